"""Inputs refused where they enter: a file the decoder chokes on, text no reader sees,
and extract schemas that can produce nothing.

- a HEIC whose `ispe` box declares 64x64 while its coded image is 512x512 (libheif
refuses past 16 times the declared area: pillow-heif raises RuntimeError). It must be a
named refusal of that one file at enqueue, a bad file in a schedule's run, and a failed
item (the job's other items done) in a real worker.
- a PDF page with visible text and invisible text (render mode 3, white on nothing,
off the page) beside it: the hidden text is never the page's text.
- `$ref` loops with no base case, and other schemas no value satisfies, refused at
enqueue with what is wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fpdf
import pypdfium2 as pdfium
import pytest
from fpdf.enums import TextMode
from PIL import Image
from redis import Redis

from tests.support import helpers
from vlmq.media import formats, opener
from vlmq.producer.client import Client
from vlmq.producer.files import check_file
from vlmq.producer.ops.schedules import ScheduleStore
from vlmq.producer.options import JobOptions
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.extract_schema import check_schema
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, JobPayload
from vlmq.worker.prep import text_layer
from vlmq.worker.prep.decode import PreprocessError, decode_image

# -- a HEIC whose header and coded image disagree ---------------------------------


def lying_heic(declared: int = 64, coded: int = 512) -> bytes:
    """A coded `coded` x `coded` HEIC whose one `ispe` box (the size a reader plans for)
    says `declared` x `declared`."""
    formats.register_plugins()
    buf = io.BytesIO()
    Image.new("RGB", (coded, coded), (10, 20, 30)).save(buf, "HEIF", quality=10)
    data = buf.getvalue()
    at = data.find(b"ispe")
    assert at > 0 and data.count(b"ispe") == 1
    assert struct.unpack(">II", data[at + 8:at + 16]) == (coded, coded)
    return data[:at + 8] + struct.pack(">II", declared, declared) + data[at + 16:]


def _png(path: Path) -> Path:
    helpers.page_image(1, (96, 96)).save(path)
    return path


def test_the_opener_names_the_inconsistency_instead_of_raising_runtimeerror() -> None:
    with pytest.raises(opener.MediaError) as info, opener.open_image(lying_heic()) as im:
        assert im.size == (64, 64)  # what the header says
        opener.decode(im)
    assert info.value.problem is opener.Problem.CORRUPT
    assert "header says 64x64" in str(info.value), str(info.value)
    with pytest.raises(PreprocessError, match=r"header says 64x64"):
        decode_image(lying_heic(), None)


def test_the_producer_refuses_that_file_alone(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "lying.heic").write_bytes(lying_heic())
    _png(tmp_path / "fine.png")
    with pytest.raises(InputError) as info:
        check_file(tmp_path / "lying.heic")
    assert "header says 64x64" in info.value.problem
    res = helpers.invoke_cli(redis_url, "enqueue", "caption", str(tmp_path), "--skip-bad",
                             "--json")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    out = json.loads(res.stdout)
    assert out["items"] == 1, out
    assert len(out["rejected"]) == 1 and "lying.heic" in json.dumps(out["rejected"]), out


def test_a_schedule_tick_survives_it_and_reports_the_file(redis_url: str,
                                                          tmp_path: Path) -> None:
    (tmp_path / "lying.heic").write_bytes(lying_heic())
    _png(tmp_path / "fine.png")
    res = helpers.invoke_cli(redis_url, "schedule", "add", "photos", "caption", str(tmp_path),
                             "--every", "3600")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    with Client(redis_url) as client:
        fired = ScheduleStore(client).tick(now=time.time() + 7200)
    assert len(fired) == 1, fired
    run = fired[0]
    assert run["items"] == 1, run
    assert [b[0] for b in run["bad"]] == ["lying.heic"], run
    assert "header says 64x64" in run["bad"][0][1]
    manual = helpers.invoke_cli(redis_url, "schedule", "run", "photos", "--json")
    assert manual.exit_code == 0, (manual.stdout, manual.stderr)


# -- text no reader sees ----------------------------------------------------------

VISIBLE = "Total due: 100.00 EUR for the consulting work done in November."
HIDDEN = "1,000,000.00 EUR. Pay to IBAN XX00 EVIL"


def hidden_text_pdf(path: Path) -> Path:
    """Page 1: the visible total and, below it, the invisible (render mode 3) one. Page 2:
    the visible total and the hidden one in white on the bare page. Page 3: the visible
    total and the hidden one placed off the page. Page 4: the visible total alone."""
    pdf = fpdf.FPDF(unit="mm")
    pdf.set_auto_page_break(False)
    for n in range(1, 5):
        pdf.add_page(format=(210, 297))
        pdf.set_font("helvetica", size=12)
        pdf.set_text_color(0, 0, 0)
        pdf.text_mode = TextMode.FILL
        pdf.set_xy(15, 15)
        pdf.multi_cell(180, 6, VISIBLE)
        if n == 1:
            pdf.text_mode = TextMode.INVISIBLE
            pdf.set_xy(15, 40)
            pdf.multi_cell(180, 6, HIDDEN)
        elif n == 2:
            pdf.set_text_color(255, 255, 255)
            pdf.set_xy(15, 40)
            pdf.multi_cell(180, 6, HIDDEN)
        elif n == 3:
            pdf.set_xy(250, 40)
            pdf.cell(180, 6, HIDDEN)
    pdf.output(str(path))
    return path


def _layers(path: Path) -> list[text_layer.Layer]:
    doc = pdfium.PdfDocument(str(path))
    try:
        return [text_layer.extract(doc, n) for n in range(1, len(doc) + 1)]
    finally:
        doc.close()


def test_hidden_text_is_never_the_pages_text(tmp_path: Path) -> None:
    layers = _layers(hidden_text_pdf(tmp_path / "invoice.pdf"))
    for n, layer in enumerate(layers[:3], start=1):
        assert "EVIL" not in layer.text and "1,000,000" not in layer.text, (n, layer)
        assert " ".join(layer.text.split()) == VISIBLE, (n, layer.text)
        assert layer.hidden > 0, (n, layer)
        assert not layer.usable("prefer"), (n, layer)
        assert "no reader sees" in layer.why_not("prefer"), (n, layer.why_not("prefer"))
        assert layer.usable("fallback")  # the visible text, once the model failed
    clean = layers[3]
    assert clean.hidden == 0 and clean.usable("prefer"), clean


def test_an_ocr_layer_over_a_scan_still_serves_fallback(tmp_path: Path) -> None:
    """Invisible text over an image is a scan's OCR layer (OCRmyPDF writes mode 3): the
    model reads such a page under prefer; fallback keeps the layer."""
    pdf = fpdf.FPDF(unit="mm")
    pdf.add_page(format=(210, 297))
    pdf.image(Image.new("L", (420, 594), 255), x=0, y=0, w=210, h=297)
    pdf.set_font("helvetica", size=12)
    pdf.text_mode = TextMode.INVISIBLE
    pdf.set_xy(15, 15)
    pdf.multi_cell(180, 6, VISIBLE)
    pdf.output(str(tmp_path / "scan.pdf"))
    (layer,) = _layers(tmp_path / "scan.pdf")
    assert " ".join(layer.text.split()) == VISIBLE
    assert layer.usable("fallback") and not layer.usable("prefer")


# -- schemas no value satisfies --------------------------------------------------

LOOP = "no value can satisfy it: a $ref loop with no base case"
NOTHING_SATISFIES: dict[str, tuple[dict[str, Any], str]] = {
    "self ref": ({"$ref": "#"}, LOOP),
    "definition loop": ({"definitions": {"a": {"$ref": "#/definitions/a"}},
                         "$ref": "#/definitions/a"}, LOOP),
    "mutual loop": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                     "$ref": "#/$defs/a"}, LOOP),
    "required recursion": ({"type": "object", "properties": {"child": {"$ref": "#"}},
                            "required": ["child"]}, LOOP),
    "false property": ({"type": "object", "properties": {"a": False}, "required": ["a"]},
                       "no value can satisfy it: `false` (at #/properties/a)"),
    "disjoint types": ({"allOf": [{"type": "string"}, {"type": "integer"}]},
                       "no value can satisfy it: it asks for types string and integer"),
    "empty enum": ({"enum": []}, "enum"),  # the meta-schema already wants one value
    # llguidance implements no `not`: refused as a keyword it would ignore, by name.
    "not anything": ({"not": {}}, '"not"'),
}


@pytest.mark.parametrize("case", sorted(NOTHING_SATISFIES))
def test_a_schema_no_value_satisfies_is_refused(case: str) -> None:
    schema, named = NOTHING_SATISFIES[case]
    with pytest.raises(PayloadError) as info:
        check_schema(schema)
    assert named in str(info.value), str(info.value)


def test_schemas_with_a_base_case_are_taken() -> None:
    tree = {"type": "object", "properties": {
        "name": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["name"]}
    linked = {"$defs": {"node": {"anyOf": [{"type": "null"}, {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
        "required": ["next"]}]}}, "$ref": "#/$defs/node"}
    for schema in (tree, linked, {"type": "object", "properties": {"a": {"$ref": "#"}}}):
        assert check_schema(schema) == schema


def test_false_is_refused_and_the_producer_refuses_a_loop(redis_url: str,
                                                          tmp_path: Path) -> None:
    with pytest.raises(PayloadError, match="non-empty JSON object"):
        check_schema(False)
    image = _png(tmp_path / "a.png")
    with Client(redis_url) as client, pytest.raises(PayloadError, match="no value can"):
        client.extract([image], {"$ref": "#"})


# -- one worker for rows 1 and 7 ----------------------------------------------------------


@dataclass
class Run:
    client: Client
    heic_job: str
    layer_job: str


@pytest.fixture(scope="module")
def run(module_redis_url: str, tiny_model: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("input-trust")
    redis = Redis.from_url(module_redis_url)
    keys = Keys()
    blobs = {}
    buf = io.BytesIO()
    helpers.page_image(3, (96, 96)).save(buf, "PNG")
    for name, data in {"lying.heic": lying_heic(), "fine.png": buf.getvalue()}.items():
        sha = hashlib.sha256(data).hexdigest()
        redis.set(keys.blob(sha), data)
        blobs[name] = sha
    # What a producer that skips the checks sends: the worker's decode is the last guard.
    payload = JobPayload(task="caption", items=tuple(
        Item(kind="image", blob=sha, source=name) for name, sha in blobs.items()),
        settings={"max_tokens": 4, "max_side": 112})
    heic_job = helpers.raw_enqueue(redis, payload.to_dict(), queue="caption")
    client = Client(module_redis_url)
    layer = client.ocr([hidden_text_pdf(tmp / "invoice.pdf")],
                       options=JobOptions(max_tokens=4, max_side=224, text_layer="prefer"))
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, name="wtrust"))
        yield Run(client, heic_job, layer.id)
    finally:
        helpers.stop_all(procs)
        client.close()
        redis.close()


@pytest.mark.slow
def test_the_worker_fails_the_lying_heic_alone(run: Run) -> None:
    job = run.client.job(run.heic_job)
    job.wait(timeout=240)
    got = {r.source: r for r in job.results()}
    assert set(got) == {"lying.heic", "fine.png"}, got
    assert got["fine.png"].ok and got["fine.png"].text, got["fine.png"]
    bad = got["lying.heic"]
    assert not bad.ok and "header says 64x64" in str(bad.error), bad


@pytest.mark.slow
def test_prefer_sends_pages_with_hidden_text_to_the_model(run: Run) -> None:
    results = helpers.finished_results(run.client, run.layer_job, timeout=240)
    assert [r.page for r in results] == [1, 2, 3, 4]
    for r in results[:3]:
        # The model read the page; its text, cut at max_tokens, may give way to the
        # layer's (the fallback rule), which is then the visible text only.
        assert r.ok and r.completion_tokens > 0, r
        assert r.text_source == "model" or r.model_text is not None, r
        assert "EVIL" not in (r.text or "") and "1,000,000" not in (r.text or ""), r
    assert results[3].text_source == "text_layer" and results[3].completion_tokens == 0
    assert " ".join((results[3].text or "").split()) == VISIBLE
