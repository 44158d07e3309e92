"""Remote images for chat requests: off unless the operator turns them on.

An http(s) image URL makes the server fetch whatever any key holder names, from the
server's own network position (an internal address, a slow or endless body), so `vlmq
api` refuses them by default and fetches them only with `--image-urls`, each within a size
(`--image-url-max-mb`) and a time limit (`--image-url-timeout`: the whole fetch is
checked against it between reads, and no one read waits longer), following redirects
only to http(s). What is fetched is then checked as any inline image is.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPMessage
from typing import IO, Any

from vlmq.server.openai_api.errors import ApiError

MB = 1000 * 1000
DEFAULT_MAX_MB = 20  # OpenAI's limit on one image
DEFAULT_TIMEOUT_S = 10.0
CHUNK = 64 * 1024
MAX_REDIRECTS = 5
OFF = ("remote image URLs are off on this server: send the image inline as a data: URI "
       "(base64); an operator turns them on with `vlmq api --image-urls`")


class _WebOnly(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) only (urllib would follow one to ftp:), a few."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int,
                         msg: str, headers: HTTPMessage, newurl: str
                         ) -> urllib.request.Request | None:
        if not newurl.lower().startswith(("http://", "https://")):
            raise urllib.error.HTTPError(newurl, code, f"Redirection to url '{newurl}' is "
                                         "not allowed (only http(s))", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


@dataclass(frozen=True)
class RemoteImages:
    """How remote images are fetched: at most `max_bytes`, all within `timeout_s`."""

    max_bytes: int = DEFAULT_MAX_MB * MB
    timeout_s: float = DEFAULT_TIMEOUT_S

    def fetch(self, url: str, param: str) -> bytes:
        """The image's bytes; ApiError 400 naming `param` and why it could not be had."""
        deadline = time.monotonic() + self.timeout_s
        opener = urllib.request.build_opener(_WebOnly())
        request = urllib.request.Request(url, headers={"User-Agent": "vlmq-api"})
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                return self._body(response, deadline, param)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise _refused(param, f"the server answered {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", None) or exc
            raise _refused(param, f"it could not be fetched ({why})") from None

    def _body(self, response: Any, deadline: float, param: str) -> bytes:
        announced = response.headers.get("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) > self.max_bytes:
            raise _refused(param, self._too_big(int(announced)))
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _refused(param, f"it took longer than {self.timeout_s:g} s to fetch")
            chunk = response.read1(CHUNK)  # what has come: the deadline is checked often
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise _refused(param, self._too_big(size, at_least=True))
            chunks.append(chunk)

    def _too_big(self, size: int, *, at_least: bool = False) -> str:
        return (f"it is {'over ' if at_least else ''}{size:,} bytes, past this server's "
                f"limit of {self.max_bytes:,} (--image-url-max-mb)")


def _refused(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: the image URL was not used: {why}", param=param,
                    code="invalid_image_url")
