"""Protocol-wide defaults and limits. Producers and workers read these, never their own copies."""

from __future__ import annotations

PROTOCOL_VERSION = 1
TASKS = ("ocr", "caption", "generate", "extract")
ITEM_KINDS = ("image", "pdf", "tiff", "text")
# A text item has no input of its own (no blob, no ref): the job's prompt is all the model
# sees (an OpenAI batch line with no image). Only tasks that take a prompt can run one.
TEXT_KIND = "text"
TEXT_TASKS = ("generate", "extract")
# The task whose job must give a prompt (it has no default one).
PROMPT_TASK = "generate"
# Kinds that are documents: each item is one 1-based page of the file (a TIFF page is a
# frame). Every TIFF is one, even with a single frame, so its kind never depends on count.
PAGED_KINDS = ("pdf", "tiff")

# The RQ function every vlmq job names; the worker dispatches on it.
TASK_FUNC = "vlmq.worker.task.run"
# What a finished job's hash holds as RQ's `data` once end_job.lua has moved the payload to
# `<prefix>:job:<id>:end` (so every value of the hash is <= 64 B): a call RQ can
# still load (no arguments), never run because the job has ended.
MOVED_DATA = '["' + TASK_FUNC + '",null,[],{}]'

DEFAULT_QUEUE = {"ocr": "ocr", "caption": "caption", "generate": "generate",
                 "extract": "extract"}

# The stores a machine reads inputs from by reference: NAME=URL, comma-separated
# (stores/backends.py; here so the CLI's help names it without importing stores).
STORES_ENV = "VLMQ_STORES"
# Set to 1 to run against a Redis whose maxmemory-policy may evict vlmq's keys
# (shared/redis_checks.py; here so the CLI's help names it without importing redis).
ALLOW_EVICTION_ENV = "VLMQ_ALLOW_EVICTION"
# A job's states as vlmq's code knows them (the status in RQ's job hash): the first three
# are the ends end_job.lua writes. The running counts name these (shared/job_index.py's
# TALLY_STATES) and `vlmq jobs --status` takes exactly these.
JOB_ENDS = ("finished", "failed", "canceled")
JOB_STATES = (*JOB_ENDS, "queued", "started", "stopped", "deferred", "scheduled")
# Where producers and workers look for Redis when neither --redis-url nor REDIS_URL is set.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# A starting worker (loading its model, not yet an RQ worker) names itself in
# `<prefix>:starting:<queue>` for each queue it will serve, refreshed every third of this;
# producers count it as serving the queue. A worker that dies while starting leaves the
# set at most this long after its last refresh.
WORKER_STARTING_TTL_S = 30
# Enqueue warns of a queue no worker serves only after this long without one: a worker
# started in the background a moment before names itself within it.
UNSERVED_GRACE_S = 1.5

BLOB_TTL_S = 7 * 24 * 3600
BLOB_MAX_BYTES = 64 * 1024 * 1024
RESULT_TTL_S = 7 * 24 * 3600
FAILURE_TTL_S = 30 * 24 * 3600
JOB_TIMEOUT_S = 24 * 3600
# RQ requeues a job whose worker died (abandoned) while retries are left; vlmq then
# resumes it at item level. Bad payloads and wrong models fail without retry.
CRASH_RETRIES = 3
# The most retries a job may carry (enqueue.lua's retries_left, for every language).
MAX_CRASH_RETRIES = 10
# A job's description (vlmq's short summary: at most three sources of 4096 characters),
# as enqueue.lua bounds it for every language.
MAX_DESCRIPTION_CHARS = 16_384
# An item's source (a file name, URL or store path, echoed in its result).
MAX_SOURCE_CHARS = 4096

