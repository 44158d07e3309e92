"""`vlmq api`: OpenAI's Files, Batch and Chat Completions API over HTTP, so the official
SDKs submit bulk work to vlmq and ask its workers interactive questions
(docs/openai-api.md). One module a job: errors (OpenAI's error shape),
access (API keys, and the Gate asked before a body is read), limits (what a key may
hold), files (uploads on disk, metadata in Redis), images (a batch's decoded images, as
long as it lives), batches (an API batch as one vlmq batch, its lifecycle), outputs (the
output and error files, made when read, whole or refused), chat (a chat completion as
a job on the `chat` queue, answered from its token stream), image_urls (remote images,
off unless turned on), metrics (the API's Prometheus figures), app (the Flask routes),
server (waitress with the key checked before the body)."""
