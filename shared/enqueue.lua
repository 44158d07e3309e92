-- vlmq protocol v1: enqueue one job atomically, from any language.
-- KEYS[1] = rq:job:<job_id>      KEYS[2] = rq:queue:<queue>      KEYS[3] = rq:queues
-- ARGV[1] = job_id   ARGV[2] = queue name   ARGV[3] = data: JSON ["vlmq.worker.task.run", null, [payload], {}]
-- ARGV[4] = description   ARGV[5] = timeout (s)   ARGV[6] = result_ttl (s)   ARGV[7] = failure_ttl (s)
-- ARGV[8] = now, RQ's format %Y-%m-%dT%H:%M:%S.%fZ (UTC)
-- ARGV[9] = retries_left: how often RQ requeues the job if its worker dies (vlmq uses 3)
-- Returns 1 when enqueued, 0 when a job with that id already exists (nothing written).
if redis.call('EXISTS', KEYS[1]) == 1 then
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
