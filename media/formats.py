"""Image formats beyond Pillow's own, and names for the ones that still cannot be read.

iPhone and Mac photo libraries are mostly HEIC, which Pillow does not read by itself:
pillow-heif (a dependency) adds it. Registration is explicit (`register_plugins()`, called
by the code that opens images, before it opens one), so importing an unrelated module never
changes what Pillow reads.

A file Pillow still cannot identify is named from its magic bytes (`describe`), so a
refusal says what the file is and what would help ("pip install pillow-jxl-plugin",
"convert it to PDF first"), after the message every such refusal has always had.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Final

from vlmq.media.tiff import MARKS

# Bytes at the start of a file that identification looks at. Enough for the ISO-BMFF brand
# list, a ZIP's first few member names, or an SVG's XML prologue and comments.
HEAD_BYTES: Final = 4096
# The message for bytes that match nothing below; it predates this module, keep it.
UNKNOWN: Final = "is neither a PDF nor an image Pillow can read"
_OPTIONAL_PLUGINS: Final = {"jxl": "pillow_jxl"}  # registers its opener on import


@dataclass(frozen=True)
class Plugins:
    """What this process can read beyond Pillow's built-in formats."""

    heif_error: str | None  # None: pillow-heif is registered; else why it is not
    jxl: bool  # pillow-jxl-plugin is installed and registered
    avif: bool  # this Pillow build reads AVIF (Pillow >= 11.3 wheels do)


_lock = threading.Lock()
_plugins: Plugins | None = None


def register_plugins() -> Plugins:
    """Register pillow-heif's opener with Pillow (and pillow-jxl-plugin where installed).

    Idempotent and cheap after the first call. A pillow-heif that fails to import is not
    an error here: HEIC files are then refused with a message that names the fix.
    """
    global _plugins
    with _lock:
        if _plugins is None:
            _plugins = _register()
        return _plugins


def _register() -> Plugins:
    from PIL import features  # here: importing this module must not import Pillow

    heif_error: str | None = None
    try:
        import pillow_heif
    except ImportError as exc:  # not installed, or its bundled libheif failed to load
        heif_error = str(exc) or type(exc).__name__
    else:
        pillow_heif.register_heif_opener()
    loaded = set()
    for name, module in _OPTIONAL_PLUGINS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue  # optional: its absence is named per file, by describe()
        loaded.add(name)
    return Plugins(heif_error=heif_error, jxl="jxl" in loaded,
                   avif=bool(features.check("avif")))


def describe(head: bytes, plugins: Plugins | None = None) -> str | None:
    """What a file starting with `head` is and what would make it readable, as a clause
    ("it is a JPEG XL image, ...; pip install ..."), or None for bytes not known here.

    For files Pillow could not identify. `plugins` defaults to this process's own
    (registered now if that was not done yet).
    """
    return _identify(head, plugins if plugins is not None else register_plugins())


def unreadable_problem(head: bytes, plugins: Plugins | None = None) -> str:
    """The producer's refusal of an unidentified file: it completes "<file>: ..."."""
    clause = describe(head, plugins)
    return UNKNOWN if clause is None else f"{UNKNOWN}: {clause}"


# -- what claims to be media ---------------------------------------------------------------

# Names that say "image" or "PDF": raster formats Pillow reads (with pillow-heif and the JPEG
# XL plugin), camera RAW, and PDF. A file named so that cannot be read is a damaged or
# unsupported picture, never a sidecar to leave out of a folder.
MEDIA_SUFFIXES: Final = frozenset((
    ".pdf", ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".gif", ".webp", ".bmp",
    ".dib", ".tif", ".tiff", ".heic", ".heif", ".hif", ".avif", ".avifs", ".jxl", ".jp2",
    ".j2k", ".jpf", ".jpx", ".j2c", ".ico", ".icns", ".cur", ".tga", ".psd", ".pcx",
    ".ppm", ".pgm", ".pbm", ".pnm", ".qoi", ".dds", ".sgi", ".xbm", ".mpo",
    ".dng", ".cr2", ".cr3", ".crw", ".nef", ".nrw", ".arw", ".srf", ".sr2", ".raf", ".orf",
    ".rw2", ".pef", ".x3f", ".mrw", ".srw", ".3fr", ".erf", ".kdc", ".dcr", ".iiq", ".rwl"))
