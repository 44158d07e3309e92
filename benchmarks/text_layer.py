"""What does `--text-layer prefer` save on a mixed PDF? The same pages under off and prefer.

A 100-page PDF (by default), half born-digital (a real text layer, written with fpdf2) and
half scans (one image per page, no text), is OCRed twice by a fresh burst worker, each run
with its own empty vision cache and the result cache off, so neither run helps the other:

1. `--text-layer off`: every page goes to the model.
2. `--text-layer prefer`: born-digital pages are read from their layer (0 tokens); only the
   scans reach the model.

Figures come from the job summaries (worker-side wall time, model load excluded) and the
worker's stats hash (PDF renders, text extractions).

    .venv/bin/python benchmarks/text_layer.py --model bench
    .venv/bin/python benchmarks/text_layer.py --pages 20 --max-tokens 16    # quicker
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import common as C
import fpdf
from PIL import Image, ImageDraw
from redis import Redis

PARAGRAPH = ("Section {n}. The committee reviewed the accounts for the period and found "
             "revenue of {r} EUR against costs of {c} EUR; the difference is carried to the "
             "reserve. Members asked for a breakdown by region before the next meeting. ")


def make_pdf(path: Path, pages: int) -> Path:
    """Odd pages born digital, even pages scans (an image of text over the whole page)."""
    pdf = fpdf.FPDF(unit="mm", format="A4")
    pdf.set_auto_page_break(False)
    for n in range(1, pages + 1):
        pdf.add_page()
        if n % 2:
            pdf.set_font("helvetica", size=11)
            text = "".join(PARAGRAPH.format(n=f"{n}.{k}", r=1000 + 37 * n + k, c=700 + k)
                           for k in range(6))
            pdf.multi_cell(180, 5.5, text)
        else:
            img = Image.new("L", (827, 1169), 255)
            draw = ImageDraw.Draw(img)
            for line in range(40):
                draw.text((60, 60 + 26 * line), f"scanned page {n}, line {line}: "
                          "accounts, revenue, costs, reserve", fill=0)
            pdf.image(img, x=0, y=0, w=210, h=297)
    pdf.output(str(path))
    return path


def run_mode(redis_url: str, model: str, pdf: Path, mode: str, work: Path,
             max_tokens: int, side: int, max_batch: int) -> dict[str, float]:
    from vlmq.producer.client import Client

    tag = f"tl-{mode}-{uuid.uuid4().hex[:6]}"
    with Client(redis_url) as client:
        job = client.ocr([pdf], queue=tag, text_layer=mode, max_tokens=max_tokens,
                         max_side=side, result_cache="off")
    cache = work / f"cache-{mode}"
    cmd = C.worker_cmd(redis_url, model, tag, max_batch=max_batch, cache_dir=cache, name=tag)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=C.worker_env(cache.parent), capture_output=True,
                          text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    process_s = time.perf_counter() - t0
    run = C.job_run(redis_url, job.id)
    with Client(redis_url) as client:
        summary = client.job(job.id).summary() or {}
        prompt = int(summary.get("prompt_tokens", 0))
    redis = Redis.from_url(redis_url)
    stats = C.read_stats(redis, tag)
    redis.close()
    sources = summary.get("text_sources", {})
    return {"wall_s": run.wall_s, "process_s": round(process_s, 2), "ok": run.ok,
            "completion_tokens": run.tokens, "prompt_tokens": prompt,
            "from_layer": int(sources.get("text_layer", 0)),
            "from_model": int(sources.get("model", 0)),
            "pdf_renders": int(stats.get("pdf_renders", 0)),
            "text_extracts": int(stats.get("text_extracts", 0)),
            "tower_calls": int(stats.get("tower_calls", 0))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None,
                   help="a Redis db to use; FLUSHED first (default: a private redis-server)")
    p.add_argument("--model", default="tiny", help="tiny, bench, or a model folder/hub id")
    p.add_argument("--pages", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--side", type=int, default=448, help="longest rendered side in px")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    model = C.resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="vlmq-textlayer-") as tmp, \
            C.redis_url_or_private(args.redis_url) as url:
        work = Path(tmp)
        C.connect(url)
        pdf = make_pdf(work / "mixed.pdf", args.pages)
        print(f"machine: {C.machine()}")
        print(f"model: {model}; {args.pages} pages ({(args.pages + 1) // 2} born digital, "
              f"{args.pages // 2} scans) at {args.side} px, max_tokens {args.max_tokens}, "
              f"max_batch {args.max_batch}")
        rows = {mode: run_mode(url, model, pdf, mode, work, args.max_tokens, args.side,
                               args.max_batch) for mode in ("off", "prefer")}
    cols = ["wall_s", "completion_tokens", "prompt_tokens", "from_model", "from_layer",
            "pdf_renders", "tower_calls", "text_extracts", "ok"]
    print(C.table(["mode", *cols], [[m, *(r[c] for c in cols)] for m, r in rows.items()]))
    off, pre = rows["off"], rows["prefer"]
    figures = {
        "pages": args.pages, "off": off, "prefer": pre,
        "wall_ratio_prefer_over_off": round(pre["wall_s"] / off["wall_s"], 3),
        "tokens_ratio_prefer_over_off": round(
            (pre["completion_tokens"] + pre["prompt_tokens"])
            / max(1, off["completion_tokens"] + off["prompt_tokens"]), 3),
    }
    print(f"prefer/off: wall {figures['wall_ratio_prefer_over_off']:.2f}x, model tokens "
          f"(prompt + generated) {figures['tokens_ratio_prefer_over_off']:.2f}x")
    C.emit_json(figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
