-- vlmq protocol v1: the one terminal event of a job's run, written once whoever ends it.
-- Call it in the same MULTI/EXEC as the status change (after it), so a reader who sees the
-- event also sees the job's final status and its result.
-- KEYS[1] = rq:job:<job_id>   KEYS[2] = <prefix>:job:<job_id>:events
-- KEYS[3] = <prefix>:job:<job_id>:items
-- ARGV[1] = job_id   ARGV[2] = finished | failed | canceled (must equal the job's status)
-- ARGV[3] = seconds the events stream and the item results live on (the job's result_ttl
--           or failure_ttl; -1 keeps them)
-- ARGV[4] = channel <prefix>:done   ARGV[5] = channel <prefix>:done:<queue>, or ''
-- ARGV[6], ARGV[7], ... = further event fields and values (e.g. 'error', '<message>')
-- Returns the event's stream id, or nil (nothing written) when the job's status is not
-- ARGV[2] or this run of the job has its terminal event already: the hash field vlmq_end
-- is set, or the stream's last entry is a terminal event (written by a canceler that did
-- not use this script; nothing is ever written after a terminal event).
-- The event is kept in the job hash, in vlmq_end as JSON with its stream id (PROTOCOL.md
-- section 5), for the hash's lifetime, while the stream itself lives only
-- LIMITS.ended_events_s more: long enough for a follower blocked on it to see the end.
-- Key names: the generated block below is shared/keys.py's KEY_TABLE, so no key is spelled here.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.batch(prefix, batch_id) return prefix .. ':batch:' .. batch_id end
function KEY.batch_counts(prefix, batch_id) return prefix .. ':batch:' .. batch_id .. ':counts' end
function KEY.batch_events(prefix, batch_id) return prefix .. ':batch:' .. batch_id .. ':events' end
function KEY.batch_jobs(prefix, batch_id) return prefix .. ':batch:' .. batch_id .. ':jobs' end
function KEY.batch_pending(prefix, batch_id) return prefix .. ':batch:' .. batch_id .. ':pending' end
function KEY.blob(prefix, sha256) return prefix .. ':blob:' .. sha256 end
function KEY.blob_jobs(prefix, sha256) return prefix .. ':blob-jobs:' .. sha256 end
function KEY.job_batch(prefix, job_id) return prefix .. ':job:' .. job_id .. ':batch' end
function KEY.job_end(prefix, job_id) return prefix .. ':job:' .. job_id .. ':end' end
function KEY.job_events(prefix, job_id) return prefix .. ':job:' .. job_id .. ':events' end
function KEY.job_failed(prefix, job_id) return prefix .. ':job:' .. job_id .. ':failed' end
function KEY.job_inputs(prefix, job_id) return prefix .. ':job:' .. job_id .. ':inputs' end
function KEY.jobs_state_index(prefix, name) return prefix .. ':by-state:' .. name end
function KEY.jobs_tally(prefix) return prefix .. ':jobs:tally' end
function KEY.rq_job(job_id) return 'rq:job:' .. job_id end
-- END KEYS
-- BEGIN LIMITS: generated from vlmq/shared/constants.py, keys.py and messages.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local LIMITS = {
  max_queues = 64,
  ended_events_s = 60,
  events_maxlen = 10000,
  moved_data = "[\"vlmq.worker.task.run\",null,[],{}]",
  fair_field = "vlmq_fair",
  loose_share = "",
  tenant_label = "tenant",
  tenant_share = "tenant:",
  items_field = "vlmq_items",
  max_items = 10000,
  version = 1,
  task_func = "vlmq.worker.task.run",
  tasks = {"ocr", "caption", "generate", "extract"},
  item_kinds = {"image", "pdf", "tiff", "text"},
  text_kind = "text",
  text_tasks = {"generate", "extract"},
  schema_task = "extract",
  prompt_task = "generate",
  paged_kinds = {"pdf", "tiff"},
  max_pages = 1000000,
  max_retries = 10,
  max_description_chars = 16384,
  max_source_chars = 4096,
  max_custom_id_chars = 256,
  max_blob_bytes = 67108864,
  job_id_chars = 128,
  job_id_shape = "[A-Za-z0-9_-]{1,128}",
  queue_chars = 64,
  queue_shape = "[A-Za-z0-9_.-]{1,64}",
  sha256_chars = 64,
  store_chars = 64,
  max_ref_path_chars = 4096,
  max_ref_size = 9007199254740991,
  fair_stale_drops = 16,
  fair_pops_per_job = 4,
  fair_pops_floor = 64,
  rcache_field_overhead = 8,
  rcache_evict_rounds = 64,
  rcache_evict_max = 1000,
}
-- END LIMITS
-- BEGIN UNITS: generated from vlmq/shared/lua.py UNITS by `python -m vlmq.shared.lua --write`; do not edit by hand.
local UNITS = {
  ms_per_s = 1000,
  us_per_ms = 1000,
  mib = 1048576,
  us_per_s = 1000000,
  s_per_min = 60,
  min_per_h = 60,
  h_per_day = 24,
  max_hour = 23,
  max_minute = 59,
  max_second = 59,
  fraction_digits = 6,
  pair = 2,
  pttl_missing = -2,
  rcache_first_gen_key = 2,
  max_exact_int = 9007199254740991,
}
-- END UNITS
-- BEGIN TALLY: copied from vlmq/shared/tally_lib.lua by `python -m vlmq.shared.lua --write`; do not edit by hand.
-- vlmq protocol v1: running counts of jobs by state and of their items (PROTOCOL.md 8b).
-- Copied into every script that changes a job (enqueue.lua, write_items.lua,
-- end_job.lua, tally.lua) by `python -m vlmq.shared.lua --write`, so that each change and
-- the counts it moves land in one script. Each job has a record in KEY.jobs_tally: the
-- state it is counted in (s), items (n), items done (d) and failed (f), its index score
-- (c) and the count hashes it is in (t: its queue's, each label's, its batch's). Moving a
-- job reads its record, so a count never depends on what the caller believes: TALLY.sync
-- after any status change (or a hash found gone) puts the job where its hash says.
local TALLY = {}
-- States counted by name; anything else a hand-written hash holds is 'other'.
TALLY.STATES = {queued = true, started = true, finished = true, failed = true,
  canceled = true, stopped = true, deferred = true, scheduled = true}

function TALLY.state(status)
  if status and TALLY.STATES[status] then return status end
  return 'other'
end
-- The states with an index (KEY.jobs_state_index): those RQ keeps no list or registry
-- of (job_index.STATE_INDEXED), so a listing by any state reads O(page); the others'
-- members would repeat RQ's queue lists and registries at ~140 B a job.
TALLY.INDEXED = {stopped = true, other = true}

local function tally_index(prefix, state, score, job_id)
  if TALLY.INDEXED[state] then
    redis.call('ZADD', KEY.jobs_state_index(prefix, state), score, job_id)
  end
end

function TALLY.read(prefix, job_id)
  local raw = redis.call('HGET', KEY.jobs_tally(prefix), job_id)
  if not raw then return nil end
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.t) ~= 'table' then return nil end
  return rec
