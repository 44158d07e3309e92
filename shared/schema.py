"""Protocol v1 schemas: the job payload and the per-item result.

Payloads come from producers in any language, so validation is strict and every
error names the JSON path of the field that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared import settings as S
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


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(path, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PayloadError(path, f"must be between {lo} and {hi}, got {value}")
    return value


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
    source = S.check_str(raw.get("source", blob[:12]), f"{path}.source", 4096)
    page: int | None = None
    if kind == "pdf":
        if "page" not in raw:
            raise PayloadError(f"{path}.page", "is required for a pdf item (1-based)")
        page = _int(raw["page"], f"{path}.page", 1, 1_000_000)
    elif raw.get("page") is not None:
        raise PayloadError(f"{path}.page", "is only allowed on pdf items")
    custom_id = raw.get("custom_id")
    if custom_id is not None:
        custom_id = S.check_str(custom_id, f"{path}.custom_id", C.MAX_CUSTOM_ID_CHARS)
    return Item(kind=kind, blob=blob, source=source, page=page, custom_id=custom_id)


def _check_fields(raw: Mapping[str, Any]) -> None:
    """Unknown fields are refused, not ignored: a misspelt setting must not silently run
    with the default."""
    allowed = S.wire_fields()
    unknown = set(raw) - set(allowed)
    if unknown:
        raise PayloadError("payload", f"unknown field(s) {sorted(unknown)}")
    for name, inner in allowed.items():
        value = raw.get(name)
        if not inner or value is None:
            continue
        if not isinstance(value, Mapping):
            raise PayloadError(name, f"must be an object, got {type(value).__name__}")
        extra = set(value) - inner
        if extra:
            raise PayloadError(name, f"unknown field(s) {sorted(extra)}")


def parse_payload(raw: Any) -> JobPayload:
    """Turn decoded JSON into a JobPayload, or raise one PayloadError naming the field."""
    if not isinstance(raw, Mapping):
        raise PayloadError("payload", f"must be a JSON object, got {type(raw).__name__}")
    if raw.get("v") != C.PROTOCOL_VERSION:
        raise PayloadError("v", f"unsupported protocol version {raw.get('v')!r}; "
                                f"this worker speaks v{C.PROTOCOL_VERSION}")
    _check_fields(raw)
    task = raw.get("task")
    if task not in C.TASKS:
        raise PayloadError("task", f"must be one of {list(C.TASKS)}, got {task!r}")
    items_raw = raw.get("items")
    if not isinstance(items_raw, list) or not items_raw:
        raise PayloadError("items", "must be a non-empty list")
    if len(items_raw) > C.MAX_ITEMS_PER_JOB:
        raise PayloadError("items", f"has more than {C.MAX_ITEMS_PER_JOB} entries")
    items = tuple(_parse_item(it, f"items[{i}]") for i, it in enumerate(items_raw))
    settings = S.values_from_wire(raw)
    if task == "generate" and not settings.get("prompt"):
        raise PayloadError("prompt", "is required for task 'generate'")
    created_at = S.check_str(raw.get("created_at") or utc_now_iso(), "created_at", 64)
    return JobPayload(task=task, items=items, settings=settings, created_at=created_at)
