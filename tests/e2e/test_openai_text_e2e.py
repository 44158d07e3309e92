"""Through Redis and a real worker: an OpenAI batch file mixing text-only and image lines.

Text-only lines (OpenAI's Batch guide writes them so) are text items: the prompt alone,
no image, no tower. The worker runs them in the same continuous batch as the image
lines, and each answer must be exactly what sequential `mlx_vlm.stream_generate` gives
at temperature 0 (cut at the same stop strings), every 200 a strict ChatCompletion. The
reference runs in a process on the worker's BLAS, since BLAS libraries round differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types.chat import ChatCompletion
from PIL import Image

from tests.support import helpers
from tests.support.helpers import finish
from vlmq.worker.job_settings import DEFAULT_IMAGE_MAX_SIDE
from vlmq.worker.model import mlx_adapter
from vlmq.worker.model.defaults import resolve
from vlmq.worker.prep import decode

pytestmark = pytest.mark.slow

URL = "/v1/chat/completions"
SYSTEM = "You are a helpful assistant."
IMAGE_PROMPT = "What is in this image?"
# (custom_id, user text, image index or None, max_tokens): text lines between image lines.
LINES = [
    ("img-0", IMAGE_PROMPT, 0, 24),
    ("text-0", "Hello world!", None, 24),
    ("img-1", IMAGE_PROMPT, 1, 16),
    ("text-1", "Write a haiku about queues.", None, 20),
    ("img-2", IMAGE_PROMPT, 2, 20),
    ("text-2", "Count to ten.", None, 12),
    ("img-3", IMAGE_PROMPT, 3, 18),
]


def _line(custom_id: str, text: str, image: Path | None, max_tokens: int) -> dict[str, Any]:
    content: Any = text if image is None else [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {
            "url": f"file://{image}"}}]
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {
        "model": "gpt-4o-mini", "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": content}]}}


def _images(folder: Path) -> list[Path]:
    folder.mkdir()
    out = []
    for i, (w, h) in enumerate([(224, 168), (112, 112), (168, 224), (84, 140)]):
        rng = np.random.default_rng(300 + i)
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        out.append(path)
    return out


def _reference(model_dir: Path, requests: list[tuple[str, str | None, int]]) -> list[str]:
    """Sequential generate of each (prompt, image path or None, max_tokens), prepared as
    the worker prepares it."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(model_dir))
    eos = mlx_adapter.eos_token_ids(processor)
    texts = []
    for prompt, path, max_tokens in requests:
        image = (None if path is None
                 else decode.decode_image(Path(path).read_bytes(), DEFAULT_IMAGE_MAX_SIDE))
        prep = mlx_adapter.prepare(processor, model.config, image, prompt)
        *_, last = stream_generate(model, processor, prep.text,
                                   image=None if image is None else [image],
                                   max_tokens=max_tokens, temperature=0.0)
        tokens = list(last.token_ids)
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        text = mlx_adapter.decode(processor, tokens)
        stops = resolve(str(model.config.model_type), "generate", prompt, None, 0.0,
                        None).stop
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        texts.append(text[:min(cuts)] if cuts else text)
    return texts


def _reference_under(choice: str, model_dir: Path,
                     requests: list[tuple[str, str | None, int]]) -> list[str]:
    """`_reference` in a fresh process whose MLX runs on the BLAS `choice`."""
    code = ("import json, sys; from pathlib import Path; from vlmq.worker.model import blas; "
            "blas.select(sys.argv[1]); from tests.e2e.test_openai_text_e2e import _reference; "
            "print(json.dumps(_reference(Path(sys.argv[2]), "
            "[tuple(r) for r in json.loads(sys.argv[3])])))")
    out = subprocess.run(
        [sys.executable, "-c", code, choice, str(model_dir), json.dumps(requests)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
        timeout=300, check=True)
    texts: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return texts


def test_text_only_lines_batched_with_image_lines_match_sequential_generate(
        redis_url: str, tiny_model: Path, tmp_path: Path, procs: list) -> None:
    images = _images(tmp_path / "imgs")
    lines = [_line(cid, text, None if i is None else images[i], m)
             for cid, text, i, m in LINES]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    # The worker flattens system and user text into one prompt, a blank line apart.
    expected = _reference_under("auto", tiny_model, [
        (f"{SYSTEM}\n\n{text}", None if i is None else str(images[i]), m)
        for _, text, i, m in LINES])
    assert len(set(expected)) == len(expected), "inputs must give distinct outputs"

    made = json.loads(helpers.invoke_cli(redis_url, "enqueue", "--openai-batch",
                                         str(requests), "--json").stdout)
    # Lines share a job by max_tokens, each item with its own prompt (five jobs, two of
    # them holding a text and an image line): all queued before the worker starts, so its
    # 4-row batch takes rows of several jobs, text and image alike.
    assert len(made["jobs"]) == len({m for *_, m in LINES}) == 5
    proc = helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch",
                                "4", "--blas", "auto")
    procs.append(proc)
    rc, log = finish(proc, timeout=300)
    assert rc == 0, log

    res = helpers.invoke_cli(redis_url, "result", made["batch"], "--format", "openai-batch")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    out = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["custom_id"] for x in out] == [cid for cid, *_ in LINES]
    got = []
    for entry in out:
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(entry["response"]["body"], strict=True)
        assert body.choices[0].finish_reason in ("stop", "length")
        got.append(body.choices[0].message.content)
    assert got == expected
