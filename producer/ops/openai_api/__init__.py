"""`vlmq api`: OpenAI's Files and Batch API over HTTP, so the official SDKs submit bulk
work to vlmq (docs/openai-api.md). One module a job: errors (OpenAI's error shape),
access (API keys), files (uploads on disk, metadata in Redis), batches (an API batch as
one vlmq batch, its lifecycle), outputs (the output and error files, made when read),
app (the Flask routes)."""
