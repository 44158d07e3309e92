"""Schedules: caption/OCR/extract runs over folders, fired exactly once per due time, incremental.

A schedule lives in Redis (any machine adds one, any scheduler fires it). Due times come
from `--every SECONDS` (slots anchored at creation) or a cron expression (croniter). A
scheduler claims a due time with one compare-and-set on the schedule's `next_due` in Lua,
so however many schedulers run, each due time fires once; one that was down catches up
with a single run for the latest missed slot.

A run reads the paths on the scheduler's machine (workers only ever get blobs) and
enqueues only the work not yet done under the schedule's current settings. The unit of
work is (settings hash, source, content sha256, page): an edited file has a new sha256,
a prompt change a new settings hash, so both are due again. An item counts as done only
once its job finished and the item itself succeeded: a failed item stays due for the
next run, and items still in a job in flight are not enqueued twice. Moved or copied
files are due again under their new name (the workers' result cache makes that cheap).

A file whose size and mtime are unchanged since the last run is not read again: its
sha256 comes from the last run's reading (uploads still verify the bytes).

Keys, under the vlmq prefix (see shared/keys.py): the schedule's hash (definition,
next_due, paused), its done set, its pending jobs, its files' last readings and its run
history.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter
from redis import Redis
from redis.exceptions import LockError, RedisError
from redis.typing import EncodableT, FieldT

from vlmq.media.opener import DECODE_ERRORS
from vlmq.producer import job_sets
from vlmq.producer.client import TERMINAL, Client, Job
from vlmq.producer.errors import JobNotFound
from vlmq.producer.expand import S3_SCHEME, FoundFile, expand_inputs
from vlmq.producer.files import CheckedFile, check_found
from vlmq.producer.inputs import Prepared, not_media
from vlmq.producer.ops.export import ExportReport, export_results
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared import extract_schema, lua
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError, VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult, Ref
from vlmq.shared.redis_text import as_str
from vlmq.stores.backends import Stores

log = logging.getLogger("vlmq.scheduler")

HISTORY = 50
# Ends each known-file entry ("size:mtime:sha256:kind:pages:t2"): entries from before a
# TIFF had pages lack it, and are read again once.
ENTRY_MARK = "t2"
RUN_LOCK_S = 600  # a run that takes longer (reading a huge tree) lets another start
# Hashed even when unset, as schedules hashed them before the settings table: an upgrade
# must not make every file of a schedule due again.
_HASHED_ALWAYS = ("prompt", "max_tokens", "max_side", "model")
# The tasks a schedule runs: those over folders of files without a per-run prompt.
TASKS = ("caption", "ocr", "extract")
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ScheduleError(VlmqError):
    """A schedule cannot be added, found or run; the message says why."""


@dataclass(frozen=True)
class Schedule:
    name: str
    task: str
    paths: tuple[str, ...]  # absolute, on the scheduler's machine
    every: float | None = None
    cron: str | None = None
    tz: str = "UTC"
    recursive: bool = False
    # The job settings its runs' jobs get, by name (those shared/settings.py lets a
    # schedule carry); checked when the schedule is made.
    settings: dict[str, Any] = field(default_factory=dict)
    export_dir: str | None = None
    export_format: str = "md"
    sidecar: bool = False
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.name or not set(self.name) <= NAME_CHARS or len(self.name) > 64:
            raise ScheduleError(f"schedule name {self.name!r}: use 1-64 letters, digits, _ . -")
        if self.task not in TASKS:
            raise ScheduleError(f"task must be {', '.join(TASKS[:-1])} or {TASKS[-1]}, "
                                f"got {self.task!r}")
        self._check_when()
        if self.export_dir is not None and self.sidecar:
            raise ScheduleError("give at most one of --export and --sidecar")
        if not self.paths:
            raise ScheduleError("give at least one path")
        self.options()  # refuses bad job options now, not at 3 a.m.
        try:
            extract_schema.check_task(self.task, self.settings.get("schema"))
        except PayloadError as exc:  # named as the flag that gives it
            raise ScheduleError(f"--schema {exc.problem}") from None

    def _check_when(self) -> None:
        """Due times it can compute: one of --every (at least a second) and --cron, in a
        known time zone; refused when the schedule is made, not when it would fire."""
        if (self.every is None) == (self.cron is None):
            raise ScheduleError("give exactly one of --cron and --every")
        if self.every is not None and not (math.isfinite(self.every) and self.every >= 1):
            raise ScheduleError(f"--every must be at least 1 second, got {self.every}")
        if self.cron is not None and not croniter.is_valid(self.cron):
            raise ScheduleError(f"--cron {self.cron!r} is not a valid cron expression")
        try:
            ZoneInfo(self.tz)
        except (KeyError, ValueError) as exc:
            raise ScheduleError(f"--tz {self.tz!r} is not a known time zone") from exc

    def options(self) -> JobOptions:
        unknown = set(self.settings) - {r.name for r in S.rows("schedule")}
        if unknown:
            raise ScheduleError(f"a schedule cannot set {', '.join(sorted(unknown))}")
        labels = {**self.settings.get("labels", {}), "schedule": self.name}
        return JobOptions(**{**self.settings, "labels": labels})

    def settings_hash(self) -> str:
        """What decides an item's text; a change makes every file due again."""
        given = self.options().given
        parts = {"task": self.task, **dict.fromkeys(_HASHED_ALWAYS),
                 **{s.name: _hashed(s, given[s.name]) for s in S.SETTINGS
                    if s.decides_text and s.name in given}}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Schedule:
        data = json.loads(raw)
        data["paths"] = tuple(data["paths"])
        # Schedules written before the settings table kept each setting at the top level.
        legacy = {k: data.pop(k) for k in list(data) if k in S.BY_NAME}
        data["settings"] = {**{k: v for k, v in legacy.items() if v not in (None, {})},
                            **data.get("settings", {})}
        return cls(**data)

    # --- due times --------------------------------------------------------------------

    def next_after(self, t: float) -> float:
        """The first due time strictly after t."""
        if self.every is not None:
            k = math.floor((t - self.created_at) / self.every) + 1
            return self.created_at + max(k, 1) * self.every
        assert self.cron is not None
        base = datetime.fromtimestamp(t, ZoneInfo(self.tz))
        return float(croniter(self.cron, base).get_next(float))

    def latest_due(self, now: float) -> float:
        """The last due time at or before now (now itself if none has passed yet)."""
        if self.every is not None:
            k = math.floor((now - self.created_at) / self.every)
            return self.created_at + k * self.every if k >= 1 else now
        assert self.cron is not None
        it = croniter(self.cron, datetime.fromtimestamp(now, ZoneInfo(self.tz)))
        prev = float(it.get_prev(float))
        nxt = float(croniter(self.cron, datetime.fromtimestamp(prev, ZoneInfo(self.tz)))
                    .get_next(float))
        return nxt if nxt <= now else prev


