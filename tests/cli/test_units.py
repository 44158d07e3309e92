"""`vlmq service print|install`: units systemd accepts, plists plistlib reads, secrets kept in
a 0600 file, and a worker started from an installed plist's own argv serving a real job."""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from tests.support.helpers import make_images
from vlmq.cli.units import systemd_word
from vlmq.cli.worker import worker_cmd

VLMQ = Path(sys.executable).with_name("vlmq")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                   reason="systemd-analyze is not installed")
SECRET_URL = "redis://:hunter2-secret@db.example:6380/3"
GRACE_DEFAULT = next(p.default for p in worker_cmd.params if p.name == "grace")


def service(home: Path, *args: str, redis_url: str = SECRET_URL, code: int | None = 0,
            env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real console script with a temporary HOME and a bare environment (this shell's
    AWS_*, SSL_* or HF_* would reach the unit) but `env_extra`."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env.update(env_extra or {})
    proc = subprocess.run([str(VLMQ), "--redis-url", redis_url, "service", *args],
                          env=env, capture_output=True, text=True, timeout=60)
    if code is not None:
        assert proc.returncode == code, (proc.stdout, proc.stderr)
    return proc


def verify(unit_text: str, tmp: Path, *, user: bool, name: str = "vlmq-test.service") -> None:
    """systemd-analyze verify on a copy; any warning (ignored line, bad quoting) fails too."""
    assert SYSTEMD_ANALYZE is not None
    folder = tmp / f"verify-{'user' if user else 'system'}"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(unit_text)
    # A short runtime dir: the user manager's own socket units (gpg-agent, ...) put their
    # sockets under it, and a long pytest path overflows a socket path's 108 bytes.
    with tempfile.TemporaryDirectory(prefix="vr", dir="/tmp") as runtime:
        cmd = [SYSTEMD_ANALYZE, *(["--user"] if user else []), "verify", str(folder / name)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "XDG_RUNTIME_DIR": runtime})
    # What verify says of this unit counts; the distribution's own units are not ours.
    ours = [line for line in proc.stderr.splitlines() if name in line or str(folder) in line]
    assert (proc.returncode, ours, proc.stdout.strip()) == (0, [], ""), (unit_text, proc.stderr)


