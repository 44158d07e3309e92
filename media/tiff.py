"""Multi-page TIFF: the page chain walked once, then any page opened directly.

Why: Pillow reaches frame N by following the chain of image directories (IFDs) from the
first, checking each step against a list of the offsets seen, so page N costs O(N) and a
walk of every page O(N^2) (page 100,000 of a 16 MB fax: 111 s). Reading only the chain,
two small reads per page, gives every page's directory offset in one pass (20,000 pages:
a few ms). A page is then opened as a one-page TIFF: the same bytes with the header's
first-directory offset pointing at that page and its next-page offset cut to 0. That works
because strip and tile offsets are absolute in the file, and Pillow (and libtiff, which
Pillow hands compressed pages) then reads one directory, never the chain.

The producer's checks and the worker's decode both use this module, so they agree on what
a file's pages are. Classic TIFF and BigTIFF, either byte order. The walk is bounded: at
most MAX_TIFF_PAGES pages, every directory inside the file, and a chain that comes back
to a page it passed is a loop, not an endless document.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import threading
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, TypeAlias, cast

from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# TIFF and BigTIFF in both byte orders, plus the two swapped marks Pillow also reads.
MARKS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+", b"MM*\x00", b"II\x00*")

# What a walk can read from; Python 3.10 has no collections.abc.Buffer.
Readable: TypeAlias = bytes | bytearray | memoryview | mmap.mmap
Private: TypeAlias = bytearray | mmap.mmap


class TiffError(VlmqError):
    """A TIFF's header or page chain cannot be followed. `page` is the page whose
    directory is at fault (None: the file as a whole); `problem` says what is wrong."""

    def __init__(self, page: int | None, problem: str) -> None:
        self.page = page
        self.problem = problem
        super().__init__(problem if page is None else f"page {page}: {problem}")


@dataclass(frozen=True)
class Layout:
    """Where a TIFF variant keeps things: classic (4-byte offsets) or BigTIFF (8-byte)."""

    order: str  # struct byte order: "<" (II) or ">" (MM)
    big: bool

    @property
    def head_len(self) -> int:
        return 16 if self.big else 8

    @property
    def first_at(self) -> int:
        """Where the header holds the first directory's offset."""
        return 8 if self.big else 4

    @property
    def count_fmt(self) -> str:
        return self.order + ("Q" if self.big else "H")

    @property
    def offset_fmt(self) -> str:
        return self.order + ("Q" if self.big else "I")

    @property
    def entry_size(self) -> int:
        return 20 if self.big else 12


@dataclass(frozen=True)
class Index:
    """Every page's directory offset, read once per file and kept with its bytes.

    `problem`, when set, is why the chain stops after the last page listed (a loop, a
    directory past the end of the file, more than the page limit): those pages are fine,
    the ones after cannot be reached. A checker refuses the file; a decoder serves the
    pages it has.
    """

    layout: Layout
    offsets: array[int]
    problem: TiffError | None = None

    @property
    def pages(self) -> int:
        return len(self.offsets)


def layout(buf: Readable) -> Layout:
    """The header's variant; TiffError (page None) when it is not a TIFF header."""
    head = bytes(buf[:4])
    if head not in MARKS:
        raise TiffError(None, "is not a TIFF (it does not start with a TIFF byte-order mark)")
    order = "<" if head[:2] == b"II" else ">"
    if struct.unpack_from(order + "H", head, 2)[0] != 43:
        if len(buf) < 8:
            raise TiffError(None, f"is {len(buf)} bytes, too short for a TIFF header")
        return Layout(order, big=False)
    if len(buf) < 16:
        raise TiffError(None, f"is {len(buf)} bytes, too short for a BigTIFF header")
    offset_size = struct.unpack_from(order + "H", buf, 4)[0]
    if offset_size != 8:
        raise TiffError(None, f"is a BigTIFF with {offset_size}-byte offsets (8 expected)")
    return Layout(order, big=True)


def _directory(buf: Readable, lay: Layout, at: int, page: int) -> tuple[int, int]:
    """(where page's next-page offset is stored, that offset), checking that the whole
    directory at `at` lies inside the file."""
    size = len(buf)
    count_size = 8 if lay.big else 2
    if at < lay.head_len or at + count_size > size:
        raise TiffError(page, f"its directory offset {at} lies outside the file "
                              f"({size} bytes)")
    (entries,) = struct.unpack_from(lay.count_fmt, buf, at)
    ptr = at + count_size + entries * lay.entry_size
    if ptr + (8 if lay.big else 4) > size:
        raise TiffError(page, f"its directory ({entries} entries at byte {at}) runs past "
                              f"the end of the file ({size} bytes)")
    return ptr, int(struct.unpack_from(lay.offset_fmt, buf, ptr)[0])


