"""`vlmq metrics`: serve the fleet's figures (server/metrics_exporter.py) to Prometheus."""

from __future__ import annotations

import errno
import logging

import click
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from vlmq.cli.common import EXIT_FAILED, fail
from vlmq.cli.logs import LogSettings, log_options
from vlmq.producer.client import redact_url
from vlmq.server.metrics_exporter import DEFAULT_PORT, FleetCollector, serve
from vlmq.shared.connection import connect
from vlmq.shared.keys import Keys

log = logging.getLogger(__name__)


@click.command("metrics")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT,
              show_default=True)
@click.option("--queued-items", is_flag=True,
              help="Also count the items of queued jobs (vlmq_queue_items): one SORT per "
                   "queue that reads every queued job hash inside Redis.")
@log_options
@click.pass_context
def metrics_cmd(ctx: click.Context, host: str, port: int,
                queued_items: bool, log_setup: LogSettings) -> None:
    """Serve fleet metrics for Prometheus at http://HOST:PORT/metrics.

    Queue depth, jobs by state per queue, dead letters, the head job's age per queue and
    live workers; each worker serves its own figures (vlmq worker --metrics-port).
    Read-only, and cheap at any number of jobs. While Redis is unreachable a scrape still
    answers 200, with vlmq_up 0 (alert on vlmq_up == 0).
    """
    log_setup.configure()
    url = ctx.find_root().obj["redis_url"]  # checked by the root's --redis-url
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
