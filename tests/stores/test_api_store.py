"""Store vlmq-api without processes: the default folder both `vlmq api` and a worker
derive, a worker's stores gaining it unless configured, and the item errors that name
the fix when it cannot be read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from vlmq.shared.messages import Item, Ref
from vlmq.stores.api_store import (
    API_STORE,
    default_api_files_dir,
    explain,
    images_dir,
    store_spec,
    with_api_store,
)
from vlmq.stores.backends import StoreError, Stores

DATA = b"an image's bytes"


def _item(store: str = API_STORE, data: bytes = DATA) -> Item:
    return Item(kind="image", blob=None, source="data-line1.png",
                ref=Ref(store, "batch_x/ab.png"), size=len(data),
                ref_sha256=hashlib.sha256(data).hexdigest())


def _failure(stores: Stores, item: Item) -> str:
    with pytest.raises(StoreError) as exc:
        stores.read(item)
    assert item.ref is not None
    message: str = explain(item.ref, exc.value)
    return message


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in ("VLMQ_DATA", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_default_folder_follows_vlmq_data_then_xdg_then_home(
        env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_api_files_dir() == tmp_path / "home" / ".local" / "share" / "vlmq" / "api"
    env.setenv("XDG_DATA_HOME", "relative/ignored")  # the XDG spec ignores a relative one
    assert default_api_files_dir() == tmp_path / "home" / ".local" / "share" / "vlmq" / "api"
    env.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_api_files_dir() == tmp_path / "xdg" / "vlmq" / "api"
    env.setenv("VLMQ_DATA", str(tmp_path / "data"))
    assert default_api_files_dir() == tmp_path / "data" / "api"


def test_a_worker_reads_the_default_folder_unless_told_another(
        env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    scans = f"scans={(tmp_path / 'scans').as_uri()}"
    stores = with_api_store(Stores.parse([scans]))
    assert sorted(stores.by_name) == ["scans", API_STORE]
    # What the API spools under its default folder, the worker reads with no flag.
    folder = images_dir(default_api_files_dir()) / "batch_x"
    folder.mkdir(parents=True)
    (folder / "ab.png").write_bytes(DATA)
    assert stores.read(_item()) == DATA
    # A store vlmq-api that was given wins: the API's own --store, for a shared folder.
    given = Stores.parse([store_spec(tmp_path / "shared files")])
    assert with_api_store(given) is given
    assert given.get(API_STORE).url == (tmp_path / "shared files" / "images").as_uri()


def test_an_unreadable_api_image_names_the_fix_and_not_the_folder(
        env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stores = with_api_store(Stores())
    for message in (_failure(stores, _item()), _failure(Stores(), _item())):
        assert f"--store {API_STORE}=file:///FILES_DIR/images" in message, message
        assert "$VLMQ_DATA" in message and "VLMQ_STORES" in message, message
        assert str(tmp_path) not in message
    assert "missing or unreadable in store vlmq-api" in _failure(stores, _item())
    assert "unknown store 'vlmq-api'" in _failure(Stores(), _item())


def test_other_failures_are_left_as_they_are(env: pytest.MonkeyPatch) -> None:
    folder = images_dir(default_api_files_dir()) / "batch_x"
    folder.mkdir(parents=True)
    (folder / "ab.png").write_bytes(b"other bytes")  # changed since it was enqueued
    changed = _failure(with_api_store(Stores()), _item())
    assert "changed since it was enqueued" in changed and "--store" not in changed
    other = _failure(Stores(), _item(store="scans"))
    assert other.startswith("unknown store 'scans'") and "FILES_DIR" not in other