def walk(buf: Readable, *, max_pages: int = C.MAX_TIFF_PAGES) -> Index:
    """The page index of the TIFF in `buf`: two small reads per page, nothing decoded.

    TiffError when not even page 1 can be reached; a chain broken later is the index's
    `problem`, so that the pages before the break stay readable.
    """
    lay = layout(buf)
    at = int(struct.unpack_from(lay.offset_fmt, buf, lay.first_at)[0])
    if at == 0:
        raise TiffError(None, "has no pages (its header's first-page offset is 0)")
    offsets: array[int] = array("Q")
    seen: set[int] = set()
    problem: TiffError | None = None
    while at:
        page = len(offsets) + 1
        if page > max_pages:
            problem = TiffError(None, f"has more than {max_pages} pages")
            break
        if at in seen:
            problem = TiffError(page - 1, "its next-page offset loops back to page "
                                          f"{offsets.index(at) + 1} (a corrupt page chain)")
            break
        try:
            _, nxt = _directory(buf, lay, at, page)
        except TiffError as exc:
            if page == 1:
                raise
            problem = exc
            break
        seen.add(at)
        offsets.append(at)
        at = nxt
    return Index(lay, offsets, problem)


class PageFile(io.RawIOBase):
    """A read-only file over a buffer, for Pillow to open.

    It has getvalue(), as io.BytesIO does: Pillow then hands libtiff (which decodes every
    compressed page) the buffer itself. Without it Pillow reads the whole file into a new
    bytes object for each page decoded, a copy of the file per page.
    """

    def __init__(self, buf: Private) -> None:
        super().__init__()
        self._buf = buf
        self._view = memoryview(buf)  # slices of it copy nothing
        self._pos = 0

    def close(self) -> None:
        self._view.release()
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._check_open()
        out = memoryview(buffer).cast("B")
        chunk = self._view[self._pos:self._pos + len(out)]
        out[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def getvalue(self) -> Private:
        self._check_open()
        return self._buf

    def _check_open(self) -> None:
        if self.closed:  # the page's patches are undone: its bytes are not this page's now
            raise ValueError("I/O operation on a closed TIFF page file")


def private_copy(data: bytes | IO[bytes]) -> Private:
    """The TIFF's bytes where only this process writes: a private mapping of a file (the
    kernel copies just the pages written, the few header bytes a page open patches) or a
    copy of bytes. A file must be this process's own (a spooled copy): a mapping of a file
    that someone else truncates faults on the next read."""
    if isinstance(data, bytes):
        return bytearray(data)
    try:
        fd = data.fileno()
    except (OSError, ValueError):  # in memory (io.BytesIO): no descriptor to map
        data.seek(0)
        return bytearray(data.read())
    if os.fstat(fd).st_size == 0:
        return bytearray()
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


class Document:
    """A TIFF opened for page access: its bytes (private_copy) and its page index.

    Thread-safe. A page open patches the document's own buffer (header and one next-page
    offset) and restores it after, so pages of one document open one at a time.
    """

    def __init__(self, data: bytes | IO[bytes], *, max_pages: int = C.MAX_TIFF_PAGES
                 ) -> None:
        self._buf = private_copy(data)
        self.index = walk(self._buf, max_pages=max_pages)
        self._lock = threading.Lock()

    @property
    def pages(self) -> int:
        return self.index.pages

    @property
    def nbytes(self) -> int:
        return len(self._buf)

    @contextmanager
    def page(self, n: int) -> Iterator[IO[bytes]]:
        """Page `n` (1-based, within `pages`) as a one-page TIFF file, valid inside the
        block only."""
        if not 1 <= n <= self.pages:
            raise ValueError(f"page {n} is not among the {self.pages} pages indexed")
        lay, at = self.index.layout, int(self.index.offsets[n - 1])
        with self._lock:
            ptr, _ = _directory(self._buf, lay, at, n)
            patches = [(lay.first_at, struct.pack(lay.offset_fmt, at)),
                       (ptr, bytes(8 if lay.big else 4))]
            saved = [(pos, bytes(self._buf[pos:pos + len(new)])) for pos, new in patches]
            for pos, new in patches:
                self._buf[pos:pos + len(new)] = new
            view = PageFile(self._buf)
            try:
                yield cast(IO[bytes], view)  # a RawIOBase: typeshed does not call that IO
            finally:
                view.close()
                for pos, old in saved:
                    self._buf[pos:pos + len(old)] = old
