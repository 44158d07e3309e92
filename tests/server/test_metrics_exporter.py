"""Prometheus metrics: a worker's /metrics, the `vlmq metrics` fleet exporter, and a real
Prometheus (the Debian package) scraping both while a job runs; promtool checks both
expositions. (tests/server/test_prometheus_scrape.py has the exporter with its Redis stopped.)

One worker, one exporter and one Prometheus serve this module's end-to-end tests (their
start is the slow part). The exporter's figures are checked against crafted Redis states,
and its cost per scrape is counted with INFO commandstats on a private Redis.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from redis import Redis

from tests.support import helpers
from tests.support import prometheus as prom
from tests.support.factories import images, payload
from tests.support.pdf_craft import drawing_bomb_pdf
from vlmq.cli.common import EXIT_CONFIG
from vlmq.producer.client import Client
from vlmq.server.metrics_exporter import FleetCollector, serve
from vlmq.shared import constants as C
from vlmq.shared import fair, job_index
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult
from vlmq.worker.jobs.rq_jobs import Refused
from vlmq.worker.metrics import FINISH_REASONS, PHASES, TOKEN_BUCKETS, WorkerMetrics
from vlmq.worker.prep.decode import PreprocessError
from vlmq.worker.prep.render_pool import RenderPool
from vlmq.worker.redis_server import free_port
from vlmq.worker.stats import JOB_EVENTS, WorkerStats

ITEMS = 3
MAX_BATCH = 4
_get = prom.get


def _samples(text: str) -> dict[str, tuple[str, list[Sample]]]:
    """Metric families of an exposition: name -> (type, samples)."""
    return {f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(text)}


def _matching(samples: list[Sample], name: str, **labels: str) -> list[float]:
    return [s.value for s in samples if s.name == name
            and all(s.labels.get(k) == v for k, v in labels.items())]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    got = _matching(samples, name, **labels)
    assert len(got) == 1, (name, labels, samples)
    return float(got[0])


def _sum(samples: list[Sample], name: str, **labels: str) -> float:
    """Summed over the labels not given (e.g. every finish_reason)."""
    return float(sum(_matching(samples, name, **labels)))


def _up(url: str, timeout: float, what: str) -> None:
    def answers() -> bool:
        try:
            return _get(url, timeout=10.0)[0] == 200
        except OSError:
            return False

    helpers.wait_for(answers, timeout, what)


@dataclass
class World:
    redis_url: str
    worker_port: int
    fleet_port: int
    prometheus: prom.Prometheus | None  # None: no prometheus binary here
    job_id: str
    procs: list[subprocess.Popen[str]]


@pytest.fixture(scope="module")
def world(module_redis_url: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("metrics")
    worker_port, fleet_port = free_port(), free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, "--metrics-port",
                                          str(worker_port), "--max-batch", str(MAX_BATCH),
                                          name="wmetrics"))
        procs.append(subprocess.Popen(
            [helpers.VLMQ, "--redis-url", module_redis_url, "metrics", "--port",
             str(fleet_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
        server = None
        if Path(prom.PROMETHEUS).exists():
            server = prom.start(tmp, {"vlmq-worker": worker_port, "vlmq-fleet": fleet_port})
            procs.append(server.proc)
        _up(f"http://127.0.0.1:{worker_port}/metrics", 300, "the worker's /metrics")
        _up(f"http://127.0.0.1:{fleet_port}/metrics", 300, "the exporter's /metrics")

        def ready() -> bool:  # the model is loaded once its type is known
            info = _samples(_get(f"http://127.0.0.1:{worker_port}/metrics")[1])
            return bool(info["vlmq_worker_info"][1][0].labels["model_type"])

        helpers.wait_for(ready, 300, "the worker to load its model")
        images = helpers.make_images(tmp / "images", ITEMS)
        res = helpers.invoke_cli(module_redis_url, "enqueue", "caption",
                                 *(str(p) for p in images), "--json", "--max-tokens", "4",
                                 "--max-side", "112")
        assert res.exit_code == 0, (res.stdout, res.stderr)
        job_id = str(json.loads(res.stdout)["id"])
        with Client(module_redis_url) as client:
            assert client.job(job_id).wait(timeout=600) == "finished"
        yield World(module_redis_url, worker_port, fleet_port, server, job_id, procs)
    finally:
        helpers.stop_all(procs)


@pytest.mark.slow
def test_prometheus_scrapes_the_worker_and_the_exporter(world: World) -> None:
    if world.prometheus is None:
        pytest.skip(prom.MISSING.format(prom.PROMETHEUS))
    p = world.prometheus
    port = p.port
    p.ready()

    def healthy() -> bool:  # each target's last scrape succeeded
        code, body = _get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=30)
        targets = json.loads(body)["data"]["activeTargets"] if code == 200 else []
        return {t["labels"]["job"] for t in targets if t["health"] == "up"} == {
            "vlmq-worker", "vlmq-fleet"}

    # Read together from one store state: a scrape that fails on a busy machine marks a
    # target's series stale until the next one succeeds, so each is a condition to meet.
    want = {"sum(vlmq_items_total)": ITEMS, 'up{job="vlmq-worker"}': 1,
            'up{job="vlmq-fleet"}': 1, 'vlmq_up{job="vlmq-fleet"}': 1,
            'sum(vlmq_item_seconds_count{job="vlmq-worker"})': ITEMS,
            'sum(vlmq_item_decode_seconds_count{job="vlmq-worker"})': ITEMS,
            'sum(vlmq_job_queue_wait_seconds_count{job="vlmq-worker"})': 1,
            'vlmq_queue_jobs{job="vlmq-fleet",queue="caption",state="finished"}': 1}
    seen: dict[str, float | None] = {}

    def scraped() -> bool:  # ... and what they said is in Prometheus' store
        seen.update({q: p.scalar(q) for q in want})
        return seen == want

    helpers.wait_for(healthy, 300, "Prometheus to scrape both targets")
    try:
        helpers.wait_for(scraped, 300, "Prometheus to store the job's items and its end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last read {seen}") from None


@pytest.mark.slow
def test_worker_metrics_names_types_and_values(world: World) -> None:
    code, text = _get(f"http://127.0.0.1:{world.worker_port}/metrics")
    assert code == 200
    fams = _samples(text)
    want = {
        "vlmq_worker_info": "gauge", "vlmq_items": "counter", "vlmq_tokens": "counter",
        "vlmq_item_phase_seconds": "counter", "vlmq_jobs": "counter",
        "vlmq_vision_cache_hits": "counter", "vlmq_vision_cache_misses": "counter",
        "vlmq_vision_cache_bytes": "gauge", "vlmq_result_cache_hits": "counter",
        "vlmq_result_cache_misses": "counter", "vlmq_pdf_renders": "counter",
        "vlmq_pdf_render_failures": "counter", "vlmq_pdf_render_timeouts": "counter",
        "vlmq_tower_calls": "counter", "vlmq_repetition_cuts": "counter",
        "vlmq_step_isolations": "counter",
        "vlmq_batch_active_rows": "gauge", "vlmq_batch_max_rows": "gauge",
        "vlmq_batch_limit_rows": "gauge",
        "vlmq_items_in_flight": "gauge", "vlmq_jobs_in_flight": "gauge",
        "vlmq_item_seconds": "histogram", "vlmq_item_first_token_seconds": "histogram",
        "vlmq_item_queue_seconds": "histogram", "vlmq_item_prefill_seconds": "histogram",
        "vlmq_item_decode_seconds": "histogram", "vlmq_item_prompt_tokens": "histogram",
        "vlmq_item_generated_tokens": "histogram", "vlmq_job_queue_wait_seconds": "histogram",
        "vlmq_render_processes": "gauge", "vlmq_mlx_busy_seconds": "counter",
        "vlmq_kv_tokens_in_flight": "gauge", "vlmq_kv_tokens_budget": "gauge",
        "vlmq_worker_pid": "gauge",
    }
    assert {name: fams[name][0] for name in want if name in fams} == want
    assert all(name.startswith(("vlmq_", "process_")) for name in fams), sorted(fams)
    s = {name: samples for name, (_, samples) in fams.items()}
    assert _sum(s["vlmq_items"], "vlmq_items_total", task="caption", outcome="ok") == ITEMS
    # Each item under the reason it stopped for (4 tokens of a random model: cut at the
    # limit, by the loop guard, or at an end token), every one a known reason.
    by_reason = {r: _value(s["vlmq_items"], "vlmq_items_total", task="caption", outcome="ok",
                           finish_reason=r) for r in FINISH_REASONS}
    assert sum(by_reason.values()) == ITEMS and by_reason["error"] == 0, by_reason
    assert _value(s["vlmq_tokens"], "vlmq_tokens_total", task="caption",
                  kind="generated") > 0
    assert _value(s["vlmq_tokens"], "vlmq_tokens_total", task="caption", kind="prompt") > 0
    assert _value(s["vlmq_jobs"], "vlmq_jobs_total", queue="caption", event="taken") == 1
    assert _value(s["vlmq_jobs"], "vlmq_jobs_total", queue="caption", event="finished") == 1
    assert _value(s["vlmq_item_seconds"], "vlmq_item_seconds_count", task="caption") == ITEMS
    assert _value(s["vlmq_item_first_token_seconds"], "vlmq_item_first_token_seconds_bucket",
                  task="caption", le="+Inf") == ITEMS
    for name in ("vlmq_item_queue_seconds", "vlmq_item_prefill_seconds",
                 "vlmq_item_decode_seconds"):
        assert _value(s[name], f"{name}_count", task="caption") == ITEMS, name
    generated = _value(s["vlmq_tokens"], "vlmq_tokens_total", task="caption", kind="generated")
    assert _value(s["vlmq_item_generated_tokens"], "vlmq_item_generated_tokens_sum",
                  task="caption") == generated
    assert _value(s["vlmq_item_generated_tokens"], "vlmq_item_generated_tokens_bucket",
                  task="caption", le="5.0") == ITEMS  # at most 4 tokens each
    assert _value(s["vlmq_job_queue_wait_seconds"], "vlmq_job_queue_wait_seconds_count",
                  queue="caption") == 1
    assert _value(s["vlmq_kv_tokens_budget"], "vlmq_kv_tokens_budget") > 0  # once loaded
    assert _value(s["vlmq_kv_tokens_in_flight"], "vlmq_kv_tokens_in_flight") == 0
    assert _value(s["vlmq_vision_cache_misses"], "vlmq_vision_cache_misses_total") == ITEMS
    assert _value(s["vlmq_tower_calls"], "vlmq_tower_calls_total") >= 1
    assert _value(s["vlmq_result_cache_misses"], "vlmq_result_cache_misses_total") == ITEMS
    assert _value(s["vlmq_batch_max_rows"], "vlmq_batch_max_rows") == MAX_BATCH
    assert _value(s["vlmq_items_in_flight"], "vlmq_items_in_flight") == 0
    info = s["vlmq_worker_info"][0].labels
    assert info["model_type"] == "qwen2_vl" and info["blas"] and info["version"], info
    assert info["worker"] == "wmetrics" and "name" not in info, info  # --name, no pid
    assert _value(s["vlmq_worker_pid"], "vlmq_worker_pid") == world.procs[0].pid
    rc, out = prom.check_metrics(text)
    assert rc == 0, out


@pytest.mark.slow
def test_worker_refuses_a_metrics_port_in_use(redis_url: str, tiny_model: Path,
                                              tmp_path: Path,
                                              start_worker: helpers.Spawn) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_worker(redis_url, tiny_model, tmp_path, "--metrics-port", str(port),
                            name="wbusy")
        rc, out = helpers.finish(proc, timeout=300)
    assert rc == EXIT_CONFIG, out  # a configuration error: no restart would fix it
    assert f"cannot serve metrics on 127.0.0.1:{port}: the port is in use" in out, out
    assert "loading model" not in out, out  # refused before the model load


# --- the fleet exporter against crafted Redis states ------------------------------------


def _scrape(redis: Redis, *, items: bool = False) -> dict[str, list[Sample]]:
    registry = CollectorRegistry()
    registry.register(FleetCollector(redis, Keys(), items=items))
    return {name: samples for name, (_, samples)
            in _samples(generate_latest(registry).decode()).items()}


def test_exporter_counts_queues_failures_dead_letters_and_workers(redis: Redis,
                                                                   keys: Keys) -> None:
    """Crafted with the worker's own lifecycle: a poison entry dead-lettered, a job failed,
    two left queued (the head enqueued 100 s ago by Redis's clock)."""
    ids = [helpers.raw_enqueue(redis, payload(*images(n), task="caption"), queue="caption")
           for n in (1, 2, 3)]
    # Raw writes skip enqueue.lua and so the running counts: reindex counts them, as
    # `vlmq reindex` does for jobs written before the counts (PROTOCOL.md 8b).
    job_index.reindex(redis, keys)
    redis.lpush(Keys.rq_queue("caption"), "not a job id!")
    with helpers.worker_lifecycle(redis, ["caption"]) as life:
        refused = life.take()
        assert isinstance(refused, Refused), refused
        running = life.take()
        assert running is not None and not isinstance(running, Refused)
        assert running.job_id == ids[0]
        assert life.fail(running, "crafted failure") is None
    secs, _ = redis.time()
    redis.hset(Keys.rq_job(ids[1]), "enqueued_at",
               time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(secs - 100)))
    redis.sadd(keys.workers, "alive", "gone")
    redis.hset(keys.worker_stats("alive"), "model", "m")
    s = _scrape(redis, items=True)
    jobs = s["vlmq_queue_jobs"]
    assert _value(jobs, "vlmq_queue_jobs", queue="caption", state="queued") == 2
    assert _value(jobs, "vlmq_queue_jobs", queue="caption", state="failed") == 1
    assert _value(jobs, "vlmq_queue_jobs", queue="caption", state="started") == 0
    assert _value(s["vlmq_queue_depth"], "vlmq_queue_depth", queue="caption") == 2
    assert _value(s["vlmq_queue_items"], "vlmq_queue_items", queue="caption") == 2 + 3
    assert _value(s["vlmq_dead_letters"], "vlmq_dead_letters") == 1
    assert _value(s["vlmq_workers"], "vlmq_workers") == 1
    assert _value(s["vlmq_up"], "vlmq_up") == 1
    age = _value(s["vlmq_queue_oldest_age_seconds"], "vlmq_queue_oldest_age_seconds",
                 queue="caption")
    assert 99 <= age < 160, age
    assert "vlmq_queue_items" not in _scrape(redis)  # only when asked for
    assert _value(s["vlmq_queue_depth"], "vlmq_queue_depth", queue="ocr") == 0  # a default


