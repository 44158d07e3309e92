"""The demo's bundled sample for the reader: `python -m vlmq.worker.model.reader.samples`.

Writes producer/samples/reader.pdf (3 born-digital pages: typed labels), reader-note.png and
reader-label.jpg, with reader.json holding the text rendered on each, so the demo can
print what was read beside what was written, and its character error rate. Fixed
texts (not random ones) so a reader of the demo sees plausible pages; fixed seed for
the layout. Needs fpdf2 (a dev dependency); the files it wrote are committed.
"""

from __future__ import annotations

import json
import random
import sys
from importlib import resources
from pathlib import Path

from vlmq.worker.model.reader import data

PDF_TEXTS = ("INVOICE 2291", "TOTAL DUE 118.40", "SHIP TO: ROOM 7")
PNG_TEXT = "CALL TEAM MONDAY"
JPG_TEXT = "BOX 318 - LAKE"
SEED = 7
TRUTH = "reader.json"


def samples_dir() -> Path:
    return Path(str(resources.files("vlmq.producer").joinpath("samples")))


def sample_paths() -> list[Path]:
    """The reader's sample files, in the order the demo enqueues them."""
    folder = samples_dir()
    return [folder / "reader.pdf", folder / "reader-note.png", folder / "reader-label.jpg"]


def sample_truth() -> dict[tuple[str, int], str]:
    """(file name, page; 0 for an image) -> the text rendered there."""
    raw = json.loads((samples_dir() / TRUTH).read_text(encoding="utf-8"))
    return {(name, int(page)): text for name, pages in raw.items()
            for page, text in pages.items()}


def write(folder: Path) -> None:
    rng = random.Random(SEED)
    (folder / "reader.pdf").write_bytes(data.born_digital_pdf(list(PDF_TEXTS), rng))
    data.render(PNG_TEXT, rng, data.FONTS[2]).save(folder / "reader-note.png")
    data.render(JPG_TEXT, rng, data.FONTS[1]).save(folder / "reader-label.jpg", quality=92)
    truth = {"reader.pdf": {str(n): t for n, t in enumerate(PDF_TEXTS, start=1)},
             "reader-note.png": {"0": PNG_TEXT}, "reader-label.jpg": {"0": JPG_TEXT}}
    (folder / TRUTH).write_text(json.dumps(truth, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else samples_dir())
