"""Every `vlmq worker` option, defined once: flag, kind, range, default, help, and the
WorkerConfig field it fills.

`vlmq worker`'s click options (cli/worker.py), WorkerConfig's fields and defaults
(worker/config.py) and the worker arguments `vlmq service` writes into a unit
(cli/units.py) all follow from OPTIONS, so a new worker option is one row here plus the
code that uses its value. Modelled on the job settings' table (shared/settings.py).

A row's `default` is the option's own, in the option's units (MiB, GB, seconds, None for
"decided when the worker starts"); `to_config` turns the option's value into the field's
(bytes, a resolved default). Rows that together make one value (the repetition guard)
name the same field and COMPOSITES builds it. This module imports no click and nothing
heavy: the CLI loads it on every `vlmq` command listing.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from vlmq.shared import constants as C
from vlmq.shared import logs
from vlmq.shared.chat import CHAT_QUEUE
from vlmq.shared.keys import QUEUE_NAME_RE
from vlmq.stores.backends import STORES_ENV, FolderStore, S3Store, Store, StoreError, Stores
from vlmq.worker.engine.batch_size import DEFAULT_CAP, FLOOR
from vlmq.worker.engine.repetition import ON_REPETITION, RepetitionGuard
from vlmq.worker.model import names
from vlmq.worker.model.default_dirs import default_cache_dir

# Defaults the modules that use them import from here (render_pool, results/cache, poison):
# those modules load numpy and Redis, which this table must not.
DEFAULT_RENDER_MEM_MB = 1024
DEFAULT_RENDER_TIMEOUT_S = 60.0
DEFAULT_RESULT_CACHE_TTL_S = 30 * 24 * 3600
DEFAULT_RESULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_POISON_KILLS = 2
MAX_DEFAULT_PREP_THREADS = 4  # --prep-threads when not given: the cores, at most this
# --heartbeat-ttl when not given: RQ's job_monitoring_interval (30 s) + 60, what
# BatchWorker takes then (worker/jobs/running.py; a test holds the two together).
DEFAULT_HEARTBEAT_TTL_S = 90
# worker/model/blas.py's WORKER_THREADS_RULE, which a test holds this to: blas loads
# ctypes and importlib.metadata, which `vlmq worker --help` need not.
WORKER_THREADS_RULE = ("the cores this process may use minus --prep-threads, at least 1, "
                       "unless MKL_NUM_THREADS (for MKL) or OPENBLAS_NUM_THREADS is set")
# Interactive requests first: a worker serves them ahead of every bulk queue.
DEFAULT_QUEUES = (CHAT_QUEUE, *(C.DEFAULT_QUEUE[task] for task in C.TASKS))
_GUARD = RepetitionGuard()  # the guard's own defaults are the options'

# str, int, float (ranges lo..hi), path (a folder), flag (on when given), choice,
# strs (repeatable), stores (--store NAME=URL, repeatable: cli.common.store_option's).
KINDS = ("str", "int", "float", "path", "flag", "choice", "strs", "stores")
# local_path: how `vlmq service` treats the value. The unit runs in its cache directory,
# so a relative path would name another file there.
PATH = "path"  # always a local path: refused unless absolute
PATH_OR_ID = "path or id"  # a local path when one exists by that name (else a hub id)
# MiB and GiB as the options count them.
_MIB = 1024 * 1024
_GIB = 1024**3


class OptionError(ValueError):
    """An option's value refused when it becomes a config value; `flag` names the option."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag
        self.message = message


def _same(value: Any) -> Any:
    return value


def _mib(value: float) -> int:
    return int(value * _MIB)


def _mib_or_none(value: float | None) -> int | None:
    return None if value is None else _mib(value)


def _gib(value: float) -> int:
    return int(value * _GIB)


def _measured(fixed: bool) -> bool:
    """--fixed-batch turns off the measured batch size (auto_batch)."""
    return not fixed


def _true_or_none(value: bool) -> bool | None:
    """A flag whose absence leaves the decision to the environment ($VLMQ_ALLOW_EVICTION)."""
    return True if value else None


def default_name() -> str:
    """A worker's name without --name: unique in Redis, new at every start (host.pid)."""
    return f"{socket.gethostname()}.{os.getpid()}"


def _worker_name(value: str | None) -> str:
    return value or default_name()


def _prep_threads(value: int | None) -> int:
    return value or min(MAX_DEFAULT_PREP_THREADS, os.cpu_count() or 2)


def _cache_dir(value: Path | None) -> Path:
    return value if value is not None else default_cache_dir() / "vision"


def stores(value: Stores | Iterable[str]) -> Stores:
    """--store's value: a Stores (click's callback parsed it) or NAME=URL specs."""
    if isinstance(value, Stores):
        return value
    try:
        return Stores.parse(value)
    except StoreError as exc:
        raise ValueError(str(exc)) from None


