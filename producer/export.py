"""Results back into files: `OUT/<source>.md|.txt|.json`, or sidecars next to the inputs.

An item's `source` is its path relative to the folder given when the job was enqueued,
so the output tree mirrors the input tree. A source comes from a payload that any
producer may have written, so every target is checked to stay inside the output root:
absolute paths, `..` parts and symlinked folders pointing out are refused.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from vlmq.producer import formats
from vlmq.shared.errors import VlmqError
from vlmq.shared.schema import ItemResult

# The formats that say how one source's results become a file (formats.Format.file).
FORMATS = tuple(name for name, f in formats.FORMATS.items() if f.file is not None)


class UnsafeSource(VlmqError):
    """A result's source would be written outside the output root."""


@dataclass
class ExportReport:
    written: list[Path] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)   # (source, item error)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (source, why)

    def merge(self, other: ExportReport) -> None:
        self.written += other.written
        self.failed += other.failed
        self.refused += other.refused

    def to_dict(self) -> dict[str, object]:
        return {"written": [str(p) for p in self.written],
                "failed": [{"source": s, "error": e} for s, e in self.failed],
                "refused": [{"source": s, "reason": r} for s, r in self.refused]}


def target_path(root: Path, source: str, suffix: str) -> Path:
    """Where `source` + suffix goes under root; raises UnsafeSource if that is outside."""
    if not source or "\x00" in source:
        raise UnsafeSource(f"source {source!r} is empty or not a path")
    posix = PurePosixPath(source.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(source).drive:
        raise UnsafeSource(f"source {source!r} is an absolute path")
    if ".." in posix.parts:
        raise UnsafeSource(f"source {source!r} climbs out of the output folder (..)")
    base = root.resolve()
    target = base.joinpath(*posix.parts[:-1], posix.name + suffix)
    # A folder on the way that is a symlink pointing out would carry the write along.
    if not target.parent.resolve().is_relative_to(base):
        raise UnsafeSource(f"source {source!r} leads outside {root} through a symlink")
    if target.is_symlink():
        raise UnsafeSource(f"{target} is a symlink; not writing through it")
    return target


def _write(path: Path, text: str) -> None:
    """Atomic: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_results(results: Iterable[ItemResult], root: Path, fmt: str = "md") -> ExportReport:
    """Write one job's results under root; later writes of the same source replace earlier.

    A PDF becomes `<source>.<fmt>`, an image `<source>.txt` (`<source>.json` in json);
    what a file holds is the format's own (vlmq.producer.formats, Format.file). Failed
    images are not written (reported in `failed`); a failed PDF page is reported too and
    keeps its place in the document.
    """
    render = formats.FORMATS[fmt].file if fmt in formats.FORMATS else None
    if render is None:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    report = ExportReport()
    docs: dict[str, list[ItemResult]] = {}
    images: list[ItemResult] = []
    for r in results:
        if r.page is not None:
            docs.setdefault(r.source, []).append(r)
        else:
            images.append(r)
    for r in images:
        if not r.ok:
            report.failed.append((r.source, r.error or "failed"))
            continue
        _emit(report, root, r.source, ".json" if fmt == "json" else ".txt", render([r]))
    for source, pages in docs.items():
        report.failed += [(f"{source} page {p.page}", p.error or "failed")
                          for p in pages if not p.ok]
        _emit(report, root, source, f".{fmt}", render(pages))
    return report


def _emit(report: ExportReport, root: Path, source: str, suffix: str, text: str) -> None:
    try:
        path = target_path(root, source, suffix)
    except UnsafeSource as exc:
        report.refused.append((source, str(exc)))
        return
    _write(path, text)
    report.written.append(path)
