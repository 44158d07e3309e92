"""The engine's continuous batching is token-for-token identical to sequential generate."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.factories import random_image
from vlmq.worker.engine.batcher import Engine, EngineError, Finished, Request
from vlmq.worker.model import mlx_adapter

PROMPT = "Read this page."
# (job, seed, size, max_tokens): 9 items, 3 jobs, mixed sizes and budgets.
ITEMS = [
    ("job-a", 0, (224, 224), 24),
    ("job-a", 1, (168, 112), 16),
    ("job-a", 2, (112, 168), 20),
    ("job-b", 3, (224, 140), 12),
    ("job-b", 4, (56, 56), 24),
    ("job-b", 5, (140, 224), 18),
    ("job-c", 6, (84, 84), 22),
    ("job-c", 7, (196, 196), 10),
    ("job-c", 8, (224, 112), 20),
]


@dataclass
class Ref:
    prepared: mlx_adapter.Prepared
    tokens: list[int]


@pytest.fixture(scope="module")
def refs(tiny_model: Path) -> dict[tuple[str, int], Ref]:
    """Sequential mlx_vlm.stream_generate references, computed before any engine runs."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(tiny_model))
    out = {}
    for job, seed, size, max_tokens in ITEMS:
        image = random_image(seed, size)
        prep = mlx_adapter.prepare(processor, model.config, image, PROMPT)
        *_, last = stream_generate(
            model, processor, prep.text, image=[image], max_tokens=max_tokens, temperature=0.0
        )
        out[(job, seed)] = Ref(prep, list(last.token_ids))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model: Path, refs: dict) -> Iterator[Engine]:
    eng = Engine(str(tiny_model), max_batch=4, prefill_batch=2)
    info = eng.wait_ready(timeout=60)
    assert (info.model_type, info.cacheable, info.context_length) == ("qwen2_vl", True, 4096)
    yield eng
    eng.close(timeout=10)


def _req(key, prep: mlx_adapter.Prepared, max_tokens: int, **kw) -> Request:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("stop", ())
    kw.setdefault("cached_features", None)
    return Request(key=key, prepared=prep, max_tokens=max_tokens, **kw)


def _collect(engine: Engine, n: int, timeout: float = 60.0) -> dict:
    got: dict = {}
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        for f in engine.get_finished(timeout=0.2):
            assert f.key not in got
            got[f.key] = f
    assert len(got) == n, f"only {len(got)}/{n} finished"
    return got


def test_parity_with_sequential_generate_under_continuous_batching(engine: Engine, refs) -> None:
    items = [((job, seed), max_tokens) for job, seed, _, max_tokens in ITEMS]
    first, later = items[:5], items[5:]
    tokens_before = engine.state.tokens_generated
    for key, max_tokens in first:
        engine.submit(_req(key, refs[key].prepared, max_tokens))
    # Wait until decoding is under way, then add the rest mid-flight.
    deadline = time.monotonic() + 30
    early: list[Finished] = []
    while engine.state.tokens_generated == tokens_before and time.monotonic() < deadline:
        early += engine.get_finished(timeout=0.005)
    assert engine.state.tokens_generated > tokens_before
    assert engine.state.active + engine.state.waiting > 0, (
        "first wave finished before the second came")
    # A greedy row with a sampling neighbour must stay exact.
    engine.submit(_req("hot", refs[later[0][0]].prepared, 8, temperature=1.5))
    for key, max_tokens in later:
        engine.submit(_req(key, refs[key].prepared, max_tokens))
    got = {f.key: f for f in early}
    got.update(_collect(engine, len(items) + 1 - len(early)))

    for key, max_tokens in items:
        f = got[key]
        assert f.error is None
        assert f.tokens == refs[key].tokens, key
        assert f.completion_tokens == len(f.tokens) <= max_tokens
        assert f.prompt_tokens == refs[key].prepared.prompt_tokens
        assert f.finish_reason in ("stop", "length")
        assert not f.vision_cache_hit
        assert {"queue_s", "vision_s", "prefill_s", "generate_s"} <= set(f.timings)
    assert any(len(got[k].tokens) == m for k, m in items)  # budgets really bind
    assert len(got["hot"].tokens) <= 8 and got["hot"].error is None
    assert engine.stats()["peak_active"] == 4  # batches really filled, never over max_batch
    assert engine.state.active == engine.state.waiting == 0


