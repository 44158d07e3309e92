"""Containment through a real worker: real Redis, the Python client, the tiny model.

One producer's hostile schema or failing row costs that producer alone: the other jobs in
the worker finish with every item ok and the same text as without it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import helpers
from tests.support.schemas import RECEIPT
from vlmq.producer.client import Client, Job
from vlmq.producer.options import JobOptions
from vlmq.shared.messages import ItemResult

OPTS = JobOptions(max_tokens=24, max_side=112)
HOSTILE = {"type": "string", "pattern": "^(a{1000}){1000}$"}
SLOW = {"type": "string", "pattern": "^(a{700}){700}$"}


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("contain")
    procs: list[subprocess.Popen[str]] = []
    try:
        # No shared result cache: a rerun must really generate to be compared.
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, "--max-batch", "8",
                                          "--result-cache-mb", "0", name="wc"))
        yield module_redis_url, tmp
    finally:
        helpers.stop_all(procs)


def _texts(client: Client, job: Job) -> list[str | None]:
    results = helpers.finished_results(client, job.id)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [r.text for r in results]


def _innocent_jobs(client: Client, tmp: Path) -> tuple[Job, Job]:
    images = helpers.make_images(tmp / "innocent", 4)
    return (client.caption(images, options=OPTS),
            client.extract(images[:3], RECEIPT, options=OPTS.with_(max_tokens=200)))


def _failed(client: Client, job: Job) -> list[ItemResult]:
    assert client.job(job.id).wait(timeout=180) in ("finished", "failed")
    return list(client.job(job.id).results())


def test_a_hostile_schema_beside_two_jobs_fails_only_its_own_item(
        served: tuple[str, Path]) -> None:
    url, tmp = served
    with Client(url) as client:
        caption, extract = _innocent_jobs(client, tmp)
        alone = (_texts(client, caption), _texts(client, extract))
        attacker = client.extract(helpers.make_images(tmp / "attack", 2), HOSTILE,
                                  options=OPTS)
        caption, extract = _innocent_jobs(client, tmp)
        beside = (_texts(client, caption), _texts(client, extract))
        hostile = _failed(client, attacker)
    assert beside == alone
    assert len(hostile) == 2 and all(not r.ok for r in hostile)
    for r in hostile:
        assert "too costly to match" in (r.error or "") and "budget" in (r.error or ""), r.error


def test_a_slow_schema_costs_an_innocent_job_little(served: tuple[str, Path]) -> None:
    """(a{700}){700}: 0.15-0.45 s a mask step before; now cut within its budget, so the
    innocent job beside it gets what it gets alone. What that costs in time is for
    benchmarks/containment.py to print (no clock is asserted here)."""
    url, tmp = served
    images = helpers.make_images(tmp / "slow-innocent", 3)
    with Client(url) as client:
        alone = _texts(client, client.extract(images, RECEIPT,
                                              options=OPTS.with_(max_tokens=220)))
        attacker = client.extract(helpers.make_images(tmp / "slow-attack", 3), SLOW,
                                  options=OPTS.with_(max_tokens=220))
        beside = _texts(client, client.extract(images, RECEIPT,
                                               options=OPTS.with_(max_tokens=220)))
        hostile = _failed(client, attacker)
    assert beside == alone
    assert len(hostile) == 3
    assert all(not r.ok and "budget" in (r.error or "") for r in hostile), hostile


def test_a_step_failing_for_one_row_of_four_fails_that_row_alone(
        served: tuple[str, Path], tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator step that raises while one row is in the batch, culprit unknown to the
    engine (VLMQ_FAULT_ROW, a test hook): three rows end with their text from a clean run,
    the fourth fails with its own error; nothing is retried or requeued."""
    url, tmp = served
    images = helpers.make_images(tmp / "fault", 4)
    with Client(url) as client:
        clean = _texts(client, client.caption(images, options=OPTS))
        job_id = "fault-job-1"
        monkeypatch.setenv("VLMQ_FAULT_ROW", f"{job_id}:2")
        opts = OPTS.with_(queue="faulty", job_id=job_id)
        job = client.caption(images, options=opts)
        proc = helpers.start_worker(url, tiny_model, tmp, "--queues", "faulty", "--max-batch",
                                    "4", "--result-cache-mb", "0", name="wfault")
        try:
            assert client.job(job.id).wait(timeout=180) == "finished"
            results = sorted(client.job(job.id).results(), key=lambda r: r.index)
        finally:
            helpers.stop_all([proc])
    assert [r.ok for r in results] == [True, True, False, True]
    assert [r.text for i, r in enumerate(results) if i != 2] == [clean[0], clean[1], clean[3]]
    assert "InjectedFault" in (results[2].error or "") and "fails alone" in (
        results[2].error or ""), results[2].error
