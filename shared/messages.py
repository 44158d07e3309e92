"""Protocol v1 schemas: the job payload and the per-item result.

Payloads come from producers in any language, so validation is strict and every
error names the JSON path of the field that is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared import extract_schema
from vlmq.shared import settings as S
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import SHA256_RE


def utc_now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pattern_max_chars(pattern: re.Pattern[str]) -> int:
    """The longest a whole-string pattern `[...]{N}` or `[...]{1,N}` takes: its N, so a
    message or a Lua script states the pattern's own bound."""
    found = re.fullmatch(r"\[[^\]]+\]\{(\d+)(?:,(\d+))?\}", pattern.pattern)
    if found is None:
        raise ValueError(f"not a bounded character-class pattern: {pattern.pattern}")
    return int(found[2] or found[1])


# A store name (stores/backends.py): the same pattern in enqueue.lua.
STORE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_REF_PATH_CHARS = 4096
# Sizes are JSON numbers: every other language reads them exactly up to 2**53.
MAX_REF_SIZE = 2**53 - 1
# Each payload rule's refusal, worded once: parse_payload raises it and enqueue.lua returns
# it (its generated MESSAGES block), so every language is refused in the same words. A `%s`
# takes what the comment names (Python's `%`, Lua's string.format).
PAYLOAD_MESSAGES: dict[str, str] = {
    # the value given, as Python's repr writes it
    "version": f"unsupported protocol version %s; vlmq speaks v{C.PROTOCOL_VERSION}",
    "task": "must be one of " + ", ".join(C.TASKS),
    "items": "must be a non-empty list",
    "max_items": f"has more than {C.MAX_ITEMS_PER_JOB} entries",
    "prompt_required": f"is required for task {C.PROMPT_TASK} (unless `messages` is given)",
    "not_object": "must be an object",
    "unknown_fields": "unknown field(s) %s",  # the sorted names, as a Python list
    "kind": "must be one of " + ", ".join(C.ITEM_KINDS),
    "text_input": "is not allowed on a text item (it has no input: the prompt is all)",
    "text_task": "text is for tasks " + ", ".join(C.TEXT_TASKS) + ": %s reads an image",
    "blob_and_ref": "has both blob and ref; give exactly one",
    "ref_object": 'must be an object {"store", "path"}',
    "store": "must match " + STORE_NAME_RE.pattern,
    "ref_path": f"must be a non-empty string of at most {MAX_REF_PATH_CHARS} characters",
    "size_missing": "is required with ref (the input's bytes)",
    "size": f"must be a whole number of bytes from 1 to {MAX_REF_SIZE}",
    "sha256": f"must be a lowercase hex sha256 ({pattern_max_chars(SHA256_RE)} characters)",
    "only_with_ref": "is only allowed with ref",
    "page_missing": "is required for a %s item (1-based)",  # the item's kind
    "page": f"must be an integer from 1 to {C.MAX_TIFF_PAGES} (1-based)",
    "page_not_paged": "is only allowed on " + " and ".join(C.PAGED_KINDS) + " items",
    "source": f"must be a string of at most {C.MAX_SOURCE_CHARS} characters",
    "custom_id": f"must be a string of at most {C.MAX_CUSTOM_ID_CHARS} characters",
    "prompt_empty": "must not be empty (leave it out to use the job's prompt)",
}
# Why a store path would leave its store, each worded once: the worker refuses by these
# (stores/backends.py ref_path_problem) and enqueue.lua refuses the same at enqueue.
REF_PATH_PROBLEMS: dict[str, str] = {
    "empty": "is empty",
    "nul": "contains a NUL character",
    "backslash": "contains a backslash (paths in a store use /)",
    "absolute": "is absolute (paths in a store are relative to it)",
    "dotdot": "has a '..' segment (it would leave the store)",
}
# A text item's content hash: that of no bytes.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@dataclass(frozen=True)
class Ref:
    """Where a referenced input lives: a store's name and a relative posix path in it.

    The name, not a location, travels: each machine maps it to its own folder or bucket
    (`--store NAME=URL`), so the same job runs on a Mac and on Linux.
    """

    store: str
    path: str

    def to_dict(self) -> dict[str, str]:
        return {"store": self.store, "path": self.path}

    def __str__(self) -> str:
        return f"{self.store}:{self.path}"


