"""One input file, local or in a store, read and checked by content (media/checks.py):
what it is, how many pages, its sha256, and where its bytes are for the upload.

Holding where the bytes are instead of the bytes keeps a 10,000-photo set at a few MB of
RAM: a file is read again at upload, and its hash proves it is still what was checked.
"""

from __future__ import annotations

import os
import stat as stat_mod
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from vlmq.media.checks import PDF_HEADER_WINDOW, PDF_MAGIC, check_content, is_tiff, refusal
from vlmq.producer.expand import S3_SCHEME, FoundFile, no_store
from vlmq.shared import constants as C
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.errors import InputError
from vlmq.shared.messages import Ref
from vlmq.stores.backends import (
    FolderStore,
    Store,
    StoreError,
    StoreMissing,
    Stores,
    hash_stream,
)

# An S3 object is hashed once on its way into this spool, then checked from it: in memory
# while small, on disk past this.
SPOOL_BYTES = 16 * 1024 * 1024
# A referenced file up to this size is read whole, hashed and checked from memory (one read);
# a larger one is hashed as a stream, then checked from the file.
SMALL_REF_BYTES = 4 * 1024 * 1024
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class BlobSource:
    """Where one distinct input's bytes are, and what they were when validated.

    Holding this instead of the bytes keeps a 10,000-photo set at a few MB of RAM: the
    file is read again at upload, and the hash proves it is still what was checked.
    """

    path: Path
    source: str
    sha256: str
    size: int

    def read_verified(self) -> bytes:
        """The file's bytes, refused (InputError) if they changed since validation."""
        changed = "changed since it was validated; enqueue it again"
        try:
            size = self.path.stat().st_size
            if size != self.size:  # cheap, and spares reading a file that grew huge
                raise InputError(self.source, f"{changed} (size {self.size} -> {size} bytes)")
            data = self.path.read_bytes()
        except OSError as exc:
            raise InputError(self.source, f"cannot be read for upload: "
                                          f"{exc.strerror or exc}") from exc
        if sha256_hex(data) != self.sha256:
            raise InputError(self.source, f"{changed} (its sha256 differs)")
        return data


@dataclass(frozen=True)
class CheckedFile:
    """One input file whose content has been verified; its bytes are not kept."""

    path: Path | str  # a reference's as given (str); an upload's as read (Path)
    source: str
    kind: str  # "pdf" | "tiff" | "image"
    pages: int  # page count of a PDF or TIFF (C.PAGED_KINDS); 1 for an image
    sha256: str
    size: int
    ref: Ref | None = None  # where it is, when it lies in a store: enqueued by reference

    def blob(self) -> BlobSource:
        return BlobSource(path=Path(self.path), source=self.source, sha256=self.sha256,
                          size=self.size)


def _read(path: Path, source: str) -> bytes:
    if not path.exists():
        raise InputError(source, "no such file")
    if path.is_dir():
        raise InputError(source, "is a directory (pass --recursive, or list its files)")
    if not path.is_file():
        raise InputError(source, "is not a regular file")
    try:
        size = path.stat().st_size
        if size > C.BLOB_MAX_BYTES:
            with path.open("rb") as fh:
                head = fh.read(PDF_HEADER_WINDOW)
                problem = refusal(source, _too_big(size, is_pdf=PDF_MAGIC in head), head, fh)
            raise problem
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(source, f"cannot be read: {exc.strerror or exc}") from exc
    if not data:
        raise refusal(source, "is empty", b"")
    return data


def _too_big(size: int, *, is_pdf: bool) -> str:
    """A PDF is one blob however few pages are wanted, so --pages cannot help: say so."""
    limit = C.BLOB_MAX_BYTES
    head = f"is {size} bytes, over the {limit // (1024 * 1024)} MiB ({limit}-byte) blob limit"
    if is_pdf:
        return f"{head}; split it into smaller PDFs"
    return f"{head}; recompress or downscale it"


def check_file(path: str | os.PathLike[str], *, source: str | None = None) -> CheckedFile:
    """Verify one file by content; raises InputError naming the file and the problem."""
    p = Path(path)
    name = source if source is not None else str(path)
    data = _read(p, name)
    kind, pages = check_content(data, data[:PDF_HEADER_WINDOW], name)
    return CheckedFile(path=p, source=name, kind=kind, pages=pages, sha256=sha256_hex(data),
                       size=len(data))


def check_stored(store: Store, path: str, source: str, *, name: str | None = None
                 ) -> CheckedFile:
    """A file in a store, checked by content as check_file does, as a reference.

    It is streamed: hashed in chunks, then PDFium and Pillow read the file itself (an S3
    object, or a TIFF, from a copy of its own: see _hashed), so memory stays bounded
    whatever the size. Errors name the file as `name` (default: the source). The content
    check is check_content's light one (thorough=False): a reference is not uploaded, and
    the worker decodes it anyway.
    """
    shown = name if name is not None else source
    try:
        with store.open(path) as raw:
            kind, pages, sha, size = _check_stream(raw, shown)
    except StoreMissing as exc:
        raise InputError(shown, f"no such file ({exc})") from exc
    except StoreError as exc:
        raise InputError(shown, str(exc)) from exc
    except OSError as exc:
        raise InputError(shown, f"cannot be read: {exc.strerror or exc}") from exc
    return CheckedFile(path=Path(shown), source=source, kind=kind, pages=pages, sha256=sha,
                       size=size, ref=Ref(store.name, path))


