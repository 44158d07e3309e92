"""`vlmq ask` without a worker: each way it cannot ask exits with its code, at once, with
Redis untouched where the input was bad (the answers themselves: tests/e2e/test_chat_e2e.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from click.testing import Result
from redis import Redis

from tests.support.helpers import invoke_cli, make_images
from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNREACHABLE
from vlmq.shared.keys import Keys


def test_no_live_worker_exits_1_at_once(run_cli: Callable[..., Result], redis: Redis,
                                        tmp_path: Path) -> None:
    image = make_images(tmp_path, 1)[0]
    t0 = time.monotonic()
    res = run_cli("ask", str(image), "What is it?", code=EXIT_FAILED)
    assert time.monotonic() - t0 < 2
    assert "no live worker serves queue 'chat'" in res.stderr
    assert not redis.exists(Keys.rq_queue("chat"))
    res = run_cli("ask", str(image), "What is it?", "--json", code=EXIT_FAILED)
    assert json.loads(res.stderr)["error"]["kind"] == "failed"


def test_a_bad_image_exits_2_with_nothing_enqueued(run_cli: Callable[..., Result],
                                                   redis: Redis, tmp_path: Path) -> None:
    res = run_cli("ask", str(tmp_path / "missing.png"), "What?", code=EXIT_BAD_INPUT)
    assert "no such file" in res.stderr and "nothing was enqueued" in res.stderr
    (tmp_path / "notes.txt").write_text("not an image")
    redis.sadd(Keys.rq_queue_workers("chat"), Keys.rq_worker("fake"))
    res = run_cli("ask", str(tmp_path / "notes.txt"), "What?", code=EXIT_BAD_INPUT)
    assert "nothing was enqueued" in res.stderr
    assert not redis.exists(Keys.rq_queue("chat"))


def test_redis_unreachable_exits_69(tmp_path: Path) -> None:
    image = make_images(tmp_path, 1)[0]
    res = invoke_cli("redis://127.0.0.1:1/0", "ask", str(image), "What?")
    assert res.exit_code == EXIT_UNREACHABLE, (res.stdout, res.stderr)


def test_an_image_from_stdin_and_a_timeout(redis_url: str, redis: Redis,
                                           tmp_path: Path) -> None:
    from click.testing import CliRunner

    from vlmq.cli.main import main
    from vlmq.producer.client import Client

    def ask(data: bytes, *args: str) -> Result:
        return CliRunner().invoke(main, ["--redis-url", redis_url, "ask", "-", "What?", *args],
                                  input=data, catch_exceptions=False)

    res = ask(b"")
    assert res.exit_code == EXIT_BAD_INPUT and "stdin is empty" in res.stderr
    redis.sadd(Keys.rq_queue_workers("chat"), Keys.rq_worker("fake"))  # it never answers
    redis.hset(Keys().worker_stats("fake"), "model", "fake")
    res = ask(make_images(tmp_path, 1)[0].read_bytes(), "--timeout", "0.5")
    assert res.exit_code == EXIT_TIMEOUT, (res.stdout, res.stderr)
    assert "no complete answer within 0.5s; the request was cancelled" in res.stderr
    with Client(redis_url) as client:
        [row] = client.jobs(queue="chat")
        job = client.job(row.id)
        assert job.status() == "canceled"
        assert [i.kind for i in job.payload().items] == ["image"]
