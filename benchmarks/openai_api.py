"""`vlmq api` at scale: a large OpenAI Batch file with data-URI images,
uploaded with the official `openai` SDK to a real `vlmq api`, validated and enqueued,
then (with --run) answered by a tiny worker to completed and its output downloaded.

The figure that matters is how much Redis grows for the batch against the file's size:
the file and its decoded images live in the API's --files-dir; the jobs carry
references into it (store vlmq-api). Redis is a private redis-server (nothing else
writes to it), measured as INFO used_memory after minus before and as MEMORY USAGE of
every key.

    .venv/bin/python benchmarks/openai_api.py                     # 10,000 lines, enqueue only
    .venv/bin/python benchmarks/openai_api.py --lines 10000 --run # and through a tiny worker
    .venv/bin/python benchmarks/openai_api.py --prompts distinct  # each line its own prompt
    .venv/bin/python benchmarks/openai_api.py --via cli           # `vlmq enqueue --openai-batch`

`--prompts distinct` gives each line a prompt of its own (eight words drawn from a small
vocabulary and the line's number), the case where lines share no job unless an item can
carry its own prompt; `--text` writes text-only lines (no image), where the prompt is
all a line holds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.common as BC
from tests.support import helpers
from tests.support import openai_api as T
from vlmq.stores.api_store import store_spec

WORDS = ("describe", "the", "image", "list", "colors", "shapes", "count", "objects",
         "read", "title", "left", "right", "top", "bottom", "corner", "briefly")


def prompt(i: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(8)) + f" ({i})"


def make_file(path: Path, args: argparse.Namespace) -> Path:
    """The batch file: image lines (`distinct` images) or text lines, each with the one
    prompt T.line writes or (--prompts distinct) a prompt of its own."""
    uris = [] if args.text else [T.data_uri(i, (args.side, args.side * 5 // 4))
                                 for i in range(args.distinct)]
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(args.lines):
            line = json.loads(T.line(f"req-{i}", uris[i % args.distinct] if uris else ""))
            content = line["body"]["messages"][0]["content"]
            if args.prompts == "distinct":
                content[0]["text"] = prompt(i, rng)
            if args.text:
                line["body"]["messages"][0]["content"] = content[0]["text"]
            f.write(json.dumps(line) + "\n")
    return path


def _keys_bytes(redis: Redis) -> int:
    return sum(redis.memory_usage(k, samples=0) or 0 for k in redis.scan_iter(count=1000))


def measure(url: str, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    import openai

    redis = Redis.from_url(url)
    t0 = time.monotonic()
    path = make_file(tmp / "batch.jsonl", args)
    out: dict[str, float] = {"file_bytes": path.stat().st_size,
                             "make_s": time.monotonic() - t0}
    if args.via == "cli":
        return {**out, **_through_cli(url, redis, path)}
    port = T.free_port()
    procs = [T.start_api(url, tmp / "files", port)]
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=T.KEYS[0],
                        max_retries=5)
    try:
        helpers.wait_for(lambda: _answers(api), 60, "vlmq api")
        before_mem, before_keys = int(redis.info("memory")["used_memory"]), _keys_bytes(redis)
        t0 = time.monotonic()
        made = api.files.create(file=path, purpose="batch")
        out["upload_s"] = time.monotonic() - t0
        batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        while (batch := api.batches.retrieve(batch.id)).status == "validating":
            time.sleep(0.2)
        out["validate_s"] = time.monotonic() - t0 - out["upload_s"]
        assert batch.status == "in_progress", batch.errors
        out["redis_used_memory"] = int(redis.info("memory")["used_memory"]) - before_mem
        out["redis_keys"] = _keys_bytes(redis) - before_keys
        if args.run:
            out.update(_run(url, tmp, api, batch.id, args, procs))
    finally:
        helpers.stop_all(procs)
        redis.close()
    return out


def _through_cli(url: str, redis: Redis, path: Path) -> dict[str, float]:
    """The same file through `submit_openai_batch` (what `vlmq enqueue --openai-batch`
    runs): the jobs it makes, and what Redis holds for them, without the API's record."""
    from vlmq.producer.client import Client
    from vlmq.producer.openai_files import submit_openai_batch

    before_mem, before_keys = int(redis.info("memory")["used_memory"]), _keys_bytes(redis)
    t0 = time.monotonic()
    with Client(url) as client:
        batch, _ = submit_openai_batch(client, path)
        jobs = len(batch.job_ids())
    return {"upload_s": 0.0, "validate_s": time.monotonic() - t0, "jobs": jobs,
            "redis_used_memory": int(redis.info("memory")["used_memory"]) - before_mem,
            "redis_keys": _keys_bytes(redis) - before_keys}


