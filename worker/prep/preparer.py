"""Turn one job item into an engine Request, on a CPU pool thread.

On a vision-cache hit nothing about the image is touched: no blob fetch, no decode, no
PDF render, no tower; the cached grid rebuilds the prompt ids. On a miss the image is
fetched, decoded or rendered, resized and run through the processor, and the engine hands
the tower's features back through `on_features` so they are cached for next time.

With render processes (the worker's), every decode and render runs in one of them, under
its time and memory limits: an item past either fails alone and this pool thread is free
at once. A referenced input is read as a verified private copy on disk, never whole into
memory here, and only up to the render processes' memory budget (REF_LIMIT_WHY).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

import numpy as np
from PIL import Image
from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, JobPayload
from vlmq.shared.urls import redact_text
from vlmq.stores.api_store import explain
from vlmq.stores.backends import RefUnreadable, StoreError, Stores
from vlmq.worker.engine.batcher import Engine, EngineInfo, Request
from vlmq.worker.engine.constraints import Structured
from vlmq.worker.item_order import JobState
from vlmq.worker.job_settings import JobSettings, resolve_job
from vlmq.worker.jobs.poison import RiskLog
from vlmq.worker.model import mlx_adapter
from vlmq.worker.prep import decode, text_layer
from vlmq.worker.prep.render_pool import DEFAULT_MEM_MB, RenderPool
from vlmq.worker.prep.vision_cache import Entry, VisionCache, cache_key

log = logging.getLogger("vlmq.worker")

# How long an item waits for another item's pending tower run on the same image.
SINGLE_FLIGHT_WAIT_S = 60.0
MAX_REMEMBERED_LAYERS = 4096
# Referenced inputs remembered as verified (with the identity of what was hashed).
MAX_REMEMBERED_REFS = 4096
# Threads that verify referenced items a result-cache answer is waiting on.
VERIFY_THREADS = 4
# Bump when rendering or resizing changes in a way that changes pixels.
PREPROCESS_VERSION = 1
# Why a referenced input has the size limit it has, for its error.
REF_LIMIT_WHY = (" on this worker: a reference may be as large as one decode process's memory "
                 "(--render-mem-mb), since some decoders (libtiff, libheif) hold the file whole")


class PrepError(VlmqError):
    """An item cannot be prepared; the message names the problem, the job goes on. It is
    stored in Redis as the item's error, so it is redacted (shared/urls.py)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


def ref_failed(item: Item, exc: VlmqError) -> PrepError:
    """The item error for a reference that failed: what its producer may know, with the
    reason a RefUnreadable keeps to itself logged here, on this machine only; an API
    batch's image that cannot be read says which setting fixes it (api_store.explain)."""
    detail = getattr(exc, "detail", None)
    if detail is not None:
        log.warning("%s: %s", item.source, detail)
    if item.ref is not None and isinstance(exc, StoreError):
        return PrepError(explain(item.ref, exc))
    return PrepError(str(exc))


class Readable(list[int]):
    """A job's item indexes the result cache may be asked about, with `confirm`: which of
    those it answered may have the answer, once their referenced inputs were verified
    (worker/results/cache.py calls it on the hits only, so a miss costs no read)."""

    def __init__(self, indexes: Iterable[int],
                 confirm: Callable[[Sequence[int]], set[int]]) -> None:
        super().__init__(indexes)
        self.confirm = confirm


class _Held:
    """A verified copy of an item's input, handed to the first reader that asks (it then
    closes it); later readers get a fresh verified copy. Unread, close() drops it."""

    def __init__(self, copy: IO[bytes] | None, again: Callable[[], decode.Source]) -> None:
        self._copy, self._again = copy, again
        self._lock = threading.Lock()

    def __call__(self) -> decode.Source:
        with self._lock:
            copy, self._copy = self._copy, None
        return copy if copy is not None else self._again()

    def close(self) -> None:
        with self._lock:
            copy, self._copy = self._copy, None
        if copy is not None:
            copy.close()


@dataclass(frozen=True)
class FromLayer:
    """An item answered by its PDF page's text layer (text_layer prefer): no model run."""

    text: str


Prepared = Request | FromLayer


def model_matches(requested: str, served: str) -> bool:
    """A job's `model` matches when it names the served id, or the same local folder."""
    if requested == served:
        return True
    try:
        a, b = Path(requested).expanduser(), Path(served).expanduser()
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # e.g. "~nosuchuser/..." cannot be expanded
        return False


