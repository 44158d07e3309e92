"""Lines that share a model and settings share jobs whatever their prompts: each item
carries its own prompt where it is not its job's (the prompt most of its items have), the
file's record keeps every custom_id's line, and a job's prompts stay a bounded part of its
payload. Redis then holds a line of distinct prompts in a small multiple of what a line of
identical prompts costs (it held a job: ~3 kB)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from redis import Redis

from tests.producer.test_openai_batch import SCHEMA, line, png_uri
from vlmq.producer.client import Client
from vlmq.producer.job_sets import Part
from vlmq.producer.manifest import MAX_JOB_PROMPT_BYTES
from vlmq.producer.openai_files import FileRecord, read_batch_file, submit_openai_batch
from vlmq.producer.options import JobOptions

URL = "/v1/chat/completions"


def text_line(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {
        "model": "gpt-4o-mini", "max_tokens": 8,
        "messages": [{"role": "user", "content": text}], **body}}


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def test_lines_differing_in_prompt_share_a_job(tmp_path: Path) -> None:
    extract = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    lines = [text_line("t0", "Say one."), line("i0", png_uri(1), "Describe it.", max_tokens=8,
                                               model="gpt-4o-mini"),
             text_line("t1", "Say two."), text_line("t2", "Say one."),
             line("i1", png_uri(2), "What is it?", max_tokens=8, model="gpt-4o-mini"),
             text_line("t3", "Say one.", max_tokens=9),  # other settings: its own job
             line("e0", png_uri(3), "", response_format=extract),  # no prompt: the schema's
             line("e1", png_uri(4), "Read the title.", response_format=extract)]
    read = read_batch_file(write(tmp_path / "in.jsonl", lines), JobOptions(), spool=tmp_path)
    jobs = [(g.task, g.options.prompt, [(i.custom_id, i.prompt) for i in g.prepared.items])
            for g in read.groups]
    assert jobs == [
        ("generate", "Say one.", [("t0", None), ("i0", "Describe it."), ("t1", "Say two."),
                                  ("t2", None), ("i1", "What is it?")]),
        ("generate", "Say one.", [("t3", None)]),
        ("extract", None, [("e0", None)]),
        ("extract", "Read the title.", [("e1", None)])]
    # The payload carries them; the record puts every line back in its place.
    group = read.groups[0]
    wire, parsed = group.options.payload(group.task, group.prepared.items)
    assert [i.get("prompt") for i in wire["items"]] == [None, "Describe it.", "Say two.",
                                                        None, "What is it?"]
    assert [i.prompt for i in parsed.items] == [None, "Describe it.", "Say two.", None,
                                                "What is it?"]
    record = FileRecord.of(read, [Part(g.task, g.prepared, g.options) for g in read.groups],
                           ["a", "b", "c", "d"])
    assert record.jobs["a"][0] == (1, 2, 3, 4, 5) and record.jobs["b"][0] == (6,)


def test_a_jobs_prompts_stay_a_bounded_part_of_its_payload(tmp_path: Path) -> None:
    rng = random.Random(1)
    prompt_chars = 20_000
    n = MAX_JOB_PROMPT_BYTES // (prompt_chars + 2) + 5
    lines = [text_line(f"r{i}", "".join(rng.choice("abcdefgh ") for _ in range(prompt_chars)))
             for i in range(n)]
    read = read_batch_file(write(tmp_path / "big.jsonl", lines), JobOptions(), spool=tmp_path)
    assert len(read.groups) == 2
    for group in read.groups:
        carried = sum(len(json.dumps(i.prompt)) for i in group.prepared.items if i.prompt)
        assert carried <= MAX_JOB_PROMPT_BYTES
    assert [i.custom_id for g in read.groups for i in g.prepared.items] == [
        f"r{i}" for i in range(n)]


def _keys_bytes(redis: Redis) -> int:
    return sum(redis.memory_usage(k, samples=0) or 0 for k in redis.scan_iter(count=1000))


def _bytes_per_line(redis_url: str, path: Path) -> tuple[float, int]:
    redis = Redis.from_url(redis_url)
    redis.flushdb()
    with Client(redis_url) as client:
        batch, _ = submit_openai_batch(client, path)
        jobs = len(batch.job_ids())
    lines = len(path.read_text().splitlines())
    per_line = _keys_bytes(redis) / lines
    redis.flushdb()
    redis.close()
    return per_line, jobs


def test_distinct_prompts_cost_redis_a_small_multiple_of_identical_ones(
        redis_url: str, tmp_path: Path) -> None:
    words = ("describe", "list", "colors", "shapes", "count", "objects", "read", "title",
             "left", "right", "top", "bottom", "corner", "briefly", "the", "image")
    rng = random.Random(0)
    n = 2000
    same = write(tmp_path / "same.jsonl", [text_line(f"r{i}", "Describe the image.")
                                           for i in range(n)])
    distinct = write(tmp_path / "distinct.jsonl", [
        text_line(f"r{i}", " ".join(rng.choice(words) for _ in range(8)) + f" ({i})")
        for i in range(n)])
    same_bytes, same_jobs = _bytes_per_line(redis_url, same)
    distinct_bytes, distinct_jobs = _bytes_per_line(redis_url, distinct)
    assert same_jobs == distinct_jobs == 4  # 500 items a job
    # A job a line cost ~3 kB a line; an item with its own ~50-character prompt, a few
    # tens of bytes (benchmarks/openai_api.py --text --prompts distinct).
    assert distinct_bytes <= 4 * max(same_bytes, 10), (distinct_bytes, same_bytes)