end

local function tally_save(prefix, job_id, rec)
  redis.call('HSET', KEY.jobs_tally(prefix), job_id, cjson.encode(rec))
end

-- Add each delta to every count hash of the job. Only a new job (jobs = 1) creates a
-- hash; one that expired with its batch is not brought back. A hash whose last job is
-- counted out is deleted, so labels used once leave nothing behind.
local function tally_add(rec, deltas)
  for _, key in ipairs(rec.t) do
    if deltas.jobs == 1 or redis.call('EXISTS', key) == 1 then
      local left = nil
      for name, delta in pairs(deltas) do
        if delta ~= 0 then
          local now = redis.call('HINCRBY', key, name, delta)
          if name == 'jobs' then left = now end
        end
      end
      if left == 0 then redis.call('DEL', key) end
    end
  end
end

-- A new job counted in `state`; a job that has a record already is left as it is.
function TALLY.create(prefix, job_id, state, items, score, keys)
  if redis.call('HEXISTS', KEY.jobs_tally(prefix), job_id) == 1 then return end
  local rec = {s = state, n = items, d = 0, f = 0, c = score, t = keys}
  tally_add(rec, {jobs = 1, items = items, [state] = 1, [state .. '_items'] = items})
  tally_index(prefix, state, score, job_id)
  tally_save(prefix, job_id, rec)
end

function TALLY.move(prefix, job_id, rec, state)
  if rec.s == state then return end
  tally_add(rec, {[rec.s] = -1, [rec.s .. '_items'] = -rec.n, [state] = 1,
    [state .. '_items'] = rec.n})
  redis.call('ZREM', KEY.jobs_state_index(prefix, rec.s), job_id)
  tally_index(prefix, state, rec.c, job_id)
  rec.s = state
  tally_save(prefix, job_id, rec)
end

-- The job leaves every count (deleted, or its hash expired): all it added is taken back.
function TALLY.forget(prefix, job_id, rec)
  tally_add(rec, {jobs = -1, items = -rec.n, items_done = -rec.d, items_failed = -rec.f,
    [rec.s] = -1, [rec.s .. '_items'] = -rec.n})
  redis.call('ZREM', KEY.jobs_state_index(prefix, rec.s), job_id)
  redis.call('HDEL', KEY.jobs_tally(prefix), job_id)