def _served(redis: Redis) -> tuple[int, str]:
    """One scrape of the exporter's own server (prometheus_client's) over HTTP."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(redis, Keys()))
    server, _thread = serve("127.0.0.1", 0, registry)
    try:
        return _get(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()


def test_exporter_answers_200_and_up_0_when_redis_is_down() -> None:
    """Prometheus drops the body of a non-2xx scrape: only a 200 gets vlmq_up 0 stored."""
    down = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    code, body = _served(down)
    assert code == 200, body
    fams = _samples(body)
    assert _value(fams["vlmq_up"][1], "vlmq_up") == 0
    assert set(fams) == {"vlmq_up", "vlmq_scrape_seconds"}, sorted(fams)  # nothing made up
    rc, out = prom.check_metrics(body)
    assert rc == 0, out


def test_exporter_output_passes_promtool(redis: Redis) -> None:
    helpers.raw_enqueue(redis, payload(*images(1), task="caption"), queue="caption")
    code, body = _served(redis)
    assert code == 200, body
    assert _value(_samples(body)["vlmq_up"][1], "vlmq_up") == 1
    rc, out = prom.check_metrics(body)
    assert rc == 0, out


def test_exporter_refuses_a_port_in_use(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([helpers.VLMQ, "--redis-url", redis_url, "metrics", "--port",
                              str(port)], capture_output=True, text=True, timeout=60,
                             check=False)
    assert res.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in res.stderr, res.stderr


def _commands_per_scrape(redis: Redis) -> int:
    _scrape(redis)  # the first scrape also loads the scripts it runs
    redis.config_resetstat()
    _scrape(redis)
    stats = redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k not in ("cmdstat_info", "cmdstat_config"))


def _add_jobs(redis: Redis, n: int) -> None:
    """n queued jobs and n finished ones in two queues: real job hashes, RQ's keys."""
    for queue in ("ocr", "caption"):
        ids = [helpers.raw_enqueue(redis, payload(*images(1), task="caption"), queue=queue)
               for _ in range(n)]
        pipe = redis.pipeline(transaction=False)
        for job_id in ids[: n // 2]:
            pipe.lrem(Keys.rq_queue(queue), 1, job_id)
            pipe.zadd(Keys.rq_registry("finished", queue), {job_id: time.time() + 3600})
            pipe.hset(Keys.rq_job(job_id), "status", "finished")
        pipe.execute()


def test_exporter_cost_does_not_grow_with_jobs(own_redis: Redis) -> None:
    _add_jobs(own_redis, 20)
    few = _commands_per_scrape(own_redis)
    _add_jobs(own_redis, 2000)
    many = _commands_per_scrape(own_redis)
    assert _value(_scrape(own_redis)["vlmq_queue_jobs"], "vlmq_queue_jobs", queue="ocr",
                  state="finished") == 10 + 1000
    assert few == many, (few, many)
    queues = len(set(C.DEFAULT_QUEUE.values()))  # ocr and caption are among them
    assert many <= 4 + 10 * queues, many  # a fixed handful per queue


# --- render failures, counted from what the render pool really says ----------------------


def _failed(message: str) -> ItemResult:
    return ItemResult(index=0, source="a.pdf", page=1, text=None, finish_reason="error",
                      prompt_tokens=0, completion_tokens=0, vision_cache_hit=False,
                      error=message, timings={})


def test_render_failures_and_timeouts_are_counted_from_the_pool_s_errors() -> None:
    stats = WorkerStats("w", 4, 8)
    pool = RenderPool(1, mem_mb=256, timeout_s=0.5)
    try:
        for data, timeout in ((drawing_bomb_pdf(2_000_000), 30.0),  # over the memory limit
                              (drawing_bomb_pdf(2_000_000), 0.001)):  # over the time limit
            pool.timeout_s = timeout
            with pytest.raises(PreprocessError) as caught:
                pool.render(data, 1, 1288, doc_key=sha256_hex(data))
            stats.count_item(_failed(str(caught.value)), "ocr")
    finally:
        pool.close()
    stats.count_item(_failed("page 3 is out of range"), "ocr")  # a bad page, not the pool
    assert (stats.render_failures, stats.render_timeouts) == (2, 1)
    items, _, _, _ = stats.totals()
    assert items == {("ocr", "failed", "error"): 3}


# --- the worker's series, before and after its first items (no model) --------------------


@dataclass
class _Engine:
    """What the metrics read of the engine (worker/stats._EngineView), set by hand."""

    active: int = 0
    waiting: int = 0
    tower_calls: int = 0
    peak_waiting: int = 0
    busy_s: float = 0.0
    repetitions: int = 0
    isolations: int = 0
    kv_in_flight: int = 0
    kv_budget: int = 0
    batch_limit: int = 0
    batch_reason: str = ""
    prefix_hits: int = 0
    prefix_tokens_skipped: int = 0
    prefill_tokens: int = 0
    prefix_bytes: int = 0
    deferrals: int = 0
    interactive_admitted: int = 0
    bulk_rows_delayed: int = 0
    cancelled: int = 0


def _worker_scrape(metrics: WorkerMetrics) -> dict[str, tuple[str, list[Sample]]]:
    return _samples(generate_latest(metrics.registry).decode())


def _ran(finish_reason: str, *, completion: int = 7, error: str | None = None) -> ItemResult:
    """An item the model ran, with the timings the engine and writer record."""
    return ItemResult(index=0, source="a.png", page=None, text=None if error else "t",
                      finish_reason=finish_reason, prompt_tokens=300,
                      completion_tokens=completion, vision_cache_hit=False, error=error,
                      timings={"preprocess_s": 0.5, "queue_s": 0.25, "vision_s": 0.125,
                               "embed_s": 0.0625, "prefill_s": 0.0625, "generate_s": 2.0})


def test_worker_series_exist_at_zero_before_their_first_use() -> None:
    stats = WorkerStats("w", 4, 8)
    fams = _worker_scrape(WorkerMetrics(stats, lambda: (0, 0), queues=["ocr", "caption"]))
    s = {name: samples for name, (_, samples) in fams.items()}
    for task in C.TASKS:
        for outcome in ("ok", "failed"):
            for reason in FINISH_REASONS:
                assert _value(s["vlmq_items"], "vlmq_items_total", task=task, outcome=outcome,
                              finish_reason=reason) == 0
        for kind in ("prompt", "generated"):
            assert _value(s["vlmq_tokens"], "vlmq_tokens_total", task=task, kind=kind) == 0
        for name in ("vlmq_item_seconds", "vlmq_item_first_token_seconds",
                     "vlmq_item_queue_seconds", "vlmq_item_prefill_seconds",
                     "vlmq_item_decode_seconds", "vlmq_item_prompt_tokens",
                     "vlmq_item_generated_tokens"):
            assert fams[name][0] == "histogram", name
            assert _value(s[name], f"{name}_count", task=task) == 0, name
            assert _value(s[name], f"{name}_bucket", task=task, le="+Inf") == 0, name
    for phase in PHASES:
        assert _value(s["vlmq_item_phase_seconds"], "vlmq_item_phase_seconds_total",
                      phase=phase) == 0
    for queue in ("ocr", "caption"):
        for event in JOB_EVENTS:
            assert _value(s["vlmq_jobs"], "vlmq_jobs_total", queue=queue, event=event) == 0
        assert _value(s["vlmq_job_queue_wait_seconds"], "vlmq_job_queue_wait_seconds_count",
                      queue=queue) == 0
    assert _value(s["vlmq_kv_tokens_budget"], "vlmq_kv_tokens_budget") == 0  # no engine yet
    rc, out = prom.check_metrics(generate_latest(
        WorkerMetrics(stats, lambda: (0, 0), queues=["ocr"]).registry).decode())
    assert rc == 0, out


def test_worker_counts_items_by_finish_reason_and_observes_histograms() -> None:
    stats = WorkerStats("w", 4, 8)
    metrics = WorkerMetrics(stats, lambda: (0, 0), queues=["ocr"])
    stats.count_item(_ran("stop"), "ocr")
    stats.count_item(_ran("length", completion=4096), "ocr")
    stats.count_item(_ran("length", completion=4096), "ocr")
    stats.count_item(_ran("error", error="boom"), "ocr")
    stats.count_item(_failed("page 3 is out of range"), "ocr")  # prep failed: no timings
    stats.count_job("ocr", "taken", waited_s=42.0)
    fams = _worker_scrape(metrics)
    s = {name: samples for name, (_, samples) in fams.items()}

    def items(outcome: str, reason: str) -> float:
        return _value(s["vlmq_items"], "vlmq_items_total", task="ocr", outcome=outcome,
                      finish_reason=reason)

    assert (items("ok", "stop"), items("ok", "length"), items("failed", "error")) == (1, 2, 2)
    ran = 4  # the prep failure has no timings: it is in no histogram

    def h(name: str, suffix: str, **labels: str) -> float:
        return _value(s[name], f"{name}_{suffix}", **labels)

    assert h("vlmq_item_queue_seconds", "count", task="ocr") == ran
    assert h("vlmq_item_queue_seconds", "sum", task="ocr") == ran * 0.25
    assert h("vlmq_item_prefill_seconds", "sum", task="ocr") == ran * 0.25  # vision..prefill
    assert h("vlmq_item_decode_seconds", "sum", task="ocr") == ran * 2.0
    assert h("vlmq_item_first_token_seconds", "sum", task="ocr") == ran * 1.0
    assert h("vlmq_item_seconds", "sum", task="ocr") == ran * 3.0
    assert h("vlmq_item_prompt_tokens", "sum", task="ocr") == ran * 300
    # Tokens per item in 1-2-5 buckets: the 4096-token items land past 2000, under 5000.
    gen = "vlmq_item_generated_tokens"
    assert (h(gen, "bucket", task="ocr", le="10.0"), h(gen, "bucket", task="ocr", le="2000.0"),
            h(gen, "bucket", task="ocr", le="5000.0")) == (2, 2, 4)
    assert len(_matching(s[gen], f"{gen}_bucket", task="ocr")) == len(TOKEN_BUCKETS) + 1
    assert h("vlmq_job_queue_wait_seconds", "count", queue="ocr") == 1
    assert h("vlmq_job_queue_wait_seconds", "sum", queue="ocr") == 42.0
    assert h("vlmq_job_queue_wait_seconds", "bucket", queue="ocr", le="40.0") == 0
    assert h("vlmq_job_queue_wait_seconds", "bucket", queue="ocr", le="50.0") == 1
    assert _value(s["vlmq_jobs"], "vlmq_jobs_total", queue="ocr", event="taken") == 1


def test_worker_kv_budget_beside_the_tokens_in_flight() -> None:
    stats = WorkerStats("w", 4, 8)
    metrics = WorkerMetrics(stats, lambda: (0, 0))
    stats.engine = _Engine(active=2, kv_in_flight=3000, kv_budget=12000, batch_limit=4)
    s = {name: samples for name, (_, samples) in _worker_scrape(metrics).items()}
    assert _value(s["vlmq_kv_tokens_in_flight"], "vlmq_kv_tokens_in_flight") == 3000
    assert _value(s["vlmq_kv_tokens_budget"], "vlmq_kv_tokens_budget") == 12000


def test_worker_counts_interactive_requests_and_the_bulk_rows_they_delayed() -> None:
    """The chat queue's answers by how they ended (every end at 0 from the first scrape),
    time to first token and decode rate as histograms, promtool-clean."""
    stats = WorkerStats("w", 4, 8)
    metrics = WorkerMetrics(stats, lambda: (0, 0))
    stats.engine = _Engine(bulk_rows_delayed=3)
    stats.first_token("a", 0.05)
    stats.interactive_done("a", "stop", first_token_s=9.0, tokens=40, generate_s=0.5)
    stats.interactive_done("b", "cancelled")
    s = {name: samples for name, (_, samples) in _worker_scrape(metrics).items()}
    total = "vlmq_interactive_requests_total"
    assert _value(s["vlmq_interactive_requests"], total, finish_reason="stop") == 1
    assert _value(s["vlmq_interactive_requests"], total, finish_reason="cancelled") == 1
    assert _value(s["vlmq_interactive_requests"], total, finish_reason="error") == 0
    assert _value(s["vlmq_bulk_rows_delayed"], "vlmq_bulk_rows_delayed_total") == 3
    ttft = s["vlmq_interactive_ttft_seconds"]
    # The streamed first token counted, not the later estimate.
    assert _value(ttft, "vlmq_interactive_ttft_seconds_count") == 1
    assert _value(ttft, "vlmq_interactive_ttft_seconds_sum") == pytest.approx(0.05)
    rate = s["vlmq_interactive_tokens_per_second"]
    assert _value(rate, "vlmq_interactive_tokens_per_second_sum") == pytest.approx(80.0)
    rc, out = prom.check_metrics(generate_latest(metrics.registry).decode())
    assert rc == 0, out


def test_worker_shows_its_share_between_batches() -> None:
    """The jobs in hand by batch (the worker fills stats.shares at each stats tick): one
    series per batch, the jobs without one under their own name, promtool-clean."""
    stats = WorkerStats("w", 4, 8)
    metrics = WorkerMetrics(stats, lambda: (0, 0))
    stats.shares = fair.shares_of([("b-big", 1), ("b-big", 1), ("b-big", 3), ("b-one", 1),
                                   ("", 40)])
    s = {name: samples for name, (_, samples) in _worker_scrape(metrics).items()}
    assert _value(s["vlmq_share_jobs"], "vlmq_share_jobs", batch="b-big") == 3
    assert _value(s["vlmq_share_items"], "vlmq_share_items", batch="b-big") == 5
    assert _value(s["vlmq_share_jobs"], "vlmq_share_jobs", batch="b-one") == 1
    assert _value(s["vlmq_share_items"], "vlmq_share_items", batch=fair.LOOSE_NAME) == 40
    rc, out = prom.check_metrics(generate_latest(metrics.registry).decode())
    assert rc == 0, out
    stats.shares = []  # the batches ended: their series go
    s = {name: samples for name, (_, samples) in _worker_scrape(metrics).items()}
    assert s["vlmq_share_jobs"] == []


def test_engine_state_says_its_kv_budget(tiny_model: Path) -> None:
    """What the gauge reads: --max-kv-tokens from the start, else the budget the engine
    derives from the model and the machine's memory once loaded."""
    from vlmq.worker.engine.batcher import Engine

    given = Engine(str(tiny_model), max_kv_tokens=5000)
    derived = Engine(str(tiny_model))
    try:
        assert given.state.kv_budget == 5000
        helpers.wait_for(lambda: derived.state.kv_budget > 0, 300,
                         "the engine to derive its KV budget")
        derived.wait_ready(timeout=300)
    finally:
        given.close(timeout=10)
        derived.close(timeout=10)


def test_worker_identity_is_stable_across_restarts() -> None:
    """A named worker is its --name; an unnamed one host:port (its host.pid name changes
    at every start, so it labels nothing); the pid is a gauge's value."""
    stats = WorkerStats("box.4242", 4, 8)
    named = WorkerMetrics(WorkerStats("scanner-1", 4, 8), lambda: (0, 0))
    unnamed = WorkerMetrics(stats, lambda: (0, 0), named=False)
    try:
        port = unnamed.serve("127.0.0.1", 0)
        code, text = _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        unnamed.close()
    assert code == 200
    info = _samples(text)["vlmq_worker_info"][1][0].labels
    assert info["worker"] == f"{socket.gethostname()}:{port}", info
    assert "4242" not in text.split("vlmq_worker_info{", 1)[1].split("}", 1)[0]
    s = _worker_scrape(named)
    assert s["vlmq_worker_info"][1][0].labels["worker"] == "scanner-1"
    assert _value(s["vlmq_worker_pid"][1], "vlmq_worker_pid") == os.getpid()
