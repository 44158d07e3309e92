"""RQ's key names, spelled once in shared/keys.py, are the ones RQ itself uses."""

from __future__ import annotations

import pytest
from redis import Redis
from rq import Queue, Worker
from rq.job import Job
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from vlmq.shared.keys import RQ_QUEUES, RQ_REGISTRIES, RQ_WORKERS, Keys

REGISTRY_CLASSES = {"started": StartedJobRegistry, "finished": FinishedJobRegistry,
                    "failed": FailedJobRegistry, "deferred": DeferredJobRegistry,
                    "scheduled": ScheduledJobRegistry, "canceled": CanceledJobRegistry}


def test_rq_names_match_rq(redis: Redis) -> None:
    assert Keys.rq_job("j1") == Job.key_for("j1")
    assert Keys.rq_queue("ocr") == Queue("ocr", connection=redis).key
    assert Keys.rq_intermediate("ocr") == Queue("ocr", connection=redis).intermediate_queue_key
    assert Queue.redis_queues_keys == RQ_QUEUES
    assert Keys.rq_results("j1") == Result.get_key("j1")
    assert Keys.rq_worker("w1") == Worker.redis_worker_namespace_prefix + "w1"
    assert Worker.redis_workers_keys == RQ_WORKERS
    assert Keys.rq_queue_workers("ocr") == WORKERS_BY_QUEUE_KEY % "ocr"
    assert set(RQ_REGISTRIES) == set(REGISTRY_CLASSES)
    for kind, cls in REGISTRY_CLASSES.items():
        assert Keys.rq_registry(kind, "ocr") == cls("ocr", connection=redis).key


@pytest.mark.parametrize(("key", "job_id"), [
    ("rq:job:abc", "abc"),
    ("rq:job:abc:dependents", None),  # RQ's per-job keys are not jobs
    ("rq:job:", None),
    ("rq:queue:abc", None),
])
def test_job_id_of_a_scanned_key(key: str, job_id: str | None) -> None:
    assert Keys.rq_job_id(key) == job_id


def test_names_read_back_from_rq_sets() -> None:
    assert Keys.rq_name(Keys.rq_queue("a.b-c")) == "a.b-c"
    assert Keys.rq_name(Keys.rq_worker("host:123")) == "host:123"
    assert Keys.rq_job_glob() == "rq:job:*"
