-- vlmq protocol v1: the members of rq:queues that have any key behind them, so that a
-- reader counts those and not the names anyone may SADD (PROTOCOL.md section 1).
-- KEYS[1] = rq:queues   ARGV[1] = prefix
-- Returns the live members (rq:queue:<queue>), in SMEMBERS order.
-- BEGIN KEYS: generated from vlmq/shared/keys.py by `python -m vlmq.shared.lua --write`; do not edit by hand.
local KEY = {}
function KEY.counts_queue(prefix, queue) return prefix .. ':counts:queue:' .. queue end
function KEY.rq_canceled(queue) return 'rq:canceled:' .. queue end
function KEY.rq_deferred(queue) return 'rq:deferred:' .. queue end
function KEY.rq_failed(queue) return 'rq:failed:' .. queue end
function KEY.rq_finished(queue) return 'rq:finished:' .. queue end
function KEY.rq_queue(queue) return 'rq:queue:' .. queue end
function KEY.rq_queue_workers(queue) return 'rq:workers:' .. queue end
function KEY.rq_scheduled(queue) return 'rq:scheduled:' .. queue end
function KEY.rq_started(queue) return 'rq:wip:' .. queue end
-- END KEYS
local prefix = ARGV[1]
local members = redis.call('SMEMBERS', KEYS[1])
local live = {}

-- As Keys.rq_name: the text after the second colon (after the last, with fewer).
local function name_of(member)
  return member:match('^[^:]*:[^:]*:(.*)$') or member:match('^[^:]*:(.*)$') or member
end

for _, member in ipairs(members) do
  local q = name_of(member)
  if redis.call('EXISTS', KEY.rq_queue(q), KEY.rq_started(q), KEY.rq_finished(q),
                KEY.rq_failed(q), KEY.rq_deferred(q), KEY.rq_scheduled(q),
                KEY.rq_canceled(q), KEY.rq_queue_workers(q),
                KEY.counts_queue(prefix, q)) > 0 then
    live[#live + 1] = member
  end
end
return live
