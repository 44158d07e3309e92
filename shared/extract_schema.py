"""The JSON Schema of an extract job: checked once, the same way, by producers and workers.

A schema reaches a worker from any producer, and the worker compiles it into a per-row
matcher (llguidance) that constrains decoding. So a schema is refused at enqueue unless
the worker can honour all of it: a JSON object, within the size cap, valid against its
meta-schema (jsonschema), satisfiable (some JSON value meets it: see `_Satisfiable`), and
taken by llguidance without errors or warnings (a warning means the matcher would ignore
part of the schema, e.g. `not`, so output could break it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

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
    # Imported here: they cost about 100 ms, and every vlmq command imports this module
    # (the settings table) while only a schema check needs them.
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for
    from llguidance import LLMatcher, grammar_from

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
    why = _Satisfiable(schema).why_not()
    if why is not None:
        return f"no value can satisfy it: {why}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar_from("json_schema", text))
    if is_error or messages:
        what = "cannot follow it" if is_error else "would ignore part of it"
        return (f"is not supported: the decoder's matcher (llguidance) {what}: "
                f"{'; '.join(messages) or 'no reason given'}")
    return None


_JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# Steps of the satisfiability walk; a schema needing more is left to llguidance (it is
# within C.MAX_SCHEMA_BYTES, so this is only reached by a crafted web of $refs).
_MAX_STEPS = 50_000


def _types(schema: Mapping[str, Any]) -> frozenset[str] | None:
    """The JSON types a schema's own `type` allows (None: any), integer inside number."""
    named = schema.get("type")
    names = [named] if isinstance(named, str) else named if isinstance(named, list) else None
    if names is None:
        return None
    allowed = {n for n in names if n in _JSON_TYPES}
    return frozenset(allowed | ({"integer"} if "number" in allowed else set()))


class _Satisfiable:
    """Whether some JSON value satisfies a schema, for what can make none (a schema
    such as `{"$ref": "#"}` would make every item fail): a `$ref` loop with no
    base case (the schema is only itself, or an object must hold itself), `false`, an
    empty `enum`, `allOf` members whose types do not meet, a required property or a
    non-empty array of such a schema. Local `$ref`s only ("#", "#/..."); others are
    assumed satisfiable, as is anything this does not model (formats, bounds: llguidance
    refuses the bounds that cross, and every `not`, `{"not": {}}` included, as a keyword
    it does not implement): the check refuses only what surely makes no value.

    A least fixed point by depth-first search: a `$ref` met again on the path gives no
    value along that path. A True answer is always right and remembered; a False one only
    when it did not rest on a reference still being worked out."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.known: dict[int, bool] = {}
        self.path: list[int] = []
        self.loop = False  # the current answer rests on a reference on the path
        self.steps = 0
        self.why: str | None = None

    def why_not(self) -> str | None:
        try:
            ok = self.ok(self.root, "#")
        except _TooBig:
            return None
        return None if ok else (self.why or "it matches nothing")

    def _no(self, why: str) -> bool:
        self.why = self.why or why
        return False

    def ok(self, schema: Any, at: str) -> bool:
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise _TooBig
        if isinstance(schema, bool):
            return schema or self._no(f"`false` (at {at}) matches nothing")
        if not isinstance(schema, Mapping):
            return True
        key = id(schema)
        if key in self.known:
            return self.known[key]
        if key in self.path:
            self.loop = True
            return self._no(f"a $ref loop with no base case runs through {at}")
        self.path.append(key)
        outer, self.loop = self.loop, False
        try:
            answer = self._own(schema, at)
        finally:
            self.path.pop()
        if answer or not self.loop:
            self.known[key] = answer
        self.loop = self.loop or outer
        return answer

    def _own(self, schema: Mapping[str, Any], at: str) -> bool:
        ref = schema.get("$ref")
        if isinstance(ref, str) and not self.ok(self._resolve(ref), ref):
            return False
        if "enum" in schema and schema["enum"] == []:
            return self._no(f"an empty enum (at {at}) matches nothing")
        members = schema.get("allOf")
        members = members if isinstance(members, list) else []
        types = self._met_types(schema, members, at)
        if types is not None and not types:
            return False
        if not all(self.ok(m, f"{at}/allOf/{i}") for i, m in enumerate(members)):
            return False
        if not self._some_option(schema, at):
            return False
        return self._shaped(schema, types, at)

    def _met_types(self, schema: Mapping[str, Any], members: list[Any], at: str
                   ) -> frozenset[str] | None:
        """The types the schema and its allOf members all allow (None: any); an empty set,
        with its reason kept, when they do not meet."""
        types = _types(schema)
        for member in members:
            if isinstance(member, Mapping) and (more := _types(member)) is not None:
                types = more if types is None else types & more
        if types is not None and not types:
            named = [m["type"] for m in [schema, *members]
                     if isinstance(m, Mapping) and isinstance(m.get("type"), str)]
            self._no(f"it asks for types {' and '.join(named) or 'none'} at once (at {at})")
        return types

    def _some_option(self, schema: Mapping[str, Any], at: str) -> bool:
        """Whether anyOf and oneOf (where given) each have a satisfiable member."""
        for word in ("anyOf", "oneOf"):
            options = schema.get(word)
            if isinstance(options, list) and options and not any(
                    self.ok(m, f"{at}/{word}/{i}") for i, m in enumerate(options)):
                return False
        return True

    def _shaped(self, schema: Mapping[str, Any], types: frozenset[str] | None,
                at: str) -> bool:
        """Whether some allowed type has a value: a scalar type always does; an object its
        required properties' schemas must allow, an array its first minItems items'."""
        if types is None or types - {"object", "array"}:
            return True
        if "object" in types and self._object(schema, at):
            return True
        return "array" in types and self._array(schema, at)

    def _object(self, schema: Mapping[str, Any], at: str) -> bool:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = schema.get("required")
        names = required if isinstance(required, list) else []
        return all(self.ok(props[n], f"{at}/properties/{n}") for n in names
                   if isinstance(n, str) and n in props)

    def _array(self, schema: Mapping[str, Any], at: str) -> bool:
        least = schema.get("minItems")
        if not isinstance(least, int) or least < 1:
            return True
        prefix = schema.get("prefixItems")
        firsts = prefix[:least] if isinstance(prefix, list) else []
        if not all(self.ok(m, f"{at}/prefixItems/{i}") for i, m in enumerate(firsts)):
            return False
        items = schema.get("items")
        if len(firsts) < least and items is not None and not isinstance(items, list):
            return self.ok(items, f"{at}/items")
        return True

    def _resolve(self, ref: str) -> Any:
        """A local reference's target ("#" or a JSON pointer "#/a/b"); True (satisfiable,
        as far as this check can tell) for any other or one that leads nowhere."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return True
        node: Any = self.root
        for raw in ref[2:].split("/"):
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node


class _TooBig(Exception):
    """The satisfiability walk ran out of steps: no verdict."""


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
