"""Where every option's value comes from: the command line, the environment, a TOML file.

Each option of every command has one home, its click definition, and three ways in on
top of its default, in this order of precedence (click's own): a flag, then an
environment variable, then the config file, then the default.

- The environment: `VLMQ_<COMMAND>_<OPTION>`, upper case, dashes as underscores, the
  command path included (`VLMQ_WORKER_MAX_BATCH`, `VLMQ_ENQUEUE_OCR_PAGES`, the root's
  `VLMQ_REDIS_URL`). Click generates the name from the command tree (`auto_envvar_prefix`),
  so no option writes its own. An option that also has a well-known variable of its own
  (REDIS_URL, VLMQ_STORES) reads it too.
- The file: `--config FILE` (or `$VLMQ_CONFIG`), else `config.toml` in
  `$XDG_CONFIG_HOME/vlmq` (`~/.config/vlmq`) when it exists. Top-level keys are the root's
  options, tables are commands (`[worker]`, `[enqueue.ocr]`), keys the option names with
  dashes or underscores. A key no command knows is an error naming it: a typo must not
  leave a setting silently at its default.

`--redis-url` and `--config` belong to the root, and may be given before or after the
command's name (`vlmq worker --redis-url URL`): `hoist` moves them to the front.
This module imports only click and the standard library.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

ENV_PREFIX = "VLMQ"
CONFIG_ENV = "VLMQ_CONFIG"
CONFIG_NAME = "config.toml"
CONFIG_META = "vlmq.config"  # the root context's meta key: the config file it read
# The root's options a user may also give after a command's name.
ROOT_OPTIONS = ("--redis-url", "--config")
# Options that act rather than set: never shown as settings.
_NOT_SETTINGS = frozenset({"help", "print_config", "config_file", "version"})


class ConfigError(Exception):
    """The config file cannot be used as given: unreadable, not TOML, or a key no command
    knows. A configuration no retry can fix (exit 78)."""


def default_path() -> Path:
    """Where the config file is looked for when no --config or $VLMQ_CONFIG names one."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "vlmq" / CONFIG_NAME


def word(text: str) -> str:
    """A command or flag name as a variable's part."""
    return text.upper().replace("-", "_")


def name_variables(command: click.Command, prefix: str) -> None:
    """Give each option of `command` (and of its subcommands, recursively) its variable,
    `<prefix>_<LONG FLAG>`: the flag a user reads in --help, where click's own rule would
    use the parameter's name (`--status` whose name is state, `--json` whose is as_json).
    The name click would use stays an alias after it, and an option's own well-known
    variable (REDIS_URL) after that. Flags that share one value (`--no-result-cache`,
    `--result-cache-sampled`) read none: no one word names which of them a variable
    means; the config file sets their value."""
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        if param.is_flag and not param.is_bool_flag:
            param.allow_from_autoenv = False
            continue
        longs = [o for o in param.opts if o.startswith("--")]
        names = [f"{prefix}_{word(longs[0][2:])}"] if longs else []
        names.append(f"{prefix}_{word(param.name)}")
        own = param.envvar
        names += [own] if isinstance(own, str) else list(own or [])
        param.envvar = list(dict.fromkeys(names))
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            name_variables(sub, f"{prefix}_{word(name)}")


def env_names(param: click.Option) -> list[str]:
    """The variables an option reads, first the one its help and docs name."""
    own = param.envvar
    return [own] if isinstance(own, str) else list(own or [])


def hoist(args: Sequence[str], root: click.Group, ctx: click.Context) -> list[str]:
    """The arguments with every root option moved to the front, so `vlmq worker
    --redis-url URL` is `vlmq --redis-url URL worker`. The words are read as click will
    read them, command by command: the value of another option (`--prompt --config`)
    stays where it is, and nothing after `--` moves."""
    front: list[str] = []
    rest: list[str] = []
    command: click.Command = root
    valued = _valued(root)
    i = 0
    while i < len(args):
        word = args[i]
        name = word.split("=", 1)[0]
        if word == "--":
            rest.extend(args[i:])
            break
        if name in ROOT_OPTIONS:
            end = i + 1 if "=" in word else min(i + 2, len(args))
            front.extend(args[i:end])
            i = end
            continue
        if word in valued:
            rest.extend(args[i:i + 2])
            i += 2
            continue
        if not word.startswith("-") and isinstance(command, click.Group):
            sub = command.get_command(ctx, word)
            if sub is not None:
                command, valued = sub, _valued(sub)
        rest.append(word)
        i += 1
    return front + rest


def _valued(command: click.Command) -> set[str]:
    """The option words of `command` that take the next word as their value."""
    return {opt for p in command.params if isinstance(p, click.Option) and not p.is_flag
            and p.nargs != 0 for opt in p.opts}


def config_path(args: Sequence[str]) -> tuple[Path | None, bool]:
    """(the file to read, whether it was named): --config in the (hoisted) arguments,
    else $VLMQ_CONFIG, else the default location when a file is there."""
    named: Path | None = None  # the last one given, as click keeps the last value
    for i, word in enumerate(args):
        if word == "--":
            break
        if word == "--config" and i + 1 < len(args):
            named = Path(args[i + 1])
        elif word.startswith("--config="):
            named = Path(word.split("=", 1)[1])
    if named is not None:
        return named, True
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]), True
    path = default_path()
    return (path, False) if path.is_file() else (None, False)


