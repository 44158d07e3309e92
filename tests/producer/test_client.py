"""The Python client against a real Redis: enqueue, blobs, job handle, queues, workers."""

from __future__ import annotations

import io
import json
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis
from rq import Queue, SimpleWorker, Worker
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from tests.support.helpers import following_events, pdf_bytes, wait_for, worker_lifecycle
from tests.support.lua_calls import write_items
from vlmq.producer import Client, JobFailed, JobNotFound, WaitTimeout, inputs, sample_files
from vlmq.producer.client import wait_all
from vlmq.producer.page_specs import PagesWithoutPdf
from vlmq.shared import constants as C
from vlmq.shared.enqueue import fetch_job, is_json_data, payload_of
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult


def png_bytes(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), color).save(buf, "PNG")
    return buf.getvalue()


def item_result(index: int, source: str, page: int | None, text: str | None,
                error: str | None = None) -> ItemResult:
    return ItemResult(index=index, source=source, page=page, text=text,
                      finish_reason=None if error else "stop", prompt_tokens=10,
                      completion_tokens=5, vision_cache_hit=False, error=error)


def finish(redis: Redis, job_id: str, summary: dict[str, object]) -> None:
    """What the worker's success path leaves behind: a result entry and status finished."""
    job = fetch_job(redis, job_id)
    Result.create(job, Result.Type.SUCCESSFUL, ttl=60, return_value=summary)
    job.set_status(JobStatus.FINISHED)


@pytest.fixture
def client(redis_url: str) -> Client:
    c = Client(redis_url, prefix="vlmq")
    yield c
    c.close()


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "doc.pdf"
    path.write_bytes(pdf_bytes(8))
    return path


def blob_keys(redis: Redis) -> list[bytes]:
    return sorted(redis.scan_iter(match="vlmq:blob:*"))


def test_ocr_enqueues_a_json_rq_job(client: Client, redis: Redis, doc: Path) -> None:
    job = client.ocr([doc], "1-3,7", max_side=1024, prompt="Read it.", max_tokens=512,
                     temperature=0.0, stop=["</page>"], labels={"batch": "b1"}, model="m")
    assert (job.queue, job.items, job.blobs, job.uploaded) == ("ocr", 4, 1, 1)
    assert job.status() == "queued"
    assert redis.lrange("rq:queue:ocr", 0, -1) == [job.id.encode()]

    rq_job = fetch_job(redis, job.id)
    assert rq_job.func_name == C.TASK_FUNC
    assert rq_job.origin == "ocr"
    assert rq_job.timeout == C.JOB_TIMEOUT_S
    assert rq_job.result_ttl == C.RESULT_TTL_S
    assert rq_job.failure_ttl == C.FAILURE_TTL_S
    assert rq_job.description.startswith("vlmq ocr: 4 item(s) from ")
    payload = payload_of(rq_job)
    assert [i.page for i in payload.items] == [1, 2, 3, 7]
    assert {i.kind for i in payload.items} == {"pdf"}
    assert (payload.get("prompt"), payload.get("max_side"), payload.get("model")) == (
        "Read it.", 1024, "m")
    assert payload.get("stop") == ("</page>",)
    assert dict(payload.labels) == {"batch": "b1"}

    raw = redis.hget(f"rq:job:{job.id}", "data")
    assert is_json_data(raw) and b"\x80" not in zlib.decompress(raw)
    func, _, args, _ = json.loads(zlib.decompress(raw))
    assert func == C.TASK_FUNC and args[0]["items"][3]["page"] == 7
    # The uploaded blob is the file's exact bytes.
    assert client.blobs.get(payload.items[0].blob) == doc.read_bytes()


