"""OpenAI Batch input files: each line a chat request, read as a manifest line.

A line is {"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}, the
format OpenAI's Batch API and vLLM's `run-batch` read. Each request becomes one item of a
manifest Request (producer/manifest.py), so checking every line before anything is
written, grouping by task and settings, custom_id echo, --skip-bad and errors by line and
field are the manifest's own. The output side is the `openai-batch` format
(producer/ops/output_formats.py).

The mapping, and why:
- One request is one item: exactly one image (an `image_url` part, or a `file` part's
  `file_data`), of one page. vlmq's items are images and pages; a text-only request has
  nothing to run on, and several images would need one answer per several items.
- The text of every system, developer and user message, in order and a blank line apart,
  is the prompt: vlmq sends the model one prompt with the image. Assistant turns (a
  conversation) are refused rather than flattened into something the model never saw.
- No `response_format` (or type text) is task generate, with that prompt. `json_schema`
  is task extract with its schema (vlmq always enforces it, so `strict` changes nothing);
  `json_object` is extract with {"type": "object"}: any JSON object.
- `model` is the model the worker must serve (vlmq's model setting): a worker serving
  another fails the job naming both, as vLLM refuses a request for a model it does not
  serve. Leave it out to let any worker take the request.
- Images come inline (`data:` URIs, base64) or from `file://` paths (relative to the
  batch file's folder, or absolute; a path under a configured store goes by reference).
  An http(s) URL is refused: vlmq never fetches from the web. A data: image is written
  to a spool folder and checked by content like any file (producer/files.py).
- Fields that change the answer and that vlmq cannot honour (n > 1, top_p, seed, tools,
  logprobs...) are refused naming them; bookkeeping fields (user, metadata, store...)
  are ignored.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from vlmq.producer.job_sets import JOB_ITEMS
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

URL = "/v1/chat/completions"
LINE_FIELDS = ("custom_id", "method", "url", "body")
BODY_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature",
               "stop", "response_format")
# Accepted only at their OpenAI default: any other value asks for what vlmq does not do.
DEFAULT_ONLY: Mapping[str, Any] = {"n": 1, "stream": False, "logprobs": False, "top_p": 1,
                                   "presence_penalty": 0, "frequency_penalty": 0}
# Bookkeeping that does not change the answer: accepted and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key")
ROLES = ("system", "developer", "user")
MESSAGE_FIELDS = ("role", "content", "name")
SCHEMA_FIELDS = ("name", "schema", "strict", "description")
# A line carries its image inline: room for a blob-sized image in base64, and the rest.
MAX_LINE_BYTES = C.BLOB_MAX_BYTES * 4 // 3 + 1024 * 1024
WEB_REFUSED = ("http(s) URLs are refused: vlmq never fetches from the web; download it "
               "and use a file:// path")
_SUBTYPE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,30}")


def read_openai_batch(path: str | Path, base: JobOptions, *, spool: Path,
                      skip_bad: bool = False, job_size: int = JOB_ITEMS
                      ) -> tuple[list[Group], list[tuple[int, str]]]:
    """read_manifest for an OpenAI Batch file. `spool` is a folder that holds the data:
    images until they are uploaded (the caller removes it after the enqueue)."""
    batch = Path(path)
    parse = functools.partial(parse_request, folder=batch.parent, spool=spool)
    return read_manifest(batch, base, skip_bad=skip_bad, job_size=job_size, parse=parse,
                         max_line_bytes=MAX_LINE_BYTES)


def parse_request(number: int, text: str, *, folder: Path, spool: Path) -> Request:
    """One line as a manifest Request; PayloadError names the field (body.messages[0]...)."""
    raw = line_object(text, LINE_FIELDS, ())
    for name in LINE_FIELDS:
        if name not in raw:
            raise PayloadError(name, "is required")
    custom_id = check_custom_id(raw["custom_id"])
    if raw["method"] != "POST":
        raise PayloadError("method", f'must be "POST", got {raw["method"]!r}')
    if raw["url"] != URL:
        raise PayloadError("url", f'must be "{URL}" (vlmq serves chat completions), '
                                  f"got {raw['url']!r}")
    body = raw["body"]
    if not isinstance(body, dict):
        raise PayloadError("body", f"must be an object, got {type(body).__name__}")
    _check_body_fields(body)
    task, schema = _task(body.get("response_format"))
    prompt, (field, url) = _messages(body.get("messages"))
    if not prompt and task == "generate":
        raise PayloadError("body.messages", "has no text: without a json_schema "
                                            "response_format a request is task generate, "
                                            "which needs a prompt")
    settings = {
        "prompt": S.BY_NAME["prompt"].check(prompt or None, "body.messages"),
        "schema": schema,
        "model": S.BY_NAME["model"].check(body.get("model"), "body.model"),
        "max_tokens": _max_tokens(body),
        "temperature": S.BY_NAME["temperature"].check(body.get("temperature"),
                                                      "body.temperature"),
        "stop": _stop(body.get("stop")),
    }
    file, source = _input(url, field, number, folder, spool)
    return Request(line=number, custom_id=custom_id, task=task, file=file, pages=None,
                   settings={k: v for k, v in settings.items() if v is not None},
                   source=source, field=field, one_item=True)


def _check_body_fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name in BODY_FIELDS or name in IGNORED:
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


def _task(value: Any) -> tuple[str, dict[str, Any] | None]:
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
                                            f'"json_schema", got {kind!r}')
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


def _messages(value: Any) -> tuple[str, tuple[str, str]]:
    """(prompt, (field, url)): the messages' text a blank line apart, and the one image."""
    if not isinstance(value, list) or not value:
        raise PayloadError("body.messages", "must be a non-empty list of messages")
    texts: list[str] = []
    image: tuple[str, str] | None = None
    for i, msg in enumerate(value):
        where = f"body.messages[{i}]"
        role, content = _message(msg, where)
        for text, ref in _parts(content, where, role):
            if text is not None:
                texts.append(text)
            elif ref is not None:
                if image is not None:
                    raise PayloadError(ref[0], f"is a second image; a request takes one "
                                               f"(the first is {image[0]})")
                image = ref
    if image is None:
        raise PayloadError("body.messages", "has no image: each request is one image (an "
                                            "image_url part) or one PDF page")
    return "\n\n".join(t for t in texts if t.strip()), image


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
                                            f"{role!r} (vlmq sends one prompt with one "
                                            "image, not a conversation)")
    return role, msg.get("content")


