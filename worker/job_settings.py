"""A job's settings as its items really run: resolved once, when the worker takes the job.

The job's own values win; what it leaves unset comes from the served checkpoint's preset,
else its model type's row (worker/model/defaults.py). check_job, the Preparer, the result
cache and the engine Request all read this one object, so the result-cache key can never
describe other settings than the ones the item was generated with.

Every field is a job setting of shared/settings.py's table, named as its row: the defaults
and which fields decide an item's text (the result-cache key) are read from the rows, so
the worker holds no second copy of either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared import extract_schema
from vlmq.shared import settings as S
from vlmq.shared.chat import Message
from vlmq.shared.messages import Item, JobPayload
from vlmq.worker.model.defaults import Resolved, resolve

# olmOCR renders pages at 1288 px on the longest side; a sound default for OCR models.
DEFAULT_PDF_MAX_SIDE = 1288
# Images larger than this are shrunk before the processor sees them (it bounds pixels too).
DEFAULT_IMAGE_MAX_SIDE = 2048


def _default(name: str) -> Any:
    """The settings row's default: the one a job that leaves `name` unset gets."""
    return S.BY_NAME[name].default


@dataclass(frozen=True)
class JobSettings(Resolved):
    """The generation settings (Resolved) plus the rest of what the job's items run with."""

    max_side: int | None = _default("max_side")  # None: the worker's default for the kind
    result_cache: str = _default("result_cache")  # a choice of the row
    blob_ttl: int = _default("blob_ttl")
    text_layer: str = _default("text_layer")  # PDF pages only
    # extract: the JSON Schema every item's value obeys, as its canonical text (hashable,
    # and what the result-cache key and the matcher's grammar cache hold)
    schema: str | None = _default("schema")
    # An interactive request's conversation: its items' prompt is rendered from it with
    # the model's chat template, in place of `prompt` (shared/chat.py).
    messages: tuple[Message, ...] | None = _default("messages")
    stream: bool = _default("stream")  # the answer goes to the job's token stream too

    def deciding_text(self, kind: str) -> dict[str, Any]:
        """Every setting that can change an item's text, as the result-cache key holds
        them: a field added here is in the key unless its row does not decide text."""
        out = {k: v for k, v in asdict(self).items() if k not in NOT_DECIDING_TEXT}
        out["max_side"] = self.side_for(kind)
        if kind != "pdf":  # only a PDF page has a text layer: other items share one key
            del out["text_layer"]
        return out

    @property
    def prompt_or_messages(self) -> str | tuple[Message, ...]:
        """What the item's prompt is rendered from: the conversation when the job has one."""
        return self.messages if self.messages is not None else self.prompt

    def for_item(self, item: Item) -> JobSettings:
        """The settings `item` runs with: its own prompt, where it carries one, in place of
        the job's (so the preparer and the result-cache key read one object per item)."""
        return self if item.prompt is None else replace(self, prompt=item.prompt)

    def side_for(self, kind: str) -> int:
        if self.max_side is not None:
            return self.max_side
        # A TIFF page is a document page (a scan, a fax), sized as a PDF page is.
        return DEFAULT_PDF_MAX_SIDE if kind in C.PAGED_KINDS else DEFAULT_IMAGE_MAX_SIDE


# JobSettings fields that leave an item's text as it is (kept out of the result-cache key):
# those whose row does not decide text. A field that is no row is a KeyError at import.
NOT_DECIDING_TEXT = frozenset(f.name for f in fields(JobSettings)
                              if not S.BY_NAME[f.name].decides_text)
# The fields a job's payload gives as they are (Resolved's come from the model's rows, the
# schema as its canonical text).
_AS_GIVEN = tuple(f.name for f in fields(JobSettings)
                  if f.name not in {g.name for g in fields(Resolved)} | {"schema"})


def resolve_job(payload: JobPayload, model_type: str, model_id: str | None) -> JobSettings:
    """The settings `payload`'s items run with on this model; ValueError when the job
    cannot run here (a task with no prompt for this model type)."""
    schema = payload.get("schema")
    prompt = payload.get("prompt")
    if payload.task == "extract" and not prompt and schema is not None:
        prompt = extract_schema.default_prompt(schema)
    messages = payload.get("messages")
    # A conversation needs no prompt of the job's or the model's: its last (user) turn
    # stands for it where one is shown.
    given = prompt or (messages[-1].content or " " if messages else None)
    res = resolve(model_type, payload.task, given, payload.get("max_tokens"),
                  payload.get("temperature"), payload.get("stop"), model_id=model_id)
    return JobSettings(**asdict(res), **{name: payload.get(name) for name in _AS_GIVEN},
                       schema=None if schema is None else extract_schema.schema_text(schema))
