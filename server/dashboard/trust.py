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
import math
import re
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from flask import Request

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("vlmq.dashboard")

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
TOKEN_ENV = "VLMQ_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
MIN_TOKEN_DISTINCT = 6
TOKEN_RULE = (f"it needs at least {MIN_TOKEN_CHARS} characters, at least "
              f"{MIN_TOKEN_DISTINCT} different ones, and no one character in more than half "
              "of it; make one with: python -c 'import secrets; "
              "print(secrets.token_urlsafe(24))'")
FAILURES_ALLOWED = 10  # wrong tokens per client address within FAILURE_WINDOW_S, then 429
FAILURE_WINDOW_S = 60.0
MAX_CLIENTS = 10_000  # addresses whose failures are remembered
SESSION_TTL_S = 12 * 3600.0  # a login lasts a working day, then the form again
MAX_SESSIONS = 10_000
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


def token_strength(token: str) -> str | None:
    """Why `token` is too weak to guard the dashboard, or None. One stated rule rather
    than a score: at least MIN_TOKEN_CHARS characters, MIN_TOKEN_DISTINCT different ones,
    and no one character in more than half of it, so "aaaa..." or "abab..." fail while
    any random token (hex, base64, a passphrase) passes. Never quotes the token."""
    counts = Counter(token)
    if len(token) < MIN_TOKEN_CHARS:
        return f"it has {len(token)} characters"
    if len(counts) < MIN_TOKEN_DISTINCT:
        return f"it has only {len(counts)} different characters"
    if max(counts.values()) * 2 > len(token):
        return f"one character is {max(counts.values())} of its {len(token)}"
    return None


class Sessions:
    """Server-side login sessions: each successful login gets a random id, so one stolen
    cookie is one session (ended by logout or expiry), not everyone's. Ids are kept as
    their sha256, so a lookup's timing says nothing about a stored id; bounded, oldest
    dropped first, so logins cannot grow memory without end."""

    def __init__(self, clock: Callable[[], float], ttl_s: float = SESSION_TTL_S,
                 cap: int = MAX_SESSIONS) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._cap = cap
        self._expiry: dict[bytes, float] = {}  # sha256 of the id -> clock time it ends
        self._lock = threading.Lock()  # waitress serves from several threads

    def start(self) -> str:
        sid = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            if len(self._expiry) >= self._cap:
                self._expiry = {k: t for k, t in self._expiry.items() if t > now}
            while len(self._expiry) >= self._cap:
                del self._expiry[next(iter(self._expiry))]
            self._expiry[_digest(sid)] = now + self._ttl_s
        return sid

    def valid(self, sid: str) -> bool:
        if not sid:
            return False
        key = _digest(sid)
        with self._lock:
            ends = self._expiry.get(key)
            if ends is not None and ends <= self._clock():
                del self._expiry[key]
                ends = None
        return ends is not None

    def end(self, sid: str) -> None:
        with self._lock:
            self._expiry.pop(_digest(sid), None)


class FailureLimit:
    """Wrong tokens per client address: after `allowed` failures within `window_s`, that
    address is refused (429) until the oldest of them leaves the window. Counted per
    address so one guesser does not lock everyone out; the table of addresses is bounded
    (stale ones pruned first) so a spray of addresses cannot grow it without end."""

    def __init__(self, clock: Callable[[], float], allowed: int = FAILURES_ALLOWED,
                 window_s: float = FAILURE_WINDOW_S, cap: int = MAX_CLIENTS) -> None:
        self._clock = clock
        self.allowed = allowed
        self.window_s = window_s
        self._cap = cap
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> int | None:
        """Whole seconds until `client` may try again, or None when it may now."""
        now = self._clock()
        with self._lock:
            times = self._seen.get(client)
            if times is None or len(times) < self.allowed:
                return None
            wait = times[0] + self.window_s - now
        return math.ceil(wait) if wait > 0 else None

    def failed(self, client: str) -> int:
        """Counts a wrong token from `client`; returns its failures within the window."""
        now = self._clock()
        with self._lock:
            if client not in self._seen and len(self._seen) >= self._cap:
                self._prune(now)
            times = self._seen.setdefault(client, deque(maxlen=self.allowed))
            times.append(now)
            return sum(1 for t in times if t > now - self.window_s)

    def _prune(self, now: float) -> None:
        self._seen = {c: t for c, t in self._seen.items() if t[-1] > now - self.window_s}
        while len(self._seen) >= self._cap:
            del self._seen[next(iter(self._seen))]


@dataclass(frozen=True)
class Attempt:
    ok: bool
    retry_after: int | None = None  # set when refused without checking (429)


class Login:
    """The optional token: `Authorization: Bearer TOKEN`, or a session cookie the login
    form sets (a random id per login, kept server-side with an expiry, ended by logout).
    Wrong tokens are limited per client address and logged without the token; the token
    is compared in constant time and never logged or echoed."""

    def __init__(self, token: str, clock: Callable[[], float] = time.monotonic) -> None:
        weak = token_strength(token)
        if weak is not None:
            raise ValueError(f"the dashboard token is too weak ({weak}): {TOKEN_RULE}")
        self._token = token.encode()
        self.sessions = Sessions(clock)
        self.failures = FailureLimit(clock)

    def check_token(self, given: str) -> bool:
        # Bytes, so a non-ASCII guess compares (str compare_digest wants ASCII) in
        # constant time like any other.
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._token)

    def attempt(self, given: str, client: str) -> Attempt:
        """One try of the token from `client` (login form or Bearer header): refused
        unchecked while the client is over its limit, else checked and, when wrong,
        counted and logged (the address, never what was sent)."""
        wait = self.failures.retry_after(client)
        if wait is not None:
            return Attempt(ok=False, retry_after=wait)
        if self.check_token(given):
            return Attempt(ok=True)
        count = self.failures.failed(client)
        log.warning("wrong dashboard token from %s (%d of %d allowed per %d s)", client,
                    count, self.failures.allowed, self.failures.window_s)
        if count >= self.failures.allowed:
            log.warning("too many wrong tokens from %s: refused for %d s", client,
                        self.failures.window_s)
        return Attempt(ok=False)


def bearer(request: Request) -> str | None:
    """The token an `Authorization: Bearer` header carries, or None without one."""
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else None


def _digest(sid: str) -> bytes:
    return hashlib.sha256(sid.encode("utf-8", "surrogateescape")).digest()


def safe_next(target: str | None) -> str:
    """A login's redirect target: a path on this dashboard, else "/".

    Read as a browser reads a Location: it drops tabs and newlines anywhere and spaces and
    controls at the ends, and takes a backslash for a slash, so "/", a tab, "/evil" (or
    "/", a backslash, "evil") is "//evil", another site. So anything holding a control,
    space or backslash is refused outright (which also keeps a newline out of the header,
    once a 500), as is anything not starting with exactly one "/" (a scheme, "//host").
    Non-ASCII is percent-encoded, as a header must be."""
    if (not target or target[0] != "/" or target[1:2] == "/"
            or any(c <= " " or c in "\\\x7f" or 0x80 <= ord(c) < 0xA0 for c in target)):
        return "/"
    return "".join(c if c.isascii() else quote(c, safe="", errors="replace") for c in target)
