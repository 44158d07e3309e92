"""The dashboard's login against a `next` that a browser reads as another site, guessing
the token as fast as the server answers, a weak token, one session cookie for everyone
with no way to end it, and no Secure flag behind TLS. A real `vlmq dashboard` process over
real HTTP; the Flask test client with a fake clock only where time must pass (a window
running out, a session expiring)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from click.testing import CliRunner
from redis import Redis

from tests.server.dashboard.test_access import TOKEN, call, login_env
from tests.support.dashboard_data import Dataset, dataset
from vlmq.cli.main import main
from vlmq.server.dashboard.app import Settings, create_app
from vlmq.server.dashboard.screenshot import running_dashboard
from vlmq.server.dashboard.trust import COOKIE, TOKEN_ENV

FAILURES = 10  # wrong tokens a client may send within the window before it gets 429
SECOND_CLIENT = "127.0.0.2"  # another loopback address (Linux answers all of 127/8)


@pytest.fixture
def data(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    with dataset(redis_url, redis, tmp_path) as d:
        yield d


def log_in(port: int, *, next_: str = "/", headers: dict[str, str] | None = None,
           source: str | None = None) -> tuple[int, dict[str, str]]:
    code, got, _ = call(port, "/login", method="POST", headers=headers, source=source,
                        body=f"token={quote(TOKEN)}&next={next_}")
    return code, got


def session_of(headers: dict[str, str]) -> str:
    """'vlmq_session=...' from a Set-Cookie header."""
    pair = headers["set-cookie"].split(";", 1)[0]
    assert pair.startswith(f"{COOKIE}="), pair
    return pair


def can_bind(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the redirect after login -------------------------------------------------------

# As a form field (percent-decoded once by the server): each one a browser would read as
# another site, or as a header the server cannot send.
OFF_SITE = ("/%09/evil.example", "/%0a/x", "/%0d%0a/evil.example", "/%0d/evil.example",
            "%09//evil.example", "/%5Cevil.example", "/%5C/evil.example", "%5C%5Cevil.example",
            "//evil.example", "///evil.example", "https://evil.example/",
            "https:evil.example", "javascript:alert(1)", "evil.example",
            "%20//evil.example", "/%00/evil.example", "/%7f/evil.example",
            "/%09%09/evil.example", "/%E3%80%82/evil.example%0a")


def test_login_redirects_only_to_paths_of_this_dashboard(redis_url: str, data: Dataset,
                                                         tmp_path: Path) -> None:
    log = tmp_path / "dashboard.log"
    with running_dashboard(redis_url, env=login_env(), log=log) as (base, _proc):
        port = int(base.rsplit(":", 1)[1])
        for target in OFF_SITE:
            code, headers = log_in(port, next_=target)
            assert code == 303, (target, code)
            assert headers["location"] == "/", (target, headers["location"])
            code, _, page = call(port, f"/login?next={target}")
            assert code == 200 and b"Traceback" not in page, (target, code)
            assert b'name="next" value="/"' in page, target
        # A page of this dashboard is kept, query and all, and non-ASCII travels encoded.
        code, headers = log_in(port, next_=quote("/jobs?state=failed&label=batch=nov"))
        assert code == 303 and headers["location"] == "/jobs?state=failed&label=batch=nov"
        code, headers = log_in(port, next_=quote("/jobs?label=k=é"))
        assert code == 303 and headers["location"] == "/jobs?label=k=%C3%A9"
        # The round trip a browser makes: a page, the login form, back to that page.
        code, headers, _ = call(port, f"/jobs/{data.finished}?item=1")
        assert code == 303
        next_ = re.search(r"next=([^&]+)", headers["location"])
        assert next_ is not None
        code, headers = log_in(port, next_=next_.group(1))
        assert code == 303 and headers["location"] == f"/jobs/{data.finished}?item=1"
    assert "Traceback" not in log.read_text()


# --- guessing, weak tokens, sessions, logout, Secure -----------------------------------

def test_wrong_tokens_are_limited_per_client_and_logged(redis_url: str, data: Dataset,
                                                        tmp_path: Path) -> None:
    log = tmp_path / "dashboard.log"
    guesses = [f"guess-{i:04d}-abcdefghijkl" for i in range(FAILURES + 5)]
    page = f"/jobs/{data.finished}"
    with running_dashboard(redis_url, env=login_env(), log=log) as (base, _proc):
        port = int(base.rsplit(":", 1)[1])
        codes = [call(port, "/login", method="POST", body=f"token={g}")[0]
                 for g in guesses[:FAILURES]]
        assert codes == [401] * FAILURES
        # The limit is reached: more guesses, and even the right token, get 429 for now.
        code, headers, body = call(port, "/login", method="POST",
                                   body=f"token={guesses[FAILURES]}")
        assert code == 429 and b"Traceback" not in body
        assert 1 <= int(headers["retry-after"]) <= 60, headers
        assert log_in(port)[0] == 429
        code, headers, _ = call(port, page,
                                headers={"Authorization": f"Bearer {guesses[-1]}"})
        assert code == 429 and "retry-after" in headers
        assert call(port, page, headers={"Authorization": f"Bearer {TOKEN}"})[0] == 429
        # Another client is not locked out by this one.
        if can_bind(SECOND_CLIENT):
            code, _, _ = call(port, "/login", method="POST", body="token=nope-nope-nope",
                              source=SECOND_CLIENT)
            assert code == 401
            code, headers = log_in(port, source=SECOND_CLIENT)
            assert code == 303 and "set-cookie" in headers
    text = log.read_text()
    failures = [line for line in text.splitlines() if "wrong dashboard token" in line]
    assert len(failures) == FAILURES + (1 if can_bind(SECOND_CLIENT) else 0), text
    assert all("127.0.0.1" in line for line in failures[:FAILURES])
    assert "too many wrong tokens from 127.0.0.1" in text
    assert TOKEN not in text and not any(g in text for g in guesses)


def test_the_failure_window_runs_out(redis_url: str) -> None:
    clock = Clock()
    web = create_app(Settings(redis_url, auth_token=TOKEN), clock=clock).test_client()
    for _ in range(FAILURES):
        clock.now += 5  # ten failures in 45 s: the first leaves the window at 60 s
        assert web.post("/login", data={"token": "wrong"}).status_code == 401
    resp = web.post("/login", data={"token": TOKEN})
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "15"
    clock.now += 14
    assert web.post("/login", data={"token": TOKEN}).status_code == 429
    clock.now += 1  # one failure left the window: one more try
    assert web.post("/login", data={"token": "wrong"}).status_code == 401
    assert web.post("/login", data={"token": TOKEN}).status_code == 429
    clock.now += 60
    assert web.post("/login", data={"token": TOKEN}).status_code == 303


WEAK = {"a" * 16: "only 1 different", "a" * 40: "only 1 different",
        "ab" * 12: "only 2 different", "1234512345123451": "only 5 different",
        "a" * 20 + "bcdefghij": "one character is 20 of its 29",
        "tiny-tok": "it has 8 characters"}


def test_weak_tokens_are_refused_at_start(redis_url: str) -> None:
    for token, why in WEAK.items():
        with pytest.raises(ValueError, match=why) as raised:
            create_app(Settings(redis_url, auth_token=token))
        assert token not in str(raised.value)
    for token in ("abcdefghijklmnop", TOKEN, "correct horse battery staple"):
        create_app(Settings(redis_url, auth_token=token))
    for token, why in WEAK.items():  # by argument and by environment alike
        got = CliRunner().invoke(main, ["dashboard", "--redis-url", redis_url],
                                 env={TOKEN_ENV: token})
        assert got.exit_code == 2 and why in got.stderr, (token, got.stderr)
        assert "at least 16 characters, at least 6 different" in got.stderr
        assert token not in got.stderr
    got = CliRunner().invoke(main, ["dashboard", "--redis-url", redis_url,
                                    "--auth-token", "b" * 16])
    assert got.exit_code == 2 and "b" * 16 not in got.stderr


def test_each_login_is_its_own_session_and_logout_ends_it(redis_url: str, data: Dataset
                                                          ) -> None:
    page = f"/jobs/{data.finished}"
    with running_dashboard(redis_url, env=login_env()) as (base, _proc):
        port = int(base.rsplit(":", 1)[1])
        first, second = (session_of(log_in(port)[1]) for _ in range(2))
        assert first != second
        for cookie in (first, second):
            code, _, body = call(port, page, headers={"Cookie": cookie})
            assert code == 200 and b"Invoice 4711" in body and b'action="/logout"' in body
        code, headers, _ = call(port, "/logout", method="POST", headers={"Cookie": first})
        assert code == 303 and urlsplit(headers["location"]).path == "/login"
        assert f"{COOKIE}=;" in headers["set-cookie"]  # the browser forgets it too
        code, headers, body = call(port, page, headers={"Cookie": first})
        assert code == 303 and b"Invoice" not in body
        assert urlsplit(headers["location"]).path == "/login"
        code, _, body = call(port, page, headers={"Cookie": second})
        assert code == 200 and b"Invoice 4711" in body
        # Logging out without a session, or with a stale one, is no error.
        assert call(port, "/logout", method="POST")[0] == 303
        assert call(port, "/logout", method="POST", headers={"Cookie": first})[0] == 303
        # A logout from another site is refused like every cross-origin POST.
        code, _, _ = call(port, "/logout", method="POST",
                          headers={"Cookie": second, "Origin": "http://evil.example"})
        assert code == 403
        assert call(port, page, headers={"Cookie": second})[0] == 200


def test_a_session_expires(redis_url: str, data: Dataset) -> None:
    clock = Clock()
    web = create_app(Settings(redis_url, auth_token=TOKEN), clock=clock).test_client()
    assert web.post("/login", data={"token": TOKEN}).status_code == 303
    assert web.get(f"/jobs/{data.finished}").status_code == 200
    clock.now += 12 * 3600 + 1
    resp = web.get(f"/jobs/{data.finished}")
    assert resp.status_code == 303 and urlsplit(resp.headers["Location"]).path == "/login"


def test_secure_cookie_behind_a_trusted_tls_proxy(redis_url: str, data: Dataset) -> None:
    https = {"X-Forwarded-Proto": "https"}
    with running_dashboard(redis_url, "--trusted-proxy", "127.0.0.1",
                           env=login_env()) as (base, _proc):
        port = int(base.rsplit(":", 1)[1])
        code, headers = log_in(port, headers=https)
        assert code == 303 and "Secure" in headers["set-cookie"]
        assert "Secure" not in log_in(port)[1]["set-cookie"]  # plain http, straight in
        # Behind the proxy, each forwarded client has its own failure count.
        for _ in range(FAILURES):
            code, _, _ = call(port, "/login", method="POST", body="token=wrong",
                              headers={"X-Forwarded-For": "10.0.0.1"})
            assert code == 401
        assert log_in(port, headers={"X-Forwarded-For": "10.0.0.1"})[0] == 429
        assert log_in(port, headers={"X-Forwarded-For": "10.0.0.2"})[0] == 303
    # Without --trusted-proxy the header is anyone's to send, and is not believed.
    with running_dashboard(redis_url, env=login_env()) as (base, _proc):
        code, headers = log_in(int(base.rsplit(":", 1)[1]), headers=https)
        assert code == 303 and "Secure" not in headers["set-cookie"]
