"""No Lua script spells a protocol number or a task/kind list: each comes from the Python
table or constant that owns it, through a generated block (shared/lua.py), so raising a
limit in Python raises it for every language at once.

The numbers a script may write itself are structural, never a rule:
- 0 and 1 (empty, first, step);
- an index: any literal between brackets (KEYS[n], ARGV[i + 2], a reply's reply[n], a
  table constructor's {[n] = ...}), and the head of a numeric for loop over the arguments
  (`for i = 6, #ARGV, 2 do`: where the arguments start and how many make one entry).
Comments and string contents are stripped before scanning, so a message or a comment may
name a number; a string that is a number and nothing else ('10000' for XADD) is one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlmq.shared import constants as C
from vlmq.shared import lua

SCRIPTS = sorted(Path(lua.__file__).parent.glob("*.lua"))
ALLOWED = {"0", "1"}
NUMBER = re.compile(r"(?<![\w.])(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")
ARG_LOOP = re.compile(r"\bfor\s+\w+\s*=\s*[^,\n]+,\s*#(?:ARGV|KEYS)\b[^\n]*?\bdo\b")
NAMES = {*C.TASKS, *C.ITEM_KINDS}


def strip(text: str) -> tuple[str, list[str]]:
    """`text` without comments and with each string literal emptied, and the strings."""
    out: list[str] = []
    strings: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("--", i):
            if text.startswith("--[[", i):
                stop = text.find("]]", i)
                i = n if stop < 0 else stop + 2
            else:
                stop = text.find("\n", i)
                i = n if stop < 0 else stop
            continue
        if text[i] in "'\"":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote:
                j += 2 if text[j] == "\\" else 1
            strings.append(text[i + 1:j])
            out.append(quote * 2)
            i = j + 1
            continue
        if text.startswith("[[", i):
            stop = text.find("]]", i)
            strings.append(text[i + 2:stop])
            out.append("''")
            i = stop + 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out), strings


def outside_blocks(text: str) -> str:
    """`text` less every generated block (keys, settings, libraries, tables)."""
    for begin, end in lua.ALL_MARKERS:
        while begin in text:
            start = text.index(begin)
            text = text[:start] + text[text.index(end, start) + len(end):]
    return text


def without_indices(code: str) -> str:
    """`code` less what the module docstring calls an index."""
    code = ARG_LOOP.sub("", code)
    while True:  # innermost brackets first: t[a[2]]
        shorter = re.sub(r"\[[^\[\]]*\]", "", code)
        if shorter == code:
            return code
        code = shorter


def literals(text: str) -> tuple[list[str], list[str]]:
    """The numbers and the task or kind names a script spells outside its blocks."""
    code, strings = strip(outside_blocks(text))
    numbers = [m.group() for m in NUMBER.finditer(without_indices(code))
               if m.group() not in ALLOWED]
    numbers += [s for s in strings if NUMBER.fullmatch(s) and s not in ALLOWED]
    return numbers, sorted(s for s in strings if s in NAMES)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_spells_no_number_or_task_and_kind_name(path: Path) -> None:
    numbers, names = literals(path.read_text(encoding="utf-8"))
    assert numbers == [], f"{path.name}: numbers outside a generated block: {numbers}"
    assert names == [], f"{path.name}: task or kind names outside a generated block: {names}"


@pytest.mark.parametrize(("code", "numbers", "names"), [
    ("if #items > 10000 then", ["10000"], []),
    ("local x = 0.5 * n", ["0.5"], []),
    ("if ttl == -2 then", ["2"], []),
    ("local k = {ocr = 1, caption = 1}", [], []),
    ("if kind ~= 'pdf' and kind ~= 'tiff' then", [], ["pdf", "tiff"]),
    ("local t = {'generate', 'extract'}", [], ["extract", "generate"]),
    ("return n + 0x40", ["0x40"], []),
    # structural: indices, the argument loop, 0 and 1, comments and strings
    ("local a = KEYS[3] .. ARGV[i + 2] .. reply[2]", [], []),
    ("for i = 6, #ARGV - 1, 2 do x = 1 end", [], []),
    ("local s = 'up to 4096 bytes' -- 64 queues", [], []),
    ("local z = {[5] = 'timeout'}", [], []),
    ("local x = 0\nlocal y = 1", [], []),
    ("redis.call('XADD', k, 'MAXLEN', '~', '10000', '*')", ["10000"], []),
])
def test_the_scan_finds_what_it_should(code: str, numbers: list[str], names: list[str]) -> None:
    assert literals(code) == (numbers, names)


def test_a_generated_block_may_hold_numbers() -> None:
    begin, end = lua.LIMITS_MARKERS
    assert literals(f"{begin}\nlocal LIMITS = {{max = 64, kinds = {{'pdf'}}}}\n{end}\n") == ([], [])


def test_every_limit_the_scripts_name_is_in_a_generated_table() -> None:
    """Each LIMITS./UNITS./CALENDAR./MESSAGES. field a script reads is one its table has."""
    tables = {"LIMITS": lua.LIMITS, "UNITS": lua.UNITS, "CALENDAR": lua.CALENDAR,
              "MESSAGES": dict(lua.messages_table())}
    for path in SCRIPTS:
        code, _ = strip(outside_blocks(path.read_text(encoding="utf-8")))
        for table, field in re.findall(r"\b(LIMITS|UNITS|CALENDAR|MESSAGES)\.(\w+)", code):
            assert field in tables[table], f"{path.name}: {table}.{field} is not generated"
