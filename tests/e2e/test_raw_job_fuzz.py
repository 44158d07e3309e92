"""Hundreds of hostile raw jobs beside valid ones, through one real worker.

A producer in another language writes RQ's hash and pushes its id with plain Redis
commands, so anything can arrive: every field of the hash and of the payload of any type,
numbers too long to convert, JSON nested past any parser, bytes that are not UTF-8, data
that is not JSON, the job's keys of another Redis type, fields missing, ids that are not
ids. Generated from a fixed seed, N_HOSTILE of them go into one queue shuffled among
N_VALID real jobs; one worker (--burst) takes them all. It must exit 0, the valid jobs
must end with the text they get alone, and each hostile job must end failed or
dead-lettered exactly once, with a reason, and never be taken again.
"""

from __future__ import annotations

import json
import pickle
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support import helpers
from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.shared import bounded_reads
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.blobs import BlobStore
from vlmq.shared.keys import KEY_TABLE, Keys
from vlmq.shared.messages import parse_payload, utc_now_iso

SEED = 4040
N_HOSTILE = 600
N_VALID = 20
JUNK_BESIDE = 0.4  # the share of valid jobs with junk in one of their own keys
QUEUE = "fuzz"
OPTS = JobOptions(max_tokens=4, max_side=56, queue=QUEUE)
KEYS = Keys()
# The keys of one job and their protocol types (rq:job:<id> among them).
JOB_KEYS = [k for k in KEY_TABLE if k.params == ("job_id",)]
REDIS_TYPES = ("string", "list", "set", "zset", "hash", "stream")
# Every field RQ keeps in a job hash, and vlmq's own.
HASH_FIELDS = ("data", "origin", "description", "timeout", "result_ttl", "failure_ttl",
               "created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat",
               "status", "meta", "retries_left", "retry_intervals", "worker_name", "exc_info",
               "result", "dependency_ids", "ttl", "group_id", "repeats_left",
               "success_callback_name", "failure_callback_name", "stopped_callback_name",
               "success_callback_timeout", "failure_callback_timeout",
               C.FIRST_STARTED_FIELD)
PAYLOAD_FIELDS = (*sorted(S.WIRE_FIELDS), "unknown")
ITEM_FIELDS = ("kind", "blob", "source", "page", "custom_id", "ref", "sha256", "size", "text",
               "unknown")

pytestmark = pytest.mark.slow


# --- hostile values ------------------------------------------------------------------------

class Raw:
    """JSON text put verbatim into a document: numbers json.dumps would not write (4,401
    digits raise in Python itself), and the document's shape is kept."""

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(value: Any) -> str:
    """json.dumps, with each Raw written as its text."""
    raws: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    text = json.dumps(swap(value))
    for i, raw in enumerate(raws):
        text = text.replace(f'"\\u0000raw{i}\\u0000"', raw)
    return text


def deep(depth: int, leaf: str = "1") -> Raw:
    """Lists nested `depth` deep, as text (Python's own json would recurse)."""
    return Raw("[" * depth + leaf + "]" * depth)


def hostile_value(rng: random.Random) -> Any:
    """A JSON value of any type, size or shape that no field of the protocol accepts in
    every place (the payload filter below keeps only what is refused)."""
    makers: list[Callable[[], Any]] = [
        lambda: Raw("1" + "0" * 4400),  # the 4,401 digits
        lambda: Raw("-" + "9" * rng.randint(4301, 6000)),
        lambda: Raw("9" * rng.randint(101, 400)),  # converts, but overflows a float
        lambda: Raw(f"1e{rng.randint(309, 99999)}"),  # inf
        lambda: Raw("-1e999"),
        lambda: Raw("NaN"),
        lambda: Raw("Infinity"),
        lambda: Raw("0." + "1" * rng.randint(101, 3000)),
        lambda: rng.randint(-2**70, 2**70),
        lambda: rng.choice([-1, 0, 2**31, 2**63, -2**63 - 1]),
        lambda: rng.uniform(-1e300, 1e300),
        lambda: rng.choice([True, False]),
        lambda: "",
        lambda: "x" * rng.randint(1, 200_000),
        lambda: "caf\ud800",  # a lone surrogate: never valid UTF-8
        lambda: "\x00\x1b[31m\n",
        lambda: [],
        lambda: [rng.randint(0, 9)] * rng.randint(1, 50),
        lambda: {},
        lambda: {"unknown": 1},
        lambda: deep(rng.randint(33, 3000)),
        lambda: {"a": deep(40, "1" + "0" * 5000)},
        lambda: [Raw("1" + "0" * 4400), "x"],
    ]
    return rng.choice(makers)()


