"""The Flask app: OpenAI's Files, Batches, Models and Chat Completions routes.

Every request needs `Authorization: Bearer KEY`; every refusal is OpenAI's error shape.
Bodies are bounded: an upload by --max-upload-mb (OpenAI's 200 MB), a chat request by
MAX_CHAT_BYTES (its image comes inline), anything else by MAX_JSON_BYTES. The dashboard's
Host allow-list (trust.HostGuard) wraps the app, against DNS rebinding. Under `vlmq api`
the server asks the same Gate before a body is read (server.py); the app asks it again,
for any other WSGI server and the tests.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from flask import Flask, Response, g, jsonify, request
from redis.exceptions import RedisError
from werkzeug.exceptions import HTTPException

from vlmq.producer.client import Client
from vlmq.producer.openai_files import ModelPolicy
from vlmq.server.dashboard.trust import HostGuard, allow_list
from vlmq.server.openai_api import outputs
from vlmq.server.openai_api.access import Gate
from vlmq.server.openai_api.batches import Batches
from vlmq.server.openai_api.chat import ChatCompletions, live_models
from vlmq.server.openai_api.errors import ApiError, error_body
from vlmq.server.openai_api.files import (
    ERRORS_PREFIX,
    OUTPUT_PREFIX,
    FileStore,
    file_object,
)
from vlmq.server.openai_api.image_urls import RemoteImages
from vlmq.server.openai_api.images import BatchImages
from vlmq.server.openai_api.limits import FORM_SLACK, MAX_CHAT_BYTES, MAX_JSON_BYTES, ApiLimits
from vlmq.server.openai_api.metrics import ChatMetrics
from vlmq.stores.api_store import API_STORE, images_dir, store_spec
from vlmq.stores.backends import Stores

log = logging.getLogger("vlmq.api")

STORE_NAME = API_STORE  # the store the workers read the API's images from
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
VALIDATORS = 2  # batch files validated at once, off the request threads
# A hub id (org/name) is shown as it is; any other model is a local path, shown by its
# folder's name: where a worker keeps its model is no client's business.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ApiSettings:
    redis_url: str
    files_dir: Path
    keys: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    allowed_hosts: tuple[str, ...] = ()
    models: ModelPolicy = field(default_factory=ModelPolicy)
    prefix: str | None = None
    limits: ApiLimits = field(default_factory=ApiLimits)
    image_urls: RemoteImages | None = None  # None: remote image URLs are refused


def _limit() -> int:
    raw = request.args.get("limit", str(DEFAULT_LIMIT))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return int(raw)


def _json_body(limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    if request.mimetype != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    if (request.content_length or 0) > limit:
        raise ApiError(413, f"the body is larger than {limit} bytes")
    raw = request.stream.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, f"the body is larger than {limit} bytes")
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body is JSON nested too deeply to read") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _page(data: list[dict[str, Any]], more: bool) -> Response:
    return jsonify({"object": "list", "data": data,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": more})


def create_app(settings: ApiSettings, *, client: Client | None = None) -> Flask:
    """The app, wrapped in the Host guard (ValueError for a weak key);
    `app.extensions["vlmq_api"]` holds the parts the server, the CLI's sweeper and the
    tests use."""
    gate = Gate(settings.keys, uploads_per_key=settings.limits.uploads_per_key)
    client = client or Client(settings.redis_url, prefix=settings.prefix)
    files = FileStore(client.redis, client.keys, settings.files_dir, settings.limits)
    stores = Stores.parse([store_spec(settings.files_dir)])
    # Where data: images are spooled by content hash: store vlmq-api, the workers' default.
    images = BatchImages(images_dir(settings.files_dir), client.redis, client.keys)
    batches = Batches(client, files, spool=images.root, stores=stores,
                      run=ThreadPoolExecutor(VALIDATORS, thread_name_prefix="validate"),
                      models=settings.models)
    chat = ChatCompletions(client, settings.models, remote=settings.image_urls,
                           metrics=ChatMetrics())
    allowed = allow_list(settings.host, settings.port, settings.allowed_hosts)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.limits.upload_bytes + FORM_SLACK
    app.extensions["vlmq_api"] = {"client": client, "files": files, "batches": batches,
                                  "images": images, "gate": gate, "allowed": allowed,
                                  "limits": settings.limits, "chat": chat}
    _routes(app, client, files, batches, images, settings.models)
    _chat_route(app, chat)
    _guards(app, gate)
    app.wsgi_app = HostGuard(app.wsgi_app, allowed)  # type: ignore[method-assign]
    return app


def _guards(app: Flask, gate: Gate) -> None:
    @app.before_request
    def _auth() -> None:
        g.owner = gate.admit(request.headers.get("Authorization"),
                             request.remote_addr or "")

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> tuple[Response, int, list[tuple[str, str]]]:
        return jsonify(exc.body()), exc.status, exc.headers()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> tuple[Response, int]:
        status = exc.code or 500
        message = {404: f"Unknown request URL: {request.method} {request.path}.",
                   413: f"the request is larger than {app.config['MAX_CONTENT_LENGTH']:,} "
                        "bytes, this server's limit"}.get(status, exc.description or exc.name)
        return jsonify(error_body(status, message)), status

    @app.errorhandler(RedisError)
    def _redis_down(exc: RedisError) -> tuple[Response, int]:
        log.error("Redis: %s", exc)
        return jsonify(error_body(503, f"vlmq cannot reach its Redis: {exc}")), 503

    @app.after_request
    def _headers(resp: Response) -> Response:
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp


def _routes(app: Flask, client: Client, files: FileStore, batches: Batches,
            images: BatchImages, models: ModelPolicy) -> None:
    @app.post("/v1/files")
    def upload() -> Response:
        if request.mimetype != "multipart/form-data":
            raise ApiError(415, "Content-Type must be multipart/form-data (fields file and "
                                "purpose)")
        files.check_room(g.owner, request.content_length or 0)  # before the form is read
        upload = request.files.get("file")
        if upload is None:
            raise ApiError(400, "Missing required parameter: 'file'.", param="file")
        purpose = request.form.get("purpose")
        if purpose is None:
            raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
        try:
            stored = files.save(upload.stream, upload.filename or "", purpose, g.owner)
        finally:
            upload.close()  # werkzeug's spooled copy: its disk space goes at once
        return jsonify(stored.object())

    @app.get("/v1/files")
    def list_files() -> Response:
        found, more = files.list(g.owner, after=request.args.get("after"),
                                 limit=_limit() if "limit" in request.args else 10_000,
                                 purpose=request.args.get("purpose"))
        return _page([f.object() for f in found], more)

    @app.get("/v1/files/<file_id>")
    def get_file(file_id: str) -> Response:
        if file_id.startswith((OUTPUT_PREFIX, ERRORS_PREFIX)):
            _, batch_id, errors, size, when = batches.file_source(g.owner, file_id)
            return jsonify(file_object(file_id, size, when, f"{batch_id}_"
                                       f"{'error' if errors else 'output'}.jsonl",
                                       "batch_output"))
        return jsonify(files.get(file_id, g.owner).object())

    @app.get("/v1/files/<file_id>/content")
    def file_content(file_id: str) -> Response:
        if file_id.startswith((OUTPUT_PREFIX, ERRORS_PREFIX)):
            vlmq_batch, batch_id, errors, size, _ = batches.file_source(g.owner, file_id)
            try:
                whole = outputs.whole_file(client, vlmq_batch, errors=errors, size=size,
                                           expired=batches.expired(g.owner, batch_id))
            except outputs.ResultsGone:
                outputs.mark_gone(client.redis, client.keys, batch_id)
                raise ApiError(404, outputs.gone_error(batch_id)["message"], param="id",
                               code=outputs.GONE_CODE) from None
            return Response(_chunks_of(whole), mimetype="application/octet-stream",
                            headers={"Content-Length": str(size)})
        stored = files.get(file_id, g.owner)
        return Response(_chunks(files.path(file_id)), mimetype="application/octet-stream",
                        headers={"Content-Length": str(stored.bytes)})

    @app.delete("/v1/files/<file_id>")
    def delete_file(file_id: str) -> Response:
        files.delete(file_id, g.owner)
        return jsonify({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches")
    def create_batch() -> Response:
        return jsonify(batches.create(g.owner, _json_body()))

    @app.get("/v1/batches")
    def list_batches() -> Response:
        page, more = batches.list(g.owner, after=request.args.get("after"), limit=_limit())
        return _page(_seen(page), more)

    @app.get("/v1/batches/<batch_id>")
    def get_batch(batch_id: str) -> Response:
        return jsonify(_seen([batches.get(g.owner, batch_id)])[0])

    def _seen(shown: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Batch objects about to be shown: an ended batch's images go, and one whose
        results are gone says so."""
        for batch in shown:
            images.ended(batch)
        outputs.note_gone(client, shown)
        return shown

    @app.post("/v1/batches/<batch_id>/cancel")
    def cancel_batch(batch_id: str) -> Response:
        return jsonify(batches.cancel(g.owner, batch_id))

    @app.get("/v1/models")
    def list_models() -> Response:
        return _page(served_models(client, models), False)


