"""Interactive requests on the wire: a conversation as a job carries it, and the token
stream a worker writes while it answers.

An interactive request is an ordinary vlmq job (one item: the conversation's image, or a
text item when it has none) on the `chat` queue, which every worker serving it takes
before any bulk job. The job's `messages` setting holds the conversation; the worker
renders it with the model's own chat template, the image in the user turn that says
`image: true`. With `stream` set, the worker appends what it decodes to
`<prefix>:job:<id>:tokens` as it decodes it (Delta entries), then one End entry; any
client that speaks Redis can XREAD it (PROTOCOL.md). The job's item result and summary
are written as for any job, so a client that missed the stream still reads the answer.

Pure data and checks: no Redis, no MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlmq.shared.errors import PayloadError

CHAT_QUEUE = "chat"
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 100_000
# The token stream: bounded, and kept a minute after its End entry for a late reader.
TOKEN_STREAM_MAXLEN = 100_000
TOKEN_STREAM_TTL_S = 60
# An End entry's finish reasons, as OpenAI names them, plus vlmq's own two.
FINISH_REASONS = ("stop", "length", "cancelled", "error")

# Field names of a token stream entry.
DELTA_FIELD = "d"
END_FIELD = "end"
PROMPT_TOKENS_FIELD = "prompt_tokens"
COMPLETION_TOKENS_FIELD = "completion_tokens"
ERROR_FIELD = "error"


@dataclass(frozen=True)
class Message:
    """One turn. `image`: the conversation's one image goes at the start of this turn."""

    role: str
    content: str
    image: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.image:
            out["image"] = True
        return out


def check_messages(raw: Any, where: str = "messages") -> tuple[Message, ...]:
    """The conversation as the wire carries it, refused with the place of the first
    problem: a list of {role, content, image?}, at most one turn with the image, and that
    one a user's; the last turn a user's (what the model answers)."""
    if not isinstance(raw, list) or not raw:
        raise PayloadError(where, "must be a non-empty list of messages")
    if len(raw) > MAX_MESSAGES:
        raise PayloadError(where, f"has more than {MAX_MESSAGES} messages")
    out = [_check_message(entry, f"{where}[{i}]") for i, entry in enumerate(raw)]
    if sum(m.image for m in out) > 1:
        raise PayloadError(where, "at most one turn carries the image")
    if out[-1].role != "user":
        raise PayloadError(where, "the last message must be the user's")
    return tuple(out)


def _check_message(entry: Any, here: str) -> Message:
    """One turn of check_messages, refused with its place."""
    if not isinstance(entry, Mapping):
        raise PayloadError(here, "must be an object with role and content")
    extra = set(entry) - {"role", "content", "image"}
    if extra:
        raise PayloadError(here, f"has unknown fields: {', '.join(sorted(map(str, extra)))}")
    role, content, image = entry.get("role"), entry.get("content"), entry.get("image", False)
    if role not in ROLES:
        raise PayloadError(f"{here}.role", f"must be one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise PayloadError(f"{here}.content", "must be a string")
    if len(content) > MAX_MESSAGE_CHARS:
        raise PayloadError(f"{here}.content", f"is longer than {MAX_MESSAGE_CHARS} "
                                              "characters")
    if not isinstance(image, bool):
        raise PayloadError(f"{here}.image", "must be true or false")
    if image and role != "user":
        raise PayloadError(f"{here}.image", "only a user's turn can carry the image")
    return Message(str(role), content, image)


@dataclass(frozen=True)
class Delta:
    """Text decoded since the previous entry."""

    text: str


@dataclass(frozen=True)
class End:
    """The answer is over: why, and what it cost."""

    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def encode(entry: Delta | End) -> dict[str, str]:
    """A token stream entry's fields (XADD)."""
    if isinstance(entry, Delta):
        return {DELTA_FIELD: entry.text}
    out = {END_FIELD: entry.finish_reason, PROMPT_TOKENS_FIELD: str(entry.prompt_tokens),
           COMPLETION_TOKENS_FIELD: str(entry.completion_tokens)}
    if entry.error is not None:
        out[ERROR_FIELD] = entry.error
    return out


def decode(fields: Mapping[bytes | str, bytes | str]) -> Delta | End:
    """An entry read back (bytes or str fields); PayloadError for one no worker writes."""
    text = {(k.decode() if isinstance(k, bytes) else k):
            (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
            for k, v in fields.items()}
    if DELTA_FIELD in text:
        return Delta(text[DELTA_FIELD])
    reason = text.get(END_FIELD)
    if reason not in FINISH_REASONS:
        raise PayloadError("token stream entry", f"is neither a delta nor an end: {text!r}")
    try:
        prompt = int(text.get(PROMPT_TOKENS_FIELD, "0"))
        completion = int(text.get(COMPLETION_TOKENS_FIELD, "0"))
    except ValueError:
        raise PayloadError("token stream entry", "has a token count that is not a "
                                                 "number") from None
    return End(str(reason), prompt, completion, text.get(ERROR_FIELD))
