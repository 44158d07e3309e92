"""`vlmq service print|install launchd|systemd -- WORKER ARGS…`: a unit that keeps a worker up.

A worker is a long-lived process; the people who run it want their init system to restart
it on a crash and to give it --grace seconds to finish in-flight items on stop. The unit
runs this install's own `vlmq` (an absolute path: launchd and systemd have no useful PATH).

Environment: the unit carries what the worker and its libraries read from this shell
(CARRY_PREFIXES, CARRY_NAMES: VLMQ_*, AWS_*, HF_*, the thread counts, proxies and CA
bundles), so an S3 or offline worker runs under the init system as it runs here; a set
variable left out that looks relevant (LOOKS_RELEVANT) is named on stderr.

Secrets: a Redis URL may hold a password, AWS_SECRET_ACCESS_KEY and HF_TOKEN are secrets,
and units are world-readable. Whenever there is an env file (always for `install`, with
--env-file for `print`), the secrets go there only, mode 0600, and the unit reads it:
systemd's EnvironmentFile=; launchd has none, so the plist's /bin/sh wrapper sources it
(the arguments are passed as argv, never re-quoted into the script). The rest of the
environment is in the unit, where `systemctl cat` shows it. Without an env file `print`
shows secrets as *** and says so.

Restarts: a worker that exits 78 (EX_CONFIG: a missing model, a bad --blas...) or 2 (a
usage error) fails the same way every time, so neither is restarted: systemd's
RestartPreventExitStatus=; launchd's KeepAlive cannot tell exit codes apart, so the plist
runs the worker under a /bin/sh wrapper that passes SIGTERM/SIGINT on and turns those two
codes into a logged exit 0, which KeepAlive's SuccessfulExit=false leaves stopped. Redis
out of reach (69) and other failures are restarted after RESTART_S.

Trust: whatever reaches a unit comes from a command line or a shell's environment that may
be hostile. A value that could end a line or name another setting is refused,
naming where it came from: control characters anywhere; a --run-as that is not a user
name; a VLMQ_* variable whose name is not a variable name (sh would run the env file's
`;cmd;`). What remains is quoted for its reader: systemd's rules (% doubled, quotes and
$ in ExecStart=), plistlib's XML, sh single quotes. Files are made with mkstemp
(O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) in the target's folder and renamed into place; a
link, FIFO or other non-file at a final name is never opened through, only replaced with
--force.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import math
import os
import plistlib
import pwd
import re
import shlex
import shutil
import stat
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from vlmq.cli import config, worker
from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_CONFIG, fail
from vlmq.shared import constants as C
from vlmq.shared.urls import MASK, redact_url
from vlmq.worker import options
from vlmq.worker.model.default_dirs import default_cache_dir

# Seconds past --grace before the init system sends SIGKILL: after the grace the worker
# still requeues what is left and closes MLX and its render processes.
STOP_MARGIN_S = 30
RESTART_S = 10
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A user name as useradd(8) and systemd's User= read it: nothing a unit line could hide
# (no space, %, \\, :, /); the final $ is Samba's machine accounts.
USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*[$]?")
USER_MAX = 32
# Unicode categories that end a line for some reader or cannot be written: C0/C1 controls
# (newline, NUL...), line/paragraph separators, and lone surrogates (bytes not UTF-8).
_BAD_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
# One env file line: a name, and a value sh's single quotes keep literally.
_ENV_LINE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*='[^'\x00-\x1f\x7f]*'")
# Keys whose values are secrets whatever they look like (S3 keys, tokens for a hub).
SECRET_KEY_RE = re.compile(r"(?i)pass|secret|token|credential|api_?key|access_key|private")
_SYSTEMD_SAFE = re.compile(r"[A-Za-z0-9_./:=,+@-]+")
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
SYSTEM_ENV_DIR = Path("/etc/vlmq")
SYSTEM_CACHE = "vlmq"  # CacheDirectory=: /var/cache/vlmq, made and owned for User=
# Exit codes that mean "the same again on a restart": a usage error, a configuration one.
NO_RESTART = (EXIT_BAD_INPUT, EXIT_CONFIG)
# launchd: unset ProcessType (= Standard) gets "light resource limits", throttling CPU and
# I/O; Background more. A worker is the machine's batch compute: Interactive has no limits.
PROCESS_TYPE = "Interactive"

# This shell's variables the unit carries: vlmq's own, the S3 client's (boto3: AWS_*), the
# hub's and transformers', the BLAS/OpenMP/MLX thread and device settings, and the proxies
# and CA bundles that downloads and S3 go through.
CARRY_PREFIXES = ("VLMQ_", "AWS_", "HF_", "HUGGINGFACE_", "HUGGING_FACE_", "TRANSFORMERS_",
                  "TOKENIZERS_", "MLX_", "OPENBLAS_", "OMP_", "MKL_", "VECLIB_")
CARRY_NAMES = frozenset({
    "CUDA_VISIBLE_DEVICES", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "ALL_PROXY",
    "https_proxy", "http_proxy", "no_proxy", "all_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"})
# Left out but likely to matter: named on stderr (--env KEY=VALUE keeps one). Library
# paths and PYTHONPATH belong to this shell's session, not to a service; without
# XDG_CACHE_HOME the hub's cache is ~/.cache/huggingface unless HF_HOME says otherwise.
LOOKS_RELEVANT = re.compile(
    r"PYTHONPATH|PYTHONHOME|LD_LIBRARY_PATH|LD_PRELOAD|DYLD_.*|XDG_CACHE_HOME"
    r"|.*(REDIS|HUGGING|BOTO|S3|MINIO|TORCH|CUDA|METAL).*")


@dataclass
class Spec:
    """One unit: what runs, as whom, with which environment, where."""

    kind: str  # launchd | systemd
    name: str
    system: bool
    program: list[str]  # [absolute vlmq, "worker", *args]
    env: dict[str, str]
    grace: float
    cache_dir: Path
    env_file: Path | None = None
    run_as: str | None = None
    system_cache: bool = False  # systemd makes cache_dir (CacheDirectory=)
    redacted: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # set here, relevant, not carried

    @property
    def stop_timeout(self) -> int:
        return math.ceil(self.grace) + STOP_MARGIN_S

    @property
    def label(self) -> str:
        return self.name

    @property
    def log_path(self) -> Path:
        return Path.home() / "Library" / "Logs" / "vlmq" / f"{self.name}.log"

    def unit_path(self) -> Path:
        if self.kind == "launchd":
            return Path.home() / "Library" / "LaunchAgents" / f"{self.label}.plist"
        if self.system:
            return SYSTEM_UNIT_DIR / f"{self.name}.service"
        return _config_home() / "systemd" / "user" / f"{self.name}.service"


def _config_home() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return Path(xdg) if xdg else Path.home() / ".config"


def default_env_file(name: str, system: bool) -> Path:
    return (SYSTEM_ENV_DIR if system else _config_home() / "vlmq") / f"{name}.env"


def vlmq_executable() -> str:
    """This install's `vlmq`: beside the running interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "vlmq"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("vlmq")
    if found is None:
        raise click.ClickException(
            f"cannot find the vlmq executable (not beside {sys.executable}, not on PATH)")
    return os.path.abspath(found)


