"""`vlmq api` end to end: the official `openai` SDKs (Python and Node.js) against a real
`vlmq api` process and a real worker on the tiny model, one of each for the module.
Upload a batch file (data-URI images, one json_schema line), create, poll to completed,
download the output and error files and parse every line with the SDK's types; cancel a
running batch; a bad file fails with line-numbered errors; another key gets 404; and
the Redis cost of a batch with images against the file's size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletion
from redis import Redis

from tests.support import helpers
from tests.support import openai_api as T
from vlmq.stores.api_store import store_spec

CLIENTS = Path(__file__).resolve().parents[1] / "support" / "clients"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API's base URL, with a worker reading the API's images as its store."""
    tmp = tmp_path_factory.mktemp("api")
    files = tmp / "files"
    port = T.free_port()
    procs = [helpers.start_worker(module_redis_url, tiny_model, tmp, "--max-batch", "8",
                                  "--store", store_spec(files)),
             T.start_api(module_redis_url, files, port)]
    base = f"http://127.0.0.1:{port}/v1"
    try:
        api = sdk(base)
        helpers.wait_for(lambda: _models(api), 240, "the API to list the worker's model")
        yield base
    finally:
        helpers.stop_all(procs)


def _models(api: openai.OpenAI) -> bool:
    try:
        return bool(list(api.models.list()))
    except openai.APIConnectionError:
        return False


def sdk(base: str, key: str = T.KEYS[0]) -> openai.OpenAI:
    """The three-line change: base_url and api_key."""
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def settle(api: openai.OpenAI, batch_id: str, timeout: float = 400) -> Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        Batch.model_validate(batch.model_dump())
        if batch.status in TERMINAL:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not end in {timeout} s")


def check_lines(output: str, errors: str, n: int) -> list[dict[str, Any]]:
    """Every line parsed with the SDK's types; every input line once, in input order."""
    lines = [json.loads(x) for x in output.splitlines()]
    for entry in lines:
        assert entry["response"]["status_code"] == 200 and entry["error"] is None
        ChatCompletion.model_validate(entry["response"]["body"], strict=True)
    bad = [json.loads(x) for x in errors.splitlines()]
    assert sorted(int(e["custom_id"][4:]) for e in lines + bad) == list(range(n))
    assert [e["custom_id"] for e in lines] == sorted((e["custom_id"] for e in lines),
                                                     key=lambda c: int(c[4:]))
    return lines


def test_python_sdk_batch_to_completed(served: str, tmp_path: Path,
                                       module_redis_url: str) -> None:
    api = sdk(served)
    path = T.batch_file(tmp_path / "in.jsonl", 6)
    made = FileObject.model_validate(api.files.create(file=path, purpose="batch").model_dump())
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"job": "e2e"})
    done = settle(api, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None and done.request_counts.total == 6
    assert done.request_counts.completed + done.request_counts.failed == 6
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    assert done.output_file_id is not None
    out = api.files.retrieve(done.output_file_id)
    FileObject.model_validate(out.model_dump())
    output = api.files.content(done.output_file_id).text
    assert out.bytes == len(output.encode())
    errors = api.files.content(done.error_file_id).text if done.error_file_id else ""
    lines = check_lines(output, errors, 6)
    schema_line = next(e for e in lines if e["custom_id"] == "req-1")
    json.loads(schema_line["response"]["body"]["choices"][0]["message"]["content"])
    with pytest.raises(openai.NotFoundError):
        sdk(served, T.KEYS[1]).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk(served, T.KEYS[1]).files.content(done.output_file_id)
    # The same batch is a vlmq batch: `vlmq status` shows it.
    redis = Redis.from_url(module_redis_url)
    vlmq_batch = redis.hget(f"vlmq:api:batch:{batch.id}", "vlmq_batch")
    redis.close()
    assert vlmq_batch is not None
    shown = helpers.invoke_cli(module_redis_url, "status", vlmq_batch.decode(), "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["items"]["total"] == 6


def test_cancel_a_running_batch(served: str, tmp_path: Path) -> None:
    api = sdk(served)
    path = tmp_path / "long.jsonl"
    uri = T.data_uri(5)
    path.write_text("".join(T.line(f"req-{i}", uri, max_tokens=48) for i in range(160)))
    made = api.files.create(file=path, purpose="batch")
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    helpers.wait_for(lambda: (api.batches.retrieve(batch.id).request_counts or
                              openai.types.BatchRequestCounts(completed=0, failed=0,
                                                              total=0)).completed > 0,
                     300, "the first line to finish")
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    ended = settle(api, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    counts = ended.request_counts
    assert counts is not None and counts.total == 160
    assert 0 < counts.completed < 160 and counts.completed + counts.failed == 160
    output = api.files.content(ended.output_file_id or "").text
    errors = api.files.content(ended.error_file_id or "").text
    check_lines(output, errors, 160)
    assert {json.loads(e)["error"]["code"] for e in errors.splitlines()} <= {
        "batch_cancelled", "item_failed", None}


def node_modules() -> Path:
    """tests/support/clients/package.json's npm packages (the `openai` SDK among them),
    where `.ci/dev.py test` installs them, else installed here into that cache."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm are not installed: `python3 .ci/dev.py test` installs them")
    if os.environ.get("VLMQ_NODE_MODULES") and \
            (Path(os.environ["VLMQ_NODE_MODULES"]) / "openai").is_dir():
        return Path(os.environ["VLMQ_NODE_MODULES"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = base / "vlmq" / "npm"
    cache.mkdir(parents=True, exist_ok=True)
    wanted = (CLIENTS / "package.json").read_text()
    if not ((cache / "package.json").exists() and (cache / "package.json").read_text() == wanted
            and (cache / "node_modules" / "openai").is_dir()):
        (cache / "package.json").write_text(wanted)
        done = subprocess.run([str(shutil.which("npm")), "install", "--prefix", str(cache),
                               "--no-audit", "--no-fund"], capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, f"npm install failed:\n{done.stdout}\n{done.stderr}"
    return cache / "node_modules"


def test_node_sdk(served: str, tmp_path: Path) -> None:
    modules = node_modules()
    good = T.batch_file(tmp_path / "in.jsonl", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(T.line("a", T.data_uri(0)) + '{"custom_id": "b"}\n')
    done = subprocess.run(["node", str(CLIENTS / "batch.cjs"), str(good), str(bad)],
                          env={**os.environ, "NODE_PATH": str(modules),
                               "OPENAI_BASE_URL": served, "KEY": T.KEYS[0],
                               "OTHER_KEY": T.KEYS[1]},
                          capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, f"node exited {done.returncode}:\n{done.stderr}"
    out = json.loads(done.stdout)
    FileObject.model_validate(out["file"])
    batch = Batch.model_validate(out["batch"])
    assert batch.status == "completed" and batch.metadata == {"from": "node"}
    check_lines(out["output"], out["errors"], 4)
    failed = Batch.model_validate(out["failed"])
    assert failed.status == "failed" and failed.errors and failed.errors.data
    assert [e.line for e in failed.errors.data] == [2]
    assert out["otherStatus"] == 404
    assert out["listed"] and out["models"]
