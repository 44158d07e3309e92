"""Two-tier cache of vision-tower outputs, so a repeated page or image skips all image work.

A hit must let the worker skip blob fetch, decode, PDF render and the tower, so keys are
computed from identities (model, blob sha256, page, preprocessing parameters), never from
pixels. Values are plain numpy arrays: this module runs on CPU pool threads and must never
touch MLX (one other thread owns every MLX call); the MLX thread converts on its side.

Memory tier: LRU bounded by bytes. Disk tier (optional): one safetensors file per key,
written atomically, bounded by total bytes with LRU eviction, rebuilt by a scan at start,
so a restarted worker stays warm. A damaged file is logged, removed and treated as a miss.

mlx-vlm ships `mlx_vlm.vision_cache.VisionFeatureCache`, but it is not reusable here: it
imports mlx at module level, bounds by entry count, keys by image path or pixel hash (which
needs the image decoded first) and has no disk tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load as st_load
from safetensors.numpy import save_file as st_save_file

log = logging.getLogger(__name__)

KEY_VERSION = 1
FILE_FORMAT = "vlmq-vision-cache-1"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
# Temp files older than this at start are leftovers of a crash; younger ones may belong to
# another process writing into the same dir right now.
STALE_TMP_S = 600.0
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")

MetaValue = str | int


def cache_key(model_id: str, blob_sha: str, page: int | None,
              params: Mapping[str, object]) -> str:
    """Hash everything that changes the features, so a stale entry can never be returned.

    `model_id` must change whenever the weights or processor change (e.g. path + revision).
    `params` carries every preprocessing setting (max_side, render scale/dpi, processor
    min/max pixels, ...); 1 and 1.0 hash differently, so callers must pass stable types.
    """
    doc = {"v": KEY_VERSION, "model": model_id, "blob": blob_sha, "page": page,
           "params": dict(params)}
    try:
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cache key params must be plain JSON values: {exc}") from exc
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _frozen(arr: np.ndarray) -> np.ndarray:
    """A contiguous read-only view: the cache shares entries, so nobody may mutate them."""
    view: np.ndarray = np.ascontiguousarray(arr).view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class Entry:
    """Vision features for one image, exactly as the MLX thread produced them.

    bf16 features travel as a uint16 view with dtype_name "bfloat16" (numpy has no bf16);
    other dtypes travel as themselves. grid_thw is needed to rebuild input ids on a hit.
    The entry keeps read-only views of the given arrays, not copies: hand over fresh arrays
    and do not mutate them afterwards.
    """

    features: np.ndarray
    dtype_name: str
    grid_thw: np.ndarray
    meta: Mapping[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.features, np.ndarray) or not isinstance(self.grid_thw,
                                                                       np.ndarray):
            raise TypeError("features and grid_thw must be numpy arrays")
        expected = np.dtype(np.uint16) if self.dtype_name == "bfloat16" else None
        if expected is None:
            try:
                expected = np.dtype(self.dtype_name)
            except TypeError as exc:
                raise ValueError(f"unknown dtype_name {self.dtype_name!r}") from exc
        if self.features.dtype != expected:
            raise ValueError(f"dtype_name {self.dtype_name!r} needs a {expected} array, "
                             f"got {self.features.dtype}")
        if not np.issubdtype(self.grid_thw.dtype, np.integer):
            raise ValueError(f"grid_thw must be an integer array, got {self.grid_thw.dtype}")
        for k, v in self.meta.items():
            if not isinstance(k, str) or not isinstance(v, str | int):
                raise ValueError(f"meta must map str to str|int, got {k!r}: {v!r}")
        object.__setattr__(self, "features", _frozen(self.features))
        object.__setattr__(self, "grid_thw", _frozen(self.grid_thw))
        object.__setattr__(self, "meta", dict(self.meta))

    @property
    def nbytes(self) -> int:
        """Bytes charged to the memory budget: the arrays (meta is small and not counted)."""
        return int(self.features.nbytes + self.grid_thw.nbytes)


class _CorruptFile(Exception):
    """A cache file that cannot be trusted; internal, always turned into a miss."""


def _checksum(entry: Entry) -> str:
    # Detects bit rot and torn writes, not tampering: the cache dir is trusted.
    crc = zlib.crc32(entry.features.data)
    crc = zlib.crc32(entry.grid_thw.data, crc)
    return f"{crc:08x}"


def _file_metadata(key: str, entry: Entry) -> dict[str, str]:
    return {"format": FILE_FORMAT, "key": key, "dtype_name": entry.dtype_name,
            "meta": json.dumps(dict(entry.meta), sort_keys=True), "crc32": _checksum(entry)}


def _check_metadata(key: str, md: Mapping[str, str] | None) -> None:
    if md is None or md.get("format") != FILE_FORMAT:
        raise _CorruptFile("not a vlmq cache file (format tag missing)")
    if md.get("key") != key:
        raise _CorruptFile(f"file holds key {md.get('key')!r}")


def _decode(key: str, data: bytes) -> Entry:
    """Parse and verify one file's bytes; any doubt raises _CorruptFile."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        md = json.loads(data[8:8 + header_len]).get("__metadata__")
        _check_metadata(key, md)
        entry = Entry(features=tensors["features"], dtype_name=md["dtype_name"],
                      grid_thw=tensors["grid_thw"], meta=json.loads(md["meta"]))
    except SafetensorError as exc:
        raise _CorruptFile(f"unreadable safetensors: {exc}") from exc
    except KeyError as exc:
        raise _CorruptFile(f"missing field {exc}") from exc
    except (ValueError, TypeError, AttributeError) as exc:  # JSON, dtype or meta checks
        raise _CorruptFile(str(exc)) from exc
    if md.get("crc32") != _checksum(entry):
        raise _CorruptFile("checksum mismatch")
    return entry


