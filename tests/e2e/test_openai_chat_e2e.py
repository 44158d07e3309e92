"""`POST /v1/chat/completions` end to end: the official `openai` SDKs (Python and Node.js)
against a real `vlmq api` process and a real worker on the tiny model. A question about an
image, whole and streamed (the streamed deltas, joined, are the whole answer at
temperature 0; chunks parse with the SDK's types; usage when asked), two turns, a
json_schema answer that validates, OpenAI-shaped errors for a bad key, a bad image, an
unknown model and what vlmq cannot do; a client that leaves mid-stream cancels its
request; a worker killed mid-answer ends the stream with an error, never a silent cut."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from redis import Redis

from tests.e2e.test_openai_api_e2e import CLIENTS, node_modules
from tests.support import helpers
from tests.support import openai_api as T
from vlmq.shared import chat
from vlmq.shared.keys import Keys

MODEL = "tiny"  # the API's --model-map name for the worker's checkpoint (strict)
# An answer of seconds: the tiny model ends a free answer within a second (its end token
# comes soon at random), so a request meant to be interrupted mid-answer asks for a JSON
# string it cannot end early.
LONG = {"type": "object", "properties": {"t": {"type": "string", "minLength": 3000}},
        "required": ["t"], "additionalProperties": False}
LONG_FORMAT = {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG}}


def start(redis_url: str, model: Path, tmp: Path, *worker_args: str, metrics: int = 0
          ) -> tuple[list[subprocess.Popen[str]], str]:
    """A worker and a `vlmq api` (strict model names, `tiny` mapped to the worker's
    checkpoint; its metrics on port `metrics` when given); the API's base URL once it
    lists the worker's model."""
    port = T.free_port()
    more = ("--metrics-port", str(metrics)) if metrics else ()
    procs = [helpers.start_worker(redis_url, model, tmp, "--max-batch", "8", *worker_args),
             T.start_api(redis_url, tmp / "files", port, "--model-map", f"{MODEL}={model}",
                         "--strict-model", *more)]
    base = f"http://127.0.0.1:{port}/v1"
    try:
        helpers.wait_for(lambda: _listed(sdk(base)), 240, "the API to list the model")
    except BaseException:
        helpers.stop_all(procs)
        raise
    return procs, base


@pytest.fixture(scope="module")
def stack(module_redis_url: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the API's base URL, its metrics URL), with a worker, for the module."""
    metrics = T.free_port()
    procs, base = start(module_redis_url, tiny_model, tmp_path_factory.mktemp("chat"),
                        metrics=metrics)
    try:
        yield base, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        helpers.stop_all(procs)


@pytest.fixture(scope="module")
def served(stack: tuple[str, str]) -> str:
    return stack[0]


def _listed(api: openai.OpenAI) -> bool:
    try:
        return MODEL in [m.id for m in api.models.list()]
    except openai.APIConnectionError:
        return False


def sdk(base: str, key: str = T.KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def question(image: int | None = 0, text: str = "Describe the image.") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": T.data_uri(image)}})
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": content}]


def test_whole_and_streamed_answers_agree(served: str) -> None:
    api = sdk(served)
    whole = api.chat.completions.create(model=MODEL, messages=question(),
                                        max_tokens=12, temperature=0)
    ChatCompletion.model_validate(whole.model_dump(), strict=True)
    assert whole.object == "chat.completion" and whole.model == MODEL
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert whole.usage is not None and whole.usage.prompt_tokens > 0
    assert 0 < whole.usage.completion_tokens <= 12
    text = choice.message.content or ""
    assert text

    chunks: list[ChatCompletionChunk] = []
    arrived: list[float] = []
    for chunk in api.chat.completions.create(
            model=MODEL, messages=question(), max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True}):
        ChatCompletionChunk.model_validate(chunk.model_dump(), strict=True)
        chunks.append(chunk)
        arrived.append(time.monotonic())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == text  # temperature 0: the same answer, token for token
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Sent as decoded, not at the end: the content chunks did not all arrive at once.
    assert len([d for d in deltas if d]) > 1


def test_two_turns(served: str) -> None:
    api = sdk(served)
    answer = api.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Say a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "And another?"}]}])
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The image in the first user turn, a question about it in the second.
    about = api.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        *question(1), {"role": "assistant", "content": "A page."},
        {"role": "user", "content": "What colour is it?"}])
    assert about.choices[0].message.content
    assert about.usage is not None
    assert about.usage.prompt_tokens > answer.usage.prompt_tokens  # the image's tokens


def test_a_json_schema_answer_validates(served: str) -> None:
    answer = sdk(served).chat.completions.create(
        model=MODEL, messages=question(2, "Title this image."), max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "title", "schema": T.SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), T.SCHEMA)