end

-- Count the job where its hash says: its status, or out when the hash is gone.
function TALLY.sync(prefix, job_id)
  local rec = TALLY.read(prefix, job_id)
  if not rec then return end
  local status = redis.call('HGET', KEY.rq_job(job_id), 'status')
  if not status then
    TALLY.forget(prefix, job_id, rec)
  else
    TALLY.move(prefix, job_id, rec, TALLY.state(status))
  end
end

-- Items newly done, and the change in failed items, of one write of item results.
function TALLY.items(prefix, job_id, done, failed)
  if done == 0 and failed == 0 then return end
  local rec = TALLY.read(prefix, job_id)
  if not rec then return end
  tally_add(rec, {items_done = done, items_failed = failed})
  rec.d = rec.d + done
  rec.f = rec.f + failed
  tally_save(prefix, job_id, rec)
end
-- END TALLY
-- BEGIN BLOBS: copied from vlmq/shared/blob_release_lib.lua by `python -m vlmq.shared.lua --write`; do not edit by hand.
-- vlmq protocol v1: a job lets go of its input blobs (PROTOCOL.md section 2). Copied into
-- every script that releases holds (end_job.lua, blob_release.lua) by
-- `python -m vlmq.shared.lua --write`, so a job that ends and a job that is deleted let go
-- by the same rule. Holds past their end are pruned first, so a long-expired failed
-- holder never keeps a blob. A failed job keeps holding its blobs until its failure
-- record expires (retry --failed-only reads them); a blob no live job holds lives on for
-- the longest of this job's keep_inputs and any failed holder's record. A blob that a
-- live job still holds is never shortened. Returns how many blobs the job held.
local BLOBS = {}
function BLOBS.release(prefix, job_id, failed, ttl)
  local inputs = KEY.job_inputs(prefix, job_id)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * UNITS.ms_per_s + math.floor(tonumber(t[2]) / UNITS.us_per_ms)
  local until_ms = (ttl > 0) and string.format('%d', now + ttl * UNITS.ms_per_s) or 'inf'
  local held = redis.call('HGETALL', inputs)
  for i = 1, #held, UNITS.pair do
    local sha, keep_s = held[i], held[i + 1]
    local jobs = KEY.blob_jobs(prefix, sha)
    if failed then
      redis.call('ZADD', jobs, until_ms, job_id)
    else
      redis.call('ZREM', jobs, job_id)
    end
    redis.call('ZREMRANGEBYSCORE', jobs, '-inf', '(' .. now)
    local last = redis.call('ZRANGE', jobs, -1, -1, 'WITHSCORES')[UNITS.pair]
    if last ~= 'inf' then
      local ms = math.max(tonumber(keep_s) * UNITS.ms_per_s, last and tonumber(last) - now or 0)
      redis.call('PEXPIRE', KEY.blob(prefix, sha), ms)
      redis.call('PEXPIRE', jobs, ms)
    end
  end
  if failed and ttl > 0 then
    redis.call('EXPIRE', inputs, ttl)
  elseif not failed then
    redis.call('DEL', inputs)
  end
  return #held / UNITS.pair