def test_same_file_twice_uploads_one_blob(client: Client, redis: Redis, doc: Path,
                                          tmp_path: Path) -> None:
    first = client.ocr([doc])
    copy = tmp_path / "copy.pdf"
    copy.write_bytes(doc.read_bytes())
    second = client.ocr([doc, copy], pages="1")
    assert (first.uploaded, first.items) == (1, 8)
    assert (second.uploaded, second.blobs, second.items) == (0, 1, 2)
    assert len(blob_keys(redis)) == 1
    _, uploaded = client.blobs.put(doc.read_bytes())
    assert uploaded is False


def test_mixed_ocr_set_image_is_one_page(client: Client, doc: Path, tmp_path: Path) -> None:
    img = tmp_path / "scan.jpg"
    img.write_bytes(png_bytes((9, 9, 9)))  # a PNG named .jpg: content decides
    job = client.ocr([img, doc], pages=[2])
    items = job.payload().items
    assert [(i.kind, i.page) for i in items] == [("image", None), ("pdf", 2)]


def test_bad_input_writes_nothing(client: Client, redis: Redis, doc: Path,
                                  tmp_path: Path) -> None:
    before = redis.dbsize()
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(InputError, match=r"bad\.png: is neither a PDF nor an image"):
        client.ocr([doc, bad])
    with pytest.raises(InputError, match="page 9 is out of range"):
        client.ocr([doc], "9")
    # Bad settings are caught by the same validation the worker runs, also before upload.
    with pytest.raises(PayloadError, match="max_side"):
        client.ocr([doc], max_side=5)
    with pytest.raises(PayloadError, match=r"^temperature: must be between 0 and 5"):
        client.caption([doc], temperature=9.0)
    assert redis.dbsize() == before


