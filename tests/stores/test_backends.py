"""Stores and references without a worker: parsing, path safety, verified reads, the wire
form (Python and enqueue.lua), and the producer enqueueing files in a store by reference."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ResponseError

from tests.support.factories import SHA, payload
from tests.support.helpers import make_images, make_pdf
from vlmq.producer.client import Client
from vlmq.producer.inputs import prepare
from vlmq.shared.enqueue import enqueue_lua, fetch_job, payload_of
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.messages import Item, Ref, parse_payload
from vlmq.stores.backends import (
    FolderStore,
    RefUnreadable,
    S3Store,
    StoreError,
    Stores,
    parse_store,
    ref_path_problem,
)


def ref_item(path: str, *, store: str = "scans", kind: str = "image", size: int = 10,
             sha: str = SHA) -> dict[str, object]:
    out: dict[str, object] = {"kind": kind, "ref": {"store": store, "path": path},
                              "sha256": sha, "size": size}
    if kind == "pdf":
        out["page"] = 1
    return out


# --- configuration ------------------------------------------------------------------------


def test_store_urls_parse(tmp_path: Path) -> None:
    stores = Stores.parse([f"a=file://{tmp_path}", "b=s3://bucket/some/prefix/",
                           f"c={tmp_path},d=s3://other"])
    a, b, c, d = (stores.get(n) for n in "abcd")
    assert isinstance(a, FolderStore) and a.root == tmp_path
    assert isinstance(b, S3Store) and (b.bucket, b.prefix) == ("bucket", "some/prefix")
    assert isinstance(c, FolderStore) and c.root == tmp_path
    assert isinstance(d, S3Store) and d.prefix == "" and d.url == "s3://other"
    assert Stores.parse([""]).describe() == "none"


@pytest.mark.parametrize(("spec", "says"), [
    ("noequals", "give NAME=URL"),
    ("bad name=file:///x", "store name"),
    ("a=file://host/x", "file:///absolute/path"),
    ("a=relative/path", "use file:///absolute/path or s3://"),
    ("a=s3://", "needs a bucket"),
    ("a=ftp://h/x", "use file:///absolute/path"),
])
def test_bad_store_specs_say_why(spec: str, says: str) -> None:
    with pytest.raises(StoreError, match=says):
        parse_store(spec)


def test_credentials_in_a_store_url_are_refused_and_not_repeated() -> None:
    with pytest.raises(StoreError) as exc:
        parse_store("a=s3://AKIAKEY:hunter2secret@bucket/prefix")
    assert "hunter2secret" not in str(exc.value) and "AKIAKEY" not in str(exc.value)
    assert "AWS_ACCESS_KEY_ID" in str(exc.value)


def test_a_store_name_given_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="given twice"):
        Stores.parse([f"a={tmp_path}", "a=s3://b"])


def test_store_option_reads_vlmq_stores(tmp_path: Path, run_cli) -> None:
    res = run_cli("enqueue", "caption", "--store", "bad", str(tmp_path), code=2)
    assert "give NAME=URL" in res.stderr


# --- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "problem"), [
    ("", "empty"), ("a/../../etc/passwd", "'..'"), ("..", "'..'"), ("/etc/passwd", "absolute"),
    ("a\\b.png", "backslash"), ("a\0b.png", "NUL"),
])
def test_paths_that_leave_a_store_are_refused(path: str, problem: str) -> None:
    found = ref_path_problem(path)
    assert found is not None and problem in found


def test_ordinary_paths_are_accepted() -> None:
    for path in ("a.png", "deep/er/scan 1.pdf", "..hidden/x", "a..b/c", "./x"):
        assert ref_path_problem(path) is None, path


def test_a_symlink_out_of_a_folder_store_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (root / "inner.txt").write_text("inner")
    (root / "out").symlink_to(outside / "secret.txt")
    (root / "same").symlink_to(root / "inner.txt")
    store = FolderStore("s", root)
    with pytest.raises(StoreError, match="leaves the store"):
        store.open("out")
    with store.open("same") as fh:  # a link that stays inside is followed
        assert fh.read() == b"inner"
    assert store.ref_path(root / "out") is None  # its target is outside: an upload
    assert store.ref_path(root / "inner.txt") == "inner.txt"
    assert [e.path for e in store.list()] == ["inner.txt", "same"]


# --- verified reads ----------------------------------------------------------------------


def test_a_read_is_verified_against_size_and_sha256(tmp_path: Path) -> None:
    (tmp_path / "f.png").write_bytes(b"0123456789")
    stores = Stores([FolderStore("scans", tmp_path)])
    sha = hashlib.sha256(b"0123456789").hexdigest()
    item = parse_payload({"v": 1, "task": "caption",
                          "items": [ref_item("f.png", sha=sha)]}).items[0]
    assert stores.read(item) == b"0123456789"
    (tmp_path / "f.png").write_bytes(b"0123456780")
    # What changed is for this machine's log (detail), never for the stored error.
    with pytest.raises(RefUnreadable, match=r"^scans:f\.png changed since it was enqueued "
                                            r"\(its size or sha256 differs\)") as exc:
        stores.read(item)
    assert exc.value.detail.startswith(f"scans:f.png changed since it was enqueued "
                                       f"(sha256 {sha[:16]}")
    (tmp_path / "f.png").write_bytes(b"01234567890")
    with pytest.raises(RefUnreadable) as exc:
        stores.read(item)
    assert "more than its 10" in exc.value.detail and "10" not in str(exc.value)
    with pytest.raises(StoreError, match="unknown store 'other'"):
        stores.read(Item(kind="image", blob=None, source="x", ref=Ref("other", "f.png"),
                         size=10, ref_sha256=sha))


# --- the wire form ---------------------------------------------------------------------------


def test_item_wire_form_round_trips() -> None:
    raw = {"v": 1, "task": "ocr", "items": [
        {**ref_item("2024/a.pdf", kind="pdf", size=99), "custom_id": "c1"},
        {"kind": "image", "blob": SHA, "source": "b.png"}]}
    payload = parse_payload(raw)
    ref, blob = payload.items
    assert ref.ref == Ref("scans", "2024/a.pdf") and ref.blob is None and ref.size == 99
    assert ref.sha256 == SHA == blob.sha256 and ref.source == "2024/a.pdf"
    wire = payload.to_dict()["items"]
    assert wire[0] == {"kind": "pdf", "ref": {"store": "scans", "path": "2024/a.pdf"},
                       "sha256": SHA, "size": 99, "source": "2024/a.pdf", "page": 1,
                       "custom_id": "c1"}
    assert "ref" not in wire[1] and "sha256" not in wire[1]
    assert parse_payload(payload.to_dict()).items == payload.items


@pytest.mark.parametrize(("item", "field"), [
    ({**ref_item("a.png"), "blob": SHA}, "items[0]"),
    ({"kind": "image", "blob": SHA, "sha256": SHA}, "items[0].sha256"),
    ({**ref_item("a.png"), "size": 0}, "items[0].size"),
    ({**ref_item("a.png"), "sha256": "AB" * 32}, "items[0].sha256"),
    ({**ref_item("a.png", store="no/slash")}, "items[0].ref.store"),
    ({"kind": "image", "ref": {"store": "s", "path": ""}, "sha256": SHA, "size": 1},
     "items[0].ref.path"),
    ({"kind": "image", "ref": {"store": "s", "path": "a", "x": 1}, "sha256": SHA,
      "size": 1}, "items[0].ref"),
])
def test_bad_references_are_refused_naming_the_field(item: dict[str, object],
                                                     field: str) -> None:
    with pytest.raises(PayloadError) as exc:
        parse_payload({"v": 1, "task": "caption", "items": [item]})
    assert exc.value.field == field


def test_enqueue_lua_takes_references_without_blobs(redis: Redis) -> None:
    job_id = enqueue_lua(redis, payload(ref_item("a/b.png"), ref_item("c.pdf", kind="pdf"),
                                 task="caption"), queue="caption")
    assert payload_of(fetch_job(redis, job_id)).items[0].ref == Ref("scans", "a/b.png")
    assert not list(redis.scan_iter("vlmq:blob:*"))


@pytest.mark.parametrize(("path", "says"), [
    ("../outside/x.png", "'..' segment"), ("a/../../x.png", "'..' segment"),
    ("/etc/passwd", "relative"), ("a\\b.png", "backslash"), ("a\0b.png", "NUL"),
])
def test_enqueue_lua_refuses_paths_that_leave_the_store(redis: Redis, path: str,
                                                         says: str) -> None:
    with pytest.raises(ResponseError) as exc:
        enqueue_lua(redis, payload(ref_item("ok.png"), ref_item(path), task="caption"),
                    queue="caption")
    assert str(exc.value).startswith("items[1].ref.path: ") and says in str(exc.value)
    assert not list(redis.scan_iter("rq:job:*"))


@pytest.mark.parametrize(("change", "field"), [
    ({"size": 1.5}, "items[0].size"), ({"size": "9"}, "items[0].size"),
    ({"sha256": "xyz"}, "items[0].sha256"), ({"ref": {"store": "a b", "path": "x"}},
                                             "items[0].ref.store"),
    ({"ref": {"store": "s", "path": "x", "extra": 1}}, "items[0].ref"),
    ({"blob": SHA}, "items[0]"),
])
def test_enqueue_lua_checks_the_reference_form(redis: Redis, change: dict[str, object],
                                               field: str) -> None:
    with pytest.raises(ResponseError) as exc:
        enqueue_lua(redis, payload({**ref_item("x.png"), **change}, task="caption"),
                    queue="caption")
    assert str(exc.value).startswith(field + ":"), str(exc.value)


# --- the producer -------------------------------------------------------------------------


def test_files_in_a_store_are_enqueued_by_reference(tmp_path: Path, redis_url: str,
                                                    redis: Redis) -> None:
    store = tmp_path / "scans"
    make_images(store / "photos", 3)
    (store / "docs").mkdir()
    make_pdf(store / "docs" / "report.pdf", 4)
    outside = make_images(tmp_path / "elsewhere", 1)[0]
    stores = Stores([FolderStore("scans", store)])
    prepared = prepare([store, outside], recursive=True, pages="2-3", stores=stores)
    refs = [i for i in prepared.items if i.ref is not None]
    assert [(i.ref.path, i.page) for i in refs if i.ref is not None] == [
        ("docs/report.pdf", 2), ("docs/report.pdf", 3), ("photos/img0.png", None),
        ("photos/img1.png", None), ("photos/img2.png", None)]
    assert all(i.size == os.path.getsize(store / i.ref.path) for i in refs if i.ref)
    uploads = [i for i in prepared.items if i.ref is None]
    assert len(uploads) == 1 and list(prepared.blobs) == [uploads[0].blob]
    with Client(redis_url, stores=stores) as client:
        job = client.submit("caption", prepared)
    assert job.uploaded == 1 and job.blobs == 1
    assert len(list(redis.scan_iter("vlmq:blob:*"))) == 1  # the file outside only
    with pytest.raises(InputError, match="page 9 is out of range"):
        prepare([store / "docs"], pages="9", stores=stores)


def test_a_bad_file_in_a_store_is_refused_before_anything_is_written(
        tmp_path: Path, redis_url: str, redis: Redis) -> None:
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nnot really")
    stores = Stores([FolderStore("scans", tmp_path)])
    with Client(redis_url, stores=stores) as client, \
            pytest.raises(InputError, match=r"broken\.pdf: is a corrupt or truncated PDF"):
        client.caption([tmp_path / "broken.pdf"])
    assert not list(redis.scan_iter("*"))[1:]  # only the test's db claim


def test_manifest_files_in_a_store_go_by_reference(tmp_path: Path, run_cli,
                                                   redis: Redis) -> None:
    make_images(tmp_path / "in", 2)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"custom_id": f"c{i}", "task": "caption",
                                            "file": f"in/img{i}.png"}) + "\n"
                                for i in range(2)))
    res = run_cli("enqueue", "--manifest", str(manifest), "--json", "--store",
                  f"m={tmp_path}", code=0)
    job = json.loads(res.stdout)["jobs"][0]
    assert job["uploaded"] == 0 and job["blobs"] == 0
    items = payload_of(fetch_job(redis, job["id"])).items
    assert [i.ref for i in items] == [Ref("m", "in/img0.png"), Ref("m", "in/img1.png")]
