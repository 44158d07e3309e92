"""One way a job is failed (shared/enqueue.fail_job), whoever fails it: a job RQ loads and a
hash RQ cannot load end up failed alike for producers, `rq info` and event followers."""

from __future__ import annotations

import json
import uuid

from redis import Redis
from redis.client import PubSub
from rq.job import JobStatus

from tests.support.factories import job_payload
from vlmq.shared import results
from vlmq.shared.enqueue import enqueue, fail_job, fetch_job, raw_exc_info
from vlmq.shared.keys import Keys


def _done_messages(pubsub: PubSub, timeout: float = 1.0) -> list[str]:
    """Ids of the done messages published, until none comes for `timeout` s."""
    out: list[str] = []
    while (msg := pubsub.get_message(ignore_subscribe_messages=True,
                                     timeout=timeout)) is not None:
        out.append(json.loads(msg["data"])["id"])
    return out


def test_loaded_and_raw_jobs_fail_alike_with_one_terminal_event(redis: Redis,
                                                                keys: Keys) -> None:
    # Pub/sub channels are one namespace across a server's dbs: a queue name of its own
    # keeps other tests' jobs off this test's done channel.
    queue = f"q-{uuid.uuid4().hex[:8]}"
    loaded_id = enqueue(redis, job_payload(), queue=queue)
    raw_id = "raw-1"  # a hash RQ could not load: failed by id
    redis.hset(Keys.rq_job(raw_id), mapping={"status": "queued", "origin": queue})
    pubsub = redis.pubsub()
    pubsub.subscribe(keys.done_queue_channel(queue))
    confirmed = pubsub.get_message(timeout=1.0)
    assert confirmed is not None and confirmed["type"] == "subscribe"
    for _ in range(2):  # failing again writes no second terminal event
        with redis.pipeline() as pipe:
            fail_job(pipe, keys, fetch_job(redis, loaded_id), queue, "bad input",
                     worker_name="w1")
            fail_job(pipe, keys, raw_id, queue, "unreadable hash")
            pipe.execute()

    for job_id, message in ((loaded_id, "bad input"), (raw_id, "unreadable hash")):
        assert redis.hget(Keys.rq_job(job_id), "status") == JobStatus.FAILED.value.encode()
        assert redis.hget(Keys.rq_job(job_id), "ended_at")
        assert redis.hexists(Keys.rq_job(job_id), results.END_FIELD)
        assert redis.zscore(Keys.rq_registry("failed", queue), job_id) is not None
        events = redis.xrange(keys.job_events(job_id))
        assert [(e[b"type"], e[b"error"]) for _, e in events] == \
            [(b"failed", message.encode())]
    result = fetch_job(redis, loaded_id).latest_result()
    assert result is not None and result.exc_string == "bad input"
    assert result.worker_name == "w1"
    assert raw_exc_info(redis, raw_id) == "unreadable hash"
    assert sorted(_done_messages(pubsub)) == sorted([loaded_id, raw_id])
    pubsub.close()
