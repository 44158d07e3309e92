-- vlmq protocol v1: the one terminal event of a job's run, written once whoever ends it.
-- Call it in the same MULTI/EXEC as the status change (after it), so a reader who sees the
-- event also sees the job's final status and its result.
-- KEYS[1] = rq:job:<job_id>   KEYS[2] = <prefix>:job:<job_id>:events
-- KEYS[3] = <prefix>:job:<job_id>:items
-- ARGV[1] = job_id   ARGV[2] = finished | failed | canceled (must equal the job's status)
-- ARGV[3] = seconds the events stream and the item results live on (the job's result_ttl
--           or failure_ttl; -1 keeps them)
-- ARGV[4] = channel <prefix>:done   ARGV[5] = channel <prefix>:done:<queue>, or ''
-- ARGV[6], ARGV[7], ... = further event fields and values (e.g. 'error', '<message>')
-- Returns the event's stream id, or nil (nothing written) when the job's status is not
-- ARGV[2] or this run of the job has its terminal event already: the hash field vlmq_end
-- is set, or the stream's last entry is a terminal event (written by a canceler that did
-- not use this script; nothing is ever written after a terminal event).
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then
  return nil
end
if redis.call('HEXISTS', KEYS[1], 'vlmq_end') == 1 then
  return nil
end
local terminal = {finished = true, failed = true, canceled = true}
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if last then
  for i = 1, #last[2], 2 do
    if last[2][i] == 'type' and terminal[last[2][i + 1]] then
      return nil
    end
  end
end
local fields = {'type', ARGV[2]}
for i = 6, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', '10000', '*', unpack(fields))
redis.call('HSET', KEYS[1], 'vlmq_end', id)
local ttl = tonumber(ARGV[3])
for _, key in ipairs({KEYS[2], KEYS[3]}) do
  if ttl > 0 then
    redis.call('EXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end
local message = cjson.encode({id = ARGV[1], status = ARGV[2]})
redis.call('PUBLISH', ARGV[4], message)
if ARGV[5] ~= '' then
  redis.call('PUBLISH', ARGV[5], message)
end
return id
