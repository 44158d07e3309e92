"""`vlmq api` and `vlmq worker` meet with no store flags: a real API process and a real
worker on the tiny model, both started without --files-dir or --store, complete a batch
of data-URI images that the official `openai` SDK submits. A worker that cannot reach
the API's images (another data folder: another machine) fails those lines, and each
line's error names the flag that fixes it.

Every default folder is under the test's tmp_path (HOME, VLMQ_DATA), never the real home.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import openai
import pytest
from openai.types import Batch

from tests.support import helpers
from tests.support import openai_api as T

TERMINAL = ("completed", "failed", "expired", "cancelled")


def _clean_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The processes started next find their default folders from `home` alone."""
    for name in ("VLMQ_DATA", "XDG_DATA_HOME", "VLMQ_STORES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))


def _serve(redis_url: str, procs: list[subprocess.Popen[str]]) -> openai.OpenAI:
    """An SDK client for a `vlmq api` with no --files-dir, once a worker is seen."""
    port = T.free_port()
    procs.append(T.start_api(redis_url, None, port))
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=T.KEYS[0],
                        max_retries=0)

    def ready() -> bool:
        try:
            return bool(list(api.models.list()))
        except openai.APIConnectionError:
            return False

    helpers.wait_for(ready, 240, "the API to list the worker's model")
    return api


def _run(api: openai.OpenAI, path: Path, timeout: float = 400) -> Batch:
    made = api.files.create(file=path, purpose="batch")
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch.id)
        if batch.status in TERMINAL:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch.id} did not end in {timeout} s")


def test_api_and_worker_with_no_store_flags_complete_a_batch(
        redis_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        procs: list[subprocess.Popen[str]]) -> None:
    home = tmp_path / "home"
    _clean_env(monkeypatch, home)
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path))  # no --store
    api = _serve(redis_url, procs)
    done = _run(api, T.batch_file(tmp_path / "in.jsonl", 4))
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
    assert done.error_file_id is None
    output = api.files.content(done.output_file_id or "").text
    lines = [json.loads(x) for x in output.splitlines()]
    assert [e["custom_id"] for e in lines] == [f"req-{i}" for i in range(4)]
    assert all(e["response"]["status_code"] == 200 for e in lines)
    # Both sides used the default folder under this HOME: the upload is kept there.
    files = home / ".local" / "share" / "vlmq" / "api"
    assert (files / "images").is_dir()
    assert any(p.is_file() for p in files.rglob("*"))


def test_a_worker_without_the_api_images_fails_each_line_naming_the_fix(
        redis_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        procs: list[subprocess.Popen[str]]) -> None:
    _clean_env(monkeypatch, tmp_path / "home")
    elsewhere = tmp_path / "other-machine"
    monkeypatch.setenv("VLMQ_DATA", str(elsewhere))  # the worker's: not the API's folder
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path))
    monkeypatch.setenv("VLMQ_DATA", str(tmp_path / "api-machine"))
    api = _serve(redis_url, procs)
    done = _run(api, T.batch_file(tmp_path / "in.jsonl", 3, schema_line=False))
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 3), done
    errors = [json.loads(x) for x in api.files.content(done.error_file_id or "").text
              .splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["req-0", "req-1", "req-2"]
    for entry in errors:
        message = entry["response"]["body"]["error"]["message"]
        assert "missing or unreadable in store vlmq-api" in message, message
        assert "--store vlmq-api=file:///FILES_DIR/images" in message, message
        assert "$VLMQ_DATA" in message, message
        assert str(elsewhere) not in message  # the worker's own folder stays its own
