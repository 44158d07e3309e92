"""A 10,000-line batch file with data-URI images through `vlmq api`'s validation and
enqueue: Redis grows by less than 5 % of the file (the images stay in the files folder;
the jobs hold references). The full pass through a worker, and the all-distinct figure,
are benchmarks/openai_api.py's (docs/openai-api.md quotes them)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx
import openai
from redis import Redis

from tests.support import openai_api as T
from vlmq.producer.client import Client
from vlmq.server.openai_api.app import ApiSettings, create_app

LINES = 10_000
DISTINCT = 500  # images; every line's data: URI is decoded and checked all the same


def _bytes(redis: Redis) -> int:
    return sum(redis.memory_usage(k, samples=0) or 0 for k in redis.scan_iter(count=1000))


def test_ten_thousand_lines_cost_redis_little(redis_url: str, redis: Redis,
                                              tmp_path: Path) -> None:
    uris = [T.data_uri(i, (160, 200)) for i in range(DISTINCT)]
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(LINES):
            f.write(T.line(f"req-{i}", uris[i % DISTINCT]))
    size = path.stat().st_size
    client = Client(redis_url)
    app = create_app(ApiSettings(redis_url=redis_url, files_dir=tmp_path / "files",
                                 keys=T.KEYS), client=client)
    http = app.test_client()
    auth = {"Authorization": f"Bearer {T.KEYS[0]}"}
    before = _bytes(redis)
    # Uploaded with the SDK (httpx's WSGI transport: the body in memory, no socket).
    sdk = openai.OpenAI(api_key=T.KEYS[0], base_url="http://127.0.0.1:8000/v1", max_retries=0,
                        http_client=httpx.Client(transport=httpx.WSGITransport(
                            app=app)))  # type: ignore[arg-type]
    made = sdk.files.create(file=path, purpose="batch").model_dump()
    assert made["bytes"] == size
    batch = http.post("/v1/batches", headers=auth, json={
        "input_file_id": made["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).get_json()
    while (shown := http.get(f"/v1/batches/{batch['id']}", headers=auth).get_json()
           )["status"] == "validating":
        time.sleep(0.2)
    assert shown["status"] == "in_progress", shown["errors"]
    assert shown["request_counts"]["total"] == LINES
    grown = _bytes(redis) - before
    assert grown < 0.05 * size, (grown, size)
    client.close()