def is_secret(key: str, value: str) -> bool:
    return bool(SECRET_KEY_RE.search(key)) or redact_url(value) != value


# --- systemd -----------------------------------------------------------------------------

def _check_text(text: str, what: str) -> None:
    """Refuse what would start a new unit line (systemd reads one setting a line) or what
    plistlib cannot write, naming the field: nothing else may end a value early."""
    if any(unicodedata.category(c) in _BAD_CATEGORIES for c in text):
        raise click.UsageError(f"{what} {text!r} holds a control character (a newline?) "
                               "or a byte that is not UTF-8; a unit cannot keep it")


def check_user(user: str, what: str) -> str:
    """A user name and nothing more: User= takes the rest of its line, % specifiers
    included, so a newline or a % there would be another setting or another user."""
    if len(user) > USER_MAX or not USER_RE.fullmatch(user):
        raise click.UsageError(
            f"{what} {user!r} is not a user name (a letter or _, then letters, digits, _ "
            f"or -, an optional final $; at most {USER_MAX})")
    return user


def check_env_key(key: str, what: str) -> None:
    """A variable name for sh and systemd alike: a `;` or a newline in one would be a
    command in the env file the plist sources, or another line of the unit."""
    if not ENV_KEY_RE.fullmatch(key):
        raise click.UsageError(f"{what} {key!r} is not a variable name (letters, digits "
                               "and _, not first a digit)")


