"""The dashboard's Flask application: pages over queues, workers and jobs' results.

Read-only unless built with allow_actions: every view reads Redis, and only the two
POST routes (cancel, retry failed items) write, through the same Client calls as the
CLI, behind a per-process CSRF token. Job data is read as JSON only, never unpickled.
Only allowed Host names are answered and POSTs must come from an allowed Origin
(trust.py: DNS rebinding); an optional token login guards dashboards bound to a LAN, with
a session per login, a logout, and a limit on wrong tokens per client address.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Response, abort, redirect, render_template, request, url_for
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from werkzeug.exceptions import HTTPException, TooManyRequests
from werkzeug.wrappers import Response as BaseResponse

from vlmq.producer import job_admin
from vlmq.producer.client import Client, Job
from vlmq.producer.errors import JobNotFound, NotAJob
from vlmq.producer.labels import split_labels
from vlmq.producer.ops.output_formats import EXTRACT, FORMATS, JobResults
from vlmq.server.dashboard import data, markup, trust
from vlmq.server.dashboard.render import PreviewCache, RenderError
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import BlobError, PayloadError, VlmqError
from vlmq.shared.keys import JOB_ID_RE, QUEUE_NAME_RE
from vlmq.shared.messages import Item, JobPayload
from vlmq.stores.backends import StoreError

log = logging.getLogger("vlmq.dashboard")

REFRESH_S = 3
JOBS_LIMIT = 200
ITEMS_PER_PAGE = 100  # rows of a job's item table shown at once (a PDF may have thousands)
ITEM_RE = re.compile(r"[0-9]{1,12}")  # ASCII digits only: '²' passes str.isdigit()
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9191
# No script at all, nothing from elsewhere: a hostile model output cannot run or load.
CSP = ("default-src 'none'; img-src 'self'; style-src 'self'; form-action 'self'; "
       "base-uri 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class Settings:
    redis_url: str
    allow_actions: bool = False
    prefix: str | None = None
    host: str = DEFAULT_HOST  # the address served on (its name is answered)
    port: int = DEFAULT_PORT
    allowed_hosts: tuple[str, ...] = ()  # more names it is reached by (--allowed-host)
    auth_token: str | None = None  # when set, every page needs it (--auth-token)


def create_app(settings: Settings, *, history: data.History | None = None,
               clock: Callable[[], float] = time.monotonic) -> Flask:
    """The app for `settings`; `clock` times failed-login windows and session expiry (a
    test moves it instead of waiting)."""
    app = Flask(__name__)
    client = Client(settings.redis_url, prefix=settings.prefix)
    previews = PreviewCache()
    hist = history or data.History()
    csrf = secrets.token_urlsafe(32)
    allowed = trust.allow_list(settings.host, settings.port, settings.allowed_hosts)
    gate = trust.Login(settings.auth_token, clock) if settings.auth_token is not None else None
    app.extensions["vlmq"] = {"client": client, "history": hist}
    # Outside Flask, so a foreign Host reaches no view, static file or error page.
    app.wsgi_app = trust.HostGuard(app.wsgi_app, allowed)  # type: ignore[method-assign]

    @app.before_request
    def _same_origin() -> None:
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            _check_origin(allowed)

    @app.before_request
    def _logged_in() -> BaseResponse | None:
        if gate is None or request.endpoint in ("login", "logout", "static"):
            return None
        given = trust.bearer(request)
        if given is not None:  # a script: the token itself, counted like a login's
            if _try_token(gate, given):
                return None
        elif gate.sessions.valid(request.cookies.get(trust.COOKIE, "")):
            return None
        if request.method in ("GET", "HEAD") and "Authorization" not in request.headers:
            target = request.path + (f"?{request.query_string.decode()}"
                                     if request.query_string else "")
            return redirect(url_for("login", next=target), code=303)
        abort(401, "this dashboard needs its token: log in, or send "
                   "'Authorization: Bearer TOKEN'")

    @app.context_processor
    def _globals() -> dict[str, Any]:
        return {"allow_actions": settings.allow_actions, "csrf": csrf,
                "host": urlsplit(settings.redis_url).hostname or "?", "downloads": FORMATS,
                "logout": gate is not None and trust.COOKIE in request.cookies}

    app.add_template_filter(duration, "duration")
    app.add_template_filter(markup.compact_json, "compact_json")

    @app.after_request
    def _headers(resp: BaseResponse) -> BaseResponse:
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        return resp

    # --- pages --------------------------------------------------------------------------

    @app.get("/")
    def overview() -> str:
        workers = data.workers(client.redis, client.keys)
        hist.sample(workers)
        plots = {w.name: _plots(hist.series(w.name)) for w in workers}
        queues = data.queues(client.redis)
        return render_template("overview.html", queues=queues,
                               states=data.jobs_by_state(queues), workers=workers,
                               plots=plots, refresh=REFRESH_S)

    @app.get("/jobs")
    def jobs() -> str:
        queue = request.args.get("queue") or None
        state = request.args.get("state") or None
        raw_labels = [x for x in request.args.getlist("label") if x]
        if queue is not None and not QUEUE_NAME_RE.fullmatch(queue):
            abort(400, f"not a valid queue name: {queue!r}")
        try:
            labels = split_labels(raw_labels)
        except ValueError as exc:
            abort(400, str(exc))
        # prune=False: the dashboard only reads (workers sweep the index of expired jobs)
        rows = job_admin.list_jobs(client.redis, client.keys, queue=queue, status=state,
                                   labels=labels, limit=JOBS_LIMIT, prune=False)
        return render_template("jobs.html", rows=rows, queue=queue or "", state=state or "",
                               label=" ".join(raw_labels), labels=raw_labels,
                               limit=JOBS_LIMIT, refresh=REFRESH_S)

    @app.get("/jobs/<job_id>")
    def job_page(job_id: str) -> str:
        job = _job(client, job_id)
        state = job.status()
        if job.problem is not None:
            return render_template("job.html", job=job, state=state, payload=None,
                                   error=job.error(), results={}, item=None, index=0,
                                   refresh=None, blob_live=False, text=None)
        payload = _payload(job)
        results = data.item_results(client.redis, client.keys, job.id)
        index = request.args.get("item", "0")
        if not ITEM_RE.fullmatch(index):
            abort(400, f"not an item number: {index[:20]!r} (0, 1, 2, ...)")
        if int(index) >= len(payload.items):
            abort(404, f"job {job.id} has no item {index!r} "
                       f"(it has {len(payload.items)}, numbered from 0)")
        i = int(index)
        item = payload.items[i]
        result = results.get(i, {})
        text = result.get("text")
        rendered = None
        if payload.task == EXTRACT and result.get("json") is not None:
            rendered = markup.json_block(result["json"])
        elif isinstance(text, str) and text:
            rendered = markup.markdown(text) if payload.task == "ocr" else markup.paragraph(text)
        first = i // ITEMS_PER_PAGE * ITEMS_PER_PAGE
        rows = range(first, min(first + ITEMS_PER_PAGE, len(payload.items)))
        return render_template(
            "job.html", job=job, state=state, payload=payload, results=results, rows=rows,
            per_page=ITEMS_PER_PAGE,
            error=job.error() if state == "failed" else None, item=item, index=i,
            result=result, text=rendered, blob_live=_input_live(client, item),
            summary=_summary(payload, results),
            refresh=None if state in job_admin.ENDED else REFRESH_S)

    @app.get("/jobs/<job_id>/items/<int:index>.png")
    def preview(job_id: str, index: int) -> Response:
        job = _job(client, job_id)
        item = _item(_payload(job), job.id, index)
        store_get = _blob_reader(client, item)
        try:
            png = previews.get(item.sha256, store_get, item.kind, item.page)
        except BlobError as exc:
            abort(404, f"the input of item {index} is gone from Redis: {exc}")
        except StoreError as exc:
            abort(404, f"the input of item {index} cannot be read here: {exc}")
        except RenderError as exc:
            abort(422, f"cannot preview item {index}: {exc}")
        return Response(png, mimetype="image/png",
                        headers={"Cache-Control": "private, max-age=300"})

    @app.get("/jobs/<job_id>/download.<fmt>")
    def download(job_id: str, fmt: str) -> Response:
        form = FORMATS.get(fmt)
        if form is None:
            abort(404, f"no download format {fmt!r} ({', '.join(FORMATS)})")
        job = _job(client, job_id)
        _payload(job)  # a job that is not readable vlmq JSON has nothing to download
        # The same renderer as `vlmq result --format`, so the two give the same bytes.
        body = form.render(JobResults.read(job))
        return Response(body, mimetype=form.mimetype, headers={
            "Content-Disposition": f'attachment; filename="{job.id}.{fmt}"'})

    # --- login (only with a token) -------------------------------------------------------------

    @app.route("/login", methods=["GET", "POST"])
    def login() -> BaseResponse | tuple[str, int]:
        if gate is None:
            abort(404, "this dashboard has no login (no --auth-token)")
        target = trust.safe_next(request.values.get("next"))
        if request.method == "GET":
            return render_template("login.html", next=target, wrong=False), 200
        if not _try_token(gate, request.form.get("token", "")):
            return render_template("login.html", next=target, wrong=True), 401
        gate.sessions.end(request.cookies.get(trust.COOKIE, ""))  # a new id each login
        resp = redirect(target, code=303)
        # Secure when the request came over https: waitress says so, directly or from a
        # --trusted-proxy's X-Forwarded-Proto (no one else's header is believed).
        resp.set_cookie(trust.COOKIE, gate.sessions.start(), httponly=True,
                        samesite="Strict", secure=request.is_secure, path="/")
        return resp

    @app.post("/logout")
    def logout() -> BaseResponse:
        """Ends this browser's session on the server (so a copied cookie dies with it) and
        has the browser drop the cookie. Without a session there is nothing to end."""
        if gate is None:
            abort(404, "this dashboard has no login (no --auth-token)")
        gate.sessions.end(request.cookies.get(trust.COOKIE, ""))
        resp = redirect(url_for("login"), code=303)
        resp.delete_cookie(trust.COOKIE, path="/", httponly=True, samesite="Strict",
                           secure=request.is_secure)
        return resp

    # --- actions (POST, only with allow_actions) --------------------------------------------

    @app.post("/jobs/<job_id>/cancel")
    def cancel(job_id: str) -> BaseResponse:
        _check_action(settings, csrf)
        job = _job(client, job_id)
        try:
            job.cancel()
        except (job_admin.CannotCancel, PayloadError) as exc:
            abort(409, str(exc))
        return redirect(url_for("job_page", job_id=job.id), code=303)

    @app.post("/jobs/<job_id>/retry-failed")
    def retry_failed(job_id: str) -> BaseResponse:
        _check_action(settings, csrf)
        job = _job(client, job_id)
        try:
            new = job.retry(failed_only=True)
        except PayloadError as exc:
            abort(409, f"cannot retry {job.id}: {exc}")
        return redirect(url_for("job_page", job_id=new.id), code=303)

    # --- errors: a page that says what is wrong, never a traceback ---------------------------

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[str, int, dict[str, str]]:
        # A 429 keeps its Retry-After; the page itself replaces werkzeug's.
        kept = {k: v for k, v in exc.get_headers() if k.lower() == "retry-after"}
        return render_template("error.html", code=exc.code, title=exc.name,
                               message=exc.description), exc.code or 500, kept

    @app.errorhandler(RedisConnectionError)
    @app.errorhandler(RedisTimeoutError)
    def redis_down(exc: Exception) -> tuple[str, int]:
        return render_template("error.html", code=503, title="Redis unreachable",
                               message=f"cannot reach Redis: {exc}"), 503

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> tuple[str, int]:
        log.exception("dashboard error on %s", request.path)
        return render_template("error.html", code=500, title="Internal error",
                               message=f"{type(exc).__name__}: the dashboard's log has "
                                       "the details"), 500

    return app


def duration(seconds: str) -> str:
    """'3725.4' -> '1 h 02 min'; '-' for a missing or unreadable figure."""
    try:
        s = int(float(seconds))
    except ValueError:
        return "-"
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _job(client: Client, job_id: str) -> Job:
    if not JOB_ID_RE.fullmatch(job_id):
        abort(400, "not a valid job id (letters, digits, '-' and '_', at most 128)")
    try:
        return client.job(job_id)
    except NotAJob as exc:
        abort(409, str(exc))
    except JobNotFound:
        abort(404, f"no job {job_id} (never enqueued, deleted, or expired)")


def _payload(job: Job) -> JobPayload:
    if job.problem is not None:
        abort(409, f"job {job.id} is not a readable vlmq job: {job.problem}")
    try:
        return job.payload()
    except VlmqError as exc:
        abort(409, f"job {job.id} is not a readable vlmq job: {exc}")


def _item(payload: JobPayload, job_id: str, index: int) -> Item:
    if not 0 <= index < len(payload.items):
        abort(404, f"job {job_id} has no item {index}")
    return payload.items[index]


def _blob_reader(client: Client, item: Item) -> Callable[[], bytes]:
    """The item's bytes: its blob, or its reference read (and verified) through this
    machine's stores ($VLMQ_STORES)."""
    if item.ref is not None:
        return lambda: client.stores.read(item)
    store = BlobStore(client.redis, client.keys)
    return lambda: store.get(item.sha256)


