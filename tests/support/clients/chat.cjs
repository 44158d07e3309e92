// The official Node.js `openai` SDK asking `vlmq api` chat completions: a question about
// an image (IMAGE, a data: URI) whole and streamed with usage, two turns, a json_schema
// answer (SCHEMA), and the status of each refusal (a bad key, a bad image, an unknown
// model). Prints one JSON object.
const OpenAI = require("openai");

const question = (text, image) => [
  { role: "system", content: "You answer briefly." },
  { role: "user", content: [{ type: "text", text },
                            ...(image ? [{ type: "image_url", image_url: { url: image } }] : [])] },
];

async function status(call) {
  try {
    await call();
    return 200;
  } catch (e) {
    return e instanceof OpenAI.APIError ? e.status : String(e);
  }
}

async function main() {
  const { OPENAI_BASE_URL: baseURL, KEY: apiKey, MODEL: model, IMAGE: image } = process.env;
  const schema = JSON.parse(process.env.SCHEMA);
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  const whole = await client.chat.completions.create({
    model, messages: question("Describe the image.", image), max_tokens: 12, temperature: 0,
  });
  const chunks = [];
  const stream = await client.chat.completions.create({
    model, messages: question("Describe the image.", image), max_tokens: 12, temperature: 0,
    stream: true, stream_options: { include_usage: true },
  });
  for await (const chunk of stream) chunks.push(chunk);
  const turns = await client.chat.completions.create({
    model, max_tokens: 8, temperature: 0, messages: [
      { role: "user", content: "Say a colour." }, { role: "assistant", content: "Blue." },
      { role: "user", content: "And another?" }],
  });
  const json = await client.chat.completions.create({
    model, messages: question("Title this image.", image), max_tokens: 40, temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "title", schema, strict: true } },
  });
  const other = new OpenAI({ baseURL, apiKey: "wrong-key-but-long-enough", maxRetries: 0 });
  const errors = {
    badKey: await status(() => other.chat.completions.create({
      model, messages: question("Hi?") })),
    badImage: await status(() => client.chat.completions.create({
      model, messages: question("What?", "data:image/png;base64,aGVsbG8gd29ybGQ=") })),
    unknownModel: await status(() => client.chat.completions.create({
      model: "gpt-unknown", messages: question("Hi?") })),
  };
  console.log(JSON.stringify({ whole, chunks, turns, json, errors }));
}

main().catch((e) => { console.error(e); process.exit(1); });
