"""`vlmq api`: OpenAI's Files, Batch and Chat Completions API for the official SDKs
(docs/openai-api.md).

The dashboard's stack (Flask under waitress): already a vlmq extra, with its Host guard
and connection limits reused; the API's work is Redis reads and file streams, which
waitress' thread pool serves, and validation runs on its own threads. waitress runs with
the API's own request parser (server/openai_api/server.py), so a request without a
valid key is refused before its body is read. The limits a key has are options from one
table (server/openai_api/limits.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_CONFIG, EXIT_UNREACHABLE, fail
from vlmq.cli.logs import LogSettings, log_options
from vlmq.server.openai_api.limits import LIMITS

SWEEP_EVERY_S = 10.0  # how often live batches are checked for their end and window
SERVER_THREADS = 8

log = logging.getLogger("vlmq.api")


def _limit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One option a row of LIMITS, in the row's units."""
    for row in reversed(LIMITS):
        kind = click.IntRange(1) if row.integer else click.FloatRange(0, min_open=True)
        command = click.option(row.flag, row.name, type=kind,
                               default=int(row.default) if row.integer else row.default,
                               show_default=True, metavar=row.unit.upper(),
                               help=f"Bounds {row.doc}.")(command)
    return command


@click.command("api")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; anything else than loopback exposes the API.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--api-keys", "api_keys", type=click.Path(dir_okay=False, exists=True),
              default=None, metavar="FILE",
              help="The accepted keys, one a line (else VLMQ_API_KEYS=k1,k2). Each key "
                   "sees only its own files and batches.")
@click.option("--files-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Where uploads and their decoded images live (never in Redis); default: "
                   "api/ in $VLMQ_DATA, else in $XDG_DATA_HOME/vlmq, else in "
                   "~/.local/share/vlmq. Workers read the images as store vlmq-api, by "
                   "default from there on their own machine; give workers elsewhere the "
                   "--store this prints, over a shared folder.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME[:PORT]",
              help="Also answer requests for this host name (repeatable).")
@click.option("--model-map", "model_map", multiple=True, metavar="NAME=CHECKPOINT",
              help="A line's model NAME runs on workers serving CHECKPOINT (as enqueue's).")
@click.option("--strict-model", is_flag=True,
              help="A line's model must be the one its workers serve (as enqueue's).")
@click.option("--image-urls", "image_urls", is_flag=True,
              help="Fetch http(s) image URLs in chat requests (off: only inline data: "
                   "images). The server then fetches whatever a key holder names, from "
                   "its own network: turn it on only where that is acceptable.")
@click.option("--image-url-max-mb", type=click.FloatRange(0, min_open=True), default=20,
              show_default=True, metavar="MB", help="With --image-urls: the most one "
                                                    "fetched image may be.")
@click.option("--image-url-timeout", type=click.FloatRange(0, min_open=True), default=10,
              show_default=True, metavar="S", help="With --image-urls: the most one fetch "
                                                   "may take.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="N",
              help="Serve the API's Prometheus metrics (chat requests, time to first "
                   "token, tokens per second) on this port (0: a free one); off by default.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Interface the metrics listen on.")
