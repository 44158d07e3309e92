"""Protocol v1 on the wire: payload validation, the Lua enqueue path, and refusing pickle."""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.support.factories import SHA, with_path
from tests.support.helpers import Tripwire, raw_enqueue, worker_lifecycle
from vlmq.shared import constants as C
from vlmq.shared.enqueue import (
    enqueue,
    enqueue_lua,
    fetch_job,
    is_json_data,
    payload_of,
    raw_exc_info,
)
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import RQ_QUEUES, Keys
from vlmq.shared.messages import PAYLOAD_MESSAGES, Item, JobPayload, parse_payload
from vlmq.worker.jobs.rq_jobs import Refused, Running


def good_payload() -> dict[str, Any]:
    """A payload as a producer in another language would write it, by hand."""
    return {
        "v": 1,
        "task": "ocr",
        "items": [{"kind": "pdf", "blob": SHA, "source": "scan.pdf", "page": 1},
                  {"kind": "image", "blob": SHA, "source": "photo.jpg"}],
        "prompt": None,
        "generation": {"max_tokens": 256, "temperature": 0, "stop": []},
        "model": None,
        "max_side": 1280,
        "labels": {"team": "ops"},
        "created_at": "2026-11-29T10:00:00.000000Z",
    }


def mutate(path: str, value: Any) -> dict[str, Any]:
    """Copy of good_payload() with one dotted path set (or deleted when value is ...)."""
    return with_path(good_payload(), path, value)


MALFORMED = [
    ("wrong version", mutate("v", 2), "v", "unsupported protocol version 2"),
    ("version as string", mutate("v", "1"), "v", "unsupported protocol version"),
    ("items not a list", mutate("items", {"0": {}}), "items", "must be a non-empty list"),
    ("items empty", mutate("items", []), "items", "must be a non-empty list"),
    ("bad sha", mutate("items.0.blob", "ABC"), "items[0].blob", "sha256"),
    ("uppercase sha", mutate("items.1.blob", "AB" * 32), "items[1].blob", "sha256"),
    ("pdf item without page", mutate("items.0.page", ...), "items[0].page", "required"),
    ("page 0", mutate("items.0.page", 0), "items[0].page", PAYLOAD_MESSAGES["page"]),
    ("page on an image", mutate("items.1.page", 3), "items[1].page", "only allowed on pdf"),
    ("unknown item kind", mutate("items.1.kind", "video"), "items[1].kind", "must be one of"),
    ("bad temperature", mutate("generation.temperature", "hot"), "generation.temperature",
     "must be a number"),
    ("temperature out of range", mutate("generation.temperature", 50),
     "generation.temperature", "between 0 and 5"),
    ("max_tokens as bool", mutate("generation.max_tokens", True), "generation.max_tokens",
     "must be an integer"),
    ("unknown top-level field", mutate("priority", 5), "payload", "unknown field(s) ['priority']"),
    ("unknown item field", mutate("items.0.dpi", 300), "items[0]", "unknown field(s) ['dpi']"),
    ("unknown generation field", mutate("generation.top_k", 5), "generation",
     "unknown field(s) ['top_k']"),
    ("unknown task", mutate("task", "translate"), "task", "must be one of"),
    ("max_side too small", mutate("max_side", 8), "max_side", "between 28 and 8192"),
    ("label not a string", mutate("labels.team", 7), "labels.team", "must be a string"),
    ("generate without prompt", mutate("task", "generate"), "prompt", "required"),
    ("not an object", ["v", 1], "payload", "must be a JSON object"),
]