def queue_names(values: Iterable[str]) -> list[str]:
    """--queues as names in priority order (the defaults when none is given), refused when
    one is not a queue name, before the model loads."""
    queues: list[str] = []
    for value in values:
        for name in value.replace(",", " ").split():
            if name not in queues:
                queues.append(name)
    queues = queues or list(DEFAULT_QUEUES)
    bad = [q for q in queues if not QUEUE_NAME_RE.fullmatch(q)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a queue name (letters, digits, _ . -)")
    return queues


def _repetition(values: Mapping[str, Any]) -> RepetitionGuard | None:
    """The four --repetition options as one guard; 0 repeats turns it off."""
    if values["repetition_repeats"] == 0:
        return None
    return RepetitionGuard(max_period=values["repetition_period"],
                           min_repeats=max(2, values["repetition_repeats"]),
                           min_span=values["repetition_min_span"],
                           on_repetition=values["on_repetition"])


@dataclass(frozen=True)
class WorkerOption:
    """One `vlmq worker` option. `field` is the WorkerConfig field it fills: by default the
    option's name; None when the command itself uses the value (--with-scheduler)."""

    name: str
    kind: str
    help: str
    default: Any = None  # in the option's units; None: decided when the worker starts
    field: str | None = ""  # "": the same as name
    to_config: Callable[[Any], Any] = _same  # the option's value -> the field's
    lo: float | None = None
    hi: float | None = None
    required: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    envvar: str | None = None
    flag: str | None = None
    local_path: str = ""  # PATH, PATH_OR_ID: `vlmq service` wants it absolute

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def config_field(self) -> str | None:
        return self.name if self.field == "" else self.field

    @property
    def show_default(self) -> bool:
        """--help shows a default that is a value (not "decided at start", not a flag's)."""
        return self.default is not None and self.kind not in ("flag", "strs", "stores")

    def words(self, value: Any) -> list[str]:
        """The command-line words that give this option `value` (what a unit writes)."""
        if self.kind == "flag":
            return [self.cli_flag] if value else []
        if self.kind == "strs":
            return [w for entry in value for w in (self.cli_flag, entry)]
        if self.kind == "stores":
            return [w for store in stores(value) for w in (self.cli_flag, store_spec(store))]
        text = _number(value) if self.kind == "float" else str(value)
        return [self.cli_flag, text]


def _number(value: float) -> str:
    """A float as the shortest word that reads back as it: 50 for 50.0, 0.1 for 0.1."""
    number = float(value)
    return str(int(number)) if math.isfinite(number) and number.is_integer() else repr(number)


def store_spec(store: Store) -> str:
    """`NAME=URL` that Stores.parse reads back as this store (the path %-quoted)."""
    if isinstance(store, FolderStore):
        return f"{store.name}={store.url}"  # a file:// URI, already quoted
    if isinstance(store, S3Store):
        return f"{store.name}=s3://{store.bucket}/{quote(store.prefix)}"
    raise TypeError(f"no --store form for {type(store).__name__}")


def _log_row(option: logs.LogOption) -> WorkerOption:
    """A logging option as a row: the command sets logging up with its value, so it fills
    no WorkerConfig field."""
    return WorkerOption(option.name, "choice" if option.choices else "flag", option.help,
                        default=option.default, field=None, choices=option.choices,
                        flag=option.flag)


OPTIONS: tuple[WorkerOption, ...] = (
    WorkerOption("model", "str", "Local model folder, a hub id (mlx-community/...), or a "
                 "name vlmq has offline. " + names.help_text(), required=True,
                 local_path=PATH_OR_ID),
    WorkerOption("queues", "strs", "Queues to serve, in priority order, comma-separated: "
                 "--queues ocr,caption (repeatable; default: "
                 f"{','.join(DEFAULT_QUEUES)}).", default=(), to_config=queue_names,
                 metavar="Q1,Q2,..."),
    WorkerOption("burst", "flag", "Exit once the queues are empty and all work is done.",
                 default=False),
    WorkerOption("max_batch", "int", "Most sequences decoded together. The batch starts at "
                 f"{FLOOR} and grows while measured tokens/s keeps rising (the worker logs what it "
                 "chose and why); --fixed-batch uses exactly this many. A quarter more rows "
                 "are kept for small jobs (express rows).", default=DEFAULT_CAP,
                 lo=1, hi=256),
    WorkerOption("fixed_batch", "flag", "Decode exactly --max-batch sequences together: no "
                 "measuring.", default=False, field="auto_batch", to_config=_measured),
    WorkerOption("cache_dir", "path", "Disk tier of the vision-feature cache (default: "
                 "vision/ in $VLMQ_CACHE, else in $XDG_CACHE_HOME/vlmq, else in "
                 "~/.cache/vlmq).", to_config=_cache_dir, local_path=PATH),
    WorkerOption("cache_mem_mb", "int", "Memory tier of the vision-feature cache (LRU by "
                 "bytes).", default=1024, lo=0, field="cache_mem_bytes", to_config=_mib),
    WorkerOption("cache_disk_gb", "float", "Disk tier bound (LRU); survives restarts.",
                 default=10.0, lo=0, field="cache_disk_bytes", to_config=_gib),
    WorkerOption("name", "str", "Worker name (default: host.pid).", to_config=_worker_name),
    WorkerOption("grace", "float", "Seconds to finish in-flight items after SIGTERM/SIGINT "
                 "before requeueing.", default=30.0, lo=0, field="grace_s"),
    WorkerOption("prep_threads", "int", "CPU threads for fetch/decode/render/tokenize "
                 f"(default: cores, at most {MAX_DEFAULT_PREP_THREADS}).", lo=1, hi=64,
                 to_config=_prep_threads),
    WorkerOption("heartbeat_ttl", "int", "Seconds without a heartbeat after which this "
                 "worker's jobs count as abandoned and are requeued (default "
                 f"{DEFAULT_HEARTBEAT_TTL_S}).", lo=1),
    WorkerOption("on_repetition", "choice", "A row whose tail loops is stopped "
                 "(finish_reason 'repetition', text kept up to the first repeat), or retried "
                 "once at temperature 0.7.", default=_GUARD.on_repetition,
                 choices=ON_REPETITION, field="repetition"),
    WorkerOption("repetition_repeats", "int", "Repeats of a block that count as a loop (0: "
                 "guard off).", default=_GUARD.min_repeats, lo=0, field="repetition"),
    WorkerOption("repetition_min_span", "int", "Tokens a loop must cover, so short runs of "
                 "one token are left alone.", default=_GUARD.min_span, lo=1,
                 field="repetition"),
    WorkerOption("repetition_period", "int", "Longest repeating block, in tokens.",
                 default=_GUARD.max_period, lo=1, hi=1024, field="repetition"),
    WorkerOption("result_cache_ttl", "int", "Seconds a finished item's text stays in the "
                 "shared result cache (in Redis, for every worker).",
                 default=DEFAULT_RESULT_CACHE_TTL_S, lo=1, metavar="S",
                 field="result_cache_ttl_s"),
    WorkerOption("result_cache_mb", "float", "Byte budget of the shared result cache; the "
                 "oldest entries go first. 0 turns it off for the items this worker runs.",
                 default=DEFAULT_RESULT_CACHE_BYTES / _MIB, lo=0, field="result_cache_bytes",
                 to_config=_mib),
    WorkerOption("print_config", "flag", "Print every option's effective value and where it "
                 "came from (flag, env, config file, default) as TOML, and exit.",
                 default=False, field=None),
    WorkerOption("with_scheduler", "flag", "Also fire schedules (vlmq schedule) from this "
                 "process, as `vlmq scheduler` does; any number of schedulers may run.",
                 default=False, field=None),
    WorkerOption("render_mem_mb", "int", "Memory limit of each render process (PDF pages, "
                 "images, TIFF pages), and the largest referenced input read; an item over "
                 "it fails alone.", default=DEFAULT_RENDER_MEM_MB, lo=64),
    WorkerOption("render_timeout", "float", "Seconds one PDF page, image or TIFF page may "
                 "take to decode before it fails alone.", default=DEFAULT_RENDER_TIMEOUT_S,
                 lo=0.1, field="render_timeout_s"),
    WorkerOption("render_procs", "int", "Render processes, which decode every input "
                 "(default: --prep-threads).", lo=1, hi=64),
    WorkerOption("max_kv_tokens", "int", "Admit a sequence only while the sum of (prompt + "
                 "max_tokens) in flight stays under this (default: from the model's KV size "
                 "and the machine's memory); a longer request runs alone.", lo=1),
    WorkerOption("prefix_cache_mb", "int", "Memory for reused prompt prefixes: the key/value "
                 "cache of an image and the template text around it, prefilled once for "
                 "every row and job with that image and prefix (LRU by bytes; default: a "
                 "16th of the machine's memory, at most 1024; 0: off). Given, it also turns "
                 "reuse on for qwen2_vl, whose prompt comes before the image.", lo=0,
                 field="prefix_cache_bytes", to_config=_mib_or_none),
    WorkerOption("poison_kills", "int", "A job whose item was being processed when this "
                 "many workers died is failed, naming the item (other jobs of a dead worker "
                 "keep their retries).", default=DEFAULT_POISON_KILLS, lo=1),
    WorkerOption("blas", "str", "BLAS for MLX's CPU matmuls on Linux: auto (MKL where "
                 "the worker extra installs it, else the system OpenBLAS, else the wheel "
                 "copy), reference (the slow one mlx[cpu] links) or a library path "
                 "(default: $VLMQ_BLAS, else auto). BLAS threads: "
                 f"{WORKER_THREADS_RULE}.",
                 metavar="auto|reference|PATH"),
    WorkerOption("allow_eviction", "flag", "Run even though Redis's maxmemory-policy may "
                 "evict keys (a warning still says what that loses); also "
                 "$VLMQ_ALLOW_EVICTION=1.", default=False, to_config=_true_or_none),
    WorkerOption("metrics_port", "int", "Serve Prometheus metrics at "
                 "http://HOST:PORT/metrics (0: off).", default=0, lo=0, hi=65535),
    WorkerOption("metrics_host", "str", "Interface the metrics endpoint listens on "
                 "(0.0.0.0: every interface).", default="127.0.0.1"),
    # --log-level, -v, -q, --log-format: every long-running command's (shared/logs.py).
    *(_log_row(option) for option in logs.OPTIONS),
    # Its click form is cli.common.store_option, which every command with --store shares
    # (the help there says more); click's value is a Stores already.
    WorkerOption("stores", "stores", "A store this machine reads inputs from by reference "
                 "(NAME=URL, repeatable).", default=(), to_config=stores, flag="--store",
                 metavar="NAME=URL", envvar=STORES_ENV),
)

BY_NAME: Mapping[str, WorkerOption] = {row.name: row for row in OPTIONS}
# Config fields that several rows make together: the rows' values by name -> the field's.
COMPOSITES: Mapping[str, Callable[[Mapping[str, Any]], Any]] = {"repetition": _repetition}
# WorkerConfig fields no worker option fills: the root command's --redis-url, the key
# prefix ($VLMQ_PREFIX), and bounds that tests, benchmarks and the demo set.
CONFIG_ONLY = ("redis_url", "keys", "window", "max_jobs", "stats_s")


def _by_field(rows: Sequence[WorkerOption]) -> dict[str, list[WorkerOption]]:
    out: dict[str, list[WorkerOption]] = {}
    for row in rows:
        if row.config_field is not None:
            out.setdefault(row.config_field, []).append(row)
    return out


def _field_value(name: str, rows: list[WorkerOption], values: Mapping[str, Any]) -> Any:
    if name not in COMPOSITES and len(rows) > 1:
        raise TypeError(f"options {', '.join(r.name for r in rows)} all fill {name}: "
                        "COMPOSITES needs a builder for it")
    try:
        if name in COMPOSITES:
            return COMPOSITES[name]({row.name: values[row.name] for row in rows})
        return rows[0].to_config(values[rows[0].name])
    except ValueError as exc:
        raise OptionError(", ".join(row.cli_flag for row in rows), str(exc)) from None


def config_values(values: Mapping[str, Any],
                  rows: Sequence[WorkerOption] = OPTIONS) -> dict[str, Any]:
    """WorkerConfig's keyword arguments from option values by name (what click parsed);
    OptionError names the option whose value is refused."""
    return {name: _field_value(name, group, values) for name, group in _by_field(rows).items()}


def defaults(rows: Sequence[WorkerOption] = OPTIONS) -> dict[str, Any]:
    """Every option's default by name: the values of a `vlmq worker` given nothing."""
    return {row.name: row.default for row in rows}


def config_default(name: str, rows: Sequence[WorkerOption] = OPTIONS) -> Any:
    """A WorkerConfig field's default: its rows' defaults, made config values."""
    return _field_value(name, _by_field(rows)[name], defaults(rows))


def from_table(name: str, rows: Sequence[WorkerOption] = OPTIONS) -> Callable[[], Any]:
    """The default factory of a WorkerConfig field that option rows fill: their defaults,
    made config values when a config is made (some are decided then: host.pid, cores)."""
    if all(row.required for row in _by_field(rows)[name]):
        raise ValueError(f"{name}: a required option's field has no default")
    return lambda: config_default(name, rows)


def unit_args(values: Mapping[str, Any], given: Iterable[str],
              rows: Sequence[WorkerOption] = OPTIONS) -> list[str]:
    """The `vlmq worker` arguments for the options in `given` (by name, in that order) with
    these values: what `vlmq service` writes into a unit."""
    by_name = {row.name: row for row in rows}
    return [word for name in given for word in by_name[name].words(values[name])]


def local_paths(rows: Sequence[WorkerOption] = OPTIONS) -> list[WorkerOption]:
    """The options whose value is (or may be) a local path."""
    return [row for row in rows if row.local_path]
