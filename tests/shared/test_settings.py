"""The settings table (shared/settings.py): Lua and Python refuse the same values with the
same field name, the Lua copy is current, and everything that takes settings follows it."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import click
import pytest
from redis import Redis
from redis.exceptions import ResponseError

from tests.support.helpers import make_images
from vlmq.cli.options import job_options
from vlmq.producer.client import Client
from vlmq.producer.manifest import FIELDS as MANIFEST_FIELDS
from vlmq.producer.ops.schedules import Schedule
from vlmq.producer.options import JOB_FIELDS, JobOptions
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.chat import check_messages
from vlmq.shared.enqueue import enqueue_lua, lua_script
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, parse_payload

SHA = "ab" * 32


def _base() -> dict[str, Any]:
    return {"v": 1, "task": "ocr", "items": [{"kind": "image", "blob": SHA, "source": "a.png"}]}


def _schema_of_bytes(n: int) -> dict[str, Any]:
    """A valid schema whose compact JSON is exactly n bytes."""
    return {"description": "x" * (n - len('{"description":""}'))}


def _bad_values(s: S.Setting) -> list[Any]:
    """Values each kind must refuse: out of range, wrong type, too long, too many."""
    if s.kind == "schema":  # what enqueue.lua can see: the type and the size
        assert s.max_len is not None
        return ["{}", 5, True, ["a"], {}, [], _schema_of_bytes(s.max_len + 1)]
    if s.kind in ("int", "float"):
        assert s.lo is not None and s.hi is not None
        out: list[Any] = [s.lo - 1, s.hi + 1, "7", True]
        return [*out, 1.5] if s.kind == "int" else out
    if s.kind == "str":
        assert s.max_len is not None
        return [5, "x" * (s.max_len + 1), ["a"]]
    if s.kind == "strs":
        assert s.max_len is not None and s.max_count is not None
        return ["abc", [""], [5], ["x" * (s.max_len + 1)], ["x"] * (s.max_count + 1)]
    if s.kind == "labels":
        assert s.max_count is not None
        return [{"team": 7}, ["a"], {f"k{i}": "v" for i in range(s.max_count + 1)}]
    if s.kind == "bool":
        return [1, "true", 0]
    if s.kind == "messages":
        assert s.max_len is not None and s.max_count is not None
        user = {"role": "user", "content": "hi"}
        return [[], "hi", {"role": "user"}, [5], [["a"]], [{**user, "name": "x"}],
                [{"role": "bot", "content": "x"}], [{"role": "user", "content": 5}],
                [{"role": "user", "content": "x" * (s.max_len + 1)}],
                [{**user, "image": "yes"}], [{"role": "system", "content": "x", "image": True}],
                [{**user, "image": True}, {"role": "assistant", "content": "a"},
                 {**user, "image": True}],
                [user, {"role": "assistant", "content": "a"}], [user] * (s.max_count + 1)]
    assert s.kind == "choice"
    return ["yes", 5, None if s.default is None else "ON"]


def _good_values(s: S.Setting) -> list[Any]:
    if s.kind in ("int", "float"):
        return [s.lo, s.hi]
    if s.kind == "str":
        return ["x", "x" * (s.max_len or 1)]
    if s.kind == "strs":
        return [[], ["x" * (s.max_len or 1)] * (s.max_count or 1)]
    if s.kind == "labels":
        return [{}, {f"k{i}": "v" for i in range(s.max_count or 1)}]
    if s.kind == "schema":
        return [{"type": "object"}, _schema_of_bytes(s.max_len or 1)]
    if s.kind == "bool":
        return [True, False]
    if s.kind == "messages":
        return [[{"role": "user", "content": ""}],
                [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "x" * (s.max_len or 1), "image": True},
                 {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "é"}],
                [{"role": "user", "content": "x"}] * (s.max_count or 1)]
    return [v for _, v in s.wire_values]


def _with(s: S.Setting, value: Any) -> dict[str, Any]:
    payload = copy.deepcopy(_base())
    if s.kind == "schema":  # the one task that takes a schema
        payload["task"] = "extract"
    *parents, leaf = s.path
    node = payload
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return payload


def _lua(redis: Redis, payload: dict[str, Any]) -> str | None:
    """enqueue.lua's refusal ("field: problem"), or None when it enqueued the job."""
    job_id = "settings-test"
    try:
        enqueue_lua(redis, payload, queue="settings-test", job_id=job_id, keys=Keys("vlmqset"))
    except ResponseError as exc:
        return str(exc)
    redis.delete(Keys.rq_job(job_id), Keys.rq_queue("settings-test"))
    return None


def _python(payload: dict[str, Any]) -> str | None:
    try:
        parse_payload(json.loads(json.dumps(payload)))
    except PayloadError as exc:
        return exc.field
    return None


@pytest.fixture
def lua_redis(redis: Redis) -> Redis:
    redis.set(Keys("vlmqset").blob(SHA), b"x")
    return redis


CASES = [(s, v) for s in S.WIRE for v in _bad_values(s) if v is not None]


@pytest.mark.parametrize(("setting", "value"), CASES,
                         ids=[f"{s.name}={str(v)[:20]}" for s, v in CASES])
def test_lua_and_python_refuse_the_same_values_naming_the_same_field(
        lua_redis: Redis, setting: S.Setting, value: Any) -> None:
    payload = _with(setting, value)
    field = _python(payload)
    lua = _lua(lua_redis, payload)
    assert field is not None, f"Python accepted {setting.name}={value!r}"
    assert lua is not None, f"enqueue.lua accepted {setting.name}={value!r}"
    assert lua.split(": ", 1)[0] == field, (lua, field)
    assert field.startswith(setting.wire or "")