def _check_systemd_path(path: Path, what: str) -> None:
    """systemd takes a path setting as the rest of the line: a trailing \\ would join the
    next line to it and spaces around it are stripped, so both are refused."""
    text = str(path)
    _check_text(text, what)
    if "\\" in text or text != text.strip():
        raise click.UsageError(f"{what} {text!r} holds a backslash or begins or ends with "
                               "a space, which systemd would read differently")


def systemd_word(arg: str, *, first: bool = False) -> str:
    """One ExecStart= word that systemd reads back as `arg`: double quotes with \\ and \"
    escaped, % doubled (specifiers), and $ doubled (variable expansion; not in the path)."""
    _check_text(arg, "argument")
    if _SYSTEMD_SAFE.fullmatch(arg) and arg != ";":
        return arg
    if first and any(c in arg for c in "$'\"\\"):
        # systemd refuses quotes and backslashes in an executable's name, and expands $.
        raise click.ClickException(f"systemd cannot run a vlmq path with $ ' \" or \\: "
                                   f"{arg!r}")
    text = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{text if first else text.replace("$", "$$")}"'


def systemd_path(path: Path | str) -> str:
    """A path setting (WorkingDirectory=, EnvironmentFile=): the whole value, % doubled."""
    _check_systemd_path(Path(path), "path")
    return str(path).replace("%", "%%")