def test_cache_hit_matches_miss_without_tower(engine: Engine, refs) -> None:
    key = ("job-a", 0)
    prep = refs[key].prepared
    stored: list[tuple[np.ndarray, str]] = []
    engine.submit(_req("miss", prep, 12, on_features=lambda a, n: stored.append((a.copy(), n))))
    miss = _collect(engine, 1)["miss"]
    assert len(stored) == 1 and stored[0][1] == "float32"

    towers = engine.state.tower_calls
    hit_prep = mlx_adapter.prepare_from_grid(
        engine.processor, engine.model_config, prep.image_grid_thw, PROMPT
    )
    assert hit_prep.pixel_values is None
    engine.submit(_req("hit", hit_prep, 12, cached_features=stored[0]))
    hit = _collect(engine, 1)["hit"]
    assert engine.state.tower_calls == towers
    assert hit.vision_cache_hit and hit.error is None
    assert hit.tokens == miss.tokens == refs[key].tokens[:12]


def test_stop_string_truncates(engine: Engine, refs) -> None:
    key = ("job-a", 0)
    ref_tokens = refs[key].tokens
    full = mlx_adapter.decode(engine.processor, ref_tokens)
    stop = mlx_adapter.decode(engine.processor, ref_tokens[4:6])
    assert stop and full.find(stop) > 0
    engine.submit(_req("stopped", refs[key].prepared, len(ref_tokens), stop=("NEVER-SEEN", stop)))
    f = _collect(engine, 1)["stopped"]
    assert f.finish_reason == "stop" and f.error is None
    assert f.text == full[: full.find(stop)]
    assert f.tokens == ref_tokens[: len(f.tokens)]
    assert len(f.tokens) < len(ref_tokens)


def test_overlong_prompt_fails_alone(engine: Engine, refs) -> None:
    long_prep = mlx_adapter.prepare(engine.processor, engine.model_config, None, "word " * 5000)
    assert long_prep.prompt_tokens > engine.info.context_length
    ok = ("job-b", 3)
    engine.submit(_req("long", long_prep, 8))
    engine.submit(_req("ok", refs[ok].prepared, 12))
    got = _collect(engine, 2)
    assert got["long"].error is not None and "context" in got["long"].error
    assert got["long"].finish_reason == "error"
    assert got["ok"].error is None and got["ok"].tokens == refs[ok].tokens
    assert engine.state.waiting == engine.state.active == 0


TEXT_PROMPTS = ["You are a helpful assistant.\n\nHello world!", "Count to ten.",
                "Write a haiku about queues."]


