"""An interactive job's token stream: what the engine decoded, appended as it comes.

A job with the `stream` setting gets `<prefix>:job:<id>:tokens` (Keys.job_tokens): one
Delta entry per engine step that decoded whole characters of its item, then one End
entry once the item's result is stored, so a reader that sees End finds the result there
too (shared/chat.py has the entry format, PROTOCOL.md section 3b the rules). The last
Delta carries what the engine had not reported yet (text held back at the end, a result
answered by the result cache), so the Deltas always add up to the item's text.

The main thread writes every entry, buffered for one pipeline per loop turn; the engine's
thread only reports text (worker/engine/batcher.py Streamed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import chat
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.messages import ItemResult
from vlmq.worker.jobs.running import Running

log = logging.getLogger("vlmq.worker")

# An End entry's finish reason for each of an item result's.
END_REASONS = {"stop": "stop", "length": "length", "repetition": "length",
               "cancelled": "cancelled", "error": "error"}


def end_of(res: ItemResult) -> chat.End:
    """The End entry for a stored item result."""
    reason = ("error" if res.error is not None
              else END_REASONS.get(res.finish_reason or "stop", "stop"))
    return chat.End(reason, res.prompt_tokens, res.completion_tokens, res.error)


class TokenStreams:
    """The token streams of the jobs in flight that asked for one."""

    def __init__(self, redis: Redis, keys: Keys, *, running_ttl_s: int) -> None:
        """`running_ttl_s`: how long a stream lives past its last entry while its job
        runs (refreshed by each entry; cut to TOKEN_STREAM_TTL_S by the End)."""
        self.redis = redis
        self.keys = keys
        self.running_ttl_s = running_ttl_s
        self._sent: dict[str, list[str]] = {}  # job id -> the Delta texts written
        self._buffer: list[tuple[str, chat.Delta | chat.End]] = []

    def delta(self, state: Running, text: str) -> bool:
        """Queue a Delta for `state`'s stream (if it has one); True when queued."""
        if not text or not state.resolved.stream:
            return False
        self._sent.setdefault(state.job_id, []).append(text)
        self._buffer.append((state.job_id, chat.Delta(text)))
        return True

    def ended(self, state: Running, results: Iterable[ItemResult]) -> None:
        """The job's item result is stored: its last Delta (what was not sent yet), then
        End. The text sent must be the start of the result's: if a tokenizer's streaming
        text ever differs from its whole decode, the End says so rather than let the
        stream and the result disagree silently."""
        if not state.resolved.stream:
            return
        for res in results:
            sent = "".join(self._sent.pop(state.job_id, []))
            text = res.text or ""
            end = end_of(res)
            if text.startswith(sent):
                if text[len(sent):]:
                    self._buffer.append((state.job_id, chat.Delta(text[len(sent):])))
            else:
                log.error("job %s: the streamed text is not the start of the answer; the "
                          "item result has the answer", state.job_id,
                          extra=job_fields(state.job_id))
                end = chat.End("error", end.prompt_tokens, end.completion_tokens,
                               "the streamed text differs from the answer: read the result")
            self._buffer.append((state.job_id, end))

    def cancelled(self, state: Running) -> None:
        """The job was cancelled while it ran: its stream ends so."""
        self._sent.pop(state.job_id, None)
        if state.payload.get("stream"):
            self._buffer.append((state.job_id, chat.End("cancelled")))

    def failed(self, state: Running, message: str) -> None:
        """The job failed as a whole (its timeout, an unwritable result): its stream ends
        with the reason, so that a reader never waits on a job that is over."""
        self._sent.pop(state.job_id, None)
        if state.payload.get("stream"):  # its settings may never have been resolved
            self._buffer.append((state.job_id, chat.End("error", error=message)))

    def forget(self, job_id: str) -> None:
        """A job that ended otherwise (failed, dropped): nothing more is sent for it."""
        self._sent.pop(job_id, None)

    def flush(self) -> None:
        """Write what is queued, in order, in one pipeline."""
        if not self._buffer:
            return
        entries, self._buffer = self._buffer, []
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id, entry in entries:
                key = self.keys.job_tokens(job_id)
                pipe.xadd(key, chat.encode(entry),  # type: ignore[arg-type]
                          maxlen=chat.TOKEN_STREAM_MAXLEN, approximate=True)
                ended = isinstance(entry, chat.End)
                pipe.expire(key, chat.TOKEN_STREAM_TTL_S if ended else self.running_ttl_s)
            try:
                pipe.execute()
            except RedisError:
                self._buffer = entries + self._buffer  # sent again once Redis is back
                raise