def render_systemd(spec: Spec, env: dict[str, str]) -> str:
    lines = ["[Unit]", f"Description=vlmq worker {spec.name}"]
    if spec.system:
        # A user manager cannot see the system's network-online.target; a user unit
        # relies on Restart= until Redis answers.
        lines += ["Wants=network-online.target", "After=network-online.target"]
    exec_start = " ".join([systemd_word(spec.program[0], first=True),
                           *(systemd_word(a) for a in spec.program[1:])])
    lines += ["", "[Service]", f"ExecStart={exec_start}"]
    if spec.run_as:
        lines.append(f"User={check_user(spec.run_as, 'User=')}")
    if spec.system_cache:
        lines.append(f"CacheDirectory={SYSTEM_CACHE}")
    lines.append(f"WorkingDirectory={systemd_path(spec.cache_dir)}")
    if spec.env_file is not None:
        lines.append(f"EnvironmentFile={systemd_path(spec.env_file)}")
    for key, value in env.items():
        check_env_key(key, "Environment=")
        _check_text(value, f"the value of {key}")
        quoted = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        lines.append(f'Environment="{key}={quoted}"')
    lines += [
        "Restart=on-failure", f"RestartSec={RESTART_S}",
        # A configuration or usage error fails the same way on every restart.
        f"RestartPreventExitStatus={' '.join(map(str, NO_RESTART))}",
        "KillSignal=SIGTERM",
        # SIGTERM to the worker alone: it stops its own PDF render processes; at the
        # timeout every process of the unit gets SIGKILL.
        "KillMode=mixed",
        f"TimeoutStopSec={spec.stop_timeout}",
        f"SyslogIdentifier={spec.name}",
        "", "[Install]", f"WantedBy={'multi-user.target' if spec.system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


# --- launchd -----------------------------------------------------------------------------

def launchd_script(env_file: Path | None, label: str) -> str:
    """The plist's sh wrapper: source the env file, run the worker ("$0" "$@": argv, never
    re-quoted), pass launchd's SIGTERM (and SIGINT) on so the worker drains within
    --grace, wait until it has exited, and turn NO_RESTART's codes into a logged exit 0:
    KeepAlive {SuccessfulExit: false} restarts any other non-zero exit."""
    codes = "|".join(map(str, NO_RESTART))
    lines = [f"set -a && . {shlex.quote(str(env_file))} && set +a"] if env_file else []
    lines += [
        # Trapped first, so no signal falls between the start and the traps; a command
        # started by sh gets the default handlers back.
        "pid=",
        "trap 'kill -TERM $pid' TERM",
        "trap 'kill -INT $pid' INT",
        '"$0" "$@" & pid=$!',
        "wait $pid; rc=$?",
        # A trapped signal ends `wait` early (rc > 128): wait on until the worker is gone.
        "while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done",
        f"case $rc in {codes}) echo \"vlmq service: the worker exited $rc (a configuration "
        "or usage error, above): not restarting; fix it, then launchctl kickstart "
        f"gui/$(id -u)/{label}\" >&2; exit 0;; esac",
        "exit $rc",
    ]
    return "\n".join(lines)


def program_arguments(spec: Spec) -> list[str]:
    return ["/bin/sh", "-c", launchd_script(spec.env_file, spec.label), *spec.program]


def render_launchd(spec: Spec, env: dict[str, str]) -> bytes:
    plist: dict[str, Any] = {
        "Label": spec.label,
        "ProgramArguments": program_arguments(spec),
        "RunAtLoad": True,
        # Restart on a crash (non-zero exit or a signal), not after a clean exit: the
        # worker exits 0 once it drained on SIGTERM, or when a --burst run is done.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_S,
        "ProcessType": PROCESS_TYPE,
        "ExitTimeOut": spec.stop_timeout,
        "WorkingDirectory": str(spec.cache_dir),
        "StandardOutPath": str(spec.log_path),
        "StandardErrorPath": str(spec.log_path),
    }
    if env:
        plist["EnvironmentVariables"] = env
    return plistlib.dumps(plist, sort_keys=False)


# --- building and writing ------------------------------------------------------------------

def env_file_text(env: dict[str, str]) -> str:
    """KEY='value' lines: one meaning for POSIX sh (`.`) and systemd's EnvironmentFile=."""
    lines = ["# Written by `vlmq service`; mode 0600: the worker's secrets (a Redis password,",
             "# AWS_SECRET_ACCESS_KEY, HF_TOKEN...). The unit holds the rest."]
    for key, value in env.items():
        check_env_key(key, "environment variable")
        _check_text(value, f"the value of {key}")
        if "'" in value:
            raise click.UsageError(
                f"the value of {key} holds a single quote, which the environment file "
                "cannot keep (in a URL, write it as %27)")
        line = f"{key}='{value}'"
        # The plist's sh sources this file: every line must be an assignment, nothing else.
        if not _ENV_LINE_RE.fullmatch(line):
            raise click.UsageError(f"the environment file cannot keep {key}={value!r}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _parse_env(values: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not ENV_KEY_RE.fullmatch(key):
            raise click.BadParameter(f"{raw!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    return env


def _worker_params(ctx: click.Context, args: Sequence[str]) -> tuple[dict[str, Any],
                                                                      list[str]]:
    """(the option values, the names given on the command line in their order). The
    worker's own parser and the table's conversions check the arguments now, not in a
    restart loop later, with this shell's environment and config file as the unit's
    worker will see them."""
    root = ctx.find_root()
    try:
        with worker.worker_cmd.make_context(
                "vlmq worker", list(args),
                default_map=(root.default_map or {}).get("worker"),
                auto_envvar_prefix=f"{root.auto_envvar_prefix}_WORKER"
                if root.auto_envvar_prefix else None) as wctx:
            params = dict(wctx.params)  # in the order given, then the rest
            given = [name for name in params
                     if wctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
        worker.config_values(params)
    except click.ClickException as exc:
        raise click.UsageError(f"worker arguments: {exc.format_message()}") from exc
    return params, given


def build_spec(ctx: click.Context, kind: str, name: str, system: bool, env_opts: Sequence[str],
               env_file: Path | None, run_as: str | None, worker_args: Sequence[str]) -> Spec:
    _check_unit_options(kind, name, system, run_as)
    params, given = _worker_params(ctx, worker_args)
    _check_absolute_paths(params)
    env, left_out = _service_env(ctx, env_opts)
    cache_dir, system_cache = _cache_dir(env, system)
    env["VLMQ_CACHE"] = str(cache_dir)  # the worker's default would follow $HOME/XDG
    if system and run_as is None:
        run_as = _default_user()
    spec = Spec(kind=kind, name=name, system=system,
                program=[vlmq_executable(), *_config_args(ctx), "worker",
                         *options.unit_args(params, given)], env=env,
                grace=float(params["grace"]), cache_dir=cache_dir, env_file=env_file,
                run_as=run_as, system_cache=system_cache, left_out=left_out)
    _check_spec(spec)
    return spec


def _config_args(ctx: click.Context) -> list[str]:
    """`--config FILE` when this command read one: the unit's worker reads the same file,
    so a change to it takes effect at the next restart."""
    path = ctx.find_root().meta.get(config.CONFIG_META)
    return [] if path is None else ["--config", str(Path(path).absolute())]


def _default_user() -> str:
    """--system's User= when --run-as is not given: who ran sudo, else this user; checked
    like --run-as, since $SUDO_USER is only an environment variable."""
    sudo = os.environ.get("SUDO_USER")
    if sudo:
        return check_user(sudo, "$SUDO_USER")
    return check_user(getpass.getuser(), "your user name")


def _check_spec(spec: Spec) -> None:
    """Every value bound for the unit or the env file, checked before anything is written:
    one clear refusal naming the field, not a unit that means something else."""
    _check_text(spec.program[0], "the vlmq path")
    for arg in spec.program[1:]:
        _check_text(arg, "worker argument")
    for key, value in spec.env.items():
        check_env_key(key, "environment variable")
        _check_text(value, f"the value of {key}")
    cache_what = "the working directory (the cache home: VLMQ_CACHE)"
    paths = [(spec.cache_dir, cache_what), (spec.unit_path(), "the unit's path")]
    if spec.env_file is not None:
        paths.append((spec.env_file, "--env-file"))
    if spec.kind == "launchd":
        paths.append((spec.log_path, "the log path"))
    for path, what in paths:
        _check_text(str(path), what)
    if spec.kind == "systemd":
        _check_systemd_path(spec.cache_dir, cache_what)
        if spec.env_file is not None:
            _check_systemd_path(spec.env_file, "--env-file")


def _check_unit_options(kind: str, name: str, system: bool, run_as: str | None) -> None:
    """Refuse a unit name or a combination the init system cannot run."""
    if not NAME_RE.fullmatch(name):
        raise click.BadParameter(f"{name!r}: letters, digits, _ . - (at most 100)",
                                 param_hint="--name")
    if kind == "launchd" and system:
        raise click.UsageError("launchd: only a LaunchAgent (it runs as you); drop --system")
    if run_as is not None and not system:
        raise click.UsageError("--run-as goes with --system")
    if run_as is not None:
        check_user(run_as, "--run-as")


def _relative(row: options.WorkerOption, value: Any) -> bool:
    if value is None:
        return False
    path = Path(value)
    return not path.is_absolute() and (row.local_path == options.PATH or path.exists())


def _check_absolute_paths(params: dict[str, Any]) -> None:
    """The service runs in its cache directory, so a relative local path would name another
    file there."""
    rows = options.local_paths()
    if any(_relative(row, params[row.name]) for row in rows):
        flags = " and ".join(row.cli_flag for row in rows)
        raise click.UsageError(f"worker arguments: give {flags} as absolute paths; the "
                               "service runs in its cache directory")


def carried(key: str) -> bool:
    """Whether the unit carries this shell's variable `key` (CARRY_PREFIXES, CARRY_NAMES)."""
    return key.startswith(CARRY_PREFIXES) or key in CARRY_NAMES


def _service_env(ctx: click.Context, env_opts: Sequence[str]) -> tuple[dict[str, str],
                                                                       list[str]]:
    """(the environment of the worker `vlmq worker` would run here, the relevant-looking
    variables of this shell left out): this root's Redis URL, this shell's carried
    variables, then --env, which has the last word."""
    root_ctx = ctx.find_root()
    root = root_ctx.obj or {}
    # A URL from the config file stays there: the unit reads the same file, and a
    # variable would outrank later edits of it.
    from_file = root_ctx.get_parameter_source("redis_url") is ParameterSource.DEFAULT_MAP
    env = {} if from_file else {"REDIS_URL": str(root.get("redis_url")
                                                 or C.DEFAULT_REDIS_URL)}
    left_out = []
    for key, value in sorted(os.environ.items()):
        if carried(key):
            check_env_key(key, "this shell's environment variable")
            env[key] = value
        elif key != "REDIS_URL" and LOOKS_RELEVANT.fullmatch(key):
            left_out.append(key)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the log file as they happen
    given = _parse_env(env_opts)
    env.update(given)
    return env, [key for key in left_out if key not in given]


def _cache_dir(env: dict[str, str], system: bool) -> tuple[Path, bool]:
    """(the service's cache and working directory, whether systemd makes it): VLMQ_CACHE
    when set, else systemd's CacheDirectory= for a system unit, else the user's default."""
    if system and "VLMQ_CACHE" not in env:
        return Path("/var/cache") / SYSTEM_CACHE, True
    if "VLMQ_CACHE" in env:
        return Path(env["VLMQ_CACHE"]).expanduser().absolute(), False
    return default_cache_dir().absolute(), False


def secrets(env: dict[str, str]) -> dict[str, str]:
    """The variables whose values are secrets: what the env file holds."""
    return {key: value for key, value in env.items() if is_secret(key, value)}


def render(spec: Spec) -> bytes:
    """The unit's bytes: the environment inline but for its secrets, which are in the env
    file, or shown masked when there is none."""
    inline: dict[str, str] = {}
    hidden = secrets(spec.env)
    for key, value in spec.env.items():
        if key in hidden:
            if spec.env_file is not None:
                continue
            spec.redacted.append(key)
            value = MASK if SECRET_KEY_RE.search(key) else redact_url(value)
        inline[key] = value
    if spec.kind == "launchd":
        return render_launchd(spec, inline)
    return render_systemd(spec, inline).encode()


@dataclass
class Planned:
    path: Path
    data: bytes
    mode: int
    existed: bool = False


class NotAFile(Exception):
    """A link, FIFO, folder or device sits where a unit or env file goes."""


def _open_regular(path: Path) -> int | None:
    """A read-only fd on the regular file at `path`, or None when nothing is there. Never
    through a link (O_NOFOLLOW: a planted one would point at the attacker's file) and
    never blocking (O_NONBLOCK: a planted FIFO would hang `install`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise NotAFile("a symbolic link") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAFile("not a regular file")
    return fd


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_regular(path: Path) -> bytes | None:
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def plan(path: Path, data: bytes, mode: int, force: bool) -> Planned:
    """Refuse, before anything is written, to replace a different file without --force."""
    try:
        old = _read_regular(path)
    except NotAFile as exc:
        if not force:
            fail(f"error: {path} is {exc}; --force replaces it (the link or file itself; "
                 "nothing is written through it)", EXIT_BAD_INPUT)
        return Planned(path, data, mode, existed=True)
    except OSError as exc:
        fail(f"error: cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    if old is None:
        return Planned(path, data, mode)
    if old != data and not force:
        fail(f"error: {path} exists and differs from what this would write; --force "
             "replaces it", EXIT_BAD_INPUT)
    return Planned(path, data, mode, existed=True)


def _unchanged(item: Planned) -> bool:
    """The file there is ours, regular and already these bytes: then only its mode is set
    (on the fd, so never on what a link swapped in meanwhile points at)."""
    try:
        fd = _open_regular(item.path)
    except NotAFile:
        return False
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid() or _read_fd(fd) != item.data:
            return False
        os.fchmod(fd, item.mode)
        return True
    finally:
        os.close(fd)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """A new file made exclusively in the target's folder (mkstemp: O_CREAT|O_EXCL|
    O_NOFOLLOW, mode 0600, an unguessable name), its mode set before any byte lands, then
    renamed over `path`, which replaces a link there rather than following it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write(item: Planned) -> str:
    """Atomic write with the mode set before any byte lands; 'wrote' or 'unchanged'."""
    path = item.path
    try:
        if item.existed and _unchanged(item):
            return "unchanged"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if item.mode == 0o600
                          else 0o755)
        _replace(path, item.data, item.mode)
    except OSError as exc:
        fail(f"error: cannot write {path}: {exc.strerror}", EXIT_BAD_INPUT)
    return "replaced" if item.existed else "wrote"


def load_commands(spec: Spec) -> list[str]:
    unit = spec.unit_path()
    if spec.kind == "launchd":
        domain = "gui/$(id -u)"
        return [f"launchctl bootout {domain}/{spec.label} 2>/dev/null; "
                f"launchctl bootstrap {domain} {shlex.quote(str(unit))}",
                f"tail -f {shlex.quote(str(spec.log_path))}"]
    ctl = "systemctl" if spec.system else "systemctl --user"
    jctl = "journalctl" if spec.system else "journalctl --user"
    out = [f"{ctl} daemon-reload && {ctl} enable --now {spec.name}.service",
           f"{ctl} restart {spec.name}.service   # if it was already running",
           f"{jctl} -u {spec.name}.service -f"]
    if not spec.system:
        out.append("loginctl enable-linger \"$USER\"   # keep it running after you log out")
    return out


def _env_files(spec: Spec, force: bool) -> list[Planned]:
    if spec.env_file is None:
        return []
    return [plan(spec.env_file, env_file_text(secrets(spec.env)).encode(), 0o600, force)]


# --- commands ------------------------------------------------------------------------------

def _options(func: Callable[..., Any]) -> Callable[..., Any]:
    for deco in reversed([
        click.argument("kind", type=click.Choice(["launchd", "systemd"])),
        click.option("--name", default="vlmq-worker", show_default=True,
                     help="Unit name (systemd NAME.service; launchd label and NAME.plist)."),
        click.option("--env", "env_opts", multiple=True, metavar="KEY=VAL",
                     help="More environment (repeatable). REDIS_URL (from --redis-url) and "
                          "this shell's VLMQ_*, AWS_*, HF_*, TRANSFORMERS_*, thread, proxy "
                          "and CA-bundle variables are always set."),
        click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path),
                     default=None,
                     help="Keep the secrets of the environment in this file (written "
                          "with mode 0600) and have the unit read it."),
        click.option("--user/--system", "user", default=True,
                     help="systemd: a user unit (default) or a system unit."),
        click.option("--run-as", default=None, metavar="USER",
                     help="--system: the User= it runs as (default: $SUDO_USER, else you)."),
        click.option("--force", is_flag=True, help="Replace a different existing file."),
        click.argument("worker_args", nargs=-1, type=click.UNPROCESSED,
                       metavar="-- WORKER_ARGS..."),
    ]):
        func = deco(func)
    return func