@dataclass(frozen=True)
class Item:
    """One unit of work: an image, one page of a PDF, or a text item (no input: the job's
    prompt alone, C.TEXT_KIND).

    Its input is either an uploaded blob (`blob`, its sha256) or a reference into a store
    (`ref`, with the content's `ref_sha256` and `size`, checked when the worker reads it):
    exactly one of the two. `sha256` is the content hash in both forms, so caches keyed on
    it share entries between a referenced file and the same bytes uploaded.
    """

    kind: str
    blob: str | None
    source: str
    page: int | None = None
    # The caller's own name for this item (batch-API style), echoed in its result.
    custom_id: str | None = None
    ref: Ref | None = None
    size: int | None = None  # bytes of a referenced input
    ref_sha256: str | None = None  # content hash of a referenced input
    # The item's own prompt, in place of the job's: requests that differ only in their
    # prompt (an OpenAI batch file's lines) share one job instead of a job each.
    prompt: str | None = None

    def __post_init__(self) -> None:
        if self.kind == C.TEXT_KIND:
            if self.blob is not None or self.ref is not None or self.page is not None:
                raise ValueError("a text item has no blob, ref or page")
            return
        if (self.blob is None) == (self.ref is None):
            raise ValueError("an item has exactly one of blob and ref")
        if self.ref is not None and (self.ref_sha256 is None or self.size is None):
            raise ValueError("a referenced item needs its sha256 and size")

    @property
    def sha256(self) -> str:
        """The input's content hash, whichever form carries it (a text item's input is
        empty: the hash of no bytes, so caches key it on the prompt alone)."""
        if self.kind == C.TEXT_KIND:
            return EMPTY_SHA256
        sha = self.blob if self.blob is not None else self.ref_sha256
        assert sha is not None  # __post_init__
        return sha

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.ref is not None:
            out.update(ref=self.ref.to_dict(), sha256=self.ref_sha256, size=self.size)
        elif self.blob is not None:
            out["blob"] = self.blob
        out["source"] = self.source
        if self.page is not None:
            out["page"] = self.page
        if self.custom_id is not None:
            out["custom_id"] = self.custom_id
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out


@dataclass(frozen=True)
class JobPayload:
    """A job as the protocol carries it: its task, its items and the settings it gives.

    `settings` holds, by name (shared/settings.py), only the settings the job gives;
    read them with `get`, which falls back to the row's default.
    """

    task: str
    items: tuple[Item, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=utc_now_iso)
    v: int = C.PROTOCOL_VERSION

    def get(self, name: str) -> Any:
        value = self.settings.get(name)
        return S.BY_NAME[name].default if value is None else value

    @property
    def labels(self) -> Mapping[str, str]:
        return self.get("labels")  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        return {"v": self.v, "task": self.task, "items": [i.to_dict() for i in self.items],
                **S.values_to_wire(self.settings), "created_at": self.created_at}

    @classmethod
    def from_dict(cls, raw: Any) -> JobPayload:
        return parse_payload(raw)


# Decimal places of an item result's timings (seconds): 0.1 ms.
TIMING_DIGITS = 4
TEXT_FROM_MODEL = "model"
TEXT_FROM_LAYER = "text_layer"


