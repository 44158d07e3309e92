"""An API batch's validation always ends, in `failed` with OpenAI's `errors` (numbered
lines, BatchError's fields) or `in_progress`, never staying `validating`: lines with numbers
too long to convert, a file past OpenAI's 50,000 requests, a failure no check foresaw,
and a cancel that arrives while the file is read. The official `openai` SDK over the app
(httpx's WSGI transport), real Redis."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import openai
import pytest
from flask import Flask
from openai.types import Batch, BatchError

from tests.producer.test_bounded_lines import HOSTILE, request
from tests.support import openai_api as T
from vlmq.producer.client import Client
from vlmq.producer.openai_files import MAX_REQUESTS
from vlmq.server.openai_api.batches import Batches
from vlmq.server.openai_api.files import FileStore
from vlmq.stores.backends import Stores


@pytest.fixture
def app(redis_url: str, tmp_path: Path) -> Iterator[Flask]:
    with T.in_process_app(redis_url, tmp_path / "files") as made:
        yield made



def settled(api: openai.OpenAI, batch_id: str, seconds: float = 120) -> Batch:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status != "validating":
            return Batch.model_validate(batch.model_dump())
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} stayed validating")


def submit(api: openai.OpenAI, path: Path) -> Batch:
    made = api.files.create(file=path, purpose="batch")
    return settled(api, api.batches.create(input_file_id=made.id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h").id)


def errors_of(batch: Batch) -> list[BatchError]:
    assert batch.status == "failed" and batch.failed_at is not None, batch
    assert batch.errors is not None and batch.errors.object == "list"
    return [BatchError.model_validate(e.model_dump(), strict=True)
            for e in batch.errors.data or []]


def test_hostile_lines_fail_the_batch_with_numbered_errors(app: Flask, tmp_path: Path) -> None:
    api = T.sdk(app)
    lines = [request("ok"), *(text for text, _, _ in HOSTILE)]
    path = tmp_path / "hostile.jsonl"
    path.write_text("".join(x + "\n" for x in lines))
    batch = submit(api, path)
    errors = errors_of(batch)
    assert [(e.line, e.param, e.code) for e in errors] == [
        (n, field, "invalid_request") for n, (_, field, _) in enumerate(HOSTILE, start=2)]
    assert "401 characters" in (errors[0].message or "")
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(batch.id)
    # A file with no good line at all names each line too, not the file.
    path.write_text(HOSTILE[1][0] + "\n")
    assert [(e.line, e.param) for e in errors_of(submit(api, path))] == [
        (1, "body.max_tokens")]
    path.write_text("\n\n")
    assert [e.code for e in errors_of(submit(api, path))] == ["empty_file"]


def test_a_file_past_openais_request_limit_fails_as_openai_fails_it(
        app: Flask, tmp_path: Path) -> None:
    api = T.sdk(app)
    path = tmp_path / "big.jsonl"
    one = request("x")
    with path.open("w") as f:
        for i in range(MAX_REQUESTS + 1):
            f.write(one.replace('"x"', f'"r{i}"') + "\n")
    (error,) = errors_of(submit(api, path))
    assert (error.code, error.line, error.param) == ("too_many_tasks", MAX_REQUESTS + 1, None)
    assert "more than 50,000 requests" in (error.message or "")


def test_an_unforeseen_failure_fails_the_batch_and_is_logged(
        app: Flask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug no check foresaw")

    monkeypatch.setattr("vlmq.server.openai_api.batches.read_batch_file", broken)
    path = tmp_path / "in.jsonl"
    path.write_text(request("a") + "\n")
    with caplog.at_level(logging.ERROR, logger="vlmq.api"):
        (error,) = errors_of(submit(T.sdk(app), path))
    assert error.code == "server_error" and "RuntimeError" in (error.message or "")
    assert any("validation failed unexpectedly" in r.getMessage() and r.exc_info
               for r in caplog.records)


class Held(Executor):
    """Holds what is submitted until the test runs it: a validation that has not read its
    file yet, at the moment the test chooses."""

    def __init__(self) -> None:
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.held.append((fn, args))
        return Future()

    def run_all(self) -> None:
        for fn, args in self.held:
            fn(*args)
        self.held.clear()


def test_a_cancel_while_validating_ends_cancelled_with_nothing_enqueued(
        redis_url: str, tmp_path: Path) -> None:
    client = Client(redis_url)
    held = Held()
    files = FileStore(client.redis, client.keys, tmp_path / "files")
    batches = Batches(client, files, spool=tmp_path / "spool", stores=Stores.parse([]),
                      run=held)
    path = tmp_path / "in.jsonl"
    path.write_text(request("a") + "\n" + request("b") + "\n")
    with path.open("rb") as f:
        stored = files.save(f, "in.jsonl", "batch", "owner-1")
    made = batches.create("owner-1", {"input_file_id": stored.id, "completion_window": "24h",
                                      "endpoint": "/v1/chat/completions"})
    assert made["status"] == "validating"
    assert batches.cancel("owner-1", made["id"])["status"] == "cancelling"
    held.run_all()  # the file is read after the cancel
    shown = Batch.model_validate(batches.get("owner-1", made["id"]))
    assert shown.status == "cancelled" and shown.cancelled_at is not None
    assert client.redis.hget(client.keys.api_batch(made["id"]), "vlmq_batch") is None
    assert not any(k.startswith(b"rq:job:") for k in client.redis.scan_iter(count=1000))
    assert json.loads(json.dumps(batches.get("owner-1", made["id"])))["errors"] is None
    client.close()