class Preparer:
    def __init__(self, engine: Engine, info: EngineInfo, cache: VisionCache, redis: Redis,
                 keys: Keys, pool: ThreadPoolExecutor, renderer: RenderPool | None = None,
                 risk: RiskLog | None = None, stores: Stores | None = None,
                 urgent: ThreadPoolExecutor | None = None) -> None:
        """`renderer`: the worker's render processes; None renders in this process (tests
        and benchmarks that construct a Preparer directly; a crafted PDF can then hurt).
        `urgent`: the pool interactive jobs' items are prepared in, so that they never
        queue behind the bulk items already submitted to `pool` (default: `pool`).
        `stores`: the only places referenced items are read from (none: every reference
        fails its item, naming the store it needs)."""
        self.stores = stores if stores is not None else Stores()
        self.engine = engine
        self.renderer = renderer
        self.ref_limit = (renderer.mem_mb if renderer is not None else DEFAULT_MEM_MB) << 20
        self.risk = risk  # marks the steps a crash would be charged for (worker/jobs/poison.py)
        self.info = info
        self.cache = cache
        self.keys = keys
        self.blobs = BlobStore(redis, keys)
        self.pool = pool
        self.urgent = urgent if urgent is not None else pool
        self.model_identity = f"{info.model_id}@{info.fingerprint}"
        self._proc_params = self._processor_params(engine.processor)
        self.structured = Structured(engine.processor.tokenizer,
                                     mlx_adapter.eos_token_ids(engine.processor))
        self._flights: dict[str, threading.Event] = {}  # cache key -> its tower run is pending
        self._flight_of: dict[tuple[str, int], str] = {}  # owning item -> cache key
        self._flights_lock = threading.Lock()
        # Item -> its layer's fallback text, as the prefer check read it (None: unusable).
        self._layers: OrderedDict[tuple[str, int], str | None] = OrderedDict()
        # (store, path, sha256, size) -> identity of the file that hashed to it.
        self._verified: OrderedDict[tuple[str, str, str, int], str] = OrderedDict()
        self._verify_pool: ThreadPoolExecutor | None = None

    @staticmethod
    def _processor_params(processor: Any) -> dict[str, object]:
        """Processor settings that change the pixels the tower sees (part of the cache key)."""
        ip = getattr(processor, "image_processor", None)
        out: dict[str, object] = {}
        for name in ("min_pixels", "max_pixels", "patch_size", "merge_size",
                     "temporal_patch_size", "image_mean", "image_std"):
            value = getattr(ip, name, None)
            if isinstance(value, (int, float, str)):
                out[name] = value
            elif isinstance(value, (list, tuple)):
                out[name] = [float(v) for v in value]
        size = getattr(ip, "size", None)
        if isinstance(size, dict):
            out["size"] = {str(k): int(v) for k, v in size.items() if isinstance(v, int)}
        return out

    def check_job(self, payload: JobPayload) -> JobSettings | str:
        """The job's settings on this model, or a reason to fail the whole job before any
        item runs."""
        if payload.get("model") and not model_matches(payload.get("model"), self.info.model_id):
            return (f"job asks for model {payload.get('model')!r} but this worker serves "
                    f"{self.info.model_id!r}; enqueue it on a queue that worker serves")
        try:
            settings = resolve_job(payload, self.info.model_type, self.info.model_id)
            if settings.schema is not None:
                self.structured.grammar(settings.schema)  # compiled once, here
        except ValueError as exc:  # ConstraintError too: a schema this matcher refuses
            return str(exc)
        return settings

    def touch_blobs(self, payload: JobPayload, settings: JobSettings, *,
                    pipeline: Pipeline | None = None) -> None:
        """Refresh the TTL of every blob a job reads, and of the set of jobs holding it,
        when the job starts (for as long as the job asked its inputs to be kept): a job
        that waited long in its queue does not find its inputs gone. Never shortens."""
        shas = {item.blob for item in payload.items if item.blob is not None}
        if not shas:
            return
        blobs = BlobStore(self.blobs.redis, self.keys, ttl_s=settings.blob_ttl)
        pipe = pipeline if pipeline is not None else self.blobs.redis.pipeline(transaction=False)
        for sha in shas:
            blobs.touch(sha, pipeline=pipe)
        if pipeline is None:
            pipe.execute()

    def readable(self, payload: JobPayload, indexes: list[int]) -> Readable:
        """The items among `indexes` the result cache may be asked about: blobs, and refs
        naming a store of this worker with a path that stays inside it. A hit on a ref is
        used only once the file is verified (Readable.confirm): a missing, unreadable or
        changed reference must fail in prepare() even when a cache knows its claimed
        content."""
        out = []
        for idx in indexes:
            ref = payload.items[idx].ref
            try:
                if ref is not None:
                    self.stores.get(ref.store).checked(ref.path)
            except StoreError:
                continue
            out.append(idx)
        return Readable(out, partial(self._confirm, payload))

    def _confirm(self, payload: JobPayload, indexes: Sequence[int]) -> set[int]:
        """The items among `indexes` whose input verifies now (blobs need not): each
        distinct reference hashed once, several at a time, none copied."""
        refs = {idx: payload.items[idx] for idx in indexes if payload.items[idx].ref}
        out = {idx for idx in indexes if idx not in refs}
        if not refs:
            return out
        distinct = {(i.ref, i.ref_sha256, i.size): i for i in refs.values()}
        with self._flights_lock:
            if self._verify_pool is None:
                self._verify_pool = ThreadPoolExecutor(VERIFY_THREADS,
                                                       thread_name_prefix="vlmq-verify")
            pool = self._verify_pool
        good = {key for key, ok in zip(distinct, pool.map(self._verifies, distinct.values()),
                                       strict=True) if ok}
        return out | {idx for idx, i in refs.items() if (i.ref, i.ref_sha256, i.size) in good}

    def _verifies(self, item: Item) -> bool:
        try:
            self.verify_ref(item, keep=False)
        except PrepError:
            return False
        return True

    def verify_ref(self, item: Item, *, keep: bool = True) -> IO[bytes] | None:
        """Verify a referenced item's input (open it, check size and sha256) before any
        cache may answer for it; PrepError when it fails. A file verified before whose
        identity (inode and ctime, or ETag and version) has not changed is not read again
        (None); otherwise the verified copy is returned when `keep`, for the decode."""
        ref, sha, size = item.ref, item.ref_sha256, item.size
        assert ref is not None and sha is not None and size is not None
        key = (ref.store, ref.path, sha, size)
        with self._flights_lock:
            known = self._verified.get(key)
        try:
            if known is not None and self.stores.identity(ref) == known:
                return None
        except RefUnreadable:
            pass  # read it below, for the same answer a first read gives
        try:
            copy, stamp = self.stores.verify(item, limit=self.ref_limit, why=REF_LIMIT_WHY,
                                             keep=keep)
        except StoreError as exc:
            raise ref_failed(item, exc) from None
        with self._flights_lock:
            self._verified[key] = stamp
            self._verified.move_to_end(key)
            while len(self._verified) > MAX_REMEMBERED_REFS:
                self._verified.popitem(last=False)
        return copy

    def submit(self, state: JobState, idx: int) -> Future[tuple[Prepared, float]]:
        pool = self.urgent if state.interactive else self.pool
        return pool.submit(self.prepare, state.job_id, state.payload,
                           state.resolved.for_item(state.payload.items[idx]), idx,
                           interactive=state.interactive)

    def key_for(self, settings: JobSettings, item: Item) -> str:
        params = {"max_side": settings.side_for(item.kind), "kind": item.kind,
                  "v": PREPROCESS_VERSION, "processor": self._proc_params}
        return cache_key(self.model_identity, item.sha256, item.page, params)

    def prepare(self, job_id: str, payload: JobPayload, settings: JobSettings,
                idx: int, *, interactive: bool = False) -> tuple[Prepared, float]:
        """The item as an engine Request (or its page's text-layer answer), and the
        seconds that took. `interactive`: its row goes ahead of every bulk row."""
        t0 = time.perf_counter()
        item = payload.items[idx]
        common = self._common(job_id, idx, settings)
        common.update(interactive=interactive, stream=settings.stream)
        # Before any cache: a reference that is missing, unreadable or changed fails,
        # whatever a cache knows of the content it claims. Its verified copy, if it had
        # to be read, serves the decode.
        held = self._held(item)
        try:
            return self._prepare(job_id, payload, settings, idx, held, common), \
                time.perf_counter() - t0
        finally:
            if held is not None:
                held.close()

    def _held(self, item: Item) -> _Held | None:
        if item.ref is None:
            return None
        return _Held(self.verify_ref(item), self._fetcher(item))

    def _prepare(self, job_id: str, payload: JobPayload, settings: JobSettings, idx: int,
                 held: _Held | None, common: dict[str, Any]) -> Prepared:
        item = payload.items[idx]
        if item.kind == C.TEXT_KIND:
            # No image: nothing to fetch, no tower, and no vision or prefix cache key.
            prepared = mlx_adapter.prepare(self.engine.processor, self.engine.model_config, None,
                                           settings.prompt_or_messages)
            return Request(prepared=prepared, cached_features=None, **common)
        if item.kind == "pdf" and payload.task == "ocr" and settings.text_layer == "prefer":
            answered = self._prefer_layer(job_id, idx, item, held)
            if answered is not None:
                return answered
        key = self.key_for(settings, item) if self.info.cacheable else None
        # The image's content key also keys its prompt prefix (worker/engine/prefix_cache.py).
        common["prefix_key"] = key or self.key_for(settings, item)
        entry = self._lookup(key, (job_id, idx)) if key is not None else None
        if entry is not None:
            prepared = mlx_adapter.prepare_from_grid(self.engine.processor,
                                                     self.engine.model_config,
                                                     entry.grid_thw, settings.prompt_or_messages)
            return Request(prepared=prepared,
                           cached_features=(entry.features, entry.dtype_name), **common)
        return self._from_pixels(job_id, idx, settings, item, key, common, held)

    def _common(self, job_id: str, idx: int, settings: JobSettings) -> dict[str, Any]:
        """What the item's Request carries however its image is prepared."""
        common: dict[str, Any] = {"key": (job_id, idx), "max_tokens": settings.max_tokens,
                                  "temperature": settings.temperature, "stop": settings.stop}
        if settings.schema is not None:
            try:  # on this pool thread: the MLX thread only steps the matcher
                common["constraint"] = self.structured.row(settings.schema)
            except ValueError as exc:
                raise PrepError(str(exc)) from exc
        if self.risk is not None:
            common["risky"] = partial(self.risk.step, job_id, idx)
        return common

    def _prefer_layer(self, job_id: str, idx: int, item: Item,
                      held: _Held | None = None) -> FromLayer | None:
        """The page's text layer as the answer when it is good enough (text_layer prefer)."""
        layer = self.text_layer(item, held)
        if layer is not None and layer.usable("prefer"):
            return FromLayer(layer.text)
        # Should the model fail the page, the fallback needs no second read.
        self._remember_layer((job_id, idx), layer.text if layer is not None
                             and layer.usable("fallback") else None)
        return None

    def _from_pixels(self, job_id: str, idx: int, settings: JobSettings, item: Item,
                     key: str | None, common: dict[str, Any],
                     held: _Held | None = None) -> Request:
        """A vision-cache miss: the image decoded or rendered, then through the processor;
        its features are cached when the tower has run."""
        try:
            with self._risky(job_id, idx, item):
                image = self._load_image(settings, item, held)
                try:
                    prepared = mlx_adapter.prepare(self.engine.processor, self.engine.model_config,
                                                   image, settings.prompt_or_messages)
                except (ValueError, TypeError) as exc:
                    raise PrepError(f"processor rejected the image: {exc}") from exc
        except BaseException:
            self.item_done(job_id, idx)  # let anyone waiting on these features go on
            raise
        on_features = None
        if key is not None and prepared.image_grid_thw is not None:
            on_features = self._storer(key, prepared.image_grid_thw)
        return Request(prepared=prepared, cached_features=None, on_features=on_features,
                       **common)

    def _risky(self, job_id: str, idx: int, item: Item) -> AbstractContextManager[None]:
        """A decode in this process is at the job's risk (a crash in it is charged to the
        job, worker/jobs/poison.py); in a render process it cannot crash the worker."""
        if self.risk is None or self.renderer is not None or item.kind == "pdf":
            return nullcontext()
        return self.risk.step(job_id, idx, "image decode")

    def _lookup(self, key: str, owner: tuple[str, int]) -> Entry | None:
        """Cache lookup with single flight: the same image in flight twice (a duplicate
        page, the same photo in two jobs) runs the tower once; the second waits for it."""
        entry = self.cache.get(key)
        if entry is not None:
            return entry
        with self._flights_lock:
            flight = self._flights.get(key)
            if flight is None:
                self._flights[key] = threading.Event()
                self._flight_of[owner] = key
                return None
        flight.wait(SINGLE_FLIGHT_WAIT_S)
        return self.cache.get(key)  # None if the owner failed: then compute it here

    def _land(self, key: str) -> None:
        with self._flights_lock:
            flight = self._flights.pop(key, None)
        if flight is not None:
            flight.set()

    def item_done(self, job_id: str, idx: int) -> None:
        """The item finished, however: end the flight it owned, if any."""
        with self._flights_lock:
            key = self._flight_of.pop((job_id, idx), None)
        if key is not None:
            self._land(key)

    def _load_image(self, settings: JobSettings, item: Item,
                    held: _Held | None = None) -> Image.Image:
        side = settings.side_for(item.kind)
        fetch = held if held is not None else self._fetcher(item)
        try:
            if self.renderer is not None:
                return _decode_out(self.renderer, fetch, item, side)
            return _decode_here(fetch, item, side)
        except VlmqError as exc:
            raise ref_failed(item, exc) from exc

    def _fetcher(self, item: Item) -> Callable[[], decode.Source]:
        """What reads the item's bytes, called only when they are needed (a render child
        may have the PDF or TIFF open). A reference comes as a verified private copy on
        disk, refused past this worker's limit for one."""
        if item.ref is not None:
            return partial(self.stores.open_verified, item, limit=self.ref_limit,
                           why=REF_LIMIT_WHY)
        return partial(decode.fetch_blob, self.blobs, item.sha256)

    def text_layer(self, item: Item, held: _Held | None = None) -> text_layer.Layer | None:
        """A PDF item's page text layer, judged; None when it cannot be read (the page then
        goes to the model, which says what is wrong with it)."""
        assert item.page is not None
        fetch = held if held is not None else self._fetcher(item)
        try:
            if self.renderer is not None:
                return self.renderer.text_layer(fetch, item.page, doc_key=item.sha256)
            return decode.pdf_text_layer(fetch, item.page, doc_key=item.sha256)
        except VlmqError as exc:
            log.info("%s page %d: no text layer read: %s", item.source, item.page,
                     getattr(exc, "detail", exc))
            return None

    def _remember_layer(self, owner: tuple[str, int], text: str | None) -> None:
        with self._flights_lock:
            self._layers[owner] = text
            while len(self._layers) > MAX_REMEMBERED_LAYERS:  # items of dropped jobs
                self._layers.popitem(last=False)

    def known_layer(self, job_id: str, idx: int) -> tuple[bool, str | None]:
        """What the prefer check already read of the item's layer, forgotten once asked:
        (True, text or None), or (False, None) when it read nothing."""
        with self._flights_lock:
            if (job_id, idx) in self._layers:
                return True, self._layers.pop((job_id, idx))
        return False, None

    def fallback_text(self, item: Item) -> str | None:
        """The text a page the model failed falls back to, if its layer is usable. Runs on
        a pool thread; a Redis error here only costs the fallback."""
        try:
            layer = self.text_layer(item)
        except RedisError as exc:
            log.warning("%s page %s: text layer not read: %s", item.source, item.page, exc)
            return None
        return layer.text if layer is not None and layer.usable("fallback") else None

    def _storer(self, key: str, grid: np.ndarray) -> Callable[[np.ndarray, str], None]:
        """Called on the MLX thread: keep the features in memory now, write disk in the pool."""
        def store(features: np.ndarray, dtype_name: str) -> None:
            entry = Entry(features=features, dtype_name=dtype_name, grid_thw=grid)
            self.cache.put(key, entry, write_disk=False)
            self._land(key)
            try:
                self.pool.submit(self.cache.persist, key, entry)
            except RuntimeError:  # the pool is shutting down: write it here instead
                self.cache.persist(key, entry)
        return store


def _decode_out(renderer: RenderPool, fetch: Callable[[], decode.Source], item: Item,
                side: int) -> Image.Image:
    """The item's pixels from a render process (time and memory bounded)."""
    if item.kind == "pdf":
        assert item.page is not None
        return renderer.render(fetch, item.page, side, doc_key=item.sha256)
    if item.kind == "tiff":
        assert item.page is not None
        return renderer.decode_tiff_page(fetch, item.page, side, doc_key=item.sha256)
    return renderer.decode_image(fetch, side, key=item.sha256)


def _decode_here(fetch: Callable[[], decode.Source], item: Item, side: int) -> Image.Image:
    """The item's pixels decoded in this process (a Preparer built without render
    processes: tests and benchmarks; an input can then cost this process anything)."""
    if item.kind == "pdf":
        assert item.page is not None
        return decode.render_pdf_page(fetch, item.page, side, doc_key=item.sha256)
    if item.kind == "tiff":
        assert item.page is not None
        return decode.decode_tiff_page(fetch, item.page, side, doc_key=item.sha256)
    return decode.decode_image(fetch, side)