@dataclass
class ItemResult:
    """What the worker writes for each item, as soon as that item is done."""

    index: int
    source: str
    page: int | None
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    vision_cache_hit: bool
    error: str | None
    timings: dict[str, float] = field(default_factory=dict)
    custom_id: str | None = None  # the item's custom_id, echoed back
    repetition: str | None = None  # what the repetition guard did (cut, retried), if anything
    # True when the text came from the shared result cache: nothing was generated.
    result_cache_hit: bool = False
    # Prompt tokens a cached prefix spared this item's prefill; > 0 is a prefix hit.
    prefix_tokens: int = 0
    # Where `text` came from: the model, or the PDF page's own text layer ("text_layer":
    # with text_layer prefer, or fallback after the model failed the page).
    text_source: str = TEXT_FROM_MODEL
    # Fallback (the model failed the page and `text` is the page's text layer): the
    # model's error, or what it wrote before max_tokens or the repetition guard cut it.
    # A failed item cut that way (an extract's unfinished JSON) keeps that text here too.
    model_error: str | None = None
    model_text: str | None = None
    # An extract item's parsed object (`text` holds the same JSON as text).
    json: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """The protocol's item result (PROTOCOL.md section 4). Timings are rounded to
        0.1 ms and `repetition` is left out when null: nothing reads more digits, and
        every byte here is kept once per item in Redis."""
        out = asdict(self)
        out["timings"] = {k: round(v, TIMING_DIGITS) for k, v in self.timings.items()}
        for name, default in _LEFT_OUT:
            if out[name] == default:
                del out[name]
        return out

    def stored(self) -> dict[str, Any]:
        """The stored form's keys (PROTOCOL.md section 4): to_dict less every key that
        holds its default (STORED_DEFAULTS), timings to the ms and none that is 0. An item
        result is kept once per item for the job's whole result_ttl, so each default
        spelled out would cost every item its bytes."""
        out = self.to_dict()
        for name, default in STORED_DEFAULTS:
            value = out.get(name, default)
            if value is default or (type(value) is type(default) and value == default):
                out.pop(name, None)
        timings = {k: round(v, STORED_TIMING_DIGITS) for k, v in self.timings.items()}
        timings = {k: v for k, v in timings.items() if v}
        if timings:
            out["timings"] = timings
        return out

    def to_json(self) -> str:
        """The stored form (what a worker HSETs into the items hash): `stored()` as compact
        JSON, text as UTF-8 rather than \\u escapes (a third of the bytes for CJK), unless
        the text holds what UTF-8 cannot carry (a lone surrogate)."""
        out = json.dumps(self.stored(), separators=(",", ":"), ensure_ascii=False)
        try:
            out.encode()
        except UnicodeEncodeError:
            return json.dumps(self.stored(), separators=(",", ":"))
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ItemResult:
        return cls(
            index=int(raw["index"]),
            source=str(raw["source"]),
            page=None if raw.get("page") is None else int(raw["page"]),
            text=raw.get("text"),
            finish_reason=raw.get("finish_reason", FINISH_STOP),
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            vision_cache_hit=bool(raw.get("vision_cache_hit")),
            error=raw.get("error"),
            timings={str(k): float(v) for k, v in (raw.get("timings") or {}).items()},
            custom_id=None if raw.get("custom_id") is None else str(raw["custom_id"]),
            repetition=raw.get("repetition"),
            result_cache_hit=bool(raw.get("result_cache_hit")),
            prefix_tokens=int(raw.get("prefix_tokens") or 0),
            text_source=str(raw.get("text_source") or TEXT_FROM_MODEL),
            model_error=raw.get("model_error"),
            model_text=raw.get("model_text"),
            json=raw.get("json"),
        )


# ItemResult fields left out of the stored JSON while they hold these (the common case).
_LEFT_OUT = (("repetition", None), ("text_source", TEXT_FROM_MODEL), ("model_error", None),
             ("model_text", None), ("json", None))
FINISH_STOP = "stop"
# ...and, in the stored form only (ItemResult.stored; exports keep them), these: a reader
# takes an absent key for its default (PROTOCOL.md section 4).
STORED_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("page", None), ("text", None), ("finish_reason", FINISH_STOP), ("prompt_tokens", 0),
    ("completion_tokens", 0), ("vision_cache_hit", False), ("error", None),
    ("timings", {}), ("custom_id", None), ("result_cache_hit", False), ("prefix_tokens", 0))
# Decimal places of the stored timings: 1 ms.
STORED_TIMING_DIGITS = 3


@dataclass(frozen=True)
class JobSummary:
    """The RQ job's return value once every item is done."""

    items: int
    ok: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    cache_hits: int
    labels: Mapping[str, str] = field(default_factory=dict)  # the job's own, echoed back
    result_cache_hits: int = 0  # items answered from the shared result cache
    # Items that started from a cached prefix, and the prompt tokens that spared the prefill.
    prefix_hits: int = 0
    prefix_tokens_skipped: int = 0
    # Items with text, by where it came from ({"model": 48, "text_layer": 52}).
    text_sources: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The summary; the prefix counts only when not 0 (absent means 0): a finished job
        keeps its summary twice, in its end's fields and JSON, for its whole result_ttl."""
        out = asdict(self)
        out["labels"] = dict(self.labels)
        out["text_sources"] = dict(self.text_sources)
        for name in SUMMARY_LEFT_OUT_AT_0:
            if not out[name]:
                del out[name]
        return out


# JobSummary keys left out while 0 (PROTOCOL.md section 6).
SUMMARY_LEFT_OUT_AT_0 = ("prefix_hits", "prefix_tokens_skipped")


# --- validation -------------------------------------------------------------------------


