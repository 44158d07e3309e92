"""Who the dashboard answers: the Host and Origin allow-list, and the optional login.

DNS rebinding points an attacker's name at 127.0.0.1, so a page the victim opened can
read the dashboard and act on it with the victim's network position. Comparing Origin
with Host does not stop it (the attacker controls both), so both are checked against
names the operator chose. The login is for dashboards bound to a LAN, where anyone who
can reach the port could otherwise read every document.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from flask import Request

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("vlmq.dashboard")

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
TOKEN_ENV = "VLMQ_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
COOKIE = "vlmq_session"
# A DNS name, an IPv4 address or a bracketed IPv6 address, with an optional port.
NAME_RE = re.compile(r"(?:[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")
REFUSED = (b"421 this dashboard does not answer to that Host name. To reach it by another "
           b"name, start it with --allowed-host NAME.\n")


@dataclass(frozen=True)
class AllowList:
    hosts: frozenset[str]  # Host header values answered
    origins: frozenset[str]  # Origin netlocs a POST may come from

    def origin_ok(self, origin: str) -> bool:
        """A browser POST's Origin: http(s) and one of the allowed names (never 'null')."""
        parts = urlsplit(origin.strip().lower())
        return parts.scheme in ("http", "https") and parts.netloc in self.origins


def bracket(host: str) -> str:
    """'::1' -> '[::1]': the form an IPv6 address takes in Host and Origin."""
    host = host.strip().lower()
    return f"[{host}]" if host.count(":") > 1 and not host.startswith("[") else host


def normalize_name(name: str) -> str:
    """An --allowed-host value as Host carries it; ValueError for anything else."""
    value = bracket(name)
    if not NAME_RE.fullmatch(value):
        raise ValueError(f"not a host name, address or name:port: {name!r}")
    return value


def allow_list(host: str, port: int, names: Iterable[str] = ()) -> AllowList:
    """Loopback names and the --host value with the port, and each --allowed-host NAME.

    A name without a port also stands for itself bare, as a browser sends it on the
    scheme's default port (a reverse proxy in front). Bare loopback names are answered
    too: no rebinding makes a browser send them, and it is what Flask's test client
    sends. Origins are exact: a bare loopback origin is another site on port 80."""
    with_port = {f"{n}:{port}" for n in (*LOOPBACK, bracket(host))}
    bare: set[str] = set()
    for raw in names:
        name = normalize_name(raw)
        if re.search(r":[0-9]+$", name):
            with_port.add(name)
        else:
            with_port.add(f"{name}:{port}")
            bare.add(name)
    if port == 80:
        bare.update((*LOOPBACK, bracket(host)))
    origins = frozenset(with_port | bare)
    return AllowList(hosts=origins | frozenset(LOOPBACK), origins=origins)


class HostGuard:
    """WSGI middleware: a request whose Host is not allowed gets 421 before Flask sees it,
    so no view, static file or error page answers a rebound name."""

    def __init__(self, app: WSGIApplication, allowed: AllowList) -> None:
        self.app = app
        self.allowed = allowed

    def __call__(self, environ: WSGIEnvironment,
                 start_response: StartResponse) -> Iterable[bytes]:
        host = str(environ.get("HTTP_HOST", "")).strip().lower()
        if host in self.allowed.hosts:
            return self.app(environ, start_response)
        log.warning("refused a request for Host %r", host[:100])
        start_response("421 Misdirected Request", [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(REFUSED))), ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff")])
        return [REFUSED]


class Login:
    """The optional token: `Authorization: Bearer TOKEN`, or a session cookie the login
    form sets. The cookie is an HMAC of the token under a per-process key, so it is not
    the token itself and stops working when the dashboard restarts. All comparisons are
    constant-time; the token is never logged or echoed."""

    def __init__(self, token: str) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the dashboard token must have at least {MIN_TOKEN_CHARS} "
                             "characters")
        self._token = token.encode()
        self._session = hmac.new(secrets.token_bytes(32), self._token,
                                 hashlib.sha256).hexdigest()

    def check_token(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._token)

    @property
    def session(self) -> str:
        return self._session

    def authorized(self, request: Request) -> bool:
        header = request.headers.get("Authorization", "")
        if header[:7].lower() == "bearer ":
            return self.check_token(header[7:].strip())
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self._session.encode())


def safe_next(target: str | None) -> str:
    """A login's redirect target: a path on this dashboard only (no '//host', no scheme)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target
