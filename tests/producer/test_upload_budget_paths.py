"""One upload budget for every producer path, and a budget wait that ends.

- `--manifest`, `--openai-batch` and a plain folder, with `--max-pending-mb 1` and ten
images of about 0.9 MB each, keep every job's uploads and the pending total within the
budget (measured in Redis: the blob keys' STRLEN, under a private prefix). A thread in the
test stands in for the workers: it measures each queued job's inputs and cancels it, which
ends it (its inputs released, the producer told on the done channel).

- with no worker on the queue and the budget full, `--wait-timeout 2` exits 124 and
names the queue and the budget; the Client's default gives up too when no worker serves.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from PIL import Image
from redis import Redis
from redis.exceptions import RedisError

from tests.support.helpers import VLMQ
from vlmq.producer import job_admin, upload
from vlmq.producer.client import Client
from vlmq.producer.inputs import prepare
from vlmq.producer.options import JobOptions
from vlmq.producer.upload import MB
from vlmq.shared.blobs import UPLOAD_TTL_S
from vlmq.shared.errors import VlmqError
from vlmq.shared.keys import PREFIX_ENV, SHA256_RE, Keys
from vlmq.shared.redis_text import as_str

QUEUE = "trust-budget"
IMAGES = 10
SIDE = 548  # 548 x 548 x 3 bytes of noise, stored: a PNG of about 0.86 MB
BUDGET_MB = 1
URL = "/v1/chat/completions"


def _images(folder: Path, n: int = IMAGES) -> list[Path]:
    """`n` distinct incompressible PNGs, each under the budget."""
    folder.mkdir(parents=True)
    rng = random.Random(29)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.frombytes("RGB", (SIDE, SIDE), rng.randbytes(SIDE * SIDE * 3)).save(
            buf, "PNG", compress_level=0)
        path = folder / f"img{i:02d}.png"
        path.write_bytes(buf.getvalue())
        out.append(path)
    assert all(0.8 * MB < p.stat().st_size < BUDGET_MB * MB for p in out)
    return out


@pytest.fixture
def prefix(monkeypatch: pytest.MonkeyPatch) -> Keys:
    """A private key prefix for this test's blobs."""
    name = "vt" + uuid.uuid4().hex[:8]
    monkeypatch.setenv(PREFIX_ENV, name)
    return Keys(name)


class _Drain:
    """Stands in for workers on QUEUE: each queued job's inputs are measured (STRLEN of its
    blobs) and the job canceled. Meanwhile the bytes of blobs held (uploaded, or held by a
    job not ended: a TTL past the --keep-inputs grace) are sampled."""

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.client = Client(redis_url, prefix=keys.prefix)
        self.redis: Redis = self.client.redis
        self.keys = keys
        self.job_bytes: list[int] = []
        self.held_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> _Drain:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._sample()
                for raw in self.redis.lrange(f"rq:queue:{QUEUE}", 0, -1):
                    self._end(as_str(raw))
                time.sleep(0.02)
        except (RedisError, VlmqError, OSError, ValueError) as exc:  # the test reads it
            self.error = exc

    def _sample(self) -> None:
        """Bytes of the blobs the budget bounds: held by a job not ended (a hold scored
        +inf in its blob-jobs zset), or uploaded and held by no job yet (no holds, and the
        upload TTL; a released blob lives --keep-inputs, 3600 s, instead)."""
        shas = [as_str(k).rsplit(":", 1)[-1]
                for k in self.redis.scan_iter(match=self.keys.blob("*"), count=1000)]
        shas = [s for s in shas if SHA256_RE.fullmatch(s)]
        pipe = self.redis.pipeline(transaction=False)
        for sha in shas:
            pipe.strlen(self.keys.blob(sha))
            pipe.zcard(self.keys.blob_jobs(sha))
            pipe.zcount(self.keys.blob_jobs(sha), "+inf", "+inf")
            pipe.pttl(self.keys.blob(sha))
        replies = pipe.execute()
        held = sum(int(size) for size, holds, live, ttl in zip(
            replies[0::4], replies[1::4], replies[2::4], replies[3::4], strict=True)
            if int(live) > 0 or (int(holds) == 0 and 0 < int(ttl) <= UPLOAD_TTL_S * 1000))
        self.held_max = max(self.held_max, held)

    def _end(self, job_id: str) -> None:
        shas = {i.blob for i in self.client.job(job_id).payload().items if i.blob}
        pipe = self.redis.pipeline(transaction=False)
        for sha in shas:
            pipe.strlen(self.keys.blob(sha))
        self.job_bytes.append(sum(int(n) for n in pipe.execute()))
        try:
            job_admin.cancel(self.redis, self.keys, job_id)
        except job_admin.CannotCancel:
            return  # ended already


