"""Producers in other languages, written from shared/PROTOCOL.md alone, against a real
worker: bash + redis-cli, Node.js with the npm `redis` package, and Python with only the
`redis` package. Each enqueues through enqueue.lua, follows the events stream from 0-0 to
the terminal event, reads the results (the summary kept in the job hash), follows again
after the stream expired, gets a bad EVALSHA's error at once, and sees a job
the worker refuses end with a terminal event too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import make_images, make_pdf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parents[1] / "support" / "clients"
ENQUEUE_LUA = ROOT / "shared" / "enqueue.lua"


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One worker (default queues: ocr, caption, generate) serving every test here."""
    proc = helpers.start_worker(module_redis_url, tiny_model,
                                tmp_path_factory.mktemp("worker"), "--max-batch", "4",
                                name="polyglot")
    try:
        yield module_redis_url
    finally:
        helpers.stop_all([proc])


def run_client(cmd: list[str], url: str, **env: str) -> str:
    done = subprocess.run(cmd, env={**os.environ, "REDIS_URL": url,
                                    "ENQUEUE_LUA": str(ENQUEUE_LUA), **env},
                          capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, f"{cmd[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def node_modules() -> Path:
    """The npm packages of tests/support/clients/package.json: those `.ci/dev.py test` installed,
    else installed here into the same kind of cache directory."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: `python3 .ci/dev.py test` installs it with "
                    "apt-get when run as root")
    if os.environ.get("VLMQ_NODE_MODULES"):
        return Path(os.environ["VLMQ_NODE_MODULES"])
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed, so the npm `redis` package cannot be had")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = base / "vlmq" / "npm"
    cache.mkdir(parents=True, exist_ok=True)
    wanted = (CLIENTS / "package.json").read_text()
    if not ((cache / "package.json").exists() and (cache / "package.json").read_text() == wanted
            and (cache / "node_modules" / "redis").is_dir()):
        (cache / "package.json").write_text(wanted)
        done = subprocess.run([npm, "install", "--prefix", str(cache), "--no-audit",
                               "--no-fund"], capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, f"npm install failed:\n{done.stdout}\n{done.stderr}"
    return cache / "node_modules"


def test_bash_and_redis_cli_producer(served: str, redis_cli_ok: None, tmp_path: Path) -> None:
    image = make_images(tmp_path, 1)[0]
    out = run_client(["bash", str(CLIENTS / "caption.sh"), str(image)], served).splitlines()
    size = image.stat().st_size
    assert out[0] == f"blob {size} bytes"  # the upload was binary-safe
    assert out[1] == "enqueue 1"
    assert out[2].startswith("bad ") and "timeout" in out[2]
    events = out[out.index("enqueue 1") + 2:]
    first_end = next(i for i, line in enumerate(events) if line.startswith("terminal "))
    assert events[:first_end] == ["event item 0", "event finished"], events
    summary = json.loads(events[first_end].removeprefix("terminal finished "))
    assert summary["items"] == 1 and summary["ok"] == 1
    # Read right after the terminal event: the final status and the kept end are there; a
    # finished job has no RQ results entry (PROTOCOL.md section 6).
    assert events[first_end + 1:first_end + 4] == ["status finished", "end-type finished",
                                                   "result-type "]
    item = json.loads(events[first_end + 4].removeprefix("item 0 "))
    assert item["index"] == 0 and item.get("error") is None and item["text"]
    late = events[first_end + 5]  # its stream gone: the end read from the job hash
    assert late.startswith("late kept "), events
    kept = json.loads(late.removeprefix("late kept "))
    assert kept["type"] == "finished" and kept["summary"] == summary
    refused = out[out.index("enqueue 1", 3):]
    assert refused[1] == "event failed"
    assert refused[2].startswith("terminal failed ") and "someone/another-model" in refused[2]
    assert refused[3:6] == ["status failed", "end-type failed", "result-type 2"]


def test_node_producer(served: str, tmp_path: Path) -> None:
    modules = node_modules()
    pdf = make_pdf(tmp_path / "doc.pdf", 4)
    out = json.loads(run_client(["node", str(CLIENTS / "ocr.cjs"), str(pdf), "2", "4"], served,
                                NODE_PATH=str(modules)))
    assert out["enqueued"] == 1
    assert "timeout" in out["bad"]
    types = [e["type"] for e in out["events"]]
    assert types == ["item"] * 3 + ["finished"] and out["status"] == "finished"
    assert sorted(int(e["index"]) for e in out["events"][:3]) == [0, 1, 2]
    assert out["summary"] == out["returned"]
    assert out["summary"]["items"] == 3 and out["summary"]["ok"] == 3
    assert out["late"]["events"] == [] and out["late"]["kept"]["summary"] == out["summary"]
    assert [(i["index"], i["page"]) for i in sorted(out["items"], key=lambda i: i["index"])] \
        == [(0, 2), (1, 3), (2, 4)]
    refused = out["refused"]
    assert [e["type"] for e in refused["events"]] == ["failed"]
    assert refused["status"] == "failed" and "v" in refused["events"][0]["error"]


def test_plain_redis_py_producer(served: str, tmp_path: Path) -> None:
    images = make_images(tmp_path, 2)
    out = json.loads(run_client([sys.executable, str(CLIENTS / "producer.py"),
                                 *map(str, images)], served))
    assert out["imports_vlmq"] is False
    assert out["enqueued"] == 1 and "timeout" in out["bad"]
    assert [e["type"] for e in out["events"]] == ["item", "item", "finished"]
    assert out["status"] == "finished"
    assert json.loads(out["events"][-1]["labels"]) == {"lang": "python"}  # JSON, not repr
    assert out["summary"] == out["returned"] and out["summary"]["ok"] == 2
    kept = out["late"]["kept"]  # its stream gone: the end read from the job hash
    assert kept["type"] == "finished" and kept["summary"] == out["summary"] and kept["id"]
    assert [i["index"] for i in out["items"]] == [0, 1] and all(i["text"] for i in out["items"])
    assert out["notified"] == [{"id": out["id"], "status": "finished"}]
    refused = out["refused"]
    assert [e["type"] for e in refused["events"]] == ["failed"]
    assert refused["status"] == "failed"
    assert "not JSON (a pickled job?)" in refused["events"][0]["error"]


@pytest.fixture
def redis_cli_ok() -> None:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (it comes with redis-server/redis-tools)")


def test_the_worker_served_every_job_without_a_stray_write(served: str) -> None:
    """After the producers above: every job's stream still there (each client deleted its
    first job's, as its expiry would) ends with its one terminal event."""
    conn = Redis.from_url(served)
    try:
        for key in conn.scan_iter("vlmq:job:*:events"):
            types = [f[b"type"] for _, f in conn.xrange(key)]
            ends = [t for t in types if t in (b"finished", b"failed", b"canceled")]
            assert len(ends) == 1 and types[-1] == ends[0], (key, types)
    finally:
        conn.close()
