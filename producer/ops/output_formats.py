"""Output formats, each defined once: a name, its renderer, and what `vlmq export` writes.

`vlmq result`, the dashboard's downloads and `vlmq export` all render through FORMATS,
so a format gives the same bytes wherever it is asked for. A new format is one entry:
a function from a job's results to text, registered with `@_format`; its docstring's
first paragraph is the help text the CLI shows for it.

An extract job's items carry `json`, the parsed object: jsonl gives every item a `json`
key, csv flattens the objects' top-level fields into columns, and export writes each
source's objects as `<source>.json` (extract_file).
"""

from __future__ import annotations

import csv
import heapq
import inspect
import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from vlmq.shared.keys import Keys
from vlmq.shared.messages import TEXT_FROM_LAYER, ItemResult, JobPayload
from vlmq.shared.redis_text import as_str

if TYPE_CHECKING:  # imported where used: `vlmq result --help` reads FORMATS without them
    from vlmq.producer.client import Job
    from vlmq.producer.openai_files import FileRecord


@dataclass(frozen=True)
class JobResults:
    """One job's results as the renderers read them, read once so every format of one
    request sees the same snapshot of a running job."""

    job: Job
    state: str
    results: tuple[ItemResult, ...]
    error: str | None  # why the job failed; None unless it has

    @classmethod
    def read(cls, job: Job) -> JobResults:
        state = job.status()
        results = tuple(job.results())
        return cls(job, state, results, job.error() if state == "failed" else None)


Render = Callable[[JobResults], str]
# Several jobs' results as one output, for a format whose renderings cannot simply be
# concatenated (csv has one header).
RenderMany = Callable[[Sequence[JobResults]], str]
# One source's results (an image's one result, or a PDF's pages) as one exported file.
RenderFile = Callable[[Sequence[ItemResult]], str]
# A job's output as (successes, failures), for `vlmq result --errors FILE`.
Split = Callable[[JobResults], tuple[str, str]]
# Several jobs' (successes, failures), for a format whose lines interleave across jobs.
SplitMany = Callable[[Sequence[JobResults]], tuple[str, str]]


@dataclass(frozen=True)
class Format:
    name: str
    mimetype: str
    render: Render
    several_jobs: bool  # renderings of several jobs, concatenated, are one valid output
    omits_failed: bool = False  # failed items are left out (the CLI names them on stderr)
    file: RenderFile | None = None  # None: `vlmq export` does not offer this format
    many: RenderMany | None = None  # None: several jobs are their renderings concatenated
    split: Split | None = None  # None: this format has no errors file
    split_many: SplitMany | None = None  # None: several jobs' splits concatenated

    def render_jobs(self, views: Sequence[JobResults]) -> str:
        """Several jobs (ids, or a batch's jobs) as one output, in the order given."""
        if self.many is not None:
            return self.many(views)
        return "".join(self.render(v) for v in views)

    def split_jobs(self, views: Sequence[JobResults]) -> tuple[str, str]:
        """Several jobs' (successes, failures), for --errors."""
        if self.split_many is not None:
            return self.split_many(views)
        assert self.split is not None, f"{self.name} has no errors file"
        split = [self.split(v) for v in views]
        return "".join(ok for ok, _ in split), "".join(bad for _, bad in split)

    @property
    def summary(self) -> str:
        first = " ".join((inspect.getdoc(self.render) or self.name).split("\n\n")[0].split())
        return first[:1].lower() + first[1:].rstrip(".")


FORMATS: dict[str, Format] = {}


def _format(name: str, mimetype: str, *, several_jobs: bool, omits_failed: bool = False,
            file: RenderFile | None = None, many: RenderMany | None = None,
            split: Split | None = None, split_many: SplitMany | None = None
            ) -> Callable[[Render], Render]:
    def register(render: Render) -> Render:
        FORMATS[name] = Format(name, mimetype, render, several_jobs, omits_failed, file, many,
                               split, split_many)
        return render

    return register


