"""OpenAI Batch input files: each line a chat request, read as a manifest line.

A line is {"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}, the
format OpenAI's Batch API and vLLM's `run-batch` read. Each request becomes one item of a
manifest Request (producer/manifest.py), so checking every line before anything is
written, grouping by task and settings, custom_id echo, --skip-bad and errors by line and
field are the manifest's own. The output side is the `openai-batch` format
(producer/ops/output_formats.py).

The mapping, and why:
- One request is one item: one image (an `image_url` part, or a `file` part's
  `file_data`), of one page, or none: a text-only request is a text item (its prompt
  alone, no image: shared/PROTOCOL.md). Several images would need one answer per several
  items, so a second one is refused.
- The text of every system, developer and user message, in order and a blank line apart,
  is the prompt: vlmq sends the model one prompt with the image. Assistant turns (a
  conversation) are refused rather than flattened into something the model never saw.
- No `response_format` (or type text) is task generate, with that prompt. `json_schema`
  is task extract with its schema (vlmq always enforces it, so `strict` changes nothing);
  `json_object` is extract with {"type": "object"}: any JSON object.
- `model` (OpenAI requires it on every line) is recorded, not enforced: a queue's
  workers serve whatever model they serve, so a file written for gpt-4o-mini runs as it
  is. ModelPolicy changes that: `strict` makes the name the job's model setting (a worker
  serving another fails the job naming both, as vLLM refuses a model it does not serve),
  and a mapping (`--model-map NAME=CHECKPOINT`) turns a name into the checkpoint the
  workers must serve. Lines asking for different names never share a job, so each job
  records one name.
- Images come inline (`data:` URIs, base64) or from `file://` paths (relative to the
  batch file's folder, or absolute; a path under a configured store goes by reference).
  An http(s) URL is refused: vlmq never fetches from the web. A data: image is written
  to a spool folder and checked by content like any file (producer/files.py).
- Fields that change the answer and that vlmq cannot honour (n > 1, tools, logprobs...)
  are refused naming them; bookkeeping fields (user, metadata, store...) are ignored.
  Sampling knobs vlmq's batched sampler has no per-row place for (seed, top_p, the
  penalties) are checked and not applied, so a file written with them still runs: at
  temperature 0 (greedy) seed and top_p change nothing; the penalties' repetition control
  is the worker's repetition guard's (docs/openai-batch.md says so).
- The file's order and its skipped lines are kept with the batch (FileRecord, in the
  batch's record), so the output can give every input line one line, in input order.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from vlmq.producer.job_sets import JOB_ITEMS, Batch, Part, submit_parts
from vlmq.producer.manifest import (
    Group,
    Request,
    check_custom_id,
    line_object,
    read_manifest,
)
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.keys import Keys

if TYPE_CHECKING:
    from vlmq.producer.client import Client
    from vlmq.stores.backends import Stores

URL = "/v1/chat/completions"
LINE_FIELDS = ("custom_id", "method", "url", "body")
RESPONSES_URL = "/v1/responses"
BODY_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature",
               "stop", "response_format")
# Checked, and not applied (the module's docstring says why): name -> (type, low, high),
# OpenAI's own ranges (a seed is an int64).
NOT_APPLIED: Mapping[str, tuple[type, float, float]] = {
    "seed": (int, -2**63, 2**63 - 1), "top_p": (float, 0.0, 1.0),
    "presence_penalty": (float, -2.0, 2.0), "frequency_penalty": (float, -2.0, 2.0)}
# Accepted only at their OpenAI default: any other value asks for what vlmq does not do.
DEFAULT_ONLY: Mapping[str, Any] = {"n": 1, "stream": False, "logprobs": False,
                                   "top_logprobs": 0, "logit_bias": {},
                                   "modalities": ["text"], "tools": [], "tool_choice": "none",
                                   "stream_options": None}
# Bookkeeping that does not change the answer: accepted and ignored.
# parallel_tool_calls means nothing without tools; reasoning_effort and verbosity are
# knobs of reasoning models, which vlmq's are not.
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key", "parallel_tool_calls", "reasoning_effort", "verbosity")
ROLES = ("system", "developer", "user")
MESSAGE_FIELDS = ("role", "content", "name")
IMAGE_FIELDS = ("url", "detail")
# vlmq sizes every image by the job's max_side; `detail` is checked and not applied.
DETAILS = ("auto", "low", "high")
SCHEMA_FIELDS = ("name", "schema", "strict", "description")
# A line carries its image inline: room for a blob-sized image in base64, and the rest.
MAX_LINE_BYTES = C.BLOB_MAX_BYTES * 4 // 3 + 1024 * 1024
WEB_REFUSED = ("http(s) URLs are refused: vlmq never fetches from the web; download it "
               "and use a file:// path")
MAX_MODEL_NAME = 256
# OpenAI's limit on one batch input file ("up to 50,000 requests", its batches.create
# reference): a longer file is refused at its first request over, the rest unread.
MAX_REQUESTS = 50_000
# A value quoted in an error is cut to this many characters: a line may be 86 MiB.
SHOWN_CHARS = 100
_SUBTYPE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,30}")


@dataclass(frozen=True)
class ModelPolicy:
    """How a line's `model` becomes the job's model setting (the module's docstring)."""

    strict: bool = False
    mapping: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, pairs: Iterable[str], *, strict: bool = False) -> ModelPolicy:
        """From `NAME=CHECKPOINT` pairs (--model-map); PayloadError names a bad one."""
        mapping: dict[str, str] = {}
        for pair in pairs:
            name, sep, checkpoint = pair.partition("=")
            if not sep or not name or not checkpoint:
                raise PayloadError("model_map", f"{pair!r} is not NAME=CHECKPOINT")
            mapping[name] = S.BY_NAME["model"].check(checkpoint, "model_map")
        return cls(strict, mapping)

    def setting(self, name: str | None) -> str | None:
        """The model a worker must serve for a line asking for `name` (None: any)."""
        if name is None:
            return None
        if name in self.mapping:
            return self.mapping[name]
        return name if self.strict else None


