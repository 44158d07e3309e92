"""The job options, defined once: the CLI and the Python client both build a JobOptions.

Everything about a job except its inputs lives here, so a new option is added in one
place (plus its click flag) and reaches the payload, the RQ job and the blobs alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.jobs import check_job_id, check_queue_name
from vlmq.shared.schema import Generation, Item, JobPayload, parse_payload

# Longest a result or blob may be kept: RQ stores TTLs as seconds, and a year is far past
# any bulk run while still catching a milliseconds-for-seconds mistake.
MAX_TTL_S = 366 * 24 * 3600


@dataclass(frozen=True)
class JobOptions:
    """How a job's items are processed and kept; None means the model's/worker's default."""

    prompt: str | None = None
    model: str | None = None
    max_side: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    queue: str | None = None  # None: the task's default queue (C.DEFAULT_QUEUE)
    job_id: str | None = None
    result_ttl: int = C.RESULT_TTL_S
    blob_ttl: int = C.BLOB_TTL_S
    # The workers' shared result cache: "on" (temperature 0 only), "off", or "sampled".
    result_cache: str = "on"

    def __post_init__(self) -> None:
        # Accept any sequence/mapping from callers, keep immutable, comparable copies.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "labels", dict(self.labels))
        for name in ("result_ttl", "blob_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not 1 <= value <= MAX_TTL_S:
                raise PayloadError(name, f"must be whole seconds between 1 and {MAX_TTL_S}, "
                                         f"got {value!r}")
        if self.result_cache not in ("on", "off", "sampled"):
            raise PayloadError("result_cache", f'must be "on", "off" or "sampled", '
                                               f"got {self.result_cache!r}")
        if self.queue is not None:
            check_queue_name(self.queue)
        if self.job_id is not None:
            check_job_id(self.job_id)

    @classmethod
    def build(cls, **values: Any) -> JobOptions:
        """From keyword values where None means "not given" (click passes every option)."""
        return cls(**{k: v for k, v in values.items() if v is not None})

    def with_(self, **changes: Any) -> JobOptions:
        return replace(self, **changes)

    def queue_for(self, task: str) -> str:
        return self.queue if self.queue is not None else C.DEFAULT_QUEUE[task]

    def payload(self, task: str, items: Sequence[Item]) -> JobPayload:
        """The validated payload: exactly the check a worker runs, so a bad option fails
        here with the field named and Redis untouched."""
        draft = JobPayload(
            task=task,
            items=tuple(items),
            prompt=self.prompt,
            generation=Generation(max_tokens=self.max_tokens, temperature=self.temperature,
                                  stop=self.stop),
            model=self.model,
            max_side=self.max_side,
            labels=dict(self.labels),
            result_cache=self.result_cache,
        )
        return parse_payload(draft.to_dict())

    def settings_key(self) -> tuple[Any, ...]:
        """What must be equal for two requests to share one job (all but the inputs)."""
        return (self.prompt, self.model, self.max_side, self.max_tokens, self.temperature,
                self.stop, tuple(sorted(self.labels.items())), self.queue, self.result_ttl,
                self.blob_ttl, self.result_cache)
