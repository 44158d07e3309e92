// The official Node.js `openai` SDK against `vlmq api`: the three-line change is
// baseURL and apiKey. Uploads a batch file, creates the batch, polls it to its end,
// downloads the output and error files; then a bad file (failed, line-numbered errors)
// and another key's view of the batch (404). Prints one JSON object.
const fs = require("fs");
const OpenAI = require("openai");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function settle(client, id) {
  for (;;) {
    const b = await client.batches.retrieve(id);
    if (!["validating", "in_progress", "finalizing", "cancelling"].includes(b.status)) return b;
    await sleep(200);
  }
}

async function run(client, path) {
  const file = await client.files.create({ file: fs.createReadStream(path), purpose: "batch" });
  const created = await client.batches.create({
    input_file_id: file.id, endpoint: "/v1/chat/completions", completion_window: "24h",
    metadata: { from: "node" },
  });
  return { file, created, batch: await settle(client, created.id) };
}

async function text(client, id) {
  if (!id) return "";
  return await (await client.files.content(id)).text();
}

async function main() {
  const [good, bad] = process.argv.slice(2);
  const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.KEY });
  const other = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OTHER_KEY });
  const ok = await run(client, good);
  const output = await text(client, ok.batch.output_file_id);
  const errors = await text(client, ok.batch.error_file_id);
  const failed = await run(client, bad);
  let otherStatus = null;
  try {
    await other.batches.retrieve(ok.batch.id);
  } catch (e) {
    otherStatus = e instanceof OpenAI.NotFoundError ? e.status : String(e);
  }
  const listed = [];
  for await (const b of client.batches.list({ limit: 1 })) listed.push(b.id);
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  console.log(JSON.stringify({ file: ok.file, batch: ok.batch, output, errors,
                               failed: failed.batch, otherStatus, listed, models }));
}

main().catch((e) => { console.error(e); process.exit(1); });
