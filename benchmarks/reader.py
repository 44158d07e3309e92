"""The trained reader's character error rate and pages/s, through a real worker.

Held-out pages (a seed the training run never draws) in the training fonts: half PNG
images, half pages of a born-digital PDF (rendered by the worker, text layer off), OCR'd
by `vlmq worker --burst` at the demo's settings (--max-side 448, the family's OCR
prompt); then the demo's own sample. CER is the edit distance over the true length,
averaged over pages. Takes about a minute with the defaults on 2 shared cores.

    .venv/bin/python benchmarks/reader.py [--items 32] [--max-batch 8] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from vlmq.worker.model import reader
from vlmq.worker.model.reader import data, samples

BENCH_SEED = 20_261_202  # held out: training draws from its own seed's stream only
MAX_TOKENS = 96


def held_out(folder: Path, items: int) -> tuple[list[Path], dict[tuple[str, int], str]]:
    """PNG pages and one PDF of the rest; truth keyed by (file name, page)."""
    rng = random.Random(BENCH_SEED)
    folder.mkdir(parents=True, exist_ok=True)
    truth: dict[tuple[str, int], str] = {}
    paths = []
    for k in range(items // 2):
        p = data.page(rng)
        path = folder / f"page{k:03d}.png"
        p.image.save(path)
        paths.append(path)
        truth[(path.name, 0)] = p.text
    texts = [data.random_text(rng) for _ in range(items - items // 2)]
    pdf = folder / "pages.pdf"
    pdf.write_bytes(data.born_digital_pdf(texts, rng))
    paths.append(pdf)
    truth.update({(pdf.name, n): t for n, t in enumerate(texts, start=1)})
    return paths, truth


def measure(redis_url: str, model: str, paths: list[Path], truth: dict[tuple[str, int], str],
            work: Path, max_batch: int, label: str) -> dict[str, float]:
    from vlmq.producer.client import Client

    run = common.run_burst_worker(redis_url, model, paths, max_batch=max_batch,
                                  cache_dir=work / f"cache-{label}", max_tokens=MAX_TOKENS,
                                  side=reader.MAX_SIDE, label=label)
    job = run.jobs[0]
    with Client(redis_url) as client:
        results = list(client.job(job.job_id).results())
    rates = [data.cer(r.text or "", truth[(Path(r.source).name, r.page or 0)])
             for r in results]
    worst = max(zip(rates, results, strict=True), key=lambda x: x[0])
    print(f"  {label}: worst page {Path(worst[1].source).name} p{worst[1].page or 0}: "
          f"CER {worst[0]:.3f}, read {worst[1].text!r}")
    return {"pages": len(rates), "cer": sum(rates) / len(rates),
            "pages_per_s": job.items / job.wall_s if job.wall_s else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default=None, help="a Redis db (FLUSHED first; default: a "
                    "private redis-server)")
    ap.add_argument("--model", default=None, help="reader folder (default: the shipped one)")
    ap.add_argument("--items", type=int, default=32, help="held-out pages (default 32)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    model = args.model or str(reader.weights_dir())
    with tempfile.TemporaryDirectory(prefix="vlmq-reader-") as tmp, \
            common.redis_url_or_private(args.redis_url) as url:
        common.connect(url)  # refuses the test suite's dbs, flushes the given one
        work = Path(tmp)
        paths, truth = held_out(work / "held-out", args.items)
        figures = {f"held_out_{k}": v for k, v in
                   measure(url, model, paths, truth, work, args.max_batch, "held-out").items()}
        demo = samples.sample_truth()
        figures.update({f"demo_{k}": v for k, v in
                        measure(url, model, samples.sample_paths(), demo, work,
                                args.max_batch, "demo").items()})
    print(common.table(["set", "pages", "CER", "pages/s"],
                       [[s, figures[f"{s}_pages"], f"{figures[f'{s}_cer']:.3%}",
                         f"{figures[f'{s}_pages_per_s']:.2f}"] for s in ("held_out", "demo")]))
    common.emit_json(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
