"""Every job setting, defined once: name, wire path, type, range, default, CLI flag, help.

The CLI flags of every command that takes job settings, `JobOptions`, payload parsing, the
manifest and schedule fields, the worker's JobSettings (worker/job_settings.py), the
range checks and defaults in enqueue.lua and PROTOCOL.md's settings table all follow from
SETTINGS, so a new setting is one row here plus the worker code that uses it. enqueue.lua
carries a generated copy of the table (`python -m vlmq.shared.lua --write`, which
shared/lua.py runs over every script); tests keep the copy in step with the rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared import extract_schema
from vlmq.shared.chat import MAX_MESSAGE_CHARS, MAX_MESSAGES, ROLES, Message, check_messages
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import JOB_ID_RE, QUEUE_NAME_RE

# Longest a result or blob may be kept: RQ stores TTLs as seconds, and a year is far past
# any bulk run while still catching a milliseconds-for-seconds mistake.
MAX_TTL_S = 366 * 24 * 3600
# How long inputs stay once the last job using them has ended (finished, canceled, deleted):
# long enough to look at or retry a result, short enough that a bulk run's inputs leave.
KEEP_INPUTS_S = 3600
MAX_STOP_CHARS = 256
MAX_MODEL_CHARS = 512

# Setting.kind is one of: int, float, bool, str, strs, labels, choice, schema (a JSON Schema
# object for task extract, checked by shared/extract_schema.py), messages (a conversation,
# checked by shared/chat.py).


@dataclass(frozen=True)
class Switch:
    """A flag that sets a choice setting to one value (`--no-result-cache` -> "off")."""

    flag: str
    value: str
    help: str


@dataclass(frozen=True)
class Setting:
    """One job setting. `wire` is its dotted path in the payload; None keeps it on the RQ
    job instead (`job_field` names the hash field a retry reads it back from)."""

    name: str
    kind: str
    help: str
    wire: str | None = None
    job_field: str | None = None
    default: Any = None  # None: the model's (or the worker's) own
    lo: float | None = None
    hi: float | None = None
    # str: characters; strs: characters of each entry; schema: bytes of compact JSON
    max_len: int | None = None
    max_count: int | None = None  # strs, labels: entries
    pattern: re.Pattern[str] | None = None
    invalid: str = ""  # str with a pattern: the refusal, formatted with {value!r}
    choices: tuple[str, ...] = ()
    wire_values: tuple[tuple[str, Any], ...] = ()  # choice -> its JSON form
    metavar: str | None = None
    flag: str | None = None
    switches: tuple[Switch, ...] = ()  # flags instead of a value option
    manifest: bool = True  # a manifest line may set it
    schedule: bool = True  # a schedule may set it
    retry: bool = True  # a retry carries it over
    cli: bool = True  # the job commands take it as a flag (not a conversation)
    decides_text: bool = False  # a change gives an item other text (schedules re-run it)
    # What the payload field means, for PROTOCOL.md's settings table (shared/docs_tables.py
    # adds what it accepts and its default from the fields above).
    doc: str = ""

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.wire.split(".")) if self.wire else ()

    def check(self, value: Any, where: str | None = None) -> Any:
        """The value in its Python form, or PayloadError naming `where` (default: the
        setting's name). None means not given and is returned as it is."""
        if value is None:
            return None
        return _CHECKS[self.kind](self, value, where or self.name)

    @property
    def shown(self) -> str:
        """The JSON values a choice takes, as the error messages list them."""
        forms = [json.dumps(v) for _, v in self.wire_values]
        return ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else "".join(forms)

    def to_wire(self, value: Any) -> Any:
        if self.kind == "messages":
            return [m.to_dict() for m in value]
        return dict(self.wire_values).get(value, value) if self.wire_values else value

    def from_wire(self, raw: Any) -> Any:
        """A payload's JSON value for this setting, checked and in its Python form."""
        if self.wire_values:
            for name, encoded in self.wire_values:
                if raw is encoded or (type(raw) is type(encoded) and raw == encoded):
                    return name
            raise PayloadError(self.wire or self.name, f"must be {self.shown}, got {raw!r}")
        return self.check(raw, self.wire)


def _check_int(s: Setting, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(where, f"must be an integer, got {type(value).__name__}")
    _check_range(s, value, where)
    return value


def _check_float(s: Setting, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PayloadError(where, f"must be a number, got {type(value).__name__}")
    number = float(value)
    _check_range(s, number, where)  # NaN fails it too
    return number


def _check_bool(s: Setting, value: Any, where: str) -> bool:
    del s
    if not isinstance(value, bool):
        raise PayloadError(where, "must be true or false")
    return value


def _check_range(s: Setting, value: float, where: str) -> None:
    lo = -math.inf if s.lo is None else s.lo
    hi = math.inf if s.hi is None else s.hi
    if not lo <= value <= hi:
        raise PayloadError(where, f"must be between {_num(lo)} and {_num(hi)}, "
                                  f"got {_num(value)}")


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}"


def check_text(value: str, where: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer or UTF-8 writer accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise PayloadError(where, f"is not valid UTF-8 text (a lone surrogate U+{ord(bad):04X} "
                                  f"at character {exc.start})") from None
    return value


def check_str(value: Any, where: str, max_len: int | None) -> str:
    if not isinstance(value, str):
        raise PayloadError(where, f"must be a string, got {type(value).__name__}")
    if max_len is not None and len(value) > max_len:
        raise PayloadError(where, f"is longer than {max_len} characters")
    return check_text(value, where)


def _check_str(s: Setting, value: Any, where: str) -> str | None:
    text = check_str(value, where, s.max_len)
    if s.pattern is not None and not s.pattern.fullmatch(text):
        raise PayloadError(where, s.invalid.format(value=text))
    return text or None  # "" is "not given": the model's default


def _check_strs(s: Setting, value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise PayloadError(where, "must be a list of strings")
    if s.max_count is not None and len(value) > s.max_count:
        raise PayloadError(where, f"has more than {s.max_count} entries")
    out: list[str] = []
    for i, entry in enumerate(value):
        text = check_str(entry, f"{where}[{i}]", s.max_len)
        if not text:
            raise PayloadError(f"{where}[{i}]", "must not be empty")
        out.append(text)
    return tuple(out)


def _check_labels(s: Setting, value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise PayloadError(where, "must be an object of string values")
    if s.max_count is not None and len(value) > s.max_count:
        raise PayloadError(where, f"has more than {s.max_count} entries")
    out: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise PayloadError(f"{where}.{key}", "must be a string")
        out[check_text(key, where)] = check_text(val, f"{where}.{key}")
    return out


def _check_choice(s: Setting, value: Any, where: str) -> str:
    if value not in s.choices:
        raise PayloadError(where, f"must be one of {', '.join(s.choices)}, got {value!r}")
    return str(value)


def _check_schema(s: Setting, value: Any, where: str) -> dict[str, Any]:
    del s  # the cap is C.MAX_SCHEMA_BYTES, the row's max_len only copies it for Lua
    return extract_schema.check_schema(value, where)


def _check_messages(s: Setting, value: Any, where: str) -> tuple[Message, ...]:
    del s  # the caps are shared/chat.py's; the row copies them for Lua
    if isinstance(value, (list, tuple)):  # Message objects too: a retry, a client's own
        value = [m.to_dict() if isinstance(m, Message) else m for m in value]
    out = check_messages(value, where)
    for i, m in enumerate(out):
        check_text(m.content, f"{where}[{i}].content")
    return out


_CHECKS = {"int": _check_int, "float": _check_float, "bool": _check_bool, "str": _check_str,
           "strs": _check_strs, "labels": _check_labels, "choice": _check_choice,
           "schema": _check_schema, "messages": _check_messages}


SETTINGS: tuple[Setting, ...] = (
    Setting("prompt", "str", "Prompt text (default: the model's own for the task).",
            wire="prompt", max_len=C.MAX_PROMPT_CHARS, decides_text=True,
            doc="required for `generate`; null: the worker's default for the model and task "
            "(for `extract`, one built from the schema)"),
    # Task extract only (required there): the worker constrains each item's output to it.
    Setting("schema", "schema", "JSON Schema file the answer must follow (task extract; "
            f"at most {C.MAX_SCHEMA_BYTES // 1024} KiB).", wire="schema",
            max_len=C.MAX_SCHEMA_BYTES, metavar="FILE", decides_text=True,
            doc="required for `extract`, refused on other tasks: the JSON Schema each item's "
            "answer follows (below the table)"),
    Setting("model", "str", "Model id the worker should use (default: its own).",
            wire="model", max_len=MAX_MODEL_CHARS, decides_text=True,
            doc="the model id the job needs; a worker serving another model fails the job, "
            "naming both"),
    Setting("max_tokens", "int", "Most tokens to generate per item.",
            wire="generation.max_tokens", lo=1, hi=C.MAX_TOKENS_LIMIT, metavar="N",
            decides_text=True, doc="most tokens generated per item; null: the model's default"),
    Setting("max_side", "int", "Resize so the longer side is at most PX pixels "
            "(default: the model's own).", wire="max_side", lo=C.MAX_SIDE_RANGE[0],
            hi=C.MAX_SIDE_RANGE[1], metavar="PX", decides_text=True,
            doc="longest side in pixels of the image (or rendered PDF page) given to the "
            "model; null: the worker's default"),
    Setting("temperature", "float", "Sampling temperature, 0 = greedy (default: the model's "
            "own).", wire="generation.temperature", lo=0.0, hi=C.MAX_TEMPERATURE, metavar="T",
            decides_text=True, doc="null: the model's default (0 for OCR)"),
    Setting("stop", "strs", "Extra stop string (repeatable).", wire="generation.stop",
            default=(), max_count=C.MAX_STOP_STRINGS, max_len=MAX_STOP_CHARS,
            decides_text=True, doc="stop strings beside the model's own"),
    Setting("labels", "labels", "Label stored with the job (repeatable).", wire="labels",
            default={}, max_count=C.MAX_LABELS, flag="--label", metavar="K=V",
            manifest=False,
            doc="echoed back; `vlmq jobs/status --label k=v` select on them"),
    Setting("result_cache", "choice", "The workers' shared result cache: on (temperature 0 "
            "items only), off, or sampled (also items generated with temperature > 0).",
            wire="result_cache", default="on", choices=("on", "off", "sampled"),
            wire_values=(("on", True), ("off", False), ("sampled", "sampled")),
            switches=(Switch("--no-result-cache", "off",
                             "Generate every item afresh, even if the workers' shared result "
                             "cache holds its text."),
                      Switch("--result-cache-sampled", "sampled",
                             "Also cache (and reuse) items generated with temperature > 0; by "
                             "default only deterministic (temperature 0) items are.")),
            doc="`true`: the workers' shared result cache answers and keeps deterministic, "
            "temperature-0 items; `false`: every item is generated afresh; `\"sampled\"`: "
            "items generated with temperature > 0 are cached too"),
    # fallback by default: it never replaces what the model wrote, costs nothing on pages
    # the model reads, and turns a page the model failed into its exact embedded text.
    # prefer changes what good pages look like (plain text, not the model's markdown), so
    # it is asked for.
    Setting("text_layer", "choice", "OCR and a PDF page's own text layer: off (never used), "
            "fallback (the layer's text beside the model's failure on a page the model "
            "fails; the default) or prefer (a page whose layer passes the quality check "
            "skips the model).", wire="text_layer", default="fallback",
            choices=("off", "fallback", "prefer"),
            wire_values=(("off", "off"), ("fallback", "fallback"), ("prefer", "prefer")),
            decides_text=True,
            doc="what a PDF page's own text layer is used for in an `ocr` job (section 4, "
            "\"Text layers\"); other tasks and items ignore it"),
    # Interactive requests (shared/chat.py): the conversation the prompt is rendered from
    # with the model's chat template, and whether the answer is streamed as decoded.
    Setting("messages", "messages", "The conversation to answer (an interactive request).",
            wire="messages", max_len=MAX_MESSAGE_CHARS, max_count=MAX_MESSAGES,
            choices=ROLES, decides_text=True, manifest=False, schedule=False, cli=False,
            doc="a conversation, replacing `prompt`: the worker renders it with the model's "
            "chat template, the item's image at the start of the turn with `image: true` "
            "(section 3b)"),
    Setting("stream", "bool", "Write the answer to the job's token stream as it is decoded.",
            wire="stream", default=False, manifest=False, schedule=False, retry=False,
            cli=False,
            doc="`true`: the worker appends the decoded text to `<prefix>:job:<id>:tokens` "
            "(section 3b)"),
    Setting("blob_ttl", "int", f"Keep the uploaded inputs S seconds "
            f"(default {C.BLOB_TTL_S // 86400} days).", wire="blob_ttl",
            default=C.BLOB_TTL_S, lo=1, hi=MAX_TTL_S, metavar="S", manifest=False,
            doc="seconds the job's input blobs are kept while the job is queued or running; "
            "the worker refreshes them for this long when it starts the job, and a retry "
            "keeps it"),
    Setting("keep_inputs", "int", f"Keep the inputs S seconds after the last job using them "
            f"finishes, is canceled or deleted (default {KEEP_INPUTS_S}); a failed job keeps "
            "them as long as its failure record.", wire="keep_inputs", default=KEEP_INPUTS_S,
            lo=1, hi=MAX_TTL_S, metavar="S", manifest=False,
            doc="seconds the inputs stay once the last job using them has finished, been "
            "canceled or deleted (section 2); a failed job keeps them as long as its "
            "failure record"),
    # Set by the producer when a set becomes several jobs (producer/job_sets.py), never by
    # hand; a retry belongs to a new batch, so it is not carried over.
    Setting("batch", "str", "The batch the job belongs to (set by vlmq when a set becomes "
            "several jobs).", wire="batch", max_len=128, pattern=JOB_ID_RE,
            invalid="invalid batch id {value!r} (must match [A-Za-z0-9_-]{{1,128}})",
            metavar="ID", manifest=False, schedule=False, retry=False,
            doc="the batch the job belongs to (section 9); set by the producer that made the "
            "batch, never carried by a retry"),
    Setting("result_ttl", "int", f"Keep the results S seconds after the job ends "
            f"(default {C.RESULT_TTL_S // 86400} days).", job_field="result_ttl",
            default=C.RESULT_TTL_S, lo=1, hi=MAX_TTL_S, metavar="S", manifest=False),
    Setting("queue", "str", "Queue to put the job on; workers take jobs from the queues "
            "they are started with (default: the task's own).", job_field="origin",
            pattern=QUEUE_NAME_RE, invalid="invalid queue name {value!r} (letters, digits, _ . -)",
            metavar="NAME", manifest=False),
    Setting("job_id", "str", "Use this job id ([A-Za-z0-9_-]); refused if a job with it "
            "exists, so a re-run script cannot enqueue the same work twice.",
            pattern=JOB_ID_RE,
            invalid="invalid job id {value!r} (must match [A-Za-z0-9_-]{{1,128}})",
            metavar="ID", manifest=False, schedule=False, retry=False),
)

BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
WIRE: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.wire)
# The payload's own fields, beside the settings' (see PROTOCOL.md).
PAYLOAD_FIELDS = ("v", "task", "items", "created_at")


def _wire_fields() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {name: set() for name in PAYLOAD_FIELDS}
    for s in WIRE:
        head, *rest = s.path
        out.setdefault(head, set()).update(rest)
    return {k: frozenset(v) for k, v in out.items()}


# Allowed payload keys: top level -> the keys its object may hold (empty: a plain value).
WIRE_FIELDS: Mapping[str, frozenset[str]] = _wire_fields()


def check_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings by name, each checked and in its Python form; unknown names refused.
    Values equal to the default are dropped: only what was given is kept."""
    out: dict[str, Any] = {}
    for name, raw in values.items():
        setting = BY_NAME.get(name)
        if setting is None:
            raise PayloadError(name, f"unknown setting (known: {', '.join(BY_NAME)})")
        value = setting.check(raw)
        if value is not None and value != setting.default:
            out[name] = value
    return out


def values_from_wire(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a payload gives, checked, by name (errors name the wire path)."""
    out: dict[str, Any] = {}
    for s in WIRE:
        raw: Any = payload
        for part in s.path:
            raw = raw.get(part) if isinstance(raw, Mapping) else None
        if raw is None:
            continue
        value = s.from_wire(raw)
        if value is not None and value != s.default:
            out[s.name] = value
    return out


def values_to_wire(values: Mapping[str, Any]) -> dict[str, Any]:
    """The payload fields for settings by name (only those with a wire path)."""
    out: dict[str, Any] = {}
    for s in WIRE:
        if s.name not in values:
            continue
        *parents, leaf = s.path
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        value = s.to_wire(values[s.name])
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out


# --- the Lua copy ------------------------------------------------------------------------

LUA_BEGIN = "-- BEGIN SETTINGS"
LUA_END = "-- END SETTINGS"
LUA_MARKERS = (LUA_BEGIN, LUA_END)


def _lua_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _lua_row(s: Setting) -> str:
    fields = [f"name = {_lua_literal(s.wire)}",
              "path = {" + ", ".join(_lua_literal(p) for p in s.path) + "}",
              f"kind = {_lua_literal(s.kind)}"]
    # A number's default is the one Lua applies when the payload leaves it out (blob_ttl,
    # keep_inputs: the input holds enqueue.lua writes).
    numeric_default = s.kind in ("int", "float") and s.default is not None
    for attr in ("lo", "hi", "max_len", "max_count", *(("default",) if numeric_default else ())):
        value = getattr(s, attr)
        if value is not None:  # a schema's max_len counts bytes: named so for Lua
            name = "max_bytes" if s.kind == "schema" and attr == "max_len" else attr
            fields.append(f"{name} = {_lua_literal(value)}")
    if s.choices and not s.wire_values:
        fields.append("choices = {" + ", ".join(_lua_literal(c) for c in s.choices) + "}")
    if s.kind == "messages":  # a turn's fields, as shared/chat.py's Message has them
        fields.append("fields = {" + ", ".join(_lua_literal(f.name) for f in
                                             dataclasses.fields(Message)) + "}")
    if s.wire_values:
        fields.append("values = {" + ", ".join(_lua_literal(v) for _, v in s.wire_values)
                      + "}")
        fields.append(f"shown = {_lua_literal(s.shown)}")
    return "  {" + ", ".join(fields) + "},"


def lua_block() -> str:
    """The table enqueue.lua checks payload settings against, generated from SETTINGS."""
    lines = [f"{LUA_BEGIN}: generated from vlmq/shared/settings.py by "
             "`python -m vlmq.shared.lua --write`; do not edit by hand.",
             "local SETTINGS = {", *(_lua_row(s) for s in WIRE), "}", LUA_END]
    return "\n".join(lines)


def lua_with_block(script: str) -> str:
    """`script` with its generated block replaced by the current one."""
    start, end = script.index(LUA_BEGIN), script.index(LUA_END) + len(LUA_END)
    start = script.rindex("\n", 0, start) + 1
    return script[:start] + lua_block() + script[end:]


def rows(scope: str) -> Iterator[Setting]:
    """The settings a `scope` ("manifest", "schedule", "retry", "cli") may carry."""
    return (s for s in SETTINGS if getattr(s, scope))


if __name__ == "__main__":  # the command this module's generated block used to name
    from vlmq.shared import lua

    sys.exit(lua.main(["--write" if sys.argv[1:] == ["--write-lua"] else "--check"]))