# Characters that would end a Markdown heading or hide in it: C0 controls, DEL, C1 NEL and
# the Unicode line and paragraph separators.
_BREAKS = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")


def escape_line_breaks(text: str) -> str:
    """text with its control characters written as escapes (\\n, \\x00): a name from a
    payload (a file name, a custom_id) stays on its heading's line and shows what it is."""
    return _BREAKS.sub(_escaped, text)


def _escaped(m: re.Match[str]) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


# Terminal control in text that a PDF's layer or a model's answer carries:
# whole escape sequences first (ECMA-48: ESC [ or C1 CSI ... final byte; ESC ] P X ^ _ or
# their C1 forms ... BEL or ST, never past a line end; ESC and one more), then any C0
# control but tab, LF and CR, DEL and the C1 controls. Left in a txt, md or csv file, `cat`
# on a terminal runs them (set its title, clear it, recolour it).
_SEQUENCES = re.compile(
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def strip_controls(text: str) -> str:
    """text without terminal control: escape sequences and control characters removed
    (tab, LF and CR stay). What txt, md and csv hold; jsonl and json keep every
    character, which JSON writes escaped."""
    if not _CONTROLS.search(text):
        return text
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))


def for_terminal(text: str) -> str:
    """text with every control character but tab, LF and CR shown as its escape (\\x1b):
    for a terminal, which would run it. A last guard for whatever a format keeps (the
    formats' own text is already plain) and for names in messages."""
    return _CONTROLS.sub(_escaped, text)


