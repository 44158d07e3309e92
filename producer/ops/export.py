"""Results back into files: `OUT/<source>.md|.txt|.json`, or sidecars next to the inputs
(an extract job's are always `<source>.json`, its objects).

An item's `source` is its path relative to the folder given when the job was enqueued,
so the output tree mirrors the input tree. A source comes from a payload that any
producer may have written, so every target is checked to stay inside the output root:
absolute paths and `..` parts are refused, and every folder on the way is opened through
its parent's file descriptor with O_NOFOLLOW, so a symlinked folder (even one swapped in
while the export runs) is refused rather than followed out of the root.

vlmq overwrites only files it wrote itself and that are unchanged since: each folder it
writes into gets a manifest (MANIFEST_NAME) with the sha256 of every file it wrote there.
Any other file at a target (the user's own `photo.jpg.txt`) is kept and reported unless
`overwrite` is given. Enqueue reads the same manifests to skip vlmq's own sidecars.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from vlmq.producer.export_ledger import MANIFEST_NAME, read_manifest_at
from vlmq.producer.ops import output_formats
from vlmq.shared.errors import VlmqError
from vlmq.shared.messages import ItemResult

# The formats that say how one source's results become a file (output_formats.Format.file).
FORMATS = tuple(name for name, f in output_formats.FORMATS.items() if f.file is not None)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeSource(VlmqError):
    """A result's source would be written outside the output root."""


@dataclass
class ExportReport:
    written: list[Path] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)   # (source, item error)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (source, why)
    kept: list[Path] = field(default_factory=list)  # not vlmq's own: left as they were

    def merge(self, other: ExportReport) -> None:
        self.written += other.written
        self.failed += other.failed
        self.refused += other.refused
        self.kept += other.kept

    def to_dict(self) -> dict[str, object]:
        return {"written": [str(p) for p in self.written],
                "failed": [{"source": s, "error": e} for s, e in self.failed],
                "refused": [{"source": s, "reason": r} for s, r in self.refused],
                "kept": [str(p) for p in self.kept]}