def load(path: Path) -> dict[str, Any]:
    """The file's tables as click's default_map: keys with dashes made option names."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not valid TOML: not UTF-8 text") from None
    return _names(data)


def _names(table: Mapping[str, Any]) -> dict[str, Any]:
    return {key.replace("-", "_"): _names(value) if isinstance(value, dict) else value
            for key, value in table.items()}


def check(ctx: click.Context, command: click.Command, table: dict[str, Any],
          path: Path, where: str = "") -> None:
    """Refuse a key that is neither an option of `command` nor one of its subcommands (a
    table), naming it and the file. A key may be the option's name or its long flag
    (`json` for --json, whose name is as_json); it is renamed to the name in place."""
    names = _option_keys(command)
    repeatable = {p.name for p in command.params if isinstance(p, click.Option) and p.multiple}
    for key in list(table):
        value = table[key]
        here = f"{where}.{key}" if where else key
        if key in names and not isinstance(value, dict):
            name = names[key]
            value = table.pop(key)
            # One word for a repeatable option is a list of one, as on the command line.
            table[name] = [value] if name in repeatable and isinstance(value, str) else value
            continue
        sub = (command.get_command(ctx, key) if isinstance(command, click.Group)
               and isinstance(value, dict) else None)
        if sub is None:
            known = sorted(set(names.values()))
            owner = " ".join(["vlmq", *where.split(".")] if where else ["vlmq"])
            raise ConfigError(f"config file {path}: {here!r} is not an option of `{owner}`"
                              + (f" (options: {', '.join(known)})" if known else ""))
        check(ctx, sub, value, path, here)


def _option_keys(command: click.Command) -> dict[str, str]:
    """Every key that names an option of `command` -> the option's name."""
    keys: dict[str, str] = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name and param.name not in _NOT_SETTINGS:
            keys[param.name] = param.name
            for flag in param.opts:
                if flag.startswith("--"):
                    keys.setdefault(flag[2:].replace("-", "_"), param.name)
    return keys


def misconfigured(exc: click.BadParameter) -> str | None:
    """What to say when a refused value came from a config file or an environment
    variable, not the command line (a configuration error, exit 78); None otherwise."""
    ctx, param = exc.ctx, exc.param
    if ctx is None or not isinstance(param, click.Option) or param.name is None:
        return None
    source = ctx.get_parameter_source(param.name)
    if source is ParameterSource.DEFAULT_MAP:
        path = ctx.find_root().meta.get(CONFIG_META)
        table = ".".join(c.info_name or "" for c in list(reversed(_chain(ctx)))[1:])
        key = f"{table}.{param.name}" if table else param.name
        return f"config file {path}: {key!r}: {exc.format_message()}"
    if source is ParameterSource.ENVIRONMENT:
        names = [n for n in env_names(param) if os.environ.get(n)]
        return f"environment variable {names[0] if names else '?'}: {exc.format_message()}"
    return None


def sources(ctx: click.Context, path: Path | None) -> Iterator[tuple[str, str, Any, str]]:
    """(table, option name, value, where it came from) for each option of the command
    being run and of the commands above it; the root's table is ""."""
    chain = _chain(ctx)
    for depth, level in enumerate(reversed(chain)):
        table = ".".join(c.info_name or "" for c in list(reversed(chain))[1:depth + 1])
        for param in level.command.params:
            if not isinstance(param, click.Option) or param.name is None or param.hidden:
                continue
            if param.name in _NOT_SETTINGS:
                continue
            yield table, param.name, level.params.get(param.name), _source(level, param, path)


def _source(ctx: click.Context, param: click.Option, path: Path | None) -> str:
    assert param.name is not None
    source = ctx.get_parameter_source(param.name)
    if source is ParameterSource.COMMANDLINE:
        return f"flag {param.opts[0]}"
    if source is ParameterSource.ENVIRONMENT:
        names = [n for n in env_names(param) if os.environ.get(n)]
        return f"env {names[0]}" if names else "env"
    if source is ParameterSource.DEFAULT_MAP:
        return f"file {path}"
    return "default"


def toml_value(value: Any) -> str | None:
    """A value as TOML text, None where TOML has no form (not set)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        parts = [toml_value(v) for v in value]
        return "[" + ", ".join(p for p in parts if p is not None) + "]"
    text = str(value)
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def render(ctx: click.Context, path: Path | None,
           shown: Callable[[str, Any], Any] = lambda _name, value: value) -> list[str]:
    """The effective settings of the command being run as TOML lines, each with where its
    value came from: a file a user can keep as their config. `shown` turns a value that
    is an object into the form its option reads."""
    lines = ["# each value and where it came from (flag > env > file > default)"
             + (f"; config file {path}" if path else "; no config file")]
    section = ""
    for level, name, value, source in sources(ctx, path):
        if level and level != section:
            section = level
            lines += ["", f"[{level}]"]
        text = toml_value(shown(name, value))
        lines.append(f"{name} = {text}  # {source}" if text is not None
                     else f"# {name}: not set, decided at start  # {source}")
    return lines


def _chain(ctx: click.Context) -> list[click.Context]:
    out: list[click.Context] = []
    node: click.Context | None = ctx
    while node is not None:
        out.append(node)
        node = node.parent
    return out
