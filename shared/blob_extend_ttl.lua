-- vlmq: extend a blob's TTL, only upward (shared/blobs.py).
-- KEYS[1] = <prefix>:blob:<sha256>   ARGV[1] = the TTL wanted (ms)
-- Returns 0 when the key is missing, 1 when it exists (its TTL now >= ARGV[1] ms, or none
-- at all, which is left alone).
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then return 0 end
if ttl >= 0 and ttl < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