@dataclass(frozen=True)
class Skipped:
    """A line --skip-bad left out: the error file gives it a line of its own."""

    line: int
    custom_id: str | None
    param: str | None  # the field at fault, as OpenAI's BatchError names it
    reason: str


@dataclass
class BatchFile:
    """A read batch file: the jobs to enqueue, the lines skipped, and what the output
    needs to put every line back in its place (each custom_id's line, each line's model
    name)."""

    groups: list[Group]
    skipped: list[Skipped]
    lines: dict[str, int]  # custom_id -> line number, of the lines enqueued
    models: dict[int, str]  # line number -> the model its line named

    @property
    def rejected(self) -> list[tuple[int, str]]:
        return [(s.line, s.reason) for s in self.skipped]


# A skipped line's record is bounded: a file with more bad lines than this is refused
# whole (fix it), and a reason is kept to this many characters.
MAX_SKIPPED = 10_000
MAX_REASON_CHARS = 1000
_PARAM = re.compile(r"field '([^']*)' ")


def read_batch_file(path: str | Path, base: JobOptions, *, spool: Path,
                    skip_bad: bool = False, job_size: int = JOB_ITEMS,
                    models: ModelPolicy | None = None, paths: bool = True) -> BatchFile:
    """read_manifest for an OpenAI Batch file, streamed line by line (a data: image goes
    to `spool`, a folder the caller removes after the enqueue, never into memory twice).
    paths=False refuses file:// images: `vlmq api` reads files its callers uploaded,
    whose paths would name the server's own files."""
    batch = Path(path)
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    parse = functools.partial(parse_request, folder=batch.parent if paths else None,
                              spool=spool,
                              models=models or ModelPolicy(), ids=ids, names=names)
    groups, rejected = read_manifest(batch, base, skip_bad=skip_bad, job_size=job_size,
                                     parse=parse, max_line_bytes=MAX_LINE_BYTES,
                                     max_requests=MAX_REQUESTS)
    if len(rejected) > MAX_SKIPPED:
        raise InputError(str(batch), f"{len(rejected)} bad lines, more than the "
                                     f"{MAX_SKIPPED} --skip-bad keeps a record of; fix the "
                                     f"file (the first: line {rejected[0][0]}: "
                                     f"{rejected[0][1]})")
    bad = {n for n, _ in rejected}
    skipped = [Skipped(n, ids.get(n), param_of(why), why[:MAX_REASON_CHARS])
               for n, why in rejected]
    lines = {cid: n for n, cid in ids.items() if n not in bad}
    return BatchFile(groups, skipped, lines, {n: v for n, v in names.items() if n not in bad})


def param_of(reason: str) -> str | None:
    """The field a line's refusal names (OpenAI's BatchError `param`), if any."""
    found = _PARAM.match(reason)
    return found[1] if found else None