def _hashed(setting: S.Setting, value: Any) -> Any:
    """A setting's value as the settings hash takes it: a schema as its text, since its
    key order (the order the model writes fields in) changes the items' text."""
    return extract_schema.schema_text(value) if setting.kind == "schema" else value


def _ms(t: float) -> str:
    return str(round(t * 1000))


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def scan(schedule: Schedule, stores: Stores | None = None
         ) -> tuple[list[FoundFile], list[str]]:
    """Every input file under the schedule's paths (s3:// ones listed through `stores`),
    and the paths that are gone."""
    found: list[FoundFile] = []
    missing: list[str] = []
    for path in schedule.paths:
        files, errors = expand_inputs([path], stores or Stores(),
                                      recursive=schedule.recursive)
        if path.startswith(S3_SCHEME):
            if errors:
                missing.append(path)
            found.extend(files)
            continue
        files = [f for f in files if os.path.exists(f.path)]
        if not files and not os.path.exists(path):  # a glob matching nothing too
            missing.append(path)
            continue
        found.extend(files)
    return found, missing


def _checked(f: FoundFile, known: str | None, stores: Stores | None = None
             ) -> tuple[CheckedFile, str]:
    """The file checked, and its entry for the next run. Unchanged size and mtime (size
    and ETag for S3, from the listing): the last run's reading is reused (rsync's rule),
    so a nightly run over 10,000 photos reads only the new and edited ones. Uploads still
    verify the bytes against the sha256, and so do workers reading references."""
    stores = stores or Stores()
    if f.stamp is not None:
        stamp = f.stamp
    else:
        try:
            st = os.stat(f.path)
        except OSError as exc:
            raise InputError(f.source, f"cannot be read: {exc.strerror or exc}") from exc
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
    fields = known.split(":") if known is not None else []
    # An entry without the ENTRY_MARK was written before TIFFs had pages: its "image:1"
    # may be a 5-page TIFF, so such an entry is read again once (a "pdf" one still holds).
    fresh = (len(fields) == 6 and fields[5] == ENTRY_MARK) or (
        len(fields) == 5 and fields[3] == "pdf")
    if known is not None and fresh:
        size, mtime, sha256, kind, pages = fields[:5]
        if f"{size}:{mtime}" == stamp and kind in C.ITEM_KINDS:
            ref = _ref_of(f, stores)
            return CheckedFile(path=Path(f.path), source=f.source, kind=kind, pages=int(pages),
                               sha256=sha256, size=int(size), ref=ref), known
    checked = check_found(f, stores)
    return checked, (f"{stamp}:{checked.sha256}:{checked.kind}:{checked.pages}:"
                     f"{ENTRY_MARK}")