def last_line(text: str) -> str:
    """A traceback's last line is its message: the one line worth showing inline."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else text


def _text(r: ItemResult) -> str:
    return strip_controls(r.text or "").rstrip("\n") + "\n"


def _pages(pages: Sequence[ItemResult], marker: Callable[[int | None], str]) -> str:
    """A PDF's or TIFF's pages in page order, each after a marker naming it; a failed page shows its
    error in place, so the document keeps its page order."""
    parts: list[str] = []
    for r in sorted(pages, key=lambda r: (r.page or 0, r.index)):
        body = strip_controls(r.text).rstrip("\n") if r.ok and r.text else (
            f"[error: {strip_controls(r.error)}]" if r.error else "")
        parts.append(f"{marker(r.page)}\n\n{body}\n")
    return "\n".join(parts)


def _md_file(results: Sequence[ItemResult]) -> str:
    if results[0].page is None:  # an image: its text alone
        return _text(results[0])
    return _pages(results, lambda page: f"<!-- page {page} -->")


def _txt_file(results: Sequence[ItemResult]) -> str:
    if results[0].page is None:
        return _text(results[0])
    return _pages(results, lambda page: f"--- page {page} ---")


def _json_file(results: Sequence[ItemResult]) -> str:
    if results[0].page is None:
        return json.dumps(results[0].to_dict(), indent=2) + "\n"
    pages = sorted(results, key=lambda p: p.page or 0)
    return json.dumps([p.to_dict() for p in pages], indent=2) + "\n"


# The task whose items carry `json`, the parsed object (shared.constants.TASKS).
EXTRACT = "extract"


def _row(job_id: str, fields: dict[str, Any]) -> str:
    return json.dumps({"job_id": job_id, **fields}) + "\n"


def _fields(view: JobResults, r: ItemResult) -> dict[str, Any]:
    """An item's protocol fields; an extract job's items all have `json` (null when the
    item failed), so a reader of the lines need not know which were left out."""
    out = r.to_dict()
    if view.job.task == EXTRACT:
        out.setdefault("json", None)
    return out


def jsonl_split(view: JobResults) -> tuple[str, str]:
    """(successes, failures) as jsonl, for the OpenAI Batch convention of an errors file.

    A failed job's unfinished items count as failures, so the errors file names every
    item that has no text.
    """
    ok = "".join(_row(view.job.id, _fields(view, r)) for r in view.results if r.ok)
    bad = {r.index: _row(view.job.id, _fields(view, r)) for r in view.results if not r.ok}
    if view.error is not None:
        reason = f"no result: the job failed: {last_line(view.error)}"
        done = {r.index for r in view.results}
        for index, item in enumerate(view.job.payload().items):
            if index not in done:
                bad[index] = _row(view.job.id, {
                    "index": index, "source": item.source, "page": item.page,
                    "custom_id": item.custom_id, "text": None, "error": reason,
                    **({"json": None} if view.job.task == EXTRACT else {})})
    return ok, "".join(bad[i] for i in sorted(bad))


@_format("jsonl", "application/x-ndjson", several_jobs=True, split=jsonl_split)
def render_jsonl(view: JobResults) -> str:
    """One item result per line (with job_id and custom_id).

    Lines come in item order, failed items included with their error; it is the format
    other programs read, so every field an item has is there.
    """
    return "".join(_row(view.job.id, _fields(view, r)) for r in view.results)


@_format("json", "application/json", several_jobs=False, file=_json_file)
def render_json(view: JobResults) -> str:
    """One object with the job's status and summary.

    Also its labels, its failure (if it failed) and every item result, indented for
    people; exported, each source becomes <source>.json with every item field.
    """
    job = view.job
    return json.dumps({"id": job.id, "status": view.state, "labels": job.labels,
                       "summary": job.summary() if view.state == "finished" else None,
                       "error": view.error,
                       "items": [_fields(view, r) for r in view.results]}, indent=2) + "\n"


@_format("md", "text/markdown", several_jobs=False, file=_md_file)
def render_markdown(view: JobResults) -> str:
    """A readable document, one section per page or image.

    Sections follow item order, one heading each; errors and gaps are made visible, and a
    failed job's document opens with why it failed, before any page. Exported, a PDF
    becomes <source>.md with a marker before each page, an image <source>.txt.
    """
    job, state, error = view.job, view.state, view.error
    by_index = {r.index: r for r in view.results}
    parts: list[str] = []
    if error is not None:
        error = strip_controls(error)
        parts.append(f"> **This job failed:** {last_line(error)}\n")
        if len(error.strip().splitlines()) > 1:
            parts.append("```text\n" + error.strip() + "\n```\n")
    parts.append(f"<!-- vlmq job {job.id}: {state}, {len(view.results)}/{job.items} "
                 "items -->\n")
    for index, item in enumerate(job.payload().items):
        source = escape_line_breaks(item.source)
        heading = source if item.page is None else f"{source} — page {item.page}"
        if item.custom_id is not None:
            heading += f" ({escape_line_breaks(item.custom_id)})"
        parts.append(f"## {heading}\n")
        parts.append(_md_section(by_index.get(index), state, error))
    return "\n".join(parts)


def _md_section(r: ItemResult | None, state: str, error: str | None) -> str:
    if r is None and error is not None:
        return "> _no result: the job failed before this item (see the top)_\n"
    if r is None:
        return f"> _not done yet (job {state})_\n"
    if r.error is not None:
        return f"> **Error:** {strip_controls(r.error)}\n"
    if not r.text:
        return "_(no text)_\n"
    if r.text_source == TEXT_FROM_LAYER:
        return f"> _{layer_note(r)}_\n\n" + _text(r)
    return _text(r)


def layer_note(r: ItemResult) -> str:
    """Says that an item's text is its page's text layer, and why the model's is not."""
    if r.model_error is not None:
        return f"from the PDF's text layer; the model failed: {escape_line_breaks(r.model_error)}"
    if r.model_text is not None:
        return f"from the PDF's text layer; the model's text was cut ({r.finish_reason})"
    return "from the PDF's text layer"