def _answers(api: object) -> bool:
    import openai

    assert isinstance(api, openai.OpenAI)
    try:
        api.models.list()
        return True
    except openai.APIConnectionError:
        return False


def _run(url: str, tmp: Path, api: object, batch_id: str, args: argparse.Namespace,
         procs: list[object]) -> dict[str, float]:
    import openai

    assert isinstance(api, openai.OpenAI)
    model = Path(BC.ensure_model(None))
    t0 = time.monotonic()
    proc = helpers.start_worker(url, model, tmp, "--max-batch", str(args.max_batch),
                                "--store", store_spec(tmp / "files"))
    procs.append(proc)
    while (batch := api.batches.retrieve(batch_id)).status not in ("completed", "failed"):
        time.sleep(1)
    ran = time.monotonic() - t0
    t0 = time.monotonic()
    lines = sum(1 for _ in api.files.content(batch.output_file_id or "").iter_lines())
    errors = sum(1 for _ in api.files.content(batch.error_file_id).iter_lines()) \
        if batch.error_file_id else 0
    return {"run_s": ran, "download_s": time.monotonic() - t0, "output_lines": lines,
            "error_lines": errors}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="a Redis nothing else uses meanwhile (default: a private one)")
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--distinct", type=int, default=None,
                        help="distinct images (default: one per line)")
    parser.add_argument("--side", type=int, default=160, help="image width (px)")
    parser.add_argument("--run", action="store_true",
                        help="also answer it with a tiny worker to completed")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--prompts", choices=("same", "distinct"), default="same",
                        help="one prompt on every line, or each line its own")
    parser.add_argument("--text", action="store_true",
                        help="text-only lines (no image): the prompt is all a line holds")
    parser.add_argument("--via", choices=("api", "cli"), default="api",
                        help="through `vlmq api` (HTTP, the SDK) or submit_openai_batch")
    args = parser.parse_args(argv)
    if args.run and args.via != "api":
        parser.error("--run goes with --via api")
    args.distinct = args.distinct or args.lines
    with BC.redis_url_or_private(args.redis_url) as url, \
            tempfile.TemporaryDirectory(prefix="vlmq-api-bench-") as tmp:
        got = measure(url, Path(tmp), args)
    size = got["file_bytes"]
    inputs = ("text only" if args.text else
              f"{args.distinct} distinct {args.side}px PNGs as data: URIs")
    print(f"{args.lines} lines, {inputs}, {args.prompts} prompts, via {args.via}; "
          f"file {size / 1e6:.1f} MB")
    rows = [("upload (SDK, HTTP)", f"{got['upload_s']:.1f} s"),
            ("validate + enqueue", f"{got['validate_s']:.1f} s"),
            ("Redis used_memory growth", f"{got['redis_used_memory'] / 1e3:.0f} kB "
                                         f"({100 * got['redis_used_memory'] / size:.2f} %)"),
            ("Redis keys' MEMORY USAGE", f"{got['redis_keys'] / 1e3:.0f} kB "
                                         f"({100 * got['redis_keys'] / size:.2f} %)"),
            ("per line (keys)", f"{got['redis_keys'] / args.lines:.0f} B")]
    if "jobs" in got:
        rows.append(("jobs", f"{got['jobs']:.0f}"))
    if args.run:
        rows += [("worker run to completed", f"{got['run_s']:.0f} s"),
                 ("download output + errors", f"{got['download_s']:.1f} s"),
                 ("output / error lines", f"{got['output_lines']:.0f} / "
                                          f"{got['error_lines']:.0f}")]
    print(BC.table(("figure", "value"), rows))


if __name__ == "__main__":
    main()
