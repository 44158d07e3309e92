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
-- oldest generation go, at most 64,000 per call. Returns how many digests were not in the cache before.
local now, span, first = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then return 0 end  -- nothing to point at
if pttl >= 0 and pttl < ttl then ttl = pttl end
local target = math.floor((now + ttl) / span) - first + 2
if target < 2 then target = 2 end
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
-- take 32 in jemalloc, which MEMORY USAGE leaves out: 8 more per field (measured, 7.0).
local function gen_usage(key)
  local bytes = redis.call('MEMORY', 'USAGE', key)
  if not bytes then return 0 end
  if redis.call('OBJECT', 'ENCODING', key) == 'hashtable' then
    bytes = bytes + 8 * redis.call('HLEN', key)
  end
  return bytes
end
local function usage()
  local total = 0
  for k = 2, #KEYS do total = total + gen_usage(KEYS[k]) end
  return total
end
local total = usage()
for _ = 1, 64 do
  if total <= budget then break end
  local oldest = nil
  for k = 2, #KEYS do
    if redis.call('EXISTS', KEYS[k]) == 1 then oldest = KEYS[k] break end
  end
  if oldest == nil then break end
  local n = redis.call('HLEN', oldest)
  local per = gen_usage(oldest) / math.max(n, 1)
  local count = math.min(n, 1000, math.max(1, math.ceil((total - budget) / math.max(per, 1))))
  if count >= n then
    redis.call('DEL', oldest)
  else
    redis.call('HDEL', oldest, unpack(redis.call('HRANDFIELD', oldest, count)))
  end
  total = usage()
end
return fresh