@_format("txt", "text/plain", several_jobs=True, omits_failed=True, file=_txt_file)
def render_txt(view: JobResults) -> str:
    """The texts alone, in item order, a blank line apart (failed items left out).

    For piping into other tools: nothing but model output. Exported, each source is its
    own file, so a PDF's pages there each follow a plain-text marker and a failed page
    shows its error in place.
    """
    return "".join(_text(r) + "\n" for r in view.results if r.ok)


# --- csv: one row per item, for spreadsheets ----------------------------------------------

# What a spreadsheet runs as a formula when a cell starts with it (OWASP's list, and the
# full-width forms, which spreadsheets read as the ASCII ones): such a cell gets a leading '
# and stays text. Spreadsheets skip leading whitespace and zero-width or format characters
# (U+200B..U+200F, U+2060, U+FEFF: Unicode's Cf) before reading one, so those do not hide
# a formula either. A JSON number is written as JSON writes it ("-3.5"),
# never a formula, so it keeps its sign unguarded.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
_HIDES_START = re.compile(r"[\s\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064"
                          r"\u2066-\u206f\ufeff]*")
_FIXED = ("source", "page", "custom_id")


def _guard(text: str) -> str:
    """text as a cell: without terminal control (NUL included, which some readers take for
    the end of the file) and with a leading ' when a spreadsheet would run it."""
    text = strip_controls(text)
    if text.startswith(_FORMULA_START):  # tab and CR are whitespace: checked as they are
        return "'" + text
    rest = text[_HIDES_START.match(text).end():]  # type: ignore[union-attr]
    return "'" + text if rest.startswith(_FORMULA_START) else text


def csv_cell(value: Any) -> str:
    """One cell: null empty, a string as it is (guarded: _guard), a number or boolean as
    JSON writes it, a nested object or array as its compact JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return _guard(value)
    return _guard(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _unique(names: Sequence[str], taken: set[str]) -> list[str]:
    """Column headers for the objects' fields: a field named like a fixed column (a schema
    with its own "source" or "error") becomes json.source, so no header repeats."""
    headers = []
    for name in names:
        header = name
        while header in taken:
            header = "json." + header
        taken.add(header)
        headers.append(header)
    return headers


def render_csv_jobs(views: Sequence[JobResults]) -> str:
    """Several jobs as one table: one header, the columns of every job's items."""
    rows = [(view.job.task == EXTRACT, r) for view in views for r in view.results]
    fields, whole, texts = _csv_columns(views, rows)
    tail = ["json"] * whole + ["text"] * texts + ["error"]
    headers = [*_FIXED, *_unique(fields, {*_FIXED, *tail}), *tail]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180: CRLF, quotes where needed
    writer.writerow([csv_cell(h) for h in headers])
    for extract, r in rows:
        writer.writerow([csv_cell(c) for c in _csv_row(extract, r, fields, whole, texts)])
    return out.getvalue()


def _csv_columns(views: Sequence[JobResults], rows: Sequence[tuple[bool, ItemResult]]
                 ) -> tuple[list[str], bool, bool]:
    """What the table needs columns for: (the extract objects' top-level fields in
    first-seen order, whether some object is not a JSON object (a top-level array: a json
    column), whether some job has text (a text column))."""
    fields: dict[str, None] = {}
    whole = False
    for extract, r in rows:
        if extract and isinstance(r.json, dict):
            fields.update(dict.fromkeys(r.json))
        elif extract and r.json is not None:
            whole = True
    texts = any(view.job.task != EXTRACT for view in views)
    return list(fields), whole, texts


def _csv_row(extract: bool, r: ItemResult, fields: Sequence[str], whole: bool,
             texts: bool) -> list[Any]:
    """One item's cells under _csv_columns' headers; a column the item has no value for is
    empty."""
    obj = r.json if extract and isinstance(r.json, dict) else {}
    cells: list[Any] = [r.source, r.page, r.custom_id, *(obj.get(f) for f in fields)]
    if whole:
        cells.append(r.json if extract and not isinstance(r.json, dict) else None)
    if texts:
        cells.append(None if extract else r.text)
    return [*cells, r.error]


