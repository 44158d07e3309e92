"""Lines that differ only in their prompt share a job, each item with its own prompt,
through Redis and a real worker (the tiny model): the output answers every custom_id with
its own text, in input order, and at temperature 0 exactly the text the same file gives
enqueued a job per line (job_size 1, each job's prompt its one line's), every 200 a strict
ChatCompletion. Image lines and text-only lines alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from tests.support import helpers
from tests.support.helpers import finish
from vlmq.producer.client import Client
from vlmq.producer.openai_files import submit_openai_batch
from vlmq.producer.ops.output_formats import JobResults, openai_output
from vlmq.producer.options import JobOptions

pytestmark = pytest.mark.slow

URL = "/v1/chat/completions"
PROMPTS = ["Hello world!", "Write a haiku about queues.", "Count to ten.",
           "Name three colors.", "What is Redis?", "Say yes."]
IMAGE_PROMPTS = ["What is in this image?", "Describe the colors."]


def _line(custom_id: str, text: str, image: Path | None) -> dict[str, Any]:
    content: Any = text if image is None else [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": f"file://{image}"}}]
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {
        "model": "gpt-4o-mini", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "user", "content": content}]}}


def _answers(client: Client, batch_id: str) -> list[tuple[str, str]]:
    views = [JobResults.read(j) for j in client.batch(batch_id).jobs()]
    out = []
    for ok, raw in openai_output(views):
        entry = json.loads(raw)
        assert ok and entry["error"] is None, entry
        body = ChatCompletion.model_validate(entry["response"]["body"], strict=True)
        out.append((entry["custom_id"], body.choices[0].message.content or ""))
    return out


def test_lines_sharing_a_job_answer_as_a_job_each_would(
        redis_url: str, tiny_model: Path, tmp_path: Path, procs: list[Any]) -> None:
    images = helpers.make_images(tmp_path / "imgs", len(IMAGE_PROMPTS))
    lines = [_line(f"text-{i}", p, None) for i, p in enumerate(PROMPTS)]
    lines[2:2] = [_line(f"img-{i}", p, images[i]) for i, p in enumerate(IMAGE_PROMPTS)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    order = [x["custom_id"] for x in lines]
    # No result cache: the second run must generate, not read the first one's texts.
    base = JobOptions.build(result_cache="off")
    with Client(redis_url) as client:
        shared, _ = submit_openai_batch(client, path, options=base)
        alone, _ = submit_openai_batch(client, path, options=base, job_size=1)
        (job,) = shared.jobs()
        payload = job.payload()
        assert len(payload.items) == len(lines)
        assert sum(i.prompt is not None for i in payload.items) == len(lines) - 1
        assert len(alone.job_ids()) == len(lines)
        assert all(i.prompt is None for j in alone.jobs() for i in j.payload().items)
        procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                          "--max-batch", "4"))
        rc, log = finish(procs[-1], timeout=300)
        assert rc == 0, log
        got, expected = _answers(client, shared.id), _answers(client, alone.id)
    assert [cid for cid, _ in got] == order
    assert got == expected
    assert len({text for _, text in got}) > 1, "distinct prompts gave one answer"
