"""Every script vlmq runs is a packaged .lua file, loaded through shared/lua.py alone."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

from redis import Redis

from vlmq.shared import lua

ROOT = Path(__file__).resolve().parents[2]
NAMES = [v for k, v in vars(lua).items() if k.isupper() and isinstance(v, str)]
# What marks a string as Lua source: a call into the server.
LUA_CALL = re.compile(r"redis\.(p?call)\s*\(")


def test_every_script_is_packaged_and_compiles(redis: Redis) -> None:
    packaged = {p.name for p in resources.files("vlmq.shared").iterdir()
                if p.name.endswith(".lua")}
    assert set(NAMES) == packaged
    for name in NAMES:
        sha = redis.script_load(lua.source(name))  # a syntax error raises here
        assert lua.script(redis, name).sha == sha


def test_no_inline_lua_in_the_source() -> None:
    """Scripts live in files (reviewable as Lua, readable by other languages), not in
    Python strings, and only shared/lua.py registers them."""
    for top in ("producer", "worker", "shared", "cli", "media", "stores"):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            strings = [n.value for n in ast.walk(ast.parse(text))
                       if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            assert not any(LUA_CALL.search(s) for s in strings), path
            if path != ROOT / "shared" / "lua.py":
                assert "register_script(" not in text, path
