-- vlmq protocol v1: enqueue one job atomically, from any language.
-- KEYS[1] = rq:job:<job_id>      KEYS[2] = rq:queue:<queue>      KEYS[3] = rq:queues
-- KEYS[4] = <prefix>:job:<job_id>:items   KEYS[5] = <prefix>:job:<job_id>:events
-- ARGV[1] = job_id   ARGV[2] = queue name   ARGV[3] = data: JSON ["vlmq.worker.task.run", null, [payload], {}]
-- ARGV[4] = description   ARGV[5] = timeout (s)   ARGV[6] = result_ttl (s)   ARGV[7] = failure_ttl (s)
-- ARGV[8] = now, RQ's format %Y-%m-%dT%H:%M:%S.%fZ (UTC)
-- ARGV[9] = retries_left: how often RQ requeues the job if its worker dies (vlmq uses 3)
-- Returns 1 when enqueued, 0 when the id is taken: a job with that id exists, or results
-- of an earlier job with that id remain (nothing written either way). A malformed argument
-- is an error reply naming it; the payload itself is validated by the worker.
if not string.match(ARGV[1], '^[%w_-]+$') or #ARGV[1] > 128 then
  return redis.error_reply('job_id: must match [A-Za-z0-9_-]{1,128}')
end
if not string.match(ARGV[2], '^[%w_.-]+$') or #ARGV[2] > 64 then
  return redis.error_reply('queue: must match [A-Za-z0-9_.-]{1,64}')
end
if KEYS[1] ~= 'rq:job:' .. ARGV[1] or KEYS[2] ~= 'rq:queue:' .. ARGV[2] then
  return redis.error_reply('KEYS[1] and KEYS[2] must be rq:job:<job_id> and rq:queue:<queue>')
end
if not string.match(ARGV[5], '^%d+$') then
  return redis.error_reply('timeout: must be a whole number of seconds')
end
for i, name in pairs({[6] = 'result_ttl', [7] = 'failure_ttl'}) do
  if not string.match(ARGV[i], '^%-?%d+$') then
    return redis.error_reply(name .. ': must be a whole number of seconds (-1: keep forever)')
  end
end
if not string.match(ARGV[8], '^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d+Z$') then
  return redis.error_reply('now: must be UTC as %Y-%m-%dT%H:%M:%S.%fZ')
end
if not string.match(ARGV[9], '^%d+$') then
  return redis.error_reply('retries_left: must be a whole number')
end
if redis.call('EXISTS', KEYS[1], KEYS[4], KEYS[5]) > 0 then
  return 0
end
redis.call('HSET', KEYS[1],
  'data', ARGV[3],
  'origin', ARGV[2],
  'description', ARGV[4],
  'timeout', ARGV[5],
  'result_ttl', ARGV[6],
  'failure_ttl', ARGV[7],
  'created_at', ARGV[8],
  'enqueued_at', ARGV[8],
  'status', 'queued',
  'meta', '{}',
  'retries_left', ARGV[9],
  'success_callback_name', '',
  'failure_callback_name', '',
  'stopped_callback_name', '',
  'started_at', '',
  'ended_at', '',
  'last_heartbeat', '',
  'worker_name', '',
  'group_id', '')
redis.call('SADD', KEYS[3], KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