end
-- END BLOBS
-- The prefix is KEYS[2]'s, less the events stream's own name.
local prefix = string.sub(KEYS[2], 1, #KEYS[2] - #KEY.job_events('', ARGV[1]))
-- Running counts (PROTOCOL.md 8b): the job is counted in the state its hash now says,
-- whether or not this call writes the event (a second caller moves nothing).
TALLY.sync(prefix, ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then
  return nil
end
-- A finished job's end is in its end hash (below), the others' in the job hash.
local end_key = KEY.job_end(prefix, ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'vlmq_end') == 1
    or redis.call('HEXISTS', end_key, 'event') == 1 then
  return nil
end
local terminal = {finished = true, failed = true, canceled = true}
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if last then
  for i = 1, #last[UNITS.pair], UNITS.pair do
    if last[2][i] == 'type' and terminal[last[2][i + 1]] then
      return nil
    end
  end
end
local fields = {'type', ARGV[2]}
for i = 6, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', LIMITS.events_maxlen, '*', unpack(fields))
-- The event as the job hash keeps it: its type and fields, but for `finished` only the
-- summary (the stream's other fields are copies of the summary's).
local kept = {type = ARGV[2]}
for i = 6, #ARGV - 1, 2 do
  kept[ARGV[i]] = ARGV[i + 1]
end
if kept.summary then
  local ok, summary = pcall(cjson.decode, kept.summary)
  kept = {type = ARGV[2], summary = ok and summary or kept.summary}
end
kept.id = id
local ttl = tonumber(ARGV[3])
if ARGV[2] == 'finished' then
  -- Revision 3 (PROTOCOL.md sections 5, 6): the event and RQ's payload (`data`, read again
  -- only to retry the job) go to the end hash, and the job hash's `data` becomes a stub
  -- RQ can load, so every value left there is <= 64 B and Redis keeps the hash in its
  -- compact encoding (~500 B, not ~1.5 kB). A payload moved by an earlier run stays.
  local data = redis.call('HGET', KEYS[1], 'data')
  if data and data ~= LIMITS.moved_data then
    redis.call('HSET', end_key, 'data', data)
    redis.call('HSET', KEYS[1], 'data', LIMITS.moved_data)
  end
  -- Redis never turns a hashtable back into a listpack: the hash is written again, whole,
  -- with its lifetime (RQ's result_ttl, set before this script in the same transaction).
  local pttl = redis.call('PTTL', KEYS[1])
  local all = redis.call('HGETALL', KEYS[1])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(all))
  if pttl > 0 then redis.call('PEXPIRE', KEYS[1], pttl) end
  redis.call('HSET', end_key, 'event', cjson.encode(kept))
  if ttl > 0 then redis.call('EXPIRE', end_key, ttl) else redis.call('PERSIST', end_key) end
else
  redis.call('HSET', KEYS[1], 'vlmq_end', cjson.encode(kept))
  -- RQ gives a canceled job's hash no lifetime (a failed one has failure_ttl): it is kept
  -- as long as its items, then counted out by whoever meets it gone (section 8b).
  if ARGV[2] == 'canceled' and ttl > 0 and redis.call('PTTL', KEYS[1]) == -1 then
    redis.call('EXPIRE', KEYS[1], ttl)
  end
end
redis.call('EXPIRE', KEYS[2], LIMITS.ended_events_s)
-- The failed-items set (write_items.lua) lives exactly as long as the items hash.
local failed_items = KEY.job_failed(prefix, ARGV[1])
for _, key in ipairs({KEYS[3], failed_items}) do
  if ttl > 0 then
    redis.call('EXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end
local message = cjson.encode({id = ARGV[1], status = ARGV[2]})
redis.call('PUBLISH', ARGV[4], message)
if ARGV[5] ~= '' then
  redis.call('PUBLISH', ARGV[5], message)
end
-- BEGIN BATCH (producer/job_sets.py, PROTOCOL.md section 9): a job of a batch leaves the
-- batch's pending set once; the job that empties it writes the batch's one terminal event.
do
  local job_batch = KEY.job_batch(prefix, ARGV[1])
  local batch = redis.call('GET', job_batch)
  if batch then
    local bkey, pending = KEY.batch(prefix, batch), KEY.batch_pending(prefix, batch)
    local batch_events = KEY.batch_events(prefix, batch)
    if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', job_batch, ARGV[3]) end
    if redis.call('SREM', pending, ARGV[1]) == 1 then
      redis.call('HINCRBY', bkey, ARGV[2], 1)
      if redis.call('SCARD', pending) == 0 then
        local n = redis.call('HMGET', bkey, 'jobs', 'finished', 'failed', 'canceled', 'ttl')
        local status = 'finished'
        if tonumber(n[3] or '0') > 0 then status = 'failed'
        elseif tonumber(n[4] or '0') > 0 then status = 'canceled' end
        local now = redis.call('TIME')
        redis.call('HSET', bkey, 'status', status, 'ended_at', now[1] .. '.' .. now[2])
        redis.call('XADD', batch_events, '*', 'type', status, 'batch', batch,
          'jobs', n[1] or '0', 'finished', n[2] or '0', 'failed', n[3] or '0',
          'canceled', n[4] or '0')
        local batch_ttl = tonumber(n[5] or '0') or 0
        for _, key in ipairs({bkey, KEY.batch_jobs(prefix, batch), batch_events,
            KEY.batch_counts(prefix, batch)}) do
          if batch_ttl > 0 then redis.call('EXPIRE', key, batch_ttl) end
        end
        redis.call('PUBLISH', ARGV[4], cjson.encode({id = batch, status = status, batch = true}))
      end
    end
  end
end
-- END BATCH
-- The job lets go of its input blobs (PROTOCOL.md section 2; the BLOBS block above).
BLOBS.release(prefix, ARGV[1], ARGV[2] == 'failed', ttl)
return id
