"""Local input validation: every problem is found here, before one byte reaches Redis.

A bulk job that fails on page 4,000 of a worker's queue because one scan was truncated
costs hours; the producer is the cheap place to refuse it. Types are decided by content,
never by file name, since scans arrive with whatever extension the scanner chose.
"""

from __future__ import annotations

import glob
import io
import os
import re
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import pypdfium2 as pdfium
from PIL import Image, UnidentifiedImageError

from vlmq.media import formats as image_formats
from vlmq.media import tiff as TIFF
from vlmq.media.pdfium import PDFIUM_LOCK, open_problem
from vlmq.producer.ops.export_ledger import (
    MANIFEST_MAX,
    MANIFEST_NAME,
    parse_manifest,
    written_by_vlmq,
)
from vlmq.shared import constants as C
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.errors import InputError
from vlmq.shared.messages import Item, Ref
from vlmq.stores.backends import S3Store, Store, StoreError, StoreMissing, Stores, hash_stream

PDF_MAGIC = b"%PDF-"
# The PDF spec lets the header sit anywhere in the first 1024 bytes (PDFium agrees).
PDF_HEADER_WINDOW = 1024
# TIFF and BigTIFF, little- and big-endian, plus the two swapped marks Pillow also reads.
TIFF_MAGICS = TIFF.MARKS
# A TIFF's pages become items; the payload's page numbers stop here (shared/messages.py).
MAX_TIFF_PAGES = C.MAX_TIFF_PAGES
_GLOB_CHARS = re.compile(r"[*?\[]")
_RANGE_PART = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")

PageSpec = str | Sequence[int] | None
# An S3 object is hashed once on its way into this spool, then checked from it: in memory
# while small, on disk past this.
SPOOL_BYTES = 16 * 1024 * 1024
S3_SCHEME = "s3://"


