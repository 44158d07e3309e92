"""Units carry the worker's environment and restart it only when a restart can help.

An S3 or offline worker reads AWS_* and HF_* from its environment: the unit must hold
them (secrets only in the 0600 env file). A worker whose configuration is wrong exits 78
(EX_CONFIG) and is not restarted (systemd RestartPreventExitStatus=, the plist's sh
wrapper); Redis out of reach exits 69 and is.
"""

from __future__ import annotations

import os
import plistlib
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_units import SYSTEMD_ANALYZE, VLMQ, mode, service, settings, verify
from vlmq.cli import common
from vlmq.cli.units import CARRY_NAMES, CARRY_PREFIXES, NO_RESTART
from vlmq.worker import loop
from vlmq.worker.model.mlx_adapter import ModelLoadError
from vlmq.worker.redis_server import free_port

S3_ENV = {
    "AWS_PROFILE": "scans", "AWS_ENDPOINT_URL": "http://minio.lan:9000",
    "AWS_REGION": "eu-west-1", "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "3",
    "HTTPS_PROXY": "http://proxy.lan:3128",
}
S3_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID", "AWS_SECRET_ACCESS_KEY": "s3cr3t-key-value",
    "AWS_SESSION_TOKEN": "session-token-value", "HF_TOKEN": "hf_token_value",
}
LEFT_OUT = {"PYTHONPATH": "/opt/mine", "REDIS_PASSWORD": "x", "LD_LIBRARY_PATH": "/opt/lib"}
WORKER = ["--", "--model", "/models/ocr", "--store", "scans=s3://bucket/in"]


def _inline(unit_text: str) -> dict[str, str]:
    """Environment= settings of a unit, by name."""
    pairs = (v.strip('"').split("=", 1) for v in settings(unit_text).get("Environment", []))
    return dict((k, v) for k, v in pairs)


def _secrets_only_in(env_file: Path, shown: str) -> None:
    text = env_file.read_text()
    assert mode(env_file) == 0o600
    for key, value in S3_SECRETS.items():
        assert f"{key}='{value}'" in text and value not in shown
    for key in S3_ENV:
        assert key not in text  # the rest is in the unit, where it can be read


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_s3_worker_unit_holds_its_aws_variables_and_secrets_stay_in_the_env_file(
        tmp_path: Path, kind: str) -> None:
    home = tmp_path / "home"
    proc = service(home, "install", kind, *WORKER, redis_url="redis://db.lan:6379/0",
                   env_extra={**S3_ENV, **S3_SECRETS, **LEFT_OUT})
    env_file = home / ".config" / "vlmq" / "vlmq-worker.env"
    if kind == "systemd":
        unit = home / ".config" / "systemd" / "user" / "vlmq-worker.service"
        text = unit.read_text()
        inline = _inline(text)
        unit_settings = settings(text)
        assert unit_settings["EnvironmentFile"] == [str(env_file)]
        assert unit_settings["RestartPreventExitStatus"] == ["2 78"]
        if SYSTEMD_ANALYZE is not None:
            verify(text, tmp_path, user=True)
    else:
        unit = home / "Library" / "LaunchAgents" / "vlmq-worker.plist"
        text = unit.read_text()
        plist = plistlib.loads(unit.read_bytes())
        inline = plist["EnvironmentVariables"]
        assert plist["ProcessType"] == "Interactive"
        assert str(env_file) in plist["ProgramArguments"][2]
    assert {k: inline[k] for k in S3_ENV} == S3_ENV
    assert inline["REDIS_URL"] == "redis://db.lan:6379/0"
    assert not set(S3_SECRETS) & set(inline)
    _secrets_only_in(env_file, text + proc.stdout + proc.stderr)
    # Named on stderr, not carried: a shell's session paths, a variable vlmq does not read.
    warning = next(line for line in proc.stderr.splitlines() if "not in the unit" in line)
    assert all(key in warning for key in LEFT_OUT), proc.stderr
    assert not set(LEFT_OUT) & set(inline)


def test_print_without_env_file_masks_every_secret(tmp_path: Path) -> None:
    proc = service(tmp_path, "print", "systemd", *WORKER, env_extra={**S3_ENV, **S3_SECRETS})
    inline = _inline(proc.stdout)
    assert {k: inline[k] for k in S3_SECRETS} == dict.fromkeys(S3_SECRETS, "***")
    assert all(key in proc.stderr for key in S3_SECRETS) and "--env-file" in proc.stderr
    assert inline["AWS_PROFILE"] == "scans"


def test_the_carried_list_covers_what_the_worker_reads() -> None:
    """The documented list: S3 (boto3), the hub, transformers, BLAS/MLX threads, proxies."""
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "HF_HOME", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                "MLX_METAL_FAST_SYNCH", "VLMQ_STORES"):
        assert key.startswith(CARRY_PREFIXES), key
    assert {"HTTPS_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"} <= CARRY_NAMES