@pytest.mark.parametrize(("raw", "field", "needle"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_payload_errors_name_the_field(raw: Any, field: str, needle: str) -> None:
    with pytest.raises(PayloadError) as info:
        parse_payload(raw)
    assert info.value.field == field
    assert needle in info.value.problem
    assert str(info.value).startswith(field)


def test_good_payload_round_trips() -> None:
    parsed = parse_payload(good_payload())
    assert parsed.items[0] == Item(kind="pdf", blob=SHA, source="scan.pdf", page=1)
    assert parse_payload(json.loads(json.dumps(parsed.to_dict()))) == parsed


def test_malformed_payload_written_raw_fails_reading_with_the_field(redis: Redis) -> None:
    job_id = raw_enqueue(redis, mutate("items.0.page", 0), queue="ocr")
    refusal = "items[0].page: " + PAYLOAD_MESSAGES["page"]
    with pytest.raises(PayloadError, match="^" + re.escape(refusal)):
        payload_of(fetch_job(redis, job_id))


def test_lua_and_rq_paths_read_back_identically(redis: Redis) -> None:
    redis.set(Keys().blob(SHA), b"x")
    payload = parse_payload(good_payload())
    rq_id = enqueue(redis, payload, queue="ocr")
    lua_id = enqueue_lua(redis, payload.to_dict(), queue="ocr", job_id="from-lua-1")
    assert lua_id == "from-lua-1"

    via_rq = Job.fetch(rq_id, connection=redis, serializer=JSONSerializer)
    via_lua = Job.fetch(lua_id, connection=redis, serializer=JSONSerializer)
    assert via_lua.func_name == via_rq.func_name == C.TASK_FUNC
    assert via_lua.args == via_rq.args == [payload.to_dict()]
    assert via_lua.kwargs == via_rq.kwargs == {}
    assert payload_of(via_lua) == payload_of(via_rq) == payload
    assert via_lua.origin == via_rq.origin == "ocr"
    assert via_lua.get_status() == via_rq.get_status() == "queued"
    assert via_lua.timeout == via_rq.timeout == C.JOB_TIMEOUT_S
    assert via_lua.result_ttl == C.RESULT_TTL_S and via_lua.failure_ttl == C.FAILURE_TTL_S
    assert via_lua.enqueued_at is not None and via_lua.description

    assert redis.lrange(Keys.rq_queue("ocr"), 0, -1) == [rq_id.encode(), lua_id.encode()]
    assert redis.smembers(RQ_QUEUES) == {b"rq:queue:ocr"}
    assert Queue("ocr", connection=redis, serializer=JSONSerializer).job_ids == [rq_id, lua_id]
    # Same id twice: refused, nothing overwritten.
    with pytest.raises(PayloadError, match="already exists"):
        enqueue_lua(redis, payload.to_dict(), queue="ocr", job_id=lua_id)
    assert redis.llen(Keys.rq_queue("ocr")) == 2


def test_rq_job_hash_is_json_with_no_pickle(redis: Redis) -> None:
    job_id = enqueue(redis, parse_payload(good_payload()), queue="caption-x")
    fields = redis.hgetall(Keys.rq_job(job_id))
    data = zlib.decompress(fields[b"data"])
    assert json.loads(data)[0] == C.TASK_FUNC
    assert is_json_data(fields[b"data"])
    meta = fields.get(b"meta")
    if meta:
        json.loads(zlib.decompress(meta) if meta[:1] == b"x" else meta)
    for name, value in fields.items():
        raw = zlib.decompress(value) if name in (b"data", b"meta") and value[:1] == b"x" \
            else value
        assert not raw.startswith(b"\x80"), f"field {name!r} looks pickled"
    for field in (b"origin", b"timeout", b"result_ttl", b"failure_ttl", b"description",
                  b"created_at", b"enqueued_at", b"status"):
        assert fields.get(field), field
    assert fields[b"origin"] == b"caption-x"


def test_pickled_job_is_refused_and_never_unpickled(redis: Redis, tmp_path: Path) -> None:
    flag = tmp_path / "tripped"
    payload = copy.deepcopy(good_payload())
    payload["prompt"] = Tripwire(flag)
    # rq's default serializer is pickle: this is what a careless or hostile producer sends.
    pickled = Queue("ocr", connection=redis).enqueue_call(func=C.TASK_FUNC, args=[payload])
    raw = redis.hget(Keys.rq_job(pickled.id), "data")
    assert zlib.decompress(raw).startswith(b"\x80") and not is_json_data(raw)

    with pytest.raises(PayloadError, match=r"^data: job data is not JSON \(a pickled job\?\)"):
        payload_of(fetch_job(redis, pickled.id))
    assert not flag.exists(), "the pickled job was unpickled"


def test_payload_of_refuses_other_functions(redis: Redis) -> None:
    job = Queue("ocr", connection=redis, serializer=JSONSerializer).enqueue_call(
        func="os.system", args=["echo hi"])
    with pytest.raises(PayloadError, match="not a vlmq job"):
        payload_of(fetch_job(redis, job.id))


def test_payload_dataclass_defaults_are_valid() -> None:
    payload = JobPayload(task="caption", items=(Item("image", SHA, "a.png"),))
    assert parse_payload(payload.to_dict()).v == C.PROTOCOL_VERSION


def test_enqueue_refuses_an_existing_job_id_even_when_racing(redis_url: str,
                                                             redis: Redis) -> None:
    payload = parse_payload(good_payload())
    first = enqueue(redis, payload, queue="ocr", job_id="taken")
    with pytest.raises(PayloadError, match=r"^job_id: a job with id taken already exists$"):
        enqueue(redis, payload, queue="other", job_id="taken")
    assert fetch_job(redis, first).origin == "ocr"
    assert redis.lrange(Keys.rq_queue("ocr"), 0, -1) == [b"taken"]
    assert not redis.exists(Keys.rq_queue("other"))

    # Eight producers, each on its own connection, race for one id: exactly one wins.
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def producer(n: int) -> None:
        conn = Redis.from_url(redis_url)
        barrier.wait()
        try:
            enqueue(conn, payload, queue=f"q{n}", job_id="raced")
            outcomes.append(f"won q{n}")
        except PayloadError:
            outcomes.append("refused")
        finally:
            conn.close()

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("refused") == 7
    origin = fetch_job(redis, "raced").origin
    assert winners == [f"won {origin}"]
    assert sum(redis.llen(Keys.rq_queue(f"q{n}")) for n in range(8)) == 1


def _latest_result_entry(redis: Redis, job_id: str) -> dict[bytes, bytes]:
    """PROTOCOL.md section 6, step by step: the newest entry of `rq:results:<id>`."""
    entries = redis.xrevrange(f"rq:results:{job_id}", "+", "-", count=1)
    assert len(entries) == 1
    _entry_id, fields = entries[0]
    return dict(fields)


def test_failed_and_finished_jobs_decode_without_rq(redis: Redis) -> None:
    ok_id = enqueue(redis, parse_payload(good_payload()), queue="ocr")
    bad_id = enqueue(redis, parse_payload(good_payload()), queue="ocr")
    summary = {"items": 2, "ok": 1, "failed": 1, "prompt_tokens": 30,
               "completion_tokens": 12, "wall_s": 1.5, "cache_hits": 1}
    message = "model mismatch: job wants m1, this worker serves m2 — naïve"
    with worker_lifecycle(redis, ["ocr"]) as life:
        ok, bad = life.take(), life.take()
        assert isinstance(ok, Running) and isinstance(bad, Running)
        life.succeed(ok, summary)
        life.fail(bad, message)

    # Finished: status, then the summary in the terminal event its end hash keeps
    # (sections 5, 6, revision 3), beside the payload the job hash's `data` no longer
    # holds; RQ's results stream holds no entry for it.
    assert redis.hget(Keys.rq_job(ok_id), "status") == b"finished"
    assert not redis.hexists(Keys.rq_job(ok_id), "vlmq_end")
    end = json.loads(redis.hget(Keys().job_end(ok_id), "event"))
    assert end["type"] == "finished" and end["summary"] == summary
    assert redis.hget(Keys.rq_job(ok_id), "data") == C.MOVED_DATA.encode()
    assert payload_of(fetch_job(redis, ok_id, Keys())) == parse_payload(good_payload())
    assert not redis.exists(f"rq:results:{ok_id}")
    # Failed: the plain message in the kept `failed` event...
    failed_end = json.loads(redis.hget(Keys.rq_job(bad_id), "vlmq_end"))
    assert failed_end == {"type": "failed", "error": message, "id": failed_end["id"]}

    # ...and RQ's entry: type 2 and exc_string = base64 of zlib of the UTF-8 message.
    assert redis.hget(Keys.rq_job(bad_id), "status") == b"failed"
    fields = _latest_result_entry(redis, bad_id)
    assert fields[b"type"] == b"2"
    text = zlib.decompress(base64.b64decode(fields[b"exc_string"])).decode("utf-8")
    assert text == message
    assert not redis.hexists(Keys.rq_job(bad_id), "exc_info")  # not where it lives
    # RQ's own reader agrees with the plain decoding above.
    latest = fetch_job(redis, bad_id).latest_result()
    assert latest is not None and latest.exc_string == text


def test_unloadable_job_failure_is_plain_text_in_exc_info(redis: Redis) -> None:
    redis.set(Keys().blob(SHA), b"x")
    job_id = enqueue_lua(redis, good_payload(), queue="ocr")
    redis.hset(Keys.rq_job(job_id), "created_at", "yesterday")
    with worker_lifecycle(redis, ["ocr"]) as life:
        assert isinstance(life.take(), Refused)
    assert redis.hget(Keys.rq_job(job_id), "status") == b"failed"
    assert not redis.exists(f"rq:results:{job_id}")
    text = redis.hget(Keys.rq_job(job_id), "exc_info").decode("utf-8")
    assert text.startswith(f"vlmq refused job {job_id}: RQ cannot read its hash")
    assert raw_exc_info(redis, job_id) == text


@pytest.mark.parametrize(("arg", "value", "needle"), [
    (0, "bad id!", "job_id: must match"),
    (1, "bad queue!", "queue: must match"),
    (4, "86400.0", "timeout: must be a positive whole number"),
    (4, "0", "timeout: must be a positive whole number"),
    (5, "1h", "result_ttl: must be a positive whole number"),
    (5, "-5", "result_ttl: must be a positive whole number"),
    (6, "-1", "failure_ttl: must be a positive whole number"),
    (7, "yesterday", "now: must be UTC"),
    (7, "2026-11-29T12:00:00Z", "now: must be UTC"),
    (7, "2026-11-29T12:00:00.1234567Z", "1 to 6 fraction digits"),
    (8, "three", "retries_left: must be a whole number from 0 to 10"),
    (8, "11", "retries_left: must be a whole number from 0 to 10"),
    (8, "1e20", "retries_left: must be a whole number from 0 to 10"),
])
def test_lua_refuses_malformed_arguments_by_name(redis: Redis, arg: int, value: str,
                                                 needle: str) -> None:
    from redis.exceptions import ResponseError

    from vlmq.shared.enqueue import lua_script

    keys = Keys()
    args = ["j1", "ocr", json.dumps([C.TASK_FUNC, None, [{}], {}]), "d", "60", "60", "60",
            "2026-11-29T12:00:00.000000Z", "3"]
    args[arg] = value
    job_id, queue = args[0], args[1]
    before = redis.dbsize()
    with pytest.raises(ResponseError, match=needle):
        redis.eval(lua_script(), 5, f"rq:job:{job_id}", f"rq:queue:{queue}", RQ_QUEUES,
                   keys.job_items(job_id), keys.job_events(job_id), *args)
    assert redis.dbsize() == before


def test_lua_refuses_an_id_whose_old_results_remain(redis: Redis) -> None:
    keys = Keys()
    redis.hset(keys.job_items("reused"), "0", "{}")  # left by an earlier, deleted job
    redis.set(keys.blob(SHA), b"x")
    with pytest.raises(PayloadError, match="already exists"):
        enqueue_lua(redis, good_payload(), queue="ocr", job_id="reused")
    assert not redis.exists("rq:job:reused")
