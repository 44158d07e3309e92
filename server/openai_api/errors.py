"""Every refusal in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so
the SDKs raise their typed errors (BadRequestError, AuthenticationError, NotFoundError...)
with the message vlmq wrote."""

from __future__ import annotations

from typing import Any

# OpenAI's error types by status (what its API answers for each).
TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
         403: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 409: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error", 503: "server_error"}


class ApiError(Exception):
    """A request vlmq refuses: its status, and what the error body says; `retry_after`
    (seconds) goes out as the Retry-After header, which the SDKs wait for; `retry=False`
    as `x-should-retry: false`, which tells the SDKs not to retry (an error that must
    reach the caller at once)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None,
                 retry: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.retry = retry

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def headers(self) -> list[tuple[str, str]]:
        """The headers every refusal carries, whoever sends it (Flask or the server)."""
        out = [("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")]
        if self.retry_after is not None:
            out.append(("Retry-After", str(self.retry_after)))
        if self.retry is not None:
            out.append(("x-should-retry", "true" if self.retry else "false"))
        return out


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def not_found(kind: str, some_id: str) -> ApiError:
    """The answer for an id that is not the caller's: the same whether it exists for
    another key or not at all, so ids of others cannot be probed."""
    return ApiError(404, f"No such {kind}: '{some_id[:200]}'", param="id",
                    code=None)