def settings(unit_text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit_text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            out.setdefault(key, []).append(value)
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- launchd -------------------------------------------------------------------------------


def test_plist_has_the_worker_argv_and_stops_after_grace(tmp_path: Path) -> None:
    args = ["--model", "/models/ocr model", "--queues", "ocr,caption", "--grace", "45.5",
            "--max-batch", "4"]
    proc = service(tmp_path, "print", "launchd", "--name", "ocr", "--env", "HF_HUB_OFFLINE=1",
                   "--", *args, redis_url="redis://10.0.0.5:6379/2")
    plist = plistlib.loads(proc.stdout.encode())
    program = plist["ProgramArguments"]
    assert program[:2] == ["/bin/sh", "-c"]  # the wrapper that keeps 78 from restarts
    assert Path(program[3]).is_absolute() and Path(program[3]).samefile(VLMQ)
    assert program[4:] == ["worker", *args]
    assert plist["Label"] == "ocr"
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProcessType"] == "Interactive"
    assert plist["ExitTimeOut"] > 45.5
    logs = tmp_path / "Library" / "Logs" / "vlmq" / "ocr.log"
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(logs)
    assert plist["WorkingDirectory"] == str(tmp_path / ".cache" / "vlmq")
    env = plist["EnvironmentVariables"]
    assert (env["REDIS_URL"], env["HF_HUB_OFFLINE"]) == ("redis://10.0.0.5:6379/2", "1")
    assert str(tmp_path / "Library" / "LaunchAgents" / "ocr.plist") in proc.stderr
    assert "launchctl bootstrap gui/$(id -u)" in proc.stderr


def test_plist_exit_timeout_follows_the_worker_default_grace(tmp_path: Path) -> None:
    plist = plistlib.loads(service(tmp_path, "print", "launchd", "--", "--model", "m/x").stdout
                           .encode())
    assert plist["ExitTimeOut"] > GRACE_DEFAULT


def test_print_masks_passwords_and_says_where_they_go(tmp_path: Path) -> None:
    for kind in ("launchd", "systemd"):
        proc = service(tmp_path, "print", kind, "--env", "AWS_SECRET_ACCESS_KEY=abc123xyz",
                       "--", "--model", "m/x")
        assert "hunter2" not in proc.stdout and "abc123xyz" not in proc.stdout
        assert "redis://:***@db.example:6380/3" in proc.stdout
        assert "--env-file" in proc.stderr and "REDIS_URL" in proc.stderr


def test_print_with_env_file_writes_it_0600_and_masks_nothing(tmp_path: Path) -> None:
    env_path = tmp_path / "conf" / "w.env"
    proc = service(tmp_path, "print", "systemd", "--env-file", str(env_path), "--",
                   "--model", "m/x")
    assert mode(env_path) == 0o600 and SECRET_URL in env_path.read_text()
    assert settings(proc.stdout)["EnvironmentFile"] == [str(env_path)]
    assert "hunter2" not in proc.stdout and "***" not in proc.stdout
    assert "***" not in proc.stderr and str(env_path) in proc.stderr


# --- systemd -------------------------------------------------------------------------------


@needs_systemd
@pytest.mark.parametrize("system", [False, True])
def test_systemd_unit_passes_verify(tmp_path: Path, system: bool) -> None:
    args = ["--model", "/models/a b", "--grace", "50", "--name", "it's \"w1\" 100% $HOME",
            "--queues", "ocr"]
    scope = ["--system", "--run-as", "alice"] if system else []
    text = service(tmp_path, "print", "systemd", *scope, "--env", "NOTE=50% \"off\" \\o/",
                   "--", *args, redis_url="redis://127.0.0.1:6379/0").stdout
    verify(text, tmp_path, user=not system)
    unit = settings(text)
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillSignal"] == ["SIGTERM"]
    assert int(unit["TimeoutStopSec"][0]) > 50
    assert unit["ExecStart"][0].startswith(f"{VLMQ} worker ")
    assert 'Environment="REDIS_URL=redis://127.0.0.1:6379/0"' in text
    if system:
        assert (unit["User"], unit["WantedBy"]) == (["alice"], ["multi-user.target"])
        assert unit["WorkingDirectory"] == ["/var/cache/vlmq"]
        assert unit["After"] == ["network-online.target"]
    else:
        assert unit["WantedBy"] == ["default.target"]
        assert unit["WorkingDirectory"] == [str(tmp_path / ".cache" / "vlmq")]


@needs_systemd
@pytest.mark.parametrize("name", ["a b", "100%", ";", "semi;colon", "ünïcode  x", "a%nb"])
def test_systemd_reads_a_quoted_word_back(tmp_path: Path, name: str) -> None:
    """verify checks that ExecStart's binary exists: it passes only if systemd's own
    unquoting of systemd_word(path) gives this exact file name (systemd refuses quotes and
    backslashes in an executable's name: test_exec_start_parses_back covers those)."""
    binary = tmp_path / name
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    unit = ("[Unit]\nDescription=q\n[Service]\n"
            f"ExecStart={systemd_word(str(binary), first=True)} {systemd_word(name)}\n")
    verify(unit, tmp_path, user=False)
    missing = ("[Unit]\nDescription=q\n[Service]\n"
               f"ExecStart={systemd_word(str(binary) + 'x', first=True)}\n")
    with pytest.raises(AssertionError):
        verify(missing, tmp_path, user=False)


def exec_start_argv(unit_text: str) -> list[str]:
    """ExecStart= read back in systemd's order: specifiers (%%), then words (our output
    only uses double quotes with \\ and \" inside, where POSIX shlex agrees), then $$."""
    line = settings(unit_text)["ExecStart"][0].replace("%%", "%")
    return [word.replace("$$", "$") for word in shlex.split(line)]


def test_exec_start_parses_back(tmp_path: Path) -> None:
    args = ["--model", "/m/it's \"q\"", "--name", "back\\slash $HOME ${X} 100%n; x",
            "--queues", "ocr", "--store", "docs=file:///srv/my%20docs%25"]
    text = service(tmp_path, "print", "systemd", "--", *args).stdout
    assert exec_start_argv(text) == [str(VLMQ), "worker", *args]
    if SYSTEMD_ANALYZE is not None:
        verify(text, tmp_path, user=True)


def test_unit_arguments_are_the_options_given_as_the_table_writes_them(tmp_path: Path) -> None:
    """In the order given, each in the table's own form (a store as its NAME=URL, a float
    as its shortest word); what came from the environment stays there: the unit's
    environment carries this shell's VLMQ_* variables."""
    args = ["--queues", "ocr", "--grace", "50.0", "--model", "m/x", "--queues", "caption",
            "--store", "docs=/srv/my docs", "--fixed-batch"]
    text = service(tmp_path, "print", "systemd", "--", *args).stdout
    assert exec_start_argv(text)[2:] == [
        "--queues", "ocr", "--queues", "caption", "--grace", "50", "--model", "m/x",
        "--store", "docs=file:///srv/my%20docs", "--fixed-batch"]
    from_env = service(tmp_path, "print", "systemd", "--", "--model", "m/x",
                       env_extra={"VLMQ_STORES": "docs=file:///srv/docs"}).stdout
    assert exec_start_argv(from_env)[2:] == ["--model", "m/x"]
    assert 'Environment="VLMQ_STORES=file:///srv/docs"' not in from_env
    assert 'Environment="VLMQ_STORES=docs=file:///srv/docs"' in from_env


def test_systemd_word_doubles_dollar_and_percent() -> None:
    assert systemd_word("$HOME 5%") == '"$$HOME 5%%"'
    assert systemd_word("plain-word_1.2") == "plain-word_1.2"
    assert systemd_word("") == '""'


# --- install -------------------------------------------------------------------------------


def test_install_systemd_keeps_the_password_in_a_0600_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = service(home, "install", "systemd", "--", "--model", "m/x", "--grace", "20")
    unit_path = home / ".config" / "systemd" / "user" / "vlmq-worker.service"
    env_path = home / ".config" / "vlmq" / "vlmq-worker.env"
    assert (mode(unit_path), mode(env_path)) == (0o644, 0o600)
    text = unit_path.read_text()
    assert "hunter2" not in text and "hunter2" not in proc.stdout
    assert settings(text)["EnvironmentFile"] == [str(env_path)]
    # The secret (REDIS_URL with its password) is in the file alone; the rest is inline.
    assert not any(v.startswith('"REDIS_URL') for v in settings(text)["Environment"])
    assert 'Environment="PYTHONUNBUFFERED=1"' in text
    assert (home / ".cache" / "vlmq").is_dir()
    assert ("systemctl --user daemon-reload && systemctl --user enable --now "
            "vlmq-worker.service") in proc.stdout
    # The file means the same to sh (launchd's wrapper) as the URL given.
    read = subprocess.run(["/bin/sh", "-c", 'set -a && . "$0" && printf %s "$REDIS_URL"',
                           str(env_path)], capture_output=True, text=True, check=True)
    assert read.stdout == SECRET_URL
    if SYSTEMD_ANALYZE is not None:
        verify(text, tmp_path, user=True)

    again = service(home, "install", "systemd", "--", "--model", "m/x", "--grace", "20")
    assert "unchanged" in again.stdout
    changed = service(home, "install", "systemd", "--", "--model", "m/y", code=2)
    assert "differs" in changed.stderr and str(unit_path) in changed.stderr
    assert unit_path.read_text() == text
    service(home, "install", "systemd", "--force", "--", "--model", "m/y")
    assert "m/y" in unit_path.read_text()


def test_install_refuses_a_changed_env_file(tmp_path: Path) -> None:
    service(tmp_path, "install", "systemd", "--", "--model", "m/x")
    proc = service(tmp_path, "install", "systemd", "--", "--model", "m/x",
                   redis_url="redis://:other@db.example:6380/3", code=2)
    assert "vlmq-worker.env exists and differs" in proc.stderr


def test_install_launchd_sources_the_env_file(tmp_path: Path) -> None:
    proc = service(tmp_path, "install", "launchd", "--name", "cap", "--",
                   "--model", "m/x", "--queues", "caption")
    plist_path = tmp_path / "Library" / "LaunchAgents" / "cap.plist"
    env_path = tmp_path / ".config" / "vlmq" / "cap.env"
    assert (mode(plist_path), mode(env_path)) == (0o644, 0o600)
    assert "hunter2" not in plist_path.read_text() and "hunter2" in env_path.read_text()
    plist = plistlib.loads(plist_path.read_bytes())
    assert "REDIS_URL" not in plist["EnvironmentVariables"]
    program = plist["ProgramArguments"]
    assert program[:2] == ["/bin/sh", "-c"] and str(env_path) in program[2]
    assert Path(program[3]).samefile(VLMQ)
    assert program[4:] == ["worker", "--model", "m/x", "--queues", "caption"]
    assert (tmp_path / "Library" / "Logs" / "vlmq").is_dir()
    assert f"launchctl bootstrap gui/$(id -u) {plist_path}" in proc.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["launchd", "--system", "--", "--model", "m/x"], "LaunchAgent"),
    (["systemd", "--", "--model", "m/x", "--no-such-flag"], "--no-such-flag"),
    (["systemd", "--", "--queues", "ocr"], "--model"),
    (["systemd", "--env", "1BAD=x", "--", "--model", "m/x"], "KEY=VALUE"),
    (["systemd", "--name", "a/b", "--", "--model", "m/x"], "--name"),
    (["systemd", "--", "--model", "m/x", "--cache-dir", "rel/dir"], "absolute"),
    # The table's conversions run too: a queue name the worker would refuse on every restart.
    (["systemd", "--", "--model", "m/x", "--queues", "ocr:x"], "--queues"),
    (["systemd", "--", "--model", "m/x", "--store", "docs=rel/dir"], "--store"),
])
def test_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = service(tmp_path, "print", *args, code=2)
    assert needle in proc.stderr and proc.stdout == ""


