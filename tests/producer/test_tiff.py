"""Multi-page TIFF as a page set: a TIFF is a document like a PDF, one
item per page (frame), every page checked at enqueue, decoded one at a time on the worker.

The fax is five pages in mixed compression (CCITT Group 4 for the 1-bit pages, LZW for the
grey and colour ones), as scanners write them. One real worker serves the module.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from redis import Redis
from redis.exceptions import ResponseError

from tests.support import helpers
from tests.support.factories import item, payload
from tests.support.lua_calls import call, store_blob
from tests.support.tiff_craft import PAGES, fax_bytes, fax_page, tiff_bytes
from vlmq.producer.client import Client
from vlmq.producer.expand import FoundFile
from vlmq.producer.files import check_file, check_stored
from vlmq.producer.inputs import Prepared, prepare
from vlmq.producer.manifest import read_manifest
from vlmq.producer.ops.export import export_results
from vlmq.producer.ops.schedules import ENTRY_MARK, _checked
from vlmq.producer.options import JobOptions
from vlmq.producer.page_specs import PagesWithoutPdf
from vlmq.server.dashboard.render import RenderError, render
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import PAYLOAD_MESSAGES, parse_payload
from vlmq.stores.backends import FolderStore
from vlmq.worker.job_settings import (
    DEFAULT_IMAGE_MAX_SIDE,
    DEFAULT_PDF_MAX_SIDE,
    JobSettings,
)
from vlmq.worker.prep import decode

FAST = {"max_tokens": 4, "result_cache": "off"}


@pytest.fixture
def fax(tmp_path: Path) -> Path:
    path = tmp_path / "fax.tiff"
    path.write_bytes(fax_bytes())
    return path


def test_the_fax_really_has_five_pages_in_mixed_compression(fax: Path) -> None:
    with Image.open(fax) as im:
        assert im.n_frames == 5
        seen = []
        for i in range(5):
            im.seek(i)
            seen.append((im.mode, im.info["compression"]))
    assert seen == PAGES


def test_a_tiff_is_one_item_per_page_in_page_order(fax: Path) -> None:
    checked = check_file(fax)
    assert (checked.kind, checked.pages) == ("tiff", 5)
    items = prepare([fax]).items
    assert [(i.kind, i.page) for i in items] == [("tiff", p) for p in range(1, 6)]
    assert len({i.blob for i in items}) == 1  # one upload for the five pages


def test_pages_selects_tiff_pages_and_refuses_one_out_of_range(fax: Path) -> None:
    assert [i.page for i in prepare([fax], pages="2-3").items] == [2, 3]
    with pytest.raises(InputError, match=r"page 9 is out of range: .*fax.tiff has 5 pages"):
        prepare([fax], pages="9")


def test_a_one_frame_tiff_is_a_tiff_of_one_page(tmp_path: Path) -> None:
    path = tmp_path / "one.tif"
    fax_page(0, "RGB").save(path, compression="tiff_lzw")
    assert [(i.kind, i.page) for i in prepare([path]).items] == [("tiff", 1)]
    assert [i.page for i in prepare([path], pages="1").items] == [1]  # --pages applies


def test_bigtiff_is_typed_as_tiff_by_its_magic(tmp_path: Path) -> None:
    path = tmp_path / "big.tif"
    frames = [fax_page(i, "L") for i in range(2)]
    frames[0].save(path, save_all=True, append_images=frames[1:], big_tiff=True)
    assert path.read_bytes()[:4] in (b"II+\x00", b"MM\x00+")
    checked = check_file(path)
    assert (checked.kind, checked.pages) == ("tiff", 2)


def test_a_bomb_sized_page_is_refused_naming_its_page(tmp_path: Path) -> None:
    # 9000x8000 = 72 Mpx, over C.MAX_IMAGE_PIXELS, yet a few KB in Group 4.
    big = Image.new("1", (9000, 8000), 1)
    assert big.width * big.height > C.MAX_IMAGE_PIXELS
    path = tmp_path / "bomb.tiff"
    path.write_bytes(tiff_bytes([(fax_page(0, "1"), "group4"), (fax_page(1, "1"), "group4"),
                                 (big, "group4")]))
    assert path.stat().st_size < 100_000
    with pytest.raises(InputError, match=r"page 3: image is larger than the 64000000-pixel "
                                         r"limit .*: 9000x8000") as info:
        check_file(path)
    assert info.value.path == str(path)


def test_a_truncated_last_page_is_refused_naming_its_page(tmp_path: Path) -> None:
    # The last page raw (Pillow writes its directory before its pixels): cut into them.
    data = tiff_bytes([(fax_page(i, mode), comp) for i, (mode, comp) in enumerate(PAGES[:4])]
                      + [(fax_page(4, "L"), None)])
    path = tmp_path / "cut.tiff"
    path.write_bytes(data[:-2000])
    with pytest.raises(InputError, match=r"page 5: is a corrupt or truncated TIFF page"):
        check_file(path)
    # A file cut inside page 5's directory is refused the same way.
    whole = fax_bytes()
    path.write_bytes(whole[:-40])
    with pytest.raises(InputError, match=r"page 5: is a corrupt or truncated TIFF page"):
        check_file(path)


def test_a_stored_tiff_is_checked_as_a_stream(tmp_path: Path, fax: Path) -> None:
    checked = check_stored(FolderStore("scans", tmp_path), fax.name, fax.name)
    assert (checked.kind, checked.pages) == ("tiff", 5)
    (tmp_path / "cut.tiff").write_bytes(fax.read_bytes()[:-40])
    with pytest.raises(InputError, match=r"page 5: is a corrupt"):
        check_stored(FolderStore("scans", tmp_path), "cut.tiff", "cut.tiff")


def _animations(folder: Path) -> list[Path]:
    frames = [fax_page(i, "RGB", (96, 120)) for i in range(3)]
    out = []
    for name, fmt in (("anim.gif", "GIF"), ("anim.png", "PNG"), ("anim.webp", "WEBP"),
                      ("stereo.mpo", "MPO")):
        frames[0].save(folder / name, fmt, save_all=True, append_images=frames[1:],
                       duration=100, loop=0)
        with Image.open(folder / name) as im:
            assert getattr(im, "n_frames", 1) == 3, name  # really animated
        out.append(folder / name)
    return out


def test_animated_gif_png_webp_and_mpo_stay_one_image_item(tmp_path: Path) -> None:
    paths = _animations(tmp_path)
    items = prepare(paths).items
    assert [(i.kind, i.page) for i in items] == [("image", None)] * 4
    with pytest.raises(PagesWithoutPdf, match="applies to PDFs and multi-page TIFFs"):
        prepare(paths, pages="1-2")


def test_a_manifest_takes_pages_of_a_tiff(tmp_path: Path, fax: Path) -> None:
    manifest = tmp_path / "requests.jsonl"
    manifest.write_text(json.dumps({"custom_id": "fax", "task": "ocr", "file": str(fax),
                                    "pages": "4-5"}) + "\n")
    groups, rejected = read_manifest(manifest, JobOptions())
    assert not rejected
    assert [(i.kind, i.page) for g in groups for i in g.prepared.items] == [
        ("tiff", 4), ("tiff", 5)]


def test_a_schedule_reads_an_old_image_entry_for_a_tiff_again(fax: Path) -> None:
    st = os.stat(fax)
    found = FoundFile(str(fax), fax.name, str(fax.parent))
    old = f"{st.st_size}:{st.st_mtime_ns}:{'ab' * 32}:image:1"  # before TIFFs had pages
    checked, entry = _checked(found, old)
    assert (checked.kind, checked.pages) == ("tiff", 5)
    assert entry.endswith(f":tiff:5:{ENTRY_MARK}")
    again, same = _checked(found, entry)  # a current entry is trusted, not read
    assert (again.kind, again.pages, same) == ("tiff", 5, entry)


# -- the wire: payload parsing and enqueue.lua ----------------------------------------------

def test_payload_takes_tiff_with_a_page_and_refuses_it_without() -> None:
    parsed = parse_payload(payload(item("tiff", page=3))).items[0]
    assert (parsed.kind, parsed.page) == ("tiff", 3)
    with pytest.raises(PayloadError, match=r"items\[0\]\.page.*required for a tiff item"):
        parse_payload(payload(item("tiff")))
    with pytest.raises(PayloadError, match="only allowed on pdf and tiff items"):
        parse_payload(payload(item(page=1)))


def test_enqueue_lua_takes_tiff_with_a_page_and_refuses_it_without(redis: Redis) -> None:
    store_blob(redis)
    missing = "items[0].page: " + PAYLOAD_MESSAGES["page_missing"] % "tiff"
    with pytest.raises(ResponseError, match=re.escape(missing)):
        call(redis, data=payload(item("tiff")))
    with pytest.raises(ResponseError, match=r"items\[0\]\.kind: must be one of image, pdf, tiff"):
        call(redis, data=payload(item("tif", page=1)))
    with pytest.raises(ResponseError, match="only allowed on pdf and tiff items"):
        call(redis, data=payload(item(page=1)))
    assert not redis.exists(Keys.rq_job("j1"))
    assert call(redis, data=payload(item("tiff", page=2))) == 1
    assert redis.lrange("rq:queue:ocr", 0, -1) == [b"j1"]


# -- the worker's decode ----------------------------------------------------------------


def test_decode_tiff_page_decodes_that_page_only() -> None:
    data = fax_bytes()
    pages = [decode.decode_tiff_page(data, n, 100) for n in range(1, 6)]
    assert all(p.mode == "RGB" and max(p.size) == 100 for p in pages)
    assert len({p.tobytes() for p in pages}) == 5  # five different pages, not page 1 five times
    with pytest.raises(decode.PreprocessError,
                       match=r"page 6 is out of range: the TIFF has 5 page"):
        decode.decode_tiff_page(data, 6, 100)


def test_decode_tiff_page_guards_only_the_page_asked_for() -> None:
    big = Image.new("1", (9000, 8000), 1)
    data = tiff_bytes([(fax_page(0, "1"), "group4"), (big, "group4")])
    assert decode.decode_tiff_page(data, 1, 64).size[1] == 64
    with pytest.raises(decode.PreprocessError, match=r"page 2 is 9000x8000 .*decompression bomb"):
        decode.decode_tiff_page(data, 2, 64)


def test_a_tiff_page_is_sized_as_a_document_page() -> None:
    settings = JobSettings(prompt="p", max_tokens=4, temperature=0.0, stop=())
    assert settings.side_for("tiff") == settings.side_for("pdf") == DEFAULT_PDF_MAX_SIDE
    assert settings.side_for("image") == DEFAULT_IMAGE_MAX_SIDE


def test_the_dashboard_previews_a_tiff_page() -> None:
    data = fax_bytes()
    previews = [render(data, "tiff", page, 120) for page in (1, 3)]
    with Image.open(io.BytesIO(previews[1])) as im:
        assert im.format == "PNG" and max(im.size) == 120
    assert previews[0] != previews[1]  # page 3, not page 1 again
    with pytest.raises(RenderError, match="the TIFF has 5 pages, not 9"):
        render(data, "tiff", 9, 120)


# -- one real worker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("tiff-worker")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, name="wtiff"))
        yield module_redis_url
    finally:
        helpers.stop_all(procs)


_results = helpers.finished_results


@pytest.mark.slow
def test_ocr_over_a_tiff_gives_its_pages_in_order(worker: str, tmp_path: Path) -> None:
    fax = tmp_path / "fax.tiff"
    fax.write_bytes(fax_bytes())
    res = helpers.invoke_cli(worker, "enqueue", "ocr", str(fax), "--json", "--max-tokens", "4",
                             "--no-result-cache")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert json.loads(res.stdout)["items"] == 5
    with Client(worker) as client:
        first = _results(client, json.loads(res.stdout)["id"])
        assert [(r.source, r.page) for r in first] == [("fax.tiff", p) for p in range(1, 6)]
        assert all(r.ok and r.text for r in first), [r.error for r in first]
        # One blob, five pages: the vision cache keys on the page, so five misses...
        assert not any(r.vision_cache_hit for r in first)
        second = _results(client, client.ocr([fax], **FAST).id)
    # ...and five hits when the same pages come again.
    assert [r.page for r in second] == [1, 2, 3, 4, 5]
    assert all(r.ok and r.vision_cache_hit for r in second)
    report = export_results(first, tmp_path / "out", "md")
    assert not report.failed
    md = (tmp_path / "out" / "fax.tiff.md").read_text()
    markers = [f"<!-- page {p} -->" for p in range(1, 6)]
    assert all(m in md for m in markers)
    assert [md.index(m) for m in markers] == sorted(md.index(m) for m in markers)


@pytest.mark.slow
def test_a_tiff_page_out_of_range_fails_that_item_on_the_worker(worker: str,
                                                                fax: Path) -> None:
    """Items made past the producer's page check (as by a client in another language)
    ask for page 9 of 5: that item fails naming the page count, the other is read."""
    prepared = Prepared()
    prepared.add(check_file(fax), [2, 9])
    with Client(worker) as client:
        results = _results(client, client.submit("ocr", prepared, JobOptions(**FAST)).id)
    assert results[0].ok and results[0].page == 2
    assert results[1].error is not None
    assert "page 9 is out of range: the TIFF has 5 page(s)" in results[1].error


def test_the_pages_of_one_tiff_fetch_its_bytes_once() -> None:
    data = fax_bytes()
    fetched: list[int] = []

    def fetch() -> bytes:
        fetched.append(1)
        return data

    key = "f" * 64
    sizes = [decode.decode_tiff_page(fetch, page, 300, doc_key=key).size for page in (1, 3, 5, 2)]
    assert len(fetched) == 1 and len(set(sizes)) >= 1
    with pytest.raises(decode.PreprocessError, match="out of range: the TIFF has 5 page"):
        decode.decode_tiff_page(fetch, 6, 300, doc_key=key)
