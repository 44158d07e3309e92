"""Store paths and what their failures say, without a worker.

- a folder store reaches a file one name at a time from its root, so a folder swapped
for a symlink out of the store (however fast, whenever) is never gone through.
- what a reference's failure says to its producer does not map the store.
- secrets in URLs are redacted from store errors and --store parse errors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmq.shared.messages import Item, Ref
from vlmq.shared.urls import redact_text
from vlmq.stores import backends
from vlmq.stores.backends import (
    FolderStore,
    RefUnreadable,
    StoreError,
    Stores,
    parse_store,
)

INSIDE, OUTSIDE = b"inside bytes", b"OUTSIDE SECRET"
OPENS = 20_000  # bounded by count, never by time


def _tree(tmp: Path) -> tuple[Path, Path]:
    """root/d/x.png (inside) and outside/x.png beside the root."""
    root, outside = tmp / "root", tmp / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "x.png").write_bytes(INSIDE)
    (outside / "x.png").write_bytes(OUTSIDE)
    return root, outside


def _read(store: FolderStore, path: str) -> bytes | None:
    try:
        with store.open(path) as fh:
            return fh.read()
    except StoreError:
        return None


# --- the swap race -----------------------------------------------------------------

_SWAPPER = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    a, b, stop = (p.encode() for p in sys.argv[1:4])
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    print("ready", flush=True)
    n = 0
    while n % 256 or not os.path.exists(stop):
        if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
            sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
        n += 1
""")


def _has_renameat2() -> bool:
    name = ctypes.util.find_library("c")
    return sys.platform.startswith("linux") and name is not None and \
        hasattr(ctypes.CDLL(name), "renameat2")


