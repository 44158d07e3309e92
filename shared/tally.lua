-- vlmq protocol v1: a job's place in the running counts (PROTOCOL.md section 8b), for the
-- Python paths that change a job outside the other scripts (RQ's enqueue, a worker's
-- start or requeue, delete, the sweep). Queue it in the same MULTI as the change, after it.
-- KEYS[1] = <prefix>:jobs:tally
-- ARGV[1] = 'ensure': ARGV[2] = job_id, ARGV[3] = items, ARGV[4] = index score (epoch us),
--           ARGV[5], ... = the count hashes the job is in. Counts a job that has no record
--           in the state its hash's status says; one that has is synced.
-- ARGV[1] = 'sync': ARGV[2], ... = job ids, each counted where its hash says (counted out
--           when the hash is gone).
-- Returns the number of job ids handled.
-- Key names: the generated block below is shared/keys.py's KEY_TABLE, so no key is spelled here.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.jobs_state_index(prefix, name) return prefix .. ':by-state:' .. name end
function KEY.jobs_tally(prefix) return prefix .. ':jobs:tally' end
function KEY.rq_job(job_id) return 'rq:job:' .. job_id end
local KEY_SHOWN = {
  jobs_tally = '<prefix>:jobs:tally',
}
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
local prefix = string.sub(KEYS[1], 1, #KEYS[1] - #KEY.jobs_tally(''))
if KEYS[1] ~= KEY.jobs_tally(prefix) then
  return redis.error_reply('KEYS[1]: must be ' .. KEY_SHOWN.jobs_tally)
end
if ARGV[1] == 'ensure' then
  local job_id = ARGV[2]
  if TALLY.read(prefix, job_id) then
    TALLY.sync(prefix, job_id)
    return 1
  end
  local status = redis.call('HGET', KEY.rq_job(job_id), 'status')
  if not status then return 0 end
  local counts = {}
  for i = 5, #ARGV do counts[#counts + 1] = ARGV[i] end
  TALLY.create(prefix, job_id, TALLY.state(status), tonumber(ARGV[3]), ARGV[4], counts)
  return 1
elseif ARGV[1] == 'sync' then
  for i = 2, #ARGV do TALLY.sync(prefix, ARGV[i]) end
  return #ARGV - 1
end
return redis.error_reply('ARGV[1]: must be ensure or sync')
