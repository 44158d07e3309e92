"""Which files in a folder vlmq's export wrote: the per-folder manifest both sides read.

Export (producer/ops/export.py) writes it and overwrites only files it names with an unchanged
sha256; enqueue (producer/expand.py) skips only the files it names as sidecars. It lives
apart from both so inputs need not import export's formats (and the client they import).
"""

from __future__ import annotations

import json
import os
import stat

# Per folder: {"v": 1, "files": {name: sha256}} of the files vlmq wrote there.
MANIFEST_NAME = ".vlmq-written.json"
# A manifest bigger than this is not vlmq's (a folder of 100k sidecars is ~10 MB).
MANIFEST_MAX = 64 * 1024 * 1024


def read_manifest_at(dir_fd: int) -> dict[str, str]:
    """The names vlmq wrote in this folder, with their sha256; {} when there is no
    manifest or it is not one vlmq wrote (then nothing there counts as vlmq's own)."""
    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size > MANIFEST_MAX:
            return {}
        with os.fdopen(os.dup(fd), "rb") as fh:
            return parse_manifest(fh.read())
    except OSError:
        return {}
    finally:
        os.close(fd)


def parse_manifest(raw: bytes) -> dict[str, str]:
    """A manifest's {name: sha256}; {} for anything that is not a manifest vlmq wrote."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)}


def written_by_vlmq(folder: str) -> set[str]:
    """Names in folder that vlmq's export wrote (enqueue skips these as sidecars)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return set()
    try:
        return set(read_manifest_at(fd))
    finally:
        os.close(fd)
