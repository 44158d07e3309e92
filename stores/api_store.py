"""Store `vlmq-api`: where `vlmq api` decodes a batch file's data: images and its workers
read them, found by one function on both sides.

The API writes the images under its files folder (default_api_files_dir, unless
--files-dir says otherwise) and its jobs reference them as store `vlmq-api`; a worker
reads that store at the same default folder unless it was given one (--store or
VLMQ_STORES). So an API and its workers started on one machine, by one user, with no
flags, agree; workers elsewhere need the folder shared and named by `--store`, which the
API prints at its start and a failed item's message names.

The images stay on disk, out of Redis: one batch file holds up to 200 MB of them, a key
may run several, and Redis memory is every tenant's, where a folder's disk is only the
API's machine's (and the per-key stored-bytes limit bounds it).
"""

from __future__ import annotations

import os
from pathlib import Path

from vlmq.shared import constants as C
from vlmq.shared.messages import Ref
from vlmq.stores.backends import (
    FolderStore,
    RefUnreadable,
    StoreError,
    Stores,
    UnknownStore,
    unreadable,
)

API_STORE = "vlmq-api"
DATA_ENV = "VLMQ_DATA"


def default_data_dir() -> Path:
    """$VLMQ_DATA, else $XDG_DATA_HOME/vlmq, else ~/.local/share/vlmq, absolute: data,
    not a cache, since a running batch's images cannot be made again."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return (base / "vlmq").absolute()


def default_api_files_dir() -> Path:
    """`vlmq api`'s --files-dir when none is given."""
    return default_data_dir() / "api"


def images_dir(files_dir: Path) -> Path:
    """The folder of store vlmq-api under an API's files folder."""
    return files_dir / "images"


def store_spec(files_dir: Path) -> str:
    """The `--store` that reads the images of an API serving `files_dir`."""
    return f"{API_STORE}={images_dir(files_dir.resolve()).as_uri()}"


def with_api_store(stores: Stores) -> Stores:
    """A worker's stores: `stores`, with store vlmq-api at this machine's default folder
    unless they name it. Nothing is created: a folder that is not there fails the items
    that need it, saying what to give (explain)."""
    if API_STORE in stores.by_name:
        return stores
    try:
        default = FolderStore(API_STORE, images_dir(default_api_files_dir()))
    except RuntimeError:  # no home folder: its items fail naming the flag instead
        return stores
    return Stores([*stores, default])


def explain(ref: Ref, exc: StoreError) -> str:
    """The item error for a reference that cannot be read: for store vlmq-api (missing
    here, or its file absent) it names the setting that fixes it; any other error (a
    changed file, a size over the limit) as it is. Never this machine's folder: the
    message goes to whoever submitted the batch."""
    message = str(exc)
    if ref.store != API_STORE:
        return message
    if not isinstance(exc, UnknownStore) and not (
            isinstance(exc, RefUnreadable) and message == unreadable(ref)):
        return message
    return (f"{message}. Store {API_STORE} is the folder `vlmq api` decodes a batch's "
            f"images into: start this worker on the API's machine as the same user (the "
            f"same ${DATA_ENV}), or give it the API's images folder, shared with this "
            f"machine, as --store {API_STORE}=file:///FILES_DIR/images (or "
            f"{C.STORES_ENV}), FILES_DIR being the API's --files-dir; `vlmq api` prints "
            f"that flag at its start. A batch that ended has its images removed")