@pytest.fixture(scope="module")
def text_refs(tiny_model: Path) -> list[Ref]:
    """Sequential references for text-only prompts (no image at all)."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(tiny_model))
    out = []
    for prompt in TEXT_PROMPTS:
        prep = mlx_adapter.prepare(processor, model.config, None, prompt)
        *_, last = stream_generate(model, processor, prep.text, image=None, max_tokens=16,
                                   temperature=0.0)
        out.append(Ref(prep, list(last.token_ids)))
    return out


def test_text_only_rows_share_the_batch_with_image_rows(text_refs: list[Ref],
                                                        engine: Engine, refs) -> None:
    """An OpenAI text-only line is a row with no image: batched beside image rows it
    gives its sequential tokens, and only the image rows call the tower."""
    images = [("job-a", 1), ("job-b", 4), ("job-c", 6)]
    towers = engine.state.tower_calls
    keys: list[Any] = []
    for i, text in enumerate(text_refs):  # text and image rows interleaved, all at once
        engine.submit(_req(("text", i), text.prepared, 16))
        engine.submit(_req(images[i], refs[images[i]].prepared, 16))
        keys += [("text", i), images[i]]
    got = _collect(engine, len(keys))
    for i, text in enumerate(text_refs):
        assert got[("text", i)].error is None and got[("text", i)].tokens == text.tokens
    for key in images:
        assert got[key].tokens == refs[key].tokens[:16]
    assert engine.state.tower_calls - towers == len(images)


def test_bad_cached_features_fail_alone(engine: Engine, refs) -> None:
    prep = refs[("job-c", 6)].prepared
    hit_prep = mlx_adapter.prepare_from_grid(
        engine.processor, engine.model_config, prep.image_grid_thw, PROMPT
    )
    wrong = (np.zeros((3, 128), dtype=np.float32), "float32")  # wrong token count
    engine.submit(_req("bad", hit_prep, 8, cached_features=wrong))
    engine.submit(_req("good", prep, 8))
    got = _collect(engine, 2)
    assert got["bad"].error is not None
    assert got["good"].tokens == refs[("job-c", 6)].tokens[:8]


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    eng = Engine(str(tmp_path / "nope"), max_batch=2)
    with pytest.raises(EngineError, match=r"model folder .*nope does not exist"):
        eng.wait_ready(timeout=60)
    with pytest.raises(EngineError, match="no model"):
        eng.submit(_req("x", mlx_adapter.Prepared(text="", input_ids=np.zeros(1, np.int32)), 1))
    eng.close(timeout=5)


def test_lower_priority_number_is_admitted_first(tiny_model: Path, refs: dict) -> None:
    """Queued requests wait for a free row by priority (the worker's items-left), not FIFO.

    Submitted before the model has loaded, all four wait together; with one row they run
    one at a time, so the finish order is the admission order.
    """
    eng = Engine(str(tiny_model), max_batch=1)
    try:
        (job, seed, _, _) = ITEMS[0]
        prep = refs[(job, seed)].prepared
        for key, priority in (("big-1", 24), ("big-2", 24), ("small", 1), ("mid", 3)):
            eng.submit(_req(key, prep, 2, priority=priority))
        eng.wait_ready(timeout=60)
        order: list = []
        deadline = time.monotonic() + 60
        while len(order) < 4 and time.monotonic() < deadline:
            order += [f.key for f in eng.get_finished(timeout=0.2)]
    finally:
        eng.close(timeout=10)
    assert order == ["small", "mid", "big-1", "big-2"]


_SIGNALLED_WAIT = """
import queue, signal, sys
from vlmq.worker.engine.batcher import EngineState
outbox = EngineState().outbox
seen = []
stop = []
signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
signal.signal(signal.SIGUSR2, lambda *_: stop.append(1))
print("ready", flush=True)
while not stop:
    try:
        outbox.get(timeout=0.01)  # what the worker's main loop does while it idles
    except queue.Empty:
        pass
print("done", len(seen), flush=True)
"""


def test_a_signal_during_the_main_loops_wait_never_wedges_it() -> None:
    """The main thread waits on the outbox with a timeout, and SIGTERM lands there. On
    CPython 3.11 a SimpleQueue.get(timeout=) interrupted by a signal can block for good
    (a worker that never stopped, 1 stop in 4 right after start); the outbox must return."""
    import random
    import signal
    import subprocess
    import sys

    signals = 300
    proc = subprocess.Popen([sys.executable, "-c", _SIGNALLED_WAIT, str(signals)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        rng = random.Random(0)
        for _ in range(signals):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(rng.uniform(0.001, 0.012))
        # Signals sent faster than a loaded machine runs the child coalesce, so the
        # child is not asked to count them: a last, distinct signal tells it to stop,
        # and a wedged get() would never see it.
        proc.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    word, handled = out.split()
    assert word == "done" and int(handled) > 0
