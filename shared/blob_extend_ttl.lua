-- vlmq: extend a blob's TTL, only upward (shared/blobs.py).
-- KEYS[1] = <prefix>:blob:<sha256>   KEYS[2] (optional) = <prefix>:blob-jobs:<sha256>
-- ARGV[1] = the TTL wanted (ms)
-- Returns 0 when the blob is missing, 1 when it exists (its TTL now >= ARGV[1] ms, or none
-- at all, which is left alone). The jobs holding it (KEYS[2]), when there are any, live at
-- least as long.
local want = tonumber(ARGV[1])
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then return 0 end
if ttl >= 0 and ttl < want then redis.call('PEXPIRE', KEYS[1], want) end
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 and redis.call('PTTL', KEYS[2]) < want then
  redis.call('PEXPIRE', KEYS[2], want)
end
return 1