NO_SUFFIX: Final = "(no suffix)"
# First bytes of images and PDFs, for a file whose name says nothing: a cut-off JPEG that
# Pillow no longer identifies is still a picture.
_MEDIA_MAGIC: Final = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"8BPS",
                       b"qoif", b"DDS ", b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51",
                       *MARKS)


def suffix_kind(name: str) -> str:
    """How a file is counted among those left out: its suffix in lower case, or
    NO_SUFFIX."""
    suffix = _suffix(name)
    return suffix if suffix else NO_SUFFIX


def claims_media(name: str, head: bytes) -> bool:
    """Whether a file's name or first bytes say it is an image or a PDF.

    What decides whether a file in a folder that cannot be read is left out (a sidecar,
    a note, a video) or refused (a picture that is damaged or needs a plugin): only the
    latter claims to be media. Types stay decided by content; this only splits the files
    that content typing could not read.
    """
    if _suffix(name) in MEDIA_SUFFIXES or b"%PDF-" in head[:1024]:
        return True
    if head.startswith(_MEDIA_MAGIC) or (head[:2] == b"BM" and head[6:10] == bytes(4)):
        return True
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    if head.startswith(b"\xff\x0a") or head.startswith(_JXL_CONTAINER):
        return True
    if _brands(head) & (_HEIF_BRANDS | _AVIF_BRANDS | {b"crx "}):
        return True
    return _camera_raw(head, _NO_PLUGINS) is not None


def _suffix(name: str) -> str:
    base = name.rstrip("/").rsplit("/", 1)[-1]
    stem, dot, suffix = base.rpartition(".")
    return f".{suffix.lower()}" if dot and stem.strip(".") else ""


# -- identification by magic bytes -------------------------------------------------------

_HEIF_BRANDS: Final = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm",
                       b"hevs", b"mif1", b"msf1", b"mif2", b"heif"}
_AVIF_BRANDS: Final = {b"avif", b"avis"}
_VIDEO_BRANDS: Final = {b"qt  ", b"isom", b"iso2", b"iso4", b"iso5", b"iso6", b"mp41",
                        b"mp42", b"m4v ", b"M4V ", b"M4A ", b"3gp4", b"3gp5", b"3g2a",
                        b"avc1", b"dash", b"MSNV"}
_JXL_CONTAINER: Final = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
_OLE2: Final = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_TO_PDF: Final = "convert it to PDF first (e.g. libreoffice --headless --convert-to pdf FILE)"
# Camera RAW formats that are not TIFF underneath (TIFF-based ones, e.g. NEF, CR2, ARW and
# DNG, open in Pillow as TIFF and are not refused).
_RAW_MAGIC: Final = ((b"FUJIFILMCCD-RAW", "Fujifilm RAF"), (b"IIRO", "Olympus ORF"),
                     (b"IIRS", "Olympus ORF"), (b"MMOR", "Olympus ORF"),
                     (b"IIU\x00", "Panasonic RW2"), (b"FOVb", "Sigma X3F"),
                     (b"\x00MRM", "Minolta MRW"))
_RAW_FIX: Final = ("camera RAW files need developing: export it to JPEG or TIFF first "
                   "(from the camera's or a photo app, or e.g. darktable-cli)")
_NO_PLUGINS: Final = Plugins(heif_error=None, jxl=False, avif=False)  # for _camera_raw


def _identify(head: bytes, plugins: Plugins) -> str | None:
    for check in (_iso_bmff, _jpeg_xl, _documents, _camera_raw, _markup, _plain_text):
        found = check(head, plugins)
        if found is not None:
            return found
    return None


def _brands(head: bytes) -> set[bytes]:
    """The major and compatible brands of an ISO-BMFF file (HEIF, AVIF, MP4, CR3), if any."""
    if head[4:8] != b"ftyp":
        return set()
    size = min(int.from_bytes(head[:4], "big"), len(head))
    return {head[8:12]} | {head[i:i + 4] for i in range(16, size - 3, 4)}


def _iso_bmff(head: bytes, plugins: Plugins) -> str | None:
    brands = _brands(head)
    if not brands:
        return None
    if b"crx " in brands:
        return f"it is a camera RAW file (Canon CR3); {_RAW_FIX}"
    if brands & _AVIF_BRANDS:
        if plugins.avif:
            return "it is an AVIF image that Pillow cannot open: corrupt or truncated"
        return ("it is an AVIF image, and this Pillow was built without AVIF; "
                "upgrade it: pip install -U pillow")
    if brands & _HEIF_BRANDS:
        if plugins.heif_error is not None:
            return (f"it is a HEIC/HEIF image, and pillow-heif cannot be loaded here "
                    f"({plugins.heif_error}); install it: pip install pillow-heif")
        return ("it is a HEIC/HEIF image that libheif cannot open: corrupt or truncated, "
                "or a HEIF variant libheif does not decode")
    if brands & _VIDEO_BRANDS:
        return ("it is a video (MP4/MOV); skip it (a Live Photo's .mov beside its .heic "
                "is one) or extract a frame first")
    return None