def hostile_bytes(rng: random.Random) -> bytes:
    """A raw hash field value: not necessarily text, JSON or a number."""
    makers: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: rng.randbytes(rng.randint(1, 64)),
        lambda: b"\xff\xfe\x80" * rng.randint(1, 10),
        lambda: b"1" + b"0" * 4400,
        lambda: b"9" * rng.randint(20, 400),
        lambda: b"-" + b"9" * rng.randint(1, 30),
        lambda: b"1e999",
        lambda: b"nan",
        lambda: b"86400.0",
        lambda: b"0",
        lambda: b"-1",
        lambda: b"yesterday",
        lambda: b"2024-13-45T99:99:99.000000Z",
        lambda: b"null",
        lambda: b"[]",
        lambda: b"{}",
        lambda: b"[" * 5000 + b"]" * 5000,
        lambda: b'{"a": ' + b"1" * 5000 + b"}",
        lambda: zlib.compress(b"[" * 100_000 + b"]" * 100_000),
        lambda: b"x" * rng.randint(1, 100_000),
        lambda: dumps(hostile_value(rng)).encode("utf-8", "surrogatepass"),
    ]
    return rng.choice(makers)()


# --- hostile jobs --------------------------------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    kind: str  # what it is, for the assertion messages
    entry: bytes  # what was pushed onto the queue
    job_id: str | None  # the id whose keys the test wrote, if any


def valid_payload(blob: str) -> dict[str, Any]:
    return {"v": 1, "task": "caption", "items": [{"kind": "image", "blob": blob,
                                                  "source": "a.png"}],
            "max_side": 56, "generation": {"max_tokens": 2}}


def is_refused(data: str) -> bool:
    """Whether vlmq refuses this job data: over a bound, or not a valid payload. Only such
    payloads count as hostile (a mutation can leave a valid job)."""
    try:
        wire = bounded_reads.loads(data)
        parse_payload(wire[2][0])
    except Exception:  # noqa: BLE001  # any refusal or crash: hostile either way
        return True
    return False


def bad_payload(rng: random.Random, blob: str) -> Any:
    """A payload vlmq must refuse: one field, item field or setting given a hostile value
    or left out, or the payload itself replaced."""
    while True:
        payload: Any = valid_payload(blob)
        how = rng.randrange(5)
        if how == 0:
            payload[rng.choice(PAYLOAD_FIELDS)] = hostile_value(rng)
        elif how == 1:
            payload["generation"][rng.choice(("max_tokens", "temperature", "stop",
                                              "unknown"))] = hostile_value(rng)
        elif how == 2:
            payload["items"][0][rng.choice(ITEM_FIELDS)] = hostile_value(rng)
        elif how == 3:
            for name in rng.sample(["v", "task", "items"], rng.randint(1, 3)):
                del payload[name]
            if "items" in payload and rng.random() < 0.5:
                del payload["items"][0][rng.choice(("kind", "blob"))]
        else:
            payload = hostile_value(rng)
        if is_refused(wire_data([payload])):
            return payload


def wire_data(args: Any, func: Any = C.TASK_FUNC, kwargs: Any = None) -> str:
    return dumps([func, None, args, {} if kwargs is None else kwargs])


