-- vlmq: claim one due time of a schedule (producer/ops/schedules.py), so that of several
-- schedulers exactly one fires it.
-- KEYS[1] = <prefix>:schedule:<name>
-- ARGV[1] = the next_due the caller read   ARGV[2] = the next_due after this run
-- Returns 1 when claimed; 0 when another claimed it first or the schedule is paused.
if redis.call('HGET', KEYS[1], 'next_due') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'paused') == '1' then return 0 end
redis.call('HSET', KEYS[1], 'next_due', ARGV[2])
return 1
