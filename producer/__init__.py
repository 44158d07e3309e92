"""Producer side of vlmq: validate inputs locally, upload blobs, enqueue, wait, read results.

Importable without MLX: producers run on machines that never load a model.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from vlmq.producer.client import Client, Job, JobFailed, JobNotFound, WaitTimeout
from vlmq.producer.options import JobOptions

__all__ = ["Client", "Job", "JobFailed", "JobNotFound", "JobOptions", "WaitTimeout",
           "sample_files"]


def sample_files() -> dict[str, Path]:
    """The bundled demo inputs (a 3-page PDF and 3 images), name -> path on disk."""
    root = Path(str(resources.files("vlmq.producer").joinpath("samples")))
    return {p.name: p for p in sorted(root.iterdir()) if p.is_file() and p.name[0] != "."}
