"""A worker's options, as the CLI (cli/worker.py) and tests build them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vlmq.shared.keys import Keys
from vlmq.stores.backends import Stores
from vlmq.worker.engine.batch_size import DEFAULT_CAP
from vlmq.worker.engine.repetition import RepetitionGuard
from vlmq.worker.intake.poison import DEFAULT_POISON_KILLS
from vlmq.worker.prep.render_pool import DEFAULT_MEM_MB as DEFAULT_RENDER_MEM_MB
from vlmq.worker.prep.render_pool import DEFAULT_TIMEOUT_S as DEFAULT_RENDER_TIMEOUT_S
from vlmq.worker.results.cache import DEFAULT_MAX_BYTES, DEFAULT_TTL_S


@dataclass
class WorkerConfig:
    redis_url: str
    model: str
    queues: list[str]
    burst: bool = False
    max_batch: int = DEFAULT_CAP  # the cap; with auto_batch the limit is measured below it
    auto_batch: bool = True  # the row limit follows measured throughput (batch_size.py)
    cache_dir: Path | None = None
    cache_mem_bytes: int = 1024 * 1024 * 1024
    cache_disk_bytes: int = 10 * 1024**3
    name: str = "vlmq-worker"
    grace_s: float = 30.0
    prep_threads: int = 2
    window: int | None = None      # prepared-but-not-batched bound; default 2 x the limit
    max_jobs: int | None = None    # jobs in flight; default max(4, the batch limit)
    stats_s: float = 2.0
    heartbeat_ttl: int | None = None  # None: RQ's job monitoring interval + 60 s
    result_cache_ttl_s: int = DEFAULT_TTL_S
    result_cache_bytes: int = DEFAULT_MAX_BYTES  # 0 turns the shared result cache off
    render_procs: int | None = None  # PDF render processes; default prep_threads
    render_mem_mb: int = DEFAULT_RENDER_MEM_MB
    render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    max_kv_tokens: int | None = None  # None: derived from the model and machine memory
    poison_kills: int = DEFAULT_POISON_KILLS  # worker deaths a job may cause before it fails
    blas: str | None = None  # auto | reference | a library path; None: $VLMQ_BLAS, else auto
    allow_eviction: bool | None = None  # None: $VLMQ_ALLOW_EVICTION
    metrics_port: int = 0  # Prometheus /metrics (worker/metrics.py); 0: not served
    metrics_host: str = "127.0.0.1"
    # The stores referenced items are read from (machine configuration, --store).
    stores: Stores = field(default_factory=Stores)
    keys: Keys = field(default_factory=Keys.from_env)
    repetition: RepetitionGuard | None = field(default_factory=RepetitionGuard)  # None: off

    def prep_window(self, batch_limit: int) -> int:
        return self.window or 2 * batch_limit

    def job_limit(self, batch_limit: int) -> int:
        return self.max_jobs or max(4, batch_limit)
