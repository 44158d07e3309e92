"""`vlmq ask IMAGE QUESTION`: one question about one image, answered now by a worker
ahead of its bulk work, printed as it is decoded (the Python side: producer/chat.py).

Exit codes (cli/common.py): 0 answered; 1 not answered (no live worker serves the chat
queue, the worker failed the request or died, Ctrl-C cancelled it); 2 bad input; 69
Redis unreachable; 124 --timeout passed.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_TIMEOUT, fail
from vlmq.cli.options import schema_option
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError

if TYPE_CHECKING:
    from vlmq.producer.chat import ChatStream


@click.command("ask")
@click.argument("image")
@click.argument("question")
@click.option("--system", metavar="TEXT", help="A system message before the question.")
@click.option("--max-tokens", type=click.IntRange(1, C.MAX_TOKENS_LIMIT), metavar="N",
              help=S.BY_NAME["max_tokens"].help)
@click.option("--temperature", type=click.FloatRange(0.0, C.MAX_TEMPERATURE), metavar="T",
              help=S.BY_NAME["temperature"].help)
@click.option("--stop", multiple=True, metavar="TEXT", help=S.BY_NAME["stop"].help)
@click.option("--schema", callback=schema_option, metavar="FILE",
              type=click.Path(dir_okay=False),
              help="Answer with a JSON object following this JSON Schema file.")
@click.option("--model", metavar="ID", help=S.BY_NAME["model"].help)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Give up (exit 124, the request cancelled) when the answer has not "
                   "ended after SECONDS.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object once the answer ends (id, text, finish_reason, "
                   "usage) instead of the text as it comes.")
@click.pass_context
def ask_cmd(ctx: click.Context, image: str, question: str, system: str | None,
            max_tokens: int | None, temperature: float | None, stop: tuple[str, ...],
            schema: Any, model: str | None, timeout: float | None, as_json: bool) -> None:
    """Ask one question about one image now, ahead of the bulk work; the answer prints
    as it is decoded.

    A worker serving the `chat` queue (every worker does by default) takes the request
    before any bulk job. IMAGE `-` reads the image from stdin. Ctrl-C cancels the
    request; the worker drops it within one step."""
    from vlmq.cli.progress import warn
    from vlmq.producer import chat
    from vlmq.producer.client import Client
    from vlmq.shared import redis_checks

    try:
        picture = _stdin_image() if image == "-" else image
        request = chat.chat_input(question, image=picture, system=system)
        task, options = chat.chat_options(request, max_tokens=max_tokens,
                                          temperature=temperature, stop=stop,
                                          schema=schema, model=model)
    except (InputError, PayloadError) as exc:
        fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)
    with Client(ctx.find_root().obj["redis_url"], on_warning=warn) as client:
        try:
            job = chat.submit_chat(client, request, task, options)
        except (InputError, PayloadError) as exc:
            fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)
        except redis_checks.EvictionRefused as exc:
            fail(f"error: {exc}\nnothing was enqueued", EXIT_FAILED)
        except chat.NoWorker as exc:
            fail(f"error: {exc}", EXIT_FAILED)
        with chat.ChatStream(client, job, timeout=timeout) as stream:
            _follow(stream, as_json)


def _stdin_image() -> bytes:
    """IMAGE `-`: the image's bytes from stdin, read no further than the blob limit."""
    data = sys.stdin.buffer.read(C.BLOB_MAX_BYTES + 1)
    if len(data) > C.BLOB_MAX_BYTES:
        raise InputError("-", f"stdin holds more than the {C.BLOB_MAX_BYTES}-byte blob "
                              "limit; recompress or downscale the image")
    if not data:
        raise InputError("-", "stdin is empty: pipe the image in (IMAGE `-`)")
    return data


def _follow(stream: ChatStream, as_json: bool) -> None:
    """Print the answer (as it comes, or as one JSON object), or fail saying why not."""
    from vlmq.producer import chat

    try:
        for delta in stream:
            if not as_json:
                click.echo(delta, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the stream cancelled the request on its way out
        _end_line(as_json, stream)
        fail(f"error: cancelled (job {stream.id})", EXIT_FAILED)
    except chat.ChatTimeout as exc:
        _end_line(as_json, stream)
        fail(f"error: {exc}", EXIT_TIMEOUT)
    except chat.ChatError as exc:
        _end_line(as_json, stream)
        fail(f"error: {exc}", EXIT_FAILED)
    if as_json:
        usage = stream.usage.to_dict() if stream.usage is not None else None
        click.echo(json.dumps({"id": stream.id, "text": stream.text,
                               "finish_reason": stream.finish_reason, "usage": usage}))
        return
    _end_line(as_json, stream)
    if stream.finish_reason == "length":
        click.echo("vlmq: the answer stopped at --max-tokens", err=True)
    elif stream.finish_reason == "cancelled":
        fail(f"error: the request was cancelled (job {stream.id})", EXIT_FAILED)


def _end_line(as_json: bool, stream: ChatStream) -> None:
    """End the streamed text's line, so what follows starts on its own."""
    if not as_json and stream.text:
        click.echo("")


def register(group: click.Group) -> None:
    group.add_command(ask_cmd)