def test_caption_skip_bad_exposes_rejected(client: Client, tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    for i in range(3):
        (tmp_path / "set" / f"ok{i}.png").write_bytes(png_bytes((i, 0, 0)))
    (tmp_path / "set" / "empty.png").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.png: is empty"):
        client.caption([tmp_path / "set"])
    job = client.caption([tmp_path / "set"], skip_bad=True, prompt="Describe.")
    assert job.items == 3 and job.queue == "caption"
    assert [(Path(p).name, r) for p, r in job.rejected] == [("empty.png", "is empty")]
    assert job.payload().task == "caption"


def test_generate_needs_a_prompt_and_uses_its_queue(client: Client, tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(png_bytes((1, 1, 1)))
    with pytest.raises(PayloadError, match="prompt"):
        client.generate([img], "")
    job = client.generate(str(img), "Count the circles.")  # a bare str is one path
    assert (job.queue, job.items, job.payload().get("prompt")) == ("generate", 1,
                                                                   "Count the circles.")


def test_bundled_samples_enqueue(client: Client) -> None:
    samples = sample_files()
    assert set(samples) == {"document.pdf", "red_circle.png", "blue_square.png",
                            "yellow_triangle.jpg"}
    assert sum(p.stat().st_size for p in samples.values()) < 200 * 1024
    job = client.ocr([samples["document.pdf"]])
    assert job.items == 3
    assert client.caption(list(samples.values())).items == 6


def test_job_handle_progress_results_summary(client: Client, redis: Redis, keys: Keys,
                                             doc: Path) -> None:
    job = client.ocr([doc], "1-3")
    same = client.job(job.id)
    assert (same.id, same.queue, same.items) == (job.id, "ocr", 3)
    assert job.progress() == (0, 3)
    write_items(redis, keys, job.id, item_result(2, str(doc), 3, "third"))
    write_items(redis, keys, job.id, item_result(0, str(doc), 1, None, error="boom"))
    assert job.progress() == (2, 3)
    assert [r.index for r in job.results()] == [0, 2]
    assert job.failed_items() == 1
    assert job.summary() is None and job.error() is None
    finish(redis, job.id, {"items": 3, "ok": 2, "failed": 1})
    assert job.status() == "finished"
    assert job.summary() == {"items": 3, "ok": 2, "failed": 1}


def test_unknown_job(client: Client) -> None:
    with pytest.raises(JobNotFound, match="nope"):
        client.job("nope")


def test_wait_times_out_on_a_queued_job(client: Client, doc: Path) -> None:
    job = client.ocr([doc], "1")
    with pytest.raises(WaitTimeout) as info:
        job.wait(timeout=0.6)
    assert str(info.value).startswith("timed out after 0.6s: 0/1 items done; still pending")
    assert info.value.statuses == {job.id: "queued"}
    assert (info.value.done, info.value.total) == (0, 1)


def test_wait_wakes_when_the_job_finishes(client: Client, redis: Redis, keys: Keys,
                                          doc: Path) -> None:
    job = client.ocr([doc], "1-2")

    def work() -> None:
        # Once the wait blocks on the job's events (Redis lists it in XREAD), not before.
        wait_for(lambda: following_events(redis), 120, "the wait to follow the job's events")
        for i in range(2):
            write_items(redis, keys, job.id, item_result(i, "doc.pdf", i + 1, "x"))
        finish(redis, job.id, {"items": 2})

    seen: list[tuple[str, int, int, bool]] = []

    class Recorded:
        def __init__(self, total: int, label: str) -> None:
            self.total, self.label = total, label

        def update(self, done: int, *, final: bool = False) -> None:
            seen.append((self.label, self.total, done, final))

    t = threading.Thread(target=work)
    t.start()
    assert wait_all([job], timeout=300, progress=lambda _stack, total, label:
                    Recorded(total, label)) == {job.id: "finished"}
    t.join()
    # The library only reports: the counts reach the caller's progress, last one final.
    assert seen[-1] == ("items", 2, 2, True) and not any(final for *_, final in seen[:-1])
    assert job.wait(timeout=60, check=True) == "finished"


def test_a_failed_job_reports_its_error(client: Client, redis: Redis, tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(png_bytes((5, 5, 5)))
    job = client.caption([img])
    # A plain RQ worker runs the placeholder task, which fails the job on purpose: a real
    # failure through RQ's own code path.
    SimpleWorker(["caption"], connection=redis, serializer=JSONSerializer).work(burst=True)
    assert job.wait(timeout=60) == "failed"
    assert "vlmq worker" in (job.error() or "")
    with pytest.raises(JobFailed, match=f"job {job.id} failed: .*WrongWorkerError"):
        job.wait(timeout=60, check=True)


def test_queues_and_workers(client: Client, redis: Redis, keys: Keys, doc: Path) -> None:
    client.ocr([doc], "1")
    client.ocr([doc], "2", queue="ocr-high")
    queues = client.queues()
    assert {n: q.queued for n, q in queues.items()} == {"ocr": 1, "ocr-high": 1}

    worker = Worker(["ocr"], connection=redis, name="w1", serializer=JSONSerializer)
    worker.register_birth()
    redis.sadd(keys.workers, "w1", "gone")
    redis.hset(keys.worker_stats("w1"), mapping={"model": "tiny", "in_flight": "3",
                                                 "tokens_per_s": "41.5"})
    infos = client.workers()
    assert [w.name for w in infos] == ["w1"]  # "gone" has no stats and no RQ worker
    assert infos[0].queues == ("ocr",)
    assert infos[0].stats == {"model": "tiny", "in_flight": "3", "tokens_per_s": "41.5"}
    worker.register_death()


def test_client_reads_env(monkeypatch: pytest.MonkeyPatch, redis_url: str, doc: Path) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("VLMQ_PREFIX", "other")
    with Client() as c:
        job = c.ocr([doc], "1")
        assert c.keys.prefix == "other"
        items_key = c.keys.job_items(job.id)
        assert items_key.startswith("other:job:")
        assert list(c.redis.scan_iter(match="other:blob:*"))
    assert Queue("ocr", connection=Redis.from_url(redis_url)).count == 1


@pytest.mark.parametrize("change", ["other size", "same size"])
def test_file_changed_after_validation_enqueues_nothing(client: Client, redis: Redis,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        change: str) -> None:
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(png_bytes((1, 2, 3)))
    second.write_bytes(png_bytes((4, 5, 6)))
    real_prepare = inputs.prepare

    def prepare_then_edit(*args: Any, **kwargs: Any) -> Any:
        prepared = real_prepare(*args, **kwargs)
        data = second.read_bytes()
        # Someone rewrites the file between validation and upload.
        second.write_bytes(data + b"tail" if change == "other size"
                           else data[:-1] + bytes([data[-1] ^ 0xFF]))
        return prepared

    monkeypatch.setattr(inputs, "prepare", prepare_then_edit)
    with pytest.raises(InputError, match=r"b\.png: changed since it was validated"):
        client.caption([first, second])
    assert list(redis.scan_iter(match="rq:*")) == []  # no job, no queue
    # a.png may already be stored: content-addressed and expiring, so harmless.
    assert len(blob_keys(redis)) <= 1


def test_existing_job_id_is_refused(client: Client, redis: Redis, keys: Keys,
                                    doc: Path) -> None:
    first = client.ocr([doc], "1", job_id="fixed-1")
    assert first.id == "fixed-1"
    with pytest.raises(PayloadError, match=r"^job_id: a job with id fixed-1 already exists$"):
        client.ocr([doc], "2-3", job_id="fixed-1")
    assert [i.page for i in client.job("fixed-1").payload().items] == [1]
    assert redis.lrange("rq:queue:ocr", 0, -1) == [b"fixed-1"]
    # The RQ job is gone but its item results are not: a new job must not inherit them.
    write_items(redis, keys, "gone-1", item_result(0, "doc.pdf", 1, "old text"))
    with pytest.raises(PayloadError, match="a job with id gone-1 already exists"):
        client.ocr([doc], "1", job_id="gone-1")
    assert not redis.exists("rq:job:gone-1")


def test_job_handle_for_a_job_the_worker_refused(client: Client, redis: Redis) -> None:
    pickled = Queue("ocr", connection=redis).enqueue_call(func=C.TASK_FUNC, args=[{"v": 1}])
    job = client.job(pickled.id)
    assert job.problem is not None and job.problem.startswith("data: job data is not JSON")
    assert (job.status(), job.items, job.error()) == ("queued", 0, None)
    with worker_lifecycle(redis, ["ocr"]) as life:
        life.take()
    assert job.status() == "failed"
    assert f"vlmq refused job {pickled.id}: data: job data is not JSON" in (job.error() or "")
    with pytest.raises(JobFailed, match="not JSON"):
        job.wait(timeout=60, check=True)


def test_bad_redis_url_names_it() -> None:
    with pytest.raises(ValueError, match=r"^invalid Redis URL 'nope': "):
        Client("nope")


def test_job_labels_come_from_the_payload(client: Client, doc: Path) -> None:
    job = client.ocr([doc], labels={"batch": "b7", "owner": "ann"})
    assert job.labels == {"batch": "b7", "owner": "ann"}
    assert client.job(job.id).labels == {"batch": "b7", "owner": "ann"}
    assert client.job(client.ocr([doc]).id).labels == {}


def test_job_labels_of_an_unreadable_job_are_empty(client: Client, redis: Redis) -> None:
    pickled = Queue("ocr", connection=redis).enqueue_call(func=C.TASK_FUNC, args=[{"v": 1}])
    assert client.job(pickled.id).labels == {}


def test_pages_without_a_pdf_is_refused(client: Client, redis: Redis, tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(png_bytes((9, 9, 9)))
    before = redis.dbsize()
    with pytest.raises(PagesWithoutPdf,
                       match=r"^pages applies to PDFs and multi-page TIFFs, and none of the "
                             r"inputs is one$"):
        client.ocr([img], pages="1")
    with pytest.raises(InputError):  # an InputError like any other bad input
        client.ocr([img], pages=[1, 2])
    assert redis.dbsize() == before
    assert client.ocr([img]).items == 1  # without pages it is fine
