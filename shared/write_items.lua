-- vlmq: a worker's item results for one job, written only while its execution owns the job
-- (worker/results/writer.py). All of them and their events land together, or none.
-- KEYS[1] = rq:job:<job_id>   KEYS[2] = <prefix>:job:<job_id>:owner
-- KEYS[3] = <prefix>:job:<job_id>:items   KEYS[4] = <prefix>:job:<job_id>:events
-- ARGV[1] = owner token   ARGV[2] = ttl (s)   ARGV[3] = events stream maxlen
-- ARGV[4], ARGV[5], ARGV[6], ... = (index, result JSON, ok 0|1) per item
-- Returns 0 (nothing written) unless the job is STARTED and owned by the token, else 1.
-- The set <prefix>:job:<job_id>:failed (beside KEYS[3]) holds the indexes of failed items,
-- so listings count done (HLEN) and failed (SCARD) without reading any result.
-- Key names: the generated block below is shared/keys.py's KEY_TABLE, so no key is spelled here.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.job_failed(prefix, job_id) return prefix .. ':job:' .. job_id .. ':failed' end
function KEY.job_items(prefix, job_id) return prefix .. ':job:' .. job_id .. ':items' end
function KEY.rq_job(job_id) return 'rq:job:' .. job_id end
-- END KEYS
if redis.call('HGET', KEYS[1], 'status') ~= 'started'
    or redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
-- The job id and prefix are those in KEYS[1] and KEYS[3], less the keys' own names.
local job_id = string.sub(KEYS[1], #KEY.rq_job('') + 1)
local prefix = string.sub(KEYS[3], 1, #KEYS[3] - #KEY.job_items('', job_id))
local failed = KEY.job_failed(prefix, job_id)
for i = 4, #ARGV, 3 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  if ARGV[i + 2] == '0' then
    redis.call('SADD', failed, ARGV[i])
  else
    redis.call('SREM', failed, ARGV[i])
  end
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*',
             'type', 'item', 'index', ARGV[i], 'ok', ARGV[i + 2])
end
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[2])
if redis.call('EXISTS', failed) == 1 then redis.call('EXPIRE', failed, ARGV[2]) end
return 1