def _ref_of(f: FoundFile, stores: Stores) -> Ref | None:
    """Where an unchanged file is, as a reference (None: it is uploaded)."""
    hit = stores.for_url(f.path) if f.path.startswith(S3_SCHEME) else None
    if hit is not None:
        return Ref(hit[0].name, hit[1])
    return stores.ref_for_path(f.path) if stores else None


# A unit of work a run may enqueue: (file, its checking, page or None, unit hash).
_Candidate = tuple[FoundFile, CheckedFile, int | None, str]


def _units(settings: str, f: FoundFile, checked: CheckedFile) -> list[tuple[int | None, str]]:
    """(page, unit) of each item a checked file makes: a paged file's pages, else one."""
    pages: list[int | None] = (list(range(1, checked.pages + 1))
                               if checked.kind in C.PAGED_KINDS else [None])
    return [(page, _unit(settings, f.source, checked.sha256, page)) for page in pages]


def _unit(settings: str, source: str, sha256: str, page: int | None) -> str:
    raw = f"{settings}\0{source}\0{sha256}\0{page or 0}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class ScheduleStore:
    """Schedules, their state and history in Redis; firing and finishing runs."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.redis: Redis = client.redis
        self.keys: Keys = client.keys
        self._claim = lua.script(self.redis, lua.SCHEDULE_CLAIM)
        self.who = f"{socket.gethostname()}.{os.getpid()}"

    # --- definitions ------------------------------------------------------------------

    def add(self, schedule: Schedule, *, replace: bool = False) -> float:
        """Store a schedule; returns its first due time. Replacing keeps history and done
        marks (a settings change makes the files due through the settings hash)."""
        key = self.keys.schedule(schedule.name)
        first = schedule.next_after(time.time())
        if replace:
            self.redis.hset(key, "def", schedule.to_json())
        elif not self.redis.hsetnx(key, "def", schedule.to_json()):  # two adds: one wins
            raise ScheduleError(f"a schedule named {schedule.name!r} exists; remove it first "
                                "or pass --replace")
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, "next_due", _ms(first))
        pipe.sadd(self.keys.schedules, schedule.name)
        pipe.execute()
        return first

    def get(self, name: str) -> Schedule:
        raw = self.redis.hget(self.keys.schedule(name), "def")
        if raw is None:
            raise ScheduleError(f"no schedule named {name!r}")
        return Schedule.from_json(raw)

    def names(self) -> list[str]:
        return sorted(as_str(n) for n in self.redis.smembers(self.keys.schedules))

    def remove(self, name: str) -> None:
        self.get(name)
        self.redis.delete(self.keys.schedule(name), self.keys.schedule_done(name),
                          self.keys.schedule_pending(name), self.keys.schedule_runs(name),
                          self.keys.schedule_files(name))
        self.redis.srem(self.keys.schedules, name)

    def set_paused(self, name: str, paused: bool) -> None:
        self.get(name)
        self.redis.hset(self.keys.schedule(name), "paused", "1" if paused else "0")

    def describe(self, name: str) -> dict[str, Any]:
        """What `schedule list` shows: the definition, next due time, paused, history."""
        sched = self.get(name)
        state = {as_str(k): as_str(v)
                 for k, v in self.redis.hgetall(self.keys.schedule(name)).items()}
        next_due = int(state.get("next_due", "0")) / 1000
        return {"name": name, "task": sched.task, "paths": list(sched.paths),
                "when": f"every {sched.every:g} s" if sched.every is not None
                else f"cron {sched.cron} ({sched.tz})",
                "next_due": iso_time(next_due), "paused": state.get("paused") == "1",
                "export": sched.export_dir, "sidecar": sched.sidecar,
                "pending_jobs": self.redis.hlen(self.keys.schedule_pending(name)),
                "runs": self.history(name)}

    def history(self, name: str) -> list[dict[str, Any]]:
        raw = self.redis.hgetall(self.keys.schedule_runs(name))
        runs = [json.loads(v) for v in raw.values()]
        return sorted(runs, key=lambda r: (r["due_ms"], r.get("fired_at", "")))

    def _record(self, name: str, run: dict[str, Any]) -> None:
        key = self.keys.schedule_runs(name)
        self.redis.hset(key, run["id"], json.dumps(run))
        fields = sorted(self.redis.hkeys(key), key=as_str)
        if len(fields) > HISTORY:
            self.redis.hdel(key, *fields[:len(fields) - HISTORY])

    # --- firing -----------------------------------------------------------------------

    def tick(self, now: float | None = None) -> list[dict[str, Any]]:
        """One scheduler pass: finish what completed, fire what is due. The runs fired."""
        fired = []
        for name in self.names():
            try:
                self.finish_pending(name)
                run = self._fire_if_due(name, time.time() if now is None else now)
            except RedisError:  # Redis's trouble is every schedule's: the scheduler loop waits
                raise
            except (VlmqError, OSError) as exc:  # one schedule's trouble stops no other
                log.warning("schedule %s: %s", name, exc)
                continue
            except Exception:
                # A bug met by one schedule (a decoder's RuntimeError) is
                # logged with its traceback; the scheduler, and every other schedule, go on.
                log.exception("schedule %s: unexpected error; the others go on", name)
                continue
            if run is not None:
                fired.append(run)
        return fired

    def _fire_if_due(self, name: str, now: float) -> dict[str, Any] | None:
        key = self.keys.schedule(name)
        state = self.redis.hmget(key, "next_due", "paused", "def")
        if state[0] is None or state[2] is None or (state[1] and as_str(state[1]) == "1"):
            return None
        due = int(state[0]) / 1000
        if now < due:
            return None
        sched = Schedule.from_json(state[2])
        slot = max(due, sched.latest_due(now))  # down for several slots: one run, the latest
        if not self._claim(keys=[key], args=[as_str(state[0]), _ms(sched.next_after(now))]):
            return None  # another scheduler took this due time
        log.info("schedule %s: firing due time %s%s", name, iso_time(slot),
                 " (catching up: one run for the missed ones)" if slot > due else "")
        return self.run(name, due=slot)

    def run(self, name: str, *, due: float | None = None) -> dict[str, Any]:
        """Run a schedule now (manual) or for a claimed due time; returns its run record."""
        manual = due is None
        when = time.time() if due is None else due
        lock = self.redis.lock(self.keys.schedule_lock(name), timeout=RUN_LOCK_S,
                               blocking_timeout=RUN_LOCK_S)
        if not lock.acquire():
            raise ScheduleError(f"schedule {name!r}: another run holds the lock")
        try:
            self.finish_pending(name)
            sched = self.get(name)
            run: dict[str, Any] = {"id": f"{_ms(when)}-{'m' if manual else 's'}",
                                   "due": iso_time(when), "due_ms": int(_ms(when)),
                                   "manual": manual, "fired_at": iso_time(time.time()),
                                   "by": self.who}
            try:
                run.update(self._enqueue_due(sched))
            except (VlmqError, RedisError, OSError) as exc:
                run.update(job_id=None, items=0, skipped=0, status="error",
                           error=f"{type(exc).__name__}: {exc}")
            self._record(name, run)
            return run
        finally:
            try:
                lock.release()
            except LockError:  # held past RUN_LOCK_S: another run may have started
                log.warning("schedule %s: the run outlived its lock (%d s)", name, RUN_LOCK_S)

    def _enqueue_due(self, sched: Schedule) -> dict[str, Any]:
        stores = self.client.stores
        found, missing = scan(sched, stores)
        settings = sched.settings_hash()
        done_key = self.keys.schedule_done(sched.name)
        in_flight = self._in_flight(sched.name)
        current: set[str] = set()
        candidates: list[_Candidate] = []
        bad: list[list[str]] = []
        left_out: dict[str, int] = {}  # files in its folders that are not media, by kind
        skipped = 0
        known = self._known_files(sched.name)
        seen: dict[FieldT, EncodableT] = {}  # this run's entries, for the next run
        read = 0
        for f in found:
            try:
                checked, entry = _checked(f, known.get(f.path), stores)
            except InputError as exc:
                other = not_media(f, exc)
                if other is not None:
                    left_out[other[1]] = left_out.get(other[1], 0) + 1
                else:
                    bad.append([f.source, exc.problem])
                continue
            except DECODE_ERRORS as exc:  # a decoder's own error the check let out: that
                # file is bad, the run goes on
                bad.append([f.source, f"cannot be checked: {type(exc).__name__}: {exc}"])
                continue
            read += entry != known.get(f.path)
            seen[f.path] = entry
            for page, unit in _units(settings, f, checked):
                current.add(unit)
                if unit in in_flight:
                    skipped += 1
                else:
                    candidates.append((f, checked, page, unit))
        todo = self._not_done(done_key, candidates)
        skipped += len(candidates) - len(todo)
        self._prune_done(done_key, current)
        self._save_readings(sched.name, seen)
        out: dict[str, Any] = {"skipped": skipped, "missing": missing, "bad": bad,
                               "not_media": left_out, "files": len(found), "read": read}
        if not todo:
            return {**out, "job_id": None, "items": 0, "status": "nothing new"}
        prepared = Prepared()
        for _, checked, page, _ in todo:
            prepared.add(checked, [page])
        return {**out, **self._submit(sched, prepared, [(c[3], c[0].root) for c in todo])}

    def _in_flight(self, name: str) -> set[str]:
        """Units in the schedule's jobs still running: not enqueued twice."""
        in_flight: set[str] = set()
        for raw in self.redis.hvals(self.keys.schedule_pending(name)):
            in_flight.update(json.loads(raw)["units"])
        return in_flight

    def _known_files(self, name: str) -> dict[str, str]:
        """The last run's reading of each file, by path (see _checked)."""
        return {as_str(k): as_str(v)
                for k, v in self.redis.hgetall(self.keys.schedule_files(name)).items()}

    def _save_readings(self, name: str, seen: dict[FieldT, EncodableT]) -> None:
        """This run's readings replace the last run's, so files gone drop out."""
        files_key = self.keys.schedule_files(name)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(files_key)
        if seen:
            pipe.hset(files_key, mapping=seen)
        pipe.execute()

    def _not_done(self, done_key: str, candidates: list[_Candidate]) -> list[_Candidate]:
        """The candidates no earlier run has done (one SMISMEMBER for them all)."""
        if not candidates:
            return []
        flags = self.redis.smismember(done_key, [c[3] for c in candidates])
        return [c for c, flag in zip(candidates, flags, strict=True) if not flag]

    def _submit(self, sched: Schedule, prepared: Prepared,
                units: list[tuple[str, str]]) -> dict[str, Any]:
        """Everything due goes now: a set over one job's size is one batch for this run.
        Each job's pending entry holds its items' (unit, root), in item order."""
        made = job_sets.submit_set(self.client, sched.task, prepared, sched.options())
        jobs = [made] if isinstance(made, Job) else made.jobs()
        at = 0
        for job in jobs:
            part = units[at:at + job.items]
            at += job.items
            self.redis.hset(self.keys.schedule_pending(sched.name), job.id, json.dumps(
                {"units": [u for u, _ in part], "roots": [r for _, r in part]}))
        several = {} if isinstance(made, Job) else {"batch": made.id,
                                                    "jobs": [j.id for j in jobs]}
        return {"job_id": made.id, **several, "items": len(prepared.items),
                "status": "enqueued"}

    def _prune_done(self, done_key: str, current: set[str]) -> None:
        stale = [m for m in (as_str(v) for v in self.redis.smembers(done_key))
                 if m not in current]
        if stale:
            self.redis.srem(done_key, *stale)

    # --- finishing --------------------------------------------------------------------

    def finish_pending(self, name: str) -> list[str]:
        """Jobs of this schedule that ended: mark their succeeded items done, write the
        exports, and complete their run records. Each job is finished by one caller only
        (whoever deletes its pending entry)."""
        pending_key = self.keys.schedule_pending(name)
        ended: list[str] = []
        for job_id_raw, raw in self.redis.hgetall(pending_key).items():
            job_id = as_str(job_id_raw)
            try:
                status = self.client.job(job_id).status()
            except JobNotFound:
                status = "gone"
            if status not in TERMINAL and status != "gone":
                continue
            if not self.redis.hdel(pending_key, job_id):
                continue  # another scheduler is finishing it
            self._finish(name, job_id, status, json.loads(raw))
            ended.append(job_id)
        return ended

    def _finish(self, name: str, job_id: str, status: str, pending: dict[str, Any]) -> None:
        units: list[str] = pending["units"]
        roots: list[str] = pending["roots"]
        results = [] if status == "gone" else list(self.client.job(job_id).results())
        ok = [r for r in results if r.ok and r.index < len(units)]
        if ok:
            self.redis.sadd(self.keys.schedule_done(name), *(units[r.index] for r in ok))
        update: dict[str, Any] = {"status": status, "ok": len(ok),
                                  "failed": len(units) - len(ok)}
        try:
            sched = self.get(name)
        except ScheduleError:
            return
        if sched.export_dir is not None or sched.sidecar:
            update.update(_export(sched, job_id, results, roots))
        self._update_run(name, job_id, update)

    def _update_run(self, name: str, job_id: str, update: dict[str, Any]) -> None:
        key = self.keys.schedule_runs(name)
        for field_name, raw in self.redis.hgetall(key).items():
            run = json.loads(raw)
            if job_id in run.get("jobs", ()):
                _add_job_end(run, job_id, update)
            elif run.get("job_id") == job_id:
                run.update(update)
            else:
                continue
            self.redis.hset(key, field_name, json.dumps(run))
            return


