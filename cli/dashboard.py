"""`vlmq dashboard`: serve the dashboard (waitress) until interrupted.

Imports Flask only when run, so `vlmq --help` works on installs without the extra, and
the command itself says which extra is missing.
"""

from __future__ import annotations

import logging
import resource
import threading

import click

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_CONFIG, EXIT_UNREACHABLE, fail
from vlmq.cli.logs import LogSettings, log_options

SAMPLE_EVERY_S = 5.0
SERVER_THREADS = 8
# Connections are cheap for waitress (one poll loop reads them all), so idle or half-open
# ones must neither outlive a short timeout nor fill a small limit: waitress' defaults
# (120 s, 100 connections) let 150 stalled sockets lock everyone out for minutes.
CHANNEL_TIMEOUT_S = 10
CLEANUP_INTERVAL_S = 1
MAX_CONNECTIONS = 2000
SPARE_FDS = 64  # files the process needs besides connections (Redis, previews, logs)
# From a --trusted-proxy only: the scheme (so the session cookie is Secure behind TLS) and
# the client's address (so wrong tokens are counted per client, not all as the proxy's).
PROXY_HEADERS = frozenset({"x-forwarded-proto", "x-forwarded-for"})

log = logging.getLogger("vlmq.dashboard")


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; anything else than loopback exposes job data.")
@click.option("--port", type=click.IntRange(1, 65535), default=9191, show_default=True)
@click.option("--allow-actions", is_flag=True,
              help="Show cancel and retry-failed buttons (off: the dashboard never writes).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME[:PORT]",
              help="Also answer requests for this host name (repeatable). Only 127.0.0.1, "
                   "localhost, [::1] and the --host value are answered otherwise.")
@click.option("--auth-token", envvar="VLMQ_DASHBOARD_TOKEN", show_envvar=True, default=None,
              metavar="TOKEN",
              help="Require this token on every page: a login form, or 'Authorization: "
                   "Bearer TOKEN'. 16+ characters, 6+ different ones, no one character in "
                   "more than half. Prefer the env var: arguments show in ps.")
@click.option("--trusted-proxy", default=None, metavar="ADDRESS",
              help="A reverse proxy's address (e.g. 127.0.0.1) whose X-Forwarded-Proto and "
                   "X-Forwarded-For are believed: the session cookie is then Secure behind "
                   "TLS, and wrong tokens are counted per real client.")
@log_options
@click.pass_context
def dashboard_cmd(ctx: click.Context, host: str, port: int,
                  allow_actions: bool, allowed_hosts: tuple[str, ...],
                  auth_token: str | None, trusted_proxy: str | None,
                  log_setup: LogSettings) -> None:
    """A web page over queues, workers and jobs: progress, and each page next to its text."""
    from redis.exceptions import RedisError

    from vlmq.producer.client import redact_url

    try:
        import waitress

        from vlmq.server.dashboard.app import Settings, create_app
        from vlmq.server.dashboard.data import History, workers
        from vlmq.server.dashboard.trust import LOOPBACK, bracket, normalize_name
    except ImportError as exc:
        fail(f"error: `vlmq dashboard` needs the dashboard extra ({exc.name} is missing): "
             "pip install 'vlmq[dashboard]'", EXIT_CONFIG)
    url = ctx.find_root().obj["redis_url"]  # checked by the root's --redis-url
    for name in allowed_hosts:
        try:
            normalize_name(name)
        except ValueError as exc:
            fail(f"error: {exc} (from --allowed-host)", EXIT_BAD_INPUT)
    history = History()
    settings = Settings(redis_url=url, allow_actions=allow_actions, host=host, port=port,
                        allowed_hosts=allowed_hosts, auth_token=auth_token or None)
    try:
        app = create_app(settings, history=history)
    except ValueError as exc:  # a weak token; the message never contains it
        fail(f"error: {exc} (from --auth-token / $VLMQ_DASHBOARD_TOKEN)", EXIT_BAD_INPUT)
    client = app.extensions["vlmq"]["client"]
    try:
        client.redis.ping()
    except RedisError as exc:
        fail(f"error: cannot reach Redis at {redact_url(url)}: {exc}", EXIT_UNREACHABLE)
    stop = threading.Event()

    def sample() -> None:
        # Keeps the throughput plots filling while nobody has the page open.
        while not stop.wait(SAMPLE_EVERY_S):
            try:
                history.sample(workers(client.redis, client.keys))
            except RedisError as exc:
                log.warning("sampling stats failed: %s", exc)

    # Failed logins (address, never the token) and refused Host names are logged too.
    log_setup.configure()
    if bracket(host) not in LOOPBACK and not settings.auth_token:
        log.warning("listening on %s without --auth-token: anyone who can reach this port "
                    "can read every job's inputs and results", host)
    if host in ("0.0.0.0", "::"):
        log.info("only requests for loopback names and --allowed-host names are answered; "
                 "add the names people use to reach it")
    threading.Thread(target=sample, name="stats-sampler", daemon=True).start()
    log.info("vlmq dashboard on http://%s:%d/ (%s); Ctrl-C stops it", host, port,
             "actions allowed" if allow_actions else "read-only")
    try:
        waitress.serve(app, host=host, port=port, threads=SERVER_THREADS, ident="vlmq",
                       channel_timeout=CHANNEL_TIMEOUT_S, cleanup_interval=CLEANUP_INTERVAL_S,
                       connection_limit=_connection_limit(), asyncore_use_poll=True,
                       **_proxy_settings(trusted_proxy))
    finally:
        stop.set()


def _proxy_settings(trusted_proxy: str | None) -> dict[str, object]:
    """waitress' own proxy handling: headers from that address only, others' dropped."""
    if trusted_proxy is None:
        return {}
    return {"trusted_proxy": trusted_proxy, "trusted_proxy_headers": set(PROXY_HEADERS),
            "clear_untrusted_proxy_headers": True}


def _connection_limit() -> int:
    """As many connections as open files allow, up to MAX_CONNECTIONS: the soft file limit
    is raised towards the hard one first. poll(), not select(), so descriptors past 1024
    work."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_CONNECTIONS + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit: %s", exc)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - SPARE_FDS))


def register(group: click.Group) -> None:
    group.add_command(dashboard_cmd)
