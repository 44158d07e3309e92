-- vlmq: extend a blob's TTL, only upward (shared/blobs.py).
-- KEYS[1] = <prefix>:blob:<sha256>   KEYS[2] (optional) = <prefix>:blob-jobs:<sha256>
-- ARGV[1] = the TTL wanted (ms)
-- Returns 0 when the blob is missing, 1 when it exists (its TTL now >= ARGV[1] ms, or none
-- at all, which is left alone). The jobs holding it (KEYS[2]), when there are any, live at
-- least as long.
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
local want = tonumber(ARGV[1])
local ttl = redis.call('PTTL', KEYS[1])
if ttl == UNITS.pttl_missing then return 0 end
if ttl >= 0 and ttl < want then redis.call('PEXPIRE', KEYS[1], want) end
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 and redis.call('PTTL', KEYS[2]) < want then
  redis.call('PEXPIRE', KEYS[2], want)
end
return 1
