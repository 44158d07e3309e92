"""Every Lua script vlmq runs is a packaged file beside this module, loaded here.

One way keeps them reviewable as Lua, shipped in the wheel (package data `*.lua`) and
readable by other-language clients from the same file (enqueue.lua is part of the
protocol). Scripts are registered, not EVALed: redis-py then sends EVALSHA and loads the
source only when the server does not have it, including inside a pipeline.

No script spells a key name, a limit, a number or a refusal by hand: each file carries
generated blocks, the key names it uses (from shared/keys.py's KEY_TABLE), the limits and
lists (LIMITS, from the Python constant that owns each), UNITS and CALENDAR, and in
enqueue.lua the settings table (shared/settings.py) and the payload rules' wording
(shared/messages.py); libraries (tally_lib.lua, blob_release_lib.lua) are copied in whole
(tests/shared/test_lua_literals.py keeps numbers out of the rest). The blocks live
in the files themselves, not only in what Python loads, because other languages'
producers read the files from disk.
`python -m vlmq.shared.lua --write` regenerates them; `--check` (and
tests/shared/test_key_table.py) fails while a file differs from what the tables give.
"""

from __future__ import annotations

import json
import re
import string
import sys
from functools import cache
from importlib import resources
from pathlib import Path

from redis import Redis
from redis.commands.core import Script

from vlmq.shared import constants as C
from vlmq.shared import extract_schema, messages
from vlmq.shared import settings as S
from vlmq.shared.keys import JOB_ID_RE, KEY, QUEUE_NAME_RE, SHA256_RE, KeyName

# The scripts, by file name (each file's header says its KEYS, ARGV and reply).
ENQUEUE = "enqueue.lua"
END_JOB = "end_job.lua"
WRITE_ITEMS = "write_items.lua"
RESULT_CACHE_STORE = "result_cache_store.lua"
RESULT_CACHE_LOOKUP = "result_cache_lookup.lua"
SCHEDULE_CLAIM = "schedule_claim.lua"
BLOB_EXTEND_TTL = "blob_extend_ttl.lua"
TALLY = "tally.lua"
FAIR_TAKE = "fair_take.lua"
QUEUE_CENSUS = "queue_census.lua"
BLOB_RELEASE = "blob_release.lua"
SCRIPTS = (ENQUEUE, END_JOB, WRITE_ITEMS, RESULT_CACHE_STORE, RESULT_CACHE_LOOKUP,
           SCHEDULE_CLAIM, BLOB_EXTEND_TTL, TALLY, FAIR_TAKE, QUEUE_CENSUS, BLOB_RELEASE)
# The running counts' functions (PROTOCOL.md 8b), one file copied into every script that
# changes a job, between these markers: each change and its counts land in one script.
TALLY_LIB = "tally_lib.lua"
TALLY_MARKERS = ("-- BEGIN TALLY", "-- END TALLY")
# How a job lets go of its input blobs (PROTOCOL.md section 2): copied into end_job.lua (a
# job that ends) and blob_release.lua (a deleted job, shared/blobs.py), so both run it.
BLOBS_LIB = "blob_release_lib.lua"
BLOBS_MARKERS = ("-- BEGIN BLOBS", "-- END BLOBS")
LIBRARIES = ((TALLY_MARKERS, TALLY_LIB), (BLOBS_MARKERS, BLOBS_LIB))

# The key block's first and last line (a tuple: lua's str constants are the script names).
KEY_MARKERS = ("-- BEGIN KEYS", "-- END KEYS")


