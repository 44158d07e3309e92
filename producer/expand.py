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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from vlmq.producer.export_ledger import (
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


class FoundFile(NamedTuple):
    """A file found from what was given: its path (or s3:// URL), its source name, and
    the folder the source is relative to (the folder given, a glob's fixed part, or the
    file's own). `stamp` is "size:ETag" for an S3 object, from its listing. `real` is a
    local file's resolved path, resolved once here (it keeps the same file named twice
    once) and reused for its store lookup and its open: one resolution per file. `walked`:
    found by walking a folder or listing a prefix, not named (a folder leaves out what is
    not media; producer/inputs.py). A tuple, not a dataclass: a million-file walk makes
    one per file."""

    path: str
    source: str
    root: str
    stamp: str | None = None
    real: str | None = None
    walked: bool = False


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
    seen = Seen()
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
        out.append(FoundFile(full, full[len(base) + 1:], base, f"{e.size}:{e.stamp}",
                             walked=True))
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

    Folders contribute every non-hidden regular file, marked `walked`: the check leaves out
    those that are not media and reports them (producer/inputs.py); vlmq's own sidecars
    are left out here. The same file named twice is kept once.
    """
    out: list[FoundFile] = []
    errors: list[InputError] = []
    for f in _iter_sources(paths, recursive, Seen()):
        (errors if isinstance(f, InputError) else out).append(f)  # type: ignore[arg-type]
    return out, errors


def _iter_sources(paths: Iterable[str | os.PathLike[str]], recursive: bool, seen: Seen
                  ) -> Iterator[FoundFile | InputError]:
    """expand_sources one file at a time; `seen`: what was given so far."""
    manifests: dict[str, set[str]] = {}
    folders: dict[str, str] = {}

    def add(name: str, source: str, root: str) -> Iterator[FoundFile]:
        key = resolve(name, folders)
        if key not in seen:
            seen.paths.add(key)
            yield FoundFile(name, source, root, real=key)

    for raw in paths:
        name = os.fspath(raw)
        p = Path(name)
        if p.is_dir():
            walk = Walk(os.path.realpath(p), recursive)
            yield from _walk(str(p), name, walk, seen)
            seen.walks.append(walk)
            if not walk.files:
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


@dataclass
class Walk:
    """One folder given, as it is walked: its resolved path, how deep the walk goes, the
    folders under it it could not list, and how many files it met (sidecars included)."""

    real: str
    recursive: bool
    unlisted: list[str] = field(default_factory=list)
    files: int = 0

    def gave(self, real: str) -> bool:
        """Whether this walk gives (or gave) the file whose resolved path is `real`: inside
        it, no hidden name on the way, within its depth, listed, not a sidecar."""
        head = os.path.join(self.real, "")
        if not real.startswith(head):
            return False
        parts = real[len(head):].split(os.sep)
        if (len(parts) > 1 and not self.recursive) or any(n.startswith(".") for n in parts):
            return False
        if any(real.startswith(os.path.join(u, "")) for u in self.unlisted):
            return False
        return not is_sidecar(real) and _listable(real, self.recursive)

    def order(self, rel: str) -> tuple[tuple[int, str], ...]:
        """Where a file at `rel` (posix, relative to the walk's folder) comes in the walk:
        a folder's files by name, then its folders by name, each in full."""
        *folders, name = rel.split("/")
        return (*((1, f) for f in folders), (0, name))


def _listable(real: str, recursive: bool) -> bool:
    """Whether a walk lists what is at `real` as a file: a flat walk only a regular file, a
    recursive one anything there that is not a folder."""
    if not recursive:
        return os.path.isfile(real)
    try:
        return not stat.S_ISDIR(os.lstat(real).st_mode)
    except OSError:
        return False


class Seen:
    """The files given so far, so that one given twice is kept once, in memory that follows
    what was named rather than the set: a walked folder is kept as its Walk (a file found
    again inside it is one the walk gave by Walk.gave), and only files given one by one
    (directly, by a glob, through a symlink in a folder) by their resolved paths."""

    def __init__(self) -> None:
        self.paths: set[str] = set()
        self.walks: list[Walk] = []

    def __contains__(self, real: object) -> bool:
        return real in self.paths or (isinstance(real, str)
                                      and any(w.gave(real) for w in self.walks))

    def first_link(self, real: str, rel: str, walk: Walk) -> bool:
        """A symlink in `walk` at `rel` to the file at `real`: whether it is the first way
        that file is given (its target may be a file this walk gives earlier, or later:
        then that one is the one dropped)."""
        if real in self or (walk.gave(real) and walk.order(
                real[len(os.path.join(walk.real, "")):].replace(os.sep, "/"))
                < walk.order(rel)):
            return False
        self.paths.add(real)
        return True


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


def _walk(top: str, given: str, walk: Walk, seen: Seen) -> Iterator[FoundFile]:
    """The files of folder `top` (as given: `given`) in a stable order, without vlmq's
    sidecars or what `seen` holds. A file's resolved path is its folder's plus its name,
    since the walk never goes through a symlinked folder: a file costs no stat and no path
    resolution of its own (a symlinked file, its one realpath)."""
    for folder, real, rel, files in _folders(top, walk):
        walk.files += len(files)
        owned = written_by_vlmq(folder) if files else set()
        # Where a file's path starts (Path.iterdir names a file in "." without "./").
        prefix = "" if folder == "." and not walk.recursive else os.path.join(folder, "")
        for entry in files:
            name = entry.name
            if name in owned:
                continue
            if entry.is_symlink():
                target = os.path.realpath(prefix + name)
                if seen.first_link(target, rel + name, walk):
                    yield FoundFile(prefix + name, rel + name, given, None, target, True)
                continue
            target = real + name
            if target in seen.paths or (seen.walks and target in seen):
                continue
            yield FoundFile(prefix + name, rel + name, given, None, target, True)


_Folder = tuple[str, str, str, list[os.DirEntry[str]]]


def _folders(top: str, walk: Walk) -> Iterator[_Folder]:
    """(folder as walked, its resolved path and its path from `top` each with a trailing
    separator, its files sorted by name) for `top` and, when recursive, every folder under
    it, depth first in name order (os.walk's order), hidden names and symlinked folders
    left out. Recursive, "files" are all that is not a folder (a broken symlink too: the
    check then says what it is); flat, regular files and symlinks to them (Path.is_file).
    One folder's names are in memory at a time."""
    stack = [(top, os.path.join(walk.real, ""), "")]
    while stack:
        folder, real, rel = stack.pop()
        try:
            with os.scandir(folder) as listing:
                entries = sorted((e for e in listing if not e.name.startswith(".")),
                                 key=_entry_name)
        except OSError:
            walk.unlisted.append(real)
            continue
        if not walk.recursive:
            yield folder, real, rel, [e for e in entries if _is(e.is_file)]
            continue
        dirs = [e for e in entries if _is(e.is_dir)]
        yield folder, real, rel, [e for e in entries if not _is(e.is_dir)]
        stack.extend((os.path.join(folder, d.name), f"{real}{d.name}{os.sep}",
                      f"{rel}{d.name}/") for d in reversed(dirs) if not d.is_symlink())


def _entry_name(entry: os.DirEntry[str]) -> str:
    return entry.name


def _is(test: Callable[[], bool]) -> bool:
    """A DirEntry test (it follows a symlink), False where it cannot tell, as os.walk."""
    try:
        return test()
    except OSError:
        return False


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
