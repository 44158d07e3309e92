"""Batch manifests: a JSONL file of requests, the way batch APIs take them.

Each line is one request: {"custom_id", "task", "file", "pages"?} and any of the settings
a manifest may carry ("prompt", "max_tokens", "max_side", ...: see shared/settings.py).
An extract line's "schema" is a JSON Schema object, or the path of a .json file holding
one (relative to the manifest's folder, like "file").
Every line is checked before anything is written; errors name the line and the field.
A line is JSON read with bounds (number sizes, nesting), so no line can raise anything but
its own error. Lines with the same task and settings become one job, so a manifest's
items share batches on the worker; lines whose prompts differ share it too, each item
carrying its own prompt where it is not the job's (shared/PROTOCOL.md, items[].prompt),
so a file of distinct prompts costs Redis an item a line, not a job. Every item carries
its line's custom_id into its result.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlmq.producer.files import CheckedFile, check_file
from vlmq.producer.inputs import Prepared
from vlmq.producer.job_sets import JOB_ITEMS, split_prepared
from vlmq.producer.options import JobOptions, read_schema_file
from vlmq.producer.page_specs import parse_pages
from vlmq.shared import constants as C
from vlmq.shared import extract_schema
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.messages import Item

# The request's own fields; every setting a manifest may carry (shared/settings.py) too.
OWN_FIELDS = ("custom_id", "task", "file", "pages")
FIELDS = (*OWN_FIELDS, *(s.name for s in S.rows("manifest")))
REQUIRED = ("custom_id", "task", "file")
# A request is a few hundred bytes; a longer line is refused (naming it) unread.
MAX_LINE_BYTES = 1024 * 1024
# A JSON number of a line is at most this many characters: far more than any setting
# takes (an int64 seed has 20), and far from where int() turns slow or refuses (4,300
# digits) and a float overflows to inf.
MAX_NUMBER_CHARS = 100
# A line nests at most this deep: an extract schema's levels under the line's own few.
MAX_LINE_DEPTH = extract_schema.MAX_SCHEMA_DEPTH + 8
# Per-item prompts a job carries, in bytes of JSON: a quarter of what a worker reads of a
# job's data (C.MAX_FIELD_BYTES), so the rest of the payload always fits beside them.
MAX_JOB_PROMPT_BYTES = C.MAX_FIELD_BYTES // 4
# A line that fails in a way no check foresaw is that line's error, never the file's.
UNFORESEEN = (ArithmeticError, LookupError, RecursionError, TypeError, ValueError)

log = logging.getLogger("vlmq.producer")


class TooManyRequests(InputError):
    """A file with more requests than its format allows, refused whole at the first one
    over (`line`), without reading the rest."""

    def __init__(self, path: str, line: int, limit: int) -> None:
        self.line = line
        self.limit = limit
        super().__init__(path, f"line {line}: the file has more than {limit:,} requests, "
                               "the most one batch file may hold; split it")


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


class _Unreadable:
    """Stands where a line held a number no check could take, so that the error can
    name its field once the whole line is read."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def bounded_json(text: str) -> Any:
    """A line's JSON with every number bounded (MAX_NUMBER_CHARS, finite, no NaN) and its
    nesting bounded (MAX_LINE_DEPTH): PayloadError naming the field, never another
    exception, whatever the line holds."""
    raw, unreadable = _loads(text)
    _refuse(raw, unreadable)
    return raw


def _loads(text: str) -> tuple[Any, _Unreadable | None]:
    """The JSON, and the first number in it no check could take (still in its place)."""
    found: list[_Unreadable] = []

    def refused(why: str) -> _Unreadable:
        found.append(_Unreadable(why))
        return found[-1]

    def number(text: str, kind: Callable[[str], float]) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            return refused(f"is a number of {len(text):,} characters; vlmq reads numbers of "
                           f"at most {MAX_NUMBER_CHARS}")
        value = kind(text)
        return value if math.isfinite(value) else refused(f"is {text}, too large a number")

    try:
        raw = json.loads(text, parse_int=lambda t: number(t, int),
                         parse_float=lambda t: number(t, float),
                         parse_constant=lambda t: refused(f"is {t}, which is not a JSON "
                                                          "number"))
    except RecursionError:
        raise PayloadError("(line)", f"nests JSON deeper than {MAX_LINE_DEPTH} "
                                     "levels") from None
    except json.JSONDecodeError as exc:
        raise PayloadError("(line)", f"is not JSON: {exc}") from None
    _check_nesting(raw)
    return raw, found[0] if found else None