# The limits block: every protocol limit, list and name a script uses that is no payload
# setting (those are the SETTINGS block), each from the Python constant that owns it, so
# Lua and Python refuse at one number. No script spells any of them by hand
# (tests/shared/test_lua_literals.py).
LIMITS_MARKERS = ("-- BEGIN LIMITS", "-- END LIMITS")
LIMITS: dict[str, object] = {
    "max_queues": C.MAX_QUEUES, "ended_events_s": C.ENDED_EVENTS_S,
    "events_maxlen": C.EVENTS_MAXLEN,
    "moved_data": C.MOVED_DATA, "fair_field": C.FAIR_FIELD, "loose_share": C.LOOSE_SHARE,
    "tenant_label": C.TENANT_LABEL, "tenant_share": C.TENANT_SHARE,
    "items_field": C.ITEMS_FIELD, "max_items": C.MAX_ITEMS_PER_JOB,
    "version": C.PROTOCOL_VERSION, "task_func": C.TASK_FUNC, "tasks": list(C.TASKS),
    "item_kinds": list(C.ITEM_KINDS), "text_kind": C.TEXT_KIND,
    "text_tasks": list(C.TEXT_TASKS), "schema_task": extract_schema.EXTRACT,
    "prompt_task": C.PROMPT_TASK, "paged_kinds": list(C.PAGED_KINDS),
    "max_pages": C.MAX_TIFF_PAGES, "max_retries": C.MAX_CRASH_RETRIES,
    "max_description_chars": C.MAX_DESCRIPTION_CHARS,
    "max_source_chars": C.MAX_SOURCE_CHARS, "max_custom_id_chars": C.MAX_CUSTOM_ID_CHARS,
    "max_blob_bytes": C.BLOB_MAX_BYTES,
    "job_id_chars": messages.pattern_max_chars(JOB_ID_RE), "job_id_shape": JOB_ID_RE.pattern,
    "queue_chars": messages.pattern_max_chars(QUEUE_NAME_RE), "queue_shape": QUEUE_NAME_RE.pattern,
    "sha256_chars": messages.pattern_max_chars(SHA256_RE),
    "store_chars": messages.pattern_max_chars(messages.STORE_NAME_RE),
    "max_ref_path_chars": messages.MAX_REF_PATH_CHARS, "max_ref_size": messages.MAX_REF_SIZE,
    "fair_stale_drops": C.FAIR_STALE_DROPS, "fair_pops_per_job": C.FAIR_POPS_PER_JOB,
    "fair_pops_floor": C.FAIR_POPS_FLOOR,
    "rcache_field_overhead": C.RCACHE_FIELD_OVERHEAD_BYTES,
    "rcache_evict_rounds": C.RCACHE_EVICT_ROUNDS, "rcache_evict_max": C.RCACHE_EVICT_MAX,
}
# The units block: the arithmetic of times and Redis replies the scripts share (not
# protocol limits, but numbers all the same, so none is spelled by hand in a script).
UNITS_MARKERS = ("-- BEGIN UNITS", "-- END UNITS")
UNITS: dict[str, object] = {
    "ms_per_s": 1000, "us_per_ms": 1000, "mib": 1 << 20, "us_per_s": 1_000_000, "s_per_min": 60,
    "min_per_h": 60, "h_per_day": 24, "max_hour": 23, "max_minute": 59, "max_second": 59,
    "fraction_digits": 6,
    # a flat HGETALL / WITHSCORES reply: field then value
    "pair": 2,
    # PTTL's reply for a key that does not exist
    "pttl_missing": -2,
    # result_cache_store.lua's KEYS index of its first generation hash
    "rcache_first_gen_key": 2,
    # the largest integer a double (a Lua number) holds exactly
    "max_exact_int": 2**53 - 1,
}
# The calendar block (enqueue.lua): Gregorian leap years and H. Hinnant's days-from-civil
# algorithm, to score a job by its created time in epoch µs.
CALENDAR_MARKERS = ("-- BEGIN CALENDAR", "-- END CALENDAR")
CALENDAR: dict[str, object] = {
    "month_days": [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31], "leap_month": 2,
    "leap_every": 4, "century": 100, "era_years": 400, "era_days": 146097,
    "year_days": 365, "months": 12, "march_shift": 9, "month_days_num": 153,
    "month_days_round": 2, "month_days_den": 5, "epoch_shift": 719468,
}
# What a script names outside its block: KEY.<name>(...) builds a key, KEY_SHOWN.<name>
# is its documented form (`<prefix>:job:<job_id>:items`) for error messages.
_USES = re.compile(r"\bKEY(_SHOWN)?\.(\w+)")


