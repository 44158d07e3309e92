"""What the user named (files, folders, quoted globs, s3:// URLs) expanded to the files
to check, each with the source name results are filed under.

Nothing here reads a file's content (producer/files.py does); folders and listings are
walked in a stable order, vlmq's own sidecars are left out, and names that cannot travel
in a JSON payload are refused here, one file at a time.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmq.producer.ops.export_ledger import (
    MANIFEST_MAX,
    MANIFEST_NAME,
    parse_manifest,
    written_by_vlmq,
)
from vlmq.shared.errors import InputError
from vlmq.stores.backends import S3Store, Store, StoreError, StoreMissing, Stores

_GLOB_CHARS = re.compile(r"[*?\[]")
S3_SCHEME = "s3://"


def no_store(url: str) -> str:
    """Why an s3:// URL cannot be read: no store holds it, and how to add one."""
    return ("is in no configured store: add --store NAME=s3://bucket/prefix (or "
            f"VLMQ_STORES) for it, e.g. --store data={url.rstrip('/')}")


def expand_paths(paths: Iterable[str | os.PathLike[str]], *,
                 recursive: bool = False) -> tuple[list[str], list[InputError]]:
    """Files, folders and (quoted) globs -> file paths in a stable order, plus path errors."""
    found, errors = expand_sources(paths, recursive=recursive)
    return [f.path for f in found], errors


@dataclass(frozen=True)
class FoundFile:
    """A file found from what was given: its path (or s3:// URL), its source name, and
    the folder the source is relative to (the folder given, a glob's fixed part, or the
    file's own). `stamp` is "size:ETag" for an S3 object, from its listing. `real` is a
    local file's resolved path, resolved once here (it keeps the same file named twice
    once) and reused for its store lookup and its open: one resolution per file."""

    path: str
    source: str
    root: str
    stamp: str | None = None
    real: str | None = None


def expand_inputs(paths: Iterable[str | os.PathLike[str]], stores: Stores, *,
                  recursive: bool = False) -> tuple[list[FoundFile], list[InputError]]:
    """expand_sources, with s3:// sources listed through the store that holds them."""
    found: list[FoundFile] = []
    errors: list[InputError] = []
    for f in iter_inputs(paths, stores, recursive=recursive):
        (errors if isinstance(f, InputError) else found).append(f)  # type: ignore[arg-type]
    return found, errors


def iter_inputs(paths: Iterable[str | os.PathLike[str]], stores: Stores, *,
                recursive: bool = False) -> Iterator[FoundFile | InputError]:
    """expand_inputs one file (or path error) at a time, in the same order, so a set of
    a million files is checked and enqueued as it is walked rather than listed first."""
    seen: set[str] = set()
    for raw in paths:
        if not os.fspath(raw).startswith(S3_SCHEME):
            yield from _iter_sources([raw], recursive, seen)
            continue
        try:
            yield from _expand_url(os.fspath(raw), stores, recursive)
        except InputError as exc:
            yield exc


def _expand_url(url: str, stores: Stores, recursive: bool) -> list[FoundFile]:
    hit = stores.for_url(url)
    if hit is None:
        raise InputError(url, no_store(url))
    store, rel = hit
    assert isinstance(store, S3Store)
    base = url.rstrip("/")
    try:
        if rel and not url.endswith("/"):
            try:
                entry = store.stat(rel)
                return [FoundFile(url, rel.rsplit("/", 1)[-1], base.rsplit("/", 1)[0],
                                  f"{entry.size}:{entry.stamp}")]
            except StoreMissing:
                pass  # perhaps a prefix: listed below
        entries = list(store.list(rel))
    except StoreError as exc:
        raise InputError(url, str(exc)) from exc
    if not entries:
        raise InputError(url, "no such object, and no objects under this prefix")
    if not recursive:
        raise InputError(url, f"is a prefix holding {len(entries)} object(s) "
                              "(pass --recursive to enqueue them)")
    head = f"{store.url}/"
    owned = _owned_in_listing(store, [e.path for e in entries])
    out = []
    for e in entries:
        if e.path in owned:
            continue
        full = head + e.path
        out.append(FoundFile(full, full[len(base) + 1:], base, f"{e.size}:{e.stamp}"))
    return out


def _owned_in_listing(store: Store, paths: list[str]) -> set[str]:
    """is_sidecar for a listing (an S3 prefix, whose listing hides dot files): the files a
    folder's manifest names (a folder exported with --sidecar, then copied to the bucket).
    Only folders holding a candidate (photo.jpg.txt beside photo.jpg) are asked for theirs,
    so a bucket of plain images costs no extra request."""
    names = set(paths)
    folders = sorted({p.rpartition("/")[0] for p in paths
                      if os.path.splitext(p)[1] in SIDECAR_SUFFIXES
                      and os.path.splitext(p)[0] in names})
    owned: set[str] = set()
    for folder in folders:
        manifest = f"{folder}/{MANIFEST_NAME}" if folder else MANIFEST_NAME
        try:
            with store.open(manifest) as fh:
                listed = parse_manifest(fh.read(MANIFEST_MAX + 1))
        except StoreMissing:
            continue
        except (StoreError, OSError) as exc:
            raise InputError(f"{store.url}/{manifest}", f"cannot read vlmq's manifest: {exc}"
                             ) from exc
        owned.update(f"{folder}/{n}" if folder else n for n in listed)
    return owned


# What `vlmq export --sidecar` writes next to an input (photo.jpg.txt, doc.pdf.md).
SIDECAR_SUFFIXES = (".txt", ".md", ".json")