# --- restarts -------------------------------------------------------------------------------


def test_exit_codes_agree() -> None:
    assert loop.EXIT_CONFIG == common.EXIT_CONFIG == 78
    assert loop.EXIT_UNAVAILABLE == common.EXIT_UNREACHABLE == 69
    assert set(NO_RESTART) == {common.EXIT_BAD_INPUT, common.EXIT_CONFIG}


def _plist_program(tmp_path: Path) -> list[str]:
    proc = service(tmp_path / "home", "print", "launchd", "--", "--model", "/m")
    return list(plistlib.loads(proc.stdout.encode())["ProgramArguments"])


@pytest.mark.parametrize(("code", "wrapper_code"), [(0, 0), (78, 0), (2, 0), (69, 69), (1, 1)])
def test_plist_wrapper_turns_configuration_exits_into_no_restart(
        tmp_path: Path, code: int, wrapper_code: int) -> None:
    """KeepAlive {SuccessfulExit: false} restarts every non-zero exit: the wrapper reports
    78 and 2 in the log and exits 0, and passes every other code on."""
    program = _plist_program(tmp_path)
    fake = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    proc = subprocess.run([*program[:3], *fake], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == wrapper_code, proc.stderr
    assert ("not restarting" in proc.stderr) == (code in NO_RESTART)
    if code in NO_RESTART:
        assert f"launchctl kickstart gui/{os.getuid()}/vlmq-worker" in proc.stderr


FAKE_WORKER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    out.write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(out.parent / "ready").write_text("")
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_plist_wrapper_passes_the_stop_signal_to_the_worker(tmp_path: Path,
                                                            sig: signal.Signals) -> None:
    """launchd signals the job's process, the sh: the worker must get it to drain."""
    program = _plist_program(tmp_path)
    got = tmp_path / "got"
    proc = subprocess.Popen([*program[:3], sys.executable, "-c", FAKE_WORKER, str(got)],
                            env={"PATH": "/usr/bin:/bin"})
    try:
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None
            subprocess.run(["sleep", "0.05"], check=True)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got.read_text() == sig.name


# --- the real worker's exit codes -------------------------------------------------------------


def _worker(args: list[str], redis_url: str, tmp_path: Path,
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "VLMQ_CACHE": str(tmp_path / "cache"), **(extra or {})}
    return subprocess.run([str(VLMQ), "--redis-url", redis_url, "worker", "--burst", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_worker_with_a_missing_model_folder_exits_78(tmp_path: Path, redis_url: str) -> None:
    proc = _worker(["--model", str(tmp_path / "no-such-model")], redis_url, tmp_path)
    assert proc.returncode == 78, proc.stderr
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_worker_offline_with_an_uncached_hub_id_exits_78(tmp_path: Path,
                                                         redis_url: str) -> None:
    """HF_HUB_OFFLINE with nothing in the cache: no restart will download it."""
    proc = _worker(["--model", "vlmq-tests/not-cached"], redis_url, tmp_path,
                   {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 78, proc.stderr


def test_worker_with_redis_out_of_reach_exits_69(tmp_path: Path, tiny_model: Path) -> None:
    proc = _worker(["--model", str(tiny_model)], f"redis://127.0.0.1:{free_port()}/0",
                   tmp_path)
    assert proc.returncode == 69, proc.stderr
    assert "cannot reach Redis" in proc.stderr


def test_worker_from_the_plist_with_a_missing_model_is_not_restarted(
        tmp_path: Path, redis_url: str) -> None:
    """The installed plist run as launchd would: exit 0 (KeepAlive leaves it stopped) and
    the reason in the log."""
    home = tmp_path / "home"
    service(home, "install", "launchd", "--", "--model", str(tmp_path / "gone"), "--burst",
            redis_url=redis_url)
    plist = plistlib.loads((home / "Library" / "LaunchAgents" / "vlmq-worker.plist")
                           .read_bytes())
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", **plist["EnvironmentVariables"]}
    proc = subprocess.run(plist["ProgramArguments"], cwd=plist["WorkingDirectory"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "does not exist" in proc.stderr and "exited 78" in proc.stderr


def test_a_hub_out_of_reach_is_transient_any_other_load_error_is_not() -> None:
    def chained(cause: BaseException) -> ModelLoadError:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise FileNotFoundError("cannot find the files on the Hub") from inner
        except FileNotFoundError as outer:
            error = ModelLoadError("cannot load model")
            error.__cause__ = outer
            return error

    assert chained(socket.gaierror(-2, "Name or service not known")).network
    assert chained(ConnectionRefusedError(111, "refused")).network
    assert chained(TimeoutError("timed out")).network
    assert not chained(KeyError("model_type")).network
    assert not ModelLoadError("model folder /m does not exist").network
