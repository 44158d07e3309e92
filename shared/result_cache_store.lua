-- vlmq: point result-cache entries at one job's stored item results (worker/results/cache.py),
-- then evict to keep the cache's real memory under the byte budget.
-- KEYS[1] = <prefix>:job:<job_id>:items, the results the entries point at
-- KEYS[2..n] = the live generation hashes <prefix>:rcache:gen:<g>, g = ARGV[3], ARGV[3]+1, ...
-- ARGV[1] = now (ms)   ARGV[2] = generation span (ms)   ARGV[3] = first live generation
-- ARGV[4] = budget (bytes)   ARGV[5] = the cache's ttl (ms)
-- ARGV[6], ARGV[7], ... = (digest, pointer) per entry
-- An entry lives in the generation of its target's expiry (the items hash's PTTL, capped
-- by the cache ttl): generation g holds entries whose target expires in [g*span, (g+1)*span)
-- and expires at (g+1)*span, so no entry outlives its target by more than one span. An
-- entry in another generation (pointing at an older copy) moves to the new one.
-- Budget: what the generation hashes really use (gen_usage); over it, random entries of the
-- oldest generation go, at most LIMITS.rcache_evict_rounds * rcache_evict_max per call. Returns how many digests were not in the cache before.
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
local now, span, first = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local pttl = redis.call('PTTL', KEYS[1])
if pttl == UNITS.pttl_missing then return 0 end  -- nothing to point at
if pttl >= 0 and pttl < ttl then ttl = pttl end
local FIRST_GEN_KEY = UNITS.rcache_first_gen_key  -- KEYS[2]: generation `first`
local target = math.floor((now + ttl) / span) - first + FIRST_GEN_KEY
if target < FIRST_GEN_KEY then target = FIRST_GEN_KEY end
if target > #KEYS then target = #KEYS end
local gen = KEYS[target]
local others = {}  -- the other generations that exist: where an older pointer can be
for k = 2, #KEYS do
  if k ~= target and redis.call('EXISTS', KEYS[k]) == 1 then others[#others + 1] = KEYS[k] end
end
local fresh = 0
for i = 6, #ARGV, 2 do
  local moved = 0
  for _, key in ipairs(others) do moved = moved + redis.call('HDEL', key, ARGV[i]) end
  local added = redis.call('HSET', gen, ARGV[i], ARGV[i + 1])
  if added == 1 and moved == 0 then fresh = fresh + 1 end
end
redis.call('PEXPIREAT', gen, (first + target - 1) * span)
-- MEMORY USAGE (5 sampled fields) of one generation; a hash table's 24-byte dict entries
-- take more in jemalloc, which MEMORY USAGE leaves out: LIMITS.rcache_field_overhead per field.
local function gen_usage(key)
  local bytes = redis.call('MEMORY', 'USAGE', key)
  if not bytes then return 0 end
  if redis.call('OBJECT', 'ENCODING', key) == 'hashtable' then
    bytes = bytes + LIMITS.rcache_field_overhead * redis.call('HLEN', key)
  end
  return bytes
end
local function usage()
  local total = 0
  for k = 2, #KEYS do total = total + gen_usage(KEYS[k]) end
  return total
end
local total = usage()
for _ = 1, LIMITS.rcache_evict_rounds do
  if total <= budget then break end
  local oldest = nil
  for k = 2, #KEYS do
    if redis.call('EXISTS', KEYS[k]) == 1 then oldest = KEYS[k] break end
  end
  if oldest == nil then break end
  local n = redis.call('HLEN', oldest)
  local per = gen_usage(oldest) / math.max(n, 1)
  local count = math.min(n, LIMITS.rcache_evict_max, math.max(1, math.ceil((total - budget) / math.max(per, 1))))
  if count >= n then
    redis.call('DEL', oldest)
  else
    redis.call('HDEL', oldest, unpack(redis.call('HRANDFIELD', oldest, count)))
  end
  total = usage()
end
return fresh
