"""A producer-only install, made from this one: with this folder first on PYTHONPATH, the
worker extra's modules (cli/worker.py's WORKER_MODULES) are found nowhere, by import and
by importlib.util.find_spec alike."""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from typing import Any

HIDDEN = frozenset({"mlx", "mlx_vlm"})


class HidingFinder:
    """One of sys.meta_path's finders, blind to HIDDEN (and their submodules)."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)  # type: ignore[no-any-return]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.finder, attr)


sys.meta_path[:] = [HidingFinder(f) for f in sys.meta_path]
