"""The served dashboard against DNS rebinding (foreign Host and
Origin), the optional token login, item numbers that are not numbers, and half-open
connections that must not lock everyone out; links in model output. A
real `vlmq dashboard` process over real HTTP where the server matters; Flask's test
client where only the app does."""

from __future__ import annotations

import http.client
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner
from redis import Redis

from tests.support.dashboard_data import Dataset, dataset, result
from tests.support.helpers import wait_for
from tests.support.lua_calls import write_items
from vlmq.cli.dashboard import CHANNEL_TIMEOUT_S, CLEANUP_INTERVAL_S
from vlmq.cli.main import main
from vlmq.server.dashboard import browser
from vlmq.server.dashboard.app import Settings, create_app
from vlmq.server.dashboard.screenshot import running_dashboard
from vlmq.server.dashboard.trust import COOKIE, TOKEN_ENV, allow_list
from vlmq.shared.keys import Keys

TOKEN = "s3cret-dashboard-token-0123456789"
HALF_OPEN = 150


@pytest.fixture
def data(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    with dataset(redis_url, redis, tmp_path) as d:
        yield d


@contextmanager
def served(redis_url: str, *extra: str, env: dict[str, str] | None = None,
           log: Path | None = None) -> Iterator[int]:
    """A running `vlmq dashboard`; yields its port."""
    with served_process(redis_url, *extra, env=env, log=log) as (port, _pid):
        yield port


@contextmanager
def served_process(redis_url: str, *extra: str, env: dict[str, str] | None = None,
                   log: Path | None = None) -> Iterator[tuple[int, int]]:
    """The same; yields its port and its process id."""
    with running_dashboard(redis_url, *extra, env=env, log=log) as (base, proc):
        yield int(base.rsplit(":", 1)[1]), proc.pid


def accepted(pid: int, port: int) -> int:
    """Connections the server process has accepted on `port`: established sockets on that
    port among its open files (those still in the kernel's listen backlog are not yet its).
    Read from /proc; elsewhere from psutil, where installed."""
    if not os.path.isdir(f"/proc/{pid}/fd"):
        psutil = pytest.importorskip("psutil")
        return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
                   if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with suppress(OSError), open(table, encoding="ascii") as fh:
            for row in fh.read().splitlines()[1:]:
                local, state, inode = (row.split()[i] for i in (1, 3, 9))
                count += (state == "01" and int(local.rsplit(":", 1)[1], 16) == port
                          and inode in inodes)
    return count


def still_open(s: socket.socket) -> bool:
    """Whether the peer has not closed `s` (nothing to read yet, no end of stream)."""
    timeout = s.gettimeout()
    s.setblocking(False)  # with a timeout set, recv would first wait for data
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    finally:
        s.settimeout(timeout)


def call(port: int, path: str, *, host: str | None = None, method: str = "GET",
         body: str | None = None, headers: dict[str, str] | None = None,
         source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request over 127.0.0.1 with the given Host header (a rebound name arrives so),
    from the address `source` if given (another client)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                      source_address=(source, 0) if source else None)
    try:
        sent = {"Host": host or f"127.0.0.1:{port}", **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=body, headers=sent)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def csrf_of(page: bytes) -> str:
    found = re.search(rb'name="csrf" value="([^"]+)"', page)
    assert found is not None, page[:500]
    return found.group(1).decode()


def test_a_rebound_host_name_gets_nothing(redis_url: str, data: Dataset) -> None:
    with served(redis_url, "--allow-actions", "--allowed-host", "dash.lan") as port:
        evil = f"evil.example:{port}"
        for path in (f"/jobs/{data.finished}", f"/jobs/{data.finished}/items/0.png",
                     "/", "/jobs", f"/jobs/{data.finished}/download.md",
                     "/static/style.css", "/nothing-here"):
            code, _, body = call(port, path, host=evil)
            assert code == 421, (path, code)
            assert b"Invoice" not in body and b"PNG" not in body, path
        for host in ("evil.example", "127.0.0.1.evil.example", "dash.lan.evil.example",
                     f"localhost:{port + 1}" if port < 65535 else "localhost:1"):
            assert call(port, "/jobs", host=host)[0] == 421, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}",
                     f"LOCALHOST:{port}", f"dash.lan:{port}", "dash.lan"):
            code, _, body = call(port, f"/jobs/{data.finished}", host=host)
            assert code == 200 and b"Invoice 4711" in body, host
        code, _, png = call(port, f"/jobs/{data.finished}/items/0.png")
        assert code == 200 and png.startswith(b"\x89PNG"), code


