"""One PDF render process: `python -m vlmq.worker.render_child MEM_MB`.

It renders pages, and reads their text layers (`"op": "text"`), for the worker.

PDFium is not thread-safe and a crafted page (millions of drawing operations) can take
gigabytes and minutes, or abort the process outright. So the worker never renders in its
own process: each of these children holds its own open documents, caps its own memory,
and dies alone when a page is too much. The parent (worker/render_pool.py) talks to it
over stdin/stdout with the framing in `render_wire`.

Memory is capped twice: RLIMIT_AS (hard, where the OS enforces it, e.g. Linux) and a
watchdog thread that exits with EXIT_OVER_MEMORY once peak RSS passes the budget (macOS
does not enforce RLIMIT_AS; ctypes calls release the GIL, so the thread runs mid-render).
The same thread exits when the parent is gone, so a killed worker leaves no renderer.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from typing import BinaryIO

from vlmq.worker import preprocess as P
from vlmq.worker.render_wire import EXIT_OVER_MEMORY, WireError, read_msg, write_msg

_WATCH_S = 0.05


def _vm_size_bytes() -> int | None:
    """Current address-space size (Linux /proc); None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _limit_address_space(budget: int) -> None:
    base = _vm_size_bytes()
    if base is None:
        return
    limit = base + budget
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # not permitted or not supported here: the watchdog remains
        return


def _watchdog(budget: int, parent: int) -> None:
    base = _peak_rss_bytes()
    while True:
        if os.getppid() != parent:
            os._exit(1)
        if _peak_rss_bytes() - base > budget:
            os._exit(EXIT_OVER_MEMORY)
        time.sleep(_WATCH_S)


def _no_data() -> bytes:
    raise RuntimeError("document data was not sent")  # only if the parent breaks the protocol


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer render requests until the parent closes stdin."""
    while True:
        try:
            msg = read_msg(inp)
        except WireError:
            return
        if msg is None:
            return
        header, data = msg
        key, page = str(header["key"]), int(header["page"])
        if not data and not P.has_open_pdf(key):
            write_msg(out, {"need": "data"})
            continue
        opens = P.COUNTERS.snapshot()["pdf_opens"]
        try:
            if header.get("op") == "text":
                layer = P.pdf_text_layer(data or _no_data, page, doc_key=key)
                opened = P.COUNTERS.snapshot()["pdf_opens"] > opens
                write_msg(out, {"layer": layer.to_wire(), "opened": opened})
                continue
            img = P.render_pdf_page(data or _no_data, page, int(header["max_side"]),
                                    doc_key=key)
        except P.PreprocessError as exc:
            write_msg(out, {"error": str(exc)})
            continue
        except MemoryError:
            os._exit(EXIT_OVER_MEMORY)  # state after a failed allocation is not trusted
        opened = P.COUNTERS.snapshot()["pdf_opens"] > opens
        write_msg(out, {"w": img.width, "h": img.height, "opened": opened}, img.tobytes())


def main() -> None:
    budget = int(sys.argv[1]) * 1024 * 1024
    _limit_address_space(budget)
    threading.Thread(target=_watchdog, args=(budget, os.getppid()), daemon=True,
                     name="vlmq-render-watchdog").start()
    write_msg(sys.stdout.buffer, {"ready": True})
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
