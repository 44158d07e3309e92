"""Every Lua script vlmq runs is a packaged file beside this module, loaded here.

One way keeps them reviewable as Lua, shipped in the wheel (package data `*.lua`) and
readable by other-language clients from the same file (enqueue.lua is part of the
protocol). Scripts are registered, not EVALed: redis-py then sends EVALSHA and loads the
source only when the server does not have it, including inside a pipeline.

No script spells a key name or a setting's range by hand: each file carries generated
blocks, the key names it uses (from shared/keys.py's KEY_TABLE) and, in enqueue.lua, the
settings table (shared/settings.py) and the limits (shared/constants.py). The blocks live
in the files themselves, not only in what Python loads, because other languages'
producers read the files from disk.
`python -m vlmq.shared.lua --write` regenerates them; `--check` (and
tests/protocol/test_key_table.py) fails while a file differs from what the tables give.
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
from vlmq.shared import settings as S
from vlmq.shared.keys import KEY, KeyName

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
SCRIPTS = (ENQUEUE, END_JOB, WRITE_ITEMS, RESULT_CACHE_STORE, RESULT_CACHE_LOOKUP,
           SCHEDULE_CLAIM, BLOB_EXTEND_TTL, TALLY, FAIR_TAKE, QUEUE_CENSUS)
# The running counts' functions (PROTOCOL.md 8b), one file copied into every script that
# changes a job, between these markers: each change and its counts land in one script.
TALLY_LIB = "tally_lib.lua"
TALLY_MARKERS = ("-- BEGIN TALLY", "-- END TALLY")

# The key block's first and last line (a tuple: lua's str constants are the script names).
KEY_MARKERS = ("-- BEGIN KEYS", "-- END KEYS")
# The limits block: protocol limits a script enforces that are no payload setting (the
# queue count, issue 29), from shared/constants.py, so Lua and Python refuse at one number.
LIMITS_MARKERS = ("-- BEGIN LIMITS", "-- END LIMITS")
LIMITS: dict[str, int | str] = {"max_queues": C.MAX_QUEUES, "ended_events_s": C.ENDED_EVENTS_S,
                                 "moved_data": C.MOVED_DATA, "fair_field": C.FAIR_FIELD,
                                 "loose_share": C.LOOSE_SHARE,
                                 "tenant_label": C.TENANT_LABEL,
                                 "tenant_share": C.TENANT_SHARE,
                                 "items_field": C.ITEMS_FIELD,
                                 "max_items": C.MAX_ITEMS_PER_JOB}
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


def tally_block() -> str:
    """The tally block: shared/tally_lib.lua between its markers."""
    begin, end = TALLY_MARKERS
    lib = script_path(TALLY_LIB).read_text(encoding="utf-8").rstrip("\n")
    return "\n".join([f"{begin}: copied from vlmq/shared/{TALLY_LIB} by "
                      "`python -m vlmq.shared.lua --write`; do not edit by hand.", lib, end])


def limits_block() -> str:
    """The limits block: `local LIMITS = {...}` from LIMITS."""
    begin, end = LIMITS_MARKERS
    # json.dumps: a number as it is, a string quoted (a JSON string is a Lua string)
    fields = ", ".join(f"{name} = {json.dumps(value)}" for name, value in LIMITS.items())
    return "\n".join([f"{begin}: generated from vlmq/shared/constants.py by "
                      "`python -m vlmq.shared.lua --write`; do not edit by hand.",
                      f"local LIMITS = {{{fields}}}", end])


def _replace_block(text: str, markers: tuple[str, str], block: str) -> str:
    begin, end = markers
    start = text.rfind("\n", 0, text.index(begin)) + 1
    stop = text.index(end) + len(end)
    return text[:start] + block + text[stop:]


def with_blocks(script_text: str) -> str:
    """`script_text` with each generated block it has replaced by the current one (the
    tally block first: the key block names the keys it uses too)."""
    out, (begin, end) = script_text, KEY_MARKERS
    if TALLY_MARKERS[0] in out:
        out = _replace_block(out, TALLY_MARKERS, tally_block())
    if LIMITS_MARKERS[0] in out:
        out = _replace_block(out, LIMITS_MARKERS, limits_block())
    if begin in out:
        start = out.rfind("\n", 0, out.index(begin)) + 1
        stop = out.index(end) + len(end)
        out = out[:start] + key_block(out) + out[stop:]
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