@click.group("service")
def service_group() -> None:
    """launchd and systemd units that keep a worker running and stop it within --grace.

    vlmq service print|install launchd|systemd [OPTIONS] -- WORKER ARGS…
    """


@service_group.command("print")
@_options
@click.pass_context
def print_cmd(ctx: click.Context, kind: str, name: str, env_opts: tuple[str, ...],
              env_file: Path | None, user: bool, run_as: str | None, force: bool,
              worker_args: tuple[str, ...]) -> None:
    """Print the unit for `vlmq worker WORKER ARGS…` (put the worker's arguments after --).

    Secrets are shown as *** unless --env-file is given: that file is then written (mode
    0600) with them, and the unit reads it.
    """
    spec = build_spec(ctx, kind, name, not user, env_opts,
                      env_file.absolute() if env_file else None, run_as, worker_args)
    data = render(spec)
    for item in _env_files(spec, force):
        click.echo(f"vlmq: {write(item)} {item.path} (mode 0600: the secrets of the "
                   "environment)", err=True)
    click.echo(data.decode(), nl=False)
    warn_left_out(spec)
    if spec.redacted:
        click.echo(f"vlmq: {', '.join(spec.redacted)} printed with *** for secrets: give "
                   "--env-file PATH (written with mode 0600) or use `vlmq service install`, "
                   "which keeps them out of the unit", err=True)
    click.echo(f"vlmq: save it as {spec.unit_path()}, then:", err=True)
    dirs = [] if spec.system_cache else [spec.cache_dir]
    dirs += [spec.log_path.parent] if kind == "launchd" else []
    for line in [f"mkdir -p {' '.join(shlex.quote(str(d)) for d in dirs)}"] * bool(dirs) + (
            load_commands(spec)):
        click.echo(f"  {line}", err=True)