def _refuse(raw: Any, unreadable: _Unreadable | None) -> None:
    if unreadable is not None:
        raise PayloadError(_path_to(raw, unreadable), unreadable.why)


def _check_nesting(raw: Any) -> None:
    stack: list[tuple[Any, int]] = [(raw, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_LINE_DEPTH:
            raise PayloadError("(line)", f"nests JSON deeper than {MAX_LINE_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def _path_to(raw: Any, target: object) -> str:
    """The field holding `target`, as errors name fields (body.messages[0].content)."""
    stack: list[tuple[Any, str]] = [(raw, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path or "(line)"
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return "(line)"


def line_object(text: str, fields: Sequence[str] = FIELDS,
                required: Sequence[str] = REQUIRED, *,
                first: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One line as a JSON object holding only `fields`, every `required` one among them
    (PayloadError naming the field): the first check of a manifest or batch-file line.
    `first` sees the object before anything in it is refused (to note its custom_id)."""
    raw, unreadable = _loads(text)
    if not isinstance(raw, dict):
        _refuse(raw, unreadable)
        raise PayloadError("(line)", f"must be a JSON object, got {type(raw).__name__}")
    if first is not None:
        first(raw)
    _refuse(raw, unreadable)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PayloadError(unknown[0][:100], f"unknown field (allowed: {', '.join(fields)})")
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
    extract_schema.check_task(task, settings.get("schema"))
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
                  max_line_bytes: int = MAX_LINE_BYTES, max_requests: int | None = None
                  ) -> tuple[list[Group], list[tuple[int, str]]]:
    """Check every line; returns the jobs to enqueue (at most `job_size` items each: more
    than one become a batch) and the rejected lines.

    Without skip_bad any bad line raises ManifestError listing them all, and nothing is
    enqueued. Files are checked (type, pages) here, so the worker gets no surprises.
    `parse` reads another line format into the same Requests (default: a manifest line's,
    relative to the manifest's folder), so checks, grouping and errors are these.
    `max_requests` refuses a longer file at its first request over (TooManyRequests),
    before the rest is read.
    """
    manifest = Path(path)
    reader = _LineReader(manifest, parse)
    groups: dict[tuple[Any, ...], Group] = {}
    errors: list[tuple[int, str]] = []
    requests = 0
    for number, line in _lines(manifest, max_line_bytes):
        if line is not None and not line.strip():
            continue
        requests += 1
        if max_requests is not None and requests > max_requests:
            raise TooManyRequests(str(path), number, max_requests)
        if line is None:
            errors.append((number, f"is longer than the {max_line_bytes}-byte limit for a "
                                   "manifest line"))
            continue
        read = reader.read(number, line)
        if isinstance(read, str):
            errors.append((number, read))
            continue
        _add(groups, base, *read)
    if errors and not skip_bad:
        raise ManifestError(str(path), errors)
    if not groups:
        raise ManifestError(str(path), errors or [(0, "no requests in the manifest")])
    return _split(groups.values(), job_size), errors


class _LineReader:
    """One line at a time into a checked Request, or that line's error message: what the
    file's lines share (custom_ids seen, schema files read) lives here."""

    def __init__(self, manifest: Path, parse: LineParser | None) -> None:
        self.manifest = manifest
        self.parse = parse
        self.seen: dict[str, int] = {}
        self.schemas: dict[Path, dict[str, Any]] = {}  # schema files, read once each

    def read(self, number: int, line: str
             ) -> str | tuple[Request, CheckedFile | None, list[int | None]]:
        req: Request | None = None
        try:
            req = (self.parse(number, line) if self.parse is not None
                   else parse_line(number, line, self.manifest.parent, self.schemas))
            if req.custom_id in self.seen:
                raise PayloadError("custom_id", f"{req.custom_id!r} is already used on line "
                                                f"{self.seen[req.custom_id]}")
            checked, pages = _checked_pages(req)
        except PayloadError as exc:
            return f"field {exc.field!r} {exc.problem}"
        except InputError as exc:
            shown = "file" if req is None else req.field
            return f"field {shown!r} {exc.path}: {exc.problem}"
        except UNFORESEEN as exc:
            log.debug("%s line %d", self.manifest, number, exc_info=True)
            return f"field '(line)' cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
        self.seen[req.custom_id] = number
        return req, checked, pages


def _add(groups: dict[tuple[Any, ...], Group], base: JobOptions, req: Request,
         checked: CheckedFile | None, pages: list[int | None]) -> None:
    """The request's items into the job of its task and settings. The prompt is the
    item's own: requests whose prompts differ share a job (_shared_prompt picks the job's)."""
    settings = dict(req.settings)
    options = base.with_(**settings)
    prompt = options.prompt
    options = options.with_(prompt=None)
    group = groups.setdefault((req.task, options.key(), req.group, prompt is not None),
                              Group(req.task, options, Prepared()))
    prepared = group.prepared
    start = len(prepared.items)
    if checked is None:
        prepared.items.append(Item(kind=C.TEXT_KIND, blob=None,
                                   source=req.source or C.TEXT_KIND, custom_id=req.custom_id))
    else:
        prepared.add(checked, pages, custom_id=req.custom_id)
    if prompt is not None:
        prepared.items[start:] = [replace(i, prompt=prompt) for i in prepared.items[start:]]


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
    """Groups over the job size, or over MAX_JOB_PROMPT_BYTES of prompts of their own,
    become several jobs (producer/job_sets.py: why that size, and how a file's items stay
    together), each with the prompt most of its items have. The upload budget's cut is not
    made here, where no client is known: submit_parts makes it for every path
    (job_sets.split_for); an item without a prompt of its own keeps the job's, so that cut
    changes nothing."""
    out: list[Group] = []
    for group in groups:
        for part in split_prepared(group.prepared, job_size):
            common = Counter(i.prompt for i in part.items).most_common(1)[0][0]
            out += [_shared_prompt(group.task, group.options, piece, common)
                    for piece in _by_prompt_bytes(part, common)]
    return out


def _by_prompt_bytes(prepared: Prepared, common: str | None) -> list[Prepared]:
    """`prepared` cut where the prompts its items carry (all but `common`, the job's)
    would pass MAX_JOB_PROMPT_BYTES."""
    pieces: list[list[Item]] = [[]]
    held = 0
    for item in prepared.items:
        cost = 0 if item.prompt in (None, common) else len(json.dumps(item.prompt))
        if pieces[-1] and held + cost > MAX_JOB_PROMPT_BYTES:
            pieces.append([])
            held = 0
        pieces[-1].append(item)
        held += cost
    if len(pieces) == 1:
        return [prepared]
    blobs = prepared.blobs
    return [Prepared(items=piece, blobs={i.blob: blobs[i.blob] for i in piece
                                         if i.blob is not None and i.blob in blobs})
            for piece in pieces]


def _shared_prompt(task: str, options: JobOptions, prepared: Prepared,
                   common: str | None) -> Group:
    """One job: `common`, the prompt most of its items have, becomes the job's, and only
    the items whose prompt differs carry their own (an identical-prompt file costs no more
    than before; a file of distinct prompts costs an item a line, not a job)."""
    if common is None:
        return Group(task, options, prepared)
    items = [replace(i, prompt=None) if i.prompt == common else i for i in prepared.items]
    return Group(task, options.with_(prompt=common), Prepared(items=items,
                                                              blobs=prepared.blobs))
