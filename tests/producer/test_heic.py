"""HEIC/HEIF photos (iPhone and Mac libraries) everywhere images work, and formats that
still cannot be read named in the refusal with what would help.

The HEIC files are made here with pillow-heif. Orientation is pinned against a JPEG of the
same pixels: an HEIC saved with EXIF orientation 6 carries it as an `irot` transform, which
libheif applies on decode, and pillow-heif then resets the EXIF orientation to 1, so our
ImageOps.exif_transpose finds nothing to do and the photo is turned exactly once.

One worker serves the end-to-end tests of this module (its start is the slow part).
"""

from __future__ import annotations

import io
import json
import subprocess
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pillow_heif
import pytest
from PIL import Image

from tests.support import helpers
from vlmq.media import formats
from vlmq.media.formats import UNKNOWN, Plugins, describe
from vlmq.producer.client import Client
from vlmq.producer.files import check_file
from vlmq.producer.ops.output_formats import strip_controls
from vlmq.server.dashboard.render import RenderError, render
from vlmq.shared.errors import InputError
from vlmq.shared.messages import ItemResult
from vlmq.worker.prep.decode import PreprocessError, decode_image

ORIENTATION = 0x0112
BLUE, RED = (0, 0, 255), (255, 0, 0)
SETTINGS = ("--max-tokens", "4", "--max-side", "112")


def _sideways() -> Image.Image:
    """64x32 as stored: blue left half, red right half. Turned 90 degrees clockwise
    (EXIF orientation 6) it is 32x64 with blue on top."""
    img = Image.new("RGB", (64, 32), RED)
    img.paste(BLUE, (0, 0, 32, 32))
    return img


