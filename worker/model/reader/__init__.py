"""A tiny OCR reader trained on this machine: real qwen2_vl weights that read printed text.

Every other model vlmq builds offline has random weights, so nothing that depends on
what the model *sees* (rotation, page order, scaling, the chat template) can be
tested with them. This one reads short rendered pages (`data.py` says exactly which),
so tests and the demo can measure a character error rate. `train.py` makes it;
`weights/` is the checkpoint it made, in the mlx-vlm format `mlx_vlm.load` reads.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The worker settings the reader was trained for: pages are WIDTH x HEIGHT, which
# --max-side WIDTH leaves as they are (a PDF page of that aspect renders to it).
MAX_SIDE = 448


def weights_dir() -> Path:
    """The shipped checkpoint's folder (inside the installed package)."""
    return Path(str(resources.files("vlmq.worker.model.reader").joinpath("weights")))
