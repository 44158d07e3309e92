"""Batch manifests: a JSONL file of requests, the way batch APIs take them.

Each line is one request: {"custom_id", "task", "file", "pages"?} and any of the settings
a manifest may carry ("prompt", "max_tokens", "max_side", ...: see shared/settings.py).
An extract line's "schema" is a JSON Schema object, or the path of a .json file holding
one (relative to the manifest's folder, like "file").
Every line is checked before anything is written; errors name the line and the field.
Lines with the same task and settings become one job, so a manifest's items share
batches on the worker; every item carries its line's custom_id into its result.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmq.producer.files import CheckedFile, check_file
from vlmq.producer.inputs import Prepared
from vlmq.producer.job_sets import JOB_ITEMS, split_prepared
from vlmq.producer.options import JobOptions, read_schema_file
from vlmq.producer.page_specs import parse_pages
from vlmq.shared import constants as C
from vlmq.shared import extract_schema as json_schema
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.messages import Item

# The request's own fields; every setting a manifest may carry (shared/settings.py) too.
OWN_FIELDS = ("custom_id", "task", "file", "pages")
FIELDS = (*OWN_FIELDS, *(s.name for s in S.rows("manifest")))
REQUIRED = ("custom_id", "task", "file")
# A request is a few hundred bytes; a longer line is refused (naming it) unread.
MAX_LINE_BYTES = 1024 * 1024


class ManifestError(InputError):
    """Bad lines of a manifest, all listed at once (line number, field, problem)."""

    def __init__(self, path: str, errors: Sequence[tuple[int, str]]) -> None:
        self.errors = list(errors)
        super().__init__(path, f"{len(self.errors)} bad line(s)")

    def __str__(self) -> str:
        return (f"{self.path}: {len(self.errors)} bad line(s):\n"
                + "\n".join(f"  line {n}: {msg}" for n, msg in self.errors))


@dataclass(frozen=True)
class Request:
    line: int
    custom_id: str
    task: str
    file: Path | None  # None: a text item (C.TEXT_KIND), the line's prompt alone
    pages: str | None
    settings: dict[str, Any]  # the line's own settings, checked, by name
    # Another line format (producer/openai_files.py) names its input elsewhere: the
    # item's source (default: the path), the field errors about the file name, and
    # whether the request must be one item (a document of several pages is refused).
    source: str | None = None
    field: str = "file"
    one_item: bool = False
    # More that lines must share to share a job (an OpenAI line's unenforced model name,
    # recorded per job), beyond task and settings.
    group: tuple[Any, ...] = ()


# One line (number, text) as a Request; raises PayloadError naming the field.
LineParser = Callable[[int, str], Request]


@dataclass
class Group:
    """Requests that share a job: one task, one set of options."""

    task: str
    options: JobOptions
    prepared: Prepared


def line_object(text: str, fields: Sequence[str] = FIELDS,
                required: Sequence[str] = REQUIRED) -> dict[str, Any]:
    """One line as a JSON object holding only `fields`, every `required` one among them
    (PayloadError naming the field): the first check of a manifest or batch-file line."""
    try:
        raw: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PayloadError("(line)", f"is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PayloadError("(line)", f"must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PayloadError(unknown[0], f"unknown field (allowed: {', '.join(fields)})")
    for name in required:
        if name not in raw:
            raise PayloadError(name, "is required")
    return raw


def check_custom_id(custom_id: Any) -> str:
    if not isinstance(custom_id, str) or not custom_id \
            or len(custom_id) > C.MAX_CUSTOM_ID_CHARS:
        raise PayloadError("custom_id", f"must be a string of 1 to {C.MAX_CUSTOM_ID_CHARS} "
                                        "characters")
    return custom_id


def _own_fields(raw: dict[str, Any]) -> tuple[str, str, str, str | None]:
    custom_id = check_custom_id(raw["custom_id"])
    task = raw["task"]
    if task not in C.TASKS:
        raise PayloadError("task", f"must be one of {', '.join(C.TASKS)}, got {task!r}")
    file = raw["file"]
    if not isinstance(file, str) or not file:
        raise PayloadError("file", "must be a path (relative to the manifest's folder)")
    pages = raw.get("pages")
    if pages is not None and (not isinstance(pages, str) or not pages.strip()):
        raise PayloadError("pages", 'must be a page range string such as "1-3,7"')
    return custom_id, task, file, pages


def _schema(value: Any, base: Path, files: dict[Path, dict[str, Any]]) -> Any:
    """A line's "schema": an object as it is; a string is a file relative to `base`, read
    once per manifest however many lines name it (`files`)."""
    if not isinstance(value, str):
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if path not in files:
        try:
            files[path] = read_schema_file(path)
        except PayloadError as exc:
            raise PayloadError("schema", f"{exc.field}: {exc.problem}") from None
    return files[path]


def parse_line(number: int, text: str, base: Path,
               schemas: dict[Path, dict[str, Any]] | None = None) -> Request:
    raw = line_object(text)
    custom_id, task, file, pages = _own_fields(raw)
    if raw.get("schema") is not None:
        raw["schema"] = _schema(raw["schema"], base, {} if schemas is None else schemas)
    settings = {s.name: s.check(raw[s.name]) for s in S.rows("manifest") if s.name in raw}
    if raw.get("prompt") is not None and not settings.get("prompt"):
        raise PayloadError("prompt", "must not be empty")
    json_schema.check_task(task, settings.get("schema"))
    if task == "generate" and not settings.get("prompt"):
        raise PayloadError("prompt", "is required for task generate")
    path = Path(file).expanduser()
    return Request(line=number, custom_id=custom_id, task=task,
                   file=path if path.is_absolute() else base / path, pages=pages,
                   settings={k: v for k, v in settings.items() if v is not None})


def _lines(manifest: Path, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | None]]:
    """(number, text) per line, None for a line over `limit` bytes: read with a bounded
    readline, so a 500 MB line costs at most `limit` bytes of memory, never the line."""
    try:
        with manifest.open("rb") as fh:
            for number in itertools.count(1):
                raw = fh.readline(limit + 1)
                if not raw:
                    return
                if len(raw) > limit and not raw.endswith(b"\n"):
                    while (rest := fh.readline(limit)) and not rest.endswith(b"\n"):
                        pass  # the rest of the long line, a bounded piece at a time
                    yield number, None
                    continue
                try:
                    yield number, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise InputError(str(manifest), f"cannot read the manifest: line {number} "
                                                    f"is not UTF-8 ({exc})") from None
    except OSError as exc:
        raise InputError(str(manifest), f"cannot read the manifest: {exc}") from None


def read_manifest(path: str | Path, base: JobOptions, *, skip_bad: bool = False,
                  job_size: int = JOB_ITEMS, parse: LineParser | None = None,
                  max_line_bytes: int = MAX_LINE_BYTES
                  ) -> tuple[list[Group], list[tuple[int, str]]]:
    """Check every line; returns the jobs to enqueue (at most `job_size` items each: more
    than one become a batch) and the rejected lines.

    Without skip_bad any bad line raises ManifestError listing them all, and nothing is
    enqueued. Files are checked (type, pages) here, so the worker gets no surprises.
    `parse` reads another line format into the same Requests (default: a manifest line's,
    relative to the manifest's folder), so checks, grouping and errors are these.
    """
    manifest = Path(path)
    groups: dict[tuple[Any, ...], Group] = {}
    errors: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    schemas: dict[Path, dict[str, Any]] = {}  # schema files, read once each
    for number, line in _lines(manifest, max_line_bytes):
        if line is None:
            errors.append((number, f"is longer than the {max_line_bytes}-byte limit for a "
                                   "manifest line"))
            continue
        if not line.strip():
            continue
        req: Request | None = None
        try:
            req = (parse(number, line) if parse is not None
                   else parse_line(number, line, manifest.parent, schemas))
            if req.custom_id in seen:
                raise PayloadError("custom_id", f"{req.custom_id!r} is already used on line "
                                                f"{seen[req.custom_id]}")
            checked, pages = _checked_pages(req)
        except PayloadError as exc:
            errors.append((number, f"field {exc.field!r} {exc.problem}"))
            continue
        except InputError as exc:
            shown = "file" if req is None else req.field
            errors.append((number, f"field {shown!r} {exc.path}: {exc.problem}"))
            continue
        seen[req.custom_id] = number
        options = base.with_(**req.settings)
        group = groups.setdefault((req.task, options.key(), req.group),
                                  Group(req.task, options, Prepared()))
        _add(group.prepared, req, checked, pages)
    if errors and not skip_bad:
        raise ManifestError(str(path), errors)
    if not groups:
        raise ManifestError(str(path), errors or [(0, "no requests in the manifest")])
    return _split(groups.values(), job_size), errors


def _add(prepared: Prepared, req: Request, checked: CheckedFile | None,
         pages: list[int | None]) -> None:
    if checked is None:
        prepared.items.append(Item(kind=C.TEXT_KIND, blob=None,
                                   source=req.source or C.TEXT_KIND, custom_id=req.custom_id))
    else:
        prepared.add(checked, pages, custom_id=req.custom_id)


def _checked_pages(req: Request) -> tuple[CheckedFile | None, list[int | None]]:
    """The request's file checked (type, pages), and the items it asks for: the pages given
    of a paged file (a one-item request may not name several), else the image itself; a
    text request (no file) has none to check."""
    if req.file is None:
        return None, []
    checked = check_file(req.file, source=req.source or str(req.file))
    paged = checked.kind in C.PAGED_KINDS
    if req.one_item and checked.pages > 1:
        raise PayloadError(req.field, f"is a {checked.kind.upper()} of "
                                      f"{checked.pages} pages, and a request is one "
                                      "item: give one page per request")
    if req.pages is not None and not paged:
        raise PayloadError("pages", f"applies to PDFs and multi-page TIFFs; "
                                    f"{req.file} is an image")
    pages: list[int | None] = (list(parse_pages(req.pages, checked.pages, str(req.file)))
                               if paged else [None])
    return checked, pages


def _split(groups: Iterable[Group], job_size: int = JOB_ITEMS) -> list[Group]:
    """Groups over the job size become several jobs (producer/job_sets.py: why that size,
    and how a file's items stay together). The upload budget's cut is not made here, where
    no client is known: submit_parts makes it for every path (job_sets.split_for)."""
    return [Group(g.task, g.options, part) for g in groups
            for part in split_prepared(g.prepared, job_size)]