def bad_data(rng: random.Random, blob: str) -> bytes:
    """A `data` field that is no vlmq job: not JSON, not text, not RQ's array, another
    function, the wrong arguments, or a refused payload; zlib-compressed or not."""
    makers: list[Callable[[], bytes | str]] = [
        lambda: rng.randbytes(rng.randint(1, 300)),
        lambda: b'["' + C.TASK_FUNC.encode() + b'", null, [{"v": 1, "task": "\xff\xfe"}], {}]',
        lambda: dumps(hostile_value(rng)),
        lambda: wire_data([bad_payload(rng, blob)]),
        lambda: wire_data([bad_payload(rng, blob)])[:-rng.randint(1, 20)],  # truncated
        lambda: wire_data(hostile_value(rng)),
        lambda: wire_data([], ),
        lambda: wire_data([valid_payload(blob), valid_payload(blob)]),
        lambda: wire_data([bad_payload(rng, blob)], func=hostile_value(rng)),
        lambda: wire_data([valid_payload(blob)], func="os.system"),
        lambda: dumps([C.TASK_FUNC, None, [bad_payload(rng, blob)]]),
        lambda: dumps([C.TASK_FUNC]),
        lambda: pickle.dumps((C.TASK_FUNC, None, [valid_payload(blob)], {})),
        lambda: b"",
    ]
    data = rng.choice(makers)()
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return zlib.compress(raw) if rng.random() < 0.3 else raw


def hash_fields(data: bytes) -> dict[str, bytes | str | int]:
    now = utc_now_iso()
    return {"data": data, "origin": QUEUE, "description": "fuzz", "timeout": C.JOB_TIMEOUT_S,
            "result_ttl": C.RESULT_TTL_S, "failure_ttl": C.FAILURE_TTL_S, "created_at": now,
            "enqueued_at": now, "status": "queued", "meta": "{}",
            "retries_left": C.CRASH_RETRIES}


def write_hash(redis: Redis, job_id: str, fields: dict[str, bytes | str | int]) -> Hostile:
    redis.hset(Keys.rq_job(job_id), mapping=fields)  # type: ignore[arg-type]
    redis.rpush(Keys.rq_queue(QUEUE), job_id)
    return Hostile("", job_id.encode(), job_id)


def wrong_type(redis: Redis, key: str, own: str, rng: random.Random) -> str:
    """Create `key` as a Redis type other than `own`; returns the type."""
    kind = rng.choice([t for t in REDIS_TYPES if t != own])
    writers: dict[str, Callable[[], object]] = {
        "string": lambda: redis.set(key, "x"), "list": lambda: redis.rpush(key, "x"),
        "set": lambda: redis.sadd(key, "x"), "zset": lambda: redis.zadd(key, {"x": 1}),
        "hash": lambda: redis.hset(key, "x", "1"),
        "stream": lambda: redis.xadd(key, {"x": "1"})}
    writers[kind]()
    return kind


def make_hostile(redis: Redis, rng: random.Random, n: int, blob: str) -> Hostile:
    """The n-th hostile job, of one of six kinds."""
    job_id = f"fz{n:04d}{rng.getrandbits(32):08x}"
    kind = rng.choice(["payload", "payload", "data", "hash field", "key type", "missing",
                       "entry"])
    if kind == "payload":
        made = write_hash(redis, job_id, hash_fields(wire_data([bad_payload(rng, blob)])
                                                     .encode("utf-8", "surrogatepass")))
    elif kind == "data":
        made = write_hash(redis, job_id, hash_fields(bad_data(rng, blob)))
    elif kind == "hash field":
        # The field may be harmless alone: the payload is refused in any case, after RQ,
        # the guard and the job's end have read the field.
        fields = hash_fields(wire_data([bad_payload(rng, blob)]).encode("utf-8",
                                                                        "surrogatepass"))
        name = rng.choice(HASH_FIELDS)
        fields[name] = hostile_bytes(rng)
        if name == "status" and fields[name] in (b"null", b""):
            fields[name] = b"bogus"  # an empty status reads as a job taken elsewhere
        made = write_hash(redis, job_id, fields)
        kind = f"hash field {name}"
    elif kind == "key type":
        # A key of the job of another type: rq:job:<id> itself half the time, else one of
        # vlmq's beside an otherwise valid job.
        spec = next(k for k in JOB_KEYS if k.name == "rq_job") if rng.random() < 0.5 \
            else rng.choice(JOB_KEYS)
        if spec.name != "rq_job":
            redis.hset(Keys.rq_job(job_id), mapping=hash_fields(  # type: ignore[arg-type]
                wire_data([valid_payload(blob)]).encode()))
        found = wrong_type(redis, spec.build(KEYS.prefix, {"job_id": job_id}), spec.type, rng)
        redis.rpush(Keys.rq_queue(QUEUE), job_id)
        made = Hostile("", job_id.encode(), job_id)
        kind = f"key {spec.name} a {found}"
    elif kind == "missing":
        fields = hash_fields(wire_data([bad_payload(rng, blob)]).encode("utf-8",
                                                                        "surrogatepass"))
        gone = rng.sample(sorted(fields), rng.randint(1, 4))
        for name in gone:
            del fields[name]
        made = write_hash(redis, job_id, fields)
        kind = f"missing {','.join(sorted(gone))}"
    else:
        made, kind = absurd_entry(redis, rng, n)
    return Hostile(kind, made.entry, made.job_id)


