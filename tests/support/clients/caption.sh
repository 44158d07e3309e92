#!/usr/bin/env bash
# A vlmq producer with nothing but bash and redis-cli, following shared/PROTOCOL.md:
# upload an image binary-safely, enqueue a caption job with EVALSHA of enqueue.lua, follow
# its events from 0-0 to the terminal event, read its status, kept end and items; follow it
# again once its events stream has expired (the end is read from the job hash). Then the
# same for a job the worker refuses (it names another model), and one bad EVALSHA whose
# error comes back at once.
#
# Usage: REDIS_URL=redis://host:port/db ENQUEUE_LUA=shared/enqueue.lua caption.sh IMAGE
# Prints one line per fact ("terminal finished", "status finished", "item 0 {...}", ...).
set -euo pipefail
: "${REDIS_URL:?set REDIS_URL}" "${ENQUEUE_LUA:?set ENQUEUE_LUA}"
PREFIX=${VLMQ_PREFIX:-vlmq}
image=$1

cli() { redis-cli -u "$REDIS_URL" "$@"; }

sha=$(sha256sum "$image" | cut -d' ' -f1)
blob="$PREFIX:blob:$sha"
# EXPIRE answers 1 when the blob is there already (and refreshes it); otherwise upload:
# -x sends stdin, byte for byte, as the command's LAST argument, hence SETEX (its value
# comes last; the same content under the same name makes a race harmless).
if [ "$(cli EXPIRE "$blob" 604800)" != 1 ]; then
  [ "$(cli -x SETEX "$blob" 604800 < "$image")" = OK ]
fi
echo "blob $(cli STRLEN "$blob") bytes"

script=$(cli SCRIPT LOAD "$(cat "$ENQUEUE_LUA")")

enqueue() {  # job_id queue data [timeout]: prints the script's reply (1, 0 or the error)
  local id=$1 queue=$2 data=$3 timeout=${4:-86400}
  cli EVALSHA "$script" 5 "rq:job:$id" "rq:queue:$queue" rq:queues \
    "$PREFIX:job:$id:items" "$PREFIX:job:$id:events" \
    "$id" "$queue" "$data" "caption from bash" "$timeout" 604800 2592000 \
    "$(date -u +%Y-%m-%dT%H:%M:%S.%6NZ)" 3 2>&1
}

kept_end() {  # job_id: the terminal event kept once the job ended (JSON), or nothing:
  local end   # a finished job's in its end hash, the others' in the job hash (section 5)
  end=$(cli --raw HGET "$PREFIX:job:$1:end" event)
  case $end in '{'*) ;; *) end=$(cli --raw HGET "rq:job:$1" vlmq_end) ;; esac
  case $end in '{'*) echo "$end" ;; esac
}

follow() {  # job_id: reads events from 0-0, one at a time, until the terminal one
  local id=$1 last=0-0 deadline=$((SECONDS + 180)) i end ended='' block=()
  while [ "$SECONDS" -lt "$deadline" ]; do
    local -a lines
    mapfile -t lines < <(cli --raw XREAD COUNT 1 "${block[@]}" STREAMS "$PREFIX:job:$id:events" "$last")
    block=(BLOCK 2000)  # the first read does not wait: the job may have ended long ago
    if [ "${#lines[@]}" -lt 4 ]; then  # nothing new: ended, its stream expired?
      end=$(kept_end "$id")
      [ -n "$end" ] || continue
      # Ended: the stream may still hold the end (it lives a minute more); read it once
      # more without waiting, and take the hash's copy only when it is gone.
      if [ -n "$ended" ]; then echo "kept $end"; return 0; fi
      ended=1 block=()
      continue
    fi
    last=${lines[1]}  # lines: stream name, entry id, field, value, field, value, ...
    local -A ev=()
    for ((i = 2; i + 1 < ${#lines[@]}; i += 2)); do ev[${lines[i]}]=${lines[i + 1]}; done
    echo "event ${ev[type]}${ev[index]:+ ${ev[index]}}"
    case ${ev[type]} in
      finished) echo "terminal finished ${ev[summary]}"; return 0 ;;
      failed) echo "terminal failed ${ev[error]}"; return 0 ;;
      canceled) echo "terminal canceled"; return 0 ;;
    esac
  done
  echo "no terminal event within 180 s"
  return 1
}

ended() {  # job_id: what a reader sees right after the terminal event
  local id=$1
  echo "status $(cli HGET "rq:job:$id" status)"
  # The end the job hash keeps: its type (a finished job's summary is in it too).
  echo "end-type $(kept_end "$id" | grep -o '"type":"[a-z]*"' | cut -d'"' -f4)"
  # RQ's results stream: an entry for a failed job only (its type), none once finished.
  echo "result-type $(cli --raw XREVRANGE "rq:results:$id" + - COUNT 1 | tail -n +2 |
    paste - - | awk -F'\t' '$1 == "type" {print $2}')"
}

name=$(basename "$image")
payload() {  # model (or null)
  printf '["vlmq.worker.task.run",null,[{"v":1,"task":"caption","items":[{"kind":"image","blob":"%s","source":"%s"}],"generation":{"max_tokens":4},"max_side":112,"model":%s}],{}]' \
    "$sha" "$name" "$1"
}

job="bash-$(date +%s%N)"
echo "enqueue $(enqueue "$job" caption "$(payload null)")"
echo "bad $(enqueue "$job-bad" caption "$(payload null)" soon)"
follow "$job"
ended "$job"
cli --raw HGETALL "$PREFIX:job:$job:items" | paste - - | while IFS=$'\t' read -r idx json; do
  echo "item $idx $json"
done
cli DEL "$PREFIX:job:$job:events" > /dev/null  # as its expiry a minute after the end would
echo "late $(follow "$job")"

refused="$job-refused"
echo "enqueue $(enqueue "$refused" caption "$(payload '"someone/another-model"')")"
follow "$refused"
ended "$refused"
