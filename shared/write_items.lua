-- vlmq: a worker's item results for one job, written only while its execution owns the job
-- (worker/results/writer.py). All of them and their events land together, or none.
-- KEYS[1] = rq:job:<job_id>   KEYS[2] = <prefix>:job:<job_id>:owner
-- KEYS[3] = <prefix>:job:<job_id>:items   KEYS[4] = <prefix>:job:<job_id>:events
-- ARGV[1] = owner token   ARGV[2] = ttl (s)   ARGV[3] = events stream maxlen
-- ARGV[4], ARGV[5], ARGV[6], ... = (index, result JSON, ok 0|1) per item
-- Returns 0 (nothing written) unless the job is STARTED and owned by the token, else 1.
-- The set <prefix>:job:<job_id>:failed (beside KEYS[3]) holds the indexes of failed items,
-- so listings count done (HLEN) and failed (SCARD) without reading any result; the
-- running counts of the job's queue, labels and batch (PROTOCOL.md 8b) move with them.
-- Key names: the generated block below is shared/keys.py's KEY_TABLE, so no key is spelled here.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.job_failed(prefix, job_id) return prefix .. ':job:' .. job_id .. ':failed' end
function KEY.job_items(prefix, job_id) return prefix .. ':job:' .. job_id .. ':items' end
function KEY.jobs_state_index(prefix, name) return prefix .. ':by-state:' .. name end
function KEY.jobs_tally(prefix) return prefix .. ':jobs:tally' end
function KEY.rq_job(job_id) return 'rq:job:' .. job_id end
-- END KEYS
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
if redis.call('HGET', KEYS[1], 'status') ~= 'started'
    or redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
-- The job id and prefix are those in KEYS[1] and KEYS[3], less the keys' own names.
local job_id = string.sub(KEYS[1], #KEY.rq_job('') + 1)
local prefix = string.sub(KEYS[3], 1, #KEYS[3] - #KEY.job_items('', job_id))
local failed = KEY.job_failed(prefix, job_id)
local done_now, failed_now = 0, 0  -- what this write adds to the running counts
for i = 4, #ARGV, 3 do
  done_now = done_now + redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  if ARGV[i + 2] == '0' then
    failed_now = failed_now + redis.call('SADD', failed, ARGV[i])
  else
    failed_now = failed_now - redis.call('SREM', failed, ARGV[i])
  end
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*',
             'type', 'item', 'index', ARGV[i], 'ok', ARGV[i + 2])
end
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[2])
if redis.call('EXISTS', failed) == 1 then redis.call('EXPIRE', failed, ARGV[2]) end
TALLY.items(prefix, job_id, done_now, failed_now)
return 1