def absurd_entry(redis: Redis, rng: random.Random, n: int) -> tuple[Hostile, str]:
    """A queue entry that is no job id (or one whose hash is gone)."""
    how = rng.randrange(6)
    tag = f"{n:04d}"
    if how == 0:
        entry = b"\xff" + tag.encode() + rng.randbytes(4) + b"\x80"
        kind = "entry not UTF-8"
    elif how == 1:
        entry = f"x{tag}:y".encode()
        if rng.random() < 0.5:  # the hash it names exists, of some type
            wrong_type(redis, Keys.rq_job(entry.decode()), "", rng)
        kind = "entry with a colon"
    elif how == 2:
        entry = (tag + "a" * rng.randint(129, 5000)).encode()
        kind = "entry too long"
    elif how == 3:
        entry = (tag + rng.choice([" ", "\n", "\t", "é", "/", "*", "{", ".."]) + "x").encode()
        kind = "entry with a bad character"
    elif how == 4:
        entry = f"gone{tag}".encode()
        kind = "entry whose hash is gone"
    else:
        entry = tag.encode() + dumps(hostile_value(rng)).encode("utf-8", "surrogatepass")[:2000]
        kind = "entry of JSON"
    redis.sadd("rq:queues", Keys.rq_queue(QUEUE))
    redis.rpush(Keys.rq_queue(QUEUE), entry)
    job_id = entry.decode() if how == 1 else None
    return Hostile("", entry, job_id), kind


def junk_beside(redis: Redis, rng: random.Random, job_id: str) -> None:
    """Junk of the right Redis type in one of a valid job's own keys, as a foreign writer
    may leave it: nothing in it reads as a result, so the job must run as if it were not
    there (the same text as alone)."""
    junk: list[Callable[[], object]] = [
        lambda: redis.hset(KEYS.job_items(job_id), "abc", "junk"),
        lambda: redis.hset(KEYS.job_items(job_id), "0", rng.choice(
            [b"junk", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"index": 1' + b"0" * 5000 + b"}",
             b'{"index": "x"}', b"[]"])),
        lambda: redis.hset(KEYS.job_items(job_id), "9" * 400, "{}"),
        lambda: redis.sadd(KEYS.job_failed(job_id), "abc"),
        lambda: redis.hset(KEYS.job_kills(job_id), "count", "1" + "0" * 5000),
        lambda: redis.hset(KEYS.job_risk(job_id), "0", b"\xff|decode|x"),
        lambda: redis.hset(KEYS.job_end(job_id), "event", "[" * 5000),
        lambda: redis.set(KEYS.job_owner(job_id), b"\xff junk"),
    ]
    rng.choice(junk)()


# --- the run -------------------------------------------------------------------------------

def dead_entries(redis: Redis) -> dict[str, list[str]]:
    """Dead-letter reasons by entry (as the worker records an entry: text, 512 chars)."""
    out: dict[str, list[str]] = {}
    for raw in redis.lrange(KEYS.dead, 0, -1):
        record = json.loads(raw)
        out.setdefault(record["entry"], []).append(record["reason"])
    return out


