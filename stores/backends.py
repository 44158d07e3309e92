"""Stores: named places that hold inputs, so items can name a file instead of carrying it.

A store is a folder (`file:///mnt/scans`) or an S3 bucket and prefix
(`s3://bucket/scans`), configured per machine as `NAME=URL` (`--store`, repeatable, or
`VLMQ_STORES="a=URL,b=URL"`). Only the name travels in a job: a Mac's `/Volumes/scans`
and a Linux box's `/mnt/scans` can both be `scans`.

Every path is resolved here and nowhere else, so the rules hold for every reader: a
path must be relative, posix, without `..`, backslashes or NUL, and a folder store
follows a symlink only when its target is inside the store. Nothing outside a store is
ever opened. Reads of an item verify its size and sha256 while streaming, into a private
copy (Stores.open_verified), so what is decoded is exactly what was verified.

S3 goes through boto3 (imported only when an S3 store is used): it takes endpoint,
region and credentials from the standard AWS chain (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`/`AWS_DEFAULT_REGION`,
profiles, instance roles). Secrets never appear in a store's URL, so never in logs,
payloads or errors: a URL with credentials in it is refused without echoing them.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import stat as stat_mod
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import unquote, urlsplit

from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError
from vlmq.shared.messages import REF_PATH_PROBLEMS, STORE_NAME_RE, Item, Ref
from vlmq.shared.urls import redact_text

log = logging.getLogger("vlmq.stores")

STORES_ENV = C.STORES_ENV
CHUNK = 1 << 20  # bytes per read while hashing: memory stays bounded whatever the size
_ZEROS = bytes(CHUNK)
# The producer's bound on a referenced input (it hashes it at enqueue). A worker reads one
# only up to its own, smaller limit, which follows its decode memory (worker/prep/preparer.py).
MAX_REF_BYTES = 4 << 30
# Symlinks (and swaps seen mid-walk) a folder store follows for one path, as the kernel's
# own limit: a loop of links, or a tree changed faster than it is walked, ends refused.
MAX_HOPS = 40
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the check cannot block the open (fstat refuses it).
_FILE_FLAGS = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC
# What a swapped name looks like to an open that does not follow it: walk again.
_SWAPPED = frozenset({errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EMLINK})


class StoreError(VlmqError):
    """A store is misconfigured, or a reference cannot be read; the message says which.

    Every message is redacted when it is made (shared/urls.py redact_text): store errors
    quote URLs and library errors vlmq did not write (botocore quotes AWS_ENDPOINT_URL, a
    user's --store may be a presigned URL), and they end up in logs and in Redis.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


class RefUnreadable(StoreError):
    """A reference a worker cannot use. The message is all its producer may learn: the
    file is missing or unreadable, or its content changed. Which (missing, a directory, a
    symlink out of the store, a sha or size and how it differs) is `detail`, for this
    machine's log only: a producer with only Redis access must not map the store."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = redact_text(detail)


def unreadable(ref: Ref) -> str:
    """The one answer for a reference that cannot be read, whatever the reason."""
    return f"{ref}: the referenced file is missing or unreadable in store {ref.store}"


def changed(ref: Ref) -> str:
    """The one answer for a reference whose content is not what was enqueued."""
    return (f"{ref} changed since it was enqueued (its size or sha256 differs); "
            "enqueue it again")


class StoreMissing(StoreError):
    """The file or object is not in the store."""


class UnknownStore(StoreError):
    """A reference names a store this machine was not given."""


def ref_path_problem(path: str) -> str | None:
    """Why `path` cannot name a file inside a store, or None when it can."""
    if not path:
        return REF_PATH_PROBLEMS["empty"]
    if "\0" in path:
        return REF_PATH_PROBLEMS["nul"]
    if "\\" in path:
        return REF_PATH_PROBLEMS["backslash"]
    if path.startswith("/"):
        return REF_PATH_PROBLEMS["absolute"]
    if ".." in path.split("/"):
        return REF_PATH_PROBLEMS["dotdot"]
    return None


@dataclass(frozen=True)
class Entry:
    """One file of a store: its relative path, size and a cheap change stamp (the mtime
    in ns for a folder, the ETag for S3)."""

    path: str
    size: int
    stamp: str


class Store(ABC):
    """One named store; its methods take paths relative to it."""

    def __init__(self, name: str) -> None:
        if not STORE_NAME_RE.fullmatch(name):
            raise StoreError(f"store name {name!r}: use 1-64 letters, digits, _ . -")
        self.name = name

    @property
    @abstractmethod
    def url(self) -> str:
        """The store's URL as configured (never holds a secret)."""

    def checked(self, path: str) -> str:
        problem = ref_path_problem(path)
        if problem is not None:
            raise StoreError(f"{self.name}:{path}: the path {problem}")
        return path

    def check(self, path: str) -> None:
        """Refuse a path that would leave the store (StoreError), opening nothing."""
        self.checked(path)

    @abstractmethod
    def stat(self, path: str) -> Entry: ...

    @abstractmethod
    def open(self, path: str) -> IO[bytes]:
        """A stream of the file's bytes (seekable for a folder store); close it."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[Entry]:
        """Every file under `prefix` (a relative folder, "" for all), sorted by path."""

    def open_stamped(self, path: str) -> tuple[IO[bytes], str]:
        """open(), and the identity of exactly what was opened (see identity()), so a
        hash of the stream can be vouched for later without reading it again."""
        fh = self.open(path)
        return fh, self.identity(path)

    def identity(self, path: str) -> str:
        """A cheap stamp that changes whenever the content can have: a worker that
        verified a file with this stamp need not read it again while it stays."""
        return self.stat(path).stamp


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _file_stamp(st: os.stat_result) -> str:
    """A file's identity: a rewrite in place moves ctime (which no user can set back), a
    replacement is another inode."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class FolderStore(Store):
    """A folder; every path is walked from the root one name at a time (below).

    No path string is handed to the kernel to resolve: each folder on the way is opened
    relative to the one before it with O_NOFOLLOW | O_DIRECTORY, the file with
    O_NOFOLLOW, so a folder swapped for a symlink between a check and the open makes the
    open fail (and the walk start again) instead of going outside. A symlink is followed
    only by reading it here, checking that its target stays inside the store, and walking
    that target again from the root, at most MAX_HOPS times.
    """

    def __init__(self, name: str, root: str | os.PathLike[str]) -> None:
        super().__init__(name)
        self.root = Path(root)
        if not self.root.is_absolute():
            raise StoreError(f"store {name}: {root} is not an absolute path")

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def real_root(self) -> str:
        return os.path.realpath(self.root)

    def _leaves(self, path: str) -> StoreError:
        return StoreError(f"{self.name}:{path}: leaves the store (a symlink points "
                          "outside it); nothing was read")

    def _missing(self, path: str) -> StoreMissing:
        return StoreMissing(f"{self.name}:{path}: no such file in {self.root}")

    def _target(self, path: str, done: list[str], target: str) -> list[str]:
        """A symlink's target (found after the real folders `done`) as names from the
        root; StoreError when it would leave the store. `done` holds no symlink, so its
        '..' are resolved by name."""
        if target.startswith("/"):
            for base in (str(self.root).rstrip("/"), self.real_root().rstrip("/")):
                if target == base or target.startswith(base + "/"):
                    done, target = [], target[len(base):]
                    break
            else:
                raise self._leaves(path)
        out = list(done)
        for part in _parts(target):
            if part != "..":
                out.append(part)
            elif out:
                out.pop()
            else:
                raise self._leaves(path)
        return out

    def _walk_once(self, path: str, parts: list[str]
                   ) -> list[str] | tuple[int, str, os.stat_result, list[str]]:
        """One walk from the root: (the parent folder's fd, which the caller closes, the
        file's name and lstat, its names from the root), or the names to walk again (a
        symlink followed, or the tree changed under the walk)."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
        try:
            for i, name in enumerate(parts):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError) as exc:
                    raise self._missing(path) from exc
                if stat_mod.S_ISLNK(st.st_mode):
                    try:
                        target = os.readlink(name, dir_fd=fd)
                    except OSError:  # no longer a link: look again
                        return parts
                    return self._target(path, parts[:i], target) + parts[i + 1:]
                if i == len(parts) - 1:
                    found, fd = fd, -1  # the caller's now
                    return found, name, st, parts
                if not stat_mod.S_ISDIR(st.st_mode):
                    raise self._missing(path)
                try:
                    inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _SWAPPED:  # swapped since its lstat: walk again
                        return parts
                    raise StoreError(f"{self.name}:{path}: {exc.strerror or exc}") from exc
                os.close(fd)
                fd = inner
            raise self._missing(path)  # no names: the root itself is no file
        finally:
            if fd >= 0:
                os.close(fd)

    def _resolve(self, path: str) -> tuple[int, str, os.stat_result, list[str]]:
        """The file `path` names, reached by walking from the root and never outside:
        (its parent folder's fd, which the caller closes, its name there, its lstat, which
        is never a symlink's, and its names from the root)."""
        parts = _parts(self.checked(path))
        for _ in range(MAX_HOPS + 1):
            step = self._walk_once(path, parts)
            if not isinstance(step, list):
                return step
            parts = step
        raise StoreError(f"{self.name}:{path}: too many symlinks (or changes) on the way; "
                         "nothing was read")

    def locate(self, path: str) -> str:
        """The real location of `path` under the real root, refused when it (or a symlink
        on the way) leaves the store. Only folders are opened, never the file."""
        fd, _, _, parts = self._resolve(path)
        os.close(fd)
        return os.path.join(self.real_root(), *parts)

    def check(self, path: str) -> None:
        self.locate(path)

    def ref_path(self, local: str | os.PathLike[str]) -> str | None:
        """`local`'s path relative to this store, or None when it is not inside it."""
        root = self.real_root()
        real = os.path.realpath(local)
        if real == root or os.path.commonpath([root, real]) != root:
            return None
        return Path(os.path.relpath(real, root)).as_posix()

    def stat(self, path: str) -> Entry:
        fd, _, st, _ = self._resolve(path)
        os.close(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise StoreError(f"{self.name}:{path}: is not a regular file")
        return Entry(path=path, size=st.st_size, stamp=str(st.st_mtime_ns))

    def identity(self, path: str) -> str:
        fd, _, st, _ = self._resolve(path)
        os.close(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise StoreError(f"{self.name}:{path}: is not a regular file")
        return _file_stamp(st)

    def _open_fd(self, path: str) -> int:
        """An fd of the regular file `path` names inside the store (see the class)."""
        for _ in range(MAX_HOPS + 1):
            parent, name, st, _ = self._resolve(path)
            try:
                if not stat_mod.S_ISREG(st.st_mode):  # a FIFO or device: never opened
                    raise StoreError(f"{self.name}:{path}: is not a regular file")
                try:
                    fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
                except OSError as exc:
                    if exc.errno in _SWAPPED:  # swapped since its lstat: walk again
                        continue
                    raise StoreError(f"{self.name}:{path}: {exc.strerror or exc}") from exc
            finally:
                os.close(parent)
            if stat_mod.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)  # swapped for something else since its lstat: refuse
            raise StoreError(f"{self.name}:{path}: is not a regular file")
        raise StoreError(f"{self.name}:{path}: changed too often while being opened; "
                         "nothing was read")

    def open(self, path: str) -> IO[bytes]:
        return os.fdopen(self._open_fd(path), "rb")

    def open_stamped(self, path: str) -> tuple[IO[bytes], str]:
        fd = self._open_fd(path)
        return os.fdopen(fd, "rb"), _file_stamp(os.fstat(fd))

    def list(self, prefix: str = "") -> Iterator[Entry]:
        top = self.locate(prefix) if prefix else self.real_root()
        root = self.real_root()
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                rel = Path(os.path.relpath(os.path.join(folder, name), root)).as_posix()
                try:
                    yield self.stat(rel)
                except StoreError:
                    continue  # a symlink out, a FIFO: not an input of this store


class S3Store(Store):
    """A bucket and key prefix, read through boto3 (one client per store, thread-safe).

    `client`: a boto3 S3 client configured by the caller; by default one is made from the
    AWS environment the first time the store is used.
    """

    def __init__(self, name: str, bucket: str, prefix: str = "", *, client: Any = None
                 ) -> None:
        super().__init__(name)
        if not bucket:
            raise StoreError(f"store {name}: an s3:// URL needs a bucket (s3://bucket/prefix)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client: Any = client
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    import boto3
                except ImportError as exc:
                    raise StoreError(f"store {self.name} is on S3 and boto3 is not "
                                     "installed: pip install boto3") from exc
                # A session per store: boto3's default session is not thread-safe.
                self._client = boto3.session.Session().client("s3")
            return self._client

    def key(self, path: str) -> str:
        path = self.checked(path)
        return f"{self.prefix}/{path}" if self.prefix else path

    def rel(self, key: str) -> str | None:
        """The store path of a bucket key, or None when the key is outside the prefix."""
        if not self.prefix:
            return key or None
        head = self.prefix + "/"
        return (key[len(head):] or None) if key.startswith(head) else None

    def _fail(self, path: str, exc: Exception) -> StoreError:
        """botocore's errors say what failed (a code, an endpoint), never a credential;
        only the code and message are kept."""
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            err = response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                return StoreMissing(f"{self.name}:{path}: no such object in {self.url}")
            return StoreError(f"{self.name}:{path}: S3 error {code}: {err.get('Message', '')}"
                              .rstrip(": "))
        return StoreError(f"{self.name}:{path}: {type(exc).__name__}: {exc}")

    def _call(self, path: str, method: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client(), method)(Bucket=self.bucket, **kw)
        except (ClientError, BotoCoreError, ValueError) as exc:  # ValueError: a bad endpoint
            raise self._fail(path, exc) from None


    def stat(self, path: str) -> Entry:
        head = self._call(path, "head_object", Key=self.key(path))
        return Entry(path=path, size=int(head["ContentLength"]),
                     stamp=str(head.get("ETag", "")).strip('"'))

    def open(self, path: str) -> IO[bytes]:
        return self.open_stamped(path)[0]

    def open_stamped(self, path: str) -> tuple[IO[bytes], str]:
        got = self._call(path, "get_object", Key=self.key(path))
        return cast(IO[bytes], _S3Body(self, path, got["Body"])), _object_stamp(got)

    def identity(self, path: str) -> str:
        return _object_stamp(self._call(path, "head_object", Key=self.key(path)))

    def list(self, prefix: str = "") -> Iterator[Entry]:
        if prefix:
            self.checked(prefix)
        start = self.key(prefix.rstrip("/")) + "/" if prefix else \
            (self.prefix + "/" if self.prefix else "")
        paginator = self.client().get_paginator("list_objects_v2")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", []):
                    rel = self.rel(str(obj["Key"]))
                    if rel is None or rel.endswith("/") or ref_path_problem(rel):
                        continue
                    if any(part.startswith(".") for part in rel.split("/")):
                        continue
                    yield Entry(path=rel, size=int(obj["Size"]),
                                stamp=str(obj.get("ETag", "")).strip('"'))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(prefix or "/", exc) from None


def _object_stamp(reply: Mapping[str, Any]) -> str:
    """An object's identity, the same from head_object and get_object: a replaced object
    has another ETag (and version, and time)."""
    return ":".join(str(reply.get(k, "")).strip('"') for k in
                    ("ETag", "VersionId", "LastModified", "ContentLength"))


class _S3Body(io.RawIOBase):
    """An object's body whose read errors are StoreErrors (redacted) like the rest."""

    def __init__(self, store: S3Store, path: str, body: Any) -> None:
        super().__init__()
        self._store, self._path, self._body = store, path, body

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            data: bytes = self._body.read(None if size < 0 else size)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._store._fail(self._path, exc) from None
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._body.close()
        finally:
            super().close()


def parse_store(spec: str) -> Store:
    """`NAME=URL` -> a Store: file:///abs/path (or a bare absolute path), s3://bucket/prefix."""
    shown = redact_text(spec.strip())
    if shown != spec.strip():  # a presigned URL, user:secret@: refused, never repeated
        raise StoreError(f"store {shown!r}: credentials and signatures do not belong in a "
                         "store URL; use the AWS environment (AWS_ACCESS_KEY_ID, ...)")
    name, sep, url = spec.strip().partition("=")
    name = name.strip()
    if not sep or not name or not url:
        raise StoreError(f"store {shown!r}: give NAME=URL, e.g. "
                         "scans=file:///mnt/scans or scans=s3://bucket/scans")
    if url.startswith("/"):
        return FolderStore(name, url)
    parts = urlsplit(url)
    if "@" in parts.netloc:  # user:secret@host: refused, and never repeated
        raise StoreError(f"store {name}: credentials do not belong in a store URL; use "
                         "the AWS environment (AWS_ACCESS_KEY_ID, ...)")
    if parts.query or parts.fragment:
        raise StoreError(f"store {name}: {url} has a query or fragment")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreError(f"store {name}: {url}: a file URL is file:///absolute/path")
        return FolderStore(name, unquote(parts.path))
    if parts.scheme == "s3":
        return S3Store(name, parts.netloc, unquote(parts.path))
    raise StoreError(f"store {name}: {url}: use file:///absolute/path or s3://bucket/prefix")


def split_specs(values: Iterable[str]) -> list[str]:
    """`--store` values and VLMQ_STORES entries: each may hold several, comma-separated."""
    return [part for value in values for part in value.split(",") if part.strip()]


class Stores:
    """The stores of this machine, by name: what refs may name, and the only places read."""

    def __init__(self, stores: Iterable[Store] = ()) -> None:
        self.by_name: dict[str, Store] = {}
        for store in stores:
            if store.name in self.by_name:
                raise StoreError(f"store {store.name} is given twice")
            self.by_name[store.name] = store

    @classmethod
    def parse(cls, values: Iterable[str]) -> Stores:
        return cls(parse_store(spec) for spec in split_specs(values))

    @classmethod
    def from_env(cls) -> Stores:
        return cls.parse([os.environ.get(STORES_ENV, "")])

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def __iter__(self) -> Iterator[Store]:
        return iter(self.by_name.values())

    def describe(self) -> str:
        return ", ".join(f"{s.name}={s.url}" for s in self) or "none"

    def get(self, name: str) -> Store:
        store = self.by_name.get(name)
        if store is None:
            raise UnknownStore(f"unknown store {name!r} (this machine has: "
                             f"{', '.join(self.by_name) or 'none'}; add --store "
                             f"{name}=URL)")
        return store

    def ref_for_path(self, local: str | os.PathLike[str]) -> Ref | None:
        """The ref naming a local file, from the innermost folder store holding it."""
        best: tuple[int, Ref] | None = None
        for store in self:
            if isinstance(store, FolderStore):
                rel = store.ref_path(local)
                depth = len(store.real_root())
                if rel is not None and (best is None or depth > best[0]):
                    best = (depth, Ref(store.name, rel))
        return None if best is None else best[1]

    def for_url(self, url: str) -> tuple[S3Store, str] | None:
        """(store, relative path or prefix) for an s3:// URL, from the innermost S3 store
        holding it; None when no store does."""
        parts = urlsplit(url)
        if parts.scheme != "s3":
            return None
        key = unquote(parts.path).strip("/")
        best: tuple[S3Store, str] | None = None
        for store in self:
            if not isinstance(store, S3Store) or store.bucket != parts.netloc:
                continue
            rel = "" if key == store.prefix else store.rel(key)
            if rel is None:
                continue
            if best is None or len(store.prefix) > len(best[0].prefix):
                best = (store, rel)
        return best

    def check(self, ref: Ref) -> None:
        """StoreError when `ref` names no store of this machine or leaves its store; only
        names are resolved, nothing is opened or read."""
        self.get(ref.store).check(ref.path)

    def open_verified(self, item: Item, *, limit: int, why: str = "") -> IO[bytes]:
        """A referenced item's bytes as an anonymous temporary file (closed by the caller)
        holding exactly what was hashed; StoreError names the reference and what is wrong.

        The reference may change between a hash and a decode; this copy cannot, so what
        is decoded is what was verified. It streams: memory stays at one chunk whatever
        the size, and runs of zeros become holes, so a sparse file stays sparse on disk.
        An item over `limit` bytes is refused before a byte is read (`why` says where the
        limit comes from); one that grew past its size is read no further.
        """
        out, _ = self.verify(item, limit=limit, why=why)
        assert out is not None
        return out

    def verify(self, item: Item, *, limit: int, why: str = "", keep: bool = True
               ) -> tuple[IO[bytes] | None, str]:
        """open_verified, and the identity (Store.identity) of what was hashed; with
        keep=False the bytes are only hashed, and no copy is returned.

        The reference's own faults (an unknown store, a path that would leave it, a size
        over the limit: what its producer sent) say so; anything about the file itself is
        RefUnreadable, one message for missing, a directory, a FIFO, a symlink out, an S3
        error, another for any change of content, with the reason in `detail`.
        """
        ref, size, sha = item.ref, item.size, item.ref_sha256
        if ref is None or size is None or sha is None:
            raise StoreError(f"{item.source}: is not a reference")
        store = self.get(ref.store)
        store.checked(ref.path)
        if size > limit:
            raise StoreError(f"{ref}: {size} bytes is over the {limit >> 20} MiB "
                             f"({limit}-byte) limit for a referenced input{why}")
        with ExitStack() as stack:
            out = stack.enter_context(tempfile.TemporaryFile(prefix="vlmq-ref-")) \
                if keep else None
            try:
                fh, stamp = store.open_stamped(ref.path)
                with fh:
                    now, got = _copy_hashed(fh, out, size)
            except (StoreError, OSError) as exc:
                raise RefUnreadable(unreadable(ref), f"{ref}: {exc}") from None
            if got != size or now != sha:
                raise RefUnreadable(changed(ref), f"{ref} changed since it was enqueued "
                                    f"(sha256 {sha[:16]}…; {_change(size, got, now)})")
            if out is not None:
                out.seek(0)
            stack.pop_all()  # verified: the caller's now
            return out, stamp

    def identity(self, ref: Ref) -> str:
        """The referenced file's identity now (Store.identity): cheap, nothing is read;
        RefUnreadable (detail in `detail`) when it cannot be had."""
        store = self.get(ref.store)
        try:
            return store.identity(store.checked(ref.path))
        except (StoreError, OSError) as exc:
            raise RefUnreadable(unreadable(ref), f"{ref}: {exc}") from None

    def read(self, item: Item, *, limit: int = MAX_REF_BYTES) -> bytes:
        """A referenced item's bytes in memory, verified as open_verified does (one copy
        of them, never a list of chunks and their join)."""
        with self.open_verified(item, limit=limit) as fh:
            return fh.read()


def _copy_hashed(fh: IO[bytes], out: IO[bytes] | None, size: int) -> tuple[str, int]:
    """(sha256, bytes read) of `fh` copied into `out` (None: only hashed), reading at most
    one chunk past `size` (enough to see that it grew); chunks of zeros are skipped over,
    not written."""
    digest = hashlib.sha256()
    got = 0
    while got <= size:
        chunk = fh.read(CHUNK)
        if not chunk:
            break
        got += len(chunk)
        digest.update(chunk)
        if out is None:
            continue
        if _ZEROS.startswith(chunk):
            out.seek(len(chunk), io.SEEK_CUR)
        else:
            out.write(chunk)
    if out is not None:
        out.truncate(got)  # a hole at the end still counts towards the size
    return digest.hexdigest(), got


def _change(size: int, got: int, now: str) -> str:
    if got > size:
        return f"now more than its {size} bytes"
    if got != size:
        return f"{size} bytes then, {got} now"
    return f"now {now[:16]}…"


def hash_stream(fh: IO[bytes], *, limit: int = MAX_REF_BYTES,
                sink: IO[bytes] | None = None) -> tuple[str, int]:
    """(sha256, size) of a stream read in CHUNK pieces (copied into `sink` when given),
    refused past `limit` bytes: memory stays at one chunk whatever the size."""
    digest = hashlib.sha256()
    size = 0
    while True:
        chunk = fh.read(CHUNK)
        if not chunk:
            return digest.hexdigest(), size
        size += len(chunk)
        if size > limit:
            raise StoreError(f"is over {limit} bytes, the limit for a referenced input")
        digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
