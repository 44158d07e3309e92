-- vlmq: store one item text in the shared result cache (worker/result_cache.py), evicting
-- expired entries, then the oldest, to keep the total under the byte budget.
-- KEYS[1] = the entry   KEYS[2] = index zset   KEYS[3] = byte counter
-- ARGV[1] = value   ARGV[2] = ttl (s)   ARGV[3] = budget (bytes)   ARGV[4] = now
-- ARGV[5] = index member   ARGV[6] = entry key prefix
-- Index members are "<bytes>:<digest>"; the digest names the entry key under the prefix.
-- Returns 1 when stored, 0 when the entry exists already or alone exceeds the budget.
local ttl, budget, now = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local function drop(member)
  local size, digest = string.match(member, '^(%d+):(.+)$')
  redis.call('ZREM', KEYS[2], member)
  redis.call('DEL', ARGV[6] .. digest)
  redis.call('DECRBY', KEYS[3], tonumber(size))
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do drop(m) end
local size = tonumber(string.match(ARGV[5], '^(%d+):'))
if size > budget then return 0 end
while tonumber(redis.call('GET', KEYS[3]) or '0') + size > budget do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then redis.call('SET', KEYS[3], 0) break end
  drop(oldest[1])
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('INCRBY', KEYS[3], size)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return 1
