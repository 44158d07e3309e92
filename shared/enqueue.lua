-- vlmq protocol v1: enqueue one job atomically, from any language.
-- KEYS[1] = rq:job:<job_id>      KEYS[2] = rq:queue:<queue>      KEYS[3] = rq:queues
-- KEYS[4] = <prefix>:job:<job_id>:items   KEYS[5] = <prefix>:job:<job_id>:events
-- ARGV[1] = job_id   ARGV[2] = queue name   ARGV[3] = data: JSON ["vlmq.worker.task.run", null, [payload], {}]
-- ARGV[4] = description   ARGV[5] = timeout (s)   ARGV[6] = result_ttl (s)   ARGV[7] = failure_ttl (s)
-- ARGV[8] = now, RQ's format %Y-%m-%dT%H:%M:%S.%fZ (UTC)
-- ARGV[9] = retries_left: how often RQ requeues the job if its worker dies (0..10; vlmq uses 3)
-- A queue not yet in rq:queues is refused once it holds LIMITS.max_queues queues (the
-- generated block below, shared/constants.py MAX_QUEUES): names are the caller's, and each
-- lives on in every listing. A queue already there is always taken.
-- Returns 1 when enqueued, 0 when the id is taken: a job with that id exists, or results
-- of an earlier job with that id remain. Anything malformed is an error reply that names
-- the argument, key or payload field. Every check runs before the first write, so an
-- error or a 0 leaves Redis exactly as it was. The worker validates the payload fully
-- (generation settings, label types...); the checks here are those that need no model.
-- Key names: the generated block below is shared/keys.py's KEY_TABLE, so no key is spelled here.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.batch_counts(prefix, batch_id) return prefix .. ':batch:' .. batch_id .. ':counts' end
function KEY.blob(prefix, sha256) return prefix .. ':blob:' .. sha256 end
function KEY.blob_jobs(prefix, sha256) return prefix .. ':blob-jobs:' .. sha256 end
function KEY.counts_label(prefix, key, value) return prefix .. ':counts:label:' .. #key .. ':' .. key .. '=' .. value end
function KEY.counts_queue(prefix, queue) return prefix .. ':counts:queue:' .. queue end
function KEY.fair_jobs(prefix, queue, batch_id) return prefix .. ':fair:' .. queue .. ':batch:' .. batch_id end
function KEY.fair_ring(prefix, queue) return prefix .. ':fair:' .. queue .. ':ring' end
function KEY.job_events(prefix, job_id) return prefix .. ':job:' .. job_id .. ':events' end
function KEY.job_inputs(prefix, job_id) return prefix .. ':job:' .. job_id .. ':inputs' end
function KEY.job_items(prefix, job_id) return prefix .. ':job:' .. job_id .. ':items' end
function KEY.jobs_index(prefix) return prefix .. ':jobs' end
function KEY.jobs_label_index(prefix, key, value) return prefix .. ':jobs:label:' .. #key .. ':' .. key .. '=' .. value end
function KEY.jobs_meta(prefix) return prefix .. ':jobs:meta' end
function KEY.jobs_queue_index(prefix, queue) return prefix .. ':jobs:queue:' .. queue end
function KEY.jobs_state_index(prefix, name) return prefix .. ':by-state:' .. name end
function KEY.jobs_tally(prefix) return prefix .. ':jobs:tally' end
function KEY.rq_job(job_id) return 'rq:job:' .. job_id end
function KEY.rq_queue(queue) return 'rq:queue:' .. queue end
function KEY.rq_queues() return 'rq:queues' end
local KEY_SHOWN = {
  job_events = '<prefix>:job:<job_id>:events',
  job_items = '<prefix>:job:<job_id>:items',
  rq_job = 'rq:job:<job_id>',
  rq_queue = 'rq:queue:<queue>',
  rq_queues = 'rq:queues',
}
-- END KEYS
-- BEGIN LIMITS: generated from vlmq/shared/constants.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local LIMITS = {max_queues = 64, ended_events_s = 60, moved_data = "[\"vlmq.worker.task.run\",null,[],{}]", fair_field = "vlmq_fair", loose_share = "", tenant_label = "tenant", tenant_share = "tenant:", items_field = "vlmq_items", max_items = 10000}
-- END LIMITS
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
-- members would repeat RQ's queue lists and registries at ~140 B a job (issue 28).
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
if #KEYS ~= 5 then
  return redis.error_reply('KEYS: expected 5 keys, got ' .. #KEYS)
end
if not string.match(ARGV[1], '^[%w_-]+$') or #ARGV[1] > 128 then
  return redis.error_reply('job_id: must match [A-Za-z0-9_-]{1,128}')
end
if not string.match(ARGV[2], '^[%w_.-]+$') or #ARGV[2] > 64 then
  return redis.error_reply('queue: must match [A-Za-z0-9_.-]{1,64}')
end
if KEYS[1] ~= KEY.rq_job(ARGV[1]) then
  return redis.error_reply('KEYS[1]: must be ' .. KEY_SHOWN.rq_job)
end
if KEYS[2] ~= KEY.rq_queue(ARGV[2]) then
  return redis.error_reply('KEYS[2]: must be ' .. KEY_SHOWN.rq_queue)
end
if KEYS[3] ~= KEY.rq_queues() then
  return redis.error_reply('KEYS[3]: must be ' .. KEY_SHOWN.rq_queues)
end
local items_tail = KEY.job_items('', ARGV[1])  -- the name less its prefix
local prefix = string.sub(KEYS[4], 1, #KEYS[4] - #items_tail)
if #KEYS[4] <= #items_tail or string.sub(KEYS[4], -#items_tail) ~= items_tail then
  return redis.error_reply('KEYS[4]: must be ' .. KEY_SHOWN.job_items)
end
if KEYS[5] ~= KEY.job_events(prefix, ARGV[1]) then
  return redis.error_reply('KEYS[5]: must be ' .. KEY_SHOWN.job_events ..
    ', with the prefix of KEYS[4]')
end
for i, name in pairs({[5] = 'timeout', [6] = 'result_ttl', [7] = 'failure_ttl'}) do
  if not string.match(ARGV[i], '^%d+$') or tonumber(ARGV[i]) < 1 then
    return redis.error_reply(name .. ': must be a positive whole number of seconds')
  end
end
-- RQ parses the fraction with %f: 1 to 6 digits (microseconds).
if not string.match(ARGV[8], '^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d?%d?%d?%d?%d?Z$') then
  return redis.error_reply('now: must be UTC as %Y-%m-%dT%H:%M:%S.%fZ (1 to 6 fraction digits)')
end
do  -- a real time of day on a real date: the worker's strptime refuses month 13 or day 45
  local y, mo, d, h, mi, sec = string.match(ARGV[8], '^(%d+)%-(%d+)%-(%d+)T(%d+):(%d+):(%d+)')
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  local leap = (y % 4 == 0 and y % 100 ~= 0) or y % 400 == 0
  local days = ({31, leap and 29 or 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31})[mo]
  if y < 1 or not days or d < 1 or d > days or tonumber(h) > 23 or tonumber(mi) > 59 or
      tonumber(sec) > 59 then
    return redis.error_reply('now: ' .. ARGV[8] .. ' is not a valid UTC date and time')
  end
end
-- The description is vlmq's short summary (at most three sources of 4096 characters).
local _, description_chars = string.gsub(ARGV[4], '[^\128-\191]', '')
if description_chars > 16384 then
  return redis.error_reply('description: is longer than 16384 characters')
end
if not string.match(ARGV[9], '^%d+$') or tonumber(ARGV[9]) > 10 then
  return redis.error_reply('retries_left: must be a whole number from 0 to 10')
end
local expected_types = {[1] = 'hash', [2] = 'list', [3] = 'set', [4] = 'hash', [5] = 'stream'}
for i, want in pairs(expected_types) do
  local got = redis.call('TYPE', KEYS[i])['ok']
  if got ~= 'none' and got ~= want then
    return redis.error_reply('KEYS[' .. i .. ']: ' .. KEYS[i] .. ' holds a ' .. got ..
      ', not a ' .. want)
  end
end
if redis.call('SISMEMBER', KEYS[3], KEYS[2]) == 0 then
  local known = redis.call('SCARD', KEYS[3])
  if known >= LIMITS.max_queues then
    return redis.error_reply('queue: ' .. ARGV[2] .. ' would be a new queue, and vlmq keeps ' ..
      'at most ' .. LIMITS.max_queues .. ' queues (' .. KEYS[3] .. ' holds ' .. known ..
      '): use an existing queue')
  end
end

-- The payload: decoded with Redis's own cjson.
local ok, data = pcall(cjson.decode, ARGV[3])
if not ok or type(data) ~= 'table' then
  return redis.error_reply('data: must be the JSON array [func, null, [payload], {}]')
end
if data[1] ~= 'vlmq.worker.task.run' then
  return redis.error_reply('data: function must be vlmq.worker.task.run')
end
if type(data[3]) ~= 'table' or #data[3] ~= 1 or type(data[3][1]) ~= 'table' then
  return redis.error_reply('data: args must be a list holding exactly one payload object')
end
local payload = data[3][1]
local function is_array(t)
  if type(t) ~= 'table' then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end
local function utf8_len(s)
  local _, n = string.gsub(s, '[^\128-\191]', '')
  return n
end
local function is_int(x, lo, hi)
  return type(x) == 'number' and x == math.floor(x) and x >= lo and x <= hi
end
-- Payload settings: the generated table below is shared/settings.py's, row for row, so
-- Lua refuses the same out-of-range values as the worker, naming the same field.
-- BEGIN SETTINGS: generated from vlmq/shared/settings.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local SETTINGS = {
  {name = 'prompt', path = {'prompt'}, kind = 'str', max_len = 20000},
  {name = 'schema', path = {'schema'}, kind = 'schema', max_bytes = 65536},
  {name = 'model', path = {'model'}, kind = 'str', max_len = 512},
  {name = 'generation.max_tokens', path = {'generation', 'max_tokens'}, kind = 'int', lo = 1, hi = 32768},
  {name = 'max_side', path = {'max_side'}, kind = 'int', lo = 28, hi = 8192},
  {name = 'generation.temperature', path = {'generation', 'temperature'}, kind = 'float', lo = 0, hi = 5},
  {name = 'generation.stop', path = {'generation', 'stop'}, kind = 'strs', max_len = 256, max_count = 16},
  {name = 'labels', path = {'labels'}, kind = 'labels', max_count = 64},
  {name = 'result_cache', path = {'result_cache'}, kind = 'choice', values = {true, false, 'sampled'}, shown = 'true, false or "sampled"'},
  {name = 'text_layer', path = {'text_layer'}, kind = 'choice', values = {'off', 'fallback', 'prefer'}, shown = '"off", "fallback" or "prefer"'},
  {name = 'blob_ttl', path = {'blob_ttl'}, kind = 'int', lo = 1, hi = 31622400, default = 604800},
  {name = 'keep_inputs', path = {'keep_inputs'}, kind = 'int', lo = 1, hi = 31622400, default = 3600},
  {name = 'batch', path = {'batch'}, kind = 'str', max_len = 128},
}
-- END SETTINGS
local top = {v = {}, task = {}, items = {}, created_at = {}}
for _, s in ipairs(SETTINGS) do
  local head, inner = s.path[1], s.path[2]
  top[head] = top[head] or {}
  if inner then top[head][inner] = 1 end
end
for k in pairs(payload) do
  if type(k) ~= 'string' or not top[k] then
    return redis.error_reply('payload: unknown field ' .. tostring(k))
  end
  if next(top[k]) ~= nil and payload[k] ~= cjson.null then
    if type(payload[k]) ~= 'table' or (#payload[k] > 0) then
      return redis.error_reply(k .. ': must be an object')
    end
    for inner in pairs(payload[k]) do
      if type(inner) ~= 'string' or not top[k][inner] then
        return redis.error_reply(k .. ': unknown field ' .. tostring(inner))
      end
    end
  end
end
local function check_setting(s, x)
  if s.values then
    for _, v in ipairs(s.values) do
      if x == v then return nil end
    end
    return 'must be ' .. s.shown
  end
  if s.kind == 'int' or s.kind == 'float' then
    if type(x) ~= 'number' or (s.kind == 'int' and x ~= math.floor(x)) then
      return 'must be ' .. (s.kind == 'int' and 'an integer' or 'a number')
    end
    if x < s.lo or x > s.hi then
      return 'must be between ' .. s.lo .. ' and ' .. s.hi
    end
  elseif s.kind == 'str' then
    if type(x) ~= 'string' then return 'must be a string' end
    if s.max_len and utf8_len(x) > s.max_len then
      return 'is longer than ' .. s.max_len .. ' characters'
    end
  elseif s.kind == 'strs' then
    if not is_array(x) then return 'must be a list of strings' end
    if s.max_count and #x > s.max_count then
      return 'has more than ' .. s.max_count .. ' entries'
    end
    for i, e in ipairs(x) do
      if type(e) ~= 'string' or e == '' or (s.max_len and utf8_len(e) > s.max_len) then
        return 'must be a non-empty string of at most ' .. s.max_len .. ' characters',
          '[' .. (i - 1) .. ']'
      end
    end
  elseif s.kind == 'labels' then
    if type(x) ~= 'table' or (#x > 0) then return 'must be an object of string values' end
    local n = 0
    for k, v in pairs(x) do
      n = n + 1
      if type(v) ~= 'string' then return 'must be a string', '.' .. tostring(k) end
    end
    if s.max_count and n > s.max_count then
      return 'has more than ' .. s.max_count .. ' entries'
    end
  elseif s.kind == 'schema' then
    -- A JSON Schema object (task extract). cjson reads {} and [] as the same empty table,
    -- so an empty one is refused whichever it was; Python refuses {} too (it constrains
    -- nothing). Its size is cjson's compact encoding less the \/ escapes Python does not
    -- write, so within a few bytes of Python's count (cjson writes 1.0 as 1). Whether it
    -- is a valid schema the matcher takes is checked by the worker (shared/extract_schema.py).
    if type(x) ~= 'table' or #x > 0 or next(x) == nil then
      return 'must be a non-empty JSON object (a JSON Schema)'
    end
    local ok, text = pcall(cjson.encode, x)
    if not ok then return 'is not JSON: ' .. tostring(text) end
    local _, escapes = string.gsub(text, '\\/', '')
    local size = #text - escapes
    if size > s.max_bytes then
      return 'is ' .. size .. ' bytes of compact JSON, over the ' .. s.max_bytes ..
        '-byte limit'
    end
  end
  return nil
end
for _, s in ipairs(SETTINGS) do
  local x = payload
  for _, part in ipairs(s.path) do
    if type(x) ~= 'table' then x = nil break end
    x = x[part]
  end
  if x ~= nil and x ~= cjson.null then
    local problem, at = check_setting(s, x)
    if problem then return redis.error_reply(s.name .. (at or '') .. ': ' .. problem) end
  end
end
if payload.v ~= 1 then
  return redis.error_reply('v: must be 1 (protocol version)')
end
local tasks = {ocr = 1, caption = 1, generate = 1, extract = 1}
if type(payload.task) ~= 'string' or not tasks[payload.task] then
  return redis.error_reply('task: must be one of ocr, caption, generate, extract')
end
local has_schema = payload.schema ~= nil and payload.schema ~= cjson.null
if payload.task == 'extract' and not has_schema then
  return redis.error_reply('schema: is required for task extract')
end
if payload.task ~= 'extract' and has_schema then
  return redis.error_reply('schema: is only allowed with task extract, not ' .. payload.task)
end
if payload.task == 'generate' and (type(payload.prompt) ~= 'string' or payload.prompt == '') then
  return redis.error_reply('prompt: is required for task generate')
end
local items = payload.items
if not is_array(items) or #items == 0 then
  return redis.error_reply('items: must be a non-empty list')
end
if #items > 10000 then
  return redis.error_reply('items: has more than 10000 entries')
end
local item_fields = {kind = 1, blob = 1, ref = 1, sha256 = 1, size = 1, source = 1, page = 1,
  custom_id = 1, prompt = 1}
-- An item's own prompt follows the job's prompt setting's row (and is never empty).
local prompt_row
for _, s in ipairs(SETTINGS) do
  if s.name == 'prompt' then prompt_row = s end
end
local function is_sha256(x)
  return type(x) == 'string' and #x == 64 and not string.match(x, '[^0-9a-f]')
end
-- Why a store path would leave its store (nil when it cannot): as stores/backends.py.
local function ref_path_problem(p)
  if type(p) ~= 'string' or p == '' or utf8_len(p) > 4096 then
    return 'must be a non-empty string of at most 4096 characters'
  end
  if string.find(p, '\0', 1, true) then return 'must not contain NUL' end
  if string.find(p, '\\', 1, true) then return 'must not contain a backslash' end
  if string.sub(p, 1, 1) == '/' then return 'must be relative (no leading /)' end
  for seg in string.gmatch(p, '[^/]+') do
    if seg == '..' then return "must not have a '..' segment" end
  end
  return nil
end
local blobs = {}
local blob_order = {}  -- first use first: a missing blob is named by its first item
for i, item in ipairs(items) do
  local at = 'items[' .. (i - 1) .. ']'
  if type(item) ~= 'table' or is_array(item) and #item > 0 then
    return redis.error_reply(at .. ': must be an object')
  end
  for k in pairs(item) do
    if type(k) ~= 'string' or not item_fields[k] then
      return redis.error_reply(at .. ': unknown field ' .. tostring(k))
    end
  end
  if item.kind ~= 'image' and item.kind ~= 'pdf' and item.kind ~= 'tiff' and
      item.kind ~= 'text' then
    return redis.error_reply(at .. '.kind: must be one of image, pdf, tiff, text')
  end
  if item.kind == 'text' then
    -- A text item (constants.TEXT_KIND) has no input: the prompt is all it gives the model.
    for _, k in ipairs({'blob', 'ref', 'sha256', 'size', 'page'}) do
      if item[k] ~= nil and item[k] ~= cjson.null then
        return redis.error_reply(at .. '.' .. k .. ': is not allowed on a text item (it ' ..
          'has no input: the prompt is all)')
      end
    end
    if payload.task ~= 'generate' and payload.task ~= 'extract' then
      return redis.error_reply(at .. '.kind: text is for tasks generate, extract: ' ..
        payload.task .. ' reads an image')
    end
  elseif item.ref ~= nil then
    -- A reference: read by the worker from its own store, so no blob to look up.
    if item.blob ~= nil then
      return redis.error_reply(at .. ': has both blob and ref; give exactly one')
    end
    local ref = item.ref
    if type(ref) ~= 'table' or (#ref > 0) then
      return redis.error_reply(at .. '.ref: must be an object {"store", "path"}')
    end
    for k in pairs(ref) do
      if k ~= 'store' and k ~= 'path' then
        return redis.error_reply(at .. '.ref: unknown field ' .. tostring(k))
      end
    end
    if type(ref.store) ~= 'string' or #ref.store > 64 or
        not string.match(ref.store, '^[%w_.-]+$') then
      return redis.error_reply(at .. '.ref.store: must match [A-Za-z0-9_.-]{1,64}')
    end
    local problem = ref_path_problem(ref.path)
    if problem then return redis.error_reply(at .. '.ref.path: ' .. problem) end
    if not is_sha256(item.sha256) then
      return redis.error_reply(at .. '.sha256: must be a lowercase hex sha256 (64 characters)')
    end
    if not is_int(item.size, 1, 9007199254740991) then
      return redis.error_reply(at .. '.size: must be a whole number of bytes, at least 1')
    end
  else
    if item.sha256 ~= nil or item.size ~= nil then
      return redis.error_reply(at .. '.' .. (item.sha256 ~= nil and 'sha256' or 'size') ..
        ': is only allowed with ref')
    end
    if not is_sha256(item.blob) then
      return redis.error_reply(at .. '.blob: must be a lowercase hex sha256 (64 characters)')
    end
    if not blobs[item.blob] then
      blobs[item.blob] = at
      blob_order[#blob_order + 1] = item.blob
    end
  end
  -- pdf and tiff are paged kinds (constants.PAGED_KINDS): one item per 1-based page.
  if item.kind == 'pdf' or item.kind == 'tiff' then
    if not is_int(item.page, 1, 1000000) then
      return redis.error_reply(at .. '.page: must be an integer from 1 to 1000000 (1-based)')
    end
  elseif item.page ~= nil and item.page ~= cjson.null then
    return redis.error_reply(at .. '.page: is only allowed on pdf and tiff items')
  end
  if item.source ~= nil and (type(item.source) ~= 'string' or utf8_len(item.source) > 4096) then
    return redis.error_reply(at .. '.source: must be a string of at most 4096 characters')
  end
  if item.custom_id ~= nil and item.custom_id ~= cjson.null and
      (type(item.custom_id) ~= 'string' or utf8_len(item.custom_id) > 256) then
    return redis.error_reply(at .. '.custom_id: must be a string of at most 256 characters')
  end
  if item.prompt ~= nil and item.prompt ~= cjson.null then
    local problem = check_setting(prompt_row, item.prompt)
    if problem then return redis.error_reply(at .. '.prompt: ' .. problem) end
    if item.prompt == '' then
      return redis.error_reply(at .. ".prompt: must not be empty (leave it out to use " ..
        "the job's prompt)")
    end
  end
end
for _, sha in ipairs(blob_order) do
  local at, key = blobs[sha], KEY.blob(prefix, sha)
  if redis.call('EXISTS', key) == 0 then
    return redis.error_reply(at .. '.blob: no blob ' .. key ..
      ' (upload it first, SET NX with a TTL)')
  end
  -- As shared/blobs.py's upload check (BLOB_MAX_BYTES): the worker reads a blob whole.
  local size = redis.call('STRLEN', key)
  if size > 67108864 then
    return redis.error_reply(at .. '.blob: ' .. key .. ' holds ' .. size ..
      ' bytes, over the 67108864-byte (64 MiB) limit for a blob')
  end
end

if redis.call('EXISTS', KEYS[1], KEYS[4], KEYS[5]) > 0 then
  return 0
end
redis.call('HSET', KEYS[1],
  'data', ARGV[3],
  'origin', ARGV[2],
  'description', ARGV[4],
  'timeout', ARGV[5],
  'result_ttl', ARGV[6],
  'failure_ttl', ARGV[7],
  'created_at', ARGV[8],
  'enqueued_at', ARGV[8],
  'status', 'queued',
  'meta', '{}',
  'retries_left', ARGV[9],
  'success_callback_name', '',
  'failure_callback_name', '',
  'stopped_callback_name', '',
  'started_at', '',
  'ended_at', '',
  'last_heartbeat', '',
  'worker_name', '',
  'group_id', '')
redis.call('SADD', KEYS[3], KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
-- Fair shares (PROTOCOL.md section 3a): the job joins its batch's list and the batch the
-- queue's ring (a new batch at tag 0: its turn comes next), and the hash says so, so a
-- worker takes batches in turn without scanning the queue.
do
  local batch = LIMITS.loose_share
  local tenant = type(payload.labels) == 'table' and payload.labels[LIMITS.tenant_label]
  if type(tenant) == 'string' and tenant ~= '' then
    batch = LIMITS.tenant_share .. tenant
  elseif type(payload.batch) == 'string' then
    batch = payload.batch
  end
  redis.call('RPUSH', KEY.fair_jobs(prefix, ARGV[2], batch), ARGV[1])
  redis.call('ZADD', KEY.fair_ring(prefix, ARGV[2]), 'NX', 0, batch)
  redis.call('HSET', KEYS[1], LIMITS.fair_field, batch)
end
-- Input holds (PROTOCOL.md section 2): the job holds each blob until it ends (end_job.lua).
-- A setting the payload leaves out takes its row's default (the generated SETTINGS table).
local function given(name)
  if payload[name] ~= nil and payload[name] ~= cjson.null then return payload[name] end
  for _, s in ipairs(SETTINGS) do
    if s.name == name then return s.default end
  end
end
local hold_ms = given('blob_ttl') * 1000
local keep = string.format('%d', given('keep_inputs'))
local inputs = KEY.job_inputs(prefix, ARGV[1])
for sha in pairs(blobs) do
  local jobs = KEY.blob_jobs(prefix, sha)
  local blob = KEY.blob(prefix, sha)
  redis.call('ZADD', jobs, 'inf', ARGV[1])
  redis.call('HSET', inputs, sha, keep)
  local left = redis.call('PTTL', blob)
  if left >= 0 and left < hold_ms then redis.call('PEXPIRE', blob, hold_ms) end
  if redis.call('PTTL', jobs) < hold_ms then redis.call('PEXPIRE', jobs, hold_ms) end
end
if next(blobs) then redis.call('PEXPIRE', inputs, hold_ms) end
-- Job indexes (PROTOCOL.md "Job indexes", shared/job_index.py): listings read these, never
-- every job hash. Scored by ARGV[8] in epoch µs (exact in a double until the year 2255);
-- the summary (its created written by hand: cjson would round it) names every index.
do
  local y, mo, d, h, mi, sec, frac = string.match(ARGV[8],
    '^(%d+)%-(%d+)%-(%d+)T(%d+):(%d+):(%d+)%.(%d+)Z$')
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  if mo <= 2 then y = y - 1 end  -- days from the civil date (H. Hinnant's algorithm)
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((mo + 9) % 12) + 2) / 5) + d - 1
  local days = era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
    - 719468
  local us = (((days * 24 + tonumber(h)) * 60 + tonumber(mi)) * 60 + tonumber(sec)) * 1000000
    + tonumber(frac .. string.rep('0', 6 - #frac))
  local score = string.format('%d', us)
  local labels = payload.labels
  if type(labels) ~= 'table' then labels = {} end
  redis.call('ZADD', KEY.jobs_index(prefix), score, ARGV[1])
  redis.call('ZADD', KEY.jobs_queue_index(prefix, ARGV[2]), score, ARGV[1])
  for k, v in pairs(labels) do
    redis.call('ZADD', KEY.jobs_label_index(prefix, k, v), score, ARGV[1])
  end
  local meta = cjson.encode({task = payload.task, items = #items, queue = ARGV[2],
    labels = labels})
  redis.call('HSET', KEY.jobs_meta(prefix), ARGV[1],
    string.sub(meta, 1, -2) .. ',"created":' .. score .. '}')
  redis.call('HSET', KEYS[1], 'vlmq_items', #items)
  -- Running counts (PROTOCOL.md 8b): the job is counted queued in its queue's, each of
  -- its labels' and its batch's counts, so status reads a count, never every job.
  local counts = {KEY.counts_queue(prefix, ARGV[2])}
  for k, v in pairs(labels) do counts[#counts + 1] = KEY.counts_label(prefix, k, v) end
  if type(payload.batch) == 'string' then
    counts[#counts + 1] = KEY.batch_counts(prefix, payload.batch)
  end
  TALLY.create(prefix, ARGV[1], 'queued', #items, score, counts)
end
return 1
