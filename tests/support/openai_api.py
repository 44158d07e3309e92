"""Batch files and a served `vlmq api` for the OpenAI API tests (ops, e2e, benchmark)."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support import helpers

if TYPE_CHECKING:
    import openai
    from flask import Flask

URL = "/v1/chat/completions"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title"],
          "properties": {"title": {"type": "string", "maxLength": 8}}}
KEYS = ("key-alpha-123456", "key-beta-6543210")


def data_uri(i: int, size: tuple[int, int] = (96, 120)) -> str:
    out = io.BytesIO()
    helpers.page_image(i, size).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def line(custom_id: str, url: str, *, schema: bool = False, max_tokens: int = 4,
         model: str = "gpt-4o-mini") -> str:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe the image."},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "title", "schema": SCHEMA, "strict": True}}
        body["max_tokens"] = 40
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL,
                       "body": body}) + "\n"


def batch_file(path: Path, n: int, *, images: int = 3, schema_line: bool = True) -> Path:
    """n lines over `images` distinct data-URI images, the second a json_schema line."""
    uris = [data_uri(i) for i in range(images)]
    with path.open("w") as f:
        for i in range(n):
            f.write(line(f"req-{i}", uris[i % images], schema=schema_line and i == 1))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_api(redis_url: str, files_dir: Path | None, port: int, *args: str,
              keys: Sequence[str] = KEYS) -> subprocess.Popen[str]:
    """`vlmq api` on `port` serving `keys`; `args` are more of its options. No files_dir:
    its default folder (from this process's environment)."""
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_API_KEYS": ",".join(keys),
           "PYTHONUNBUFFERED": "1"}
    folder = ["--files-dir", str(files_dir)] if files_dir is not None else []
    return subprocess.Popen([str(Path(sys.executable).parent / "vlmq"), "api", "--port",
                             str(port), *folder, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@contextmanager
def in_process_app(redis_url: str, files_dir: Path) -> Iterator[Flask]:
    """The API's Flask app in this process (no server), over the suite's keys."""
    from vlmq.producer.client import Client
    from vlmq.server.openai_api.app import ApiSettings, create_app

    client = Client(redis_url)
    try:
        yield create_app(ApiSettings(redis_url=redis_url, files_dir=files_dir, keys=KEYS),
                         client=client)
    finally:
        client.close()


def sdk(app: Flask, key: str = KEYS[0]) -> openai.OpenAI:
    """The official SDK talking to `app` in process, one try per call."""
    import httpx2 as httpx
    import openai

    transport = httpx.WSGITransport(app=app)  # type: ignore[arg-type]
    return openai.OpenAI(api_key=key, base_url="http://127.0.0.1:8000/v1", max_retries=0,
                         http_client=httpx.Client(transport=transport))