def _parts(source: str) -> tuple[str, ...]:
    """The source's path parts; raises UnsafeSource for anything that is not a plain
    relative path inside the root."""
    if not source or "\x00" in source:
        raise UnsafeSource(f"source {source!r} is empty or not a path")
    posix = PurePosixPath(source.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(source).drive:
        raise UnsafeSource(f"source {source!r} is an absolute path")
    if ".." in posix.parts:
        raise UnsafeSource(f"source {source!r} climbs out of the output folder (..)")
    if not posix.parts or posix.name in (".", ""):
        raise UnsafeSource(f"source {source!r} names no file")
    return posix.parts


def target_path(root: Path, source: str, suffix: str) -> Path:
    """Where `source` + suffix goes under root; raises UnsafeSource if that is outside.

    A check by name only: the write itself (export_results) opens every folder with
    O_NOFOLLOW, which is what keeps a folder swapped for a symlink from carrying it out.
    """
    parts = _parts(source)
    base = root.resolve()
    target = base.joinpath(*parts[:-1], parts[-1] + suffix)
    if not target.parent.resolve().is_relative_to(base):
        raise UnsafeSource(f"source {source!r} leads outside {root} through a symlink")
    if target.is_symlink():
        raise UnsafeSource(f"{target} is a symlink; not writing through it")
    return target


def _sha256_at(dir_fd: int, name: str) -> str | None:
    """sha256 of a regular file in dir_fd, None if it is not one (or is gone)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Atomic, inside dir_fd only: a fresh temp file (O_EXCL, never a link someone
    planted) renamed over name; a reader (or a crash) never sees half a file."""
    tmp = f".{name[:100]}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise


class _Tree:
    """Folders of one export, opened once each through their parent's descriptor."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.fds: dict[tuple[str, ...], int] = {(): os.open(root, os.O_RDONLY | os.O_DIRECTORY)}
        self.manifests: dict[tuple[str, ...], dict[str, str]] = {}
        self.dirty: set[tuple[str, ...]] = set()

    def folder(self, parts: tuple[str, ...], source: str) -> int:
        """The descriptor of root/parts, made if missing; a symlink on the way is refused."""
        if parts in self.fds:
            return self.fds[parts]
        parent = self.folder(parts[:-1], source)
        name = parts[-1]
        with contextlib.suppress(FileExistsError):  # opened below; refused if a symlink
            os.mkdir(name, 0o755, dir_fd=parent)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeSource(f"source {source!r}: {'/'.join(parts)} under {self.root} "
                                   "is a symlink or not a folder; not writing through it"
                                   ) from exc
            raise
        self.fds[parts] = fd
        return fd

    def manifest(self, parts: tuple[str, ...]) -> dict[str, str]:
        if parts not in self.manifests:
            self.manifests[parts] = read_manifest_at(self.fds[parts])
        return self.manifests[parts]

    def close(self) -> None:
        """Write each changed folder's manifest, then close every descriptor."""
        try:
            for parts in sorted(self.dirty):
                doc = {"v": 1, "files": dict(sorted(self.manifests[parts].items()))}
                with contextlib.suppress(FileNotFoundError):  # folder removed meanwhile
                    _write_at(self.fds[parts], MANIFEST_NAME,
                              json.dumps(doc, indent=0).encode())
        finally:
            for fd in self.fds.values():
                os.close(fd)


def export_results(results: Iterable[ItemResult], root: Path, fmt: str = "md",
                   overwrite: bool = False, *, extract: bool = False) -> ExportReport:
    """Write one job's results under root; later writes of the same source replace earlier.

    A PDF or TIFF (any paged item) becomes `<source>.<fmt>`, its pages in order after
    page markers; an image `<source>.txt` (`<source>.json` in json);
    what a file holds is the format's own (vlmq.producer.ops.output_formats, Format.file). Failed
    images are not written (reported in `failed`); a failed PDF page is reported too and
    keeps its place in the document. A target that exists and is not vlmq's own unchanged
    output is left alone and reported in `kept`, unless `overwrite`.

    `extract` (the results are an extract job's): every source becomes `<source>.json`
    holding its objects (output_formats.extract_file), whatever fmt; an object is the output
    there, and a .md or .txt of it would only be its JSON text again.
    """
    render, image_suffix, doc_suffix = _file_form(fmt, extract)
    report = ExportReport()
    docs, images = _by_file(results)
    tree = _Tree(root)
    try:
        for r in images:
            if not r.ok:
                report.failed.append((r.source, r.error or "failed"))
                continue
            _emit(report, tree, r.source, image_suffix, render([r]), overwrite)
        for source, pages in docs.items():
            report.failed += [(f"{source} page {p.page}", p.error or "failed")
                              for p in pages if not p.ok]
            _emit(report, tree, source, doc_suffix, render(pages), overwrite)
    finally:
        tree.close()
    return report


def _file_form(fmt: str, extract: bool) -> tuple[output_formats.RenderFile, str, str]:
    """(what renders a file, an image's suffix, a paged document's suffix) for a format; an
    extract job's files are its objects, `.json`, whatever the format."""
    render = output_formats.FORMATS[fmt].file if fmt in output_formats.FORMATS else None
    if render is None:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if extract:
        render = output_formats.extract_file
    image_suffix = ".json" if fmt == "json" or extract else ".txt"
    doc_suffix = ".json" if extract else f".{fmt}"
    return render, image_suffix, doc_suffix


def _by_file(results: Iterable[ItemResult]
             ) -> tuple[dict[str, list[ItemResult]], list[ItemResult]]:
    """(each paged source's pages, in the order given; the images): a document is one file,
    an image one file each."""
    docs: dict[str, list[ItemResult]] = {}
    images: list[ItemResult] = []
    for r in results:
        if r.page is not None:
            docs.setdefault(r.source, []).append(r)
        else:
            images.append(r)
    return docs, images


def _emit(report: ExportReport, tree: _Tree, source: str, suffix: str, text: str,
          overwrite: bool) -> None:
    try:
        _emit_one(report, tree, source, suffix, text, overwrite)
    except UnsafeSource as exc:
        report.refused.append((source, str(exc)))
    except FileNotFoundError as exc:  # a folder on the way removed under us
        report.refused.append((source, f"source {source!r}: a folder under {tree.root} "
                                       f"was moved or removed during the export ({exc})"))


def _emit_one(report: ExportReport, tree: _Tree, source: str, suffix: str, text: str,
              overwrite: bool) -> None:
    parts = _parts(source)
    folder = tree.folder(parts[:-1], source)
    name = parts[-1] + suffix
    path = tree.root.joinpath(*parts[:-1], name)
    try:
        st: os.stat_result | None = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UnsafeSource(f"{path} is a symlink or not a regular file; not writing "
                           "through it")
    own = tree.manifest(parts[:-1])
    if st is not None and not overwrite and own.get(name) != _sha256_at(folder, name):
        report.kept.append(path)
        return
    data = text.encode("utf-8")
    _write_at(folder, name, data)
    own[name] = hashlib.sha256(data).hexdigest()
    tree.dirty.add(parts[:-1])
    report.written.append(path)