GOOD = [(s, v) for s in S.WIRE for v in _good_values(s)]


@pytest.mark.parametrize(("setting", "value"), GOOD,
                         ids=[f"{s.name}={str(v)[:20]}" for s, v in GOOD])
def test_lua_and_python_accept_the_edges_of_each_range(
        lua_redis: Redis, setting: S.Setting, value: Any) -> None:
    payload = _with(setting, value)
    assert _python(payload) is None
    assert _lua(lua_redis, payload) is None


def test_the_lua_copy_of_the_table_is_current() -> None:
    script = lua_script()
    assert S.lua_with_block(script) == script, (
        "shared/enqueue.lua is out of date: run python -m vlmq.shared.settings --write-lua")
    for s in S.WIRE:
        assert f"name = '{s.wire}'" in script


def test_unknown_settings_are_refused_by_both(lua_redis: Redis) -> None:
    for payload in ({**_base(), "priority": 5}, {**_base(), "generation": {"top_k": 5}}):
        field = _python(payload)
        lua = _lua(lua_redis, payload)
        assert field is not None and lua is not None
        assert lua.split(": ", 1)[0] == field


def _non_default(s: S.Setting) -> Any:
    """A valid value for any setting that differs from its default, from its row alone (so
    a new row is covered without editing this test)."""
    if s.kind in ("int", "float"):
        assert s.lo is not None and s.hi is not None
        value: Any = (s.lo + s.hi) / 4 if s.kind == "float" else int(s.lo) + 7
    else:
        value = {"str": "retry-7", "strs": ("</page>",), "labels": {"team": "a"}, "bool": True,
                 "messages": check_messages([{"role": "user", "content": "Why?",
                                              "image": True}]),
                 "choice": next((c for c in s.choices if c != s.default), None),
                 "schema": {"type": "object", "properties": {"a": {"type": "string"}}}
                 }[s.kind]
    assert value is not None and value != s.default
    assert s.check(value) == value
    return value


def test_a_retry_carries_every_setting(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 2)
    values = {s.name: _non_default(s) for s in S.SETTINGS}
    client = Client(redis_url)
    # extract: the one task that takes every setting (schema included)
    job = client.submit("extract", [tmp_path / "in"], JobOptions(**values))
    again = job.retry()
    original = JobOptions.of_job(job.payload(), _job_fields(redis, job.id))
    retried = JobOptions.of_job(again.payload(), _job_fields(redis, again.id))
    for s in S.rows("retry"):
        want = values[s.name]
        if s.name == "labels":
            want = {**want, "retry_of": job.id}
        got = getattr(retried, s.name)
        assert got == want, f"retry dropped or changed {s.name}: {got!r}"
        assert getattr(original, s.name) == values[s.name]
    assert again.id != job.id  # job_id is the one setting a retry cannot carry
    assert not S.BY_NAME["job_id"].retry
    assert 0 < redis.ttl(Keys.from_env().blob(job.payload().items[0].blob)) <= values["blob_ttl"]


def _job_fields(redis: Redis, job_id: str) -> dict[str, str]:
    raw = redis.hmget(Keys.rq_job(job_id), list(JOB_FIELDS))
    return {k: v.decode() for k, v in zip(JOB_FIELDS, raw, strict=True) if v is not None}


def test_every_command_and_file_format_follows_the_table() -> None:
    @click.command()
    @job_options()
    def every(options: JobOptions) -> None:
        del options

    flags = {opt for p in every.params for opt in p.opts}
    for s in S.rows("cli"):
        wanted = [sw.flag for sw in s.switches] or [s.cli_flag]
        assert set(wanted) <= flags, s.name
    assert {s.name for s in S.rows("manifest")} <= set(MANIFEST_FIELDS)


def test_json_options_build_the_payload_once_and_round_trip() -> None:
    values = {s.name: _non_default(s) for s in S.WIRE}
    item = Item(kind="image", blob=SHA, source="a.png")
    wire, payload = JobOptions(**values).payload("extract", [item])
    assert parse_payload(json.loads(json.dumps(wire))) == payload
    assert dict(payload.settings) == values
    assert wire["v"] == C.PROTOCOL_VERSION


def test_a_schedule_stored_before_the_table_keeps_its_settings_and_hash() -> None:
    # Schedules written before the settings table kept each setting at the top level.
    old = {"name": "n", "task": "ocr", "paths": ["/scans"], "every": 60.0, "cron": None,
           "tz": "UTC", "recursive": False, "prompt": "Read.", "max_tokens": 5,
           "max_side": None, "model": None, "queue": "q", "labels": {"a": "b"},
           "export_dir": None, "export_format": "md", "sidecar": False, "created_at": 1.0}
    sched = Schedule.from_json(json.dumps(old))
    opts = sched.options()
    assert (opts.prompt, opts.max_tokens, opts.queue) == ("Read.", 5, "q")
    assert opts.labels == {"a": "b", "schedule": "n"}
    # The hash the old code gave: an upgrade must not make every file due again.
    legacy = {k: old[k] for k in ("task", "prompt", "max_tokens", "max_side", "model")}
    assert sched.settings_hash() == hashlib.sha256(
        json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:16]
    assert Schedule.from_json(sched.to_json()) == sched
    hotter = Schedule.from_json(json.dumps({**old, "temperature": 0.5}))
    assert hotter.settings_hash() != sched.settings_hash()
