"""System E: mlx-vlm's own HTTP server, the thing a user would run instead of a queue.

`python -m mlx_vlm.server` serves OpenAI-style `/v1/chat/completions` and batches
concurrent requests continuously (one thread drives a `BatchGenerator`, up to
`--max-num-seqs` rows). run.py starts it through this file, which loads the same BLAS a
vlmq worker would before MLX is imported (on Linux the mlx[cpu] wheel's own BLAS is
the slow reference one), then hands over to mlx-vlm's CLI unchanged.

Requests stream (`"stream": true`): the server runs a non-streaming request in
`asyncio.to_thread`, whose default pool has only cores + 4 threads, so without streaming
at most 6 rows would batch on 2 cores. Tokens are counted from the `usage` chunk.

    python benchmarks/server_e.py --model DIR --port 8090   # the wrapper, by hand
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from PIL import Image

HOST = "127.0.0.1"


@dataclass
class Reply:
    """One finished request as the client saw it."""

    completion_tokens: int
    text: str
    finish_reason: str | None
    done_at: float  # time.perf_counter() when the last chunk arrived


def data_url(image: Image.Image) -> str:
    """The exact pixels, lossless, as the data URL the server's image loader accepts."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def request_body(model: str, image_url: str, prompt: str, max_tokens: int) -> bytes:
    return json.dumps({
        "model": model,
        # Text before image: the order vlmq's and mlx-vlm's own templates give.
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": prompt},
            {"type": "image_url", "image_url": {"url": image_url}}]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,  # greedy: the server then samples by argmax, as every system
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


def chat(port: int, body: bytes, timeout: float = 1800) -> Reply:
    """One streamed chat completion on its own connection (one client per item)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"server answered {resp.status}: {resp.read()[:2000]!r}")
        tokens, parts, finish = 0, [], None
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    parts.append(delta["content"])
                finish = choice.get("finish_reason") or finish
        return Reply(tokens, "".join(parts), finish, time.perf_counter())
    finally:
        conn.close()


def _get_json(port: int, path: str) -> dict[str, Any] | None:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return json.loads(body) if resp.status == 200 else None
    except OSError:
        return None  # not listening yet
    finally:
        conn.close()


def _child_env() -> dict[str, str]:
    """This process's environment without the BLAS settings it made for itself: the server
    picks its threads as a worker would (every core, as an `mlx_vlm.server` user has)."""
    from vlmq.worker.model import blas

    return blas.child_env()


class Server:
    """`mlx_vlm.server` as a subprocess on a free port, model preloaded; its log goes to
    a file (a pipe nobody reads would fill and stall the server)."""

    def __init__(self, model: str, *, max_num_seqs: int | None, max_tokens: int,
                 log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        from vlmq.worker.redis_server import free_port

        self.model = model
        self.port = free_port()
        self.log_path = log_path
        cmd = [sys.executable, str(Path(__file__).resolve()), "--model", model,
               "--host", HOST, "--port", str(self.port),
               "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
        if max_num_seqs is not None:  # None: the server's own default (unbounded)
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env or _child_env(), start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> dict[str, Any]:
        """Until /health names the preloaded model (it loads on a background thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_vlm.server exited {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            health = _get_json(self.port, "/health")
            if health and health.get("loaded_model"):
                return health
            time.sleep(0.2)
        raise TimeoutError(f"mlx_vlm.server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def vm_hwm_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def serve(argv: list[str]) -> None:
    """Load the worker's BLAS, then run mlx-vlm's server CLI with these arguments."""
    from vlmq.worker.model import blas

    info = blas.select()  # before mlx.core loads: libmlx binds cblas_sgemm at import
    print(f"BLAS: {info.describe()}", flush=True)
    from mlx_vlm.server.cli import main

    sys.argv = ["mlx_vlm.server", *argv]  # its CLI parses sys.argv
    main()


if __name__ == "__main__":
    serve(sys.argv[1:])