def _export(sched: Schedule, job_id: str, results: list[ItemResult], roots: list[str]
            ) -> dict[str, Any]:
    """Write a finished job's results where the schedule exports them; what its run record
    says of that. A write error (a full disk, a read-only folder) is said in the record,
    beside what was written before it."""
    update: dict[str, Any] = {}
    report = ExportReport()
    try:
        _write_exports(sched, results, roots, report)
    except OSError as exc:
        update["export_error"] = f"{type(exc).__name__}: {exc}"
        log.warning("schedule %s: export of job %s failed: %s", sched.name, job_id, exc)
    update.update(exported=len(report.written), refused=[s for s, _ in report.refused],
                  kept=[str(k) for k in report.kept])
    return update


def _write_exports(sched: Schedule, results: list[ItemResult], roots: list[str],
                   report: ExportReport) -> None:
    """Into --export's folder, or (--sidecar) beside the inputs: each item's under the root
    it was found in (`roots`, by item index). `report` gathers each tree as it is done."""
    if sched.export_dir is not None:
        report.merge(export_results(results, Path(sched.export_dir), sched.export_format))
        return
    for root in sorted(set(roots)):
        report.merge(export_results(
            [r for r in results if r.index < len(roots) and roots[r.index] == root],
            Path(root), "md"))


def _add_job_end(run: dict[str, Any], job_id: str, update: dict[str, Any]) -> None:
    """A run made of a batch: sum its jobs' ends; its status once the last has ended (the
    first other than finished, if any)."""
    ended = run.setdefault("ended", {})
    ended[job_id] = update["status"]
    for name in ("ok", "failed", "exported"):
        if name in update:
            run[name] = run.get(name, 0) + update[name]
    run["refused"] = run.get("refused", []) + update.get("refused", [])
    if "export_error" in update:
        run["export_error"] = update["export_error"]
    if len(ended) == len(run["jobs"]):
        run["status"] = next((s for s in ended.values() if s != "finished"), "finished")