@_format("csv", "text/csv", several_jobs=True, many=render_csv_jobs)
def render_csv(view: JobResults) -> str:
    """One row per item (source, page, custom_id, text, error); an extract job's rows
    hold its objects' fields, a column each, in place of text.

    The columns of an extract job are its objects' top-level fields in first-seen order.
    For spreadsheets: RFC 4180 quoting, UTF-8; a nested object or array is its compact
    JSON, null is empty, control characters are left out, and a cell that a spreadsheet
    would run as a formula (starting with = + - @ or their full-width forms, after any
    whitespace or zero-width characters, or with a tab or CR) gets a leading '. Several
    jobs make one table with one header.
    """
    return render_csv_jobs([view])


# --- an extract job's files for `vlmq export` -------------------------------------------------


def _pretty(value: Any) -> str:
    """Indented JSON with text as UTF-8; \\u escapes only where UTF-8 cannot carry the text
    (a lone surrogate from a model's \\ud800)."""
    out = json.dumps(value, indent=2, ensure_ascii=False)
    try:
        out.encode()
    except UnicodeEncodeError:
        out = json.dumps(value, indent=2)
    # JSON escapes C0 itself; DEL and C1 it writes raw with ensure_ascii off. Outside a
    # string JSON has none of them, so each is a string's character, written as \\u00XX.
    return _C1.sub(lambda m: f"\\u{ord(m.group()):04x}", out) + "\n"


_C1 = re.compile(r"[\x7f-\x9f]")


def extract_file(results: Sequence[ItemResult]) -> str:
    """An extract job's source as `<source>.json`: an image's object; a PDF's or TIFF's
    pages as an array in page order, each {"page": n, "json": object}, or {"page": n,
    "error": why} for a failed page, so the array keeps every page's place."""
    if results[0].page is None:
        return _pretty(results[0].json)
    pages = sorted(results, key=lambda r: (r.page or 0, r.index))
    return _pretty([{"page": p.page, "json": p.json} if p.ok
                    else {"page": p.page, "error": p.error or "failed"} for p in pages])


# --- openai-batch: the OpenAI Batch output file -------------------------------------------

# vlmq's finish reasons as OpenAI's: the repetition guard cuts a looping answer before the
# model ended it, as max_tokens does, so both are "length"; a failed item ("error") is an
# error line, never a choice.
OPENAI_FINISH = {"stop": "stop", "length": "length", "repetition": "length"}
# A job's items that never ran, by how the job ended: OpenAI's error code and why.
_NOT_RUN = {"canceled": "batch_cancelled", "stopped": "batch_cancelled"}
# One output line: (its place in the input, whether it is a 200, the line).
Entry = tuple[int, bool, str]


