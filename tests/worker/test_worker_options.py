"""The worker options' table (worker/options.py) is the one source of `vlmq worker`'s click
options, of WorkerConfig's fields and defaults, and of the arguments `vlmq service` writes:
each is checked against the rows, and a row changed in a copy of the table changes them."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from vlmq.cli import config
from vlmq.cli.worker import worker_cmd, worker_options
from vlmq.stores.backends import STORES_ENV, Stores
from vlmq.worker import options
from vlmq.worker.config import WorkerConfig

REQUIRED = ["--model", "m"]


def command(rows: Sequence[options.WorkerOption] = options.OPTIONS) -> click.Command:
    """A `vlmq worker` made from `rows` (the real one is made from options.OPTIONS)."""
    @click.command("worker")
    @worker_options(rows)
    def cmd(**_values: Any) -> None:
        """Made from a copy of the table."""

    return cmd


def parse(args: Sequence[str], cmd: click.Command = worker_cmd) -> tuple[dict[str, Any],
                                                                         list[str]]:
    """(values by name, the names given on the command line, in order), as units.py reads
    them."""
    with cmd.make_context("vlmq worker", list(args)) as ctx:
        given = [name for name in ctx.params
                 if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
        return dict(ctx.params), given


def comparable(value: Any) -> Any:
    """Stores compare by identity: by their NAME=URL specs here."""
    if isinstance(value, Stores):
        return sorted(options.store_spec(s) for s in value)
    return value


def config_dict(cfg: WorkerConfig) -> dict[str, Any]:
    return {f.name: comparable(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def sample(row: options.WorkerOption) -> Any:
    """A value for `row` other than its default, within its range: any new row gets one."""
    if row.kind == "flag":
        return True
    if row.kind == "int":
        value = int(row.hi) if row.hi is not None else int(row.lo or 0) + 3
        return value - 1 if value == row.default else value
    if row.kind == "float":
        value = (row.lo or 0.0) + 0.25
        return value + 1 if value == row.default else value
    if row.kind == "choice":
        return next(c for c in reversed(row.choices) if c != row.default)
    if row.kind == "strs":
        return ("ocr,caption", "generate")
    if row.kind == "path":
        return Path("/srv/a dir/100%")
    if row.kind == "stores":
        return Stores.parse(["docs=file:///srv/my docs", "raw=s3://bucket/a%25b c/"])
    return "a value, with $ and 100%"


def samples(rows: Sequence[options.WorkerOption] = options.OPTIONS) -> dict[str, Any]:
    return {row.name: sample(row) for row in rows}


# --- the rows themselves ---------------------------------------------------------------------


def test_rows_are_well_formed() -> None:
    flags = [row.cli_flag for row in options.OPTIONS]
    assert len(set(flags)) == len(flags) and len(options.BY_NAME) == len(options.OPTIONS)
    for row in options.OPTIONS:
        assert row.kind in options.KINDS and row.help.strip(), row
        assert row.local_path in ("", options.PATH, options.PATH_OR_ID), row
        assert (row.kind == "choice") == bool(row.choices), row
        if row.kind == "choice":
            assert row.default in row.choices, row
        if row.kind in ("int", "float") and row.default is not None:
            assert (row.lo is None or row.lo <= row.default) and (
                row.hi is None or row.default <= row.hi), row
        assert not (row.required and row.default is not None), row


def test_fields_made_by_several_rows_have_a_builder() -> None:
    by_field: dict[str, list[str]] = {}
    for row in options.OPTIONS:
        if row.config_field is not None:
            by_field.setdefault(row.config_field, []).append(row.name)
    assert set(options.COMPOSITES) == {name for name, rows in by_field.items() if len(rows) > 1}
    assert by_field["repetition"] == ["on_repetition", "repetition_repeats",
                                      "repetition_min_span", "repetition_period"]


# --- click options ---------------------------------------------------------------------------


def test_every_row_is_a_click_option_in_table_order() -> None:
    # The root names each option's variables when it loads the command (cli/config.py);
    # naming them again changes nothing, so the test does not depend on which ran first.
    config.name_variables(worker_cmd, "VLMQ_WORKER")
    params = {p.name: p for p in worker_cmd.params}
    assert [p.name for p in worker_cmd.params] == [row.name for row in options.OPTIONS]
    for row in options.OPTIONS:
        param = params[row.name]
        assert isinstance(param, click.Option)
        if param.is_flag and not param.is_bool_flag:
            variables: list[str] | None = param.envvar  # flags sharing a value read none
        else:
            longs = [o[2:] for o in param.opts if o.startswith("--")]
            variables = list(dict.fromkeys(
                [*(f"VLMQ_WORKER_{config.word(o)}" for o in longs[:1]),
                 f"VLMQ_WORKER_{config.word(row.name)}",
                 *([row.envvar] if row.envvar else [])]))
        assert (param.opts, param.envvar, param.metavar) == (
            [row.cli_flag], variables, row.metavar), row.name
        assert (param.required, param.multiple, param.is_flag) == (
            row.required, row.kind in ("strs", "stores"), row.kind == "flag"), row.name
        if row.kind != "stores":  # its help is cli.common.store_option's, shared
            assert param.help == row.help, row.name
            assert bool(param.show_default) == row.show_default, row.name


def test_a_worker_given_nothing_gets_the_table_defaults() -> None:
    values, given = parse(REQUIRED)
    assert given == ["model"]
    for row in options.OPTIONS:
        if row.name != "model":
            assert comparable(values[row.name]) == comparable(options.stores(row.default)
                                                              if row.kind == "stores"
                                                              else row.default), row.name


def test_ranges_and_choices_come_from_the_rows() -> None:
    for row in options.OPTIONS:
        bad: list[str] = []
        if row.kind in ("int", "float") and row.lo is not None:
            bad = [row.cli_flag, str(row.lo - 1)]
        elif row.kind == "choice":
            bad = [row.cli_flag, "no-such-choice"]
        if bad:
            with pytest.raises(click.BadParameter):
                parse([*REQUIRED, *bad])


def test_a_refused_queue_name_names_its_option() -> None:
    res = CliRunner().invoke(worker_cmd, ["--model", "/nonexistent", "--queues", "ocr:x"])
    assert res.exit_code == 2
    assert "Invalid value for --queues: 'ocr:x' is not a queue name" in res.output
    with pytest.raises(options.OptionError) as err:
        options.config_values({**options.defaults(), "queues": ("ocr", "a b:c")})
    assert err.value.flag == "--queues"


# --- WorkerConfig --------------------------------------------------------------------------


def test_worker_config_fields_are_the_rows_fields() -> None:
    fields = [f.name for f in dataclasses.fields(WorkerConfig)]
    from_rows = list(dict.fromkeys(row.config_field for row in options.OPTIONS
                                   if row.config_field is not None))
    assert sorted(fields) == sorted([*from_rows, *options.CONFIG_ONLY])
    assert [f for f in fields if f in from_rows] == from_rows  # declared in table order
    required = {f.name for f in dataclasses.fields(WorkerConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == {"redis_url", *(row.name for row in options.OPTIONS if row.required)}


def _matches(value: Any, hint: Any) -> bool:
    """isinstance for the annotations WorkerConfig uses (X | None, list[str], classes)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is not None:
        return isinstance(value, origin) and all(
            _matches(v, typing.get_args(hint)[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def test_worker_config_defaults_are_the_tables() -> None:
    cfg = WorkerConfig(redis_url="redis://x", model="m")
    hints = typing.get_type_hints(WorkerConfig)
    for field in dataclasses.fields(cfg):
        if field.name in (*options.CONFIG_ONLY, "model"):
            continue
        value = getattr(cfg, field.name)
        assert comparable(value) == comparable(options.config_default(field.name)), field.name
        assert _matches(value, hints[field.name]), (field.name, value, hints[field.name])
        # and what a sample value of its rows becomes fits the annotation too
        made = options.config_values({**options.defaults(), **samples()})[field.name]
        assert _matches(made, hints[field.name]), (field.name, made)


def test_the_cli_with_defaults_makes_the_default_config() -> None:
    values, _ = parse(REQUIRED)
    from_cli = WorkerConfig(redis_url="redis://x", **options.config_values(values))
    assert config_dict(from_cli) == config_dict(WorkerConfig(redis_url="redis://x", model="m"))


def test_units_and_derived_values() -> None:
    values, _ = parse([*REQUIRED, "--cache-mem-mb", "3", "--cache-disk-gb", "0.5",
                       "--result-cache-mb", "1.5", "--fixed-batch", "--repetition-repeats",
                       "0", "--queues", "a,b", "--queues", "b,c"])
    cfg = options.config_values(values)
    assert (cfg["cache_mem_bytes"], cfg["cache_disk_bytes"], cfg["result_cache_bytes"]) == (
        3 << 20, 1 << 29, 3 << 19)
    assert (cfg["auto_batch"], cfg["repetition"], cfg["queues"]) == (False, None,
                                                                      ["a", "b", "c"])
    assert cfg["allow_eviction"] is None and "with_scheduler" not in cfg
    values, _ = parse([*REQUIRED, "--repetition-repeats", "1", "--repetition-period", "9"])
    guard = options.config_values(values)["repetition"]
    assert (guard.min_repeats, guard.max_period) == (2, 9)  # a loop is 2 repeats at least


# --- unit arguments ------------------------------------------------------------------------


def test_every_row_round_trips_through_the_unit_arguments() -> None:
    """Values -> the unit's words -> the worker's parser gives the same values and the
    same config, for a non-default value of every row (a new row is covered as it is)."""
    values = samples()
    args = options.unit_args(values, list(values))
    parsed, given = parse(args)
    assert given == list(values)
    assert {k: comparable(v) for k, v in parsed.items()} == {
        k: comparable(v) for k, v in values.items()}
    assert config_dict(WorkerConfig(redis_url="r", **options.config_values(parsed))) == (
        config_dict(WorkerConfig(redis_url="r", **options.config_values(values))))


def test_unit_arguments_keep_the_given_order_and_leave_out_the_rest() -> None:
    args = ["--queues", "ocr", "--grace", "45.5", "--model", "/m", "--queues", "caption",
            "--burst", "--render-timeout", "2"]
    values, given = parse(args)
    assert given == ["queues", "grace", "model", "burst", "render_timeout"]
    assert options.unit_args(values, given) == [
        "--queues", "ocr", "--queues", "caption", "--grace", "45.5", "--model", "/m",
        "--burst", "--render-timeout", "2"]


def test_store_specs_read_back_as_the_same_stores() -> None:
    stores = sample(options.BY_NAME["stores"])
    specs = [options.store_spec(s) for s in stores]
    assert specs == ["docs=file:///srv/my%20docs", "raw=s3://bucket/a%25b%20c"]
    assert [(s.name, s.url) for s in Stores.parse(specs)] == [(s.name, s.url) for s in stores]


def test_float_words_are_short_and_exact() -> None:
    row = options.BY_NAME["grace"]
    for value in (50.0, 0.1, 45.5, 1e-7, math.inf):
        (_, word) = row.words(value)
        assert float(word) == value
    assert row.words(50.0) == ["--grace", "50"]


# --- a change to the table changes all three ---------------------------------------------


def changed(name: str, **changes: Any) -> tuple[options.WorkerOption, ...]:
    return tuple(dataclasses.replace(row, **changes) if row.name == name else row
                 for row in options.OPTIONS)


def test_a_changed_default_reaches_click_config_and_unit() -> None:
    rows = changed("poison_kills", default=7)
    cmd = command(rows)
    values, given = parse(REQUIRED, cmd)
    assert values["poison_kills"] == 7
    assert options.config_values(values, rows)["poison_kills"] == 7
    made = dataclasses.make_dataclass("Config", [(
        "poison_kills", int, dataclasses.field(default_factory=options.from_table("poison_kills",
                                                                                  rows)))])
    assert made().poison_kills == 7  # type: ignore[attr-defined]
    # A unit leaves a default out, so its worker gets the table's default.
    assert options.unit_args(values, given, rows) == REQUIRED
    assert parse(options.unit_args(values, given, rows), cmd)[0]["poison_kills"] == 7
    # The real table is untouched.
    assert parse(REQUIRED)[0]["poison_kills"] == options.DEFAULT_POISON_KILLS != 7


def test_a_changed_flag_or_field_reaches_click_config_and_unit() -> None:
    rows = changed("poison_kills", flag="--deaths", field="deaths")
    cmd = command(rows)
    values, given = parse([*REQUIRED, "--deaths", "5"], cmd)
    assert options.unit_args(values, given, rows) == [*REQUIRED, "--deaths", "5"]
    made = options.config_values(values, rows)
    assert made["deaths"] == 5 and "poison_kills" not in made
    # Two rows filling one field need a builder: said, not guessed.
    with pytest.raises(TypeError, match="COMPOSITES"):
        options.config_values(values, changed("poison_kills", field="max_kv_tokens"))
    with pytest.raises(click.NoSuchOption):
        parse([*REQUIRED, "--poison-kills", "5"], cmd)


def test_a_new_row_is_an_option_a_config_value_and_unit_words() -> None:
    new = options.WorkerOption("idle_exit", "float", "Exit after this many idle seconds.",
                               default=0.0, lo=0)
    rows = (*options.OPTIONS, new)
    values, given = parse([*REQUIRED, "--idle-exit", "2.5"], command(rows))
    assert options.config_values(values, rows)["idle_exit"] == 2.5
    assert options.unit_args(values, given, rows) == [*REQUIRED, "--idle-exit", "2.5"]
    assert options.from_table("idle_exit", rows)() == 0.0


def test_the_store_option_is_the_rows(tmp_path: Path) -> None:
    """--store is cli.common.store_option (shared by every command), so the row and it are
    held together here: flag, envvar, metavar, and the value a Stores."""
    row = options.BY_NAME["stores"]
    assert (row.cli_flag, row.envvar, row.metavar) == ("--store", STORES_ENV, "NAME=URL")
    values, _ = parse([*REQUIRED, "--store", f"d={tmp_path}"])
    assert isinstance(values["stores"], Stores)
    assert comparable(values["stores"]) == [f"d={tmp_path.as_uri()}"]


def test_local_path_rows() -> None:
    assert [(r.name, r.local_path) for r in options.local_paths()] == [
        ("model", options.PATH_OR_ID), ("cache_dir", options.PATH)]


def test_defaults_give_every_config_field_an_option_fills() -> None:
    assert set(options.config_values(options.defaults())) == {
        row.config_field for row in options.OPTIONS if row.config_field is not None}


def test_the_table_loads_nothing_heavy() -> None:
    """Every `vlmq` listing loads cli.worker and so the table: on a producer-only install
    numpy and MLX are absent, and nothing there may need Redis's client or Pillow either."""
    code = ("import sys, vlmq.cli.worker; heavy = ('mlx', 'mlx_vlm', 'numpy', 'redis', 'rq', "
            "'PIL', 'pypdfium2', 'transformers'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
