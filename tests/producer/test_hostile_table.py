"""Hostile input, table-driven, against one real worker.

Every case states what it sends (a PDF, an image, a payload, a raw queue entry, a job
hash, an id or a name) and the clear error it must get. The cases run in waves, each
alongside an innocent 3-item job; after each wave the worker must still be the same live
process, and the innocent job must have finished every item.
"""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from redis import Redis
from redis.exceptions import ResponseError

from tests.support import helpers
from tests.support.factories import OTHER_SHA, SHA, image_bytes, sha
from tests.support.helpers import make_images, pdf_bytes, wait_for
from tests.support.pdf_craft import (
    build_pdf,
    drawing_bomb_pdf,
    encrypted_pdf,
    one_page_pdf,
    zero_page_pdf,
)
from vlmq.cli.main import main
from vlmq.producer.client import Client, WaitTimeout
from vlmq.shared import constants as C
from vlmq.shared.blobs import BlobStore, sha256_hex
from vlmq.shared.enqueue import check_job_id, check_queue_name, lua_script
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import QUEUE_NAME_RE, Keys
from vlmq.shared.messages import PAYLOAD_MESSAGES

pytestmark = pytest.mark.slow
RENDER_MB = 256
KEYS = Keys()


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "item" | "job" | "entry" | "local"
    expect: str  # substring of the clear error; "" = the item/job must succeed
    make: Callable[[Redis], Any]


# --- inputs ------------------------------------------------------------------------------

def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    return image_bytes(size=size, mode=mode,
                       color=200 if mode in ("L", "I;16") else (200, 40, 40))


def _encoded(fmt: str, mode: str = "RGB") -> bytes:
    return image_bytes(fmt, (64, 64), color=0, mode=mode)