def _epoch(value: bytes | str | None) -> int | None:
    """An RQ or payload ISO timestamp as Unix seconds (None: missing or unreadable)."""
    if value is None:
        return None
    try:
        return int(datetime.fromisoformat(as_str(value).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


def _openai_context(view: JobResults, payload: JobPayload, asked: str | None
                    ) -> tuple[str, dict[int, int], int]:
    """(model, finish time by item index, the job's own time) for a job's lines.

    The model is the one its worker served (its live stats, while they last), else the
    job's model setting, else the name the file's lines asked for (`asked`). An item's
    time is its result event's (the stream id is Redis's clock in ms); the job's end,
    start or enqueue time stands in for one trimmed away.
    """
    job, redis, keys = view.job, view.job.client.redis, view.job.client.keys
    worker, ended, started, enqueued = redis.hmget(
        Keys.rq_job(job.id), ["worker_name", "ended_at", "started_at", "enqueued_at"])
    served = redis.hget(keys.worker_stats(as_str(worker)), "model") if worker else None
    model = as_str(served) if served else str(payload.get("model") or asked or "unknown")
    times: dict[int, int] = {}
    entries: Any = redis.xrange(keys.job_events(job.id))
    for entry_id, fields in entries:
        event = {as_str(k): as_str(v) for k, v in fields.items()}
        if event.get("type") == "item" and event.get("index", "").isdigit():
            times[int(event["index"])] = int(as_str(entry_id).split("-")[0]) // 1000
    when = next((t for t in map(_epoch, (ended, started, enqueued, payload.created_at))
                 if t is not None), 0)
    return model, times, when


def cut_answer(r: ItemResult) -> bool:
    """A failed item that is an answer cut at the token limit: an extract's unfinished
    JSON, kept in model_text. vlmq's own formats keep it failed (never valid JSON);
    OpenAI's answers it with status 200 and finish_reason length, as OpenAI does."""
    return (not r.ok and r.model_text is not None and r.text_source != TEXT_FROM_LAYER
            and r.finish_reason in ("length", "repetition"))


def _completion(key: str, r: ItemResult, model: str, created: int) -> dict[str, Any]:
    """An item's answer as OpenAI's chat.completion object."""
    content = r.text if r.ok else r.model_text
    return {"id": f"chatcmpl-{key}", "object": "chat.completion", "created": created,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content or "",
                                                 "refusal": None},
                         "logprobs": None,
                         "finish_reason": OPENAI_FINISH.get(r.finish_reason or "", "stop")}],
            "usage": {"prompt_tokens": r.prompt_tokens,
                      "completion_tokens": r.completion_tokens,
                      "total_tokens": r.prompt_tokens + r.completion_tokens}}


def _not_run(view: JobResults) -> tuple[str, str] | None:
    """OpenAI's error code and why, for the items of an ended job that never ran."""
    if view.error is not None:
        return "batch_failed", f"not run: the job failed: {last_line(view.error)}"
    if view.state in _NOT_RUN:
        return _NOT_RUN[view.state], f"not run: the job was {view.state}"
    return None


def _response(key: str, r: ItemResult, model: str, created: int) -> tuple[bool, dict[str, Any]]:
    if r.ok or cut_answer(r):
        return True, {"status_code": 200, "request_id": f"req_{key}",
                      "body": _completion(key, r, model, created)}
    return False, {"status_code": 500, "request_id": f"req_{key}", "body": {"error": {
        "message": r.error, "type": "server_error", "param": None, "code": "item_failed"}}}


def openai_entries(view: JobResults, lines: Sequence[int] | None = None,
                   asked: str | None = None) -> Iterator[Entry]:
    """A job's lines as OpenAI's Batch output and error files hold them, in item order,
    each with its input line number (`lines`, by item index; without them the index).
    Ids are built from the job id and item index, so a rerender gives the same bytes.

    An answer is status 200 with a chat.completion body, a cut one too (finish_reason
    length: cut_answer). A failed item is the error file's form of a request that ran and
    failed: status 500 and an {"error"} body. An item that never ran, of a failed or
    canceled job, has no response and an error with OpenAI's code (batch_cancelled;
    batch_failed for a failed job). Items still to run in a job that has not ended are
    left out (`vlmq result` says the output is partial). An item enqueued without a
    custom_id gets its source (and #page=N) as one.
    """
    job = view.job
    payload = job.payload()
    model, times, when = _openai_context(view, payload, asked)
    done = {r.index: r for r in view.results}
    not_run = _not_run(view)
    for index, item in enumerate(payload.items):
        key = f"{job.id}_{index}"
        place = lines[index] if lines is not None and index < len(lines) else index
        head = {"id": f"batch_req_{key}", "custom_id": item.custom_id or (
            item.source if item.page is None else f"{item.source}#page={item.page}")}
        r = done.get(index)
        if r is None:
            if not_run is not None:
                yield place, False, json.dumps({**head, "response": None, "error": {
                    "code": not_run[0], "message": not_run[1]}}) + "\n"
            continue
        ok, response = _response(key, r, model, times.get(index, when))
        yield place, ok, json.dumps({**head, "response": response, "error": None}) + "\n"


