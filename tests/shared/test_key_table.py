"""Key names are spelled once, in shared/keys.py's KEY_TABLE: `Keys` builds them from it,
every Lua script's generated key block is current, no script spells a key by hand, and
the Lua functions build the very names Python does."""

from __future__ import annotations

import inspect
import re
import string

import pytest
from redis import Redis

from vlmq.shared import lua
from vlmq.shared.keys import KEY, KEY_TABLE, RQ_QUEUES, RQ_REGISTRIES, RQ_WORKERS, KeyName, Keys

PREFIX = "pfx:a"
# A sample for each param; the label key holds the separators and a 2-byte character, so
# its computed length counts UTF-8 bytes in both languages.
SAMPLES = {"sha256": "ab" * 32, "job_id": "j-1", "queue": "ocr.x", "key": "k=é:1",
           "value": "v=:2", "name": "host:7", "batch_id": "b-9", "g": "20000"}
# RQ's fixed names, module constants rather than Keys attributes.
CONSTANTS = {"rq_queues": RQ_QUEUES, "rq_workers": RQ_WORKERS}
# Keys methods that are not one key of the table.
HELPERS = {"from_env", "prefix", "rq_job_glob", "rq_job_id", "rq_name", "rq_registry"}
# A Lua string literal, either quote.
LUA_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
# A Lua comment: a line of its own, or after code (no script's strings hold " -- ").
COMMENT = re.compile(r"(?:^|\s)--.*$", re.MULTILINE)
# A key as the scripts' comments and messages write one.
SHOWN = re.compile(r"(?:<prefix>|\brq):[A-Za-z0-9_<>:.=*-]*")


def _values(key: KeyName) -> dict[str, str]:
    return {p: SAMPLES[p] for p in key.params}


def _python(key: KeyName) -> str:
    """What `Keys` gives for `key`, called the way callers call it."""
    if key.name.removeprefix("rq_") in RQ_REGISTRIES:
        return Keys.rq_registry(key.name.removeprefix("rq_"), SAMPLES["queue"])
    if key.name in CONSTANTS:
        return CONSTANTS[key.name]
    attr = getattr(Keys(PREFIX), key.name)
    if not callable(attr):
        return str(attr)
    values = _values(key)
    if key.name == "result_cache_gen":
        return str(attr(int(values["g"])))
    return str(attr(*values.values()))


@pytest.mark.parametrize("key", KEY_TABLE, ids=[k.name for k in KEY_TABLE])
def test_keys_builds_each_name_from_the_table(key: KeyName) -> None:
    assert _python(key) == key.build(PREFIX, _values(key))
    assert set(key.params) <= set(SAMPLES), "give the new field a sample"


def test_every_key_keys_builds_is_a_row_of_the_table() -> None:
    named = {n for n, _ in inspect.getmembers(Keys) if not n.startswith("_")} - HELPERS
    rows = {k.name for k in KEY_TABLE} - {f"rq_{kind}" for kind in RQ_REGISTRIES} - set(CONSTANTS)
    assert named == rows


def test_rows_are_whole() -> None:
    for key in KEY_TABLE:
        assert key.name.isidentifier() and key.type and key.content and key.lifetime, key
        assert key.pattern.startswith(("{prefix}:", "rq:")), key
        computed = dict(key.lengths)
        assert set(computed.values()) <= set(key.params), key
        assert "prefix" not in key.params
    assert len(KEY) == len(KEY_TABLE), "two rows share a name"
    assert len({k.pattern for k in KEY_TABLE}) == len(KEY_TABLE), "two rows share a pattern"


def test_every_scripts_key_block_is_current() -> None:
    assert lua.stale_scripts() == [], "run python -m vlmq.shared.lua --write"


def test_a_changed_table_makes_a_block_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a renamed key gives another block than the file holds."""
    text = lua.script_path(lua.END_JOB).read_text(encoding="utf-8")
    renamed = KeyName("job_failed", "{prefix}:job:{job_id}:failures", "set", "w", "c", "l")
    monkeypatch.setitem(KEY, "job_failed", renamed)  # type: ignore[arg-type]
    assert lua.with_blocks(text) != text
    assert ":failures'" in lua.key_block(text)


def test_a_script_cannot_name_a_key_the_table_lacks() -> None:
    with pytest.raises(KeyError):
        lua.key_block("local k = KEY.no_such_key(prefix)")


def _pieces() -> set[str]:
    """The literal parts of every pattern that could only be part of a key name."""
    out = set()
    for key in KEY_TABLE:
        for literal, _, _, _ in string.Formatter().parse(key.pattern):
            if ":" in literal and any(c.isalnum() for c in literal):
                out.add(literal)
    return out


def _hand_written(text: str) -> str:
    """A script less its generated key block."""
    begin, end = lua.KEY_MARKERS
    if begin in text:
        text = text[:text.index(begin)] + text[text.index(end) + len(end):]
    return text


@pytest.mark.parametrize("name", lua.SCRIPTS)
def test_no_script_spells_a_key_by_hand(name: str) -> None:
    """Outside its generated block a script builds keys with KEY.<name>(...) only: no string
    in its code holds a piece of a key name."""
    code = COMMENT.sub("", _hand_written(lua.source(name)))
    pieces = _pieces()
    for literal in LUA_STRING.findall(code):
        assert not any(p in literal for p in pieces), (name, literal)


@pytest.mark.parametrize("name", lua.SCRIPTS)
def test_the_keys_a_scripts_comments_name_are_the_tables(name: str) -> None:
    """Headers say which key each KEYS[i] is; a renamed key fails here until they follow."""
    shown = {k.shown for k in KEY_TABLE}
    for token in SHOWN.findall(_hand_written(lua.source(name))):
        assert token.rstrip(".,") in shown, (name, token)


def test_lua_builds_the_names_python_builds(redis: Redis) -> None:
    """Each generated Lua function, run in Redis, gives what Keys gives (the label index's
    length counts bytes in both)."""
    calls = []
    for key in KEY_TABLE:
        args = ([f"'{PREFIX}'"] if "prefix" in key.fields else []) + [
            f"'{v}'" for v in _values(key).values()]
        calls.append(f"KEY.{key.name}({', '.join(args)})")
    body = "return {" + ", ".join(calls) + "}"
    script = "\n".join([lua.KEY_MARKERS[0], lua.KEY_MARKERS[1], body])
    got = redis.eval(lua.with_blocks(script), 0)
    assert [g.decode() for g in got] == [_python(k) for k in KEY_TABLE]
    label = KEY["jobs_label_index"]
    assert f":{len(SAMPLES['key'].encode())}:" in label.build(PREFIX, _values(label))
