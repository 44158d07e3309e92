"""A referenced input is read at a bounded memory cost: streamed through
the hash into a private copy that keeps a sparse file's holes, so what is decoded is
exactly what was verified; refused past the reader's limit before a byte is read.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlmq.shared.messages import Item, Ref
from vlmq.stores.backends import CHUNK, FolderStore, RefUnreadable, StoreError, Stores


def _item(path: Path, root: Path, *, size: int | None = None, sha: str | None = None) -> Item:
    if sha is None:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
        sha = digest.hexdigest()
    return Item(kind="image", blob=None, source=path.name,
                ref=Ref("scans", path.relative_to(root).as_posix()),
                size=path.stat().st_size if size is None else size, ref_sha256=sha)


def _sparse(path: Path, head: bytes, tail: int) -> Path:
    path.write_bytes(head)
    os.truncate(path, len(head) + tail)
    if path.stat().st_blocks * 512 > 16 << 20:
        pytest.skip("this file system does not keep sparse files sparse")
    return path


def test_the_copy_is_exactly_the_file(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 17) + bytes(2 * CHUNK) + b"end"
    (tmp_path / "f.bin").write_bytes(data)
    stores = Stores([FolderStore("scans", tmp_path)])
    with stores.open_verified(_item(tmp_path / "f.bin", tmp_path), limit=1 << 30) as fh:
        assert fh.read() == data
    assert stores.read(_item(tmp_path / "f.bin", tmp_path)) == data


def test_a_sparse_file_stays_sparse_in_the_copy(tmp_path: Path) -> None:
    path = _sparse(tmp_path / "s.png", b"\x89PNG head", 1 << 30)
    stores = Stores([FolderStore("scans", tmp_path)])
    with stores.open_verified(_item(path, tmp_path), limit=2 << 30) as fh:
        st = os.fstat(fh.fileno())
        assert st.st_size == path.stat().st_size
        assert st.st_blocks * 512 < 16 << 20  # the holes were skipped, not written
        assert fh.read(9) == b"\x89PNG head"


def test_a_reference_past_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = _sparse(tmp_path / "big.png", b"x", 5 << 20)
    item = _item(path, tmp_path, sha="0" * 64)
    with pytest.raises(StoreError, match=r"^scans:big\.png: 5242881 bytes is over the 4 MiB "
                                         r"\(4194304-byte\) limit for a referenced input "
                                         r"on this box$"):
        Stores([FolderStore("scans", tmp_path)]).open_verified(item, limit=4 << 20,
                                                              why=" on this box")


def test_a_file_that_grew_is_read_no_further_than_a_chunk_past_its_size(
        tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/io"):
        pytest.skip("reads /proc/self/io")
    path = tmp_path / "grown.bin"
    path.write_bytes(b"0123456789")
    item = _item(path, tmp_path)
    with path.open("ab") as fh:
        fh.write(os.urandom(64 * CHUNK))

    def rchar() -> int:
        with open("/proc/self/io", encoding="ascii") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))

    before = rchar()
    with pytest.raises(RefUnreadable, match="changed since it was enqueued") as exc:
        Stores([FolderStore("scans", tmp_path)]).open_verified(item, limit=1 << 30)
    assert "more than its 10" in exc.value.detail
    assert rchar() - before < 3 * CHUNK


def test_reading_a_gigabyte_reference_costs_a_chunk_of_memory(tmp_path: Path) -> None:
    """Measured in a fresh process, as the worker's prep thread would read it (before: a
    list of 1,024 chunks, then their join, 2 GiB at the peak)."""
    path = _sparse(tmp_path / "s.png", b"\x89PNG", 1 << 30)
    item = _item(path, tmp_path)
    script = textwrap.dedent(f"""
        import resource
        from vlmq.shared.messages import Item, Ref
        from vlmq.stores.backends import FolderStore, Stores
        item = Item(kind="image", blob=None, source="s.png", ref=Ref("scans", "s.png"),
                    size={item.size}, ref_sha256="{item.ref_sha256}")
        stores = Stores([FolderStore("scans", {str(tmp_path)!r})])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with stores.open_verified(item, limit=2 << 30) as fh:
            assert fh.read(4) == b"\\x89PNG"
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=300)
    assert int(out.stdout) < 16 << 20, out.stdout
