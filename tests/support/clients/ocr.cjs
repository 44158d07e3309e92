// A vlmq producer in Node.js with the npm `redis` package, following shared/PROTOCOL.md:
// upload a PDF, enqueue an OCR job for a page range with EVALSHA of enqueue.lua, follow
// its events from 0-0 to the terminal event, then read the status, the summary (kept in
// the job hash) and the items, and follow it again once its events stream has expired.
// Also: one bad EVALSHA (its error comes back at once), and a job hash the worker refuses,
// which still ends with a terminal event.
//
// Usage: REDIS_URL=... ENQUEUE_LUA=shared/enqueue.lua node ocr.cjs DOC.pdf FIRST LAST
// Prints one JSON object with what it saw.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const { createClient } = require('redis');

const prefix = process.env.VLMQ_PREFIX || 'vlmq';
const TERMINAL = ['finished', 'failed', 'canceled'];

// RQ's timestamp format, %Y-%m-%dT%H:%M:%S.%fZ (microseconds).
const rqNow = () => new Date().toISOString().replace('Z', '000Z');

async function main() {
  const [pdf, first, last] = process.argv.slice(2);
  const client = createClient({ url: process.env.REDIS_URL });
  await client.connect();
  const cmd = (...args) => client.sendCommand(args.map((a) => (Buffer.isBuffer(a) ? a : String(a))));

  const bytes = fs.readFileSync(pdf);
  const sha = crypto.createHash('sha256').update(bytes).digest('hex');
  const blob = `${prefix}:blob:${sha}`;
  if ((await cmd('EXPIRE', blob, 604800)) !== 1) {
    await cmd('SET', blob, bytes, 'NX', 'EX', 604800);
  }
  const script = await cmd('SCRIPT', 'LOAD', fs.readFileSync(process.env.ENQUEUE_LUA, 'utf8'));
  const enqueue = (id, queue, payload, timeout = 86400) => cmd(
    'EVALSHA', script, 5, `rq:job:${id}`, `rq:queue:${queue}`, 'rq:queues',
    `${prefix}:job:${id}:items`, `${prefix}:job:${id}:events`,
    id, queue, JSON.stringify(['vlmq.worker.task.run', null, [payload], {}]),
    'ocr from node', timeout, 604800, 2592000, rqNow(), 3);

  // The terminal event kept once the job ended (PROTOCOL.md section 5): a finished job's
  // in its end hash, the others' in the job hash.
  async function keptEnd(id) {
    const moved = await cmd('HGET', `${prefix}:job:${id}:end`, 'event');
    const raw = moved || await cmd('HGET', `rq:job:${id}`, 'vlmq_end');
    return raw && raw.startsWith('{') ? JSON.parse(raw) : null;
  }

  async function follow(id) {
    let from = '0-0';
    const seen = [];
    const deadline = Date.now() + 180000;
    let block = [];  // the first read does not wait: the job may have ended long ago
    let ended = false;
    while (Date.now() < deadline) {
      const reply = await cmd('XREAD', 'COUNT', 100, ...block, 'STREAMS',
        `${prefix}:job:${id}:events`, from);
      block = ['BLOCK', 2000];
      const kept = reply ? null : await keptEnd(id);  // nothing new: ended, stream expired?
      if (kept && ended) {
        return { events: seen, kept, status: await cmd('HGET', `rq:job:${id}`, 'status') };
      }
      if (kept) {  // the stream may still hold the end: read it once more, not waiting
        ended = true;
        block = [];
      }
      for (const [, entries] of reply || []) {
        for (const [entryId, flat] of entries) {
          from = entryId;
          const ev = {};
          for (let i = 0; i < flat.length; i += 2) ev[flat[i]] = flat[i + 1];
          seen.push(ev);
          if (TERMINAL.includes(ev.type)) {
            // Read at once: the terminal event is written with the final status.
            return { events: seen, status: await cmd('HGET', `rq:job:${id}`, 'status') };
          }
        }
      }
    }
    throw new Error(`no terminal event for ${id} within 180 s`);
  }

  const id = `node-${Date.now()}`;
  const items = [];
  for (let page = Number(first); page <= Number(last); page++) {
    items.push({ kind: 'pdf', blob: sha, page, source: path.basename(pdf) });
  }
  const payload = { v: 1, task: 'ocr', items, generation: { max_tokens: 4 }, max_side: 112 };
  const out = { id, enqueued: await enqueue(id, 'ocr', payload) };
  try {
    await enqueue(`${id}-bad`, 'ocr', payload, 'soon');
    out.bad = 'accepted';
  } catch (err) {
    out.bad = err.message;
  }
  Object.assign(out, await follow(id));
  out.summary = JSON.parse(out.events[out.events.length - 1].summary);
  // The same summary, kept in the job hash with the end.
  out.returned = (await keptEnd(id)).summary;
  const raw = await cmd('HGETALL', `${prefix}:job:${id}:items`);
  out.items = [];
  for (let i = 0; i < raw.length; i += 2) out.items.push(JSON.parse(raw[i + 1]));
  // A follower that comes after the events stream expired (deleted here, as its expiry a
  // minute after the end would) reads the end from the job hash.
  await cmd('DEL', `${prefix}:job:${id}:events`);
  out.late = await follow(id);

  // A job hash written by hand whose payload the worker refuses (schema version 2).
  const refused = `${id}-refused`;
  await cmd('HSET', `rq:job:${refused}`,
    'data', JSON.stringify(['vlmq.worker.task.run', null, [{ ...payload, v: 2 }], {}]),
    'origin', 'ocr', 'status', 'queued', 'created_at', rqNow(), 'enqueued_at', rqNow(),
    'description', 'refused from node', 'timeout', 600, 'meta', '{}');
  await cmd('SADD', 'rq:queues', 'rq:queue:ocr');
  await cmd('RPUSH', 'rq:queue:ocr', refused);
  out.refused = await follow(refused);

  console.log(JSON.stringify(out));
  await client.quit();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