def expand_sources(paths: Iterable[str | os.PathLike[str]], *, recursive: bool = False
                   ) -> tuple[list[FoundFile], list[InputError]]:
    """Like expand_paths, with each file's `source`: its path relative to what was given.

    A file in a folder given as `photos/` is `trip/day1/img_003.jpg`, a glob match is
    relative to the glob's fixed leading folders, a file named directly keeps the name
    given unless that is absolute or climbs out (`..`), then its base name. Export writes
    results under these names, so they never point outside the folder given.

    Folders contribute every non-hidden regular file, so a stray non-image in a folder of
    scans is reported rather than silently dropped; only vlmq's own sidecars are left out.
    The same file named twice is kept once.
    """
    out: list[FoundFile] = []
    errors: list[InputError] = []
    for f in _iter_sources(paths, recursive, set()):
        (errors if isinstance(f, InputError) else out).append(f)  # type: ignore[arg-type]
    return out, errors


def _iter_sources(paths: Iterable[str | os.PathLike[str]], recursive: bool, seen: set[str]
                  ) -> Iterator[FoundFile | InputError]:
    """expand_sources one file at a time; `seen` holds the resolved paths given so far."""
    manifests: dict[str, set[str]] = {}
    folders: dict[str, str] = {}

    def add(name: str, source: str, root: str) -> Iterator[FoundFile]:
        key = resolve(name, folders)
        if key not in seen:
            seen.add(key)
            yield FoundFile(name, source, root, real=key)

    for raw in paths:
        name = os.fspath(raw)
        p = Path(name)
        if p.is_dir():
            head = os.path.join(str(p), "")  # what each walked path starts with
            empty = True
            for f in _walk(p, recursive):
                empty = False
                if not is_sidecar(f, manifests):
                    yield from add(f, _relative(f, head), name)
            if empty:
                yield InputError(name, "folder has no files" if recursive else
                                 "folder has no files (pass --recursive to descend)")
        elif p.exists() or not _GLOB_CHARS.search(name):
            yield from add(name, *_own_name(name))  # a missing path: check_file says so
        else:
            matches = sorted(glob.glob(name, recursive=recursive or "**" in name))
            files = [m for m in matches if Path(m).is_file()]
            if not files:
                yield InputError(name, "no files match this pattern")
            base = _glob_base(name)
            for f in files:
                if not is_sidecar(f, manifests):
                    yield from add(f, Path(os.path.relpath(f, base)).as_posix(), base)


def resolve(name: str, folders: dict[str, str]) -> str:
    """os.path.realpath(name), with each folder's resolved path kept in `folders`: a file
    that is not a symlink costs one lstat, not one per component of its path."""
    folder, base = os.path.split(name)
    if base in ("", ".", ".."):
        return os.path.realpath(name)
    try:
        if stat.S_ISLNK(os.lstat(name).st_mode):
            return os.path.realpath(name)
    except OSError:
        return os.path.realpath(name)  # missing: check_file says so
    real = folders.get(folder)
    if real is None:
        if len(folders) > 4096:
            folders.clear()  # one walk's folders at a time is what pays
        real = folders[folder] = os.path.realpath(folder or ".")
    return os.path.join(real, base)


def _relative(path: str, head: str) -> str:
    """A walked file's path relative to the folder walked (`head`, with its separator), as
    posix: the walk's own prefix cut off, where os.path.relpath would resolve both."""
    rel = path[len(head):] if path.startswith(head) else os.path.relpath(path, head)
    return rel.replace(os.sep, "/") if os.sep != "/" else rel


def is_sidecar(path: str, seen: dict[str, set[str]] | None = None) -> bool:
    """vlmq's own output next to an input: skipped in folders and globs, so a folder
    captioned with --sidecar can be enqueued (or scheduled) again as it is.

    Only files the folder's export manifest names count: a user's own photo.jpg.txt or
    Takeout photo.jpg.json is a file like any other. `seen` caches each folder's names.
    """
    folder, name = os.path.split(path)
    cache = {} if seen is None else seen
    if folder not in cache:
        cache[folder] = written_by_vlmq(folder)
    return name in cache[folder]


def _own_name(name: str) -> tuple[str, str]:
    """A file named directly: (source, root). The name as given, relative to the current
    folder, unless absolute or climbing out: then its base name, under its own folder."""
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        return p.name, str(p.parent)
    return p.as_posix(), "."


def _glob_base(pattern: str) -> str:
    """The folders of a glob before its first wildcard part."""
    parts = Path(pattern).parts
    fixed: list[str] = []
    for part in parts[:-1]:
        if _GLOB_CHARS.search(part):
            break
        fixed.append(part)
    return os.path.join(*fixed) if fixed else "."


def _walk(folder: Path, recursive: bool) -> Iterator[str]:
    """The folder's files in a stable order, one folder's names in memory at a time."""
    if recursive:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            yield from (os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    else:
        yield from (str(c) for c in sorted(folder.iterdir())
                    if c.is_file() and not c.name.startswith("."))


def check_name(found: FoundFile) -> None:
    """A name that is not UTF-8 (bytes like \\xff\\xfe, which Python keeps as lone
    surrogates) cannot travel in a JSON payload: refused here, named with its bad bytes
    escaped, so --skip-bad skips that file rather than the payload check failing the set."""
    for name in (found.path, found.source):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(found.path).decode("utf-8", "backslashreplace")
            raise InputError(shown, "file name is not valid UTF-8; rename the file") from None
