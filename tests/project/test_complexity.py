"""No function of the product code is over cyclomatic complexity 15, as radon measures it.

A function past that has several concerns tangled in one body; it is split along them (a
helper per concern, named for why), never chopped. Tests and benchmarks are not product
code and are not measured.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from radon.complexity import cc_visit
from radon.visitors import Class, Function

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("cli", "producer", "shared", "worker", "media", "stores")
MAX_COMPLEXITY = 15


def _functions(blocks: Iterable[Function | Class]) -> Iterator[Function]:
    """Every function, method and closure in radon's blocks, each once (cc_visit lists a
    class's methods both in the class and beside it; closures only in their function)."""
    seen: set[tuple[int, int, str]] = set()
    todo = list(blocks)
    while todo:
        block = todo.pop()
        if isinstance(block, Class):
            todo += [*block.methods, *block.inner_classes]
            continue
        todo += block.closures
        if (block.lineno, block.col_offset, block.name) not in seen:
            seen.add((block.lineno, block.col_offset, block.name))
            yield block


def _over(source: str) -> list[Function]:
    """The functions of `source` over the limit, in line order."""
    return sorted((f for f in _functions(cc_visit(source)) if f.complexity > MAX_COMPLEXITY),
                  key=lambda f: f.lineno)


def test_no_product_function_is_over_complexity_15() -> None:
    files = sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))
    assert len(files) > 50  # the product tree really was found
    over = [f"  {path.relative_to(ROOT).as_posix()}:{f.lineno} {f.fullname} {f.complexity}"
            for path in files for f in _over(path.read_text(encoding="utf-8"))]
    if over:
        pytest.fail(f"{len(over)} function(s) over complexity {MAX_COMPLEXITY}:\n"
                    + "\n".join(over), pytrace=False)


def _branchy(name: str, indent: int) -> str:
    """A def of complexity 17 (16 ifs), indented by `indent` spaces."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    return textwrap.indent(f"def {name}(x):\n{body}", " " * indent)


def test_methods_inner_classes_and_closures_are_measured() -> None:
    source = ("class Outer:\n"
              + _branchy("method", 4)
              + "    class Inner:\n"
              + _branchy("method", 8)
              + "def outer():\n"
              + _branchy("closure", 4)
              + "    return closure\n"
              + _branchy("flat", 0)
              + "def small(x):\n    return x\n")
    assert [f.fullname for f in _over(source)] == [
        "Outer.method", "Inner.method", "closure", "flat"]
