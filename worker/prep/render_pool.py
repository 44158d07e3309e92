"""A small pool of decode processes owned by the worker: PDF pages, images, TIFF pages.

Why processes: PDFium is not thread-safe (one lock would make every page of every PDF
wait), and a crafted page, image or TIFF can take gigabytes or minutes, or abort the
process that decodes it. Each child (worker/prep/render_child.py) keeps its own open documents,
has an address-space and RSS budget (`mem_mb`), and gets `timeout_s` per request. An input
that runs out of either, or crashes its child, becomes that item's PreprocessError naming
the limit; the child is replaced on the next request, the prep thread that asked is free
at once, and the worker, and every other job, go on. One mechanism bounds every kind.

The children also read pages' text layers (worker/prep/text_layer.py), for the same reasons.
Pages of one document prefer the child that already has it open (no re-send, no re-parse,
for a TIFF no re-index); different documents decode in parallel in different children.
Bytes (a blob) travel in the request; a file (a referenced input's verified copy) travels
as a descriptor, so the child reads it as its decoder needs and nothing holds it whole.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

from PIL import Image

from vlmq.worker import options
from vlmq.worker.prep import decode, text_layer
from vlmq.worker.prep.render_wire import (
    EXIT_OVER_MEMORY,
    PREFIX_SIZE,
    WireError,
    parse_header,
    parse_prefix,
    send_fd,
    write_msg,
)
from vlmq.worker.stats import COUNTERS

DEFAULT_MEM_MB = options.DEFAULT_RENDER_MEM_MB  # the table of worker options owns them
DEFAULT_TIMEOUT_S = options.DEFAULT_RENDER_TIMEOUT_S
_STOP_WAIT_S = 2.0
# A child's start (interpreter, imports) is not part of any page's time limit.
_START_TIMEOUT_S = 60.0


class _Died(Exception):
    """The child ended (crash, memory watchdog) before answering."""


class _Slot:
    """One child process, used by one thread at a time (the pool hands slots out)."""

    def __init__(self, mem_mb: int) -> None:
        self.mem_mb = mem_mb
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None  # descriptors go to the child over this
        self.docs: OrderedDict[str, None] = OrderedDict()  # what the child probably has open

    def _start(self) -> subprocess.Popen[bytes]:
        self.spawn()
        return self.await_ready()

    def spawn(self) -> None:
        """Start the child; await_ready() waits for its hello."""
        # One BLAS thread: the child never multiplies matrices, and idle BLAS threads
        # would reserve address space against its budget.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # A session of its own: a Ctrl-C or a SIGTERM sent to the worker's process group
        # must not kill a page mid-render (its item would fail for good). The worker stops
        # its children itself, and a child exits when the worker is gone (render_child).
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vlmq.worker.prep.render_child", str(self.mem_mb),
                 str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.docs.clear()

    def await_ready(self) -> subprocess.Popen[bytes]:
        """The spawned child, once it said it is ready (RuntimeError if it does not)."""
        assert self.proc is not None and self.proc.stdout is not None
        try:
            fd = self.proc.stdout.fileno()
            deadline = time.monotonic() + _START_TIMEOUT_S
            head_len, _ = parse_prefix(_read(fd, PREFIX_SIZE, deadline))
            parse_header(_read(fd, head_len, deadline))
        except TimeoutError:
            self.stop(kill=True)
            raise RuntimeError(
                f"a render process did not start in {_START_TIMEOUT_S:g} s") from None
        except (EOFError, WireError, OSError) as exc:
            raise RuntimeError(f"a render process failed to start: {self._death()}") from exc
        return self.proc

    def request(self, data: decode.Data, header: dict[str, Any], timeout_s: float,
                failing: str, verb: str) -> tuple[dict[str, Any], bytes]:
        """One answered request (`header["key"]` names the document or image); the child's
        own error, a timeout or its death is that item's PreprocessError, `failing` saying
        what went wrong ("page 3 too complex to render") and `verb` which limit ("render",
        "decode")."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        key = str(header["key"])
        kept = header.get("op") != "image"  # an image is decoded and forgotten
        try:
            if kept and key in self.docs:
                reply, pixels = self._ask(proc, header, b"", time.monotonic() + timeout_s,
                                          verb)
                if reply.get("need") == "data":
                    reply, pixels = self._send(proc, header, data, timeout_s, verb)
            else:
                reply, pixels = self._send(proc, header, data, timeout_s, verb)
        except TimeoutError:
            self.stop(kill=True)
            raise decode.PreprocessError(f"{failing}: over the {timeout_s:g} s {verb} time limit "
                                         "(--render-timeout)") from None
        except _Died as exc:
            raise decode.PreprocessError(f"{failing}: {exc}") from None
        if kept:
            self.docs[key] = None
            self.docs.move_to_end(key)
            while len(self.docs) > decode.PDF_DOC_CACHE_SIZE:
                self.docs.popitem(last=False)
        if "error" in reply:
            raise decode.PreprocessError(str(reply["error"]))
        return reply, pixels

    def _send(self, proc: subprocess.Popen[bytes], header: dict[str, Any], data: decode.Data,
              timeout_s: float, verb: str) -> tuple[dict[str, Any], bytes]:
        """The request with its input: bytes in the frame, a file as a descriptor (one
        that `data` fetched is closed once the child has its own). The time limit starts
        once the input is here: a slow fetch (Redis, S3) is not the input's decode."""
        fetched = callable(data)
        src = data() if callable(data) else data
        deadline = time.monotonic() + timeout_s
        try:
            if isinstance(src, bytes):  # "sent": an empty input is still an input
                return self._ask(proc, {**header, "sent": True}, src, deadline, verb)
            return self._ask(proc, {**header, "fd": True}, b"", deadline, verb, fd=src.fileno())
        finally:
            if fetched and not isinstance(src, bytes):
                src.close()

    def _ask(self, proc: subprocess.Popen[bytes], header: dict[str, Any], body: bytes,
             deadline: float, verb: str, fd: int | None = None
             ) -> tuple[dict[str, Any], bytes]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if fd is not None:
                assert self.sock is not None
                send_fd(self.sock, fd)
            write_msg(proc.stdin, header, body)
            out = proc.stdout.fileno()
            head_len, body_len = parse_prefix(_read(out, PREFIX_SIZE, deadline))
            reply = parse_header(_read(out, head_len, deadline))
            return reply, _read(out, body_len, deadline) if body_len else b""
        except (BrokenPipeError, EOFError, WireError, ValueError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise _Died(self._death(verb)) from exc

    def _death(self, verb: str = "render") -> str:
        """Reap the dead child and say how it ended, for the item's error."""
        proc, self.proc = self.proc, None
        self._close_sock()
        self.docs.clear()
        if proc is None:
            return "its render process is gone"
        try:
            rc = proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        _close_pipes(proc)
        limit = f"the {self.mem_mb} MB {verb} memory limit (--render-mem-mb)"
        if rc == EXIT_OVER_MEMORY:
            return f"over {limit}"
        if rc < 0:
            name = signal.Signals(-rc).name
            return f"its render process died ({name}), most likely over {limit}"
        return f"its render process exited with code {rc}"

    def _close_sock(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def stop(self, *, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        self._close_sock()
        self.docs.clear()
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            try:
                assert proc.stdin is not None
                proc.stdin.close()  # the child exits at end of input
            except OSError:
                proc.kill()
        try:
            proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:  # a broken pipe's buffered bytes cannot be flushed: nothing lost
                continue


def _rgb(reply: dict[str, Any], pixels: bytes) -> Image.Image:
    return Image.frombytes("RGB", (int(reply["w"]), int(reply["h"])), pixels)


def _read(fd: int, n: int, deadline: float) -> bytes:
    """Exactly n bytes from fd before the deadline (TimeoutError) or EOFError."""
    chunks: list[bytes] = []
    left = n
    while left > 0:
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class RenderPool:
    """Render PDF pages and decode images and TIFF pages in `size` child processes; see
    the module docstring. Thread-safe."""

    def __init__(self, size: int, *, mem_mb: int = DEFAULT_MEM_MB,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if size < 1:
            raise ValueError(f"render pool size must be at least 1, got {size}")
        if mem_mb < 16:
            raise ValueError(f"render memory limit must be at least 16 MB, got {mem_mb}")
        if timeout_s <= 0:
            raise ValueError(f"render timeout must be positive, got {timeout_s}")
        self.mem_mb = mem_mb
        self.timeout_s = timeout_s
        self._free = [_Slot(mem_mb) for _ in range(size)]
        self._all = list(self._free)
        self._cond = threading.Condition()
        self._closed = False

    def render(self, data: decode.Data, page: int, max_side: int, *, doc_key: str) -> Image.Image:
        """Same contract as decode.render_pdf_page, out of process; `data` (or the
        function that fetches it) is used only when no child has the document open."""
        decode.check_side(max_side)
        decode.check_page(page)
        reply, pixels = self._ask(data, {"key": doc_key, "page": page, "max_side": max_side},
                                  "pdf_renders", f"page {page} too complex to render", "render")
        return _rgb(reply, pixels)

    def text_layer(self, data: decode.Data, page: int, *, doc_key: str) -> text_layer.Layer:
        """Same contract as decode.pdf_text_layer, out of process."""
        decode.check_page(page)
        reply, _ = self._ask(data, {"op": "text", "key": doc_key, "page": page},
                             "text_extracts", f"page {page} text layer cannot be read",
                             "render")
        layer = reply.get("layer")
        if not isinstance(layer, dict):
            raise decode.PreprocessError(f"page {page}: its render process sent no text layer")
        return text_layer.Layer.from_wire(layer)

    def decode_image(self, data: decode.Data, max_side: int, *, key: str) -> Image.Image:
        """Same contract as decode.decode_image, out of process; `key` (the image's
        sha256) names it in the child."""
        decode.check_side(max_side)
        reply, pixels = self._ask(data, {"op": "image", "key": key, "max_side": max_side},
                                  "image_decodes", "image too complex to decode", "decode")
        return _rgb(reply, pixels)

    def decode_tiff_page(self, data: decode.Data, page: int, max_side: int, *,
                         doc_key: str) -> Image.Image:
        """Same contract as decode.decode_tiff_page, out of process; the child keeps
        the document and its page index for the pages that follow."""
        decode.check_side(max_side)
        decode.check_page(page)
        reply, pixels = self._ask(
            data, {"op": "tiff", "key": doc_key, "page": page, "max_side": max_side},
            "image_decodes", f"TIFF page {page} too complex to decode", "decode")
        return _rgb(reply, pixels)

    def _ask(self, data: decode.Data, header: dict[str, Any], counter: str, failing: str,
             verb: str) -> tuple[dict[str, Any], bytes]:
        """One request about `header["key"]`, on the child that best fits it; counted here
        as `counter` (and a document opened, as pdf_opens), as the work it stands for."""
        COUNTERS.incr(counter)
        slot = self._acquire(str(header["key"]))
        try:
            reply, body = slot.request(data, header, self.timeout_s, failing, verb)
        finally:
            self._release(slot)
        if reply.get("opened"):
            COUNTERS.incr("pdf_opens")
        return reply, body

    def _acquire(self, doc_key: str) -> _Slot:
        with self._cond:
            while not self._free:
                if self._closed:
                    raise RuntimeError("render pool is closed")
                self._cond.wait()
            if self._closed:
                raise RuntimeError("render pool is closed")
            # Prefer the child that has this document open, then a running one.
            best = max(self._free, key=lambda s: (doc_key in s.docs, s.proc is not None))
            self._free.remove(best)
            return best

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def warm(self) -> None:
        """Start every child now, all at once, so that the first PDF page of the first job
        does not wait for an interpreter to start (the worker calls this before it says it
        is ready). RuntimeError if one does not start; the others stay up."""
        with self._cond:
            idle = [s for s in self._free if s.proc is None or s.proc.poll() is not None]
            for slot in idle:
                self._free.remove(slot)
        try:
            for slot in idle:
                slot.spawn()
            for slot in idle:
                slot.await_ready()
        finally:
            for slot in idle:
                self._release(slot)

    @property
    def pids(self) -> list[int]:
        """Running children (for tests and stats)."""
        return [s.proc.pid for s in self._all if s.proc is not None and s.proc.poll() is None]

    def close(self) -> None:
        """Stop every child; renders in progress finish or fail first."""
        with self._cond:
            self._closed = True
            while len(self._free) < len(self._all):
                self._cond.wait()
            self._cond.notify_all()
        for slot in self._all:
            slot.stop()
