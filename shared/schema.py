"""Protocol v1 schemas: the job payload and the per-item result.

Payloads come from producers in any language, so validation is strict and every
error names the JSON path of the field that is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import SHA256_RE


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Item:
    """One unit of work: an image, or one page of a PDF."""

    kind: str
    blob: str
    source: str
    page: int | None = None
    # The caller's own name for this item (batch-API style), echoed in its result.
    custom_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "blob": self.blob, "source": self.source}
        if self.page is not None:
            out["page"] = self.page
        if self.custom_id is not None:
            out["custom_id"] = self.custom_id
        return out


@dataclass(frozen=True)
class Generation:
    """Sampling settings; None means 'use the model's default from the worker's table'."""

    max_tokens: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "stop": list(self.stop)}


@dataclass(frozen=True)
class JobPayload:
    task: str
    items: tuple[Item, ...]
    prompt: str | None = None
    generation: Generation = field(default_factory=Generation)
    model: str | None = None
    max_side: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    created_at: str = field(default_factory=utc_now_iso)
    v: int = C.PROTOCOL_VERSION
    # Worker result cache: "on" (deterministic items only), "off", or "sampled" (also
    # items generated with temperature > 0). On the wire: absent/true, false, "sampled".
    result_cache: str = "on"

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "task": self.task,
            "items": [i.to_dict() for i in self.items],
            "prompt": self.prompt,
            "generation": self.generation.to_dict(),
            "model": self.model,
            "max_side": self.max_side,
            "labels": dict(self.labels),
            "created_at": self.created_at,
            # Omitted when "on", so payloads without the option stay byte-identical.
            **({} if self.result_cache == "on" else
               {"result_cache": "sampled" if self.result_cache == "sampled" else False}),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> JobPayload:
        return parse_payload(raw)


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

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ItemResult:
        return cls(
            index=int(raw["index"]),
            source=str(raw["source"]),
            page=None if raw.get("page") is None else int(raw["page"]),
            text=raw.get("text"),
            finish_reason=raw.get("finish_reason"),
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            vision_cache_hit=bool(raw.get("vision_cache_hit")),
            error=raw.get("error"),
            timings={str(k): float(v) for k, v in (raw.get("timings") or {}).items()},
            custom_id=None if raw.get("custom_id") is None else str(raw["custom_id"]),
            repetition=raw.get("repetition"),
            result_cache_hit=bool(raw.get("result_cache_hit")),
        )


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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["labels"] = dict(self.labels)
        return out


# --- validation -------------------------------------------------------------------------

_TOP_KEYS = {"v", "task", "items", "prompt", "generation", "model", "max_side", "labels",
             "created_at", "result_cache"}


def _int(value: Any, path: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(path, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PayloadError(path, f"must be between {lo} and {hi}, got {value}")
    return value


def _str(value: Any, path: str, max_len: int, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise PayloadError(path, f"must be a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise PayloadError(path, f"is longer than {max_len} characters")
    _check_text(value, path)
    return value


def _check_text(value: str, path: str) -> None:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer or UTF-8 writer accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise PayloadError(path, f"is not valid UTF-8 text (a lone surrogate U+{ord(bad):04X} "
                                 f"at character {exc.start})") from None


def _parse_item(raw: Any, path: str) -> Item:
    if not isinstance(raw, Mapping):
        raise PayloadError(path, f"must be an object, got {type(raw).__name__}")
    unknown = set(raw) - {"kind", "blob", "source", "page", "custom_id"}
    if unknown:
        raise PayloadError(path, f"unknown field(s) {sorted(unknown)}")
    kind = raw.get("kind")
    if kind not in C.ITEM_KINDS:
        raise PayloadError(f"{path}.kind", f"must be one of {list(C.ITEM_KINDS)}, got {kind!r}")
    blob = raw.get("blob")
    if not isinstance(blob, str) or not SHA256_RE.fullmatch(blob):
        raise PayloadError(f"{path}.blob", "must be a lowercase hex sha256 (64 characters)")
    source = _str(raw.get("source", blob[:12]), f"{path}.source", 4096)
    assert source is not None
    page: int | None = None
    if kind == "pdf":
        if "page" not in raw:
            raise PayloadError(f"{path}.page", "is required for a pdf item (1-based)")
        page = _int(raw["page"], f"{path}.page", 1, 1_000_000)
    elif raw.get("page") is not None:
        raise PayloadError(f"{path}.page", "is only allowed on pdf items")
    custom_id = _str(raw.get("custom_id"), f"{path}.custom_id", C.MAX_CUSTOM_ID_CHARS,
                     optional=True)
    return Item(kind=kind, blob=blob, source=source, page=page, custom_id=custom_id)


def _parse_generation(raw: Any) -> Generation:
    if raw is None:
        return Generation()
    if not isinstance(raw, Mapping):
        raise PayloadError("generation", f"must be an object, got {type(raw).__name__}")
    unknown = set(raw) - {"max_tokens", "temperature", "stop"}
    if unknown:
        raise PayloadError("generation", f"unknown field(s) {sorted(unknown)}")
    max_tokens = _int(raw.get("max_tokens"), "generation.max_tokens", 1, C.MAX_TOKENS_LIMIT,
                      optional=True)
    temp_raw = raw.get("temperature")
    temperature: float | None = None
    if temp_raw is not None:
        if isinstance(temp_raw, bool) or not isinstance(temp_raw, (int, float)):
            raise PayloadError("generation.temperature", "must be a number")
        temperature = float(temp_raw)
        if not math.isfinite(temperature) or not 0.0 <= temperature <= C.MAX_TEMPERATURE:
            raise PayloadError("generation.temperature",
                               f"must be between 0 and {C.MAX_TEMPERATURE:g}")
    stop_raw = raw.get("stop") or []
    if not isinstance(stop_raw, list):
        raise PayloadError("generation.stop", "must be a list of strings")
    if len(stop_raw) > C.MAX_STOP_STRINGS:
        raise PayloadError("generation.stop", f"has more than {C.MAX_STOP_STRINGS} entries")
    stop: list[str] = []
    for i, s in enumerate(stop_raw):
        text = _str(s, f"generation.stop[{i}]", 256)
        if not text:
            raise PayloadError(f"generation.stop[{i}]", "must not be empty")
        stop.append(text)
    return Generation(max_tokens=max_tokens, temperature=temperature, stop=tuple(stop))


def parse_payload(raw: Any) -> JobPayload:
    """Turn decoded JSON into a JobPayload, or raise one PayloadError naming the field."""
    if not isinstance(raw, Mapping):
        raise PayloadError("payload", f"must be a JSON object, got {type(raw).__name__}")
    if raw.get("v") != C.PROTOCOL_VERSION:
        raise PayloadError("v", f"unsupported protocol version {raw.get('v')!r}; "
                                f"this worker speaks v{C.PROTOCOL_VERSION}")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise PayloadError("payload", f"unknown field(s) {sorted(unknown)}")
    task = raw.get("task")
    if task not in C.TASKS:
        raise PayloadError("task", f"must be one of {list(C.TASKS)}, got {task!r}")
    items_raw = raw.get("items")
    if not isinstance(items_raw, list) or not items_raw:
        raise PayloadError("items", "must be a non-empty list")
    if len(items_raw) > C.MAX_ITEMS_PER_JOB:
        raise PayloadError("items", f"has more than {C.MAX_ITEMS_PER_JOB} entries")
    items = tuple(_parse_item(it, f"items[{i}]") for i, it in enumerate(items_raw))
    prompt = _str(raw.get("prompt"), "prompt", C.MAX_PROMPT_CHARS, optional=True)
    if task == "generate" and not prompt:
        raise PayloadError("prompt", "is required for task 'generate'")
    model = _str(raw.get("model"), "model", 512, optional=True)
    lo, hi = C.MAX_SIDE_RANGE
    max_side = _int(raw.get("max_side"), "max_side", lo, hi, optional=True)
    labels_raw = raw.get("labels") or {}
    if not isinstance(labels_raw, Mapping):
        raise PayloadError("labels", "must be an object of string values")
    if len(labels_raw) > C.MAX_LABELS:
        raise PayloadError("labels", f"has more than {C.MAX_LABELS} entries")
    labels: dict[str, str] = {}
    for k, val in labels_raw.items():
        if not isinstance(val, str):
            raise PayloadError(f"labels.{k}", "must be a string")
        _check_text(str(k), "labels")
        _check_text(val, f"labels.{k}")
        labels[str(k)] = val
    result_cache = _parse_result_cache(raw.get("result_cache"))
    created_at = _str(raw.get("created_at") or utc_now_iso(), "created_at", 64)
    assert created_at is not None
    return JobPayload(
        task=task,
        items=items,
        prompt=prompt or None,
        generation=_parse_generation(raw.get("generation")),
        model=model or None,
        max_side=max_side,
        labels=labels,
        created_at=created_at,
        result_cache=result_cache,
    )


def _parse_result_cache(value: Any) -> str:
    if value is None or value is True:
        return "on"
    if value is False:
        return "off"
    if value == "sampled":
        return "sampled"
    raise PayloadError("result_cache", f'must be true, false or "sampled", got {value!r}')
