"""Producer side of vlmq: validate inputs locally, upload blobs, enqueue, wait, read results.

Importable without MLX: producers run on machines that never load a model.
"""

from __future__ import annotations

import importlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job, JobFailed, JobNotFound, WaitTimeout
    from vlmq.producer.options import JobOptions

__all__ = ["Client", "Job", "JobFailed", "JobNotFound", "JobOptions", "WaitTimeout",
           "sample_files"]

# The names above, imported on first use (PEP 562): every `vlmq.producer.X` import runs
# this file first, and the client pulls in Pillow, PDFium and RQ, which `vlmq --help` or
# a listing command never needs.
_LAZY = {"Client": "client", "Job": "client", "JobFailed": "client",
         "JobNotFound": "client", "WaitTimeout": "client", "JobOptions": "options"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def sample_files() -> dict[str, Path]:
    """The bundled demo inputs (a 3-page PDF and 3 images), name -> path on disk; the
    reader's own pages (reader*, `vlmq demo --model reader`) are not among them."""
    root = Path(str(resources.files("vlmq.producer").joinpath("samples")))
    return {p.name: p for p in sorted(root.iterdir())
            if p.is_file() and p.name[0] != "." and not p.name.startswith("reader")}
