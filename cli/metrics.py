"""`vlmq metrics`: serve the fleet's figures (server/metrics_exporter.py) to Prometheus."""

from __future__ import annotations

import errno
import logging

import click
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, fail
from vlmq.producer.client import check_redis_url, redact_url
from vlmq.server.metrics_exporter import DEFAULT_PORT, FleetCollector, serve
from vlmq.shared.connection import connect
from vlmq.shared.keys import Keys

log = logging.getLogger(__name__)


@click.command("metrics")
@click.option("--redis-url", envvar="REDIS_URL", default=None,
              help="Redis to watch (default: the root --redis-url / REDIS_URL).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT,
              show_default=True)
@click.option("--queued-items", is_flag=True,
              help="Also count the items of queued jobs (vlmq_queue_items): one SORT per "
                   "queue that reads every queued job hash inside Redis.")
@click.pass_context
def metrics_cmd(ctx: click.Context, redis_url: str | None, host: str, port: int,
                queued_items: bool) -> None:
    """Serve fleet metrics for Prometheus at http://HOST:PORT/metrics.

    Queue depth, jobs by state per queue, dead letters, the head job's age per queue and
    live workers; each worker serves its own figures (vlmq worker --metrics-port).
    Read-only, and cheap at any number of jobs. While Redis is unreachable a scrape still
    answers 200, with vlmq_up 0 (alert on vlmq_up == 0).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        url = check_redis_url(redis_url) if redis_url else ctx.find_root().obj["redis_url"]
    except ValueError as exc:
        fail(f"error: {exc} (from --redis-url)", EXIT_BAD_INPUT)
    redis = connect(url)
    registry = CollectorRegistry()
    registry.register(FleetCollector(redis, Keys.from_env(), items=queued_items))
    try:
        server, thread = serve(host, port, registry)
    except OSError as exc:
        why = ("the port is in use: pick another --port" if exc.errno == errno.EADDRINUSE
               else str(exc))
        fail(f"error: cannot listen on {host}:{port}: {why}", EXIT_FAILED)
    try:
        redis.ping()
    except RedisError as exc:
        log.warning("cannot reach Redis at %s (%s): scrapes answer vlmq_up 0 until it is "
                    "back", redact_url(url), exc)
    log.info("fleet metrics at http://%s:%d/metrics (Redis %s)", host,
             server.server_address[1], redact_url(url))
    try:
        thread.join()  # prometheus_client serves on its own (daemon) thread
    except KeyboardInterrupt:
        log.info("interrupted: stopping")
    finally:
        server.shutdown()
        server.server_close()


def register(group: click.Group) -> None:
    group.add_command(metrics_cmd)