_COUNTERS = ("hits", "mem_hits", "disk_hits", "misses", "puts", "mem_evictions",
             "disk_evictions", "disk_writes", "disk_write_errors", "corrupt_removed")


class VisionCache:
    """Thread-safe two-tier cache; one lock guards the indexes, files and counters.

    Disk reads and temp-file writes run outside the lock (they are the slow part); the
    rename into place, index updates and evictions run under it, so the index always
    matches the files this process wrote. Several processes may share a dir, but each
    enforces its budget only over the files it knows about.
    """

    def __init__(self, mem_budget_bytes: int, disk_dir: str | os.PathLike[str] | None = None,
                 disk_budget_bytes: int = 0) -> None:
        if mem_budget_bytes < 0:
            raise ValueError("mem_budget_bytes must be >= 0")
        if disk_dir is not None and disk_budget_bytes <= 0:
            raise ValueError("a disk tier needs disk_budget_bytes > 0")
        self.mem_budget_bytes = mem_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self._lock = threading.Lock()
        self._mem: OrderedDict[str, Entry] = OrderedDict()
        self._mem_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._disk_bytes = 0
        self._n = dict.fromkeys(_COUNTERS, 0)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- public API -------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """Memory first, then disk (promoted into memory); None on a miss."""
        _check_key(key)
        with self._lock:
            entry = self._mem.get(key)
            if entry is not None:
                self._mem.move_to_end(key)
                if key in self._disk:
                    self._disk.move_to_end(key)
                self._n["hits"] += 1
                self._n["mem_hits"] += 1
                return entry
            on_disk = key in self._disk
            if not on_disk:
                self._n["misses"] += 1
                return None
        entry = self._read_disk(key)
        with self._lock:
            if entry is None:
                self._n["misses"] += 1
                return None
            if key in self._disk:
                self._disk.move_to_end(key)
            self._mem_insert(key, entry)
            self._n["hits"] += 1
            self._n["disk_hits"] += 1
        self._touch(key)
        return entry

    def put(self, key: str, entry: Entry, *, write_disk: bool = True) -> None:
        """Store in memory and, if write_disk, on disk in this thread.

        Callers on a latency-critical thread pass write_disk=False and hand `persist`
        to a pool thread instead.
        """
        _check_key(key)
        with self._lock:
            self._mem_insert(key, entry)
            self._n["puts"] += 1
        if write_disk and self.disk_dir is not None:
            self.persist(key, entry)

    def persist(self, key: str, entry: Entry) -> bool:
        """Write one entry to the disk tier; True if it is on disk afterwards.

        A failed write (disk full, permissions) is logged and counted, not raised: the disk
        tier is an optimisation and must not fail the item that produced the features.
        """
        _check_key(key)
        if self.disk_dir is None:
            return False
        with self._lock:
            if key in self._disk:  # same key, same content: only refresh its recency
                self._disk.move_to_end(key)
                known = True
            else:
                known = False
        if known:
            self._touch(key)
            return True
        tmp = self.disk_dir / f".{key}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            st_save_file({"features": entry.features, "grid_thw": entry.grid_thw}, str(tmp),
                         metadata=_file_metadata(key, entry))
            size = tmp.stat().st_size
            if size > self.disk_budget_bytes:
                tmp.unlink()
                return False
            with self._lock:
                os.replace(tmp, self._path(key))
                self._disk_forget(key)
                self._disk[key] = size
                self._disk_bytes += size
                self._n["disk_writes"] += 1
                self._disk_evict()
            return True
        except (OSError, SafetensorError) as exc:
            with contextlib.suppress(OSError):  # e.g. a read-only disk refuses this too
                tmp.unlink(missing_ok=True)
            with self._lock:
                self._n["disk_write_errors"] += 1
            log.warning("vision cache: could not write %s: %s", key, exc)
            return False

    def contains(self, key: str) -> bool:
        """True if either tier holds key; counts nothing and leaves recency alone."""
        with self._lock:
            return key in self._mem or key in self._disk

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._n)
            out.update(mem_bytes=self._mem_bytes, mem_entries=len(self._mem),
                       disk_bytes=self._disk_bytes, disk_entries=len(self._disk),
                       evictions=self._n["mem_evictions"] + self._n["disk_evictions"],
                       mem_budget_bytes=self.mem_budget_bytes,
                       disk_budget_bytes=self.disk_budget_bytes)
            return out

    # -- memory tier (lock held) --------------------------------------------------------

    def _mem_insert(self, key: str, entry: Entry) -> None:
        old = self._mem.pop(key, None)
        if old is not None:
            self._mem_bytes -= old.nbytes
        if entry.nbytes > self.mem_budget_bytes:
            return  # would evict everything and still not fit
        self._mem[key] = entry
        self._mem_bytes += entry.nbytes
        while self._mem_bytes > self.mem_budget_bytes:
            _, victim = self._mem.popitem(last=False)
            self._mem_bytes -= victim.nbytes
            self._n["mem_evictions"] += 1

    # -- disk tier --------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{key}{SUFFIX}"

    def _disk_forget(self, key: str) -> None:
        size = self._disk.pop(key, None)
        if size is not None:
            self._disk_bytes -= size

    def _disk_evict(self) -> None:
        """Lock held: drop least recently used files until the budget holds."""
        while self._disk_bytes > self.disk_budget_bytes and self._disk:
            key, size = self._disk.popitem(last=False)
            self._disk_bytes -= size
            self._n["disk_evictions"] += 1
            self._path(key).unlink(missing_ok=True)

    def _touch(self, key: str) -> None:
        """Bump mtime so LRU order survives a restart."""
        # Evicted by another thread meanwhile: its recency no longer matters.
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._path(key))

    def _read_disk(self, key: str) -> Entry | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            with self._lock:  # deleted behind our back: forget it
                if not path.exists():
                    self._disk_forget(key)
            return None
        try:
            return _decode(key, data)
        except _CorruptFile as exc:
            self._remove_corrupt(key, path, inode, str(exc))
            return None

    def _remove_corrupt(self, key: str, path: Path, inode: int, why: str) -> None:
        log.warning("vision cache: removing damaged file %s: %s", path.name, why)
        with self._lock:
            try:
                same_file = os.stat(path).st_ino == inode
            except FileNotFoundError:
                same_file = False
                self._disk_forget(key)
            if same_file:  # not replaced by a fresh write since we read it
                path.unlink()
                self._disk_forget(key)
                self._n["corrupt_removed"] += 1

    def _scan(self) -> None:
        """Rebuild the index from the dir; headers only, so start-up stays fast."""
        assert self.disk_dir is not None
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for path in self.disk_dir.iterdir():
            name = path.name
            try:
                st = path.stat()
                if name.startswith(".") and name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        path.unlink(missing_ok=True)
                    continue
                key = name[:-len(SUFFIX)]
                if not (name.endswith(SUFFIX) and _KEY_RE.fullmatch(key) and path.is_file()):
                    continue
                with safe_open(str(path), framework="np") as f:
                    _check_metadata(key, f.metadata())
            except FileNotFoundError:
                continue  # removed by another process sharing the dir
            except (SafetensorError, _CorruptFile) as exc:
                log.warning("vision cache: removing damaged file %s: %s", name, exc)
                path.unlink(missing_ok=True)
                self._n["corrupt_removed"] += 1
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._disk[key] = size
            self._disk_bytes += size
        self._disk_evict()  # the budget may have shrunk since the last run


def _check_key(key: str) -> None:
    # Keys become file names, so keep them to a safe alphabet.
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"invalid cache key {key!r} (use cache_key())")
