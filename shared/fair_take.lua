-- vlmq protocol v1: a worker takes up to ARGV[3] entries of one queue into its
-- intermediate list, fairly between the batches waiting there (PROTOCOL.md section 3a).
-- KEYS[1] = rq:queue:<queue>   KEYS[2] = rq:queue:<queue>:intermediate
-- KEYS[3] = <prefix>:fair:<queue>:ring   KEYS[4] = <prefix>:fair:<queue>:clock
-- ARGV[1] = prefix   ARGV[2] = queue name   ARGV[3] = how many entries at most
-- ARGV[4] = head window: how far from the queue's head an entry is looked for before the
--           queue is searched from its tail
-- Returns {n, id...}: the entries moved, the first n of them taken from the queue's head
-- (no batch list holds them: requeued, pushed by hand), the rest in fair turns.
--
-- Order: first the head entries that no batch's turn will take, then turns by start-time fair
-- queuing, each job costing its items: the batch with the lowest tag goes next, starting at
-- max(its tag, the clock), and its tag moves on by the job's items. A batch that comes
-- back after its list emptied starts at the clock, with no credit saved up. When no turn
-- finds an entry (lists lost), the head entry is taken, so a queue with entries always
-- gives one. Each call does a bounded number of steps: `want` takes and at most
-- 4 * want + 64 list pops of ids taken, canceled or deleted meanwhile.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.fair_jobs(prefix, queue, batch_id) return prefix .. ':fair:' .. queue .. ':batch:' .. batch_id end
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
local queue_key, intermediate, ring, clock_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, queue = ARGV[1], ARGV[2]
local want, window = tonumber(ARGV[3]), tonumber(ARGV[4])
if not want or want < 1 or not window or window < 1 then
  return redis.error_reply('want and window: must be positive numbers')
end
-- Keys of another type (raw writes) are refused before anything is written; the caller
-- then takes the queue first in, first out.
for i, want_type in ipairs({'list', 'list', 'zset', 'string'}) do
  local got = redis.call('TYPE', KEYS[i])['ok']
  if got ~= 'none' and got ~= want_type then
    return redis.error_reply('WRONGTYPE KEYS[' .. i .. '] holds a ' .. got)
  end
end
local out = {0}

-- A command's reply, or nil when it failed on a key of another type (a raw write).
local function try(...)
  local got = redis.pcall(...)
  if type(got) == 'table' and got.err then return nil end
  return got
end

-- The job hash's fields, or nil when it is no hash.
local function fields(id, ...)
  return try('HMGET', KEY.rq_job(id), ...)
end

local function move_head()
  local id = redis.call('LMOVE', queue_key, intermediate, 'LEFT', 'RIGHT')
  if id then
    out[#out + 1] = id
    out[1] = out[1] + 1
  end
  return id
end

-- The batch whose turn will take this job (its hash names it and it is queued), or nil.
local function listed(id)
  local got = fields(id, LIMITS.fair_field, 'status')
  if not got or not got[1] or got[2] ~= 'queued' then return nil end
  return got[1]
end

-- Whether a batch's turn will take this entry: it is listed and next in its batch's list
-- (lists and the queue are pushed in the same order). Ids ahead of it that are listed no
-- more (taken from the head, canceled, deleted) are dropped on the way, a few at a time.
local function awaits_turn(id)
  local batch = listed(id)
  if not batch then return false end
  local list = KEY.fair_jobs(prefix, queue, batch)
  for _ = 1, LIMITS.fair_stale_drops do
    local first = try('LINDEX', list, 0)
    if first == id then return true end
    if not first or listed(first) then return false end
    try('LPOP', list)
  end
  return false
end

-- 1. Entries at the head that no turn will take go first: requeued (a worker stopped or
-- died), pushed without enqueue.lua, or stale (the worker drops those).
while #out - 1 < want do
  local head = redis.call('LINDEX', queue_key, 0)
  if not head or awaits_turn(head) then break end
  move_head()
end

-- The job a batch list named, moved into the intermediate list; its items (the turn's
-- cost), or nil when it is no longer waiting in this queue.
local function take_listed(id)
  local got = fields(id, LIMITS.fair_field, 'status', LIMITS.items_field)
  if not got or not got[1] or got[2] ~= 'queued' then return nil end
  local near = redis.call('LPOS', queue_key, id, 'MAXLEN', window)
  if redis.call('LREM', queue_key, near and 1 or -1, id) == 0 then return nil end
  redis.call('RPUSH', intermediate, id)
  redis.call('HDEL', KEY.rq_job(id), LIMITS.fair_field)
  local items = tonumber(got[3]) or 1
  return math.max(1, math.min(items, LIMITS.max_items))
end

-- 2. Fair turns.
local clock = tonumber(redis.call('GET', clock_key)) or 0
local moved_clock = false
local pops, max_pops = 0, LIMITS.fair_pops_per_job * want + LIMITS.fair_pops_floor
while #out - 1 < want and pops < max_pops do
  local first = redis.call('ZRANGE', ring, 0, 0, 'WITHSCORES')
  if #first == 0 then break end
  local batch, tag = first[1], tonumber(first[2])
  local list = KEY.fair_jobs(prefix, queue, batch)
  local id = try('LPOP', list)
  pops = pops + 1
  local cost = id and take_listed(id)
  if (try('LLEN', list) or 0) == 0 then
    redis.call('ZREM', ring, batch)
  elseif cost then
    local start = math.max(tag, clock)
    redis.call('ZADD', ring, start + cost, batch)
  end
  if cost then
    out[#out + 1] = id
    clock = math.max(tag, clock)
    moved_clock = true
  end
end
if moved_clock then
  redis.call('SET', clock_key, string.format('%.17g', clock))
end

-- 3. Nothing taken while the queue holds entries: the head one, so none waits for good.
if #out == 1 then move_head() end
return out