@_limit_options
@log_options
@click.pass_context
def api_cmd(ctx: click.Context, /, host: str, port: int,
            api_keys: str | None, files_dir: str | None, allowed_hosts: tuple[str, ...],
            model_map: tuple[str, ...], strict_model: bool, image_urls: bool,
            image_url_max_mb: float, image_url_timeout: float, metrics_port: int | None,
            metrics_host: str, log_setup: LogSettings, **limits: float) -> None:
    """Serve OpenAI's Files, Batch and Chat Completions API: the official SDKs submit
    bulk work and ask interactive questions of vlmq's workers."""
    from redis.exceptions import RedisError

    from vlmq.producer.client import redact_url
    from vlmq.producer.openai_files import ModelPolicy
    from vlmq.shared.errors import PayloadError

    try:
        from vlmq.server.openai_api.access import load_keys
        from vlmq.server.openai_api.app import ApiSettings, create_app
        from vlmq.server.openai_api.image_urls import MB, RemoteImages
        from vlmq.server.openai_api.limits import ApiLimits
        from vlmq.server.openai_api.server import make_server
    except ImportError as exc:
        fail(f"error: `vlmq api` needs the dashboard extra ({exc.name} is missing): "
             "pip install 'vlmq[dashboard]'", EXIT_CONFIG)
    try:
        keys = load_keys(api_keys)
        models = ModelPolicy.parse(model_map, strict=strict_model)
    except (ValueError, OSError, PayloadError) as exc:
        fail(f"error: {exc}", EXIT_BAD_INPUT)
    url = ctx.find_root().obj["redis_url"]  # checked by the root's --redis-url
    from vlmq.stores.api_store import default_api_files_dir, store_spec

    folder = Path(files_dir) if files_dir else default_api_files_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # tenants' files: owner only
    except OSError as exc:
        fail(f"error: cannot make the files folder {folder}: {exc}", EXIT_BAD_INPUT)
    settings = ApiSettings(redis_url=url, files_dir=folder, keys=tuple(keys), host=host,
                           port=port, allowed_hosts=allowed_hosts, models=models,
                           limits=ApiLimits.from_options(limits),
                           image_urls=RemoteImages(int(image_url_max_mb * MB),
                                                   image_url_timeout) if image_urls else None)
    try:
        app = create_app(settings)
    except ValueError as exc:  # a bad --allowed-host; the message never holds a key
        fail(f"error: {exc}", EXIT_BAD_INPUT)
    parts = app.extensions["vlmq_api"]
    try:
        parts["client"].redis.ping()
    except RedisError as exc:
        fail(f"error: cannot reach Redis at {redact_url(url)}: {exc}", EXIT_UNREACHABLE)
    log_setup.configure()
    if metrics_port is not None:
        try:
            served = parts["chat"].metrics.serve(metrics_host, metrics_port)
        except OSError as exc:
            fail(f"error: --metrics-port: {exc.strerror or exc}", EXIT_BAD_INPUT)
        log.info("the API's metrics on http://%s:%d/metrics", metrics_host, served)
    stop = threading.Event()
    threading.Thread(target=_sweep, args=(parts, stop), name="api-sweeper",
                     daemon=True).start()
    from vlmq.cli.dashboard import CHANNEL_TIMEOUT_S, _connection_limit

    server = make_server(app, parts["gate"], parts["allowed"], parts["limits"], host=host,
                         port=port, threads=SERVER_THREADS, ident="vlmq",
                         channel_timeout=CHANNEL_TIMEOUT_S * 6,
                         connection_limit=_connection_limit(), asyncore_use_poll=True)
    same = files_dir is None or folder.resolve() == default_api_files_dir().resolve()
    log.info("vlmq api on http://%s:%d/v1 (%d keys); Ctrl-C stops it. %s--store %s", host,
             port, len(keys), "Workers run by this user on this machine read its images "
             "with no flag; workers elsewhere need " if same else "Its workers need ",
             store_spec(folder))
    try:
        server.run()
    finally:
        stop.set()


def _sweep(parts: dict[str, Any], stop: threading.Event) -> None:
    """Ends and completion windows, checked while nobody reads the batches; then the
    images of batches that ended (and of any whose record is gone, from a past run)."""
    from redis.exceptions import RedisError

    from vlmq.server.openai_api.batches import Batches
    from vlmq.server.openai_api.images import BatchImages

    batches, images = parts["batches"], parts["images"]
    assert isinstance(batches, Batches) and isinstance(images, BatchImages)
    while True:
        try:
            batches.sweep()
            images.sweep()
        except (RedisError, OSError) as exc:
            log.warning("sweeping batches failed: %s", exc)
        if stop.wait(SWEEP_EVERY_S):
            return


def register(group: click.Group) -> None:
    group.add_command(api_cmd)