# --- a real worker from an installed unit ----------------------------------------------------


def test_worker_runs_from_the_installed_plist(tmp_path: Path, redis_url: str, tiny_model: Path,
                                              run_cli: Callable[..., Result]) -> None:
    """The plist's ProgramArguments, run as launchd would (its EnvironmentVariables, its
    working directory, its log file), and the job is served."""
    images = make_images(tmp_path / "in", 2)
    job_id = run_cli("enqueue", "caption", *map(str, images), "--max-tokens", "4",
                     code=0).stdout.strip()
    home = tmp_path / "home"
    service(home, "install", "launchd", "--", "--model", str(tiny_model), "--burst",
            "--queues", "caption", "--name", "svc1", "--grace", "5", redis_url=redis_url)
    plist = plistlib.loads((home / "Library" / "LaunchAgents" / "vlmq-worker.plist")
                           .read_bytes())
    log = Path(plist["StandardOutPath"])
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", **plist["EnvironmentVariables"]}
    with log.open("w") as out:
        proc = subprocess.run(plist["ProgramArguments"], cwd=plist["WorkingDirectory"],
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, log.read_text()
    assert "finished" in run_cli("wait", job_id, "--timeout", "5", code=0).stdout
    assert (home / ".cache" / "vlmq" / "vision").is_dir(), log.read_text()