class InputErrors(InputError):
    """Several files are bad; raised once with all of them so the user fixes the set in one go."""

    def __init__(self, errors: Sequence[InputError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  {e.path}: {e.problem}" for e in self.errors)
        super().__init__(f"{len(self.errors)} file(s)", f"rejected:\n{lines}")

    def __str__(self) -> str:
        return f"{len(self.errors)} bad input file(s):\n" + "\n".join(
            f"  {e.path}: {e.problem}" for e in self.errors)


class PagesWithoutPdf(InputError):
    """A page range was given but no input has pages (a PDF or a TIFF): it would select
    nothing, silently."""

    def __init__(self, option: str = "pages") -> None:
        self.option = option
        super().__init__(option, "applies to PDFs and multi-page TIFFs, and none of the "
                                 "inputs is one")

    def __str__(self) -> str:
        return f"{self.option} {self.problem}"


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

    path: Path
    source: str
    kind: str  # "pdf" | "tiff" | "image"
    pages: int  # page count of a PDF or TIFF (C.PAGED_KINDS); 1 for an image
    sha256: str
    size: int
    ref: Ref | None = None  # where it is, when it lies in a store: enqueued by reference

    def blob(self) -> BlobSource:
        return BlobSource(path=self.path, source=self.source, sha256=self.sha256,
                          size=self.size)


@dataclass
class Prepared:
    """Items ready for a payload (uploads and references), the distinct blobs the uploads
    need, and what was left out."""

    items: list[Item] = field(default_factory=list)
    blobs: dict[str, BlobSource] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def add(self, checked: CheckedFile, pages: Iterable[int | None], *,
            custom_id: str | None = None) -> None:
        if checked.ref is not None:
            for page in pages:
                self.items.append(Item(kind=checked.kind, blob=None, source=checked.source,
                                       page=page, custom_id=custom_id, ref=checked.ref,
                                       size=checked.size, ref_sha256=checked.sha256))
            return
        self.blobs.setdefault(checked.sha256, checked.blob())
        for page in pages:
            self.items.append(Item(kind=checked.kind, blob=checked.sha256,
                                   source=checked.source, page=page, custom_id=custom_id))

    def by_reference(self, stores: Stores) -> Prepared:
        """The same items, those whose file lies in one of `stores` as references (the
        rest stay uploads): for sets checked as uploads first, such as a manifest."""
        if not stores:
            return self
        out = Prepared(rejected=list(self.rejected))
        refs: dict[str, tuple[Ref, int]] = {}
        for sha, src in self.blobs.items():
            ref = stores.ref_for_path(src.path)
            if ref is not None:
                refs[sha] = (ref, src.size)
            else:
                out.blobs[sha] = src
        for item in self.items:
            hit = refs.get(item.sha256) if item.blob is not None else None
            out.items.append(item if hit is None else replace(
                item, blob=None, ref=hit[0], size=hit[1], ref_sha256=item.blob))
        return out


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
            raise InputError(source, _too_big(size, is_pdf=PDF_MAGIC in head))
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(source, f"cannot be read: {exc.strerror or exc}") from exc
    if not data:
        raise InputError(source, "is empty")
    return data


def _too_big(size: int, *, is_pdf: bool) -> str:
    """A PDF is one blob however few pages are wanted, so --pages cannot help: say so."""
    limit = C.BLOB_MAX_BYTES
    head = f"is {size} bytes, over the {limit // (1024 * 1024)} MiB ({limit}-byte) blob limit"
    if is_pdf:
        return f"{head}; split it into smaller PDFs"
    return f"{head}; recompress or downscale it"


def _pdf_page_count(data: bytes | IO[bytes], source: str) -> int:
    """Pages of a PDF given as bytes, or as a seekable file PDFium reads as it needs."""
    with PDFIUM_LOCK:
        try:
            doc = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            if not isinstance(data, bytes):  # the failure path only: the head tells why
                data.seek(0)
                data = data.read(C.BLOB_MAX_BYTES)
            raise InputError(source, open_problem(exc, data)) from exc
        try:
            count = len(doc)
        finally:
            doc.close()
    if count < 1:
        raise InputError(source, "is a PDF with no pages")
    return count


def _stream(data: bytes | IO[bytes]) -> IO[bytes]:
    if isinstance(data, bytes):
        return io.BytesIO(data)
    data.seek(0)
    return data


def _check_image(data: bytes | IO[bytes], source: str) -> None:
    """Open lazily, refuse by header size before decoding, then decode to catch truncation."""
    limit = C.MAX_IMAGE_PIXELS
    too_big = f"image is larger than the {limit}-pixel limit (possible decompression bomb)"
    image_formats.register_plugins()  # HEIC/HEIF (pillow-heif), before the first open
    try:
        with warnings.catch_warnings():
            # Pillow warns (then errors) on huge images from inside Image.open; turn the
            # warning into an exception here so it is a rejection, not noise.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(_stream(data)) as im:
                width, height = im.size
                if width * height > limit:
                    raise InputError(source, f"{too_big}: {width}x{height}")
                ratio = max(width, height) / max(1, min(width, height))
                if ratio >= C.MAX_ASPECT_RATIO:  # the worker's vision processor refuses it
                    raise InputError(source, f"image is {width}x{height}, an aspect ratio of "
                                             f"{ratio:.1f}; the vision processor needs it "
                                             f"under {C.MAX_ASPECT_RATIO}")
                im.verify()  # checksums (PNG CRCs); cheap, no pixel decode
            with Image.open(_stream(data)) as im:
                # JPEG can decode at 1/8 scale: still reads every byte, so a truncated file
                # fails, at a fraction of the cost of a full decode.
                im.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InputError(source, f"{too_big} ({exc})") from exc
    except UnidentifiedImageError as exc:
        # Name the format from its magic bytes where it is known (JPEG XL, DjVu, SVG...).
        head = _stream(data).read(image_formats.HEAD_BYTES)
        raise InputError(source, image_formats.unreadable_problem(head)) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # Pillow reports truncation/corruption with these, depending on the codec
        # (libheif's messages end in a newline).
        raise InputError(source, f"is a corrupt or truncated image ({str(exc).strip()})"
                         ) from exc


def is_tiff(head: bytes) -> bool:
    """A TIFF or BigTIFF, by its first four bytes (every byte-order mark Pillow accepts)."""
    return head[:4] in TIFF_MAGICS


def _check_tiff(data: bytes | IO[bytes], source: str) -> int:
    """Check every page (frame) of a TIFF, one at a time; returns the page count.

    A TIFF is a document, each page an item, so each page is checked as an image is: its
    header size against the pixel limit before any decode (a bomb can hide in page 40 of a
    fax), its aspect ratio, then a full decode to catch truncation. The page chain is
    walked once (media/tiff.py) and each page opened directly, so every page costs what
    page 1 does (Pillow's own seek walks the chain again: O(N^2) over a file). A loop in
    the chain, a directory past the end of the file or more than MAX_TIFF_PAGES pages
    refuses the file. Memory is one page's however many pages there are (a file must be
    the caller's own copy: its pages are mapped). Errors name the page.
    """
    try:
        doc = TIFF.Document(data)
    except TIFF.TiffError as exc:
        raise InputError(source, _tiff_problem(exc)) from exc
    if doc.index.problem is not None:
        raise InputError(source, _tiff_problem(doc.index.problem))
    page = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # Pillow only warns when a page's directory runs past the end of the file:
            # that is a truncated file, refused like any other.
            for message in ("Corrupt EXIF data", "Truncated File Read"):
                warnings.filterwarnings("error", message=message, category=UserWarning)
            for page in range(1, doc.pages + 1):
                with doc.page(page) as fp, Image.open(fp, formats=["TIFF"]) as im:
                    _check_tiff_page(im, source, page)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InputError(source, f"page {page}: image is larger than the "
                                 f"{C.MAX_IMAGE_PIXELS}-pixel limit (possible "
                                 f"decompression bomb) ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise InputError(source, f"page {page}: starts like a TIFF but Pillow cannot read "
                                 "it") from exc
    except (OSError, SyntaxError, ValueError, EOFError, TypeError, KeyError, IndexError,
            struct.error, UserWarning) as exc:
        # Pillow reports a corrupt directory or truncated strip with any of these.
        raise InputError(source, f"page {page}: is a corrupt or truncated TIFF page "
                                 f"({exc})") from exc
    return doc.pages


def _tiff_problem(exc: TIFF.TiffError) -> str:
    if exc.page is None:
        return exc.problem
    return f"page {exc.page}: is a corrupt or truncated TIFF page ({exc.problem})"


def _check_tiff_page(im: Image.Image, source: str, page: int) -> None:
    """The current frame of an open TIFF: size and aspect from its header, then decoded."""
    width, height = im.size
    if width < 1 or height < 1:
        raise InputError(source, f"page {page}: has an empty size ({width}x{height})")
    if width * height > C.MAX_IMAGE_PIXELS:
        raise InputError(source, f"page {page}: image is larger than the "
                                 f"{C.MAX_IMAGE_PIXELS}-pixel limit (possible decompression "
                                 f"bomb): {width}x{height}")
    ratio = max(width, height) / min(width, height)
    if ratio >= C.MAX_ASPECT_RATIO:
        raise InputError(source, f"page {page}: is {width}x{height}, an aspect ratio of "
                                 f"{ratio:.1f}; the vision processor needs it under "
                                 f"{C.MAX_ASPECT_RATIO}")
    im.load()  # replaces the previous page's pixels: one page in memory at a time


def check_file(path: str | os.PathLike[str], *, source: str | None = None) -> CheckedFile:
    """Verify one file by content; raises InputError naming the file and the problem."""
    p = Path(path)
    name = source if source is not None else str(path)
    data = _read(p, name)
    kind, pages = _check_content(data, data[:PDF_HEADER_WINDOW], name)
    return CheckedFile(path=p, source=name, kind=kind, pages=pages, sha256=sha256_hex(data),
                       size=len(data))


def _check_content(data: bytes | IO[bytes], head: bytes, source: str) -> tuple[str, int]:
    """(kind, pages) of an input by its content (`head`: its first bytes)."""
    if PDF_MAGIC in head:
        return "pdf", _pdf_page_count(data, source)
    if is_tiff(head):
        return "tiff", _check_tiff(data, source)
    _check_image(data, source)
    return "image", 1


def check_stored(store: Store, path: str, source: str, *, name: str | None = None
                 ) -> CheckedFile:
    """A file in a store, checked by content as check_file does, as a reference.

    It is streamed: hashed in chunks, then PDFium and Pillow read the file itself (an S3
    object, or a TIFF, from a copy of its own: see _hashed), so memory stays bounded
    whatever the size. Errors name the file as `name` (default: the source).
    """
    shown = name if name is not None else source
    try:
        with store.open(path) as raw, _hashed(raw) as (fh, sha, size):
            if not size:
                raise InputError(shown, "is empty")
            fh.seek(0)
            head = fh.read(PDF_HEADER_WINDOW)
            fh.seek(0)
            kind, pages = _check_content(fh, head, shown)
    except StoreMissing as exc:
        raise InputError(shown, f"no such file ({exc})") from exc
    except StoreError as exc:
        raise InputError(shown, str(exc)) from exc
    except OSError as exc:
        raise InputError(shown, f"cannot be read: {exc.strerror or exc}") from exc
    return CheckedFile(path=Path(shown), source=source, kind=kind, pages=pages, sha256=sha,
                       size=size, ref=Ref(store.name, path))


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
        head = raw.read(len(TIFF_MAGICS[0]))
        raw.seek(0)
        if not is_tiff(head):
            yield (raw, *hash_stream(raw))
            return
    with (tempfile.TemporaryFile(prefix="vlmq-tiff-") if seekable
          else tempfile.SpooledTemporaryFile(SPOOL_BYTES)) as sink:
        sha, size = hash_stream(raw, sink=sink)
        yield sink, sha, size


def check_found(found: FoundFile, stores: Stores) -> CheckedFile:
    """One found input, checked: by reference when it lies in one of `stores` (an
    s3:// source always does), else as an upload. Errors name it as found."""
    if found.path.startswith(S3_SCHEME):
        hit = stores.for_url(found.path)
        if hit is None:
            raise InputError(found.path, _no_store(found.path))
        return check_stored(hit[0], hit[1], found.source, name=found.path)
    ref = stores.ref_for_path(found.path) if stores else None
    if ref is not None and os.path.isfile(found.path):
        return check_stored(stores.get(ref.store), ref.path, found.source, name=found.path)
    return replace(check_file(found.path), source=found.source)


def _no_store(url: str) -> str:
    return ("is in no configured store: add --store NAME=s3://bucket/prefix (or "
            f"VLMQ_STORES) for it, e.g. --store data={url.rstrip('/')}")


def parse_pages(spec: PageSpec, page_count: int, source: str) -> list[int]:
    """'1-3,7' -> [1, 2, 3, 7]: 1-based, in the order given, duplicates dropped.

    None means every page. A list of ints is checked the same way as a string. Each range
    is checked against page_count before it is expanded, so '1-300000000' is an error
    message, not a list of 300 million ints.
    """
    if spec is None:
        return list(range(1, page_count + 1))
    pages: list[int] = []
    if isinstance(spec, str):
        if not spec.strip():
            raise InputError(source, "empty page range")
        for part in spec.split(","):
            m = _RANGE_PART.fullmatch(part)
            if not m:
                raise InputError(source, f"bad page range {part.strip()!r} in {spec!r} "
                                         "(use e.g. 1-3,7)")
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if lo < 1 or hi < 1:
                raise InputError(source, f"pages are numbered from 1, got {part.strip()!r}")
            if hi < lo:
                raise InputError(source, f"bad page range {part.strip()!r}: "
                                         f"{hi} comes before {lo}")
            _check_in_range(hi, page_count, source)
            pages.extend(range(lo, hi + 1))
    else:
        for value in spec:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(source, f"page numbers must be integers, got {value!r}")
            if value < 1:
                raise InputError(source, f"pages are numbered from 1, got {value}")
            _check_in_range(value, page_count, source)
            pages.append(value)
        if not pages:
            raise InputError(source, "empty page list")
    return list(dict.fromkeys(pages))


def _check_in_range(page: int, page_count: int, source: str) -> None:
    if page > page_count:
        raise InputError(source, f"page {page} is out of range: {source} has "
                                 f"{page_count} page{'s' if page_count != 1 else ''}")


def expand_paths(paths: Iterable[str | os.PathLike[str]], *,
                 recursive: bool = False) -> tuple[list[str], list[InputError]]:
    """Files, folders and (quoted) globs -> file paths in a stable order, plus path errors."""
    found, errors = expand_sources(paths, recursive=recursive)
    return [f.path for f in found], errors


@dataclass(frozen=True)
class FoundFile:
    """A file found from what was given: its path (or s3:// URL), its source name, and
    the folder the source is relative to (the folder given, a glob's fixed part, or the
    file's own). `stamp` is "size:ETag" for an S3 object, from its listing."""

    path: str
    source: str
    root: str
    stamp: str | None = None


def expand_inputs(paths: Iterable[str | os.PathLike[str]], stores: Stores, *,
                  recursive: bool = False) -> tuple[list[FoundFile], list[InputError]]:
    """expand_sources, with s3:// sources listed through the store that holds them."""
    found: list[FoundFile] = []
    errors: list[InputError] = []
    local: list[str | os.PathLike[str]] = []

    def flush() -> None:
        files, errs = expand_sources(local, recursive=recursive)
        found.extend(files)
        errors.extend(errs)
        local.clear()

    for raw in paths:
        if not os.fspath(raw).startswith(S3_SCHEME):
            local.append(raw)
            continue
        flush()
        try:
            found.extend(_expand_url(os.fspath(raw), stores, recursive))
        except InputError as exc:
            errors.append(exc)
    flush()
    return found, errors


def _expand_url(url: str, stores: Stores, recursive: bool) -> list[FoundFile]:
    hit = stores.for_url(url)
    if hit is None:
        raise InputError(url, _no_store(url))
    store, rel = hit
    assert isinstance(store, S3Store)
    base = url.rstrip("/")
    try:
        if rel and not url.endswith("/"):
            try:
                entry = store.stat(rel)
                return [FoundFile(url, rel.rsplit("/", 1)[-1], base.rsplit("/", 1)[0],
                                  f"{entry.size}:{entry.stamp}")]
            except StoreMissing:
                pass  # perhaps a prefix: listed below
        entries = list(store.list(rel))
    except StoreError as exc:
        raise InputError(url, str(exc)) from exc
    if not entries:
        raise InputError(url, "no such object, and no objects under this prefix")
    if not recursive:
        raise InputError(url, f"is a prefix holding {len(entries)} object(s) "
                              "(pass --recursive to enqueue them)")
    head = f"{store.url}/"
    owned = _owned_in_listing(store, [e.path for e in entries])
    out = []
    for e in entries:
        if e.path in owned:
            continue
        full = head + e.path
        out.append(FoundFile(full, full[len(base) + 1:], base, f"{e.size}:{e.stamp}"))
    return out


def _owned_in_listing(store: Store, paths: list[str]) -> set[str]:
    """is_sidecar for a listing (an S3 prefix, whose listing hides dot files): the files a
    folder's manifest names (a folder exported with --sidecar, then copied to the bucket).
    Only folders holding a candidate (photo.jpg.txt beside photo.jpg) are asked for theirs,
    so a bucket of plain images costs no extra request."""
    names = set(paths)
    folders = sorted({p.rpartition("/")[0] for p in paths
                      if os.path.splitext(p)[1] in SIDECAR_SUFFIXES
                      and os.path.splitext(p)[0] in names})
    owned: set[str] = set()
    for folder in folders:
        manifest = f"{folder}/{MANIFEST_NAME}" if folder else MANIFEST_NAME
        try:
            with store.open(manifest) as fh:
                listed = parse_manifest(fh.read(MANIFEST_MAX + 1))
        except StoreMissing:
            continue
        except (StoreError, OSError) as exc:
            raise InputError(f"{store.url}/{manifest}", f"cannot read vlmq's manifest: {exc}"
                             ) from exc
        owned.update(f"{folder}/{n}" if folder else n for n in listed)
    return owned


# What `vlmq export --sidecar` writes next to an input (photo.jpg.txt, doc.pdf.md).
SIDECAR_SUFFIXES = (".txt", ".md", ".json")


def expand_sources(paths: Iterable[str | os.PathLike[str]], *, recursive: bool = False
                   ) -> tuple[list[FoundFile], list[InputError]]:
    """Like expand_paths, with each file's `source`: its path relative to what was given.

    A file in a folder given as `photos/` is `trip/day1/img_003.jpg`, a glob match is
    relative to the glob's fixed leading folders, a file named directly keeps the name
    given unless that is absolute or climbs out (`..`), then its base name. Export writes
    results under these names, so they never point outside the folder given.

    Folders contribute every non-hidden regular file, so a stray non-image in a folder of
    scans is reported rather than silently dropped; only vlmq's own sidecars are left out.
    The same file named twice is kept once.
    """
    out: list[FoundFile] = []
    errors: list[InputError] = []
    seen: set[str] = set()
    manifests: dict[str, set[str]] = {}

    def add(name: str, source: str, root: str) -> None:
        key = os.path.realpath(name)
        if key not in seen:
            seen.add(key)
            out.append(FoundFile(name, source, root))

    for raw in paths:
        name = os.fspath(raw)
        p = Path(name)
        if p.is_dir():
            found = _walk(p, recursive)
            if not found:
                errors.append(InputError(name, "folder has no files" if recursive else
                                         "folder has no files (pass --recursive to descend)"))
            for f in found:
                if not is_sidecar(f, manifests):
                    add(f, Path(os.path.relpath(f, p)).as_posix(), name)
        elif p.exists() or not _GLOB_CHARS.search(name):
            add(name, *_own_name(name))  # a missing plain path is reported by check_file
        else:
            matches = sorted(glob.glob(name, recursive=recursive or "**" in name))
            files = [m for m in matches if Path(m).is_file()]
            if not files:
                errors.append(InputError(name, "no files match this pattern"))
            base = _glob_base(name)
            for f in files:
                if not is_sidecar(f, manifests):
                    add(f, Path(os.path.relpath(f, base)).as_posix(), base)
    return out, errors


def is_sidecar(path: str, seen: dict[str, set[str]] | None = None) -> bool:
    """vlmq's own output next to an input: skipped in folders and globs, so a folder
    captioned with --sidecar can be enqueued (or scheduled) again as it is.

    Only files the folder's export manifest names count: a user's own photo.jpg.txt or
    Takeout photo.jpg.json is a file like any other. `seen` caches each folder's names.
    """
    folder, name = os.path.split(path)
    cache = {} if seen is None else seen
    if folder not in cache:
        cache[folder] = written_by_vlmq(folder)
    return name in cache[folder]


def _own_name(name: str) -> tuple[str, str]:
    """A file named directly: (source, root). The name as given, relative to the current
    folder, unless absolute or climbing out: then its base name, under its own folder."""
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        return p.name, str(p.parent)
    return p.as_posix(), "."


def _glob_base(pattern: str) -> str:
    """The folders of a glob before its first wildcard part."""
    parts = Path(pattern).parts
    fixed: list[str] = []
    for part in parts[:-1]:
        if _GLOB_CHARS.search(part):
            break
        fixed.append(part)
    return os.path.join(*fixed) if fixed else "."


def _walk(folder: Path, recursive: bool) -> list[str]:
    found: list[str] = []
    if recursive:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    else:
        found = [str(c) for c in sorted(folder.iterdir())
                 if c.is_file() and not c.name.startswith(".")]
    return found


def _check_name(found: FoundFile) -> None:
    """A name that is not UTF-8 (bytes like \\xff\\xfe, which Python keeps as lone
    surrogates) cannot travel in a JSON payload: refused here, named with its bad bytes
    escaped, so --skip-bad skips that file rather than the payload check failing the set."""
    for name in (found.path, found.source):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(found.path).decode("utf-8", "backslashreplace")
            raise InputError(shown, "file name is not valid UTF-8; rename the file") from None


def prepare(paths: Iterable[str | os.PathLike[str]], *, pages: PageSpec = None,
            recursive: bool = False, skip_bad: bool = False,
            stores: Stores | None = None,
            limit: int | None = C.MAX_ITEMS_PER_JOB,
            on_file: Callable[[int, int], None] | None = None) -> Prepared:
    """Check every file and build items: an image is one item, a PDF or TIFF one item per
    page.

    `pages` applies to each PDF and TIFF (an image is always its one page); given with
    none among the inputs it is refused (PagesWithoutPdf). All bad files are
    collected first; unless skip_bad, any bad file rejects the whole set (InputErrors).
    Files are read one at a time and only their hash kept (upload reads them again). The
    item `limit` (one job's; None for a set that becomes a batch, producer/job_sets.py) is
    enforced the moment it is passed: reading thousands more files only to refuse the set
    afterwards would waste minutes.

    Files in one of `stores` (s3:// sources always) become references: nothing of theirs
    is uploaded, and their bytes are hashed as a stream. `on_file(done, total)` is called
    after each file, for progress over a folder that takes minutes to hash.
    """
    stores = stores if stores is not None else Stores()
    found, errors = expand_inputs(paths, stores, recursive=recursive)
    prepared = Prepared()
    for done, f in enumerate(found, start=1):
        try:
            checked, page_list = _checked_pages(f, stores, pages)
        except InputError as exc:
            errors.append(exc)
            continue
        finally:
            if on_file is not None:
                on_file(done, len(found))
        prepared.add(checked, page_list)
        if limit is not None and len(prepared.items) > limit:
            raise InputError(f"{len(found)} file(s)",
                             f"the first {done} file(s) already make {len(prepared.items)} "
                             f"items, over the {limit}-item limit per job; Client.submit_set "
                             "(and `vlmq enqueue`) split a set this size into a batch of jobs")
    return _finished(prepared, errors, skip_bad=skip_bad, pages=pages)


def _checked_pages(found: FoundFile, stores: Stores, pages: PageSpec
                   ) -> tuple[CheckedFile, list[int | None]]:
    """One found file checked, with the pages of it that become items. Errors name the
    path as found; the item carries the relative source."""
    _check_name(found)
    checked = check_found(found, stores)
    if checked.kind not in C.PAGED_KINDS:
        return checked, [None]
    return checked, list(parse_pages(pages, checked.pages, found.path))


def _finished(prepared: Prepared, errors: list[InputError], *, skip_bad: bool,
              pages: PageSpec) -> Prepared:
    """The set once every file was looked at: refused whole for a bad file (unless
    skip_bad), for nothing to enqueue, or for a page range nothing has."""
    if errors and not skip_bad:
        if len(errors) == 1:
            raise errors[0]
        raise InputErrors(errors)
    prepared.rejected = [(e.path, e.problem) for e in errors]
    if not prepared.items:
        if errors:
            raise InputErrors(errors)
        raise InputError("(no files)", "nothing to enqueue")
    if pages is not None and not any(i.kind in C.PAGED_KINDS for i in prepared.items):
        # An image is always its one page, so the range would be dropped without a word;
        # more likely the user meant a different file.
        raise PagesWithoutPdf()
    return prepared
