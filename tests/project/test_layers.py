"""The top-level packages are layers with one direction: the CLI over the servers, the
servers over the producer library, the producer and the worker side by side over media
and stores, and the wire protocol (shared/) under everything, so that other languages can
implement it and each side installs without the other.

Every import of a vlmq module counts, at the top or inside a function, and so does an
`importlib.import_module` of a constant name. There is no list of exceptions: an import
against the table is moved, or this test fails and names it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What each top-level package may import of vlmq, besides itself.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "cli": frozenset({"server", "producer", "worker", "shared", "media", "stores"}),
    "server": frozenset({"producer", "shared", "media", "stores"}),
    "producer": frozenset({"shared", "media", "stores"}),
    "worker": frozenset({"shared", "media", "stores"}),
    "media": frozenset({"shared"}),
    "stores": frozenset({"shared"}),
    "shared": frozenset(),
    "docs": frozenset(),  # the shipped pages: no code
}
# Third-party packages a layer never imports: the wire protocol draws no CLI, opens no
# media and talks to no store; media and stores stay out of each other's libraries; the
# producer is a library that prints nothing and exits nothing (the CLI draws its progress).
NEVER: dict[str, frozenset[str]] = {
    "producer": frozenset({"click"}),
    "shared": frozenset({"click", "PIL", "boto3", "botocore", "pypdfium2", "pillow_heif"}),
    "media": frozenset({"click", "boto3", "botocore"}),
    "stores": frozenset({"click", "PIL", "pypdfium2", "pillow_heif"}),
}
# Inside the producer: producer/ops/ stands on the library, never the other way.
INNER: dict[str, str] = {"producer.ops": "producer"}


def packages() -> list[str]:
    """The top-level vlmq packages: every folder of the checkout that is a package."""
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def module_files(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(("vlmq", *(parts[:-1] if parts[-1] == "__init__" else parts))), path


def imports(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each import in the file, relative ones made absolute and
    `from vlmq import x` named vlmq.x."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base == "vlmq":
                for alias in node.names:
                    yield node.lineno, f"vlmq.{alias.name}"
            else:
                yield node.lineno, base
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def offenders(package: str) -> list[str]:
    allowed = MAY_IMPORT[package] | {package}
    never = NEVER.get(package, frozenset())
    bad = []
    for module, path in module_files(package):
        where = path.relative_to(ROOT)
        for line, name in imports(module, path):
            parts = name.split(".")
            crosses = parts[0] == "vlmq" and len(parts) > 1 and parts[1] not in allowed
            if crosses or parts[0] in never:
                bad.append(f"{where}:{line}: {package} imports {name}")
    return bad


def test_every_package_is_in_the_table() -> None:
    missing = sorted(set(packages()) - set(MAY_IMPORT))
    assert missing == [], f"add to MAY_IMPORT in {Path(__file__).name}: {missing}"
    assert "server" in packages() and "cli" in packages()


def test_the_table_has_no_cycle() -> None:
    def below(package: str) -> set[str]:
        out: set[str] = set()
        todo = list(MAY_IMPORT[package])
        while todo:
            nxt = todo.pop()
            if nxt not in out:
                out.add(nxt)
                todo.extend(MAY_IMPORT[nxt])
        return out

    cyclic = [p for p in MAY_IMPORT if p in below(p)]
    assert cyclic == [], cyclic


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_no_import_goes_against_the_table(package: str) -> None:
    bad = offenders(package)
    print("\n".join(bad))
    assert bad == [], "\n" + "\n".join(bad)


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = ("def f():\n    from vlmq.cli import common\n"
              "def g():\n    import importlib\n    importlib.import_module('vlmq.server.x')\n"
              "from .. import labels\nfrom vlmq import worker\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = sorted(name for _, name in imports("vlmq.producer.ops.mod", path))
    assert found == ["importlib", "vlmq.cli", "vlmq.producer", "vlmq.server.x",
                     "vlmq.worker"], found


def test_the_producer_library_never_imports_its_ops() -> None:
    bad = []
    for inner, outer in INNER.items():
        for module, path in module_files(outer.replace(".", "/")):
            if module.startswith(f"vlmq.{inner}.") or module == f"vlmq.{inner}":
                continue
            bad += [f"{path.relative_to(ROOT)}:{line}: {module} imports {name}"
                    for line, name in imports(module, path)
                    if name == f"vlmq.{inner}" or name.startswith(f"vlmq.{inner}.")]
    print("\n".join(bad))
    assert bad == [], "\n" + "\n".join(bad)


# Importing every module of a package in a fresh process, then listing what got loaded:
# what the static check cannot see (a module loaded through another, a lazy attribute).
_IMPORT_ALL = """
import importlib, pkgutil, sys
package, forbidden = sys.argv[1], tuple(sys.argv[2:])
walked = 0
for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
    importlib.import_module(info.name)
    walked += 1
bad = sorted(m for m in sys.modules if (m + ".").startswith(tuple(f + "." for f in forbidden)))
assert not bad, bad
print(walked)
"""


@pytest.mark.parametrize("package", ["server", "producer", "worker", "shared", "media",
                                     "stores"])
def test_importing_a_package_loads_nothing_against_the_table(package: str) -> None:
    forbidden = [f"vlmq.{p}" for p in sorted(set(MAY_IMPORT) - MAY_IMPORT[package] - {package})
                 if p != "docs"]
    forbidden += sorted(NEVER.get(package, ()))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, f"vlmq.{package}", *forbidden],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) > 0, "the walk found no modules"