def _enqueue_through(redis_url: str, keys: Keys, run_cli: Callable[..., Result],
                     *args: str) -> _Drain:
    with _Drain(redis_url, keys) as drain:
        res = run_cli("enqueue", *args, "--max-pending-mb", str(BUDGET_MB), "--json")
        assert res.exit_code == 0, (res.stdout, res.stderr)
        deadline = time.monotonic() + 120
        while len(drain.job_bytes) < IMAGES and time.monotonic() < deadline \
                and drain.error is None:
            time.sleep(0.05)
    assert drain.error is None, drain.error
    return drain


def _check(drain: _Drain, images: list[Path]) -> None:
    assert len(drain.job_bytes) == IMAGES, drain.job_bytes  # every image its own job
    budget = BUDGET_MB * MB
    assert max(drain.job_bytes) <= budget, drain.job_bytes
    assert drain.held_max <= budget, (drain.held_max, budget)
    assert drain.held_max >= min(p.stat().st_size for p in images)  # it did upload


def _manifest(tmp_path: Path, images: list[Path]) -> list[str]:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "task": "caption",
                                        "file": f"imgs/{p.name}"}) + "\n"
                            for i, p in enumerate(images)), encoding="utf-8")
    return ["--manifest", str(path)]


def _openai_batch(tmp_path: Path, images: list[Path]) -> list[str]:
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": URL, "body": {"messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Describe the image."},
                {"type": "image_url", "image_url": {"url": f"file://{p}"}}]}]}}) + "\n"
        for i, p in enumerate(images)), encoding="utf-8")
    return ["--openai-batch", str(path)]


def _folder(tmp_path: Path, _images: list[Path]) -> list[str]:
    return ["caption", str(tmp_path / "imgs")]


@pytest.mark.parametrize("request_args", [_manifest, _openai_batch, _folder],
                         ids=["manifest", "openai-batch", "folder"])
def test_row2_each_job_and_the_pending_total_stay_in_the_budget(
        redis_url: str, tmp_path: Path, prefix: Keys, run_cli: Callable[..., Result],
        request_args: Callable[[Path, list[Path]], list[str]]) -> None:
    images = _images(tmp_path / "imgs")
    drain = _enqueue_through(redis_url, prefix, run_cli, *request_args(tmp_path, images),
                             "--queue", QUEUE)
    _check(drain, images)


def test_row2_a_client_job_over_the_budget_is_refused_naming_it(
        redis_url: str, tmp_path: Path, prefix: Keys) -> None:
    """Client.ocr makes one job: several files past the budget cannot be one job under it,
    so it is refused before anything is uploaded; submit_set cuts the same set."""
    _images(tmp_path / "imgs", 3)
    with Client(redis_url, prefix=prefix.prefix, max_pending_mb=BUDGET_MB) as client:
        with pytest.raises(upload.OverBudget, match="--max-pending-mb 1"):
            client.caption([str(tmp_path / "imgs")], queue=QUEUE)
        assert not list(client.redis.scan_iter(match=prefix.blob("*")))
    prepared = prepare([str(tmp_path / "imgs")])
    assert len(prepared.blobs) == 3


def _full_budget(tmp_path: Path) -> Path:
    """Three images under a budget that holds one: the second must wait."""
    _images(tmp_path / "imgs", 3)
    return tmp_path / "imgs"


def test_row15_no_worker_and_a_full_budget_time_out_with_124_naming_the_queue(
        redis_url: str, tmp_path: Path, prefix: Keys) -> None:
    folder = _full_budget(tmp_path)
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.run([VLMQ, "enqueue", "caption", str(folder), "--queue", QUEUE,
                           "--max-pending-mb", str(BUDGET_MB), "--wait-timeout", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 124, (proc.stdout, proc.stderr)
    assert QUEUE in proc.stderr and "no live worker" in proc.stderr, proc.stderr
    assert "--max-pending-mb 1" in proc.stderr, proc.stderr


def test_row15_the_client_gives_up_by_default_when_no_worker_serves(
        redis_url: str, tmp_path: Path, prefix: Keys,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (no wait_timeout) waits as long as a worker serves the queue; with none
    it gives up after UNSERVED_WAIT_S (shortened here)."""
    monkeypatch.setattr(upload, "UNSERVED_WAIT_S", 1.0)
    folder = _full_budget(tmp_path)
    with Client(redis_url, prefix=prefix.prefix, max_pending_mb=BUDGET_MB) as client, \
            pytest.raises(upload.BudgetWaitTimeout, match=QUEUE) as caught:
        client.submit_set("caption", [str(folder)], JobOptions.build(queue=QUEUE))
    assert caught.value.queues == (QUEUE,)
