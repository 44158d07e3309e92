"""Vision-feature cache: byte-bounded LRU, disk round trips, restarts, damage, threads."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vlmq.worker.prep.vision_cache import SUFFIX, Entry, VisionCache, cache_key

GRID = np.array([[1, 4, 6]], dtype=np.int64)  # 8 bytes * 3 = 24 bytes


def make_entry(n_floats: int, seed: int = 0) -> Entry:
    """A float32 entry of exactly n_floats * 4 + 24 bytes."""
    rng = np.random.default_rng(seed)
    return Entry(features=rng.standard_normal(n_floats).astype(np.float32).reshape(-1, 1),
                 dtype_name="float32", grid_thw=GRID, meta={"tokens": n_floats, "m": "x"})


def key(i: int) -> str:
    return cache_key("model-a", f"{i:064x}", None, {"max_side": 448})


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_memory_lru_by_bytes_evicts_least_recent() -> None:
    size = make_entry(100).nbytes
    assert size == 100 * 4 + GRID.nbytes
    cache = VisionCache(mem_budget_bytes=3 * size)
    for i in range(3):
        cache.put(key(i), make_entry(100, i))
    assert cache.get(key(0)) is not None  # 0 is now most recent; 1 is the LRU
    cache.put(key(3), make_entry(100, 3))
    assert cache.contains(key(0)) and cache.contains(key(2)) and cache.contains(key(3))
    assert not cache.contains(key(1))
    # One big entry pushes out as many small ones as its bytes need.
    cache.put(key(4), make_entry(200, 4))
    st = cache.stats()
    assert st["mem_bytes"] <= 3 * size
    assert not cache.contains(key(2)) and not cache.contains(key(0))
    assert cache.contains(key(3)) and cache.contains(key(4))
    assert st["mem_evictions"] == st["evictions"] == 3


def test_byte_accounting_is_exact() -> None:
    cache = VisionCache(mem_budget_bytes=10_000)
    a, b = make_entry(100, 1), make_entry(300, 2)
    cache.put(key(1), a)
    cache.put(key(2), b)
    assert cache.stats()["mem_bytes"] == a.nbytes + b.nbytes
    cache.put(key(1), make_entry(50, 3))  # replacing a key re-charges it
    st = cache.stats()
    assert st["mem_bytes"] == make_entry(50).nbytes + b.nbytes
    assert st["mem_entries"] == 2


def test_entry_bigger_than_memory_budget_is_not_kept() -> None:
    cache = VisionCache(mem_budget_bytes=1000)
    cache.put(key(0), make_entry(10))
    cache.put(key(1), make_entry(1000))
    assert cache.contains(key(0)) and not cache.contains(key(1))
    assert cache.stats()["mem_evictions"] == 0


def test_hits_misses_and_split() -> None:
    cache = VisionCache(mem_budget_bytes=10_000)
    assert cache.get(key(0)) is None
    cache.put(key(0), make_entry(10))
    assert cache.get(key(0)) is not None
    st = cache.stats()
    assert (st["hits"], st["mem_hits"], st["disk_hits"], st["misses"]) == (1, 1, 0, 1)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_disk_round_trip_is_exact(tmp_path: Path, dtype_name: str) -> None:
    rng = np.random.default_rng(7)
    if dtype_name == "float32":
        feats = rng.standard_normal((37, 16)).astype(np.float32)
    else:  # bf16 bit patterns as numpy sees them, including NaN/inf patterns
        feats = rng.integers(0, 2**16, size=(37, 16), dtype=np.uint16)
    entry = Entry(features=feats, dtype_name=dtype_name, grid_thw=GRID,
                  meta={"n_tokens": 37, "note": "ü"})
    VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20).put(
        key(0), entry)
    got = VisionCache(mem_budget_bytes=1 << 20, disk_dir=tmp_path,
                      disk_budget_bytes=1 << 20).get(key(0))
    assert got is not None
    assert got.dtype_name == dtype_name
    assert got.features.dtype == feats.dtype and got.features.shape == feats.shape
    assert got.features.tobytes() == feats.tobytes()
    assert np.array_equal(got.grid_thw, GRID) and got.grid_thw.dtype == GRID.dtype
    assert got.meta == {"n_tokens": 37, "note": "ü"}
    assert not got.features.flags.writeable  # shared entries must not be mutated


def test_restart_hits_from_disk_and_promotes(tmp_path: Path) -> None:
    first = VisionCache(mem_budget_bytes=1 << 20, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    first.put(key(0), make_entry(64))
    second = VisionCache(mem_budget_bytes=1 << 20, disk_dir=tmp_path,
                         disk_budget_bytes=1 << 20)
    st = second.stats()
    assert (st["disk_entries"], st["mem_entries"]) == (1, 0)
    assert st["disk_bytes"] == (tmp_path / f"{key(0)}{SUFFIX}").stat().st_size
    assert second.get(key(0)) is not None
    assert second.get(key(0)) is not None
    st = second.stats()
    assert (st["disk_hits"], st["mem_hits"], st["mem_entries"]) == (1, 1, 1)


def test_disk_budget_enforced_with_lru(tmp_path: Path) -> None:
    probe = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path / "probe", disk_budget_bytes=1 << 20)
    probe.put(key(99), make_entry(200))
    fsize = probe.stats()["disk_bytes"]

    d = tmp_path / "cache"
    cache = VisionCache(mem_budget_bytes=0, disk_dir=d, disk_budget_bytes=3 * fsize)
    for i in range(3):
        cache.put(key(i), make_entry(200, i))
    assert cache.get(key(0)) is not None  # 1 becomes least recently used
    cache.put(key(3), make_entry(200, 3))
    st = cache.stats()
    assert st["disk_entries"] == 3 and st["disk_bytes"] <= 3 * fsize
    assert st["disk_evictions"] == 1
    assert files(d) == sorted(f"{key(i)}{SUFFIX}" for i in (0, 2, 3))

    # The LRU order survives a restart (mtime), and a smaller budget is enforced at start.
    old = time.time() - 100
    for age, i in enumerate((2, 3, 0)):
        os.utime(d / f"{key(i)}{SUFFIX}", (old + age, old + age))
    smaller = VisionCache(mem_budget_bytes=0, disk_dir=d, disk_budget_bytes=2 * fsize)
    assert files(d) == sorted(f"{key(i)}{SUFFIX}" for i in (0, 3))
    assert smaller.stats()["disk_evictions"] == 1


def test_entry_bigger_than_disk_budget_is_not_written(tmp_path: Path) -> None:
    cache = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=500)
    cache.put(key(0), make_entry(1000))
    assert files(tmp_path) == []
    assert cache.stats()["disk_entries"] == 0


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) - 17])
    elif how == "garbage":
        path.write_bytes(b"\x00garbage" * 50)
    elif how == "bitflip":  # same length, valid header: only the checksum notices
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncate", "garbage", "empty"])
def test_corrupt_file_removed_at_start(tmp_path: Path, how: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    cache = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    cache.put(key(0), make_entry(50, 0))
    cache.put(key(1), make_entry(50, 1))
    _damage(tmp_path / f"{key(0)}{SUFFIX}", how)
    with caplog.at_level(logging.WARNING, logger="vlmq.worker.prep.vision_cache"):
        fresh = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    assert files(tmp_path) == [f"{key(1)}{SUFFIX}"]
    assert "damaged" in caplog.text
    st = fresh.stats()
    assert (st["disk_entries"], st["corrupt_removed"]) == (1, 1)
    assert fresh.get(key(0)) is None and fresh.get(key(1)) is not None


@pytest.mark.parametrize("how", ["truncate", "garbage", "bitflip"])
def test_corrupt_file_removed_on_get(tmp_path: Path, how: str,
                                     caplog: pytest.LogCaptureFixture) -> None:
    cache = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    cache.put(key(0), make_entry(50))
    _damage(tmp_path / f"{key(0)}{SUFFIX}", how)
    with caplog.at_level(logging.WARNING, logger="vlmq.worker.prep.vision_cache"):
        assert cache.get(key(0)) is None
    assert files(tmp_path) == []
    assert "damaged" in caplog.text
    st = cache.stats()
    assert (st["misses"], st["disk_entries"], st["disk_bytes"], st["corrupt_removed"]) == (
        1, 0, 0, 1)
    cache.put(key(0), make_entry(50))  # and it can be written again
    assert files(tmp_path) == [f"{key(0)}{SUFFIX}"]


def test_file_deleted_behind_our_back_is_a_miss(tmp_path: Path) -> None:
    cache = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    cache.put(key(0), make_entry(50))
    (tmp_path / f"{key(0)}{SUFFIX}").unlink()
    assert cache.get(key(0)) is None
    assert cache.stats()["disk_entries"] == 0


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    cache = VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    for i in range(5):
        cache.put(key(i), make_entry(50, i))
    cache.put(key(0), make_entry(50, 0))  # already on disk: not rewritten
    assert files(tmp_path) == sorted(f"{key(i)}{SUFFIX}" for i in range(5))
    assert cache.stats()["disk_writes"] == 5


def test_stale_temp_files_cleaned_at_start(tmp_path: Path) -> None:
    stale = tmp_path / f".{key(0)}.abc.tmp"
    young = tmp_path / f".{key(1)}.def.tmp"
    stale.write_bytes(b"half")
    young.write_bytes(b"half")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    VisionCache(mem_budget_bytes=0, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    assert files(tmp_path) == [young.name]  # may belong to a live writer


def test_write_disk_false_then_persist(tmp_path: Path) -> None:
    cache = VisionCache(mem_budget_bytes=1 << 20, disk_dir=tmp_path, disk_budget_bytes=1 << 20)
    entry = make_entry(50)
    cache.put(key(0), entry, write_disk=False)
    assert files(tmp_path) == []
    assert cache.persist(key(0), entry)
    assert files(tmp_path) == [f"{key(0)}{SUFFIX}"]


def test_keys_differ_when_anything_differs() -> None:
    base = {"max_side": 1024, "scale": 2.0, "min_pixels": 3136, "max_pixels": 1003520}
    sha = "ab" * 32
    k = cache_key("m", sha, 1, base)
    assert k == cache_key("m", sha, 1, dict(reversed(base.items())))  # order-independent
    variants = {
        cache_key("m2", sha, 1, base),
        cache_key("m", "cd" * 32, 1, base),
        cache_key("m", sha, 2, base),
        cache_key("m", sha, None, base),
        *(cache_key("m", sha, 1, {**base, name: 7}) for name in base),
        cache_key("m", sha, 1, {**base, "render_dpi": 144}),
    }
    assert k not in variants and len(variants) == 4 + len(base) + 1
    with pytest.raises(ValueError, match="JSON"):
        cache_key("m", sha, 1, {"x": object()})


def test_entry_validation() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        Entry(features=np.zeros(3, np.float32), dtype_name="bfloat16", grid_thw=GRID)
    with pytest.raises(ValueError, match="unknown dtype_name"):
        Entry(features=np.zeros(3, np.float32), dtype_name="bogus", grid_thw=GRID)
    with pytest.raises(ValueError, match="grid_thw"):
        Entry(features=np.zeros(3, np.float32), dtype_name="float32",
              grid_thw=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="invalid cache key"):
        VisionCache(mem_budget_bytes=10).get("../etc/passwd")


def test_concurrent_get_put_counters_consistent(tmp_path: Path) -> None:
    entries = [make_entry(32, i) for i in range(16)]
    # Room for about half the keys in memory, so gets mix mem hits, disk hits and evictions.
    cache = VisionCache(mem_budget_bytes=8 * entries[0].nbytes, disk_dir=tmp_path,
                        disk_budget_bytes=1 << 20)
    n_threads, n_ops = 6, 300
    barrier = threading.Barrier(n_threads)
    wrong: list[str] = []

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        barrier.wait()
        for _ in range(n_ops):
            i = int(rng.integers(0, 16))
            if rng.random() < 0.3:
                cache.put(key(i), entries[i])
            else:
                got = cache.get(key(i))
                if got is not None and got.features.tobytes() != entries[i].features.tobytes():
                    wrong.append(key(i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wrong == []
    st = cache.stats()
    assert st["hits"] + st["misses"] + st["puts"] == n_threads * n_ops
    assert st["hits"] == st["mem_hits"] + st["disk_hits"]
    assert st["disk_hits"] > 0 and st["mem_evictions"] > 0
    assert st["mem_bytes"] == st["mem_entries"] * entries[0].nbytes <= cache.mem_budget_bytes
    disk = list(tmp_path.iterdir())
    assert st["disk_entries"] == len(disk) == 16
    assert st["disk_bytes"] == sum(p.stat().st_size for p in disk)