def _png_claiming(w: int, h: int) -> bytes:
    """A valid PNG header (right CRC) claiming a w x h canvas, with no pixel data."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82")


def _item_job(kind: str, data: bytes | None, *, page: int | None = 1, sha: str | None = None,
              raw_blob: bytes | None = None) -> Callable[[Redis], str]:
    """A one-item job over `data` (uploaded) or a blob key written raw."""
    def make(redis: Redis) -> str:
        blob = sha
        if data is not None:
            blob, _ = BlobStore(redis, KEYS).put(data)
        if raw_blob is not None:
            assert blob is not None
            redis.set(KEYS.blob(blob), raw_blob)
        item: dict[str, Any] = {"kind": kind, "blob": blob, "source": "hostile"}
        if kind == "pdf":
            item["page"] = page
        # Raw: enqueue.lua would refuse some of these itself; the worker must too.
        return helpers.raw_enqueue(redis, {"v": 1, "task": "ocr", "items": [item],
                                           "max_side": 56, "generation": {"max_tokens": 2}},
                                   queue="ocr")
    return make


INPUT_CASES = [
    Case("pdf: 2M drawing operations", "item", "too complex to render",
         _item_job("pdf", drawing_bomb_pdf(2_000_000))),
    Case("pdf: encrypted", "item", "encrypted (password-protected) PDF",
         _item_job("pdf", encrypted_pdf())),
    Case("pdf: zero pages", "item", "is a PDF with no pages", _item_job("pdf", zero_page_pdf())),
    Case("pdf: truncated", "item", "corrupt or truncated PDF",
         _item_job("pdf", pdf_bytes(3)[:900])),
    Case("pdf: junk after the magic", "item", "corrupt or truncated PDF",
         _item_job("pdf", b"%PDF-1.4 junk junk")),
    Case("pdf: page past the end", "item", "page 5 is out of range: the PDF has 3 page(s)",
         _item_job("pdf", pdf_bytes(3), page=5)),
    Case("pdf: page tree that loops", "item", "page 1 of 1 cannot be loaded",
         _item_job("pdf", build_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                                     b"<< /Type /Pages /Kids [2 0 R] /Count 1 >>"]))),
    Case("pdf: a PNG sent as a PDF", "item", "not a readable PDF",
         _item_job("pdf", _png((32, 32)))),
    Case("pdf: negative MediaBox renders", "item", "",
         _item_job("pdf", one_page_pdf(b"0 0 1 1 re f", media_box=b"[0 0 -612 -792]"))),
    Case("pdf: absurd MediaBox renders at max_side", "item", "",
         _item_job("pdf", one_page_pdf(b"0 0 1 1 re f", media_box=b"[0 0 1e308 1e308]"))),
    Case("pdf: operator soup renders", "item", "",
         _item_job("pdf", one_page_pdf(b"q Q Q BT ET Tj (x) Do /Nope Do 1 2 3 cm cm"))),
    Case("pdf: form XObject drawing itself", "item", "",
         _item_job("pdf", build_pdf([
             b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
             b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
             b"/Resources << /XObject << /X 5 0 R >> >> >>",
             b"<< /Length 6 >>\nstream\n/X Do\nendstream",
             b"<< /Type /XObject /Subtype /Form /BBox [0 0 10 10] /Resources << /XObject "
             b"<< /X 5 0 R >> >> /Length 6 >>\nstream\n/X Do\nendstream"]))),
    Case("blob: missing", "item", "is missing (expired, or never uploaded)",
         _item_job("image", None, sha=OTHER_SHA)),
    Case("blob: content does not match its sha256", "item", "does not match its sha256",
         _item_job("image", None, sha=sha(0), raw_blob=_png((8, 8)))),
    Case("blob: empty", "item", "not an image",
         _item_job("image", None, sha=sha256_hex(b""), raw_blob=b"")),
    Case("image: text bytes", "item", "not an image", _item_job("image", b"hello, world")),
    Case("image: SVG", "item", "not an image",
         _item_job("image", b"<svg xmlns='http://www.w3.org/2000/svg'/>")),
    Case("image: PDF sent as an image", "item", "not an image",
         _item_job("image", pdf_bytes(1))),
    Case("image: truncated JPEG", "item", "corrupt",
         _item_job("image", _encoded("JPEG")[:300])),
    Case("image: truncated PNG", "item", "corrupt",
         _item_job("image", _png((64, 64))[:60])),
    Case("image: truncated WebP", "item", "corrupt", _item_job("image", _encoded("WEBP")[:40])),
    Case("image: PNG header claiming 100000x100000", "item", "decompression bomb",
         _item_job("image", _png_claiming(100_000, 100_000))),
    Case("image: PNG header claiming 9000x9000 (81 Mpx)", "item", "over the limit",
         _item_job("image", _png_claiming(9000, 9000))),
    Case("image: 1x1 pixel", "item", "", _item_job("image", _png((1, 1)))),
    # Refused on its own ratio, whatever max_side would shrink it to.
    Case("image: 4000x1 sliver", "item", "an aspect ratio of 4000.0",
         _item_job("image", _png((4000, 1)))),
    Case("image: 150x1 sliver", "item", "", _item_job("image", _png((150, 1)))),
    Case("image: 16-bit grey", "item", "", _item_job("image", _png((48, 48), "I;16"))),
    Case("image: CMYK JPEG", "item", "", _item_job("image", _encoded("JPEG", "CMYK"))),
    Case("image: GIF", "item", "", _item_job("image", _encoded("GIF"))),
]


# --- payloads ----------------------------------------------------------------------------



def _payload(**over: Any) -> Callable[[Redis], str]:
    def make(redis: Redis) -> str:
        p: dict[str, Any] = {"v": 1, "task": "ocr", "max_side": 56,
                             "items": [{"kind": "image", "blob": SHA}]}
        p.update(over)
        p = {k: v for k, v in p.items() if v is not _DROP}
        return helpers.raw_enqueue(redis, p, queue="ocr")  # the worker's own checks
    return make


_DROP = object()


def _img(**over: Any) -> list[dict[str, Any]]:
    return [{"kind": "image", "blob": SHA, **over}]


PAYLOAD_CASES = [
    Case("payload: protocol v2", "job", "unsupported protocol version 2", _payload(v=2)),
    Case("payload: no version", "job", "unsupported protocol version None", _payload(v=_DROP)),
    Case("payload: unknown task", "job", "task: must be one of", _payload(task="translate")),
    Case("payload: empty items", "job", "items: must be a non-empty list", _payload(items=[])),
    Case("payload: items an object", "job", "items: must be a non-empty list",
         _payload(items={"0": {}})),
    Case("payload: 10001 items", "job", "has more than 10000 entries",
         _payload(items=_img() * 10_001)),
    Case("payload: item kind video", "job", "items[0].kind: must be one of",
         _payload(items=_img(kind="video"))),
    Case("payload: blob not hex", "job", "items[0].blob: must be a lowercase hex sha256",
         _payload(items=_img(blob="z" * 64))),
    Case("payload: blob upper case", "job", "items[0].blob: must be a lowercase hex",
         _payload(items=_img(blob="AB" * 32))),
    Case("payload: blob with a trailing newline", "job", "items[0].blob: must be a lowercase",
         _payload(items=_img(blob=SHA + "\n"))),
    Case("payload: pdf item without page", "job", "is required for a pdf item",
         _payload(items=_img(kind="pdf"))),
    Case("payload: page 0", "job", "items[0].page: " + PAYLOAD_MESSAGES["page"],
         _payload(items=_img(kind="pdf", page=0))),
    Case("payload: page as a string", "job", "items[0].page: " + PAYLOAD_MESSAGES["page"],
         _payload(items=_img(kind="pdf", page="1"))),
    Case("payload: page on an image", "job", "is only allowed on pdf and tiff items",
         _payload(items=_img(page=1))),
    Case("payload: unknown item field", "job", "items[0]: unknown field(s) ['url']",
         _payload(items=_img(url="http://x"))),
    Case("payload: unknown top-level field", "job", "unknown field(s) ['callback']",
         _payload(callback="http://x")),
    Case("payload: prompt over 20000 chars", "job", "prompt: is longer than 20000",
         _payload(prompt="x" * 20_001)),
    Case("payload: prompt with a lone surrogate", "job", "prompt: is not valid UTF-8 text",
         _payload(prompt="caf\ud800")),
    Case("payload: label with a lone surrogate", "job", "labels.k: is not valid UTF-8 text",
         _payload(labels={"k": "\udfff"})),
    Case("payload: prompt not a string", "job", "prompt: must be a string", _payload(prompt=7)),
    Case("payload: max_tokens 0", "job", "generation.max_tokens: must be between 1",
         _payload(generation={"max_tokens": 0})),
    Case("payload: max_tokens 10^9", "job", "generation.max_tokens: must be between 1",
         _payload(generation={"max_tokens": 10**9})),
    Case("payload: max_tokens true", "job", "generation.max_tokens: must be an integer",
         _payload(generation={"max_tokens": True})),
    Case("payload: temperature NaN", "job", "generation.temperature: must be between 0",
         _payload(generation={"temperature": float("nan")})),
    Case("payload: temperature -1", "job", "generation.temperature: must be between 0",
         _payload(generation={"temperature": -1})),
    Case("payload: 17 stop strings", "job", "generation.stop: has more than 16",
         _payload(generation={"stop": ["x"] * 17})),
    Case("payload: empty stop string", "job", "generation.stop[0]: must not be empty",
         _payload(generation={"stop": [""]})),
    Case("payload: label value a number", "job", "labels.n: must be a string",
         _payload(labels={"n": 1})),
    Case("payload: max_side 1", "job", "max_side: must be between 28", _payload(max_side=1)),
    Case("payload: another model", "job", "job asks for model 'other/model'",
         _payload(model="other/model")),
    Case("payload: generate without a prompt", "job", "prompt: is required for task generate",
         _payload(task="generate")),
]


# --- job hashes --------------------------------------------------------------------------

def _hash(field: str, value: bytes | None) -> Callable[[Redis], str]:
    def make(redis: Redis) -> str:
        job_id = _payload()(redis)
        if value is None:
            redis.hdel(KEYS.rq_job(job_id), field)
        else:
            redis.hset(KEYS.rq_job(job_id), field, value)
        return job_id
    return make


def _zlib_bomb(inflated: int) -> bytes:
    z = zlib.compressobj(9)
    out = z.compress(b'["vlmq.worker.task.run", null, [{"v": 1, "pad": "')
    for _ in range(inflated >> 20):
        out += z.compress(b" " * (1 << 20))
    return out + z.compress(b'"}], {}]') + z.flush()


def _tuple(value: Any) -> bytes:
    return zlib.compress(json.dumps(value).encode())


HASH_CASES = [
    Case("hash: no data field", "job", "has no data field", _hash("data", None)),
    Case("hash: data inflating to 1 GiB", "job", "inflates to more than 16 MiB",
         _hash("data", _zlib_bomb(1 << 30))),
    Case("hash: data nested 100000 deep", "job", "nests JSON deeper than 32 levels",
         _hash("data", zlib.compress(b"[" * 100_000 + b"]" * 100_000))),
    Case("hash: meta nested 50 deep", "job", "job meta nests JSON deeper",
         _hash("meta", b"[" * 50 + b"]" * 50)),
    Case("hash: created_at 'yesterday'", "job", "RQ cannot read its hash",
         _hash("created_at", b"yesterday")),
    Case("hash: status 'bogus'", "job", "RQ cannot read its hash", _hash("status", b"bogus")),
    Case("hash: timeout '86400.0'", "job", "job timeout '86400.0' is not a whole number",
         _hash("timeout", b"86400.0")),
    Case("hash: pickled data", "job", "job data is not JSON (a pickled job?)",
         _hash("data", zlib.compress(pickle.dumps(("os.system", None, ["true"], {}))))),
    Case("hash: data an object", "job", "[func, instance, args, kwargs]",
         _hash("data", _tuple({"func": "x"}))),
    Case("hash: another function", "job", "not a vlmq job: function 'os.system'",
         _hash("data", _tuple(["os.system", None, ["true"], {}]))),
    Case("hash: two arguments", "job", "a vlmq job takes exactly one argument, got 2",
         _hash("data", _tuple([C.TASK_FUNC, None, [{}, {}], {}]))),
    Case("hash: no origin (repaired, runs)", "job", "", _hash("origin", None)),
    Case("hash: payload a JSON list", "job", "payload: must be a JSON object",
         _hash("data", _tuple([C.TASK_FUNC, None, [[1, 2, 3]], {}]))),
]


# --- raw queue entries -------------------------------------------------------------------

def _entry(raw: bytes | str) -> Callable[[Redis], None]:
    def make(redis: Redis) -> None:
        redis.rpush(KEYS.rq_queue("ocr"), raw)
    return make


ENTRY_CASES = [
    Case("entry: bytes ff fe", "entry", "is not UTF-8 text", _entry(b"\xff\xfe")),
    Case("entry: lone continuation byte", "entry", "is not UTF-8 text", _entry(b"job\x80")),
    Case("entry: x:y", "entry", "is not a valid job id", _entry("x:y")),
    Case("entry: id with a trailing newline", "entry", "is not a valid job id",
         _entry("abc\n")),
    Case("entry: empty string", "entry", "is not a valid job id", _entry("")),
    Case("entry: 200-character id", "entry", "is not a valid job id", _entry("a" * 200)),
    Case("entry: id with a space", "entry", "is not a valid job id", _entry("a b")),
    Case("entry: 1 MB of text", "entry", "is not a valid job id", _entry("j" * (1 << 20))),
]


# --- ids and names (refused before anything reaches Redis) -------------------------------

def _raises(fn: Callable[[], object], exc: type[BaseException]) -> Callable[[Redis], str]:
    def make(_redis: Redis) -> str:
        try:
            fn()
        except exc as err:
            return str(err)
        return "accepted"
    return make


def _cli(*args: str) -> Callable[[Redis], str]:
    def make(redis: Redis) -> str:
        url = redis.connection_pool.connection_kwargs
        res = CliRunner().invoke(main, ["--redis-url",
                                        f"redis://{url['host']}:{url['port']}/{url['db']}",
                                            *args])
        return f"exit {res.exit_code}: {res.output}"
    return make


def _lua_id(job_id: str) -> Callable[[Redis], str]:
    def make(redis: Redis) -> str:
        try:
            redis.eval(lua_script(), 5, KEYS.rq_job(job_id), KEYS.rq_queue("ocr"), "rq:queues",
                       KEYS.job_items(job_id), KEYS.job_events(job_id), job_id, "ocr", "[]",
                       "d", 60, 60, 60, "2026-01-01T00:00:00.000000Z", 3)
        except ResponseError as err:
            return str(err)
        return "accepted"
    return make


LOCAL_CASES = [
    Case("name: queue 'ocr\\n'", "local", "invalid queue name",
         _raises(lambda: check_queue_name("ocr\n"), PayloadError)),
    Case("name: queue 'ocr:x'", "local", "invalid queue name",
         _raises(lambda: check_queue_name("ocr:x"), PayloadError)),
    Case("name: queue of 65 chars", "local", "invalid queue name",
         _raises(lambda: check_queue_name("q" * 65), PayloadError)),
    Case("id: job id 'abc\\n'", "local", "invalid job id",
         _raises(lambda: check_job_id("abc\n"), PayloadError)),
    Case("id: job id 'a/b'", "local", "invalid job id",
         _raises(lambda: check_job_id("a/b"), PayloadError)),
    Case("id: queue-name regex rejects a newline", "local", "rejected",
         lambda _r: "rejected" if QUEUE_NAME_RE.fullmatch("ocr\n") is None else "accepted"),
    Case("cli: enqueue --queue 'ocr\\n'", "local", "exit 2",
         _cli("enqueue", "ocr", str(Path(__file__)), "--queue", "ocr\n")),
    Case("cli: enqueue --job-id 'abc\\n'", "local", "exit 2",
         _cli("enqueue", "ocr", str(Path(__file__)), "--job-id", "abc\n")),
    Case("lua: job id 'abc\\n'", "local", "job_id: must match", _lua_id("abc\n")),
    Case("lua: job id 'x:y'", "local", "job_id: must match", _lua_id("x:y")),
]


def _worker_cli_queue(_redis: Redis) -> str:
    from vlmq.cli.worker import worker_cmd

    res = CliRunner().invoke(worker_cmd, ["--model", "/nonexistent", "--queues", "ocr:x"])
    return f"exit {res.exit_code}: {res.output}"


LOCAL_CASES.append(Case("cli: worker --queues 'ocr:x'", "local", "is not a queue name",
                        _worker_cli_queue))

ALL_CASES = INPUT_CASES + PAYLOAD_CASES + HASH_CASES + ENTRY_CASES + LOCAL_CASES


# --- the run -----------------------------------------------------------------------------

@pytest.fixture
def worker(redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
           ) -> Iterator[helpers.subprocess.Popen[str]]:
    proc = helpers.start_worker(redis_url, tiny_model, tmp_path, "--queues", "ocr",
                                "--max-batch", "4", "--render-mem-mb", str(RENDER_MB),
                                "--render-timeout", "60", name="hostile")
    try:
        wait_for(lambda: redis.exists(KEYS.worker_stats("hostile")) == 1, 120,
                 "the worker to start")
        yield proc
    finally:
        helpers.stop_all([proc])


def _innocent(client: Client, tmp_path: Path, wave: int) -> Any:
    images = make_images(tmp_path / f"innocent{wave}", 3, sizes=[(96, 96)])
    return client.ocr(images, max_tokens=2, max_side=56)


def _check(redis: Redis, client: Client, case: Case, made: Any) -> str | None:
    """None when the case got its clear error (or succeeded, if expected); else why not."""
    if case.kind == "local":
        return None if case.expect in str(made) else f"got {made!r}"
    if case.kind == "entry":
        reasons = [json.loads(x)["reason"] for x in redis.lrange(KEYS.dead, 0, -1)]
        return None if any(case.expect in r for r in reasons) else f"dead letters {reasons}"
    job = client.job(made)
    status = job.status()
    if case.kind == "item":
        results = list(job.results())
        if status != "finished" or len(results) != 1:
            return f"status {status}, {len(results)} results, error {job.error()!r}"
        err = results[0].error
        if not case.expect:
            return None if err is None else f"item failed: {err}"
        return None if err is not None and case.expect in err else f"item error {err!r}"
    if not case.expect:  # a job that must run: its one item fails on the fake blob only
        return None if status == "finished" else f"status {status}: {job.error()!r}"
    err = job.error() or ""
    return None if status == "failed" and case.expect in err else f"{status}: {err!r}"


def test_hostile_inputs_table(redis: Redis, redis_url: str, tmp_path: Path,
                              worker: helpers.subprocess.Popen[str]) -> None:
    assert len(ALL_CASES) >= 60
    client = Client(redis_url)
    failures: list[str] = []
    waves = [INPUT_CASES, PAYLOAD_CASES + HASH_CASES, ENTRY_CASES + LOCAL_CASES]
    for n, wave in enumerate(waves):
        innocent = _innocent(client, tmp_path, n)
        made = [(case, case.make(redis)) for case in wave]
        pending = [client.job(m) for c, m in made if c.kind in ("item", "job")]
        try:
            for job in [innocent, *pending]:
                job.wait(timeout=300)
        except WaitTimeout as exc:
            worker.kill()
            out, _ = worker.communicate(timeout=300)
            raise AssertionError(f"wave {n}: {exc}; worker output:\n{out[-6000:]}") from None
        wait_for(lambda: redis.llen(KEYS.rq_queue("ocr")) == 0
                 and redis.llen("rq:queue:ocr:intermediate") == 0, 60, "the queue to drain")
        for case, m in made:
            problem = _check(redis, client, case, m)
            if problem:
                failures.append(f"{case.name}: expected {case.expect!r}; {problem}")
        assert worker.poll() is None, f"the worker died in wave {n}"
        assert innocent.status() == "finished", f"wave {n}: innocent job {innocent.status()}"
        assert [r.error for r in innocent.results()] == [None] * 3, f"wave {n}"
    assert not failures, "\n".join(failures)
    worker.terminate()
    out, _ = worker.communicate(timeout=300)
    assert out.count("ready: model") == 1, "the worker restarted"
    assert "Traceback" not in out, out
