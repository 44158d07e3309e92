"""A worker's configuration: what `vlmq worker` parsed, in the units the worker uses.

The fields that options fill take their defaults from the option table
(worker/options.py): a WorkerConfig built in code (the demo, tests) gets the same
defaults as `vlmq worker` given nothing. tests/worker/test_worker_options.py holds the
fields and the rows to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vlmq.shared.keys import Keys
from vlmq.stores.backends import Stores
from vlmq.worker.engine.repetition import RepetitionGuard
from vlmq.worker.options import from_table


@dataclass
class WorkerConfig:
    redis_url: str
    model: str
    # Filled by options (worker/options.py), in their order; defaults from the table.
    queues: list[str] = field(default_factory=from_table("queues"))  # in priority order
    burst: bool = field(default_factory=from_table("burst"))
    max_batch: int = field(default_factory=from_table("max_batch"))  # the cap
    auto_batch: bool = field(default_factory=from_table("auto_batch"))  # measured limit
    cache_dir: Path | None = field(default_factory=from_table("cache_dir"))  # None: no disk
    cache_mem_bytes: int = field(default_factory=from_table("cache_mem_bytes"))
    cache_disk_bytes: int = field(default_factory=from_table("cache_disk_bytes"))
    name: str = field(default_factory=from_table("name"))
    grace_s: float = field(default_factory=from_table("grace_s"))
    prep_threads: int = field(default_factory=from_table("prep_threads"))
    # None: RQ's job monitoring interval + 60 s
    heartbeat_ttl: int | None = field(default_factory=from_table("heartbeat_ttl"))
    # The guard on looping rows; None: off
    repetition: RepetitionGuard | None = field(default_factory=from_table("repetition"))
    result_cache_ttl_s: int = field(default_factory=from_table("result_cache_ttl_s"))
    # 0 turns the shared result cache off
    result_cache_bytes: int = field(default_factory=from_table("result_cache_bytes"))
    render_mem_mb: int = field(default_factory=from_table("render_mem_mb"))
    render_timeout_s: float = field(default_factory=from_table("render_timeout_s"))
    render_procs: int | None = field(default_factory=from_table("render_procs"))  # None: prep
    # None: derived from the model and machine memory
    max_kv_tokens: int | None = field(default_factory=from_table("max_kv_tokens"))
    # Prompt prefixes reused across rows (worker/engine/prefix_cache.py); None: from the
    # machine's memory, 0: off
    prefix_cache_bytes: int | None = field(default_factory=from_table("prefix_cache_bytes"))
    # Worker deaths a job may cause before it fails
    poison_kills: int = field(default_factory=from_table("poison_kills"))
    # auto | reference | a library path; None: $VLMQ_BLAS, else auto
    blas: str | None = field(default_factory=from_table("blas"))
    # None: $VLMQ_ALLOW_EVICTION
    allow_eviction: bool | None = field(default_factory=from_table("allow_eviction"))
    # Prometheus /metrics (worker/metrics.py); port 0: not served
    metrics_port: int = field(default_factory=from_table("metrics_port"))
    metrics_host: str = field(default_factory=from_table("metrics_host"))
    # The stores referenced items are read from (machine configuration, --store)
    stores: Stores = field(default_factory=from_table("stores"))
    # Not options (options.CONFIG_ONLY).
    keys: Keys = field(default_factory=Keys.from_env)
    window: int | None = None      # prepared-but-not-batched bound (default: prep_window)
    max_jobs: int | None = None    # jobs in flight; default max(4, the batch limit)
    stats_s: float = 2.0

    def prep_window(self, batch_limit: int) -> int:
        """Twice the limit the sizer may try next (the cap bounds it): when the limit
        doubles, the rows that fill it are prepared already, not rendered from then on."""
        return self.window or 2 * min(self.max_batch, 2 * batch_limit)

    def job_limit(self, batch_limit: int) -> int:
        return self.max_jobs or max(4, batch_limit)