def _chat_route(app: Flask, chat: ChatCompletions) -> None:
    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        # waitress's: whether the client went away (the server reads ahead to know it).
        gone = request.environ.get("waitress.client_disconnected")
        return chat.create(g.owner, _json_body(MAX_CHAT_BYTES),
                           gone if callable(gone) else None)


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        yield from _chunks_of(f)


def _chunks_of(f: IO[bytes]) -> Iterator[bytes]:
    try:
        while chunk := f.read(1 << 20):
            yield chunk
    finally:
        f.close()


def model_names(served: str, policy: ModelPolicy) -> list[str]:
    """What a client sees of a model a worker serves: the --model-map names that run on
    it, else a hub id as it is, else a local path's folder name."""
    mapped = sorted(name for name, checkpoint in policy.mapping.items()
                    if checkpoint == served)
    if mapped:
        return mapped
    if HUB_ID.fullmatch(served):
        return [served]
    return [PurePosixPath(served.replace("\\", "/").rstrip("/")).name or "model"]


def served_models(client: Client, policy: ModelPolicy | None = None) -> list[dict[str, Any]]:
    """The models live workers serve, from their stats (which expire with the worker),
    by name (model_names)."""
    served = live_models(client)
    shown = sorted({n for m in served for n in model_names(m, policy or ModelPolicy())})
    # `created` is when the model was made, which vlmq does not know: 0.
    return [{"id": m, "object": "model", "created": 0, "owned_by": "vlmq"} for m in shown]
