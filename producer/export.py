"""Results back into files: `OUT/<source>.md|.txt|.json`, or sidecars next to the inputs.

An item's `source` is its path relative to the folder given when the job was enqueued,
so the output tree mirrors the input tree. A source comes from a payload that any
producer may have written, so every target is checked to stay inside the output root:
absolute paths, `..` parts and symlinked folders pointing out are refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from vlmq.shared.errors import VlmqError
from vlmq.shared.schema import ItemResult

FORMATS = ("md", "txt", "json")


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


def _document(pages: Sequence[ItemResult], fmt: str) -> str:
    """A PDF's pages in page order, each after a marker naming it (errors shown in place)."""
    parts: list[str] = []
    for r in sorted(pages, key=lambda r: (r.page or 0, r.index)):
        body = r.text.rstrip("\n") if r.ok and r.text else (
            f"[error: {r.error}]" if r.error else "")
        marker = f"<!-- page {r.page} -->" if fmt == "md" else f"--- page {r.page} ---"
        parts.append(f"{marker}\n\n{body}\n")
    return "\n".join(parts)


def export_results(results: Iterable[ItemResult], root: Path, fmt: str = "md") -> ExportReport:
    """Write one job's results under root; later writes of the same source replace earlier.

    md: a PDF becomes `<source>.md` (pages with markers), an image `<source>.txt`.
    txt: the same, with plain-text page markers and `.txt` for PDFs too.
    json: every source becomes `<source>.json` with all item fields (a list for a PDF).
    Failed images are not written (reported in `failed`); a PDF page that failed shows
    its error in place, so the document keeps its page order.
    """
    if fmt not in FORMATS:
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
        text = (json.dumps(r.to_dict(), indent=2) + "\n" if fmt == "json"
                else (r.text or "").rstrip("\n") + "\n")
        _emit(report, root, r.source, ".json" if fmt == "json" else ".txt", text)
    for source, pages in docs.items():
        report.failed += [(f"{source} page {p.page}", p.error or "failed")
                          for p in pages if not p.ok]
        if fmt == "json":
            text = json.dumps([p.to_dict() for p in sorted(pages, key=lambda p: p.page or 0)],
                              indent=2) + "\n"
        else:
            text = _document(pages, fmt)
        _emit(report, root, source, f".{fmt}", text)
    return report


def _emit(report: ExportReport, root: Path, source: str, suffix: str, text: str) -> None:
    try:
        path = target_path(root, source, suffix)
    except UnsafeSource as exc:
        report.refused.append((source, str(exc)))
        return
    _write(path, text)
    report.written.append(path)
