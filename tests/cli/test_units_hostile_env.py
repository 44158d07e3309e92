"""`vlmq service` against a hostile environment: no value given to
it can add a directive to a unit or a command to the env file a plist sources, and no file
it writes goes through a link or file planted at a name it would use."""

from __future__ import annotations

import os
import plistlib
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from tests.cli.test_units import VLMQ, needs_systemd, settings, verify
from tests.support.helpers import invoke_cli
from vlmq.cli import units

SECRET_URL = "redis://:hunter2-secret@db.example:6380/3"
PLAIN_URL = "redis://db.example:6379/0"  # no password: the env file's text is predictable


def service(home: Path, *args: str, redis_url: str = SECRET_URL, code: int | None = 0,
            env_extra: dict[str, str] | None = None, timeout: float = 60,
            ) -> subprocess.CompletedProcess[str]:
    """The real console script with a temporary HOME, a bare environment (this shell's
    AWS_*, SSL_*... would reach the unit) but `env_extra`, and cwd in `home`, so nothing
    lands anywhere else."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env.update(env_extra or {})
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(VLMQ), "--redis-url", redis_url, "service", *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=home)
    if code is not None:
        assert proc.returncode == code, (proc.stdout, proc.stderr)
    return proc


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """For `invoke`: HOME in tmp_path, no XDG/VLMQ/SUDO variables, and the --system folders
    moved under tmp_path (this suite may run as root: nothing may touch /etc)."""
    home = tmp_path / "home"
    home.mkdir()
    for key in list(os.environ):
        if key.startswith(("XDG_", "VLMQ_", "SUDO_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(units, "SYSTEM_UNIT_DIR", tmp_path / "etc-systemd")
    monkeypatch.setattr(units, "SYSTEM_ENV_DIR", tmp_path / "etc-vlmq")
    return home


def invoke(*args: str, redis_url: str = SECRET_URL, code: int = 0) -> Result:
    """`vlmq service ARGS` in this process, so its pid (the old temp name's) is ours."""
    res = invoke_cli(redis_url, "service", *args)
    assert res.exit_code == code, (res.stdout, res.stderr)
    return res


def everything_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# --- values that would add a directive or a command ----------------------------------

BAD_USERS = [
    "nobody\nExecStartPre=+/bin/touch /tmp/x",  # the attack: a second line
    "nobody\rExecStartPre=+/bin/touch /tmp/x",
    "%n",  # a specifier: User= would be the unit's name
    "a%%b", "root ", " root", "ali ce", "x;y", "a\\", "-rf", "1abc", "", "a" * 33,
    "al:ice", "al/ice", "ali\x01ce",
]


@pytest.mark.parametrize("user", BAD_USERS)
def test_run_as_is_refused_unless_it_is_a_user_name(tmp_path: Path, user: str) -> None:
    proc = service(tmp_path, "print", "systemd", "--system", "--run-as", user, "--",
                   "--model", "m/x", code=2)
    assert "--run-as" in proc.stderr and proc.stdout == ""
    assert "ExecStartPre" not in proc.stdout


def test_run_as_newline_on_install_writes_nothing(in_process: Path, tmp_path: Path) -> None:
    before = everything_under(tmp_path)
    res = invoke("install", "systemd", "--system", "--run-as",
                 "nobody\nExecStartPre=+/bin/touch /tmp/x", "--", "--model", "m/x", code=2)
    assert "--run-as" in res.stderr
    assert everything_under(tmp_path) == before


def test_the_default_user_from_sudo_is_checked_too(tmp_path: Path) -> None:
    proc = service(tmp_path, "print", "systemd", "--system", "--", "--model", "m/x", code=2,
                   env_extra={"SUDO_USER": "bob\nExecStartPre=/bin/true"})
    assert "SUDO_USER" in proc.stderr and proc.stdout == ""


@needs_systemd
@pytest.mark.parametrize("user", ["alice", "_svc", "build-bot2", "Build", "a" * 32])
def test_a_user_name_passes_and_verifies(tmp_path: Path, user: str) -> None:
    text = service(tmp_path, "print", "systemd", "--system", "--run-as", user, "--",
                   "--model", "m/x").stdout
    assert settings(text)["User"] == [user]
    verify(text, tmp_path, user=False)


HOSTILE_NAMES = [
    "VLMQ_A;touch {p};",  # the attack: sh runs it when the plist sources the env file
    "VLMQ_A\nExecStartPre",  # a second unit line: ExecStartPre=/bin/touch ...
    "VLMQ_A $(touch {p})", "VLMQ_A`touch {p}`", "VLMQ_\u00e9", "VLMQ_A-B",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize(("verb", "kind"), [("install", "launchd"), ("install", "systemd"),
                                            ("print", "systemd"), ("print", "launchd")])
def test_an_environment_name_that_is_not_a_name_is_refused(tmp_path: Path, name: str,
                                                            verb: str, kind: str) -> None:
    """This shell's VLMQ_* variables go into the unit; one whose name is not a shell/systemd
    variable name is refused, by name, before anything is written or run."""
    marker = tmp_path / "pwned"
    home = tmp_path / "home"
    hostile = name.format(p=marker)
    proc = service(home, verb, kind, "--", "--model", "m/x", code=2,
                   env_extra={hostile: f"/bin/touch {marker}"})
    assert repr(hostile) in proc.stderr and "VLMQ_" in proc.stderr
    assert proc.stdout == "" and not marker.exists()
    assert everything_under(home) == set()


@pytest.mark.parametrize("kind", ["launchd", "systemd"])
@pytest.mark.parametrize(("where", "extra", "args", "needle"), [
    ("env value", {"VLMQ_NOTE": "a\nExecStartPre=/bin/true"}, [], "VLMQ_NOTE"),
    ("env value", {"VLMQ_NOTE": "a\x01b"}, [], "VLMQ_NOTE"),
    ("env value", {"VLMQ_NOTE": "a\x7fb"}, [], "VLMQ_NOTE"),
    ("--env value", {}, ["--env", "NOTE=a\rb"], "NOTE"),
    ("worker arg", {}, ["--", "--model", "m/x\nExecStartPre=/bin/true"], "worker argument"),
    ("worker arg", {}, ["--", "--model", "m/x", "--name", "w\tx"], "worker argument"),
    ("cache path", {"VLMQ_CACHE": "/srv/c\nExecStartPre=/bin/true"}, [], "VLMQ_CACHE"),
])
def test_a_control_character_anywhere_is_refused(tmp_path: Path, kind: str, where: str,
                                                 extra: dict[str, str], args: list[str],
                                                 needle: str) -> None:
    """Newlines would start a unit line; the rest plistlib cannot write (a traceback)."""
    if "--" not in args:
        args = [*args, "--", "--model", "m/x"]
    proc = service(tmp_path, "print", kind, *args, code=2, env_extra=extra)
    assert needle in proc.stderr and "control character" in proc.stderr, where
    assert proc.stdout == "" and "Traceback" not in proc.stderr


@pytest.mark.parametrize("cache", ["/srv/cache\\", "/srv/ca\\che", "/srv/cache "])
def test_a_systemd_path_it_would_misread_is_refused(tmp_path: Path, cache: str) -> None:
    """A trailing backslash joins the next line to WorkingDirectory= (verify says nothing);
    systemd strips the spaces around a value."""
    proc = service(tmp_path, "print", "systemd", "--", "--model", "m/x", code=2,
                   env_extra={"VLMQ_CACHE": cache})
    assert "VLMQ_CACHE" in proc.stderr and proc.stdout == ""


HOSTILE_VALUE = "$(touch {p}) `touch {p}` ;touch {p}; $HOME ${{X}} %h %% \\ \" <&> ]]> end"


def test_env_file_values_are_read_back_literally_and_run_nothing(tmp_path: Path) -> None:
    """The plist's own loader (sh, `. FILE` for the secrets, launchd's EnvironmentVariables
    for the rest) gets every value as written, and runs none."""
    marker = tmp_path / "pwned"
    home = tmp_path / "home"
    value = HOSTILE_VALUE.format(p=marker)
    service(home, "install", "launchd", "--env", f"NOTE_TOKEN={value}", "--", "--model",
            "m/x", env_extra={"VLMQ_EXTRA": value})
    plist = plistlib.loads((home / "Library" / "LaunchAgents" / "vlmq-worker.plist")
                           .read_bytes())
    program = plist["ProgramArguments"]
    assert program[:2] == ["/bin/sh", "-c"] and Path(program[3]).samefile(VLMQ)
    assert "NOTE_TOKEN" not in plist["EnvironmentVariables"]  # a secret: the file's
    # The loader with `env -0` in the worker's place: the environment the worker would get.
    out = subprocess.run([*program[:3], "/usr/bin/env", "-0"],
                         env=plist["EnvironmentVariables"],
                         capture_output=True, check=True, timeout=30).stdout.decode()
    got = dict(line.split("=", 1) for line in out.split("\0") if line)
    assert (got["NOTE_TOKEN"], got["VLMQ_EXTRA"], got["REDIS_URL"]) == (value, value,
                                                                        SECRET_URL)
    assert not marker.exists()


@needs_systemd
def test_systemd_inline_values_are_escaped_and_verify(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    value = HOSTILE_VALUE.format(p=marker)
    cache = str(tmp_path / "c 100%n $HOME")
    text = service(tmp_path, "print", "systemd", "--env", f"NOTE={value}", "--",
                   "--model", "m/x", "--name", value,
                   env_extra={"VLMQ_CACHE": cache}).stdout
    verify(text, tmp_path, user=True)
    unit = settings(text)
    assert unit["WorkingDirectory"] == [cache.replace("%", "%%")]
    assert f'"NOTE={value}"' not in text  # quoted and escaped, never raw
    words = shlex.split(unit["ExecStart"][0].replace("%%", "%"))
    assert [w.replace("$$", "$") for w in words][-1] == value
    assert not any(line.startswith("ExecStartPre") for line in text.splitlines())


def test_plist_program_arguments_round_trip(tmp_path: Path) -> None:
    """plistlib escapes XML; each worker argument stays one argv entry, as given."""
    odd = "<key>x</key>]]>&amp; 'q' \"d\" $(id) ;"
    args = ["--model", f"/models/{odd}", "--name", odd, "--queues", "ocr"]
    proc = service(tmp_path, "print", "launchd", "--env", f"NOTE={odd}", "--", *args)
    plist = plistlib.loads(proc.stdout.encode())
    assert plist["ProgramArguments"][4:] == ["worker", *args]
    assert plist["EnvironmentVariables"]["NOTE"] == odd


# --- names planted in the folders it writes to ---------------------------------------


@pytest.mark.parametrize("target_exists", [False, True])
def test_a_symlink_at_the_old_temp_name_receives_nothing(in_process: Path, tmp_path: Path,
                                                          target_exists: bool) -> None:
    """The old code opened `.NAME.PID.tmp` with O_CREAT|O_TRUNC and followed a link there."""
    conf = tmp_path / "conf"
    conf.mkdir()
    unit_dir = in_process / ".config" / "systemd" / "user"
    unit_dir.mkdir(parents=True)
    loot = tmp_path / "attacker"
    loot.mkdir()
    planted = {conf / f".w.env.{os.getpid()}.tmp": loot / "env",
               unit_dir / f".vlmq-worker.service.{os.getpid()}.tmp": loot / "unit"}
    for link, target in planted.items():
        if target_exists:
            target.write_bytes(b"")
            target.chmod(0o666)
        link.symlink_to(target)
    invoke("install", "systemd", "--env-file", str(conf / "w.env"), "--", "--model", "m/x")
    for link, target in planted.items():
        assert link.is_symlink(), link
        if target_exists:
            assert target.read_bytes() == b"", target
        else:
            assert not target.exists(), target
    env_file = conf / "w.env"
    assert not env_file.is_symlink() and stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert SECRET_URL in env_file.read_text()
    assert stat.S_IMODE((unit_dir / "vlmq-worker.service").stat().st_mode) == 0o644
    # Nothing else was left in either folder: the temp files were renamed into place.
    for folder, name in ((conf, "w.env"), (unit_dir, "vlmq-worker.service")):
        links = {link.name for link in planted if link.parent == folder}
        assert {p.name for p in folder.iterdir()} == {name, *links}


def test_temp_files_are_created_exclusively(in_process: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file is first made with O_CREAT|O_EXCL and O_NOFOLLOW (or mkstemp, which does),
    mode 0600, in the target's own folder."""
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *a: Any, **k: Any) -> int:
        if flags & os.O_CREAT:
            opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    invoke("install", "systemd", "--env-file", str(tmp_path / "conf" / "w.env"), "--",
           "--model", "m/x")
    monkeypatch.undo()
    assert len(opened) == 2, opened
    for path, flags, mode in opened:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW, path
        assert mode == 0o600 and not Path(path).exists()


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_link_or_fifo_at_the_final_name_is_never_written_through(tmp_path: Path,
                                                                   kind: str) -> None:
    """With no password the env file's text is predictable: the old code saw a link to an
    identical file as `unchanged`, chmodded the target and left the unit reading a file the
    attacker can edit (and the plist sources). A FIFO there hung it."""
    home = tmp_path / "home"
    env_path = home / ".config" / "vlmq" / "vlmq-worker.env"
    args = ["install", "launchd", "--model", "m/x"]  # after "--": the worker's
    service(home, *args[:2], "--", *args[2:], redis_url=PLAIN_URL)
    expected = env_path.read_bytes()
    env_path.unlink()
    decoy = tmp_path / "attacker.env"
    decoy.write_bytes(expected)
    decoy.chmod(0o666)
    if kind == "link":
        env_path.symlink_to(decoy)
    else:
        os.mkfifo(env_path)
    refused = service(home, *args[:2], "--", *args[2:], redis_url=PLAIN_URL, code=2,
                      timeout=20)
    assert str(env_path) in refused.stderr and "--force" in refused.stderr
    service(home, *args[:2], "--force", "--", *args[2:], redis_url=PLAIN_URL, timeout=20)
    assert stat.S_ISREG(env_path.lstat().st_mode)
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    assert env_path.read_bytes() == expected
    assert decoy.read_bytes() == expected and stat.S_IMODE(decoy.stat().st_mode) == 0o666


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="chown to another user needs root")
def test_a_symlinked_cache_dir_is_not_chowned(in_process: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As root, install hands the cache folder to --run-as; a link planted at that name must
    not hand over what it points at."""
    victim = tmp_path / "victim"
    victim.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(victim)
    monkeypatch.setenv("VLMQ_CACHE", str(link))
    res = invoke("install", "systemd", "--system", "--run-as", "nobody", "--env-file",
                 str(tmp_path / "w.env"), "--", "--model", "m/x", code=2)
    assert str(link) in res.stderr and "link" in res.stderr
    assert victim.stat().st_uid == 0

