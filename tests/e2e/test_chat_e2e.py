"""Client.chat and `vlmq ask` through a real worker on the tiny model: the answer streams,
the stream's text is the job's result, a client that leaves cancels its request and the
worker goes on, and a worker that stops mid-answer ends the stream with an error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from tests.support.helpers import VLMQ, Spawn, make_images, wait_for
from vlmq.producer import chat
from vlmq.producer.client import Client
from vlmq.shared.chat import CHAT_QUEUE

pytestmark = pytest.mark.slow


def _serving(redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn,
             *args: str) -> Client:
    start_worker(redis_url, tiny_model, tmp_path, "--queues", CHAT_QUEUE, *args)
    client = Client(redis_url)
    wait_for(lambda: client.serving(CHAT_QUEUE) > 0, 60, "the worker to serve chat")
    return client


def test_client_chat_streams_the_answer_the_job_keeps(redis_url: str, tiny_model: Path,
                                                       tmp_path: Path,
                                                       start_worker: Spawn) -> None:
    client = _serving(redis_url, tiny_model, tmp_path, start_worker)
    image = make_images(tmp_path / "in", 1)[0]
    stream = client.chat("Describe the picture.", image=image, max_tokens=12, timeout=180)
    deltas = list(stream)
    assert "".join(deltas) == stream.text
    assert stream.finish_reason in ("stop", "length")
    assert stream.usage is not None and stream.usage.prompt_tokens > 0
    assert 1 <= stream.usage.completion_tokens <= 12
    assert stream.job.wait(timeout=60) == "finished"
    [result] = list(stream.job.results())
    assert result.text == stream.text
    # A text-only question (a text item), answered by the same worker.
    again = client.chat("Say something.", max_tokens=4, timeout=180)
    assert again.result() == again.text and again.finish_reason in ("stop", "length")
    client.close()


def test_a_second_question_about_an_image_skips_its_tower_and_its_prefill(
        redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    """The vision cache answers the image's features, and a conversation puts the image
    first in its turn, so its prefix (template and image) is prefilled once too (qwen2_vl
    keeps prefixes only when --prefix-cache-mb is given)."""
    client = _serving(redis_url, tiny_model, tmp_path, start_worker, "--prefix-cache-mb", "64")
    image = make_images(tmp_path / "in", 1)[0]
    first = client.chat("Describe the picture.", image=image, max_tokens=4, timeout=180)
    first.result()
    second = client.chat("What colour is it?", image=image, max_tokens=4, timeout=180)
    second.result()
    [one] = list(first.job.results())
    [two] = list(second.job.results())
    assert not one.vision_cache_hit and one.prefix_tokens == 0
    assert two.vision_cache_hit, "the second question ran the tower again"
    assert two.prefix_tokens > 0, "the second question prefilled the image again"
    assert not two.result_cache_hit
    client.close()


def test_a_client_that_leaves_cancels_and_the_worker_goes_on(redis_url: str,
                                                             tiny_model: Path,
                                                             tmp_path: Path,
                                                             start_worker: Spawn) -> None:
    client = _serving(redis_url, tiny_model, tmp_path, start_worker)
    stream = client.chat("Write a long story.", max_tokens=2000, temperature=1.0,
                         timeout=180)  # sampled: random weights rarely sample EOS
    with stream:
        for _delta in stream:
            break
    wait_for(lambda: stream.job.status() == "canceled", 10, "the request to be cancelled")
    after = client.chat("Say something.", max_tokens=4, timeout=180)
    assert after.result() == after.text and after.finish_reason in ("stop", "length")
    client.close()


def test_a_worker_stopped_mid_answer_ends_the_stream_with_an_error(
        redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn,
        procs: list[subprocess.Popen[str]]) -> None:
    client = _serving(redis_url, tiny_model, tmp_path, start_worker, "--heartbeat-ttl", "3")
    worker = procs[-1]
    stream = client.chat("Write a long story.", max_tokens=2000, temperature=1.0,
                         timeout=180)  # sampled: random weights rarely sample EOS
    deltas = iter(stream)
    next(deltas)
    os.killpg(worker.pid, signal.SIGSTOP)  # heartbeats stop; teardown sends SIGCONT
    t0 = time.monotonic()
    with pytest.raises(chat.ChatError, match="mid-answer"):
        for _delta in deltas:
            pass
    assert time.monotonic() - t0 < 15  # its heartbeat TTL, one look, and slack
    client.close()


def test_vlmq_ask_prints_the_answer_and_its_json(redis_url: str, tiny_model: Path,
                                                 tmp_path: Path, start_worker: Spawn,
                                                 run_cli: Callable[..., Result]) -> None:
    client = _serving(redis_url, tiny_model, tmp_path, start_worker)
    image = make_images(tmp_path / "in", 1)[0]
    res = run_cli("ask", str(image), "What is in the picture?", "--max-tokens", "8",
                  "--system", "Be brief.", code=0)
    assert res.stdout.endswith("\n") or res.stdout == ""
    res = run_cli("ask", str(image), "What is in the picture?", "--max-tokens", "8",
                  "--temperature", "0", "--json", code=0)
    out = json.loads(res.stdout)
    assert set(out) == {"id", "text", "finish_reason", "usage"}
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["total_tokens"] == (out["usage"]["prompt_tokens"]
                                            + out["usage"]["completion_tokens"])
    [result] = list(client.job(out["id"]).results())
    assert result.text == out["text"]
    client.close()


def test_ctrl_c_cancels_a_vlmq_ask(redis_url: str, tiny_model: Path, tmp_path: Path,
                                   start_worker: Spawn,
                                   procs: list[subprocess.Popen[str]]) -> None:
    client = _serving(redis_url, tiny_model, tmp_path, start_worker)
    worker = procs[-1]
    image = make_images(tmp_path / "in", 1)[0]
    ask = subprocess.Popen([VLMQ, "ask", str(image), "Write a long story.", "--max-tokens",
                            "2000", "--temperature", "1"],
                           env={**os.environ, "REDIS_URL": redis_url},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(ask)
    assert ask.stdout is not None and ask.stdout.read(1)  # the answer has begun
    # Held mid-answer (the tiny model may end its answer within a blink otherwise); the
    # cancel is Redis's, and the worker's dropping of the row is tested with the worker.
    os.killpg(worker.pid, signal.SIGSTOP)
    ask.send_signal(signal.SIGINT)
    _out, err = ask.communicate(timeout=30)
    assert ask.returncode == 1, err
    job_id = re.search(r"cancelled \(job (\S+)\)", err)
    assert job_id is not None, err
    job = client.job(job_id[1])
    wait_for(lambda: job.status() == "canceled", 10, f"the cancel ({job.status()}, "
             f"{[r.completion_tokens for r in job.results()]})")
    client.close()