def test_a_rebound_cancel_is_refused(redis_url: str, redis: Redis, data: Dataset) -> None:
    status = f"rq:job:{data.running}"
    with served(redis_url, "--allow-actions") as port:
        page = call(port, f"/jobs/{data.running}")[2]
        form = f"csrf={csrf_of(page)}"
        cancel = f"/jobs/{data.running}/cancel"
        evil = f"evil.example:{port}"
        # The attack as found: Host and Origin both the attacker's, the token read first.
        code, _, _ = call(port, cancel, method="POST", body=form, host=evil,
                          headers={"Origin": f"http://{evil}"})
        assert code == 421
        for origin in (f"http://{evil}", "null", f"http://localhost:{port + 1}",
                       f"ftp://127.0.0.1:{port}", f"http://127.0.0.1:{port}.evil.example"):
            code, _, body = call(port, cancel, method="POST", body=form,
                                 headers={"Origin": origin})
            assert code == 403 and b"cross-origin request refused" in body, origin
        assert redis.hget(status, "status") == b"started"
        code, headers, _ = call(port, cancel, method="POST", body=form,
                                headers={"Origin": f"http://localhost:{port}"})
        assert code == 303 and urlsplit(headers["location"]).path == f"/jobs/{data.running}"
    assert redis.hget(status, "status") == b"canceled"


def test_item_numbers_that_are_not_numbers_get_400(redis_url: str, data: Dataset) -> None:
    web = create_app(Settings(redis_url)).test_client()
    for item in ("%C2%B2", "9" * 5000, "-1", "1e3", "%D9%A3", "+1", "%201", ""):
        resp = web.get(f"/jobs/{data.finished}?item={item}")
        page = resp.get_data(as_text=True)
        assert resp.status_code == 400, item
        assert "not an item number" in page and "Traceback" not in page, item
    assert web.get(f"/jobs/{data.finished}?item=999999999999").status_code == 404
    for index in ("%C2%B2", "9" * 5000):
        resp = web.get(f"/jobs/{data.finished}/items/{index}.png")
        assert resp.status_code in (400, 404), index
        assert "Traceback" not in resp.get_data(as_text=True), index


def test_the_allow_list(redis_url: str) -> None:
    wide = allow_list("0.0.0.0", 9191, ["Dash.LAN", "10.0.0.5:8443", "fe80::1"])
    assert {"127.0.0.1:9191", "localhost:9191", "[::1]:9191", "0.0.0.0:9191",
            "dash.lan:9191", "dash.lan", "10.0.0.5:8443", "[fe80::1]:9191"} <= wide.hosts
    assert "10.0.0.5" not in wide.hosts and "10.0.0.5:9191" not in wide.hosts
    assert wide.origin_ok("https://dash.lan") and not wide.origin_ok("http://localhost")
    assert allow_list("::1", 80).origin_ok("http://[::1]")
    with pytest.raises(ValueError, match="not a host name"):
        allow_list("127.0.0.1", 9191, ["evil.example/x"])
    bad = CliRunner().invoke(main, ["dashboard", "--redis-url", redis_url,
                                    "--allowed-host", "a b"])
    assert bad.exit_code == 2 and "not a host name" in bad.stderr


