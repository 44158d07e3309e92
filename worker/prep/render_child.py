"""One decode process: `python -m vlmq.worker.prep.render_child MEM_MB SOCKET_FD`.

It renders PDF pages (`"op": "render"`), reads their text layers (`"text"`), decodes
images (`"image"`) and TIFF pages (`"tiff"`), for the worker, answering RGB pixels.

PDFium is not thread-safe and a crafted page (millions of drawing operations) can take
gigabytes and minutes, or abort the process outright; an image codec or a TIFF can cost
as much. So the worker never decodes in its own process: each of these children holds its
own open documents, caps its own memory, and dies alone when an input is too much. The
parent (worker/prep/render_pool.py) talks to it over stdin/stdout with the framing in
`render_wire`, and passes files (a referenced input's verified copy) over SOCKET_FD.

Memory is capped twice: RLIMIT_AS (hard, where the OS enforces it, e.g. Linux) and a
watchdog thread that exits with EXIT_OVER_MEMORY once peak RSS passes the budget (macOS
does not enforce RLIMIT_AS; ctypes calls release the GIL, so the thread runs mid-render).
The same thread exits when the parent is gone, so a killed worker leaves no renderer.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from PIL import Image

from vlmq.media import opener
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_wire import EXIT_OVER_MEMORY, WireError, read_msg, recv_fd, write_msg
from vlmq.worker.stats import COUNTERS

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


Reply = tuple[dict[str, Any], bytes]


def _pixels(img: Image.Image) -> Reply:
    return {"w": img.width, "h": img.height}, img.tobytes()


def _side(header: dict[str, Any]) -> int:
    return int(header["max_side"])


def _render(header: dict[str, Any], data: decode.Data) -> Reply:
    return _pixels(decode.render_pdf_page(data, int(header["page"]), _side(header),
                                          doc_key=str(header["key"])))


def _text(header: dict[str, Any], data: decode.Data) -> Reply:
    layer = decode.pdf_text_layer(data, int(header["page"]), doc_key=str(header["key"]))
    return {"layer": layer.to_wire()}, b""


def _image(header: dict[str, Any], data: decode.Data) -> Reply:
    return _pixels(decode.decode_image(data, _side(header)))


def _tiff(header: dict[str, Any], data: decode.Data) -> Reply:
    return _pixels(decode.decode_tiff_page(data, int(header["page"]), _side(header),
                                           doc_key=str(header["key"])))


# What each op does; documents (kept open by key) may come without their bytes.
OPS: dict[str, Callable[[dict[str, Any], decode.Data], Reply]] = {
    "render": _render, "text": _text, "image": _image, "tiff": _tiff}
DOCUMENT_OPS = ("render", "text", "tiff")


def _received(header: dict[str, Any], body: bytes, sock: socket.socket | None
              ) -> decode.Source | None:
    """The input sent with the request: a file whose descriptor came over `sock`, the
    frame's body (`"sent"`, even when empty), or None (the document is already open here,
    the parent thinks)."""
    if header.get("fd"):
        if sock is None:
            raise WireError("a descriptor was announced, and this process has no socket")
        return os.fdopen(recv_fd(sock), "rb")
    return body if header.get("sent") else None


def _answer(header: dict[str, Any], src: decode.Source | None) -> Reply | None:
    """The reply to one request; None when it needs the input's bytes first."""
    op = str(header.get("op", "render"))
    if op not in OPS:
        return {"error": f"unknown request {op!r} (worker and render process differ?)"}, b""
    if src is None and (op not in DOCUMENT_OPS or not decode.has_document(str(header["key"]))):
        return None
    opens = COUNTERS.snapshot()["pdf_opens"]
    try:
        # Alone on this thread, so Pillow's bomb warning can be a refusal, as it is at
        # enqueue and in the preview, rather than a line on the worker's stderr.
        with opener.strict_warnings():
            reply, pixels = OPS[op](header, src if src is not None else _no_data)
    except decode.PreprocessError as exc:
        return {"error": str(exc)}, b""
    reply["opened"] = COUNTERS.snapshot()["pdf_opens"] > opens
    return reply, pixels


def serve(inp: BinaryIO, out: BinaryIO, sock: socket.socket | None = None) -> None:
    """Answer requests until the parent closes stdin."""
    while True:
        try:
            msg = read_msg(inp)
            if msg is None:
                return
            header, body = msg
            src = _received(header, body, sock)
        except WireError:
            return
        try:
            answer = _answer(header, src)
        except MemoryError:
            os._exit(EXIT_OVER_MEMORY)  # state after a failed allocation is not trusted
        finally:
            if src is not None and not isinstance(src, bytes):
                src.close()  # what a document keeps, it keeps through a descriptor of its own
        if answer is None:
            write_msg(out, {"need": "data"})
        else:
            write_msg(out, *answer)


def main() -> None:
    budget = int(sys.argv[1]) * 1024 * 1024
    sock = socket.socket(fileno=int(sys.argv[2])) if len(sys.argv) > 2 else None
    _limit_address_space(budget)
    threading.Thread(target=_watchdog, args=(budget, os.getppid()), daemon=True,
                     name="vlmq-render-watchdog").start()
    write_msg(sys.stdout.buffer, {"ready": True})
    serve(sys.stdin.buffer, sys.stdout.buffer, sock)


if __name__ == "__main__":
    main()
