"""What counts as "not media": the rule a folder uses to leave a file out rather than
refuse the set. Content decides first; a file whose name or first bytes claim to be an
image or a PDF is never left out, however damaged."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tests.support.factories import image_bytes
from vlmq.media import formats
from vlmq.media.checks import NotMedia, check_content, refusal
from vlmq.media.formats import NO_SUFFIX, UNKNOWN, claims_media, suffix_kind
from vlmq.shared.errors import InputError

XMP = b'<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?>\n<x:xmpmeta xmlns:x="adobe:ns:meta/">'
AAE = (b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST'
       b' 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n<plist version="1.0">')
MOV = b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00qt  " + bytes(64)
HEIC = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)


def _check(name: str, data: bytes) -> tuple[str, int]:
    return check_content(data, data[:1024], name)


@pytest.mark.parametrize(("name", "kind"), [
    ("trip/notes.txt", ".txt"), ("IMG_0001.XMP", ".xmp"), ("s3://b/p/IMG_0001.aae", ".aae"),
    ("photo.jpg.json", ".json"), ("trip/README", NO_SUFFIX), ("trip/.hidden", NO_SUFFIX),
    ("archive.tar.gz", ".gz"), ("trip.d/LICENSE", NO_SUFFIX)])
def test_suffix_kind_is_the_lowercased_suffix_of_the_file_name(name: str, kind: str) -> None:
    assert suffix_kind(name) == kind


@pytest.mark.parametrize("name", ["a.jpg", "A.JPEG", "scan.pdf", "fax.tif", "IMG.HEIC",
                                  "x.png", "x.webp", "x.avif", "x.jxl", "x.cr3", "x.dng"])
def test_an_image_or_pdf_name_claims_media_whatever_the_bytes(name: str) -> None:
    assert claims_media(name, b"plain words\n")
    assert claims_media(name, b"")


@pytest.mark.parametrize(("what", "head"), [
    ("jpeg", b"\xff\xd8\xff\xe0\x00\x10JFIF"), ("png", b"\x89PNG\r\n\x1a\n"),
    ("gif", b"GIF89a\x01\x00"), ("webp", b"RIFF\x10\x00\x00\x00WEBPVP8 "),
    ("bmp", b"BM\x36\x00\x00\x00\x00\x00\x00\x00\x36\x00"), ("tiff", b"II*\x00\x08\x00"),
    ("pdf", b"\n\n%PDF-1.7\n"), ("heic", HEIC), ("jxl", b"\xff\x0a\x00"),
    ("raf", b"FUJIFILMCCD-RAW 0201"), ("psd", b"8BPS\x00\x01")])
def test_image_and_pdf_magic_claims_media_whatever_the_name(what: str, head: bytes) -> None:
    assert claims_media("upload.bin", head), what
    assert claims_media("no-suffix", head), what


@pytest.mark.parametrize(("name", "head"), [
    ("notes.txt", b"day one: the beach\n"), ("IMG_0001.xmp", XMP), ("IMG_0001.aae", AAE),
    ("photo.jpg.json", b'{"title": "IMG_0001.jpg"}'), ("IMG_0001.MOV", MOV),
    ("README", b"read me"), ("empty.txt", b""), ("BMW notes.txt", b"BMW 320i, 1998\n")])
def test_sidecars_notes_and_videos_do_not_claim_media(name: str, head: bytes) -> None:
    assert not claims_media(name, head)


@pytest.mark.parametrize(("name", "data"), [
    ("notes.txt", b"day one: the beach\n"), ("IMG_0001.xmp", XMP), ("IMG_0001.aae", AAE),
    ("photo.jpg.json", b'{"title": "IMG_0001.jpg"}'), ("IMG_0001.MOV", MOV + bytes(512))])
def test_unreadable_content_that_claims_nothing_is_not_media(name: str, data: bytes) -> None:
    with pytest.raises(NotMedia) as caught:
        _check(name, data)
    # The message is the refusal a file named on its own has always had.
    assert caught.value.problem.startswith(UNKNOWN) and caught.value.path == name


@pytest.mark.parametrize(("name", "data"), [
    ("cut.jpg", b"\x00\x01 not a jpeg at all"),  # the name claims it
    ("photo", image_bytes("JPEG")[:40]),  # the bytes claim it: a JPEG cut short
    ("IMG_0002.heic", HEIC),
    ("notes.png", b"plain text"),
])
def test_unreadable_content_that_claims_media_is_a_bad_file(name: str, data: bytes) -> None:
    with pytest.raises(InputError) as caught:
        _check(name, data)
    assert not isinstance(caught.value, NotMedia), caught.value


def test_media_under_any_name_is_read_as_media() -> None:
    assert _check("notes.txt", image_bytes("PNG")) == ("image", 1)
    assert _check("scan.xmp", image_bytes("JPEG")) == ("image", 1)


def test_a_size_refusal_is_not_media_only_when_nothing_says_media() -> None:
    assert isinstance(refusal("notes.txt", "is empty", b""), NotMedia)
    assert not isinstance(refusal("IMG.jpg", "is empty", b""), NotMedia)
    big_video = MOV + bytes(2048)
    assert isinstance(refusal("clip.mov", "is too big", big_video[:1024], big_video), NotMedia)
    # Pillow knows the header of this one though neither its name nor its magic says so.
    tga = io.BytesIO()
    Image.new("RGB", (8, 8)).save(tga, "TGA")
    problem = refusal("frame.raw0", "is too big", tga.getvalue()[:1024], tga.getvalue())
    assert type(problem) is InputError and problem.problem == "is too big"


def test_picture_suffixes_claim_media_and_sidecar_suffixes_do_not() -> None:
    pictures = {".jpg", ".jpeg", ".png", ".pdf", ".tif", ".tiff", ".heic", ".heif", ".webp"}
    assert pictures <= formats.MEDIA_SUFFIXES
    assert not formats.MEDIA_SUFFIXES & {".txt", ".xmp", ".json", ".aae", ".mov", ".mp4"}