def _parts(content: Any, where: str, role: str
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
                                            f"got {kind!r}")
    if role != "user":
        raise PayloadError(where, f"is an image in a {role} message; images go in user "
                                  "messages")
    if kind == "image_url":
        inner = part.get("image_url")
        if not isinstance(inner, dict) or not isinstance(inner.get("url"), str):
            raise PayloadError(f"{where}.image_url", 'must be {"url": "data:..." or '
                                                     '"file://..."}')
        return None, (f"{where}.image_url.url", inner["url"])
    inner = part.get("file")
    if not isinstance(inner, dict):
        raise PayloadError(f"{where}.file", 'must be {"file_data": "data:..."}')
    if "file_id" in inner:
        raise PayloadError(f"{where}.file.file_id", "vlmq has no files API: inline the "
                                                    "file as file_data (a data: URI)")
    if not isinstance(inner.get("file_data"), str):
        raise PayloadError(f"{where}.file.file_data", "must be a data: URI")
    return None, (f"{where}.file.file_data", inner["file_data"])


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    given = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
    if len(given) > 1:
        raise PayloadError("body.max_completion_tokens", "give max_tokens or "
                                                         "max_completion_tokens, not both")
    if not given:
        return None
    value: int = S.BY_NAME["max_tokens"].check(body[given[0]], f"body.{given[0]}")
    return value


def _stop(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    listed = [value] if isinstance(value, str) else value
    stop: tuple[str, ...] = S.BY_NAME["stop"].check(listed, "body.stop")
    return stop


def _input(url: str, field: str, number: int, folder: Path, spool: Path
           ) -> tuple[Path, str | None]:
    """The image's file, and its item source (None: the path itself)."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise PayloadError(field, WEB_REFUSED)
    if scheme.startswith("data:"):
        return _spooled(url, field, number, spool)
    if scheme.startswith("file://"):
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
    head, comma, encoded = url.partition(",")
    if not comma:
        raise PayloadError(field, "is not a data: URI (no comma before the data)")
    mime, *params = (p.strip().lower() for p in head[len("data:"):].split(";"))
    if "base64" not in params:
        raise PayloadError(field, "must be base64-encoded (data:image/png;base64,...)")
    kind, _, subtype = mime.partition("/")
    if not ((kind == "image" and _SUBTYPE.fullmatch(subtype)) or mime == "application/pdf"):
        raise PayloadError(field, f"is a data: URI of {mime or 'no media type'!r}; give an "
                                  "image (image/png, image/jpeg...) or a PDF "
                                  "(application/pdf)")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(field, f"is not valid base64 ({exc})") from None
    if not data:
        raise PayloadError(field, "holds no data")
    path = spool / sha256_hex(data)
    try:
        if not path.exists():
            path.write_bytes(data)
    except OSError as exc:
        raise InputError(str(spool), f"cannot spool a data: image: "
                                     f"{exc.strerror or exc}") from exc
    return path, f"data-line{number}.{'pdf' if mime == 'application/pdf' else subtype}"
