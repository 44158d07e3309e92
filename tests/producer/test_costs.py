"""Producer costs that follow a job's own work, by counting, never timing: Redis
commands per upload whatever is pending, split work linear in the set, by reference four
system calls and no path resolution per file and at most three round trips per job, files
given twice kept once without a set of every path, the first job queued before the last
file is read, and the items held bounded."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis

from vlmq.producer import expand, inputs, job_sets, stream_sets, upload
from vlmq.producer.client import Client
from vlmq.producer.files import BlobSource
from vlmq.producer.inputs import Prepared
from vlmq.producer.job_sets import Batch
from vlmq.shared.errors import InputError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item
from vlmq.shared.results import end_job_event
from vlmq.stores.backends import FolderStore, Stores


def _png(i: int) -> bytes:
    """A distinct small PNG."""
    im = Image.new("RGB", (8, 8), (i % 256, (i // 256) % 256, 7))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _pngs(folder: Path, n: int, per_dir: int = 10) -> list[Path]:
    out = []
    for i in range(n):
        sub = folder / f"d{i // per_dir:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        out.append(sub / f"{i:05d}.png")
        out[-1].write_bytes(_png(i))
    return out


def _calls(redis: Redis) -> int:
    """Every command the server has run (INFO commandstats, summed)."""
    stats: dict[str, Any] = redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if not k.endswith("|info"))


# --- the upload budget -------------------------------------------------------------------


def test_commands_per_upload_do_not_grow_with_pending_jobs(
        own_redis: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "SWEEP_S", 1e9)  # no time-based sweep inside the count
    kw = own_redis.connection_pool.connection_kwargs
    client = Client(f"redis://{kw['host']}:{kw['port']}/0", allow_eviction=True)
    files = _pngs(tmp_path, 260)
    per_upload = []
    at = 0
    for pending in (20, 240):
        while at < pending:
            client.caption([files[at]])
            at += 1
        before = _calls(own_redis)
        for _ in range(5):
            client.caption([files[at]])
            at += 1
        per_upload.append((_calls(own_redis) - before) / 5)
    assert len(client.uploads.pending) == 245
    # The job's own upload and enqueue (a command more or less as the job index's upkeep
    # falls); nothing per pending job: one HGET each made 220 more pending cost 220 more.
    assert abs(per_upload[1] - per_upload[0]) <= 1 and per_upload[1] < 60
    client.close()


def test_a_job_end_is_heard_without_reading_the_pending_jobs(
        own_redis: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "SWEEP_S", 1e9)
    kw = own_redis.connection_pool.connection_kwargs
    client = Client(f"redis://{kw['host']}:{kw['port']}/0", allow_eviction=True)
    jobs = [client.caption([f]) for f in _pngs(tmp_path, 30)]
    pending_bytes = client.uploads.pending_bytes
    first = jobs[0]
    own_redis.hset(Keys.rq_job(first.id), "status", "finished")
    end_job_event(own_redis, client.keys, first.id, "finished", queue=first.queue, ttl_s=60)
    hgets = int(own_redis.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))
    client.uploads.refresh()
    after = int(own_redis.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))
    assert first.id not in client.uploads.pending and len(client.uploads.pending) == 29
    assert client.uploads.pending_bytes < pending_bytes
    assert after == hgets  # heard on the done channel: no status read
    client.close()


# --- splitting -----------------------------------------------------------------------------


class _CountingDict(dict[str, BlobSource]):
    """A blob dict that counts the entries anything walks or looks up."""

    touched = 0

    def items(self) -> Any:
        for pair in super().items():
            _CountingDict.touched += 1
            yield pair

    def __getitem__(self, key: str) -> BlobSource:
        _CountingDict.touched += 1
        return super().__getitem__(key)


def _split_work(n: int) -> int:
    blobs = _CountingDict()
    items = []
    for i in range(n):
        sha = f"{i:064x}"
        dict.__setitem__(blobs, sha, BlobSource(Path(f"/x/{i}"), f"{i}.png", sha, 10))
        items.append(Item(kind="image", blob=sha, source=f"{i}.png"))
    _CountingDict.touched = 0
    parts = job_sets.split_prepared(Prepared(items=items, blobs=blobs), 10)
    assert sum(len(p.items) for p in parts) == n and all(len(p.blobs) == 10 for p in parts)
    return _CountingDict.touched


def test_split_work_is_linear_in_the_blobs() -> None:
    small, big = _split_work(500), _split_work(2000)
    assert big == 4 * small <= 3 * 2000  # was jobs x blobs: 100 x 2000 at the larger


def test_a_long_run_is_cut_in_order() -> None:
    items = [Item(kind="pdf", blob="a" * 64, source="a.pdf", page=p) for p in range(1, 2502)]
    jobs = job_sets.split_items(items, 500)
    assert [len(j) for j in jobs] == [500] * 5 + [1]
    assert [i.page for j in jobs for i in j] == list(range(1, 2502))


# --- by reference: one resolution per file, streamed ---------------------------------------


@pytest.fixture
def store_client(redis_url: str, tmp_path: Path) -> Iterator[Client]:
    client = Client(redis_url, stores=Stores([FolderStore("t", tmp_path / "set")]),
                    allow_eviction=True)
    yield client
    client.close()


def test_one_path_resolution_per_file(store_client: Client, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _pngs(tmp_path / "set", 60)
    real = os.path.realpath
    calls: list[str] = []

    def counting(path: Any, *a: Any, **kw: Any) -> str:
        calls.append(os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os.path, "realpath", counting)
    batch = store_client.submit_set("caption", [tmp_path / "set"], recursive=True,
                                    job_size=20)
    assert isinstance(batch, Batch) and batch.items == 60
    payloads = [j.payload() for j in batch.jobs()]
    assert all(i.ref is not None for p in payloads for i in p.items)  # by reference
    # None per file: the folder given and the store's root, once each for the set (a
    # walked file's resolved path is its folder's plus its name). Was 8 per file.
    assert len(calls) <= 2


def _counting(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Calls of these os functions (and os.path.realpath) from here on, by name."""
    counts = dict.fromkeys((*names, "realpath"), 0)

    def counter(name: str, real: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            counts[name] += 1
            return real(*a, **kw)
        return call

    for name in names:
        monkeypatch.setattr(os, name, counter(name, getattr(os, name)))
    monkeypatch.setattr(os.path, "realpath", counter("realpath", os.path.realpath))
    return counts


def test_a_file_by_reference_costs_four_system_calls(
        store_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open, fstat, read, close per file, and nothing else that grows with the files: no
    stat or lstat (the walk's entries say what each name is), no path resolution."""
    _stream_small(monkeypatch)
    counts: dict[str, dict[str, int]] = {}
    for n in (60, 120):
        _pngs(tmp_path / "set" / str(n), n)  # 10 files a folder
        with monkeypatch.context() as m:
            counts[str(n)] = _counting(m, "open", "fstat", "read", "close", "stat", "lstat")
            batch = store_client.submit_set("caption", [tmp_path / "set" / str(n)],
                                            recursive=True, job_size=10)
        assert isinstance(batch, Batch) and batch.items == n
    more = {k: counts["120"][k] - counts["60"][k] for k in counts["60"]}
    assert more["fstat"] == more["read"] == 60  # one each per file
    assert 60 <= more["open"] <= 60 + 6 * 2  # a file's own, and a folder's manifest look
    assert more["close"] <= more["open"]
    assert more["stat"] + more["lstat"] <= 6 * 2  # per folder (the manifest), not per file
    assert more["realpath"] == 0 and counts["60"]["realpath"] <= 2


def _reads(redis: Redis) -> int:
    """Read events the server has handled: at least one per round trip of any client."""
    return int(redis.info("stats")["total_reads_processed"])


def test_round_trips_per_job_by_reference_are_few_and_do_not_grow(
        own_redis: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stream_small(monkeypatch)
    kw = own_redis.connection_pool.connection_kwargs
    client = Client(f"redis://{kw['host']}:{kw['port']}/0", allow_eviction=True,
                    stores=Stores([FolderStore("t", tmp_path / "set")]))
    reads = {}
    for n in (60, 180):
        _pngs(tmp_path / "set" / str(n), n)
        before = _reads(own_redis)
        batch = client.submit_set("caption", [tmp_path / "set" / str(n)], recursive=True,
                                  job_size=10)
        reads[n] = _reads(own_redis) - before - 1  # this INFO's own read
        assert isinstance(batch, Batch) and batch.items == n
    # Per job: the batch's check and the next id's reservation, the script check redis-py
    # makes before a pipeline with a script, the enqueue's MULTI. Was 8 (a queue check, an
    # id lookup, WATCH, EXISTS per job).
    per_job = (reads[180] - reads[60]) / 12
    assert per_job <= 3
    # The set's own: the client's first connection and eviction check, the queue check,
    # the record (29 reads in all for 60 files here).
    assert reads[60] <= 6 * 3 + 16
    client.close()


def _stream_small(monkeypatch: pytest.MonkeyPatch, after: int = 20) -> None:
    monkeypatch.setattr(stream_sets, "STREAM_AFTER_ITEMS", after)


def test_files_given_twice_are_kept_once_without_a_set_of_every_path(tmp_path: Path) -> None:
    """A folder walked is remembered as its walk, not as its files' paths; a file given
    again (inside a folder given before, named directly, through a symlink) is kept once,
    where the walk order first gives it."""
    root = tmp_path / "set"
    _pngs(root, 30)  # d000..d002
    (root / "d000" / "0-link.png").symlink_to(root / "d002" / "00029.png")  # a later file
    (root / "d002" / "z-link.png").symlink_to(root / "d000" / "00000.png")  # an earlier one
    seen = expand.Seen()
    given = [root, root / "d001", root / "d001" / "00011.png", str(root / "d00*" / "*.png")]
    found = [f for f in expand._iter_sources(given, True, seen)
             if not isinstance(f, InputError)]
    assert len(found) == 30 == len({f.real for f in found})
    names = [f.source for f in found]
    assert "d000/0-link.png" in names and "d002/00029.png" not in names
    assert "d002/z-link.png" not in names and "d000/00000.png" in names
    assert len(seen.paths) <= 2  # the symlinks' targets, not the thirty files
    assert len(seen.walks) == 2


def test_first_job_is_queued_before_the_last_file_is_read(
        store_client: Client, redis: Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stream_small(monkeypatch)
    files = _pngs(tmp_path / "set", 80)
    seen: dict[str, int] = {}
    checked = stream_sets.checked_pages

    def watching(found: Any, *a: Any) -> Any:
        if found.path == str(files[-1]):
            seen["queued"] = int(redis.llen(Keys.rq_queue("caption")))
        return checked(found, *a)

    monkeypatch.setattr(stream_sets, "checked_pages", watching)
    batch = store_client.submit_set("caption", [tmp_path / "set"], recursive=True,
                                    job_size=10)
    assert seen["queued"] >= 5  # jobs were in Redis while the last file was still unread
    assert isinstance(batch, Batch) and len(batch.jobs()) == 8
    keys = store_client.keys
    ids = [j.decode() for j in redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
    assert ids == [j.id for j in batch.jobs()]  # the record grew to name every job
    assert {m.decode() for m in redis.smembers(keys.batch_pending(batch.id))} == set(ids)
    record = redis.hgetall(keys.batch(batch.id))
    assert record[b"jobs"] == b"8" and record[b"items"] == b"80"
    assert batch.missing() == []


def test_items_held_stay_bounded_while_a_set_streams(
        store_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stream_small(monkeypatch)
    _pngs(tmp_path / "set", 200)
    most = {"items": 0}
    add = inputs.Prepared.add

    def counting(self: Prepared, *a: Any, **kw: Any) -> None:
        add(self, *a, **kw)
        most["items"] = max(most["items"], len(self.items))

    monkeypatch.setattr(inputs.Prepared, "add", counting)
    batch = store_client.submit_set("caption", [tmp_path / "set"], recursive=True,
                                    job_size=10)
    assert isinstance(batch, Batch) and batch.items == 200
    assert most["items"] <= 20 + 1 + 10  # the threshold, then a job's worth, never the set


def test_a_small_set_with_a_bad_file_is_still_refused_whole(
        store_client: Client, redis: Redis, tmp_path: Path) -> None:
    _pngs(tmp_path / "set", 30)
    (tmp_path / "set" / "d001" / "bad.png").write_bytes(b"not an image")
    before = redis.dbsize()
    with pytest.raises(InputError, match="is neither a PDF nor an image"):
        store_client.submit_set("caption", [tmp_path / "set"], recursive=True, job_size=5)
    assert redis.dbsize() == before


def test_a_bad_file_after_streaming_began_stops_the_set_and_lists_each(
        store_client: Client, redis: Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stream_small(monkeypatch)
    _pngs(tmp_path / "set", 60)
    (tmp_path / "set" / "d004" / "zz-bad.png").write_bytes(b"not an image")
    (tmp_path / "set" / "d005" / "zz-empty.png").write_bytes(b"")
    with pytest.raises(stream_sets.StreamedInputErrors) as info:
        store_client.submit_set("caption", [tmp_path / "set"], recursive=True, job_size=10)
    err = info.value
    assert [Path(e.path).name for e in err.errors] == ["zz-bad.png", "zz-empty.png"]
    assert err.jobs >= 1 and err.batch_id in str(err) and "--skip-bad" in str(err)
    batch = store_client.batch(err.batch_id)
    assert len(batch.jobs()) == err.jobs and batch.missing() == []  # reserved id counted out


def test_skip_bad_streams_and_reports_the_bad_files(
        store_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stream_small(monkeypatch)
    _pngs(tmp_path / "set", 60)
    (tmp_path / "set" / "d004" / "zz-bad.png").write_bytes(b"not an image")
    batch = store_client.submit_set("caption", [tmp_path / "set"], recursive=True,
                                    job_size=10, skip_bad=True)
    assert isinstance(batch, Batch) and batch.items == 60
    assert [Path(p).name for p, _ in batch.rejected] == ["zz-bad.png"]


def test_a_reference_gets_the_header_check(store_client: Client, tmp_path: Path) -> None:
    """Bombs by header size are refused by reference; the pixels are the worker's to decode
    (a truncated image fails its item there)."""
    folder = tmp_path / "set"
    folder.mkdir()
    buf = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buf, "PNG")
    (folder / "bomb.png").write_bytes(buf.getvalue())
    with pytest.raises(InputError, match=r"bomb\.png"):
        store_client.caption([folder / "bomb.png"])
    noisy = io.BytesIO()
    Image.effect_noise((200, 100), 60).convert("RGB").save(noisy, "PNG")
    (folder / "cut.png").write_bytes(noisy.getvalue()[:-2000])
    job = store_client.caption([folder / "cut.png"])
    assert job.items == 1 and job.payload().items[0].ref is not None