def recorded(entry: bytes) -> str:
    return entry.decode("utf-8", "backslashreplace")[:512]


def outcome(redis: Redis, h: Hostile, dead: dict[str, list[str]]) -> str | None:
    """Why `h` did not end failed or dead-lettered exactly once, or None."""
    reasons = dead.get(recorded(h.entry), [])
    if len(reasons) > 1:
        return f"dead-lettered {len(reasons)} times: {reasons}"
    if reasons and not reasons[0].strip():
        return "dead-lettered without a reason"
    status = None
    if h.job_id is not None and redis.type(Keys.rq_job(h.job_id)) == b"hash":
        status = redis.hget(Keys.rq_job(h.job_id), "status")
        if redis.type(Keys.rq_results(h.job_id)) == b"stream" and \
                redis.xlen(Keys.rq_results(h.job_id)) > 1:
            return "failed more than once"
        if redis.zscore(Keys.rq_registry("started", QUEUE), h.job_id) is not None:
            return "still in the started registry"
    if not reasons and status != b"failed":
        return f"neither dead-lettered nor failed (status {status!r})"
    return None


def test_hostile_raw_jobs_beside_valid_ones(redis_url: str, redis: Redis, tiny_model: Path,
                                            tmp_path: Path, start_worker: helpers.Spawn) -> None:
    images = helpers.make_images(tmp_path / "valid", N_VALID)
    rng = random.Random(SEED)
    with Client(redis_url) as client:
        # Alone: the valid jobs' texts with nothing else in the queue.
        alone_ids = [client.caption([p], options=OPTS.with_(job_id=f"alone-{i}")).id
                     for i, p in enumerate(images)]
        worker = start_worker(redis_url, tiny_model, tmp_path, "--queues", QUEUE, "--burst",
                              "--max-batch", "8", "--result-cache-mb", "0", name="alone")
        code, out = helpers.finish(worker, timeout=300)
        assert code == 0, out
        alone = [[r.text for r in helpers.finished_results(client, j)] for j in alone_ids]

        # Beside: every valid job shuffled among the hostile ones, all queued before the
        # worker starts, so each of its takes holds both.
        blob, _ = BlobStore(redis, KEYS).put(images[0].read_bytes())
        order = ["valid"] * N_VALID + ["hostile"] * N_HOSTILE
        rng.shuffle(order)
        hostile: list[Hostile] = []
        valid_ids: list[str] = []
        for what in order:
            if what == "valid":
                i = len(valid_ids)
                valid_ids.append(client.caption([images[i]],
                                                options=OPTS.with_(job_id=f"valid-{i}")).id)
                if rng.random() < JUNK_BESIDE:
                    junk_beside(redis, rng, valid_ids[-1])
            else:
                hostile.append(make_hostile(redis, rng, len(hostile), blob))
        assert len(hostile) == N_HOSTILE and redis.llen(Keys.rq_queue(QUEUE)) == \
            N_HOSTILE + N_VALID
        # A cache dir of its own: the valid jobs' features are computed again, beside them.
        worker = start_worker(redis_url, tiny_model, tmp_path / "beside", "--queues", QUEUE,
                              "--burst", "--max-batch", "8", "--result-cache-mb", "0",
                              name="beside")
        code, out = helpers.finish(worker, timeout=300)
        assert code == 0, out[-20000:]
        beside = [[r.text for r in helpers.finished_results(client, j)] for j in valid_ids]

    assert beside == alone
    kinds = {h.kind.split()[0] for h in hostile}
    assert kinds == {"payload", "data", "hash", "key", "missing", "entry"}, kinds
    dead = dead_entries(redis)
    wrong = {f"{h.kind} {h.entry[:60]!r}": why for h in hostile
             if (why := outcome(redis, h, dead)) is not None}
    assert not wrong, wrong
    assert redis.llen(Keys.rq_queue(QUEUE)) == 0
    assert redis.llen(f"{Keys.rq_queue(QUEUE)}:intermediate") == 0
    assert "Traceback" not in out, out[-20000:]
