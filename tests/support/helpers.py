"""Test inputs, a real worker subprocess and the in-process CLI, shared by the tests.

Plain functions; the fixtures that wrap them (procs, start_worker, run_cli) are in conftest.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw
from redis import Redis

if TYPE_CHECKING:
    from click.testing import Result

    from vlmq.producer.client import Client
    from vlmq.shared.keys import Keys
    from vlmq.shared.messages import ItemResult
    from vlmq.worker.jobs.rq_jobs import JobLifecycle

VLMQ = str(Path(sys.executable).parent / "vlmq")
Spawn = Callable[..., subprocess.Popen[str]]
COLORS = [(220, 40, 40), (40, 160, 60), (40, 70, 200), (230, 200, 40), (160, 60, 190),
          (30, 180, 190), (240, 130, 30), (90, 90, 90)]


def page_image(i: int, size: tuple[int, int] = (170, 220)) -> Image.Image:
    """A page that looks different from its neighbours even at a small render size."""
    img = Image.new("RGB", size, COLORS[i % len(COLORS)])
    draw = ImageDraw.Draw(img)
    w, h = size
    k = (i * 37) % 97
    box = [w // 8 + k % 30, h // 6, w // 2 + k % 40, h // 2 + k % 50]
    draw.rectangle(box, fill=(255, 255, 255))
    draw.ellipse([w // 3, h // 2 + (k % 20), w - 10, h - 10 - (k % 15)],
                 fill=COLORS[(i * 3 + 1) % len(COLORS)])
    draw.text((10, 10), f"page {i + 1}", fill=(0, 0, 0))
    return img


def make_pdf(path: Path, pages: int) -> Path:
    imgs = [page_image(i) for i in range(pages)]
    imgs[0].save(path, "PDF", save_all=True, append_images=imgs[1:], resolution=72.0)
    return path


def pdf_bytes(pages: int = 3) -> bytes:
    """A small real PDF, one numbered white page per page, made in memory."""
    images = []
    for i in range(pages):
        im = Image.new("L", (200, 260), 255)
        ImageDraw.Draw(im).text((20, 20), f"page {i + 1}", fill=0)
        images.append(im)
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:])
    return buf.getvalue()


def make_images(folder: Path, n: int, sizes: list[tuple[int, int]] | None = None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    sizes = sizes or [(96, 96), (128, 80), (80, 120), (112, 112)]
    out = []
    for i in range(n):
        p = folder / f"img{i}.png"
        page_image(i + 3, sizes[i % len(sizes)]).save(p)
        out.append(p)
    return out


def start_worker(redis_url: str, model: Path | str, tmp: Path, *args: str,
                 name: str = "w1", cwd: str | None = None,
                 log: Path | None = None) -> subprocess.Popen[str]:
    """`vlmq worker` on `model` (a folder, or a name such as "reader"), run in `cwd`. Its
    output is a pipe the test reads at the end, or with `log` that file: a worker that
    logs more than a pipe holds (64 KiB) before the test reads would block on a write."""
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp / "cache"),
           "PYTHONUNBUFFERED": "1"}
    cmd = [VLMQ, "worker", "--model", str(model), "--name", name,
           "--cache-dir", str(tmp / "vision-cache"), *args]
    if log is None:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                cwd=cwd)
    with log.open("a") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, cwd=cwd)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    """Teardown: no worker outlives its test, whatever the test did."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)  # a test may have left it stopped (SIGSTOP)
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate()
        proc.wait()


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"worker did not exit in {timeout} s; output:\n{out}") from None
    return proc.returncode, out


def finished_results(client: Client, job_id: str, timeout: float = 180) -> list[ItemResult]:
    """A job's item results once it finished (its error fails the test), in item order."""
    job = client.job(job_id)
    assert job.wait(timeout=timeout) == "finished", job.error()
    return sorted(job.results(), key=lambda r: r.index)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextmanager
def worker_lifecycle(redis: Redis, queues: list[str]) -> Iterator[JobLifecycle]:
    """The real vlmq worker's job lifecycle (no model): take, succeed and fail jobs exactly
    as a worker does, so producer tests read what a worker really leaves in Redis."""
    from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle

    worker = BatchWorker(queues, connection=redis, name=f"test-{uuid.uuid4().hex[:8]}")
    life = JobLifecycle(worker)
    life.register_birth()
    try:
        yield life
    finally:
        life.register_death()


