"""Every Lua script vlmq runs is a packaged file beside this module, loaded here.

One way keeps them reviewable as Lua, shipped in the wheel (package data `*.lua`) and
readable by other-language clients from the same file (enqueue.lua is part of the
protocol). Scripts are registered, not EVALed: redis-py then sends EVALSHA and loads the
source only when the server does not have it, including inside a pipeline.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis import Redis
from redis.commands.core import Script

# The scripts, by file name (each file's header says its KEYS, ARGV and reply).
ENQUEUE = "enqueue.lua"
END_JOB = "end_job.lua"
WRITE_ITEMS = "write_items.lua"
RESULT_CACHE_STORE = "result_cache_store.lua"
RESULT_CACHE_LOOKUP = "result_cache_lookup.lua"
SCHEDULE_CLAIM = "schedule_claim.lua"
BLOB_EXTEND_TTL = "blob_extend_ttl.lua"


@cache
def source(name: str) -> str:
    """The text of a packaged script; read once per process."""
    return resources.files("vlmq.shared").joinpath(name).read_text(encoding="utf-8")


def script(redis: Redis, name: str) -> Script:
    """A packaged script bound to `redis`; call it with keys=, args= (and client= for a
    pipeline)."""
    return redis.register_script(source(name))