@cache
def source(name: str) -> str:
    """The text of a packaged script; read once per process."""
    return resources.files("vlmq.shared").joinpath(name).read_text(encoding="utf-8")


def script(redis: Redis, name: str) -> Script:
    """A packaged script bound to `redis`; call it with keys=, args= (and client= for a
    pipeline)."""
    return redis.register_script(source(name))


# --- the generated blocks ----------------------------------------------------------------


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def lua_function(key: KeyName) -> str:
    """`key` as a Lua function of its prefix (vlmq's keys) and its params, in order."""
    computed = dict(key.lengths)
    parts: list[str] = []
    for literal, field, _, _ in string.Formatter().parse(key.pattern):
        if literal:
            parts.append(_quote(literal))
        if field:
            parts.append("#" + computed[field] if field in computed else field)
    args = (["prefix"] if "prefix" in key.fields else []) + list(key.params)
    return f"function KEY.{key.name}({', '.join(args)}) return {' .. '.join(parts)} end"


def _outside(text: str, begin: str, end: str) -> str:
    """`text` without its block from `begin` to `end` (all of it when there is none)."""
    if begin not in text:
        return text
    return text[:text.index(begin)] + text[text.index(end) + len(end):]


def key_block(script_text: str) -> str:
    """The key block for a script: the keys (and shown forms) it names outside the block.
    A name that is not in KEY_TABLE is a KeyError: a script cannot use a key the table
    does not define."""
    begin, end = KEY_MARKERS
    uses = _USES.findall(_outside(script_text, begin, end))
    built = sorted({name for shown, name in uses if not shown})
    shown = sorted({name for is_shown, name in uses if is_shown})
    lines = [f"{begin}: generated from vlmq/shared/keys.py by "
             "`python -m vlmq.shared.lua --write`; do not edit by hand.", "local KEY = {}",
             *(lua_function(KEY[name]) for name in built)]
    if shown:
        lines += ["local KEY_SHOWN = {",
                  *(f"  {name} = {_quote(KEY[name].shown)}," for name in shown), "}"]
    return "\n".join([*lines, end])


def library_block(markers: tuple[str, str], lib: str) -> str:
    """A library block: the file `lib` between its markers."""
    begin, end = markers
    text = script_path(lib).read_text(encoding="utf-8").rstrip("\n")
    return "\n".join([f"{begin}: copied from vlmq/shared/{lib} by "
                      "`python -m vlmq.shared.lua --write`; do not edit by hand.", text, end])


def tally_block() -> str:
    """The tally block: shared/tally_lib.lua between its markers."""
    return library_block(TALLY_MARKERS, TALLY_LIB)


