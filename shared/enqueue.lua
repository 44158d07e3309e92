-- vlmq protocol v1: enqueue one job atomically, from any language.
-- KEYS[1] = rq:job:<job_id>      KEYS[2] = rq:queue:<queue>      KEYS[3] = rq:queues
-- KEYS[4] = <prefix>:job:<job_id>:items   KEYS[5] = <prefix>:job:<job_id>:events
-- ARGV[1] = job_id   ARGV[2] = queue name   ARGV[3] = data: JSON ["vlmq.worker.task.run", null, [payload], {}]
-- ARGV[4] = description   ARGV[5] = timeout (s)   ARGV[6] = result_ttl (s)   ARGV[7] = failure_ttl (s)
-- ARGV[8] = now, RQ's format %Y-%m-%dT%H:%M:%S.%fZ (UTC)
-- ARGV[9] = retries_left: how often RQ requeues the job if its worker dies (0 to
--           LIMITS.max_retries; vlmq uses CRASH_RETRIES)
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
-- BEGIN CALENDAR: generated from vlmq/shared/lua.py CALENDAR by `python -m vlmq.shared.lua --write`; do not edit by hand.
local CALENDAR = {
  month_days = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31},
  leap_month = 2,
  leap_every = 4,
  century = 100,
  era_years = 400,
  era_days = 146097,
  year_days = 365,
  months = 12,
  march_shift = 9,
  month_days_num = 153,
  month_days_round = 2,
  month_days_den = 5,
  epoch_shift = 719468,
}
-- END CALENDAR
-- BEGIN MESSAGES: generated from vlmq/shared/messages.py PAYLOAD_MESSAGES and REF_PATH_PROBLEMS by `python -m vlmq.shared.lua --write`; do not edit by hand.
local MESSAGES = {
  version = "unsupported protocol version %s; vlmq speaks v1",
  task = "must be one of ocr, caption, generate, extract",
  items = "must be a non-empty list",
  max_items = "has more than 10000 entries",
  prompt_required = "is required for task generate (unless `messages` is given)",
  not_object = "must be an object",
  unknown_fields = "unknown field(s) %s",
  kind = "must be one of image, pdf, tiff, text",
  text_input = "is not allowed on a text item (it has no input: the prompt is all)",
  text_task = "text is for tasks generate, extract: %s reads an image",
  blob_and_ref = "has both blob and ref; give exactly one",
  ref_object = "must be an object {\"store\", \"path\"}",
  store = "must match [A-Za-z0-9_.-]{1,64}",
  ref_path = "must be a non-empty string of at most 4096 characters",
  size_missing = "is required with ref (the input's bytes)",
  size = "must be a whole number of bytes from 1 to 9007199254740991",
  sha256 = "must be a lowercase hex sha256 (64 characters)",
  only_with_ref = "is only allowed with ref",
  page_missing = "is required for a %s item (1-based)",
  page = "must be an integer from 1 to 1000000 (1-based)",
  page_not_paged = "is only allowed on pdf and tiff items",
  source = "must be a string of at most 4096 characters",
  custom_id = "must be a string of at most 256 characters",
  prompt_empty = "must not be empty (leave it out to use the job's prompt)",
  path_empty = "is empty",
  path_nul = "contains a NUL character",
  path_backslash = "contains a backslash (paths in a store use /)",
  path_absolute = "is absolute (paths in a store are relative to it)",
  path_dotdot = "has a '..' segment (it would leave the store)",
}
-- END MESSAGES
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
-- What each key must hold when it exists (checked below, once its name is checked).
local expected_types = {[1] = 'hash', [2] = 'list', [3] = 'set', [4] = 'hash', [5] = 'stream'}
if #KEYS ~= #expected_types then
  return redis.error_reply('KEYS: expected ' .. #expected_types .. ' keys, got ' .. #KEYS)
end
if not string.match(ARGV[1], '^[%w_-]+$') or #ARGV[1] > LIMITS.job_id_chars then
  return redis.error_reply('job_id: must match ' .. LIMITS.job_id_shape)
end
if not string.match(ARGV[2], '^[%w_.-]+$') or #ARGV[2] > LIMITS.queue_chars then
  return redis.error_reply('queue: must match ' .. LIMITS.queue_shape)
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
  local leap = (y % CALENDAR.leap_every == 0 and y % CALENDAR.century ~= 0) or
    y % CALENDAR.era_years == 0
  local days = CALENDAR.month_days[mo]
  if days and leap and mo == CALENDAR.leap_month then days = days + 1 end
  if y < 1 or not days or d < 1 or d > days or tonumber(h) > UNITS.max_hour or
      tonumber(mi) > UNITS.max_minute or tonumber(sec) > UNITS.max_second then
    return redis.error_reply('now: ' .. ARGV[8] .. ' is not a valid UTC date and time')
  end
end
-- The description is vlmq's short summary (at most three sources of 4096 characters).
local _, description_chars = string.gsub(ARGV[4], '[^\128-\191]', '')
if description_chars > LIMITS.max_description_chars then
  return redis.error_reply('description: is longer than ' .. LIMITS.max_description_chars ..
    ' characters')
end
if not string.match(ARGV[9], '^%d+$') or tonumber(ARGV[9]) > LIMITS.max_retries then
  return redis.error_reply('retries_left: must be a whole number from 0 to ' ..
    LIMITS.max_retries)
end
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
if data[1] ~= LIMITS.task_func then
  return redis.error_reply('data: function must be ' .. LIMITS.task_func)
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
-- A JSON value as Python's repr writes it, for a message that quotes what was given.
local function py_repr(x)
  if x == nil or x == cjson.null then return 'None' end
  if type(x) == 'boolean' then return x and 'True' or 'False' end
  if type(x) == 'string' then return "'" .. x .. "'" end
  if type(x) == 'number' and x == math.floor(x) and math.abs(x) <= UNITS.max_exact_int then
    return string.format('%d', x)
  end
  return tostring(x)
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
  {name = 'messages', path = {'messages'}, kind = 'messages', max_len = 100000, max_count = 256, choices = {'system', 'user', 'assistant'}, fields = {'role', 'content', 'image'}},
  {name = 'stream', path = {'stream'}, kind = 'bool'},
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
-- Each refusal below is shared/messages.py's, from the generated MESSAGES block.
local function unknown_fields(t, allowed)
  local names = {}
  for k in pairs(t) do
    if not allowed[k] then names[#names + 1] = tostring(k) end
  end
  if #names == 0 then return nil end
  table.sort(names)
  return string.format(MESSAGES.unknown_fields, "['" .. table.concat(names, "', '") .. "']")
end
local unknown = unknown_fields(payload, top)
if unknown then return redis.error_reply('payload: ' .. unknown) end
for k in pairs(payload) do
  if next(top[k]) ~= nil and payload[k] ~= cjson.null then
    if type(payload[k]) ~= 'table' or (#payload[k] > 0) then
      return redis.error_reply(k .. ': ' .. MESSAGES.not_object)
    end
    unknown = unknown_fields(payload[k], top[k])
    if unknown then return redis.error_reply(k .. ': ' .. unknown) end
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
  elseif s.kind == 'bool' then
    if type(x) ~= 'boolean' then return 'must be true or false' end
  elseif s.kind == 'messages' then
    -- A conversation (shared/chat.py check_messages: the same checks, the same places).
    if not is_array(x) or #x == 0 then return 'must be a non-empty list of messages' end
    if #x > s.max_count then return 'has more than ' .. s.max_count .. ' messages' end
    local images = 0
    for i, m in ipairs(x) do
      local at = '[' .. (i - 1) .. ']'
      if type(m) ~= 'table' or (#m > 0) then
        return 'must be an object with role and content', at
      end
      local extra = {}
      for k in pairs(m) do
        local known_field = false
        for _, f in ipairs(s.fields) do
          if k == f then known_field = true end
        end
        if not known_field then extra[#extra + 1] = tostring(k) end
      end
      if #extra > 0 then
        table.sort(extra)
        return 'has unknown fields: ' .. table.concat(extra, ', '), at
      end
      local known = false
      for _, r in ipairs(s.choices) do
        if m.role == r then known = true end
      end
      if not known then
        return 'must be one of ' .. table.concat(s.choices, ', '), at .. '.role'
      end
      if type(m.content) ~= 'string' then return 'must be a string', at .. '.content' end
      if utf8_len(m.content) > s.max_len then
        return 'is longer than ' .. s.max_len .. ' characters', at .. '.content'
      end
      if m.image ~= nil and type(m.image) ~= 'boolean' then
        return 'must be true or false', at .. '.image'
      end
      if m.image == true then
        if m.role ~= 'user' then return "only a user's turn can carry the image", at .. '.image' end
        images = images + 1
      end
    end
    if images > 1 then return 'at most one turn carries the image' end
    if x[#x].role ~= 'user' then return "the last message must be the user's" end
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
if payload.v ~= LIMITS.version then
  return redis.error_reply('v: ' .. string.format(MESSAGES.version, py_repr(payload.v)))
end
local function one_of(list, x)
  for _, v in ipairs(list) do
    if v == x then return true end
  end
  return false
end
if type(payload.task) ~= 'string' or not one_of(LIMITS.tasks, payload.task) then
  return redis.error_reply('task: ' .. MESSAGES.task)
end
local has_schema = payload.schema ~= nil and payload.schema ~= cjson.null
if payload.task == LIMITS.schema_task and not has_schema then
  return redis.error_reply('schema: is required for task ' .. LIMITS.schema_task)
end
if payload.task ~= LIMITS.schema_task and has_schema then
  return redis.error_reply('schema: is only allowed with task ' .. LIMITS.schema_task ..
    ', not ' .. payload.task)
end
if payload.task == LIMITS.prompt_task and
    (type(payload.prompt) ~= 'string' or payload.prompt == '') and
    (payload.messages == nil or payload.messages == cjson.null) then
  return redis.error_reply('prompt: ' .. MESSAGES.prompt_required)
end
local items = payload.items
if not is_array(items) or #items == 0 then
  return redis.error_reply('items: ' .. MESSAGES.items)
end
if #items > LIMITS.max_items then
  return redis.error_reply('items: ' .. MESSAGES.max_items)
end
local item_fields = {kind = 1, blob = 1, ref = 1, sha256 = 1, size = 1, source = 1, page = 1,
  custom_id = 1, prompt = 1}
local ref_fields = {store = 1, path = 1}
-- An item's own prompt follows the job's prompt setting's row (and is never empty).
local prompt_row
for _, s in ipairs(SETTINGS) do
  if s.name == 'prompt' then prompt_row = s end
end
local function is_sha256(x)
  return type(x) == 'string' and #x == LIMITS.sha256_chars and not string.match(x, '[^0-9a-f]')
end
local function given_field(x)
  return x ~= nil and x ~= cjson.null
end
-- Why a store path would leave its store (nil when it cannot): as stores/backends.py.
local function ref_path_problem(p)
  if type(p) ~= 'string' or p == '' or utf8_len(p) > LIMITS.max_ref_path_chars then
    return MESSAGES.ref_path
  end
  if string.find(p, '\0', 1, true) then return MESSAGES.path_nul end
  if string.find(p, '\\', 1, true) then return MESSAGES.path_backslash end
  if string.sub(p, 1, 1) == '/' then return MESSAGES.path_absolute end
  for seg in string.gmatch(p, '[^/]+') do
    if seg == '..' then return MESSAGES.path_dotdot end
  end
  return nil
end
local function bounded_str(x, max_len)
  return type(x) == 'string' and utf8_len(x) <= max_len
end
local blobs = {}
local blob_order = {}  -- first use first: a missing blob is named by its first item
for i, item in ipairs(items) do
  local at = 'items[' .. (i - 1) .. ']'
  local function refuse(field, message)
    return redis.error_reply(at .. field .. ': ' .. message)
  end
  if type(item) ~= 'table' or is_array(item) and #item > 0 then
    return refuse('', MESSAGES.not_object)
  end
  unknown = unknown_fields(item, item_fields)
  if unknown then return refuse('', unknown) end
  if not one_of(LIMITS.item_kinds, item.kind) then
    return refuse('.kind', MESSAGES.kind)
  end
  if item.kind == LIMITS.text_kind then
    -- A text item has no input: the prompt is all it gives the model.
    for _, k in ipairs({'blob', 'ref', 'sha256', 'size', 'page'}) do
      if given_field(item[k]) then return refuse('.' .. k, MESSAGES.text_input) end
    end
  elseif item.ref ~= nil then
    -- A reference: read by the worker from its own store, so no blob to look up.
    if item.blob ~= nil then return refuse('', MESSAGES.blob_and_ref) end
    local ref = item.ref
    if type(ref) ~= 'table' or (#ref > 0) then return refuse('.ref', MESSAGES.ref_object) end
    unknown = unknown_fields(ref, ref_fields)
    if unknown then return refuse('.ref', unknown) end
    if type(ref.store) ~= 'string' or #ref.store > LIMITS.store_chars or
        not string.match(ref.store, '^[%w_.-]+$') then
      return refuse('.ref.store', MESSAGES.store)
    end
    local problem = ref_path_problem(ref.path)
    if problem then return refuse('.ref.path', problem) end
    if item.size == nil then return refuse('.size', MESSAGES.size_missing) end
    if not is_int(item.size, 1, LIMITS.max_ref_size) then
      return refuse('.size', MESSAGES.size)
    end
    if not is_sha256(item.sha256) then return refuse('.sha256', MESSAGES.sha256) end
  else
    if item.sha256 ~= nil or item.size ~= nil then
      return refuse('.' .. (item.sha256 ~= nil and 'sha256' or 'size'), MESSAGES.only_with_ref)
    end
    if not is_sha256(item.blob) then return refuse('.blob', MESSAGES.sha256) end
    if not blobs[item.blob] then
      blobs[item.blob] = at
      blob_order[#blob_order + 1] = item.blob
    end
  end
  -- Paged kinds (constants.PAGED_KINDS): one item per 1-based page.
  if one_of(LIMITS.paged_kinds, item.kind) then
    if not given_field(item.page) then
      return refuse('.page', string.format(MESSAGES.page_missing, item.kind))
    end
    if not is_int(item.page, 1, LIMITS.max_pages) then return refuse('.page', MESSAGES.page) end
  elseif given_field(item.page) then
    return refuse('.page', MESSAGES.page_not_paged)
  end
  if item.source ~= nil and not bounded_str(item.source, LIMITS.max_source_chars) then
    return refuse('.source', MESSAGES.source)
  end
  if given_field(item.custom_id) and not bounded_str(item.custom_id, LIMITS.max_custom_id_chars) then
    return refuse('.custom_id', MESSAGES.custom_id)
  end
  if given_field(item.prompt) then
    local problem = check_setting(prompt_row, item.prompt)
    if problem then return refuse('.prompt', problem) end
    if item.prompt == '' then return refuse('.prompt', MESSAGES.prompt_empty) end
  end
end
-- Text items (after every item's own checks, as shared/messages.py): only tasks that take
-- a prompt run them.
if not one_of(LIMITS.text_tasks, payload.task) then
  for i, item in ipairs(items) do
    if item.kind == LIMITS.text_kind then
      return redis.error_reply('items[' .. (i - 1) .. '].kind: ' ..
        string.format(MESSAGES.text_task, payload.task))
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
  if size > LIMITS.max_blob_bytes then
    return redis.error_reply(at .. '.blob: ' .. key .. ' holds ' .. size ..
      ' bytes, over the ' .. LIMITS.max_blob_bytes .. '-byte (' ..
      LIMITS.max_blob_bytes / UNITS.mib .. ' MiB) limit for a blob')
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
local hold_ms = given('blob_ttl') * UNITS.ms_per_s
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
  local K = CALENDAR  -- days from the civil date (H. Hinnant's algorithm)
  if mo <= K.leap_month then y = y - 1 end
  local era = math.floor(y / K.era_years)
  local yoe = y - era * K.era_years
  local doy = math.floor((K.month_days_num * ((mo + K.march_shift) % K.months) +
    K.month_days_round) / K.month_days_den) + d - 1
  local days = era * K.era_days + yoe * K.year_days + math.floor(yoe / K.leap_every) -
    math.floor(yoe / K.century) + doy - K.epoch_shift
  local us = (((days * UNITS.h_per_day + tonumber(h)) * UNITS.min_per_h + tonumber(mi)) *
    UNITS.s_per_min + tonumber(sec)) * UNITS.us_per_s +
    tonumber(frac .. string.rep('0', UNITS.fraction_digits - #frac))
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
    string.sub(meta, 1, #meta - 1) .. ',"created":' .. score .. '}')
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
