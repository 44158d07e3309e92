"""`vlmq dashboard`: serve the dashboard (waitress) until interrupted.

Imports Flask only when run, so `vlmq --help` works on installs without the extra, and
the command itself says which extra is missing.
"""

from __future__ import annotations

import threading

import click
from redis.exceptions import RedisError

from vlmq.producer.client import check_redis_url, redact_url
from vlmq.shared.clitools import EXIT_BAD_INPUT, EXIT_FAILED, fail

SAMPLE_EVERY_S = 5.0
SERVER_THREADS = 8


@click.command("dashboard")
@click.option("--redis-url", envvar="REDIS_URL", default=None,
              help="Redis to watch (default: the root --redis-url / REDIS_URL).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; anything else than loopback exposes job data.")
@click.option("--port", type=click.IntRange(1, 65535), default=9191, show_default=True)
@click.option("--allow-actions", is_flag=True,
              help="Show cancel and retry-failed buttons (off: the dashboard never writes).")
@click.pass_context
def dashboard_cmd(ctx: click.Context, redis_url: str | None, host: str, port: int,
                  allow_actions: bool) -> None:
    """A web page over queues, workers and jobs: progress, and each page next to its text."""
    try:
        import waitress

        from vlmq.producer.dashboard.app import Settings, create_app
        from vlmq.producer.dashboard.data import History, workers
    except ImportError as exc:
        fail(f"error: `vlmq dashboard` needs the dashboard extra ({exc.name} is missing): "
             "pip install 'vlmq[dashboard]'", EXIT_BAD_INPUT)
    try:
        url = check_redis_url(redis_url) if redis_url else ctx.find_root().obj["redis_url"]
    except ValueError as exc:
        fail(f"error: {exc} (from --redis-url)", EXIT_BAD_INPUT)
    history = History()
    app = create_app(Settings(redis_url=url, allow_actions=allow_actions), history=history)
    client = app.extensions["vlmq"]["client"]
    try:
        client.redis.ping()
    except RedisError as exc:
        fail(f"error: cannot reach Redis at {redact_url(url)}: {exc}", EXIT_FAILED)
    stop = threading.Event()

    def sample() -> None:
        # Keeps the throughput plots filling while nobody has the page open.
        while not stop.wait(SAMPLE_EVERY_S):
            try:
                history.sample(workers(client.redis, client.keys))
            except RedisError as exc:
                click.echo(f"vlmq dashboard: sampling stats failed: {exc}", err=True)

    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"vlmq dashboard: warning: listening on {host}: anyone who can reach "
                   "this port can read every job's inputs and results", err=True)
    threading.Thread(target=sample, name="stats-sampler", daemon=True).start()
    click.echo(f"vlmq dashboard on http://{host}:{port}/ "
               f"({'actions allowed' if allow_actions else 'read-only'}); Ctrl-C stops it",
               err=True)
    try:
        waitress.serve(app, host=host, port=port, threads=SERVER_THREADS, ident="vlmq")
    finally:
        stop.set()


def register(group: click.Group) -> None:
    group.add_command(dashboard_cmd)