# Decompression-bomb guard: Pillow's own default is ~89 Mpx; bulk OCR never needs more.
MAX_IMAGE_PIXELS = 64_000_000
# Longest side over shortest: Qwen-style vision processors (smart_resize) refuse 200 and
# more, so an image (or PDF page) that far from square is refused before any work.
MAX_ASPECT_RATIO = 200
MAX_ITEMS_PER_JOB = 10_000
# A TIFF's pages (its chain of image directories) stop here, for the producer's check and
# the worker's page index alike: the bound a payload's page numbers have (shared/messages.py).
MAX_TIFF_PAGES = 1_000_000
MAX_PROMPT_CHARS = 20_000
# An extract job's JSON Schema: UTF-8 bytes of its compact JSON (shared/extract_schema.py).
# Real schemas are a few KB; the cap keeps a job hash, the matcher and the default prompt
# (which quotes the schema) small.
MAX_SCHEMA_BYTES = 65_536
MAX_TOKENS_LIMIT = 32_768
MAX_STOP_STRINGS = 16
MAX_SIDE_RANGE = (28, 8192)
# generation.temperature is 0..MAX_TEMPERATURE: far past any useful sampling, low enough
# that a typo (50 for 0.5) is refused rather than run as noise.
MAX_TEMPERATURE = 5.0
MAX_LABELS = 64
# An item's custom_id (OpenAI Batch style), echoed in its result.
MAX_CUSTOM_ID_CHARS = 256
# Field of the RQ job hash (rq:job:<id>) holding the epoch seconds of the job's first start
# on any worker (HSETNX): a resumed job's summary wall_s covers the whole job.
FIRST_STARTED_FIELD = "vlmq_first_started"
# Field of the RQ job hash naming the batch whose fair-share list holds the job ("" for
# one without a batch): written at enqueue, removed when a worker takes or starts the job,
# so an entry without it (requeued, pushed by hand) is taken from the queue's head.
FAIR_FIELD = "vlmq_fair"
# Field of the RQ job hash holding its item count (RQ ignores fields it does not know), so a
# reader of one hash need not inflate its payload (shared/job_index.py writes it).
ITEMS_FIELD = "vlmq_items"
# The share list of jobs enqueued without a batch (a batch id is never empty).
LOOSE_SHARE = ""
# A job whose labels name a tenant takes its turn with that tenant's jobs, whatever their
# batch (the OpenAI API labels each key's batches with the key's owner name), so a tenant
# with many batches gets one turn, not one per batch. Its share is TENANT_SHARE + the name,
# which no batch id (b-...) can be.
TENANT_LABEL = "tenant"
TENANT_SHARE = "tenant:"

# Hard bounds on what a worker reads from a job hash (shared/bounded_reads.py): any compressed
# field inflates to at most MAX_FIELD_BYTES, JSON nests at most MAX_JSON_DEPTH deep, and a
# JSON number is at most MAX_JSON_NUMBER_CHARS characters (every such integer converts to a
# float; Python refuses integers past 4,300 digits with a ValueError).
MAX_FIELD_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 32
MAX_JSON_NUMBER_CHARS = 100
# The dead-letter list (<prefix>:dead) keeps this many newest entries.
DEAD_LETTER_MAX = 10_000
# Queue names are chosen by whoever enqueues, and every one lives on in rq:queues and in
# each per-queue listing: a new queue is refused once rq:queues holds this many
# (enqueue.lua for every language, the Python client before it uploads); a queue already
# there is always taken. enqueue.lua gets the number in its generated LIMITS block.
MAX_QUEUES = 64
# A job's events stream outlives its end by this long, so a follower blocked on it (or
# between two reads) sees the terminal event; the end itself stays in the job hash
# (PROTOCOL.md section 5), so nothing per job is kept as a stream.
ENDED_EVENTS_S = 60
# A job's events stream is capped near this many entries (XADD MAXLEN ~).
EVENTS_MAXLEN = 10_000
# `vlmq status` and `vlmq metrics` show at most this many queues, one of them the
# "(other)" line folding the rest (those with workers and the most jobs are shown), so
# their output is bounded whatever names an older Redis already holds.
MAX_SHOWN_QUEUES = 20
# fair_take.lua's bounds on one call's work: stale ids dropped from a batch list's head per
# look, and share-list pops per job wanted (plus a floor), so a call never scans a queue.
FAIR_STALE_DROPS = 16
FAIR_POPS_PER_JOB = 4
FAIR_POPS_FLOOR = 64
# result_cache_store.lua's eviction: a hash table's 24-byte dict entries take 32 in
# jemalloc, which MEMORY USAGE leaves out (8 more per field, measured on Redis 7.0); at most
# this many rounds of at most this many entries per call.
RCACHE_FIELD_OVERHEAD_BYTES = 8
RCACHE_EVICT_ROUNDS = 64
RCACHE_EVICT_MAX = 1000