@service_group.command("install")
@_options
@click.pass_context
def install_cmd(ctx: click.Context, kind: str, name: str, env_opts: tuple[str, ...],
                env_file: Path | None, user: bool, run_as: str | None, force: bool,
                worker_args: tuple[str, ...]) -> None:
    """Write the unit for `vlmq worker WORKER ARGS…` and its environment file (mode 0600),
    and print the commands that load and start it."""
    system = not user
    chosen = env_file.absolute() if env_file else default_env_file(name, system)
    spec = build_spec(ctx, kind, name, system, env_opts, chosen, run_as, worker_args)
    items = [*_env_files(spec, force), plan(spec.unit_path(), render(spec), 0o644, force)]
    for item in items:
        note = " (mode 0600: the secrets of the environment)" if item.mode == 0o600 else ""
        click.echo(f"{write(item)} {item.path}{note}")
    warn_left_out(spec)
    dirs = [] if spec.system_cache else [spec.cache_dir]
    if kind == "launchd":
        dirs.append(spec.log_path.parent)
    for folder in dirs:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"error: cannot make {folder}: {exc}", EXIT_BAD_INPUT)
        if spec.run_as and spec.run_as != getpass.getuser():
            hand_over(folder, spec.run_as)
    click.echo("load and start it with:")
    for line in load_commands(spec):
        click.echo(f"  {line}")


def warn_left_out(spec: Spec) -> None:
    """Name this shell's variables that look relevant but that the unit does not carry."""
    if spec.left_out:
        click.echo(f"vlmq: warning: not in the unit: {', '.join(spec.left_out)} (set here; "
                   "give --env KEY=VALUE to keep one)", err=True)


def hand_over(folder: Path, user: str) -> None:
    """chown the folder itself to `user` (root installing for --run-as). Opened with
    O_NOFOLLOW and changed by fd: a link planted at that name is refused, and what it
    points at (/etc, say) never changes hands."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        fail(f"error: cannot hand {folder} to {user}: no such user", EXIT_BAD_INPUT)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "it is a symbolic link" if os.path.islink(folder) else exc.strerror
        fail(f"error: cannot hand {folder} to {user}: {why}", EXIT_BAD_INPUT)
    try:
        os.fchown(fd, uid, -1)
    except OSError as exc:
        fail(f"error: cannot hand {folder} to {user}: {exc.strerror}", EXIT_BAD_INPUT)
    finally:
        os.close(fd)


def register(group: click.Group) -> None:
    group.add_command(service_group)
