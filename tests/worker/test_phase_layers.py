"""The worker's phases are layers with one direction (worker/loop.py says why): every import
of a worker module, at the top or inside a function, goes to its own layer or one below.
There is no list of exceptions: an import against the direction is moved or the test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[2] / "worker"

# Top to bottom. A layer may import itself and the layers listed for it, never one above.
ORDER = ("orchestration", "results", "prep", "jobs", "common", "engine", "model")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "orchestration": frozenset(ORDER),
    "results": frozenset({"results", "prep", "jobs", "common", "engine", "model"}),
    "prep": frozenset({"prep", "jobs", "common", "engine", "model"}),
    "jobs": frozenset({"jobs", "common", "engine", "model"}),
    "common": frozenset({"common", "engine", "model"}),
    "engine": frozenset({"engine", "model"}),
    "model": frozenset({"model"}),
}
# The phase packages: every module under one belongs to that layer.
PACKAGES = {"results": "results", "prep": "prep", "jobs": "jobs", "engine": "engine",
            "model": "model"}
# The modules beside loop.py, by name.
TOP = {
    "loop": "orchestration", "collect": "orchestration", "upkeep": "orchestration",
    "job_start": "orchestration", "metrics": "orchestration", "redis_server": "orchestration",
    "__init__": "common", "config": "common", "options": "common", "events": "common",
    "stats": "common", "task": "common", "job_settings": "common",
    "item_order": "common",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(WORKER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("vlmq", "worker", *parts))


def worker_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(WORKER.rglob("*.py"))
            if "__pycache__" not in p.parts}


def layer_of(module: str) -> str | None:
    rest = module.split(".")[2:]
    if not rest:
        return TOP["__init__"]
    if len(rest) == 1 and (WORKER / f"{rest[0]}.py").is_file():
        return TOP.get(rest[0])
    return PACKAGES.get(rest[0])


def imported(module: str, is_package: bool, source: str, known: set[str]) -> list[str]:
    """The worker modules `source` imports, each named as precisely as the module index
    allows: `from vlmq.worker.prep import decode` is vlmq.worker.prep.decode."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            out.extend(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names)
    return [m for m in out if m == "vlmq.worker" or m.startswith("vlmq.worker.")]


def offenders(module: str, is_package: bool, source: str, known: set[str]) -> list[str]:
    mine = layer_of(module)
    assert mine is not None, module
    bad = []
    for target in imported(module, is_package, source, known):
        theirs = layer_of(target)
        if target not in known or theirs is None or theirs not in MAY_IMPORT[mine]:
            bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def test_the_table_is_one_direction() -> None:
    assert set(MAY_IMPORT) == set(ORDER)
    for i, layer in enumerate(ORDER):
        assert MAY_IMPORT[layer] == frozenset(ORDER[i:]), layer


def test_every_worker_module_has_a_layer() -> None:
    unassigned = [m for m in worker_modules() if layer_of(m) is None]
    assert unassigned == [], f"assign a layer in {Path(__file__).name}: {unassigned}"


def test_no_import_goes_up_a_layer() -> None:
    modules = worker_modules()
    known = set(modules)
    bad: list[str] = []
    for module, path in modules.items():
        if layer_of(module) is not None:
            bad += offenders(module, path.name == "__init__.py", path.read_text(), known)
    print("\n".join(bad))
    assert len(bad) == 0, "\n".join(bad)


@pytest.mark.parametrize(("module", "source"), [
    ("vlmq.worker.model.tiny", "from vlmq.worker.engine import batcher"),
    ("vlmq.worker.engine.batcher", "def f() -> None:\n    import vlmq.worker.item_order\n"),
    ("vlmq.worker.jobs.taking", "from vlmq.worker.results.writer import ResultWriter"),
    ("vlmq.worker.item_order", "from .prep import decode"),
    ("vlmq.worker.prep.stage", "from vlmq.worker.scratch import running"),
])
def test_an_upward_or_unknown_import_is_caught(module: str, source: str) -> None:
    assert len(offenders(module, False, source, set(worker_modules()))) == 1


def test_a_new_module_without_a_layer_is_caught() -> None:
    assert layer_of("vlmq.worker.scratch") is None
    assert layer_of("vlmq.worker.scratch.taking") is None
    assert layer_of("vlmq.worker.jobs.taking") == "jobs"