def _check_stream(raw: IO[bytes], shown: str) -> tuple[str, int, str, int]:
    """(kind, pages, sha256, size) of an open referenced file, hashed as a stream."""
    with _hashed(raw) as (fh, sha, size):
        if not size:
            raise refusal(shown, "is empty", b"")
        fh.seek(0)
        head = fh.read(PDF_HEADER_WINDOW)
        fh.seek(0)
        kind, pages = check_content(fh, head, shown, thorough=False)
    return kind, pages, sha, size


class LocalStores:
    """The folder stores of `stores`, their roots resolved once for a whole set (not once
    per file and store), innermost first: the first root holding a file names its ref.
    The last folder looked up is kept, so the files of one folder cost a string compare."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores
        roots = [(s.real_root(), s) for s in stores if isinstance(s, FolderStore)]
        self.roots = sorted(((os.path.join(r, ""), s) for r, s in roots),
                            key=lambda r: -len(r[0]))
        self._last: tuple[str | None, tuple[FolderStore, str] | None] = (None, None)

    def ref_for(self, real: str) -> tuple[FolderStore, str] | None:
        """(store, path in it) for a resolved local path inside one of the stores."""
        folder, sep, name = real.rpartition(os.sep)
        if folder != self._last[0]:
            self._last = (folder, self._folder_ref(folder + sep))
        at = self._last[1]
        return None if at is None else (at[0], at[1] + name)

    def _folder_ref(self, head: str) -> tuple[FolderStore, str] | None:
        """(store, the folder's path in it with its trailing /) for a resolved folder path
        with its separator."""
        for root, store in self.roots:
            if head.startswith(root):
                rel = head[len(root):]
                return store, rel.replace(os.sep, "/") if os.sep != "/" else rel
        return None


def _check_local_ref(found: FoundFile, real: str, store: FolderStore, rel: str
                     ) -> CheckedFile | None:
    """A file in a folder store, by its resolved path: opened once (no symlink followed:
    it is resolved already), read whole when small: four system calls. None when it is not
    a regular file (check_file then says what it is), as Stores would refuse it."""
    shown = found.path
    if not rel or rel.endswith("/"):
        return None  # the store's root itself, or a folder
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError:
        return None  # gone, or a symlink swapped in since it was resolved: check_file says
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            return None
        # A small file in one read of its own size (a buffered read of SMALL_REF_BYTES
        # would allocate that much per file); one that grew meanwhile is streamed.
        data = os.read(fd, st.st_size + 1) if st.st_size <= SMALL_REF_BYTES else None
        if data is not None and not data:
            raise refusal(shown, "is empty", b"")
        if data is not None and len(data) <= st.st_size:
            kind, pages = check_content(data, data[:PDF_HEADER_WINDOW], shown,
                                        thorough=False)
            sha, size = sha256_hex(data), len(data)
        else:
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as fh:
                fh.seek(0)
                kind, pages, sha, size = _check_stream(fh, shown)
    except StoreError as exc:
        raise InputError(shown, str(exc)) from exc
    except OSError as exc:
        raise InputError(shown, f"cannot be read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    # The path as given, unparsed: a reference's is only shown, and Path() costs as much
    # as the rest of a small file's check. Positional: a million files make a million.
    return CheckedFile(shown, found.source, kind, pages, sha, size, Ref(store.name, rel))


@contextmanager
def _hashed(raw: IO[bytes]) -> Iterator[tuple[IO[bytes], str, int]]:
    """(what to check the file's content from, its sha256, its size), hashed in chunks.

    A stream that cannot seek (S3) is spooled, to memory while small, to disk past
    SPOOL_BYTES. A TIFF is copied too: its checker maps the file's pages into memory, and
    a mapping of someone else's file faults if the file is cut meanwhile. Anything else
    is read in place.
    """
    seekable = raw.seekable()
    if seekable:
        head = raw.read(4)  # a TIFF byte-order mark
        raw.seek(0)
        if not is_tiff(head):
            yield (raw, *hash_stream(raw))
            return
    with (tempfile.TemporaryFile(prefix="vlmq-tiff-") if seekable
          else tempfile.SpooledTemporaryFile(SPOOL_BYTES)) as sink:
        sha, size = hash_stream(raw, sink=sink)
        yield sink, sha, size


def check_found(found: FoundFile, stores: Stores, local: LocalStores | None = None
                ) -> CheckedFile:
    """One found input, checked: by reference when it lies in one of `stores` (an
    s3:// source always does), else as an upload. Errors name it as found. `local`: the
    stores' folder roots resolved once for the set (with `found.real`, a folder store's
    file costs no further path resolution)."""
    if found.path.startswith(S3_SCHEME):
        hit = stores.for_url(found.path)
        if hit is None:
            raise InputError(found.path, no_store(found.path))
        return check_stored(hit[0], hit[1], found.source, name=found.path)
    if stores and local is not None:
        real = found.real if found.real is not None else os.path.realpath(found.path)
        at = local.ref_for(real)
        checked = _check_local_ref(found, real, *at) if at is not None else None
        return checked if checked is not None else replace(check_file(found.path),
                                                           source=found.source)
    ref = stores.ref_for_path(found.path) if stores else None
    if ref is not None and os.path.isfile(found.path):
        return check_stored(stores.get(ref.store), ref.path, found.source, name=found.path)
    return replace(check_file(found.path), source=found.source)