def _whole(value: Any, path: str, hi: int, message: str) -> int:
    """An integer from 1 to `hi`, refused in PAYLOAD_MESSAGES[message]'s words."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise PayloadError(path, PAYLOAD_MESSAGES[message])
    return value


def _bounded_str(value: Any, path: str, max_len: int, message: str, *,
                 empty: bool = True) -> str:
    """A string of at most `max_len` characters (non-empty unless `empty`), refused in
    PAYLOAD_MESSAGES[message]'s words."""
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value):
        raise PayloadError(path, PAYLOAD_MESSAGES[message])
    return S.check_text(value, path)


def unknown_fields(given: Mapping[str, Any], allowed: frozenset[str]) -> str:
    """The refusal naming the fields of `given` that `allowed` lacks."""
    return PAYLOAD_MESSAGES["unknown_fields"] % sorted(set(given) - allowed)


def _sha256(value: Any, path: str) -> str:
    if not isinstance(value, str) or not SHA256_RE.fullmatch(value):
        raise PayloadError(path, PAYLOAD_MESSAGES["sha256"])
    return value


def _parse_ref(raw: Mapping[str, Any], path: str) -> tuple[Ref, str, int]:
    """A reference's form only. Whether its path stays inside the store is the worker's
    check when it reads the item (stores/backends.py), so a bad reference fails that item
    alone, not the job."""
    if "blob" in raw:
        raise PayloadError(path, PAYLOAD_MESSAGES["blob_and_ref"])
    ref = raw["ref"]
    if type(ref) is not dict and not isinstance(ref, Mapping):
        raise PayloadError(f"{path}.ref", PAYLOAD_MESSAGES["ref_object"])
    if not _REF_FIELDS.issuperset(ref):
        raise PayloadError(f"{path}.ref", unknown_fields(ref, _REF_FIELDS))
    store = ref.get("store")
    if not isinstance(store, str) or not STORE_NAME_RE.fullmatch(store):
        raise PayloadError(f"{path}.ref.store", PAYLOAD_MESSAGES["store"])
    rel = _bounded_str(ref.get("path"), f"{path}.ref.path", MAX_REF_PATH_CHARS, "ref_path",
                       empty=False)
    if "size" not in raw:
        raise PayloadError(f"{path}.size", PAYLOAD_MESSAGES["size_missing"])
    size = _whole(raw["size"], f"{path}.size", MAX_REF_SIZE, "size")
    return Ref(store=store, path=rel), _sha256(raw.get("sha256"), f"{path}.sha256"), size


# The fields an item and its ref may have. The checks below run once per item of every job
# a producer enqueues and a worker takes (a 1 M-file set: a million), hence the dict fast
# paths and no set built per item.
_ITEM_FIELDS = frozenset({"kind", "blob", "ref", "sha256", "size", "source", "page",
                          "custom_id", "prompt"})
_REF_FIELDS = frozenset({"store", "path"})


def _parse_item(raw: Any, path: str) -> Item:
    if type(raw) is not dict and not isinstance(raw, Mapping):
        raise PayloadError(path, PAYLOAD_MESSAGES["not_object"])
    if not _ITEM_FIELDS.issuperset(raw):
        raise PayloadError(path, unknown_fields(raw, _ITEM_FIELDS))
    kind = raw.get("kind")
    if kind not in C.ITEM_KINDS:
        raise PayloadError(f"{path}.kind", PAYLOAD_MESSAGES["kind"])
    if kind == C.TEXT_KIND:
        return _text_item(raw, path)
    blob: str | None = None
    ref: Ref | None = None
    sha: str | None = None
    size: int | None = None
    if "ref" in raw:
        ref, sha, size = _parse_ref(raw, path)
        default_source = ref.path
    else:
        for name in ("sha256", "size"):
            if name in raw:
                raise PayloadError(f"{path}.{name}", PAYLOAD_MESSAGES["only_with_ref"])
        blob = _sha256(raw.get("blob"), f"{path}.blob")
        default_source = blob[:12]
    page: int | None = None
    if kind in C.PAGED_KINDS:
        if raw.get("page") is None:
            raise PayloadError(f"{path}.page", PAYLOAD_MESSAGES["page_missing"] % kind)
        page = _whole(raw["page"], f"{path}.page", C.MAX_TIFF_PAGES, "page")
    elif raw.get("page") is not None:
        raise PayloadError(f"{path}.page", PAYLOAD_MESSAGES["page_not_paged"])
    source, custom_id = _source_and_id(raw, path, default_source)
    return Item(kind=kind, blob=blob, source=source, page=page, custom_id=custom_id,
                ref=ref, size=size, ref_sha256=sha, prompt=_item_prompt(raw, path))