def lifecycle_with_ttl(redis: Redis, keys: Keys, ttl: int, queues: Sequence[str] = ("q",)
                       ) -> JobLifecycle:
    """A worker's job lifecycle with its own heartbeat TTL and no stop: a worker that dies
    (its executions expire after `ttl`) and one that rescues its jobs."""
    from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle

    worker = BatchWorker(list(queues), connection=redis,
                         name=f"w-{uuid.uuid4().hex[:8]}", heartbeat_ttl=ttl)
    life = JobLifecycle(worker, keys=keys)
    life.register_birth()
    return life


class Clock:
    """Fake time for rules that take a clock: the test moves `t` by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tripwire:
    """Put one in a pickled job: unpickling it creates `path`, proof that someone did.

    It unpickles to a call of Path.touch, a stdlib function that any process can import:
    a worker subprocess cannot import this module, and a trap it failed to load would
    prove nothing.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return Path.touch, (self.path,)


def invoke_cli(redis_url: str, *args: str) -> Result:
    """`vlmq --redis-url URL ARGS...` in process. catch_exceptions=False: a traceback fails
    the test rather than turning into an exit code."""
    from click.testing import CliRunner

    from vlmq.cli.main import main

    return CliRunner().invoke(main, ["--redis-url", redis_url, *args], catch_exceptions=False)


def raw_enqueue(redis: Redis, payload: Any, *, queue: str) -> str:
    """What a producer that skips enqueue.lua writes: the job hash, pushed, no checks.

    Lets worker tests hand it payloads the script would refuse, as a careless client in
    another language could.
    """
    import json

    from vlmq.shared import constants as C
    from vlmq.shared.messages import utc_now_iso

    job_id = uuid.uuid4().hex
    now = utc_now_iso()
    redis.hset(f"rq:job:{job_id}", mapping={
        "data": json.dumps([C.TASK_FUNC, None, [payload], {}]), "origin": queue,
        "description": "raw", "timeout": C.JOB_TIMEOUT_S, "result_ttl": C.RESULT_TTL_S,
        "failure_ttl": C.FAILURE_TTL_S, "created_at": now, "enqueued_at": now,
        "status": "queued", "meta": "{}", "retries_left": C.CRASH_RETRIES})
    redis.sadd("rq:queues", f"rq:queue:{queue}")
    redis.rpush(f"rq:queue:{queue}", job_id)
    return job_id


class Output:
    """A subprocess's output (stdout, stderr merged into it), read line by line as it comes
    by a thread of its own: a test waits for a line the process prints, the sign that it
    has reached a point, instead of sleeping for a time it might need."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None, "start the process with stdout=PIPE"
        self.proc = proc
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, needle: str, timeout: float = 300) -> str:
        """The first line holding `needle`, once printed; AssertionError (with the output)
        when the process ends without it or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self._lines if needle in line), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    why = "the process ended" if self._ended else f"{timeout} s passed"
                    raise AssertionError(f"{why} before it printed {needle!r}; output:\n"
                                         + "".join(self._lines))
                self._changed.wait(left)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """As finish(): the exit code and all the output, the process killed (and the test
        failed) when it has not exited within `timeout` s."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._thread.join(timeout=30)
            raise AssertionError(f"process did not exit in {timeout} s; output:\n"
                                 + self.text()) from None
        self._thread.join(timeout=60)
        return self.proc.returncode, self.text()


class PersistentRedis:
    """A private Redis that keeps its data across a restart (append-only file, fsync
    always), for tests that stop and start it under a client or a worker."""

    def __init__(self, binary: str, folder: Path) -> None:
        from vlmq.worker.redis_server import free_port

        self.cmd = [binary, "--port", str(free_port()), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "yes", "--appendfsync", "always", "--dir", str(folder)]
        self.url = f"redis://127.0.0.1:{self.cmd[2]}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from vlmq.worker.redis_server import answers

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_for(lambda: answers(self.url, timeout=1.0), 120, "redis to start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
            self.proc.wait(timeout=120)


def following_events(redis: Redis) -> bool:
    """Whether a client of `redis`'s db has last run XREAD: a `wait` blocked on a job's
    event stream, inside its loop. Other dbs' clients (other test runs) are not counted."""
    db = redis.connection_pool.connection_kwargs.get("db", 0)
    return any(c.get("cmd") == "xread" and int(c.get("db", -1)) == db
               for c in redis.client_list())


def abandoned(redis: Redis, queue: str, *job_ids: str) -> bool:
    """Whether every one of `job_ids` has an execution in `queue`'s started registry that
    has expired (no heartbeat within its TTL): what RQ's cleanup takes for a dead worker's."""
    from rq import Queue
    from rq.registry import StartedJobRegistry
    from rq.utils import current_timestamp

    registry = StartedJobRegistry(queue=Queue(queue, connection=redis))
    expired = set(registry.get_expired_job_ids(current_timestamp()))
    return set(job_ids) <= expired
