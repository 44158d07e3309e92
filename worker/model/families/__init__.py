"""vlmq's model families: one module per mlx-vlm model type, found by config.json's.

Each module (named after its model_type) holds everything vlmq knows about that
family: how the adapter drives it, whether its vision features can be cached, its job
defaults and checkpoint presets, and the tiny build that verifies it. Modules are
discovered, not listed, so adding a family is adding one file; names starting with
"_" hold the shared types. Pure data: importing this package imports no MLX.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from vlmq.worker.model.families._base import (
    EXTRA_STOP,
    Family,
    FamilySpec,
    Preset,
    TaskDefaults,
    TinyBuild,
)

__all__ = ["EXTRA_STOP", "FAMILIES", "Family", "FamilySpec", "Preset", "TaskDefaults",
           "TinyBuild", "discover", "find", "get", "names"]


def discover(package: str) -> dict[str, Family]:
    """Every family module of `package`, by model_type.

    A module without a `FAMILY`, or named other than its model_type, is an error at
    import: a half-made family would otherwise be skipped, or found under another
    name. Module names are unique, so model types are too.
    """
    path = importlib.import_module(package).__path__
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__name__} defines no FAMILY = Family(...)")
        if family.model_type != info.name:
            raise ValueError(f"{module.__name__} defines model type {family.model_type}; "
                             "a family module is named after its model type")
        found[family.model_type] = family
    return found


FAMILIES: Mapping[str, Family] = MappingProxyType(discover(__name__))


def names() -> tuple[str, ...]:
    """The model types vlmq serves, sorted."""
    return tuple(FAMILIES)


def find(model_type: str) -> Family | None:
    return FAMILIES.get(model_type.lower())


def get(model_type: str) -> Family:
    """The family of a model type; ValueError for one vlmq does not serve."""
    family = find(model_type)
    if family is None:
        raise ValueError(f"model type {model_type!r} is not one of vlmq's families "
                         f"({', '.join(FAMILIES)})")
    return family
