"""Through Redis and a real worker: batched output equals sequential mlx_vlm generate.

Three jobs with images of mixed sizes; the second and third are enqueued while the first
is decoding, so items of different jobs join running batches. Each item's text must be
exactly what sequential `mlx_vlm.stream_generate` gives for the same pixels at
temperature 0, decoded and cut at the same stop strings. It holds under OpenBLAS (the
default) and under the reference BLAS; each reference is computed in a process running
the same BLAS as the worker, since the two libraries round differently.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support import helpers
from tests.support.helpers import finish, wait_for
from vlmq.producer.client import Client
from vlmq.worker.model import mlx_adapter
from vlmq.worker.model.defaults import resolve
from vlmq.worker.prep import decode

pytestmark = pytest.mark.slow

PROMPT = "What is in this picture?"
MAX_SIDE = 224
SIZES = [(224, 224), (168, 112), (112, 168), (224, 140), (56, 56), (140, 224), (84, 84),
         (196, 196), (224, 112), (112, 112), (168, 224), (56, 112), (140, 140), (84, 168),
         (224, 84), (112, 56)]
# Job 1 has 10 items for a 4-row batch: once 1 is done, 9 more still have to go through,
# and jobs 2 and 3 are enqueued right then, joining the batches job 1 keeps running.
JOBS = [(0, 10, 48), (10, 13, 20), (13, 16, 24)]  # (first item, end, max_tokens)


def _images(folder: Path) -> list[Path]:
    folder.mkdir()
    out = []
    for i, (w, h) in enumerate(SIZES):
        rng = np.random.default_rng(100 + i)
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        out.append(path)
    return out


def _reference(model_dir: Path, paths: list[Path], budgets: list[int]) -> list[str]:
    from mlx_vlm import load, stream_generate

    model, processor = load(str(model_dir))
    eos = mlx_adapter.eos_token_ids(processor)
    stops = resolve(str(model.config.model_type), "generate", PROMPT, None, 0.0, None).stop
    texts = []
    for path, max_tokens in zip(paths, budgets, strict=True):
        image = decode.decode_image(path.read_bytes(), MAX_SIDE)  # the worker's own preprocessing
        prep = mlx_adapter.prepare(processor, model.config, image, PROMPT)
        *_, last = stream_generate(model, processor, prep.text, image=[image],
                                   max_tokens=max_tokens, temperature=0.0)
        tokens = list(last.token_ids)
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        text = mlx_adapter.decode(processor, tokens)
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        texts.append(text[:min(cuts)] if cuts else text)
    return texts


def _reference_under(choice: str, model_dir: Path, paths: list[Path],
                     budgets: list[int]) -> list[str]:
    """`_reference` in a fresh process whose MLX runs on the BLAS `choice`."""
    code = ("import json, sys; from pathlib import Path; from vlmq.worker.model import blas; "
            "blas.select(sys.argv[1]); from tests.e2e.test_parity_e2e import _reference; "
            "print(json.dumps(_reference(Path(sys.argv[2]), "
            "[Path(p) for p in json.loads(sys.argv[3])], json.loads(sys.argv[4]))))")
    out = subprocess.run(
        [sys.executable, "-c", code, choice, str(model_dir),
         json.dumps([str(p) for p in paths]), json.dumps(budgets)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
        timeout=300, check=True)
    texts: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return texts


@pytest.mark.parametrize("blas_choice", ["auto", "reference"])
def test_batched_jobs_match_sequential_generate(redis_url: str, tiny_model: Path,
                                                tmp_path: Path, procs: list,
                                                blas_choice: str) -> None:
    paths = _images(tmp_path / "imgs")
    budgets = [m for lo, hi, m in JOBS for _ in range(lo, hi)]
    expected = _reference_under(blas_choice, tiny_model, paths, budgets)
    assert len(set(expected)) == len(expected), "inputs must give distinct outputs"

    client = Client(redis_url)
    kw = {"prompt": PROMPT, "temperature": 0.0, "max_side": MAX_SIDE}
    (lo, hi, m), *later = JOBS
    first = client.generate(paths[lo:hi], max_tokens=m, **kw)
    proc = helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "4",
                                "--prep-threads", "2", "--blas", blas_choice)
    procs.append(proc)
    # The others join job 1 under way. The worker is held (SIGSTOP) from its first item
    # until they are enqueued, so a loaded machine, whose producer is slower than the
    # worker's decode, cannot let job 1 end first.
    wait_for(lambda: first.progress()[0] >= 1, 300, "the first item of job 1")
    proc.send_signal(signal.SIGSTOP)
    try:
        jobs = [first] + [client.generate(paths[lo:hi], max_tokens=m, **kw)
                          for lo, hi, m in later]
        assert first.progress()[0] < 10, "job 1 ended before the others were enqueued"
    finally:
        proc.send_signal(signal.SIGCONT)
    rc, out = finish(proc)
    assert rc == 0, out

    got = [r.text for job in jobs for r in job.results()]
    assert got == expected