@pytest.fixture
def swapping(tmp_path: Path) -> Iterator[tuple[FolderStore, Path]]:
    """root/d flips between the real folder and a symlink to outside, atomically (one
    renameat2 exchange) and as fast as another process can, for as long as the test."""
    if not _has_renameat2():
        pytest.skip("needs renameat2 (Linux)")
    root, outside = _tree(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(outside)
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(root / "d"), str(link),
                             str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield FolderStore("s", root), stop
    finally:
        stop.touch()
        assert proc.wait(timeout=120) == 0
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_folder_swapped_with_a_symlink_out_is_never_gone_through(
        swapping: tuple[FolderStore, Path]) -> None:
    store, _ = swapping
    seen = {INSIDE: 0, OUTSIDE: 0, None: 0}
    for _ in range(OPENS):
        got = _read(store, "d/x.png")
        seen[got] = seen.get(got, 0) + 1
    assert seen[OUTSIDE] == 0, seen
    assert seen[INSIDE] > 0, seen  # the race ran both ways: the inside file was read


def test_an_adversary_swapping_before_every_open_gets_nothing_outside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic: the swap lands just before each open the store makes, the worst
    moment for any check made before it."""
    root, outside = _tree(tmp_path)
    aside = tmp_path / "aside"
    real_open = os.open

    def flip() -> None:
        d = root / "d"
        if d.is_symlink():
            d.unlink()
            aside.rename(d)
        else:
            d.rename(aside)
            d.symlink_to(outside)

    def adversary(*args: object, **kw: object) -> int:
        flip()
        return real_open(*args, **kw)  # type: ignore[arg-type]

    store = FolderStore("s", root)
    monkeypatch.setattr(backends.os, "open", adversary)
    got = [_read(store, "d/x.png") for _ in range(50)]
    monkeypatch.undo()
    assert OUTSIDE not in got


def test_symlinked_folders_are_followed_only_inside(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path)
    (root / "in-rel").symlink_to("d")
    (root / "in-abs").symlink_to(root / "d")
    (root / "d" / "up").symlink_to("..")  # root itself: inside
    (root / "out").symlink_to(outside)
    (root / "out-rel").symlink_to("../outside")
    (root / "d" / "climb").symlink_to("../../outside")
    (root / "loop").symlink_to("loop")
    (root / "fifo.png").unlink(missing_ok=True)
    os.mkfifo(root / "fifo.png")
    store = FolderStore("s", root)
    for path in ("d/x.png", "in-rel/x.png", "in-abs/x.png", "d/up/d/x.png"):
        assert _read(store, path) == INSIDE, path
    for path in ("out/x.png", "out-rel/x.png", "d/climb/x.png"):
        with pytest.raises(StoreError, match="leaves the store"):
            store.open(path)
    with pytest.raises(StoreError, match="too many symlinks"):
        store.open("loop/x.png")
    with pytest.raises(StoreError, match="not a regular file"):
        store.open("fifo.png")  # refused, never opened (it would block)
    assert store.locate("in-rel/x.png") == os.path.join(os.path.realpath(root), "d", "x.png")


# --- one answer, whatever is wrong ---------------------------------------------------


def _ref(path: str, sha: str, size: int) -> Item:
    return Item(kind="image", blob=None, source=path, ref=Ref("s", path), size=size,
                ref_sha256=sha)


def test_a_failed_reference_says_nothing_about_the_file(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path)
    real = hashlib.sha256(INSIDE).hexdigest()
    (root / "link.png").symlink_to(outside / "x.png")
    (root / "dir.png").mkdir()
    claimed = "ab" * 32
    stores = Stores([FolderStore("s", root)])
    errors = {}
    for why, item in {"sha": _ref("d/x.png", claimed, len(INSIDE)),
                      "size": _ref("d/x.png", real, 999),
                      "missing": _ref("nope.png", claimed, 999),
                      "symlink": _ref("link.png", claimed, 999),
                      "directory": _ref("dir.png", claimed, 999)}.items():
        with pytest.raises(RefUnreadable) as exc:
            stores.open_verified(item, limit=1 << 20)
        assert item.ref is not None
        errors[why] = str(exc.value).replace(item.ref.path, "P")
        for secret in (real[:8], str(len(INSIDE)), str(root), "symlink", "no such"):
            assert secret not in str(exc.value), (why, secret)
    assert errors["sha"] == errors["size"] == "s:P changed since it was enqueued (its size " \
        "or sha256 differs); enqueue it again"
    assert errors["missing"] == errors["symlink"] == errors["directory"] == \
        "s:P: the referenced file is missing or unreadable in store s"


# --- secrets never repeated -------------------------------------------------------


def test_redact_text_masks_userinfo_and_signed_query_strings() -> None:
    text = ('Could not connect to the endpoint URL: "http://AKIAUSER:secret@host:9/b/k" '
            "and https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ff"
            "&X-Amz-Security-Token=tok&x=1 and ?AWSAccessKeyId=AKIA&Signature=q2&sig=q3"
            "&token=q4")
    out = redact_text(text)
    for secret in ("AKIAUSER", "secret", "AKIA%2F1", "=ff", "tok&", "AKIA&", "q2", "q3", "q4"):
        assert secret not in out, secret
    assert "http://***@host:9/b/k" in out and "&x=1" in out
    assert redact_text("no secret: a token, a sig") == "no secret: a token, a sig"


@pytest.mark.parametrize("spec", [
    "s=s3://b/x?X-Amz-Signature=secret", "s=s3://AKIAUSER:secret@b/x",
    "s3://b/x?X-Amz-Signature=secret", "s=https://h/x?sig=secret&token=secret"])
def test_a_store_spec_with_a_secret_is_refused_without_echoing_it(spec: str) -> None:
    with pytest.raises(StoreError) as exc:
        parse_store(spec)
    assert "secret" not in str(exc.value)


def test_the_store_option_error_does_not_echo_a_signature() -> None:
    from click.testing import CliRunner

    from vlmq.cli.main import main

    out = CliRunner().invoke(main, ["enqueue", "caption", "x.png", "--store",
                                   "s=s3://b/x?X-Amz-Signature=secret"])
    assert out.exit_code == 2 and "--store" in out.output
    assert "secret" not in out.output


def test_store_errors_are_redacted_when_made() -> None:
    exc = StoreError("s:a.png: EndpointConnectionError: http://AKIAUSER:secret@h/b/a.png")
    assert "secret" not in str(exc) and "AKIAUSER" not in str(exc)