def _item_prompt(raw: Mapping[str, Any], path: str) -> str | None:
    """An item's own prompt: the job's prompt setting's rules, and not empty (an item that
    uses the job's prompt leaves the field out)."""
    value = raw.get("prompt")
    if value is None:
        return None
    prompt: str | None = S.BY_NAME["prompt"].check(value, f"{path}.prompt")
    if not prompt:
        raise PayloadError(f"{path}.prompt", PAYLOAD_MESSAGES["prompt_empty"])
    return prompt


def _source_and_id(raw: Mapping[str, Any], path: str, default_source: str
                   ) -> tuple[str, str | None]:
    """An item's source (`default_source` when it has none) and its custom_id, if any."""
    source = _bounded_str(raw.get("source", default_source), f"{path}.source",
                          C.MAX_SOURCE_CHARS, "source")
    custom_id = raw.get("custom_id")
    if custom_id is not None:
        custom_id = _bounded_str(custom_id, f"{path}.custom_id", C.MAX_CUSTOM_ID_CHARS,
                                 "custom_id")
    return source, custom_id


def _text_item(raw: Mapping[str, Any], path: str) -> Item:
    """A text item: nothing to read, so none of an input's fields."""
    for name in ("blob", "ref", "sha256", "size", "page"):
        if raw.get(name) is not None:
            raise PayloadError(f"{path}.{name}", PAYLOAD_MESSAGES["text_input"])
    source, custom_id = _source_and_id(raw, path, C.TEXT_KIND)
    return Item(kind=C.TEXT_KIND, blob=None, source=source, custom_id=custom_id,
                prompt=_item_prompt(raw, path))


def _check_text_items(task: str, items: tuple[Item, ...]) -> None:
    """ocr and caption read an image: a text item would give them nothing."""
    if task in C.TEXT_TASKS:
        return
    for i, item in enumerate(items):
        if item.kind == C.TEXT_KIND:
            raise PayloadError(f"items[{i}].kind", PAYLOAD_MESSAGES["text_task"] % task)


def _check_fields(raw: Mapping[str, Any]) -> None:
    """Unknown fields are refused, not ignored: a misspelt setting must not silently run
    with the default."""
    allowed = S.WIRE_FIELDS
    if not allowed.keys() >= raw.keys():
        raise PayloadError("payload", unknown_fields(raw, frozenset(allowed)))
    for name, inner in allowed.items():
        value = raw.get(name)
        if not inner or value is None:
            continue
        if not isinstance(value, Mapping):
            raise PayloadError(name, PAYLOAD_MESSAGES["not_object"])
        if not inner >= value.keys():
            raise PayloadError(name, unknown_fields(value, frozenset(inner)))


def parse_payload(raw: Any) -> JobPayload:
    """Turn decoded JSON into a JobPayload, or raise one PayloadError naming the field."""
    if not isinstance(raw, Mapping):
        raise PayloadError("payload", f"must be a JSON object, got {type(raw).__name__}")
    version = raw.get("v")
    if version != C.PROTOCOL_VERSION or isinstance(version, bool):
        raise PayloadError("v", PAYLOAD_MESSAGES["version"] % repr(version))
    _check_fields(raw)
    task = raw.get("task")
    if task not in C.TASKS:
        raise PayloadError("task", PAYLOAD_MESSAGES["task"])
    items_raw = raw.get("items")
    if not isinstance(items_raw, list) or not items_raw:
        raise PayloadError("items", PAYLOAD_MESSAGES["items"])
    if len(items_raw) > C.MAX_ITEMS_PER_JOB:
        raise PayloadError("items", PAYLOAD_MESSAGES["max_items"])
    items = tuple(_parse_item(it, f"items[{i}]") for i, it in enumerate(items_raw))
    settings = S.values_from_wire(raw)
    extract_schema.check_task(task, settings.get("schema"))  # extract needs one; others none
    if task == C.PROMPT_TASK and not settings.get("prompt") and not settings.get("messages"):
        raise PayloadError("prompt", PAYLOAD_MESSAGES["prompt_required"])
    _check_text_items(task, items)
    created_at = S.check_str(raw.get("created_at") or utc_now_iso(), "created_at", 64)
    return JobPayload(task=task, items=items, settings=settings, created_at=created_at)