def openai_lines(view: JobResults) -> list[tuple[bool, str]]:
    """(ok, line) per item of one job, in item order (openai_entries)."""
    return [(ok, line) for _, ok, line in openai_entries(view)]


def skipped_entries(batch_id: str, record: FileRecord) -> Iterator[Entry]:
    """The lines --skip-bad left out, as error lines with OpenAI's BatchError fields."""
    for s in record.skipped:
        yield s.line, False, json.dumps({
            "id": f"batch_req_{batch_id}_line{s.line}", "custom_id": s.custom_id,
            "response": None, "error": {"code": "invalid_request", "message": s.reason,
                                        "param": s.param, "line": s.line}}) + "\n"


def _by_batch(views: Sequence[JobResults]) -> list[tuple[str | None, list[JobResults]]]:
    """The views grouped by the batch each job is in (None: none), in first-seen order."""
    if not views:
        return []
    pipe = views[0].job.client.redis.pipeline(transaction=False)
    for view in views:
        pipe.get(view.job.client.keys.job_batch(view.job.id))
    groups: dict[str | None, list[JobResults]] = {}
    for view, batch in zip(views, pipe.execute(), strict=True):
        groups.setdefault(as_str(batch) if batch else None, []).append(view)
    return list(groups.items())


def openai_output(views: Sequence[JobResults]) -> Iterator[tuple[bool, str]]:
    """(ok, line) for jobs' OpenAI Batch output, each batch made from a file in the file's
    order (its FileRecord: the lines of each job, merged), the lines --skip-bad left out
    in their places when every job of the batch is here. Other jobs follow item order.
    Each job's lines are read once; the merge holds one line per job at a time."""
    from vlmq.producer.openai_files import FileRecord

    for batch_id, group in _by_batch(views):
        client = group[0].job.client
        record = None if batch_id is None else FileRecord.read(client.redis, client.keys,
                                                               batch_id)
        if record is None or batch_id is None:
            for view in group:
                yield from ((ok, line) for _, ok, line in openai_entries(view))
            continue
        streams: list[Iterator[Entry]] = []
        for view in group:
            lines, asked = record.jobs.get(view.job.id, (None, None))
            streams.append(openai_entries(view, lines, asked))
        if set(record.jobs) <= {v.job.id for v in group}:
            streams.append(skipped_entries(batch_id, record))
        yield from ((ok, line) for _, ok, line in heapq.merge(*streams, key=lambda e: e[0]))


def openai_split_jobs(views: Sequence[JobResults]) -> tuple[str, str]:
    """(output file, error file) in input order, as OpenAI splits them."""
    ok_lines: list[str] = []
    bad_lines: list[str] = []
    for ok, line in openai_output(views):
        (ok_lines if ok else bad_lines).append(line)
    return "".join(ok_lines), "".join(bad_lines)


def openai_split(view: JobResults) -> tuple[str, str]:
    return openai_split_jobs([view])


def render_openai_jobs(views: Sequence[JobResults]) -> str:
    return "".join(line for _, line in openai_output(views))


@_format("openai-batch", "application/x-ndjson", several_jobs=True, split=openai_split,
         many=render_openai_jobs, split_many=openai_split_jobs)
def render_openai_batch(view: JobResults) -> str:
    """One OpenAI Batch output line per request: its custom_id and a chat.completion.

    The format OpenAI's Batch API and vLLM's run-batch write (id, custom_id, response
    {status_code, request_id, body}, error), in the input file's order, a line skipped at
    enqueue included as an error; with --errors FILE the failed requests go there, the way
    OpenAI splits its output and error files.
    """
    return render_openai_jobs([view])