def test_half_open_connections_do_not_lock_the_dashboard_out(redis_url: str,
                                                             data: Dataset) -> None:
    with served_process(redis_url) as (port, pid), ExitStack() as held:
        socks: list[socket.socket] = []
        for i in range(HALF_OPEN):
            s = held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=60))
            if i % 2:  # half of them stall in the middle of a request's headers
                s.sendall(f"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
            socks.append(s)
        wait_for(lambda: accepted(pid, port) >= HALF_OPEN, 300,
                 "the server's loop to accept every stalled connection")
        code, _, body = call(port, f"/jobs/{data.finished}")
        assert code == 200 and b"Invoice 4711" in body
        # Answered while every stalled one was still held: not once the server had closed
        # idle ones (after CHANNEL_TIMEOUT_S) to make room, which a lock-out comes to.
        assert all(still_open(s) for s in socks), "the answer waited for idle ones to close"
        # The stalled ones are closed by the server once idle for CHANNEL_TIMEOUT_S.
        deadline = time.monotonic() + CHANNEL_TIMEOUT_S + CLEANUP_INTERVAL_S + 20
        for s in socks:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(4096) == b"", "a stalled connection got an answer"


def login_env() -> dict[str, str]:
    return {**os.environ, TOKEN_ENV: TOKEN}


def test_token_login_guards_every_page(redis_url: str, redis: Redis, data: Dataset,
                                       tmp_path: Path) -> None:
    log = tmp_path / "dashboard.log"
    page = f"/jobs/{data.running}"
    with served(redis_url, "--allow-actions", env=login_env(), log=log) as port:
        for path in (page, f"{page}/items/0.png", "/", f"{page}/download.md"):
            code, headers, body = call(port, path)
            assert code == 303 and b"Invoice" not in body, path
            assert urlsplit(headers["location"]).path == "/login", path
        code, _, body = call(port, f"{page}/cancel", method="POST", body="csrf=x")
        assert code == 401 and redis.hget(f"rq:job:{data.running}", "status") == b"started"
        assert call(port, page, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(port, page, headers={"Authorization": f"Bearer {TOKEN}x"})[0] == 401
        code, _, body = call(port, page, headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and b"Cancel job" in body
        assert call(port, "/static/style.css")[0] == 200  # the login page's own style
    assert TOKEN not in log.read_text()


def test_the_login_form_sets_a_session_cookie(redis_url: str, redis: Redis, data: Dataset,
                                              tmp_path: Path) -> None:
    log = tmp_path / "dashboard.log"
    page = f"/jobs/{data.running}"
    with served(redis_url, "--allow-actions", env=login_env(), log=log) as port:
        code, _, body = call(port, "/login")
        assert code == 200 and b'name="token"' in body
        code, headers, _ = call(port, "/login", method="POST", body="token=nope")
        assert code == 401 and "set-cookie" not in headers
        code, headers, _ = call(port, "/login", method="POST",
                                body=f"token={TOKEN}&next={page}")
        assert code == 303 and urlsplit(headers["location"]).path == page
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        session = cookie.split(";", 1)[0]
        assert session.startswith(f"{COOKIE}=")
        code, _, body = call(port, page, headers={"Cookie": session})
        assert code == 200 and b"Cancel job" in body
        form = f"csrf={csrf_of(body)}"
        assert call(port, page, headers={"Cookie": f"{COOKIE}=forged"})[0] == 303
        code, headers, _ = call(port, "/login", method="POST",
                                body=f"token={TOKEN}&next=//evil.example/x")
        assert code == 303 and headers["location"] in ("/", f"http://127.0.0.1:{port}/")
        code, _, _ = call(port, f"{page}/cancel", method="POST", body=form,
                          headers={"Cookie": session})
        assert code == 303
    assert redis.hget(f"rq:job:{data.running}", "status") == b"canceled"
    assert TOKEN not in log.read_text()


def test_token_flag_and_its_checks(redis_url: str, data: Dataset) -> None:
    with served(redis_url, "--auth-token", TOKEN) as port:
        assert call(port, "/jobs")[0] == 303
        assert call(port, "/jobs", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    short = CliRunner().invoke(main, ["dashboard", "--redis-url", redis_url,
                                      "--auth-token", "tiny-tok"])
    assert short.exit_code == 2 and "at least 16 characters" in short.stderr
    assert "tiny-tok" not in short.stderr
    no_login = create_app(Settings(redis_url)).test_client()
    assert no_login.get("/login").status_code == 404


# links and images in model output (or a PDF's text layer) that would
# point the reader, or the browser itself, at an address of the attacker's choosing.
METADATA = "http://169.254.169.254"
HOSTILE_LINKS = (f"![t]({METADATA}/x.png) and [docs]({METADATA}/latest/) and "
                 f"<{METADATA}/auto> and [ref][1] and ![alt][2]\n\n"
                 f"[1]: {METADATA}/ref\n[2]: {METADATA}/img.png\n")


def item_text(page: str) -> str:
    return page.split('id="item-text"', 1)[1].split("</div>", 1)[0]


def test_links_in_model_output_point_nowhere(redis_url: str, redis: Redis,
                                             data: Dataset) -> None:
    write_items(redis, Keys(), data.finished, result(2, "invoice.pdf", 3, HOSTILE_LINKS))
    with served(redis_url) as port:
        code, _, body = call(port, f"/jobs/{data.finished}?item=2")
    assert code == 200
    shown = item_text(body.decode())
    assert "<a" not in shown and "href" not in shown and "<img" not in shown, shown
    assert "src=" not in shown, shown
    # What the text said is still there to read, addresses included, as plain text.
    for part in ("docs", "[image: t]", "[image: alt]", "ref", f"{METADATA}/x.png",
                 f"{METADATA}/latest/", f"{METADATA}/auto", f"{METADATA}/ref",
                 f"{METADATA}/img.png"):
        assert part in shown, (part, shown)


@pytest.mark.skipif(browser.find_chromium() is None,
                    reason="no Chromium (.ci/dev.py installs it as root)")
def test_links_in_model_output_point_nowhere_in_a_browser(redis_url: str, redis: Redis,
                                                          data: Dataset) -> None:
    write_items(redis, Keys(), data.finished, result(2, "invoice.pdf", 3, HOSTILE_LINKS))
    with served(redis_url) as port:
        seen = browser.dump_dom(f"http://127.0.0.1:{port}/jobs/{data.finished}?item=2")
    assert seen.console == []
    shown = item_text(seen.stdout)
    assert "<a" not in shown and "<img" not in shown, shown
    assert f"{METADATA}/x.png" in shown
