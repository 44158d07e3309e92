"""The repetition guard: looping rows are cut (or retried), the rest of the batch is exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmq.producer.options import JobOptions
from vlmq.worker.engine.batcher import Engine, Finished, Request
from vlmq.worker.engine.repetition import RepetitionGuard
from vlmq.worker.model import mlx_adapter
from vlmq.worker.model.tiny import build_tiny_model

# Small enough that the tiny random gemma3 (which loops readily) trips it in 64 tokens;
# a single token must repeat 12 times, so short runs are left alone.
GUARD = RepetitionGuard(max_period=8, min_repeats=4, min_span=12)
MAX_TOKENS = 64
PROMPT = "Read this page."


def test_find_cuts_after_the_first_copy_and_needs_enough_repeats() -> None:
    g = RepetitionGuard(max_period=4, min_repeats=3, min_span=6)
    assert g.find([1, 2, 3]) is None
    # "7 8" three times after a prefix: period 2, keep the prefix and one copy.
    assert g.find([1, 2, 3, 7, 8, 7, 8, 7, 8]) == (2, 5)
    # A single token needs min_span (6) repeats, not just min_repeats (3).
    assert g.find([5, 9, 9, 9, 9, 9]) is None
    assert g.find([5, 9, 9, 9, 9, 9, 9]) == (1, 2)
    # Periods beyond max_period are not loops.
    block = [1, 2, 3, 4, 5]
    assert g.find(block * 4) is None
    assert RepetitionGuard(max_period=5, min_repeats=3, min_span=6).find(block * 3) == (5, 5)
    with pytest.raises(ValueError, match="on_repetition"):
        RepetitionGuard(on_repetition="ignore")


def _first_loop(tokens: list[int]) -> tuple[int, int] | None:
    """(tokens generated when the guard fires, tokens kept), replaying a finished row."""
    for n in range(2, len(tokens) + 1):
        hit = GUARD.find(tokens[:n])
        if hit is not None:
            return n, hit[1]
    return None


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3")


@pytest.fixture(scope="module")
def refs(gemma: Path) -> list[tuple[mlx_adapter.Prepared, list[int]]]:
    """Six items, some looping and some not, with their sequential tokens.

    Which random image loops depends on the BLAS's rounding, so candidates are drawn until
    both kinds are present (a random tiny model loops on most of them).
    """
    from mlx_vlm import load, stream_generate

    model, processor = load(str(gemma))
    looping: list[tuple[mlx_adapter.Prepared, list[int]]] = []
    plain: list[tuple[mlx_adapter.Prepared, list[int]]] = []
    for i in range(32):
        image = Image.fromarray(
            np.random.default_rng(i).integers(0, 256, (112, 112, 3), dtype=np.uint8))
        prep = mlx_adapter.prepare(processor, model.config, image, PROMPT)
        *_, last = stream_generate(model, processor, prep.text, image=[image],
                                   max_tokens=MAX_TOKENS, temperature=0.0)
        (looping if _first_loop(list(last.token_ids)) else plain).append(
            (prep, list(last.token_ids)))
        if plain and len(plain) + len(looping) >= 6 and looping:
            break
    picked = plain[:2] + looping[:6 - len(plain[:2])]
    return [picked[k] for k in (1, 0, 2, 3, 4, 5) if k < len(picked)]


def _run(model: Path, refs: list[tuple[mlx_adapter.Prepared, list[int]]],
         guard: RepetitionGuard) -> dict[int, Finished]:
    engine = Engine(str(model), max_batch=4, repetition=guard)
    engine.wait_ready(timeout=60)
    try:
        for i, (prep, _) in enumerate(refs):
            engine.submit(Request(key=i, prepared=prep, cached_features=None,
                                  max_tokens=MAX_TOKENS, temperature=0.0, stop=()))
        got: dict[int, Finished] = {}
        deadline = time.monotonic() + 120
        while len(got) < len(refs) and time.monotonic() < deadline:
            got.update({int(f.key): f for f in engine.get_finished(0.5)})  # type: ignore[call-overload]
        assert len(got) == len(refs)
        assert engine.stats()["repetitions"] >= 1
        assert engine.state.active == 0 and engine.state.waiting == 0  # every slot was freed
        return got
    finally:
        engine.close(timeout=30)


@pytest.fixture
def loops(refs: list[tuple[mlx_adapter.Prepared, list[int]]]) -> Iterator[dict[int, tuple[int,
                                                                                          int]]]:
    found = {i: hit for i, (_, tokens) in enumerate(refs) if (hit := _first_loop(tokens))}
    assert 0 < len(found) < len(refs), "need looping and non-looping items in one batch"
    yield found


def test_a_looping_row_is_cut_and_its_batch_neighbours_are_exact(
        gemma: Path, refs: list[tuple[mlx_adapter.Prepared, list[int]]],
        loops: dict[int, tuple[int, int]]) -> None:
    got = _run(gemma, refs, GUARD)
    model_refs = {i: tokens for i, (_, tokens) in enumerate(refs)}
    from mlx_vlm import load

    _, processor = load(str(gemma))
    saved = 0
    for i, fin in got.items():
        assert fin.error is None
        if i in loops:
            fired_at, keep = loops[i]
            assert fin.finish_reason == "repetition"
            assert fin.tokens == model_refs[i][:fired_at]  # stopped the step it looped
            assert fin.text == mlx_adapter.decode(processor, model_refs[i][:keep])
            assert fin.repetition is not None and "cut at token" in fin.repetition
            saved += MAX_TOKENS - fired_at
        else:
            assert fin.tokens == model_refs[i]  # untouched: token-identical to generate
            assert fin.finish_reason in ("stop", "length") and fin.repetition is None
    assert saved > 0


def test_retry_reruns_a_looping_item_once_hotter_and_says_so(
        gemma: Path, refs: list[tuple[mlx_adapter.Prepared, list[int]]],
        loops: dict[int, tuple[int, int]]) -> None:
    retry = RepetitionGuard(max_period=8, min_repeats=4, min_span=12, on_repetition="retry")
    got = _run(gemma, refs, retry)
    for i, fin in got.items():
        assert fin.error is None
        if i in loops:
            assert fin.repetition is not None
            assert "retried at temperature 0.7" in fin.repetition
            assert fin.finish_reason in ("stop", "length", "repetition")
        else:
            assert fin.tokens == refs[i][1] and fin.repetition is None


def test_worker_writes_the_repetition_outcome_into_item_results(
        gemma: Path, redis_url: str, tmp_path: Path) -> None:
    """Through Redis and a real worker: CLI flags reach the guard, results say what it did."""
    from vlmq.producer.client import Client


    paths = []
    for i in range(4):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (112, 112, 3),
                                                          dtype=np.uint8)).save(path)
        paths.append(path)
    job = Client(redis_url).generate(paths, PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     max_side=112)
    _run_guarded_worker(redis_url, gemma, tmp_path)
    results = list(job.results())
    looped = [r for r in results if r.finish_reason == "repetition"]
    assert looped, [r.finish_reason for r in results]
    for r in results:
        assert r.error is None
        assert (r.repetition is not None) == (r.finish_reason == "repetition")
        if r.repetition is not None:
            assert "cut at token" in r.repetition and r.completion_tokens < MAX_TOKENS


def test_a_page_cut_for_repetition_falls_back_to_its_text_layer(
        gemma: Path, redis_url: str, tmp_path: Path) -> None:
    """text_layer fallback (the default) on born-digital pages the guard cuts in an ocr
    job: the item keeps the model's cut text and the guard's note, and its text is the
    page's layer."""
    import fpdf

    from vlmq.producer.client import Client


    words = "The ledger lists payments to suppliers and the totals for each month."
    pdf = fpdf.FPDF(unit="mm", format=(148, 210))
    for i in range(4):
        pdf.add_page()
        noise = np.random.default_rng(10 + i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        pdf.image(Image.fromarray(noise), x=10, y=80, w=60, h=60)  # under half the page
        pdf.set_font("helvetica", size=11)
        pdf.set_xy(10, 10)
        pdf.multi_cell(120, 6, f"{words} Page {i + 1}.")
    path = tmp_path / "ledger.pdf"
    pdf.output(str(path))
    client = Client(redis_url)
    job = client.submit("ocr", [path], JobOptions(
        prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, max_side=112))
    plain = client.submit("ocr", [path], JobOptions(
        prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, max_side=112,
        text_layer="off"))
    _run_guarded_worker(redis_url, gemma, tmp_path)
    cut = [r for r in plain.results() if r.finish_reason == "repetition"]
    assert cut, [r.finish_reason for r in plain.results()]
    by_page = {r.page: r for r in job.results()}
    for model in cut:
        r = by_page[model.page]
        assert r.ok and r.finish_reason == "repetition" and r.repetition == model.repetition
        assert r.text_source == "text_layer" and r.model_text == model.text
        assert " ".join((r.text or "").split()) == f"{words} Page {model.page}."


def _run_guarded_worker(redis_url: str, gemma: Path, tmp_path: Path) -> None:
    """A burst worker whose repetition guard trips on the tiny gemma3 within MAX_TOKENS."""
    from tests.support import helpers

    proc = helpers.start_worker(redis_url, gemma, tmp_path, "--burst", "--max-batch", "4",
                                "--repetition-repeats", "4", "--repetition-period", "8",
                                "--repetition-min-span", "12")
    try:
        rc, out = helpers.finish(proc, timeout=240)
    finally:
        helpers.stop_all([proc])
    assert rc == 0, out