def _encoded(img: Image.Image, fmt: str, orientation: int | None = None) -> bytes:
    formats.register_plugins()  # Pillow writes HEIF only with pillow-heif registered
    extra = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        extra["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, fmt, quality=90, **extra)
    return buf.getvalue()


def _heic_10bit() -> bytes:
    rgb16 = np.zeros((30, 40, 3), dtype=np.uint16)
    rgb16[..., 1] = 50_000  # green, in 16-bit units; stored as 10-bit
    heif = pillow_heif.from_bytes(mode="RGB;16", size=(40, 30), data=rgb16.tobytes())
    buf = io.BytesIO()
    heif.save(buf, quality=-1)
    assert pillow_heif.open_heif(io.BytesIO(buf.getvalue()),
                                 convert_hdr_to_8bit=False).info["bit_depth"] == 10
    return buf.getvalue()


def _heif_alpha() -> bytes:
    return _encoded(Image.new("RGBA", (40, 30), (10, 200, 30, 128)), "HEIF")


def _is_blue(px: tuple[int, ...]) -> bool:
    return px[2] > 200 and px[0] < 60


def _is_red(px: tuple[int, ...]) -> bool:
    return px[0] > 200 and px[2] < 60


def _upright(img: Image.Image) -> bool:
    rgb = img.convert("RGB")
    w, h = rgb.size
    return ((w, h) == (32, 64) and _is_blue(rgb.getpixel((w // 2, h // 8)))
            and _is_red(rgb.getpixel((w // 2, h - h // 8))))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _problem(path: Path) -> str:
    with pytest.raises(InputError) as info:
        check_file(path)
    assert info.value.path == str(path)
    return info.value.problem


# -- orientation -------------------------------------------------------------------------


def test_heic_with_exif_orientation_6_is_upright_exactly_once_like_jpeg() -> None:
    heic = _encoded(_sideways(), "HEIF", orientation=6)
    jpeg = _encoded(_sideways(), "JPEG", orientation=6)
    # What pillow-heif does: libheif applies the irot transform the encoder wrote, and the
    # EXIF orientation is reset to 1 (the original kept aside), so nothing turns it again.
    with Image.open(io.BytesIO(heic)) as im:
        assert im.format == "HEIF" and im.size == (32, 64)
        assert im.getexif().get(ORIENTATION) == 1
        assert im.info["original_orientation"] == 6
    with Image.open(io.BytesIO(jpeg)) as im:  # JPEG: the EXIF tag is ours to apply
        assert im.size == (64, 32) and im.getexif().get(ORIENTATION) == 6
    assert _upright(decode_image(heic, None)) and _upright(decode_image(jpeg, None))
    # AVIF (Pillow's own plugin) keeps the EXIF tag, which exif_transpose then applies once.
    assert _upright(decode_image(_encoded(_sideways(), "AVIF", orientation=6), None))
    assert decode_image(heic, 32).size == decode_image(jpeg, 32).size == (16, 32)


def test_heif_exif_orientation_without_irot_is_not_applied() -> None:
    # HEIF says the irot/imir transforms are authoritative and EXIF orientation is only
    # informative; libheif and Apple's viewers agree. With the irot angle zeroed, the
    # image stays as stored although its EXIF still says 6.
    heic = bytearray(_encoded(_sideways(), "HEIF", orientation=6))
    at = heic.find(b"irot")
    assert at > 0 and heic[at + 4] != 0
    heic[at + 4] = 0
    assert decode_image(bytes(heic), None).size == (64, 32)


def test_plain_10bit_and_alpha_heif_decode_to_rgb() -> None:
    plain = decode_image(_encoded(_sideways(), "HEIF"), None)
    assert plain.mode == "RGB" and plain.size == (64, 32)
    assert _is_blue(plain.getpixel((8, 16))) and _is_red(plain.getpixel((56, 16)))
    deep = decode_image(_heic_10bit(), None)
    assert deep.mode == "RGB" and deep.size == (40, 30)
    r, g, b = deep.getpixel((20, 15))
    assert g > 170 and r < 40 and b < 40
    alpha = decode_image(_heif_alpha(), None)
    assert alpha.mode == "RGB" and alpha.size == (40, 30)


# -- the producer's check ----------------------------------------------------------------


def test_producer_accepts_heic_heif_and_avif(tmp_path: Path) -> None:
    files = {"rot6.heic": _encoded(_sideways(), "HEIF", orientation=6),
             "plain.HEIC": _encoded(_sideways(), "HEIF"),
             "deep.heic": _heic_10bit(), "alpha.heif": _heif_alpha(),
             "photo.avif": _encoded(_sideways(), "AVIF")}
    for name, data in files.items():
        checked = check_file(_write(tmp_path / name, data))
        assert (checked.kind, checked.pages, checked.size) == ("image", 1, len(data)), name


def test_enqueue_caption_of_one_heic_counts_one_item(redis_url: str, tmp_path: Path) -> None:
    photo = _write(tmp_path / "IMG_0001.HEIC", _encoded(_sideways(), "HEIF", orientation=6))
    # A process of its own: this one registered pillow-heif itself to write the file.
    res = subprocess.run([helpers.VLMQ, "--redis-url", redis_url, "enqueue", "caption",
                          str(photo), "--json"], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["items"] == 1 and out["rejected"] == []


def _damaged(problem: str) -> bool:
    """Names the file as a damaged image, in either of the two ways a cut HEIC can fail:
    libheif refuses to open it (it cannot read the boxes it needs), or it opens and the
    decode runs off the end. Which one a given cut meets is libheif's choice and has moved
    between pillow-heif releases; the user needs only to learn that the image is damaged."""
    return ("corrupt or truncated image (" in problem
            or "HEIC/HEIF image that libheif cannot open: corrupt or truncated" in problem)


def test_truncated_heic_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    picture = Image.effect_mandelbrot((300, 200), (-2, -1.2, 1, 1.2), 100).convert("RGB")
    data = _encoded(picture, "HEIF")
    with_exif = _encoded(picture, "HEIF", orientation=6)
    cuts = {"half.heic": data[: len(data) // 2], "header.heic": data[:200],
            "exif.heic": with_exif[: len(with_exif) // 2],
            "exif-header.heic": with_exif[:200]}
    for name, cut in cuts.items():
        problem = _problem(_write(tmp_path / name, cut))
        assert _damaged(problem), (name, problem)
        assert "Traceback" not in problem and len(problem) < 400, problem
        with pytest.raises(PreprocessError) as info:
            decode_image(cut, None)
        assert _damaged(str(info.value)), (name, str(info.value))
    # Cut before libheif's boxes, Pillow cannot identify the file: the brand still names it.
    assert _problem(tmp_path / "header.heic") == (
        f"{UNKNOWN}: it is a HEIC/HEIF image that libheif cannot open: corrupt or "
        "truncated, or a HEIF variant libheif does not decode")


# -- formats that still cannot be read ---------------------------------------------------


def _zip(names: list[str], first: tuple[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        if first is not None:  # ODF and EPUB: "mimetype" first, stored
            z.writestr(zipfile.ZipInfo(first[0]), first[1], zipfile.ZIP_STORED)
        for name in names:
            z.writestr(name, "<x/>")
    return buf.getvalue()


def _ftyp(major: bytes, *compatible: bytes) -> bytes:
    body = major + b"\x00\x00\x00\x00" + b"".join(compatible)
    return (8 + len(body)).to_bytes(4, "big") + b"ftyp" + body + b"\x00" * 64


UNREADABLE = {
    "jpeg-xl codestream": (b"\xff\x0a\xfa\x7f" + bytes(60), "JPEG XL",
                           "pip install pillow-jxl-plugin"),
    "jpeg-xl container": (b"\x00\x00\x00\x0cJXL \r\n\x87\n" + bytes(60), "JPEG XL",
                          "pip install pillow-jxl-plugin"),
    "djvu": (b"AT&TFORM\x00\x00\x01\x00DJVUINFO" + bytes(40), "DjVu", "convert it to PDF"),
    "svg": (b"\xef\xbb\xbf<?xml version='1.0'?>\n<!-- drawn -->\n<svg xmlns='http://www.w3.org"
            b"/2000/svg' width='10' height='10'/>", "SVG", "rasterize it first"),
    "xml": (b"<?xml version='1.0'?><feed/>", "XML document", "render it"),
    "html": (b"<!DOCTYPE html><html><body>hi</body></html>", "HTML page", "as PDF"),
    "docx": (_zip(["[Content_Types].xml", "_rels/.rels", "word/document.xml"]),
             "Word document", "libreoffice --headless --convert-to pdf"),
    "xlsx": (_zip(["[Content_Types].xml", "xl/workbook.xml"]), "Excel", "convert it to PDF"),
    "odt": (_zip(["content.xml"], ("mimetype", "application/vnd.oasis.opendocument.text")),
            "OpenDocument", "convert it to PDF"),
    "epub": (_zip(["content.opf"], ("mimetype", "application/epub+zip")), "EPUB",
             "convert it to PDF"),
    "zip": (_zip(["a.jpg", "b.jpg"]), "ZIP archive", "unpack it"),
    "legacy office": (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(500), "legacy Microsoft "
                      "Office", "convert it to PDF"),
    "rtf": (b"{\\rtf1\\ansi hello}", "RTF", "convert it to PDF"),
    "canon cr3": (_ftyp(b"crx ", b"crx ", b"isom"), "camera RAW file (Canon CR3)",
                  "export it to JPEG or TIFF"),
    "fuji raf": (b"FUJIFILMCCD-RAW 0201FF383501" + bytes(80), "Fujifilm RAF", "JPEG or TIFF"),
    "olympus orf": (b"IIRO\x08\x00\x00\x00" + bytes(80), "Olympus ORF", "JPEG or TIFF"),
    "panasonic rw2": (b"IIU\x00\x08\x00\x00\x00" + bytes(80), "Panasonic RW2", "JPEG or TIFF"),
    "canon crw": (b"II\x1a\x00\x00\x00HEAPCCDR" + bytes(80), "Canon CRW", "JPEG or TIFF"),
    "live photo mov": (_ftyp(b"qt  ", b"qt  "), "video (MP4/MOV)", "extract a frame"),
    "mp4": (_ftyp(b"isom", b"isom", b"iso2", b"mp41"), "video (MP4/MOV)", "skip it"),
    "plain text": (b"Dear diary, today I scanned nothing.\n" * 3, "plain text",
                   "need an image or a PDF"),
    "utf-16 text": ("notes\r\n".encode("utf-16"), "plain text", "need an image or a PDF"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_unreadable_formats_are_named_with_their_fix(case: str, tmp_path: Path) -> None:
    data, name, fix = UNREADABLE[case]
    problem = _problem(_write(tmp_path / "input.png", data))
    assert problem.startswith(f"{UNKNOWN}: it is "), problem
    assert name in problem and fix in problem, problem


def test_unknown_bytes_keep_the_old_message(tmp_path: Path) -> None:
    noise = bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8))
    assert _problem(_write(tmp_path / "noise.jpg", b"\x00\x01" + noise)) == UNKNOWN
    assert describe(_ftyp(b"abcd", b"wxyz")) is None  # an ISO-BMFF brand not known here


def test_messages_follow_what_this_process_has_installed() -> None:
    heic_head = _encoded(_sideways(), "HEIF")[:64]
    no_heif = Plugins(heif_error="No module named 'pillow_heif'", jxl=False, avif=True)
    assert describe(heic_head, no_heif) == (
        "it is a HEIC/HEIF image, and pillow-heif cannot be loaded here (No module named "
        "'pillow_heif'); install it: pip install pillow-heif")
    with_jxl = Plugins(heif_error=None, jxl=True, avif=True)
    assert "pillow-jxl-plugin cannot open: corrupt or truncated" in str(
        describe(b"\xff\x0a" + bytes(30), with_jxl))
    avif_head = _ftyp(b"avif", b"avif", b"mif1", b"miaf")
    assert "upgrade it: pip install -U pillow" in str(
        describe(avif_head, Plugins(heif_error=None, jxl=False, avif=False)))
    # AVIF is not mistaken for HEIC although both list the generic HEIF brand mif1.
    assert "AVIF image that Pillow cannot open" in str(describe(avif_head, with_jxl))


def test_registration_is_idempotent_and_explicit() -> None:
    first = formats.register_plugins()
    assert first.heif_error is None and first.avif  # both are dependencies here
    assert formats.register_plugins() is first
    assert "HEIF" in Image.OPEN


def test_worker_names_the_format_it_cannot_decode() -> None:
    with pytest.raises(PreprocessError) as info:
        decode_image(UNREADABLE["djvu"][0], None)
    assert str(info.value).startswith("not an image (cannot identify image file): it is a "
                                      "DjVu document; convert it to PDF first")
    with pytest.raises(PreprocessError, match=r"it is a PDF, sent as an image"):
        decode_image(helpers.pdf_bytes(1), None)


# -- the dashboard preview ---------------------------------------------------------------


def test_dashboard_preview_of_heic_and_rotated_jpeg_is_upright_png() -> None:
    for fmt in ("HEIF", "JPEG"):
        png = render(_encoded(_sideways(), fmt, orientation=6), "image", None)
        with Image.open(io.BytesIO(png)) as im:
            assert im.format == "PNG" and _upright(im), fmt
    with pytest.raises(RenderError, match=r"cannot render this image: .*JPEG XL.*"
                                          r"pip install pillow-jxl-plugin"):
        render(UNREADABLE["jpeg-xl codestream"][0], "image", None)


# -- through a real worker ---------------------------------------------------------------


@dataclass
class World:
    redis_url: str
    photos: Path
    tmp: Path


@pytest.fixture(scope="module")
def world(module_redis_url: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("heic")
    photos = tmp / "photos"
    photos.mkdir()
    for name, data in {"IMG_0001.HEIC": _encoded(_sideways(), "HEIF", orientation=6),
                       "IMG_0002.heic": _encoded(helpers.page_image(1, (96, 96)), "HEIF"),
                       "deep.heic": _heic_10bit(), "alpha.heif": _heif_alpha()}.items():
        _write(photos / name, data)
    helpers.page_image(2, (96, 96)).save(photos / "scan.png")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, name="wheic"))
        yield World(module_redis_url, photos, tmp)
    finally:
        helpers.stop_all(procs)


NAMES = ["IMG_0001.HEIC", "IMG_0002.heic", "alpha.heif", "deep.heic", "scan.png"]


def _enqueue(world: World, *args: str) -> str:
    res = helpers.invoke_cli(world.redis_url, "enqueue", "caption", str(world.photos),
                             "--json", *SETTINGS, *args)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    out = json.loads(res.stdout)
    assert out["items"] == len(NAMES) and out["rejected"] == [], out
    return str(out["id"])


def _results(world: World, job_id: str) -> list[ItemResult]:
    with Client(world.redis_url) as client:
        job = client.job(job_id)
        assert job.wait(timeout=240) == "finished", job.error()
        got = sorted(job.results(), key=lambda r: r.source)
    assert [r.source for r in got] == NAMES
    assert all(r.ok and r.text for r in got), [(r.source, r.error) for r in got]
    return got


@pytest.mark.slow
def test_caption_heic_folder_caches_and_export(world: World) -> None:
    first = _results(world, _enqueue(world))
    assert not any(r.result_cache_hit for r in first)
    again = _results(world, _enqueue(world))  # the shared result cache answers
    assert all(r.result_cache_hit for r in again), again
    assert [r.text for r in again] == [r.text for r in first]
    fresh = _results(world, _enqueue(world, "--no-result-cache"))  # generated, features cached
    assert all(r.vision_cache_hit and not r.result_cache_hit for r in fresh), fresh


@pytest.mark.slow
def test_export_writes_heic_results(world: World) -> None:
    job_id = _enqueue(world)
    got = _results(world, job_id)
    out = world.tmp / "export"
    res = subprocess.run([helpers.VLMQ, "--redis-url", world.redis_url, "export", job_id,
                          "--dir", str(out)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    for r in got:
        assert r.text and (out / f"{r.source}.txt").read_text().rstrip() == strip_controls(
            r.text).rstrip()  # files hold no control characters (the tiny model writes some)


@pytest.mark.slow
def test_schedule_run_over_a_folder_enqueues_its_heic(world: World) -> None:
    def cli(*args: str) -> str:
        res = helpers.invoke_cli(world.redis_url, *args)
        assert res.exit_code == 0, (res.stdout, res.stderr)
        return str(res.stdout)

    cli("schedule", "add", "iphone", "caption", str(world.photos), "--every", "3600",
        *SETTINGS)
    run = json.loads(cli("schedule", "run", "iphone", "--json"))
    assert run["items"] == len(NAMES) and run["bad"] == [], run
    _results(world, run["job_id"])
