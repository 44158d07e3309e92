"""Where the worker keeps files by default (caches, built models)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """VLMQ_CACHE, else $XDG_CACHE_HOME/vlmq, else ~/.cache/vlmq."""
    if os.environ.get("VLMQ_CACHE"):
        return Path(os.environ["VLMQ_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vlmq"
