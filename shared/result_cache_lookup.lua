-- vlmq: find result-cache entries (worker/results/cache.py) in the live generations.
-- KEYS[1..n] = the live generation hashes <prefix>:rcache:gen:<g>, newest first
-- ARGV[1..m] = digests
-- Returns 2*m values: per digest its pointer ("<job id> <index> <text hash>") and the
-- position in KEYS of the generation holding it, or false and 0 when there is none.
local out = {}
local found = {}
for k = 1, #KEYS do
  local values = redis.call('HMGET', KEYS[k], unpack(ARGV))
  for i = 1, #ARGV do
    if not found[i] and values[i] then
      found[i] = true
      out[2 * i - 1], out[2 * i] = values[i], k
    end
  end
end
for i = 1, #ARGV do
  if not found[i] then out[2 * i - 1], out[2 * i] = false, 0 end
end
return out