def read_openai_batch(path: str | Path, base: JobOptions, *, spool: Path,
                      skip_bad: bool = False, job_size: int = JOB_ITEMS,
                      models: ModelPolicy | None = None
                      ) -> tuple[list[Group], list[tuple[int, str]]]:
    """read_batch_file as read_manifest answers: (jobs, rejected lines)."""
    read = read_batch_file(path, base, spool=spool, skip_bad=skip_bad, job_size=job_size,
                           models=models)
    return read.groups, read.rejected


def parse_request(number: int, text: str, *, folder: Path | None, spool: Path,
                  models: ModelPolicy | None = None, ids: dict[int, str] | None = None,
                  names: dict[int, str] | None = None) -> Request:
    """One line as a manifest Request; PayloadError names the field (body.messages[0]...).
    `ids` and `names` collect each line's custom_id and model name as soon as they are
    read, so a line refused later still has its custom_id in the error file."""
    def note_id(raw: dict[str, Any]) -> None:
        value = raw.get("custom_id")
        if ids is not None and isinstance(value, str) \
                and 0 < len(value) <= C.MAX_CUSTOM_ID_CHARS:
            ids[number] = value

    raw = line_object(text, LINE_FIELDS, (), first=note_id)
    for name in LINE_FIELDS:
        if name not in raw:
            raise PayloadError(name, "is required")
    custom_id = check_custom_id(raw["custom_id"])
    if raw["method"] != "POST":
        raise PayloadError("method", f'must be "POST", got {_shown(raw["method"])}')
    _check_url(raw["url"])
    body = raw["body"]
    if not isinstance(body, dict):
        raise PayloadError("body", f"must be an object, got {type(body).__name__}")
    _check_body_fields(body)
    task, schema = task_of(body.get("response_format"))
    prompt, image = _messages(body.get("messages"), task)
    model_name = model_name_of(body.get("model"))
    if names is not None and model_name is not None:
        names[number] = model_name
    wanted = (models or ModelPolicy()).setting(model_name)
    settings = {
        "prompt": S.BY_NAME["prompt"].check(prompt or None, "body.messages"),
        "schema": schema,
        "model": S.BY_NAME["model"].check(wanted, "body.model"),
        "max_tokens": max_tokens_of(body),
        "temperature": S.BY_NAME["temperature"].check(body.get("temperature"),
                                                      "body.temperature"),
        "stop": stop_of(body.get("stop")),
    }
    file, source, field_name = _item_input(image, number, folder, spool)
    return Request(line=number, custom_id=custom_id, task=task, file=file, pages=None,
                   settings={k: v for k, v in settings.items() if v is not None},
                   source=source, field=field_name, one_item=True,
                   group=() if wanted is not None else (model_name,))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _check_url(url: Any) -> None:
    if url == URL:
        return
    if url == RESPONSES_URL:
        raise PayloadError("url", f'"{RESPONSES_URL}" (the Responses API) is not served: '
                                  f'vlmq serves "{URL}"; write the request as a chat '
                                  "completion (messages, response_format)")
    raise PayloadError("url", f'must be "{URL}" (vlmq serves chat completions), got '
                              f"{_shown(url)}")


