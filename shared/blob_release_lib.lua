-- vlmq protocol v1: a job lets go of its input blobs (PROTOCOL.md section 2). Copied into
-- every script that releases holds (end_job.lua, blob_release.lua) by
-- `python -m vlmq.shared.lua --write`, so a job that ends and a job that is deleted let go
-- by the same rule. Holds past their end are pruned first, so a long-expired failed
-- holder never keeps a blob. A failed job keeps holding its blobs until its failure
-- record expires (retry --failed-only reads them); a blob no live job holds lives on for
-- the longest of this job's keep_inputs and any failed holder's record. A blob that a
-- live job still holds is never shortened. Returns how many blobs the job held.
local BLOBS = {}
function BLOBS.release(prefix, job_id, failed, ttl)
  local inputs = KEY.job_inputs(prefix, job_id)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * UNITS.ms_per_s + math.floor(tonumber(t[2]) / UNITS.us_per_ms)
  local until_ms = (ttl > 0) and string.format('%d', now + ttl * UNITS.ms_per_s) or 'inf'
  local held = redis.call('HGETALL', inputs)
  for i = 1, #held, UNITS.pair do
    local sha, keep_s = held[i], held[i + 1]
    local jobs = KEY.blob_jobs(prefix, sha)
    if failed then
      redis.call('ZADD', jobs, until_ms, job_id)
    else
      redis.call('ZREM', jobs, job_id)
    end
    redis.call('ZREMRANGEBYSCORE', jobs, '-inf', '(' .. now)
    local last = redis.call('ZRANGE', jobs, -1, -1, 'WITHSCORES')[UNITS.pair]
    if last ~= 'inf' then
      local ms = math.max(tonumber(keep_s) * UNITS.ms_per_s, last and tonumber(last) - now or 0)
      redis.call('PEXPIRE', KEY.blob(prefix, sha), ms)
      redis.call('PEXPIRE', jobs, ms)
    end
  end
  if failed and ttl > 0 then
    redis.call('EXPIRE', inputs, ttl)
  elseif not failed then
    redis.call('DEL', inputs)
  end
  return #held / UNITS.pair
end
