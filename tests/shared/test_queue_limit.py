"""Queue names are bounded.

The attack enqueued 20,000 one-item jobs through enqueue.lua, each on a queue of its own:
`vlmq metrics` then exported 200,084 series and `vlmq status` printed 20,014 lines, and
the names stay in `rq:queues`. Now enqueue.lua (for every language) and the Python client
refuse a new queue once C.MAX_QUEUES are known, and status and metrics show at most
C.MAX_SHOWN_QUEUES queues, folding the rest into one line whatever Redis already holds.
Counts, never times.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from tests.support import helpers
from tests.support.factories import image_bytes
from tests.support.lua_calls import call, refused, store_blob
from vlmq.producer.client import Client
from vlmq.producer.fleet import OTHER_QUEUES
from vlmq.server.metrics_exporter import FleetCollector
from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import RQ_QUEUES, Keys

PREFILLED = 2000


def _fill_queues(redis: Redis, n: int, *, jobs: bool = False) -> None:
    """`n` queue names in rq:queues (q0, q1...), as an attacker's enqueues leave them;
    with `jobs`, queue qI also holds I % 5 waiting ids, so some queues outweigh others."""
    pipe = redis.pipeline(transaction=False)
    for i in range(n):
        pipe.sadd(RQ_QUEUES, Keys.rq_queue(f"q{i}"))
        if jobs and i % 5:
            pipe.rpush(Keys.rq_queue(f"q{i}"), *(f"j{i}-{k}" for k in range(i % 5)))
    pipe.execute()


def _snapshot(redis: Redis) -> dict[bytes, bytes]:
    return {k: redis.type(k) for k in redis.scan_iter()} | {
        b"members": b" ".join(sorted(redis.smembers(RQ_QUEUES)))}


def test_lua_refuses_a_new_queue_past_the_limit(redis: Redis) -> None:
    store_blob(redis)
    _fill_queues(redis, C.MAX_QUEUES)
    refused(redis, f"at most {C.MAX_QUEUES} queues", job_id="j-new", queue="fresh")
    before = _snapshot(redis)
    with pytest.raises(Exception, match=f"at most {C.MAX_QUEUES} queues"):
        call(redis, job_id="j-new", queue="fresh")
    assert _snapshot(redis) == before
    # A queue already known is always taken, at the limit or past it.
    assert call(redis, job_id="j-old", queue="q7") == 1
    redis.sadd(RQ_QUEUES, Keys.rq_queue("extra"))  # old data past the limit
    assert call(redis, job_id="j-old2", queue="q8") == 1


def test_lua_takes_new_queues_up_to_the_limit(redis: Redis) -> None:
    store_blob(redis)
    _fill_queues(redis, C.MAX_QUEUES - 1)
    assert call(redis, job_id="j-last", queue="last") == 1
    assert redis.scard(RQ_QUEUES) == C.MAX_QUEUES


def test_client_refuses_a_new_queue_past_the_limit(redis_url: str, redis: Redis,
                                                   tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(image_bytes())
    _fill_queues(redis, C.MAX_QUEUES)
    before = _snapshot(redis)
    with Client(redis_url, prefix="vlmq") as client:
        with pytest.raises(PayloadError, match=f"at most {C.MAX_QUEUES} queues") as info:
            client.caption([image], queue="fresh")
        assert "fresh" in str(info.value)
        assert _snapshot(redis) == before  # nothing uploaded, nothing enqueued
        job = client.caption([image], queue="q3")  # a known queue still takes jobs
        assert job.queue == "q3"


def test_status_is_bounded_whatever_redis_holds(redis_url: str, redis: Redis) -> None:
    _fill_queues(redis, PREFILLED, jobs=True)
    res = helpers.invoke_cli(redis_url, "status")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    lines = res.stdout.splitlines()
    assert len(lines) <= C.MAX_SHOWN_QUEUES + 12, len(lines)
    folded = [line for line in lines if line.startswith(OTHER_QUEUES)]
    assert len(folded) == 1, lines
    shown = PREFILLED - (C.MAX_SHOWN_QUEUES - 1)
    assert f"{shown} queues" in folded[0]
    # The folded line still counts every waiting job: none is lost from the totals.
    total = sum(i % 5 for i in range(PREFILLED))
    table = [line.split() for line in lines[1:] if line.startswith(("q", OTHER_QUEUES))]
    assert sum(int(row[-5]) for row in table) == total, table


def test_status_json_is_bounded(redis_url: str, redis: Redis) -> None:
    _fill_queues(redis, PREFILLED)
    res = helpers.invoke_cli(redis_url, "status", "--json")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    queues = json.loads(res.stdout)["queues"]
    assert len(queues) <= C.MAX_SHOWN_QUEUES
    assert queues[OTHER_QUEUES]["queues"] == PREFILLED - (C.MAX_SHOWN_QUEUES - 1)


def test_metrics_scrape_is_bounded_whatever_redis_holds(redis: Redis) -> None:
    _fill_queues(redis, PREFILLED, jobs=True)
    registry = CollectorRegistry()
    registry.register(FleetCollector(redis, Keys("vlmq")))
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    samples = [s for f in families for s in f.samples]
    queues = {s.labels["queue"] for s in samples if "queue" in s.labels}
    assert len(queues) <= C.MAX_SHOWN_QUEUES, len(queues)
    assert OTHER_QUEUES in queues
    # Every family that has a series per queue has at most one per shown queue and state.
    assert len(samples) <= C.MAX_SHOWN_QUEUES * 12 + 10, len(samples)
    folded = [s for s in samples if s.name == "vlmq_queues_folded"]
    assert [s.value for s in folded] == [PREFILLED + len(C.DEFAULT_QUEUE)
                                         - (C.MAX_SHOWN_QUEUES - 1)]
    depth = sum(s.value for s in samples if s.name == "vlmq_queue_depth")
    assert depth == sum(i % 5 for i in range(PREFILLED))


def test_names_without_keys_cost_no_command_each(redis: Redis,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Names SADDed by hand with no key behind them: the reader counts only the queues
    that have keys (one script finds them), so its commands do not grow with the names,
    and the queues with jobs are still the ones shown."""
    from redis.client import Pipeline

    from vlmq.producer.fleet import read_fleet

    def sent_by(n: int) -> tuple[int, list[str]]:
        redis.delete(RQ_QUEUES)
        redis.sadd(RQ_QUEUES, *(Keys.rq_queue(f"junk{i}") for i in range(n)))
        _fill_queues(redis, 3, jobs=True)  # q1 and q2 hold jobs, q0 is a bare name too
        count = [0]
        execute = Pipeline.execute

        def counted(self: Pipeline, raise_on_error: bool = True) -> list[object]:
            count[0] += len(self.command_stack)
            return execute(self, raise_on_error)

        monkeypatch.setattr(Pipeline, "execute", counted)
        fleet = read_fleet(redis, Keys("vlmq"), items=True, defaults=False)
        monkeypatch.setattr(Pipeline, "execute", execute)
        assert fleet.other is not None and fleet.other.queues == n + 3 - len(fleet.queues)
        return count[0], [q.name for q in fleet.queues]

    few, shown_few = sent_by(C.MAX_SHOWN_QUEUES)
    many, shown_many = sent_by(20_000)
    assert many == few, (few, many)
    assert {"q1", "q2"} <= set(shown_few) and {"q1", "q2"} <= set(shown_many)
