"""`vlmq api --metrics-port N`: the API's own Prometheus endpoint, for its chat requests.

The worker counts what it generates; only the API sees a request from its client's side:
how it ended (a refusal never reaches a worker), the time from the request's arrival to
its first token (enqueue, the queue, the worker's prefill and the token stream's hop
through Redis, all of it), and the tokens per second its client received. Served as the
worker's endpoint is: prometheus_client's own HTTP server on a registry of its own, on
127.0.0.1 unless told otherwise, without a key (put it behind your network's rules).

Every label value is known in advance, so every series is there from the first scrape, at 0.
"""

from __future__ import annotations

import errno
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# vLLM's time-to-first-token buckets, as the worker's (worker/metrics.py) use them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKENS_PER_S_BUCKETS = tuple(float(m * 10 ** e) for e in range(5) for m in (1, 2, 5))
# How a request ended: the model stopped (an end token or a stop string) or hit its
# max_tokens; the worker failed it or died; it was cancelled by someone else, or by its
# client going away; it was refused (4xx) or no worker could take it (503).
OUTCOMES = ("stop", "length", "error", "cancelled", "disconnected", "refused",
            "unavailable")
STREAMS = ("true", "false")


class ChatMetrics:
    """The API's chat figures and (once served) their HTTP server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmq_api_chat_requests", "Chat completion requests, by "
                                "whether they streamed and how they ended.",
                                ("stream", "outcome"), registry=self.registry)
        self.ttft = Histogram("vlmq_api_chat_ttft_seconds", "Seconds from a chat request's "
                              "arrival to its first token, as its client sees it.",
                              ("stream",), buckets=TTFT_BUCKETS, registry=self.registry)
        self.tokens_per_s = Histogram("vlmq_api_chat_tokens_per_second", "Completion tokens "
                                      "per second after the first token, per request of "
                                      "more than one token.", ("stream",),
                                      buckets=TOKENS_PER_S_BUCKETS, registry=self.registry)
        for stream in STREAMS:
            for outcome in OUTCOMES:
                self.requests.labels(stream, outcome)
            self.ttft.labels(stream)
            self.tokens_per_s.labels(stream)
        self._server: WSGIServer | None = None

    def ended(self, stream: bool, outcome: str) -> None:
        self.requests.labels(_flag(stream), outcome).inc()

    def first_token(self, stream: bool, seconds: float) -> None:
        self.ttft.labels(_flag(stream)).observe(seconds)

    def rate(self, stream: bool, tokens: int, seconds: float) -> None:
        """The decode rate after the first token (one token has none)."""
        if tokens > 1 and seconds > 0:
            self.tokens_per_s.labels(_flag(stream)).observe((tokens - 1) / seconds)

    def serve(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); the port listened on. OSError with
        the reason when the port is taken."""
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"port {port} is in use: pick another "
                                         "--metrics-port") from exc
            raise
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _flag(stream: bool) -> str:
    return "true" if stream else "false"