def test_refusals_in_openai_shape(served: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(served, "wrong-key-but-long-enough").chat.completions.create(
            model=MODEL, messages=question(None))
    api = sdk(served)
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="gpt-unknown", messages=question(None))
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["code"] == "model_not_found"
    bad = [{"role": "user", "content": [
        {"type": "text", "text": "What?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}]}]
    with pytest.raises(openai.BadRequestError) as image:
        api.chat.completions.create(model=MODEL, messages=bad)
    assert isinstance(image.value.body, dict) and image.value.body["code"] == "invalid_image"
    with pytest.raises(openai.BadRequestError) as tools:
        api.chat.completions.create(model=MODEL, messages=question(None),
                                    tools=[{"type": "function",
                                            "function": {"name": "f", "parameters": {}}}])
    assert isinstance(tools.value.body, dict) and tools.value.body["param"] == "tools"


def test_a_client_that_leaves_cancels_its_request(served: str, module_redis_url: str) -> None:
    body = {"model": MODEL, "messages": question(3), "max_tokens": 4000, "temperature": 1.0,
            "stream": True, "response_format": LONG_FORMAT}
    headers = {"Authorization": f"Bearer {T.KEYS[0]}"}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", served + "/chat/completions", json=body,
                        headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        job_id = first["id"].removeprefix("chatcmpl-")
        next(line for line in lines if line.startswith("data: "))  # a first token
    left = time.monotonic()
    redis = Redis.from_url(module_redis_url)
    try:
        helpers.wait_for(lambda: redis.hget(Keys.rq_job(job_id), "status") == b"canceled",
                         10, "the request to be cancelled")
        cancelled_in = time.monotonic() - left
        helpers.wait_for(lambda: _last(redis, job_id) is not None, 10, "the stream's end")
        end = _last(redis, job_id)
    finally:
        redis.close()
    assert cancelled_in < 5, cancelled_in
    # The worker dropped the row: nobody decoded the rest.
    assert end is not None and end.finish_reason == "cancelled"
    assert end.completion_tokens < 4000


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(served: str,
                                                              module_redis_url: str) -> None:
    """Not streamed: the server learns of the closed connection while nothing is written."""
    redis = Redis.from_url(module_redis_url)
    try:
        before = set(redis.zrange(Keys.from_env().jobs_queue_index(chat.CHAT_QUEUE), 0, -1))
        with pytest.raises(openai.APITimeoutError):
            openai.OpenAI(base_url=served, api_key=T.KEYS[0], max_retries=0,
                          timeout=1.5).chat.completions.create(
                model=MODEL, messages=question(5), max_tokens=4000, temperature=1.0,
                response_format=LONG_FORMAT)
        left = time.monotonic()
        [job] = [j.decode() for j in redis.zrange(Keys.from_env().jobs_queue_index(chat.CHAT_QUEUE),
                                                  0, -1) if j not in before]
        helpers.wait_for(lambda: redis.hget(Keys.rq_job(job), "status") == b"canceled",
                         10, "the request to be cancelled")
        assert time.monotonic() - left < 5
    finally:
        redis.close()


def _last(redis: Redis, job_id: str) -> chat.End | None:
    """The token stream's End entry, once written."""
    entries: Any = redis.xrevrange(Keys.from_env().job_tokens(job_id), count=1)
    last = chat.decode(entries[0][1]) if entries else None
    return last if isinstance(last, chat.End) else None


def test_a_worker_killed_mid_answer_ends_the_stream_with_an_error(
        redis_url: str, tiny_model: Path, tmp_path: Path) -> None:
    procs, base = start(redis_url, tiny_model, tmp_path, "--heartbeat-ttl", "3")
    try:
        stream = sdk(base).chat.completions.create(
            model=MODEL, messages=question(4), max_tokens=4000, temperature=1.0,
            stream=True, response_format=LONG_FORMAT)
        seen = 0
        with pytest.raises(openai.APIError) as caught:
            for _chunk in stream:
                seen += 1
                if seen == 2:  # the role, then a first token: the worker is answering
                    os.killpg(procs[0].pid, signal.SIGKILL)
                    killed = time.monotonic()
        assert seen >= 2
        assert time.monotonic() - killed < 30
        assert "worker" in str(caught.value).lower()
    finally:
        helpers.stop_all(procs)


def test_node_sdk(served: str) -> None:
    modules = node_modules()
    done = subprocess.run(["node", str(CLIENTS / "chat.cjs")],
                          env={**os.environ, "NODE_PATH": str(modules),
                               "OPENAI_BASE_URL": served, "KEY": T.KEYS[0], "MODEL": MODEL,
                               "IMAGE": T.data_uri(6), "SCHEMA": json.dumps(T.SCHEMA)},
                          capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, f"node exited {done.returncode}:\n{done.stderr}"
    out = json.loads(done.stdout)
    whole = ChatCompletion.model_validate(out["whole"])
    assert whole.choices[0].message.content
    chunks = [ChatCompletionChunk.model_validate(c) for c in out["chunks"]]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert ChatCompletion.model_validate(out["turns"]).choices[0].message.content
    jsonschema.validate(json.loads(out["json"]["choices"][0]["message"]["content"]),
                        T.SCHEMA)
    assert out["errors"] == {"badKey": 401, "badImage": 400, "unknownModel": 404}


def test_the_api_counts_its_chat_requests(stack: tuple[str, str]) -> None:
    """After the tests above (this module's order): answered, refused, left, failed."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack[1], timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def requests(stream: str, outcome: str) -> float:
        return samples[("vlmq_api_chat_requests_total",
                        (("outcome", outcome), ("stream", stream)))]

    assert requests("false", "stop") + requests("false", "length") >= 3
    assert requests("true", "stop") + requests("true", "length") >= 1
    assert requests("false", "refused") >= 3  # an unknown model, a bad image, tools
    assert requests("true", "disconnected") >= 1
    assert samples[("vlmq_api_chat_ttft_seconds_count", (("stream", "true"),))] >= 2
    assert samples[("vlmq_api_chat_tokens_per_second_count", (("stream", "false"),))] >= 1
    assert requests("true", "unavailable") == 0
