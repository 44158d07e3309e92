"""The JSON Schema of an extract job: checked once, the same way, by producers and workers.

A schema reaches a worker from any producer, and the worker compiles it into a per-row
matcher (llguidance) that constrains decoding. So a schema is refused at enqueue unless
the worker can honour all of it: a JSON object, within the size cap, valid against its
meta-schema (jsonschema), and taken by llguidance without errors or warnings (a warning
means the matcher would ignore part of the schema, e.g. `not`, so output could break it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from llguidance import LLMatcher, grammar_from

from vlmq.shared import constants as C
from vlmq.shared.bounded_reads import BoundError, check_depth
from vlmq.shared.errors import PayloadError

EXTRACT = "extract"
# The job data nests [func, null, [payload], {}] -> payload -> schema: three levels above
# the schema, and the worker reads job data at most C.MAX_JSON_DEPTH deep.
MAX_SCHEMA_DEPTH = C.MAX_JSON_DEPTH - 3
NOT_AN_OBJECT = "must be a non-empty JSON object (a JSON Schema)"


def schema_text(schema: Mapping[str, Any]) -> str:
    """The canonical text of a schema: compact JSON, keys in their given order (property
    order is the order the model writes them in). The worker compiles exactly this, and
    its UTF-8 bytes are what C.MAX_SCHEMA_BYTES caps."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def check_schema(value: Any, where: str = "schema") -> dict[str, Any]:
    """`value` as a plain JSON object (a copy) when it is a schema the worker can follow;
    else PayloadError(where, problem). `where` is the payload field, or the file it came
    from."""
    if not isinstance(value, Mapping):
        raise PayloadError(where, f"{NOT_AN_OBJECT}, got {_json_type(value)}")
    if not value:
        # {} constrains nothing; refused so that Lua (where cjson reads {} and [] as the
        # same empty table) and Python give one answer.
        raise PayloadError(where, f"{NOT_AN_OBJECT}, got an empty object (for free text "
                                  "use caption or generate; for any object give "
                                  '{"type": "object"})')
    try:
        check_depth(value, MAX_SCHEMA_DEPTH, "schema")
        text = schema_text(value)
    except BoundError:
        raise PayloadError(where, f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except (TypeError, ValueError) as exc:
        raise PayloadError(where, f"is not JSON: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise PayloadError(where, f"is not valid UTF-8 text (a lone surrogate at character "
                                  f"{exc.start} of its JSON)") from None
    if size > C.MAX_SCHEMA_BYTES:
        raise PayloadError(where, f"is {size} bytes of compact JSON, over the "
                                  f"{C.MAX_SCHEMA_BYTES}-byte limit")
    problem = _problem(text)
    if problem is not None:
        raise PayloadError(where, problem)
    schema: dict[str, Any] = json.loads(text)  # a plain copy
    return schema


@functools.lru_cache(maxsize=128)
def _problem(text: str) -> str | None:
    """Why the worker could not follow this schema text (None: it can). Cached by text: a
    manifest of 80,000 lines with one schema checks it once, not at 1-2 ms a line."""
    schema = json.loads(text)
    named = schema.get("$schema")
    # default=None: an unknown $schema gives None (not a warning and the latest draft).
    validator = (validator_for(schema) if "$schema" not in schema
                 else validator_for(schema, default=None) if isinstance(named, str) else None)
    if validator is None:
        return (f"$schema {named!r} is not a JSON Schema draft this checker knows "
                "(draft 3 to 2020-12)")
    try:
        validator.check_schema(schema)
    except SchemaError as exc:
        at = exc.json_path.removeprefix("$").lstrip(".") or "the top level"
        return f"is not a valid JSON Schema: {exc.message} (at {at})"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar_from("json_schema", text))
    if is_error or messages:
        what = "cannot follow it" if is_error else "would ignore part of it"
        return (f"is not supported: the decoder's matcher (llguidance) {what}: "
                f"{'; '.join(messages) or 'no reason given'}")
    return None


def check_task(task: str, schema: Any) -> None:
    """Task extract needs a schema; other tasks take none (the same rule in enqueue.lua)."""
    if task == EXTRACT and schema is None:
        raise PayloadError("schema", f"is required for task {EXTRACT}")
    if task != EXTRACT and schema is not None:
        raise PayloadError("schema", f"is only allowed with task {EXTRACT}, not {task}")


def as_schema(value: Any, where: str = "schema") -> Any:
    """A schema from the forms a Python caller has: a mapping, JSON text, or a pydantic
    model class or instance (anything with `model_json_schema()`; pydantic itself is not
    a dependency). Returned unchecked: check_schema runs where every form meets."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise PayloadError(where, f"is a string but not JSON: {exc}") from None
    maker = getattr(value, "model_json_schema", None)
    if callable(maker):
        return maker()
    return value


def default_prompt(schema: Mapping[str, Any]) -> str:
    """The prompt of an extract job that gives none: what to pull out of the image, one
    line per top-level property (with its description), then the schema itself."""
    props = schema.get("properties")
    lines: list[str] = []
    if isinstance(props, Mapping):
        for name, sub in props.items():
            about = sub.get("description") if isinstance(sub, Mapping) else None
            lines.append(f"- {name}: {about}" if isinstance(about, str) and about
                         else f"- {name}")
    answer = ("one JSON object" if schema.get("type") == "object" or lines
              else "one JSON value")
    head = (f"Extract these fields from the image and answer with {answer} only, "
            "no other text:" if lines
            else f"Extract the requested information from the image and answer with "
                 f"{answer} only, no other text.")
    return "\n".join([head, *lines, f"The answer must follow this JSON Schema: "
                                    f"{schema_text(schema)}"])


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             type(None): "null", list: "an array", tuple: "an array"}
    return names.get(type(value), type(value).__name__)
