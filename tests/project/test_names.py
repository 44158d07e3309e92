"""Names that point at what exists: a vlmq module is imported under its own name (but for
the house few below), and no code or test names a round of work: git holds the history.

The house few are the two tables nearly every module reads, where a one-letter prefix
reads better than the module's name on every line: `constants as C` and `settings as S`
(docs/layout.md says the same).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOUSE = {("vlmq.shared", "constants"): "C", ("vlmq.shared", "settings"): "S"}
# Folders whose Python and Lua files are code or tests (docs and dated benchmark records
# may tell history).
CODE_DIRS = ("cli", "producer", "server", "shared", "worker", "media", "stores", "tests",
             "benchmarks", ".ci")
ROUND = re.compile(r"\b[Ii]ssues? #?[0-9]+")
WAS = re.compile(r"(#|--|\"\"\"|^\s).*\bwas: ")


def code_files(*suffixes: str) -> Iterator[Path]:
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in suffixes and "__pycache__" not in path.parts:
                yield path


def is_module(package: str, name: str) -> bool:
    """Whether `from package import name` names a vlmq module (a file or a folder)."""
    base = ROOT.joinpath(*package.split(".")[1:])
    return (base / f"{name}.py").is_file() or (base / name / "__init__.py").is_file()


def aliases(path: Path, source: str | None = None) -> Iterator[str]:
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.split(".")[0] == "vlmq":
                    yield f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name} as {a.asname}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vlmq":
            package = node.module or ""
            for a in node.names:
                if (a.asname and is_module(package, a.name)
                        and HOUSE.get((package, a.name)) != a.asname):
                    yield (f"{path.relative_to(ROOT)}:{node.lineno}: "
                           f"from {package} import {a.name} as {a.asname}")


def test_vlmq_modules_are_imported_under_their_own_names() -> None:
    found = [line for path in code_files(".py") for line in aliases(path)]
    assert found == []


def test_the_alias_check_sees_an_alias() -> None:
    probe = ("from vlmq.worker.prep import decode as P\n"
             "from vlmq.shared import constants as C\n"
             "from vlmq.shared import constants as K\n"
             "from vlmq.shared.keys import Keys as K2\n"  # a class, not a module
             "import vlmq.media.tiff as T\n")
    assert [line.split(": ", 1)[1] for line in aliases(ROOT / "probe.py", probe)] == [
        "from vlmq.worker.prep import decode as P",
        "from vlmq.shared import constants as K",
        "import vlmq.media.tiff as T"]


def test_no_code_or_test_names_a_round_of_work() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in code_files(".py", ".lua")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if ROUND.search(line) or WAS.search(line)]
    assert found == []
