"""`vlmq api` without a worker: the official `openai` SDK over the app (through httpx's
WSGI transport, no socket), real Redis. Uploads, validation to in_progress or failed with
line-numbered errors, keys seeing only their own ids, OpenAI's error shape and limits,
cancel, the completion window, and a CLI batch no key reads."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import Result
from flask import Flask
from openai.types import Batch, FileObject
from werkzeug.test import TestResponse

from tests.support import openai_api as T
from vlmq.producer.client import Client
from vlmq.producer.openai_files import submit_openai_batch
from vlmq.server.openai_api.access import KEYS_ENV, KeyRing, digest, load_keys


@pytest.fixture
def app(redis_url: str, tmp_path: Path) -> Iterator[Flask]:
    with T.in_process_app(redis_url, tmp_path / "files") as made:
        yield made



def settled(api: openai.OpenAI, batch_id: str, leave: str = "validating") -> Batch:
    for _ in range(2000):
        batch = api.batches.retrieve(batch_id)
        if batch.status != leave:
            return Batch.model_validate(batch.model_dump())
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} stayed {leave}")


def test_upload_create_and_read_back(app: Flask, tmp_path: Path, redis_url: str) -> None:
    api = T.sdk(app)
    path = T.batch_file(tmp_path / "in.jsonl", 5)
    made = api.files.create(file=path, purpose="batch")
    assert FileObject.model_validate(made.model_dump()).bytes == path.stat().st_size
    assert made.id.startswith("file-") and made.purpose == "batch"
    assert api.files.content(made.id).content == path.read_bytes()
    assert [f.id for f in api.files.list()] == [made.id]
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"run": "t1"})
    assert batch.status in ("validating", "in_progress")
    batch = settled(api, batch.id)
    assert batch.status == "in_progress", batch.errors
    assert batch.request_counts is not None and batch.request_counts.total == 5
    assert batch.metadata == {"run": "t1"} and batch.in_progress_at is not None
    # One vlmq batch: `vlmq status` reads it by the vlmq id the record names.
    client = Client(redis_url)
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch.id), "vlmq_batch")
    assert client.batch(vlmq_batch.decode()).status()["items"]["total"] == 5
    listed = api.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    # Another key sees none of it.
    other = T.sdk(app, T.KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(made.id)
    assert list(other.batches.list()) == [] and list(other.files.list()) == []
    cancelled = api.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")  # queued jobs end at once
    ended = settled(api, batch.id, leave="cancelling")
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert ended.request_counts is not None and ended.request_counts.failed == 5
    errors = api.files.content(ended.error_file_id or "").text.splitlines()
    assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_cancelled"] * 5
    api.files.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(made.id)
    client.close()


def test_listings_page_with_the_after_cursor(app: Flask, tmp_path: Path) -> None:
    api = T.sdk(app)
    made = {api.files.create(file=T.batch_file(tmp_path / f"in{n}.jsonl", 1),
                             purpose="batch").id for n in range(3)}
    seen: list[str] = []
    after: str | None = None
    for _ in range(3):
        page = api.files.list(limit=1, **({"after": after} if after else {}))
        assert len(page.data) == 1
        after = page.data[0].id
        seen.append(after)
    assert sorted(seen) == sorted(made)  # each once, one a page
    assert api.files.list(after=after).data == []
    with pytest.raises(openai.NotFoundError):
        api.files.list(after="file-unknown")
    with pytest.raises(openai.NotFoundError):
        api.batches.list(after="batch_unknown")


def test_bad_file_fails_with_numbered_lines(app: Flask, tmp_path: Path) -> None:
    api = T.sdk(app)
    path = tmp_path / "bad.jsonl"
    good = T.line("ok", T.data_uri(0))
    bad = json.loads(good)
    bad["body"]["messages"][0]["content"][1]["image_url"]["url"] = "https://x/y.png"
    local = json.loads(good)  # a path would name the server's own files
    local["body"]["messages"][0]["content"][1]["image_url"]["url"] = "file:///etc/hostname"
    path.write_text(good + json.dumps({**bad, "custom_id": "web"}) + "\n" + good.replace(
        '"ok"', '"n"') + '{"custom_id": "z", "method": "GET"}\n'
                    + json.dumps({**local, "custom_id": "local"}) + "\n")
    made = api.files.create(file=path, purpose="batch")
    batch = settled(api, api.batches.create(input_file_id=made.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    assert [e.line for e in batch.errors.data] == [2, 4, 5]
    assert "never fetches" in (batch.errors.data[0].message or "")
    assert "file:// paths are refused" in (batch.errors.data[2].message or "")
    assert batch.errors.data[0].param and "image_url" in batch.errors.data[0].param


def error_of(resp: TestResponse) -> dict[str, Any]:
    body = resp.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}, body
    return dict(body["error"])


def test_refusals_are_openai_shaped(app: Flask) -> None:
    http = app.test_client()
    auth = {"Authorization": f"Bearer {T.KEYS[0]}"}
    assert http.get("/v1/batches").status_code == 401
    error_of(http.get("/v1/batches"))
    wrong = http.get("/v1/batches", headers={"Authorization": "Bearer wrong-key-000"})
    assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
    for resp, status in (
            (http.get("/v1/nothing", headers=auth), 404),
            (http.delete("/v1/batches", headers=auth), 405),
            (http.post("/v1/batches", headers=auth, data="x", content_type="text/plain"), 415),
            (http.post("/v1/batches", headers=auth, json={"endpoint": "/v1/chat/completions"}),
             400),
            (http.post("/v1/batches", headers=auth, json={
                "input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                "completion_window": "1h"}), 400),
            (http.post("/v1/batches", headers=auth, json={
                "input_file_id": "file-x", "endpoint": "/v1/embeddings",
                "completion_window": "24h"}), 400),
            (http.post("/v1/batches", headers=auth, json={
                "input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}), 404),
            (http.post("/v1/batches", headers=auth, data=b"{" + b" " * (2 << 20) + b"}",
                       content_type="application/json"), 413),
            (http.post("/v1/files", headers=auth, json={}), 415),
            (http.get("/v1/batches?limit=0", headers=auth), 400)):
        assert resp.status_code == status, (status, resp.json)
        error_of(resp)
    refused = http.get("/v1/batches", headers={**auth, "Host": "evil.example"})
    assert refused.status_code == 421


def test_the_window_expires_a_batch(app: Flask, tmp_path: Path, redis_url: str) -> None:
    api = T.sdk(app)
    made = api.files.create(file=T.batch_file(tmp_path / "in.jsonl", 3),
                            purpose="batch")
    batch = settled(api, api.batches.create(input_file_id=made.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    assert batch.expires_at == batch.created_at + 24 * 3600
    client = Client(redis_url)
    client.redis.hset(client.keys.api_batch(batch.id), "expires_at", 0)  # the window passed
    ended = settled(api, batch.id, leave="in_progress")
    ended = settled(api, batch.id, leave="finalizing") if ended.status == "finalizing" else ended
    assert ended.status == "expired" and ended.expired_at is not None
    lines = [json.loads(x) for x in api.files.content(ended.error_file_id or "").text.split("\n")
             if x]
    assert [x["error"]["code"] for x in lines] == ["batch_expired"] * 3
    client.close()


def test_a_cli_batch_is_no_keys(app: Flask, tmp_path: Path, redis_url: str) -> None:
    """A batch `vlmq enqueue` made was created by no key: none reads, lists or cancels
    it (as another key's; the CLI and the dashboard serve it)."""
    client = Client(redis_url)
    made, _ = submit_openai_batch(client, T.batch_file(tmp_path / "cli.jsonl", 2))
    for key in T.KEYS:
        with pytest.raises(openai.NotFoundError):
            T.sdk(app, key).batches.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            T.sdk(app, key).batches.cancel(made.id)
        assert list(T.sdk(app, key).batches.list()) == []
    client.close()


def test_models_are_the_workers(app: Flask, redis_url: str) -> None:
    client = Client(redis_url)
    client.redis.sadd(client.keys.workers, "w1", "w2", "gone")
    client.redis.hset(client.keys.worker_stats("w1"), "model", "tiny")
    client.redis.hset(client.keys.worker_stats("w2"), "model", "tiny")
    assert [m.id for m in T.sdk(app).models.list()] == ["tiny"]
    client.close()


def test_keys_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# ops team\nkey-one-12345678\n\n  key-two-12345678  \n")
    assert load_keys(path, {}) == ["key-one-12345678", "key-two-12345678"]
    assert load_keys(None, {KEYS_ENV: "key-a-1234567890,key-b-1234567890"}) == [
        "key-a-1234567890", "key-b-1234567890"]
    with pytest.raises(ValueError, match="no API keys"):
        load_keys(None, {})
    path.write_text("tiny9\n")
    with pytest.raises(ValueError, match="key 1 is too weak") as refused:
        load_keys(path, {})
    assert "tiny9" not in str(refused.value)  # a key is never echoed
    ring = KeyRing(["key-one-12345678"])
    assert ring.owner("Bearer key-one-12345678") == digest("key-one-12345678")
    assert ring.owner("Bearer key-one-1234567") is None and ring.owner("Basic x") is None


def test_the_command_refuses_to_serve_without_keys(run_cli: Callable[..., Result],
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEYS_ENV, raising=False)
    res = run_cli("api", "--files-dir", str(tmp_path / "files"), code=2)
    assert "no API keys" in res.stderr
