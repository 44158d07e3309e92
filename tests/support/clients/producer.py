"""A vlmq producer in Python with only the `redis` package (no vlmq import), following
shared/PROTOCOL.md: upload images, enqueue a caption job with EVALSHA of enqueue.lua, wait
for the `<prefix>:done:<queue>` notification while following the job's events from 0-0 to
the terminal event, then read status, summary (kept in the job hash) and items, and follow
it again once its events stream has expired. Also one bad EVALSHA (its error comes back at
once) and a pickled job hash, which the worker refuses with a terminal event.

Usage: REDIS_URL=... ENQUEUE_LUA=shared/enqueue.lua python producer.py IMAGE...
Prints one JSON object with what it saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

PREFIX = os.environ.get("VLMQ_PREFIX", "vlmq")
TERMINAL = {"finished", "failed", "canceled"}


def rq_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def kept_end(r: redis.Redis, job_id: str) -> dict[str, Any] | None:
    """The terminal event kept once the job ended (PROTOCOL.md section 5): a finished
    job's in its end hash, the others' in the job hash."""
    raw = r.hget(f"{PREFIX}:job:{job_id}:end", "event") or r.hget(f"rq:job:{job_id}", "vlmq_end")
    return json.loads(raw) if raw and raw.startswith("{") else None


def follow(r: redis.Redis, job_id: str) -> dict[str, Any]:
    """Events from 0-0 (never `$`, which skips what is already written) to the end; the
    end from the job hash when the job has ended (its stream may have expired)."""
    key, last, seen = f"{PREFIX}:job:{job_id}:events", "0-0", []
    deadline = time.monotonic() + 180
    block: int | None = None  # the first read does not wait: it may have ended long ago
    ended = False
    while time.monotonic() < deadline:
        reply = r.xread({key: last}, count=100, block=block)
        block = 2000
        kept = None if reply else kept_end(r, job_id)  # nothing new: ended, stream expired?
        if kept is not None and ended:
            return {"events": seen, "kept": kept, "status": r.hget(f"rq:job:{job_id}", "status")}
        if kept is not None:  # the stream may still hold the end: read once more, not waiting
            ended, block = True, None
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                seen.append(fields)
                if fields["type"] in TERMINAL:
                    return {"events": seen, "status": r.hget(f"rq:job:{job_id}", "status")}
    raise SystemExit(f"no terminal event for {job_id} within 180 s")


def main() -> None:
    r = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True,
                             socket_timeout=30, socket_keepalive=True)
    raw = redis.Redis.from_url(os.environ["REDIS_URL"])  # bytes in, bytes out
    done = r.pubsub()
    done.subscribe(f"{PREFIX}:done:caption")  # before enqueueing, so nothing is missed

    items = []
    for arg in sys.argv[1:]:
        data = Path(arg).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        if not raw.expire(f"{PREFIX}:blob:{sha}", 604800):
            raw.set(f"{PREFIX}:blob:{sha}", data, nx=True, ex=604800)
        items.append({"kind": "image", "blob": sha, "source": Path(arg).name})
    payload = {"v": 1, "task": "caption", "items": items, "generation": {"max_tokens": 4},
               "max_side": 112, "labels": {"lang": "python"}}
    sha = r.script_load(Path(os.environ["ENQUEUE_LUA"]).read_text())

    def enqueue(job_id: str, timeout: str = "86400") -> Any:
        return r.evalsha(
            sha, 5, f"rq:job:{job_id}", "rq:queue:caption", "rq:queues",
            f"{PREFIX}:job:{job_id}:items", f"{PREFIX}:job:{job_id}:events",
            job_id, "caption", json.dumps(["vlmq.worker.task.run", None, [payload], {}]),
            "caption from plain redis-py", timeout, 604800, 2592000, rq_now(), 3)

    job_id = f"py-{uuid.uuid4().hex}"
    out: dict[str, Any] = {"id": job_id, "enqueued": enqueue(job_id)}
    try:
        out["bad"] = f"accepted: {enqueue(job_id + '-bad', 'soon')}"
    except redis.ResponseError as exc:
        out["bad"] = str(exc)
    out.update(follow(r, job_id))
    out["summary"] = json.loads(out["events"][-1]["summary"])
    out["returned"] = (kept_end(r, job_id) or {}).get("summary")
    out["items"] = sorted((json.loads(v) for v in r.hgetall(f"{PREFIX}:job:{job_id}:items")
                           .values()), key=lambda i: i["index"])
    out["notified"] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not out["notified"]:
        msg = done.get_message(timeout=1)
        if msg and msg["type"] == "message":
            out["notified"].append(json.loads(msg["data"]))

    # After the events stream expired (deleted here, as a minute after the end would).
    r.delete(f"{PREFIX}:job:{job_id}:events")
    out["late"] = follow(r, job_id)

    # A pickled job (e.g. RQ's default serializer): refused unread, with a terminal event.
    refused = f"{job_id}-pickled"
    raw.hset(f"rq:job:{refused}", mapping={
        "data": pickle.dumps(("vlmq.worker.task.run", None, [payload], {})),
        "origin": "caption", "status": "queued", "created_at": rq_now(),
        "enqueued_at": rq_now(), "description": "pickled", "timeout": "600", "meta": "{}"})
    r.sadd("rq:queues", "rq:queue:caption")
    r.rpush("rq:queue:caption", refused)
    out["refused"] = follow(r, refused)
    out["imports_vlmq"] = any(m == "vlmq" or m.startswith("vlmq.") for m in sys.modules)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
