"""Model names a user can type: `reader` and `tiny`, beside folders and hub ids.

`--model` takes a local folder or a hub id; these names stand for the two models vlmq
has without a hub, so `vlmq worker --model reader` works from any directory. The loader
(mlx_adapter.check_local, model_folder) resolves through here, so every command that
loads a model (worker, `vlmq model check`, demo, benchmarks) reads a name the same way.
A path that exists wins over a name: a folder called `reader` in the current directory
is that folder, since a name must never hide a model the user has. Jobs, results and
caches keep the name as typed (the model id); the folder's fingerprint tells versions apart.
This module imports no MLX: the CLI's help text reads NAMES.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from vlmq.worker.model.default_dirs import default_cache_dir

READER = "reader"
TINY = "tiny"

# name -> what it is, for --model's help.
NAMES: dict[str, str] = {
    READER: "vlmq's tiny reader, shipped in the package: one line of capitals and digits "
            "on a 448 x 56 label, in its 4 training fonts only",
    TINY: "random weights, built offline into the cache dir: gibberish text",
}


def help_text() -> str:
    """The names for --model's help, with the rule that a folder of that name wins."""
    listed = "; ".join(f"{name} ({what})" for name, what in NAMES.items())
    return f"Names: {listed}. A folder of that name in the current directory wins."


def builtin(model: str) -> str | None:
    """The built-in name `model` is, or None: not a name, or a path that exists."""
    if model not in NAMES or Path(model).exists():
        return None
    return model


def tiny_dir() -> Path:
    """Where `tiny` is built: the cache dir (VLMQ_CACHE), shared by every command."""
    return default_cache_dir() / "models" / "tiny-qwen2_vl"


def resolve(model: str) -> str:
    """The folder or hub id to load `model` from: a built-in name's folder (`tiny` is
    built on first use), anything else as given."""
    name = builtin(model)
    if name == READER:
        from vlmq.worker.model import reader

        return str(reader.weights_dir())
    if name == TINY:
        return str(_build_tiny())
    return model


def _build_tiny() -> Path:
    """Build (or reuse) `tiny` under a lock: workers started together on one machine
    must not write the same files at once, or one loads the other's half-written weights."""
    from vlmq.worker.model.tiny import build_tiny_model

    folder = tiny_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".tiny-qwen2_vl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return build_tiny_model(folder)