def lua_value(value: object) -> str:
    """`value` as a Lua literal: a number as it is, a string quoted, a list a table."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "nil"}[value]
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(lua_value(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {lua_value(v)}" for k, v in value.items()) + "}"
    # json.dumps: a number as it is, a string quoted (a JSON string is a Lua string)
    return json.dumps(value)


def table_block(markers: tuple[str, str], name: str, table: dict[str, object],
                owner: str) -> str:
    """A generated `local NAME = {...}` block from `table`, one field a line."""
    begin, end = markers
    return "\n".join([f"{begin}: generated from {owner} by "
                      "`python -m vlmq.shared.lua --write`; do not edit by hand.",
                      f"local {name} = {{",
                      *(f"  {k} = {lua_value(v)}," for k, v in table.items()), "}", end])


def limits_block() -> str:
    """The limits block: `local LIMITS = {...}` from LIMITS."""
    return table_block(LIMITS_MARKERS, "LIMITS", LIMITS,
                       "vlmq/shared/constants.py, keys.py and messages.py")


def units_block() -> str:
    return table_block(UNITS_MARKERS, "UNITS", UNITS, "vlmq/shared/lua.py UNITS")


def calendar_block() -> str:
    return table_block(CALENDAR_MARKERS, "CALENDAR", CALENDAR, "vlmq/shared/lua.py CALENDAR")


def messages_table() -> dict[str, object]:
    """Each payload rule's refusal as shared/messages.py words it; a store path's by
    `path_`."""
    return {**messages.PAYLOAD_MESSAGES, **{f"path_{k}": v for k,
                                            v in messages.REF_PATH_PROBLEMS.items()}}


def messages_block() -> str:
    """The messages block: each payload rule's refusal, worded once in shared/messages.py."""
    return table_block(MESSAGES_MARKERS, "MESSAGES", messages_table(),
                       "vlmq/shared/messages.py PAYLOAD_MESSAGES and REF_PATH_PROBLEMS")


MESSAGES_MARKERS = ("-- BEGIN MESSAGES", "-- END MESSAGES")
# Each generated table block, by its markers, in the order a script lays them out.
TABLE_BLOCKS = ((LIMITS_MARKERS, limits_block), (UNITS_MARKERS, units_block),
                (CALENDAR_MARKERS, calendar_block), (MESSAGES_MARKERS, messages_block))
# Every generated block's markers (tests/shared/test_lua_literals.py scans outside them).
ALL_MARKERS = (KEY_MARKERS, S.LUA_MARKERS,
               *(markers for markers, _ in LIBRARIES),
               *(markers for markers, _ in TABLE_BLOCKS))


def _replace_block(text: str, markers: tuple[str, str], block: str) -> str:
    begin, end = markers
    start = text.rfind("\n", 0, text.index(begin)) + 1
    stop = text.index(end) + len(end)
    return text[:start] + block + text[stop:]


def with_blocks(script_text: str) -> str:
    """`script_text` with each generated block it has replaced by the current one (the
    libraries first: the key block names the keys they use too)."""
    out = script_text
    for markers, lib in LIBRARIES:
        if markers[0] in out:
            out = _replace_block(out, markers, library_block(markers, lib))
    for markers, block in TABLE_BLOCKS:
        if markers[0] in out:
            out = _replace_block(out, markers, block())
    if KEY_MARKERS[0] in out:
        out = _replace_block(out, KEY_MARKERS, key_block(out))
    if S.LUA_BEGIN in out:
        out = S.lua_with_block(out)
    return out


def script_path(name: str) -> Path:
    """Where a packaged script's file is (the checkout's, in an editable install)."""
    return Path(str(resources.files("vlmq.shared").joinpath(name)))


def stale_scripts() -> list[str]:
    """The scripts whose generated blocks differ from what the tables give now."""
    return [name for name in SCRIPTS
            if with_blocks(text := script_path(name).read_text(encoding="utf-8")) != text]


def write_scripts() -> list[str]:
    """Regenerate every script's blocks in place; returns the files rewritten."""
    stale = stale_scripts()
    for name in stale:
        path = script_path(name)
        path.write_text(with_blocks(path.read_text(encoding="utf-8")), encoding="utf-8")
    source.cache_clear()
    return stale


def main(argv: list[str]) -> int:
    """`--write`: regenerate the blocks; `--check`: exit 1 naming the stale files."""
    if argv == ["--write"]:
        for name in write_scripts():
            print(f"rewrote {name}")
        return 0
    if argv == ["--check"]:
        stale = stale_scripts()
        for name in stale:
            print(f"{name} is out of date: run python -m vlmq.shared.lua --write")
        return 1 if stale else 0
    print("usage: python -m vlmq.shared.lua --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