def model_name_of(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_MODEL_NAME:
        raise PayloadError("body.model", f"must be a model name of 1 to {MAX_MODEL_NAME} "
                                         "characters")
    return value


def _check_body_fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name in BODY_FIELDS or name in IGNORED:
            continue
        if name in NOT_APPLIED:
            check_number(f"body.{name}", value, NOT_APPLIED[name])
            continue
        if name in DEFAULT_ONLY:
            default = DEFAULT_ONLY[name]
            if value is None or (value == default
                                 and isinstance(value, bool) == isinstance(default, bool)):
                continue
            raise PayloadError(f"body.{name}", f"is not supported by vlmq: only "
                                               f"{json.dumps(default)} (its default)")
        raise PayloadError(f"body.{name}", f"is not supported by vlmq (it reads "
                                           f"{', '.join(BODY_FIELDS)}; it ignores "
                                           f"{', '.join(IGNORED)})")


def check_number(where: str, value: Any, bounds: tuple[type, float, float]) -> None:
    """A knob that is not applied must still be what OpenAI would take."""
    if value is None:
        return
    kind, low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        raise PayloadError(where, f"must be {'an integer' if kind is int else 'a number'}")
    if not low <= value <= high:
        shown = (f"{low} and {high}" if kind is int else f"{low:g} and {high:g}")
        raise PayloadError(where, f"must be between {shown}, got {value}")


def task_of(value: Any) -> tuple[str, dict[str, Any] | None]:
    """(task, schema) from response_format: generate, or extract with a schema."""
    where = "body.response_format"
    if value is None:
        return "generate", None
    if not isinstance(value, dict):
        raise PayloadError(where, f"must be an object, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return "generate", None
    if kind == "json_object":
        return "extract", {"type": "object"}
    if kind != "json_schema":
        raise PayloadError(f"{where}.type", f'must be "text", "json_object" or '
                                            f'"json_schema", got {_shown(kind)}')
    spec = value.get("json_schema")
    where = f"{where}.json_schema"
    if not isinstance(spec, dict):
        raise PayloadError(where, "must be an object with the schema: {\"name\", \"schema\"}")
    unknown = sorted(set(spec) - set(SCHEMA_FIELDS))
    if unknown:
        raise PayloadError(f"{where}.{unknown[0]}", f"unknown field (allowed: "
                                                    f"{', '.join(SCHEMA_FIELDS)})")
    for name, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(name) is not None and not isinstance(spec[name], kinds):
            raise PayloadError(f"{where}.{name}", f"must be a {kinds.__name__}")
    if spec.get("schema") is None:
        raise PayloadError(f"{where}.schema", "is required: vlmq's extract task decodes to "
                                              "a schema")
    schema: dict[str, Any] = S.BY_NAME["schema"].check(spec["schema"], f"{where}.schema")
    return "extract", schema


def _item_input(image: tuple[str, str] | None, number: int, folder: Path | None, spool: Path
                ) -> tuple[Path | None, str | None, str]:
    """(file, source, field) of the line's item: its image, or none for a text item."""
    if image is None:
        return None, f"text-line{number}", "body.messages"
    file, source = _input(image[1], image[0], number, folder, spool)
    return file, source, image[0]


def _messages(value: Any, task: str) -> tuple[str, tuple[str, str] | None]:
    """(prompt, (field, url)): the messages' text a blank line apart, and the one image
    (None: a text-only request)."""
    if not isinstance(value, list) or not value:
        raise PayloadError("body.messages", "must be a non-empty list of messages")
    texts: list[str] = []
    image: tuple[str, str] | None = None
    for i, msg in enumerate(value):
        where = f"body.messages[{i}]"
        role, content = _message(msg, where)
        for text, ref in content_parts(content, where, role):
            if text is not None:
                texts.append(text)
            elif ref is not None:
                if image is not None:
                    raise PayloadError(ref[0], f"is a second image; a request takes one "
                                               f"(the first is {image[0]})")
                image = ref
    prompt = "\n\n".join(t for t in texts if t.strip())
    if not prompt and (task == "generate" or image is None):
        raise PayloadError("body.messages", "has no text: a request without an image, or "
                                            "without a json_schema response_format (task "
                                            "generate), needs a prompt")
    return prompt, image


def _message(msg: Any, where: str) -> tuple[str, Any]:
    """(role, content) of a message with only the fields and roles of one prompt."""
    if not isinstance(msg, dict):
        raise PayloadError(where, f"must be an object, got {type(msg).__name__}")
    unknown = sorted(set(msg) - set(MESSAGE_FIELDS))
    if unknown:
        raise PayloadError(f"{where}.{unknown[0]}", "is not supported by vlmq")
    role = msg.get("role")
    if role not in ROLES:
        raise PayloadError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got "
                                            f"{_shown(role)} (vlmq sends one prompt, not a "
                                            "conversation)")
    return role, msg.get("content")


def content_parts(content: Any, where: str, role: str
           ) -> Iterator[tuple[str | None, tuple[str, str] | None]]:
    """A message's content as parts, checked one at a time in order (a string is one text
    part), so the first problem in the file is the one reported."""
    if isinstance(content, str):
        yield content, None
        return
    if not isinstance(content, list):
        raise PayloadError(f"{where}.content", "must be a string or a list of parts")
    for j, part in enumerate(content):
        yield _part(part, f"{where}.content[{j}]", role)


def _part(part: Any, where: str, role: str) -> tuple[str | None, tuple[str, str] | None]:
    """A content part: (text, None) or (None, (field, url))."""
    if not isinstance(part, dict):
        raise PayloadError(where, f"must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise PayloadError(f"{where}.text", "must be a string")
        return text, None
    if kind not in ("image_url", "file"):
        raise PayloadError(f"{where}.type", f'must be "text", "image_url" or "file", '
                                            f"got {_shown(kind)}")
    if role != "user":
        raise PayloadError(where, f"is an image in a {role} message; images go in user "
                                  "messages")
    if kind == "image_url":
        inner = part.get("image_url")
        if not isinstance(inner, dict) or not isinstance(inner.get("url"), str):
            raise PayloadError(f"{where}.image_url", 'must be {"url": "data:..." or '
                                                     '"file://..."}')
        _check_image(inner, f"{where}.image_url")
        return None, (f"{where}.image_url.url", inner["url"])
    inner = part.get("file")
    if not isinstance(inner, dict):
        raise PayloadError(f"{where}.file", 'must be {"file_data": "data:..."}')
    if "file_id" in inner:
        raise PayloadError(f"{where}.file.file_id", "uploaded files are not read as a "
                                                    "request's input: inline the file as "
                                                    "file_data (a data: URI)")
    if not isinstance(inner.get("file_data"), str):
        raise PayloadError(f"{where}.file.file_data", "must be a data: URI")
    return None, (f"{where}.file.file_data", inner["file_data"])


def _check_image(inner: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(inner) - set(IMAGE_FIELDS))
    if unknown:
        raise PayloadError(f"{where}.{unknown[0]}", f"unknown field (allowed: "
                                                    f"{', '.join(IMAGE_FIELDS)})")
    detail = inner.get("detail")
    if detail is not None and detail not in DETAILS:
        raise PayloadError(f"{where}.detail", f"must be one of {', '.join(DETAILS)}, got "
                                              f"{_shown(detail)}")


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    given = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
    if len(given) > 1:
        raise PayloadError("body.max_completion_tokens", "give max_tokens or "
                                                         "max_completion_tokens, not both")
    if not given:
        return None
    value: int = S.BY_NAME["max_tokens"].check(body[given[0]], f"body.{given[0]}")
    return value


def stop_of(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    listed = [value] if isinstance(value, str) else value
    stop: tuple[str, ...] = S.BY_NAME["stop"].check(listed, "body.stop")
    return stop


def _input(url: str, field: str, number: int, folder: Path | None, spool: Path
           ) -> tuple[Path, str | None]:
    """The image's file, and its item source (None: the path itself). No folder: file://
    paths are refused (read_batch_file's paths=False)."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise PayloadError(field, WEB_REFUSED)
    if scheme.startswith("data:"):
        return _spooled(url, field, number, spool)
    if scheme.startswith("file://"):
        if folder is None:
            raise PayloadError(field, "file:// paths are refused here: inline the image "
                                      "as a data: URI")
        name = unquote(url[len("file://"):])
        if name.startswith("localhost/"):
            name = name[len("localhost"):]
        if not name:
            raise PayloadError(field, "names no file")
        path = Path(name)
        return (path if path.is_absolute() else folder / path), None
    raise PayloadError(field, "must be a data: URI (base64) or a file:// path; vlmq never "
                              "fetches from the web")


def _spooled(url: str, field: str, number: int, spool: Path) -> tuple[Path, str]:
    """A data: URI's bytes in the spool, named by their hash (the same image on many
    lines is one file, one upload); its source names the line."""
    data, mime = data_uri_bytes(url, field)
    path = spool / sha256_hex(data)
    try:
        if not path.exists():
            path.write_bytes(data)
    except OSError as exc:
        raise InputError(str(spool), f"cannot spool a data: image: "
                                     f"{exc.strerror or exc}") from exc
    suffix = "pdf" if mime == "application/pdf" else mime.partition("/")[2]
    return path, f"data-line{number}.{suffix}"


def data_uri_bytes(url: str, field: str) -> tuple[bytes, str]:
    """(bytes, media type) of a base64 data: URI of an image or a PDF; PayloadError
    naming `field` for anything else."""
    head, comma, encoded = url.partition(",")
    if not comma:
        raise PayloadError(field, "is not a data: URI (no comma before the data)")
    mime, *params = (p.strip().lower() for p in head[len("data:"):].split(";"))
    if "base64" not in params:
        raise PayloadError(field, "must be base64-encoded (data:image/png;base64,...)")
    kind, _, subtype = mime.partition("/")
    if not ((kind == "image" and _SUBTYPE.fullmatch(subtype)) or mime == "application/pdf"):
        raise PayloadError(field, f"is a data: URI of {_shown(mime or 'no media type')}; give an "
                                  "image (image/png, image/jpeg...) or a PDF "
                                  "(application/pdf)")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(field, f"is not valid base64 ({exc})") from None
    if not data:
        raise PayloadError(field, "holds no data")
    return data, mime


# --- the file's record, kept with its batch ---------------------------------------------------

# Fields of the batch's record (shared/keys.py: batch) that an OpenAI batch file adds:
# how many lines it had, the lines --skip-bad left out, and each job's lines.
RECORD_LINES = "openai:lines"
RECORD_SKIPPED = "openai:skipped"
RECORD_JOBS = "openai:jobs"
RECORD_FIELDS = (RECORD_LINES, RECORD_SKIPPED, RECORD_JOBS)


@dataclass(frozen=True)
class FileRecord:
    """What the output needs of the input file, so every line gets one output line in
    input order: each job's items' line numbers (in item order), the model name each job's
    lines asked for, and the skipped lines. Line numbers are kept as ranges ("1-40,52"),
    a few bytes for a file whose lines share settings."""

    lines: int
    skipped: tuple[Skipped, ...]
    jobs: Mapping[str, tuple[tuple[int, ...], str | None]]  # job id -> (lines, model)

    def fields(self) -> dict[str, str]:
        return {RECORD_LINES: str(self.lines),
                RECORD_SKIPPED: json.dumps([[s.line, s.custom_id, s.param, s.reason]
                                            for s in self.skipped]),
                RECORD_JOBS: json.dumps({job: [ranges(lines), model]
                                         for job, (lines, model) in self.jobs.items()})}

    @classmethod
    def read(cls, redis: Any, keys: Keys, batch_id: str) -> FileRecord | None:
        """The batch's file record; None for a batch made another way (or gone)."""
        count, skipped, jobs = redis.hmget(keys.batch(batch_id), RECORD_FIELDS)
        if count is None or jobs is None:
            return None
        return cls(int(count), tuple(Skipped(int(n), cid, param, why) for n, cid, param, why
                                     in json.loads(skipped or "[]")),
                   {job: (tuple(unranges(spans)), model)
                    for job, (spans, model) in json.loads(jobs).items()})

    @classmethod
    def of(cls, read: BatchFile, parts: Sequence[Part], job_ids: Sequence[str]) -> FileRecord:
        """The record of `read` enqueued as `parts` (the final ones, after any budget cut)
        under `job_ids`."""
        jobs: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for part, job_id in zip(parts, job_ids, strict=True):
            lines = tuple(read.lines[i.custom_id or ""] for i in part.prepared.items)
            jobs[job_id] = (lines, read.models.get(lines[0]) if lines else None)
        return cls(len(read.lines) + len(read.skipped), tuple(read.skipped), jobs)


def ranges(numbers: Iterable[int]) -> str:
    """Ascending runs as "1-3,7"; numbers out of order are runs of their own."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def unranges(text: str) -> Iterator[int]:
    for span in filter(None, text.split(",")):
        first, _, last = span.partition("-")
        yield from range(int(first), int(last or first) + 1)


def submit_batch_file(client: Client, read: BatchFile, *,
                      labels: Mapping[str, str] | None = None,
                      stores: Stores | None = None) -> Batch:
    """Enqueue a read file as a batch (always one, even of one job: its record holds the
    file's order and skipped lines), its files in a store going by reference."""
    stores = stores if stores is not None else client.stores
    parts = [Part(g.task, g.prepared.by_reference(stores), g.options) for g in read.groups]
    made = submit_parts(client, parts, labels=labels, batch=True,
                        record=lambda final, ids: FileRecord.of(read, final, ids).fields())
    assert isinstance(made, Batch)  # batch=True
    return made


def submit_openai_batch(client: Client, path: str | Path, *,
                        options: JobOptions | None = None,
                        labels: Mapping[str, str] | None = None, skip_bad: bool = False,
                        job_size: int = JOB_ITEMS, models: ModelPolicy | None = None,
                        stores: Stores | None = None) -> tuple[Batch, list[Skipped]]:
    """Read and enqueue an OpenAI Batch input file: the Python path of `vlmq enqueue
    --openai-batch` (the batch, and the lines skipped). `options` holds what every job
    shares (a queue); the file's lines add theirs."""
    base = options if options is not None else JobOptions.build(labels=labels or None)
    with tempfile.TemporaryDirectory(prefix="vlmq-batch-") as spool:
        read = read_batch_file(path, base, spool=Path(spool), skip_bad=skip_bad,
                               job_size=job_size, models=models)
        return submit_batch_file(client, read, labels=labels, stores=stores), read.skipped
