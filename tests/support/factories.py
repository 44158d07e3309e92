"""What tests build their inputs from: fake blob hashes, wire items and payloads, JobPayloads,
and images (random pixels for the model tests, plain colours encoded for the producer's).

One builder of each, so a change to the protocol's shape is made here once. Worker runs,
the CLI and Redis-side helpers are in tests.support.helpers.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
from PIL import Image

from vlmq.shared.messages import Item, JobPayload

SHA = "ab" * 32
"""A well-formed sha256 hex that names no real content: tests that never read a blob use
it, and store `b"x"` under it where enqueue.lua checks that the blob exists."""
OTHER_SHA = "cd" * 32
"""A second one, distinct from SHA (a missing blob beside a present one, a cache miss)."""


def sha(n: int) -> str:
    """The n-th of a run of distinct fake hashes (`sha(0) != sha(1)`), none equal to SHA."""
    return f"{n + 1:064x}"


def item(kind: str = "image", *, blob: str = SHA, source: str | None = None,
         page: int | None = None, **fields: Any) -> dict[str, Any]:
    """One wire item, as a producer in any language writes it; `source` and `page` are
    left out unless given (a pdf or tiff item without a page is refused)."""
    out: dict[str, Any] = {"kind": kind, "blob": blob}
    if source is not None:
        out["source"] = source
    if page is not None:
        out["page"] = page
    return {**out, **fields}


def images(n: int, *, blob: str = SHA, name: str = "p{}.png") -> list[dict[str, Any]]:
    """`n` wire image items on one blob, their sources numbered from 0."""
    return [item(blob=blob, source=name.format(i)) for i in range(n)]


def payload(*items: dict[str, Any], task: str = "ocr", **fields: Any) -> dict[str, Any]:
    """A wire payload (v 1) holding `items` (one image item when none given); any other
    top-level field by keyword."""
    return {"v": 1, "task": task, "items": list(items) or [item(source="a.png")], **fields}


def job_payload(n: int = 1, *, task: str = "ocr", blob: str | None = SHA, name: str = "p{}.png",
        first: int = 0, **settings: Any) -> JobPayload:
    """A JobPayload of `n` image items named from `name` (numbered from `first`); all on
    `blob`, or, with blob=None, each on a blob of its own (sha(first + i)). Keyword
    arguments are the job's settings (labels=..., model=..., max_side=...)."""
    items = tuple(Item(kind="image", blob=blob or sha(first + i), source=name.format(first + i))
                  for i in range(n))
    return JobPayload(task=task, items=items, settings=settings)


def random_image(seed: int, size: tuple[int, int] = (112, 112)) -> Image.Image:
    """An RGB image of random pixels from `seed`: each seed is another image to the vision
    tower, the same seed the same one."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (48, 32),
                color: Any = (200, 30, 30), mode: str = "RGB") -> bytes:
    """An image of one colour, encoded as `fmt` (PNG, JPEG, WEBP, ...)."""
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt)
    return buf.getvalue()


def slow_png(seed: int = 0) -> bytes:
    """8000x8000 (64 Mpx, just within the pixel limit) in 2 MB: its decode and resize take
    a second or more here, far past the 0.3 s limit the tests set."""
    a = (np.add.outer(np.arange(8000), np.arange(8000) * (seed + 1)) % 251).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).convert("RGB").save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def with_path(payload: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `payload` with one dotted path (list indexes as numbers) set, or
    deleted when `value` is ...: one field wrong at a time, for the refusal tables."""
    out = copy.deepcopy(payload)
    target: Any = out
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is Ellipsis:
        del target[parts[-1]]
    else:
        target[parts[-1]] = value
    return out