def _input_live(client: Client, item: Item) -> bool:
    """Whether a preview can be tried: the blob is in Redis, or the ref's store is one this
    dashboard has."""
    if item.ref is not None:
        try:
            return item.ref.store in client.stores.by_name
        except StoreError:  # a bad VLMQ_STORES: the page still shows, without a preview
            return False
    return bool(client.redis.exists(client.keys.blob(item.sha256)))


def _summary(payload: JobPayload, results: dict[int, dict[str, Any]]) -> dict[str, int]:
    failed = sum(1 for r in results.values() if r.get("error") is not None)
    return {"total": len(payload.items), "done": len(results), "failed": failed,
            "tokens": sum(int(r.get("completion_tokens") or 0) for r in results.values()),
            "cache_hits": sum(1 for r in results.values() if r.get("vision_cache_hit"))}


def _plots(series: list[tuple[float, float, float]]) -> dict[str, str]:
    return {"tokens": data.sparkline([(t, tok) for t, tok, _ in series]),
            "items": data.sparkline([(t, it) for t, _, it in series])}


def _try_token(gate: trust.Login, given: str) -> bool:
    """Whether `given` is the token; a 429 with Retry-After instead, unchecked, while this
    client address is over its limit of wrong tokens."""
    got = gate.attempt(given, request.remote_addr or "unknown")
    if got.retry_after is not None:
        raise TooManyRequests(f"too many wrong tokens from your address: try again in "
                              f"{got.retry_after} s", retry_after=got.retry_after)
    return got.ok


def _check_origin(allowed: trust.AllowList) -> None:
    """A POST comes from a page of this dashboard: Origin, when sent (browsers always send
    it on POST), is an allowed name, not merely equal to Host (a rebinding attacker
    controls both)."""
    if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
        abort(403, "cross-site request refused")
    origin = request.headers.get("Origin")
    if origin is not None and not allowed.origin_ok(origin):
        abort(403, "cross-origin request refused")


def _check_action(settings: Settings, csrf: str) -> None:
    """Actions need the flag and this process's form token (the origin is checked for
    every POST before this)."""
    if not settings.allow_actions:
        abort(403, "actions are off: start the dashboard with --allow-actions")
    token = request.form.get("csrf", "")
    if not hmac.compare_digest(token.encode(), csrf.encode()):
        abort(403, "missing or stale form token: reload the page and try again")
