"""The documents' tables of keys and settings, generated from the code's own tables.

PROTOCOL.md (and any README or docs/ page) marks each such table as a block,
`<!-- generated: NAME -->` ... `<!-- /generated -->`; `python -m vlmq.shared.docs_tables
--write` rewrites every block from KEY_TABLE (shared/keys.py), SETTINGS
(shared/settings.py) and the item result's stored defaults (shared/messages.py), and
tests/shared/test_doc_tables.py fails while a document's block differs from what the
tables give, so a changed key or default cannot leave the document behind. The numbers
the prose quotes come from the constants that set them.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vlmq.shared import blobs, redis_checks
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.keys import KEY_TABLE
from vlmq.shared.messages import STORED_DEFAULTS

# The checkout's root: the documents are the repository's, not the installed package's.
ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- generated: {name} -->"
END = "<!-- /generated -->"
_BLOCK = re.compile(r"<!-- generated: ([a-z-]+) -->\n(.*?)" + re.escape(END), re.DOTALL)
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def documents(root: Path = ROOT) -> list[Path]:
    """Where generated (and checked) blocks may live: README.md, shared/PROTOCOL.md and
    every docs/*.md page, wherever a block has moved to."""
    return [p for p in (root / "README.md", root / "shared" / "PROTOCOL.md",
                        *sorted((root / "docs").glob("*.md"))) if p.is_file()]


def _quoted() -> dict[str, str]:
    """The numbers the key table's prose quotes, from their one definition each."""
    return {"upload_ttl": str(blobs.UPLOAD_TTL_S),
            "blob_ttl_days": str(S.BY_NAME["blob_ttl"].default // 86400),
            "keep_inputs": str(S.BY_NAME["keep_inputs"].default),
            "failure_ttl_days": str(C.FAILURE_TTL_S // 86400),
            "restart_days": str(redis_checks.RESTART_RECORD_TTL_S // 86400),
            "dead_max": f"{C.DEAD_LETTER_MAX:,}",
            "starting_ttl": str(C.WORKER_STARTING_TTL_S)}


def _fill(text: str) -> str:
    quoted = _quoted()
    return _PLACEHOLDER.sub(lambda m: quoted[m.group(1)], text)


def keys_table(section: str, writers: bool = True) -> str:
    """PROTOCOL.md's table of the keys KEY_TABLE files under `section`."""
    head = ["key", "type", *(["written by"] if writers else []), "content", "lifetime"]
    rows = [[f"`{k.shown}`", k.type, *([k.writers] if writers else []), _fill(k.content),
             _fill(k.lifetime)] for k in KEY_TABLE if k.section == section]
    return _table(head, rows)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _num(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def accepts(s: S.Setting) -> str:
    """What a payload may give for `s`, from its row's kind and bounds."""
    if s.wire_values:
        forms = [f"`{json.dumps(v)}`" for _, v in s.wire_values]
        return ", ".join(forms[:-1]) + " or " + forms[-1]
    if s.kind in ("int", "float"):
        what = "an integer" if s.kind == "int" else "a number"
        return f"{what} from {_num(s.lo or 0)} to {_num(s.hi or 0)}"
    if s.kind == "str":
        rule = f" matching `{s.pattern.pattern}`" if s.pattern is not None else ""
        return f"a string of at most {_num(s.max_len or 0)} characters{rule}"
    return _ACCEPTS[s.kind](s)


_ACCEPTS: dict[str, Callable[[S.Setting], str]] = {
    "strs": lambda s: (f"a list of up to {s.max_count} non-empty strings of at most "
                       f"{s.max_len} characters each"),
    "labels": lambda s: f"an object of up to {s.max_count} string values",
    "bool": lambda s: "`true` or `false`",
    "messages": lambda s: (f"a list of up to {s.max_count} `{{\"role\", \"content\", "
                           f"\"image\"?}}` objects (role {', '.join(s.choices)}; content at "
                           f"most {_num(s.max_len or 0)} characters; the last a user's)"),
    "schema": lambda s: (f"a JSON Schema object of at most {_num(s.max_len or 0)} bytes of "
                         "compact JSON"),
}


def default_shown(s: S.Setting) -> str:
    """The row's default as the payload carries it; what null or absence means otherwise."""
    if s.default is None or s.default in ((), {}):
        return "none"
    value: Any = s.to_wire(s.default)
    shown = f"`{json.dumps(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value % 86400 == 0:
        shown += f" ({value // 86400} days)"
    return shown


def settings_table() -> str:
    """PROTOCOL.md's table of the payload settings: every row of SETTINGS with a wire path."""
    rows = [[f"`{s.wire}`", accepts(s), default_shown(s), s.doc] for s in S.WIRE]
    return _table(["field", "accepts (or null)", "default", "meaning"], rows)


def item_defaults_table() -> str:
    """PROTOCOL.md's table of the keys a stored item result leaves out while they hold
    their default (shared/messages.py STORED_DEFAULTS)."""
    rows = [[f"`{name}`", f"`{json.dumps(default)}`"] for name, default in STORED_DEFAULTS]
    return _table(["key", "absent means"], rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "keys": lambda: keys_table("keys"),
    "rcache-keys": lambda: keys_table("rcache", writers=False),
    "settings": settings_table,
    "item-defaults": item_defaults_table,
}


def with_blocks(text: str) -> str:
    """`text` with each generated block's body replaced by the current one; a block whose
    name BLOCKS lacks is a KeyError."""
    return _BLOCK.sub(lambda m: BEGIN.format(name=m.group(1)) + "\n" + BLOCKS[m.group(1)]()
                      + "\n" + END, text)


def blocks_in(text: str) -> Iterator[str]:
    """The names of the generated blocks `text` holds."""
    return (m.group(1) for m in _BLOCK.finditer(text))


def stale(root: Path = ROOT) -> list[Path]:
    """The documents whose generated blocks differ from what the tables give now."""
    return [p for p in documents(root)
            if with_blocks(text := p.read_text(encoding="utf-8")) != text]


def main(argv: list[str]) -> int:
    """`--write`: regenerate every block; `--check`: exit 1 naming the stale documents."""
    if argv not in (["--write"], ["--check"]):
        print("usage: python -m vlmq.shared.docs_tables --write | --check", file=sys.stderr)
        return 2
    out = stale()
    for path in out:
        if argv == ["--write"]:
            path.write_text(with_blocks(path.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"rewrote {path}")
        else:
            print(f"{path} is out of date: run python -m vlmq.shared.docs_tables --write")
    return 1 if out and argv == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
