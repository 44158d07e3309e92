"""The documents' tables cannot drift from the code: generated blocks (keys, settings) equal
what shared/docs_tables.py makes of the tables now, and the checkpoint table (a checked
block, prose kept by hand) agrees with the families' presets and specs. Blocks are found
wherever they live: README.md, shared/PROTOCOL.md or a docs/*.md page."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from vlmq.shared import docs_tables
from vlmq.shared import settings as S
from vlmq.shared.keys import KEY_TABLE
from vlmq.worker.model import families
from vlmq.worker.model.defaults import preset_for
from vlmq.worker.model.mlx_adapter import REFUSED

CHECKED = re.compile(r"<!-- checked: ([a-z-]+) -->\n(.*?)<!-- /checked -->", re.DOTALL)
REQUIRED_CHECKED = {"checkpoints"}
QUOTED = re.compile(r'"([^"]*)"')
TOKENS = re.compile(r"\b(\d+) tokens\b")


def _texts() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in docs_tables.documents()}


def test_every_generated_block_is_somewhere_and_current() -> None:
    found = {name for text in _texts().values() for name in docs_tables.blocks_in(text)}
    assert found >= set(docs_tables.BLOCKS), f"missing blocks: {set(docs_tables.BLOCKS) - found}"
    assert docs_tables.stale() == [], "run python -m vlmq.shared.docs_tables --write"


def test_a_changed_default_makes_the_document_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a new default in the settings row changes the block."""
    text = (docs_tables.ROOT / "shared" / "PROTOCOL.md").read_text(encoding="utf-8")
    changed = tuple(replace(s, default=7200) if s.name == "keep_inputs" else s
                    for s in S.WIRE)
    monkeypatch.setattr(S, "WIRE", changed)
    assert docs_tables.with_blocks(text) != text
    assert "`7200`" in docs_tables.settings_table()


def test_a_renamed_key_makes_the_document_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (docs_tables.ROOT / "shared" / "PROTOCOL.md").read_text(encoding="utf-8")
    first = KEY_TABLE[0]
    renamed = (replace(first, pattern="{prefix}:blobs:{sha256}"), *KEY_TABLE[1:])
    monkeypatch.setattr(docs_tables, "KEY_TABLE", renamed)
    assert docs_tables.with_blocks(text) != text


def test_the_settings_block_gives_each_rows_bounds_and_default() -> None:
    table = docs_tables.settings_table()
    for s in S.WIRE:
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| `{s.wire}` |"))
        assert s.doc and s.doc in line
        for bound in (s.lo, s.hi, s.max_len, s.max_count):
            if bound is not None and s.kind != "float":
                assert f"{int(bound):,}" in line, (s.name, bound)


def _checkpoint_rows() -> list[list[str]]:
    blocks = [m.group(2) for text in _texts().values() for m in CHECKED.finditer(text)
              if m.group(1) == "checkpoints"]
    assert len(blocks) == 1, "one `<!-- checked: checkpoints -->` block, in README or docs/"
    lines = [ln for ln in blocks[0].splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_every_checked_block_is_somewhere() -> None:
    found = {m.group(1) for text in _texts().values() for m in CHECKED.finditer(text)}
    assert found >= REQUIRED_CHECKED


def test_the_checkpoint_table_follows_the_families() -> None:
    """Each row names a preset of its family (or a refused type), says what the family's
    spec says about batching and caching, and quotes the preset's own prompt and budget;
    every preset and every refused type has a row."""
    seen: set[tuple[str, str]] = set()
    for model_id, family, task, batched, cached, note in _checkpoint_rows():
        if family in REFUSED:
            assert (batched, cached) == ("refused", "-"), model_id
            seen.add((family, ""))
            continue
        spec = families.get(family).spec
        preset = preset_for(family, model_id)
        assert preset is not None, f"{model_id}: no preset of {family} matches it"
        seen.add((family, preset.name))
        row = preset.rows[task]
        assert batched == ("yes (prompts prefilled one at a time)" if spec.prefill_one
                           else "yes"), model_id
        assert cached == ("yes" if spec.cacheable else "no"), model_id
        for quoted in QUOTED.findall(note):
            assert quoted == row.prompt, (model_id, quoted, row.prompt)
        for tokens in TOKENS.findall(note):
            assert int(tokens) == row.max_tokens, (model_id, tokens, row.max_tokens)
        assert ("image-only prompt" in note) == (row.prompt == ""), model_id
    wanted = {(f.model_type, p.name) for f in families.FAMILIES.values() for p in f.presets}
    wanted |= {(name, "") for name in REFUSED}
    assert seen == wanted, f"rows missing: {wanted - seen}; rows extra: {seen - wanted}"
