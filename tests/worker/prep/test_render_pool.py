"""PDF rendering in bounded child processes: same pixels, failures stay in their page."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.support.helpers import pdf_bytes
from tests.support.pdf_craft import drawing_bomb_pdf, encrypted_pdf, zero_page_pdf
from vlmq.shared.blobs import sha256_hex
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_pool import RenderPool
from vlmq.worker.stats import COUNTERS


@pytest.fixture
def pool() -> Iterator[RenderPool]:
    rp = RenderPool(2, mem_mb=256, timeout_s=60)
    yield rp
    rp.close()


def test_pages_match_in_process_render_and_open_once(pool: RenderPool) -> None:
    data = pdf_bytes(3)
    key = sha256_hex(data)
    fetches = []

    def fetch() -> bytes:
        fetches.append(1)
        return data

    wants = [decode.render_pdf_page(data, page, 300) for page in (1, 2, 3)]
    COUNTERS.reset()
    for page, want in zip((1, 2, 3), wants, strict=True):
        got = pool.render(fetch, page, 300, doc_key=key)
        assert got.size == want.size and got.mode == "RGB"
        assert np.array_equal(np.asarray(got), np.asarray(want))
    assert len(fetches) == 1  # the child kept the document: bytes sent once
    assert COUNTERS.snapshot() == {"pdf_opens": 1, "pdf_renders": 3, "image_decodes": 0,
                                   "text_extracts": 0}


def test_a_page_over_the_memory_limit_fails_alone(pool: RenderPool) -> None:
    bomb = drawing_bomb_pdf(2_000_000)
    assert len(bomb) < 200_000
    with pytest.raises(decode.PreprocessError, match=r"page 1 too complex to render: .*256 MB"):
        pool.render(bomb, 1, 1288, doc_key=sha256_hex(bomb))
    good = pdf_bytes(1)
    img = pool.render(good, 1, 200, doc_key=sha256_hex(good))  # a fresh child serves on
    assert max(img.size) == 200


def test_a_page_over_the_time_limit_fails_alone() -> None:
    rp = RenderPool(1, mem_mb=4096, timeout_s=0.5)
    try:
        bomb = drawing_bomb_pdf(2_000_000)
        with pytest.raises(decode.PreprocessError, match=r"over the 0\.5 s render time limit"):
            rp.render(bomb, 1, 1288, doc_key=sha256_hex(bomb))
        assert rp.pids == []  # the stuck child was killed
        good = pdf_bytes(1)
        assert rp.render(good, 1, 100, doc_key=sha256_hex(good)).size[1] == 100
    finally:
        rp.close()


@pytest.mark.parametrize(("data", "message"), [
    (encrypted_pdf(), "encrypted (password-protected) PDF"),
    (zero_page_pdf(), "is a PDF with no pages"),
    (b"%PDF-1.4 junk", "corrupt or truncated PDF"),
])
def test_unreadable_pdfs_say_why(pool: RenderPool, data: bytes, message: str) -> None:
    with pytest.raises(decode.PreprocessError, match=re.escape(message)) as err:
        pool.render(data, 1, 100, doc_key=sha256_hex(data))
    assert "PDFium: Success" not in str(err.value)
    assert "Incorrect password" not in str(err.value)


def test_pages_of_different_pdfs_render_in_different_processes(pool: RenderPool) -> None:
    docs = [pdf_bytes(2), pdf_bytes(3)]
    errors: list[Exception] = []

    def render_all(data: bytes) -> None:
        try:
            for page in range(1, 3):
                pool.render(data, page, 150, doc_key=sha256_hex(data))
        except decode.PreprocessError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=render_all, args=(d,)) for d in docs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(pool.pids) == 2


def test_children_are_out_of_the_workers_process_group() -> None:
    """A Ctrl-C or `kill -TERM -<pgid>` reaches a whole process group: were the render
    children in the worker's, a page mid-render would die and its item fail for good while
    the worker itself stops gracefully. They run in sessions of their own instead."""
    import os

    pool = RenderPool(2)
    try:
        pool.warm()
        pids = pool.pids
        assert len(pids) == 2
        for pid in pids:
            assert os.getpgid(pid) != os.getpgrp()
            assert os.getsid(pid) == pid  # its own session (and group)
    finally:
        pool.close()