def _jpeg_xl(head: bytes, plugins: Plugins) -> str | None:
    if not (head.startswith(b"\xff\x0a") or head.startswith(_JXL_CONTAINER)):
        return None
    if plugins.jxl:
        return "it is a JPEG XL image that pillow-jxl-plugin cannot open: corrupt or truncated"
    return ("it is a JPEG XL image, which Pillow does not read by itself; install the plugin "
            "where the producer and the workers run: pip install pillow-jxl-plugin")


def _documents(head: bytes, plugins: Plugins) -> str | None:
    if b"%PDF-" in head[:1024]:  # only a worker sees this: producers type PDFs first
        return "it is a PDF, sent as an image; send it as a PDF item (with a page)"
    if head.startswith(b"AT&TFORM") and head[12:15] == b"DJV":
        return ("it is a DjVu document; convert it to PDF first "
                "(e.g. ddjvu -format=pdf FILE.djvu FILE.pdf)")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _zip(head)
    if head.startswith(_OLE2):
        return f"it is a legacy Microsoft Office file (.doc, .xls or .ppt); {_TO_PDF}"
    if head.startswith(b"{\\rtf"):
        return f"it is an RTF document; {_TO_PDF}"
    return None


def _zip(head: bytes) -> str:
    """A ZIP, named by the member names and ODF/EPUB mimetype in its first local headers."""
    if b"mimetypeapplication/epub+zip" in head:
        return "it is an EPUB e-book (a ZIP container); convert it to PDF first"
    if b"mimetypeapplication/vnd.oasis.opendocument" in head:
        return f"it is an OpenDocument file (.odt, .ods or .odp; a ZIP container); {_TO_PDF}"
    for folder, kind in ((b"word/", "Word document (.docx"),
                         (b"xl/", "Excel workbook (.xlsx"),
                         (b"ppt/", "PowerPoint presentation (.pptx")):
        if folder in head:
            return f"it is a {kind}, a ZIP container); {_TO_PDF}"
    if b"[Content_Types].xml" in head:
        return f"it is a Microsoft Office document (.docx, .xlsx or .pptx); {_TO_PDF}"
    return "it is a ZIP archive; unpack it and enqueue the files inside"


def _camera_raw(head: bytes, plugins: Plugins) -> str | None:
    if head[6:14] == b"HEAPCCDR":
        return f"it is a camera RAW file (Canon CRW); {_RAW_FIX}"
    for magic, name in _RAW_MAGIC:
        if head.startswith(magic):
            return f"it is a camera RAW file ({name}); {_RAW_FIX}"
    return None


def _text(head: bytes) -> str | None:
    """The head as text when it is UTF-8 (or UTF-16 with a BOM) without control bytes."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = head[: len(head) // 2 * 2].decode("utf-16", "ignore")
    else:
        # A multi-byte character cut by HEAD_BYTES is not a reason to call it binary.
        text = head.decode("utf-8", "ignore") if _utf8_prefix(head) else ""
    if not text or any(ord(c) < 32 and c not in "\t\n\r\f" for c in text):
        return None
    return text.lstrip("\ufeff \t\r\n")


def _utf8_prefix(head: bytes) -> bool:
    for cut in range(4):  # up to 3 bytes of a cut character at the end
        try:
            head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


def _markup(head: bytes, plugins: Plugins) -> str | None:
    text = _text(head)
    if text is None or not text.startswith("<"):
        return None
    low = text.lower()
    if "<svg" in low:
        return ("it is an SVG drawing (vector XML); rasterize it first "
                "(e.g. rsvg-convert -o FILE.png FILE.svg)")
    if low.startswith("<!doctype html") or "<html" in low:
        return "it is an HTML page; print or save it as PDF first"
    if low.startswith("<?xml"):
        return "it is an XML document; render it to PDF or an image first"
    return None


def _plain_text(head: bytes, plugins: Plugins) -> str | None:
    if _text(head) is None:
        return None
    return "it is plain text; captions and OCR need an image or a PDF"
