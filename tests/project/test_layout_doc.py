"""docs/layout.md is the newcomer's map: every module of every package has its row, under
its folder's heading, and no row names a module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "server", "producer", "shared", "worker", "media", "stores")
HEADING = re.compile(r"^### `(?P<folder>[\w/]+)/`$")
ROW = re.compile(r"^\| `(?P<module>\w+\.py)` \| (?P<text>.+) \|$")


def modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES
            for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def listed(text: str) -> dict[str, str]:
    """Each module row of the page, as its path, with what the row says of it."""
    rows: dict[str, str] = {}
    folder = None
    for line in text.splitlines():
        if m := HEADING.match(line):
            folder = m["folder"]
        elif (m := ROW.match(line)) and folder is not None:
            rows[f"{folder}/{m['module']}"] = m["text"].strip()
    return rows


def test_every_module_has_its_row_and_every_row_its_module() -> None:
    rows = listed((ROOT / "docs" / "layout.md").read_text())
    assert sorted(modules() - set(rows)) == [], "modules missing from docs/layout.md"
    assert sorted(set(rows) - modules()) == [], "rows for modules that are gone"
    assert all(len(text) >= 10 for text in rows.values()), rows


def test_the_reader_sees_a_row_out_of_place() -> None:
    page = "### `worker/prep/`\n\n| module | what it holds |\n|---|---|\n" \
           "| `decode.py` | The decoders, in a thread pool |\n"
    assert listed(page) == {"worker/prep/decode.py": "The decoders, in a thread pool"}
    assert "worker/engine/decode.py" not in listed(page)
