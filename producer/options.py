"""The job options: the CLI, manifests, schedules, retries and the Python client all build
a JobOptions, whose fields are the rows of shared/settings.py (the CLI's flags for them are
built from the same rows in cli/options.py).

A JobOptions keeps only the settings that were given (checked when it is built), so it
turns into the payload in one step and a retry can copy every setting by walking the table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared import extract_schema
from vlmq.shared import settings as S
from vlmq.shared.errors import PayloadError
from vlmq.shared.messages import Item, JobPayload, parse_payload

MAX_TTL_S = S.MAX_TTL_S
# Fields of the RQ job hash that hold settings kept outside the payload (for retries).
JOB_FIELDS: tuple[str, ...] = tuple(s.job_field for s in S.rows("retry") if s.job_field)


class JobOptions:
    """How a job's items are processed and kept. Reading a setting that was not given
    gives its row's default (None: the model's or the worker's own)."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", S.check_values(values))

    def __getattr__(self, name: str) -> Any:
        setting = S.BY_NAME.get(name)
        if setting is None:
            raise AttributeError(name)
        return self._values.get(name, setting.default)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("JobOptions is immutable; use with_()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobOptions) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"JobOptions({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    @property
    def given(self) -> Mapping[str, Any]:
        """The settings given, by name (defaults left out)."""
        return dict(self._values)

    @classmethod
    def build(cls, **values: Any) -> JobOptions:
        """From keyword values where None means "not given" (click passes every option)."""
        return cls(**{k: v for k, v in values.items() if v is not None})

    def with_(self, **changes: Any) -> JobOptions:
        return JobOptions(**{**self._values, **changes})

    def queue_for(self, task: str) -> str:
        return str(self.queue) if self.queue is not None else C.DEFAULT_QUEUE[task]

    def key(self) -> tuple[Any, ...]:
        """What must be equal for two requests to share one job (all but the inputs)."""
        return tuple((k, _frozen(v, S.BY_NAME[k].kind)) for k, v in sorted(self._values.items()))


    def payload(self, task: str, items: Sequence[Item]) -> tuple[dict[str, Any], JobPayload]:
        """The wire payload and its parsed form: the check a worker runs, done here so a
        bad option fails with the field named and Redis untouched."""
        wire = JobPayload(task=task, items=tuple(items), settings=self._values).to_dict()
        return wire, parse_payload(wire)

    @classmethod
    def of_job(cls, payload: JobPayload, job_fields: Mapping[str, str]) -> JobOptions:
        """Every setting a retry carries: from the payload, and from the RQ job's hash
        (`job_fields`, decoded) for the settings kept there."""
        values: dict[str, Any] = {}
        for setting in S.rows("retry"):
            raw = job_fields.get(setting.job_field or "")
            if setting.wire:
                values[setting.name] = payload.settings.get(setting.name)
            elif raw and setting.kind == "int":
                values[setting.name] = int(raw) if raw.isdigit() and int(raw) > 0 else None
            elif raw:
                values[setting.name] = raw
        return cls.build(**values)


def _frozen(value: Any, kind: str) -> Any:
    if kind == "schema":  # nested, and its key order is the order the model writes
        return extract_schema.schema_text(value)
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    return tuple(value) if isinstance(value, list) else value


# A schema file may be pretty-printed, so it may be larger than the cap on its compact
# JSON; past this it is refused unread.
MAX_SCHEMA_FILE_BYTES = 16 * C.MAX_SCHEMA_BYTES


def read_schema_file(path: str | Path) -> dict[str, Any]:
    """A JSON Schema file (`--schema FILE`, a manifest's "schema": "FILE"), checked as the
    worker will check it; PayloadError names the file and the problem."""
    where = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SCHEMA_FILE_BYTES + 1)
    except OSError as exc:
        raise PayloadError(where, f"cannot read the schema: {exc.strerror or exc}") from None
    if len(raw) > MAX_SCHEMA_FILE_BYTES:
        raise PayloadError(where, f"is over {MAX_SCHEMA_FILE_BYTES} bytes; a schema is at "
                                  f"most {C.MAX_SCHEMA_BYTES} bytes of compact JSON")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PayloadError(where, f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
                           ) from None
    except (ValueError, RecursionError) as exc:
        raise PayloadError(where, f"is not JSON: {exc}") from None
    return extract_schema.check_schema(value, where)
