"""OpenAI Batch files in and out: input lines checked and grouped as manifest lines, each
refusal naming its line and field; then a real worker answers them and `vlmq result
--format openai-batch` writes lines whose bodies the official `openai` package accepts
as ChatCompletion objects (nothing is sent anywhere)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai.types import BatchError
from openai.types.chat import ChatCompletion

from tests.support import helpers
from tests.support.schemas import RECEIPT
from vlmq.producer.client import Client
from vlmq.producer.manifest import ManifestError
from vlmq.producer.openai_files import (
    FileRecord,
    ModelPolicy,
    ranges,
    read_batch_file,
    read_openai_batch,
    submit_openai_batch,
    unranges,
)
from vlmq.producer.ops.output_formats import JobResults, openai_output
from vlmq.producer.options import JobOptions
from vlmq.shared import extract_schema
from vlmq.shared.errors import PayloadError

URL = "/v1/chat/completions"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title"],
          "properties": {"title": {"type": "string", "maxLength": 12}}}
IMG_FIELD = "body.messages[0].content[1].image_url.url"


def png_uri(i: int = 0) -> str:
    out = io.BytesIO()
    helpers.page_image(i, (96, 96)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def line(custom_id: str, url: str, text: str = "Describe the image.", **body: Any
         ) -> dict[str, Any]:
    """A chat request with one user message: its text, then its image."""
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}}]}], **body}}


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines), encoding="utf-8")
    return path


def read(tmp: Path, lines: list[Any], **kw: Any) -> Any:
    spool = tmp / "spool"
    spool.mkdir(exist_ok=True)
    return read_openai_batch(write(tmp / "requests.jsonl", lines), JobOptions(),
                             spool=spool, **kw)


# --- input ------------------------------------------------------------------------------------


def test_good_lines_of_each_kind_become_grouped_items(tmp_path: Path) -> None:
    images = helpers.make_images(tmp_path / "imgs", 2)
    pdf = helpers.pdf_bytes(1)
    pdf_uri = "data:application/pdf;base64," + base64.b64encode(pdf).decode()
    lines = [
        line("inline", png_uri(1), max_tokens=8),
        line("relative", "file://imgs/img0.png", max_tokens=8),
        line("absolute", f"file://{images[1]}", max_completion_tokens=8),
        {"custom_id": "system+pdf", "method": "POST", "url": URL, "body": {
            "model": "some/model", "temperature": 0.5, "stop": "END", "n": 1,
            "user": "u-1", "messages": [
                {"role": "system", "content": "You read scans."},
                {"role": "user", "content": [
                    {"type": "file", "file": {"file_data": pdf_uri, "filename": "a.pdf"}},
                    {"type": "text", "text": "Summarise it."}]}]}},
        line("extract", png_uri(2), text="", max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                   "strict": True}}),
        line("any-object", png_uri(3), text="Answer in JSON.",
             response_format={"type": "json_object"}),
    ]
    groups, rejected = read(tmp_path, lines)
    assert rejected == []
    by_id = {i.custom_id: (g, i) for g in groups for i in g.prepared.items}
    assert set(by_id) == {"inline", "relative", "absolute", "system+pdf", "extract",
                          "any-object"}
    g, _ = by_id["inline"]
    # Same task and settings: one job; max_tokens or max_completion_tokens alike.
    assert [i.custom_id for i in g.prepared.items] == ["inline", "relative", "absolute"]
    assert (g.task, g.options.prompt, g.options.max_tokens) == ("generate",
                                                                "Describe the image.", 8)
    assert by_id["inline"][1].source == "data-line1.png"
    assert by_id["relative"][1].source == str(tmp_path / "imgs" / "img0.png")
    g, item = by_id["system+pdf"]
    assert (g.task, item.kind, item.page) == ("generate", "pdf", 1)
    assert g.options.prompt == "You read scans.\n\nSummarise it."
    # The file's model is recorded, not enforced: any worker of the queue answers it.
    assert (g.options.model, g.options.temperature, g.options.stop) == (
        None, 0.5, ("END",))
    g, _ = by_id["extract"]
    assert (g.task, g.options.prompt, g.options.max_tokens) == ("extract", None, 64)
    assert g.options.schema == extract_schema.check_schema(SCHEMA)
    g, _ = by_id["any-object"]
    assert (g.task, g.options.schema) == ("extract", {"type": "object"})


# OpenAI's Batch guide's own example line: text only, no image.
DOCS_TEXT_LINE = (
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": '
    '{"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a '
    'helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}')


def test_text_only_lines_are_text_items(tmp_path: Path) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    lines = [DOCS_TEXT_LINE, {"custom_id": "parts", "method": "POST", "url": URL, "body": {
        "model": "gpt-4o-mini", "response_format": schema, "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Name a title."}]}]}},
        line("image", png_uri(1))]
    groups, rejected = read(tmp_path, lines)
    assert rejected == []
    by_id = {i.custom_id: (g, i) for g in groups for i in g.prepared.items}
    g, item = by_id["request-1"]
    # No input of its own: nothing uploaded, the prompt is all the model is given.
    assert (item.kind, item.blob, item.ref, item.page, item.source) == (
        "text", None, None, None, "text-line1")
    assert item.to_dict() == {"kind": "text", "source": "text-line1",
                              "custom_id": "request-1"}
    assert (g.task, g.options.prompt, g.options.max_tokens, g.prepared.blobs) == (
        "generate", "You are a helpful assistant.\n\nHello world!", 1000, {})
    g, item = by_id["parts"]
    assert (g.task, item.kind, g.options.prompt) == ("extract", "text",
                                                     "Be brief.\n\nName a title.")
    assert by_id["image"][1].kind == "image"


def test_model_names_are_recorded_mapped_or_required(tmp_path: Path) -> None:
    lines = [line("a", png_uri(1), model="gpt-4o-mini"), line("b", png_uri(2), model="gpt-4o"),
             line("c", png_uri(3), model="gpt-4o-mini"), line("d", png_uri(4))]
    spool = tmp_path / "spool"
    spool.mkdir()
    path = write(tmp_path / "models.jsonl", lines)
    read = read_batch_file(path, JobOptions(), spool=spool)
    # Unenforced, but lines naming different models never share a job.
    assert [([i.custom_id for i in g.prepared.items], g.options.model)
            for g in read.groups] == [(["a", "c"], None), (["b"], None), (["d"], None)]
    assert read.models == {1: "gpt-4o-mini", 2: "gpt-4o", 3: "gpt-4o-mini"}
    assert read.lines == {"a": 1, "b": 2, "c": 3, "d": 4}
    policy = ModelPolicy.parse(["gpt-4o-mini=/models/tiny"], strict=False)
    read = read_batch_file(path, JobOptions(), spool=spool, models=policy)
    assert [g.options.model for g in read.groups] == ["/models/tiny", None, None]
    policy = ModelPolicy.parse(["gpt-4o-mini=/models/tiny"], strict=True)
    read = read_batch_file(path, JobOptions(), spool=spool, models=policy)
    assert [g.options.model for g in read.groups] == ["/models/tiny", "gpt-4o", None]
    with pytest.raises(PayloadError, match="is not NAME=CHECKPOINT"):
        ModelPolicy.parse(["gpt-4o-mini"])


def test_skipped_lines_keep_their_custom_id_and_field(tmp_path: Path) -> None:
    lines = [line("ok-1", png_uri(1)), line("web", "http://example.com/x.png"), "{nope",
             line("ok-1", png_uri(2))]
    spool = tmp_path / "spool"
    spool.mkdir()
    read = read_batch_file(write(tmp_path / "bad.jsonl", lines), JobOptions(), spool=spool,
                           skip_bad=True)
    assert [(s.line, s.custom_id, s.param) for s in read.skipped] == [
        (2, "web", IMG_FIELD), (3, None, "(line)"), (4, "ok-1", "custom_id")]
    assert read.lines == {"ok-1": 1}
    assert FileRecord.of(read, [], []).lines == 4
    assert list(unranges(ranges([1, 2, 3, 7, 9, 10, 4]))) == [1, 2, 3, 7, 9, 10, 4]
    assert ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"


def _bad_schema_problem() -> str:
    where = "body.response_format.json_schema.schema"
    with pytest.raises(PayloadError) as info:
        extract_schema.check_schema({"type": "object", "properties": 3}, where)
    return f"field '{where}' {info.value.problem}"


def _refusals(tmp: Path) -> list[tuple[list[Any], str]]:
    good = png_uri()
    helpers.make_pdf(tmp / "three.pdf", 3)
    (tmp / "notes.txt").write_text("not an image")
    text_uri = "data:image/png;base64," + base64.b64encode(b"plain text").decode()
    nothing = {"custom_id": "a", "method": "POST", "url": URL, "body": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}],
        "response_format": {"type": "json_object"}}}
    two = line("a", good)
    two["body"]["messages"][0]["content"].append({"type": "image_url",
                                                  "image_url": {"url": good}})
    chat = line("a", good)
    chat["body"]["messages"].append({"role": "assistant", "content": "earlier"})
    return [
        ([line("a", "https://example.com/a.png")],
         f"line 1: field '{IMG_FIELD}' http(s) URLs are refused: vlmq never fetches from "
         "the web; download it and use a file:// path"),
        ([line("a", "HTTP://example.com/a.png")], "http(s) URLs are refused"),
        ([{k: v for k, v in line("a", good).items() if k != "custom_id"}],
         "line 1: field 'custom_id' is required"),
        ([line("a", good), line("a", good)],
         "line 2: field 'custom_id' 'a' is already used on line 1"),
        ([{**line("a", good), "url": "/v1/embeddings"}],
         "line 1: field 'url' must be \"/v1/chat/completions\""),
        ([{**line("a", good), "method": "GET"}], "line 1: field 'method' must be \"POST\""),
        ([nothing], "line 1: field 'body.messages' has no text: a request without an image"),
        ([two], "line 1: field 'body.messages[0].content[2].image_url.url' is a second "
                f"image; a request takes one (the first is {IMG_FIELD})"),
        ([line("a", "data:image/png;base64")], f"field '{IMG_FIELD}' is not a data: URI"),
        ([line("a", "data:image/png,abc")], f"field '{IMG_FIELD}' must be base64-encoded"),
        ([line("a", "data:image/png;base64,@@@not base64@@@")],
         f"field '{IMG_FIELD}' is not valid base64"),
        ([line("a", "data:text/plain;base64,aGk=")],
         f"field '{IMG_FIELD}' is a data: URI of 'text/plain'; give an image"),
        ([line("a", text_uri)], f"line 1: field '{IMG_FIELD}' data-line1.png: "),
        ([line("a", "file://notes.txt")], f"field '{IMG_FIELD}' {tmp / 'notes.txt'}: "),
        ([line("a", "file://missing.png")], "missing.png: no such file"),
        ([line("a", "file://three.pdf")],
         f"field '{IMG_FIELD}' is a PDF of 3 pages, and a request is one item"),
        ([line("a", "s3://bucket/a.png")], f"field '{IMG_FIELD}' must be a data: URI"),
        ([line("a", good, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": 3}}})],
         _bad_schema_problem()),
        ([line("a", good, response_format={"type": "yaml"})],
         "field 'body.response_format.type' must be"),
        ([chat], "line 1: field 'body.messages[1].role' must be one of system, developer, "
                 "user"),
        ([line("a", good, n=2)], "field 'body.n' is not supported by vlmq: only 1"),
        ([line("a", good, seed=3.5)], "field 'body.seed' must be an integer"),
        ([line("a", good, top_p=2)], "field 'body.top_p' must be between 0 and 1"),
        ([line("a", good, tools=[{"type": "function", "function": {"name": "f"}}])],
         "field 'body.tools' is not supported by vlmq: only []"),
        ([line("a", good, logprobs=True)], "field 'body.logprobs' is not supported by vlmq"),
        ([line("a", good, audio={"voice": "alloy"})],
         "field 'body.audio' is not supported by vlmq"),
        ([{**line("a", good), "url": "/v1/responses"}],
         "line 1: field 'url' \"/v1/responses\" (the Responses API) is not served"),
        ([line("a", good, model="")], "field 'body.model' must be a model name"),
        ([line("a", good, max_tokens=4, max_completion_tokens=4)],
         "field 'body.max_completion_tokens' give max_tokens or max_completion_tokens"),
        ([line("a", good, temperature=9)], "field 'body.temperature' must be between"),
        ([line("a", good, text="")], "field 'body.messages' has no text"),
        (["{nope"], "line 1: field '(line)' is not JSON"),
    ]


def test_every_refusal_names_the_line_and_the_field(tmp_path: Path) -> None:
    for lines, needle in _refusals(tmp_path):
        with pytest.raises(ManifestError) as info:
            read(tmp_path, lines)
        assert needle in str(info.value), (needle, str(info.value))


def test_skip_bad_keeps_the_good_lines(tmp_path: Path) -> None:
    lines = [line("ok-1", png_uri(1)), line("web", "http://example.com/x.png"),
             line("ok-2", png_uri(2))]
    groups, rejected = read(tmp_path, lines, skip_bad=True)
    assert [i.custom_id for g in groups for i in g.prepared.items] == ["ok-1", "ok-2"]
    assert [n for n, _ in rejected] == [2] and "http(s) URLs are refused" in rejected[0][1]


# --- a real worker, and the output files -------------------------------------------------------


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    tmp = tmp_path_factory.mktemp("openai-batch")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, "--max-batch",
                                          "6", name="wo"))
        yield module_redis_url, tmp, tiny_model
    finally:
        helpers.stop_all(procs)


def _cli(url: str, *args: str, code: int = 0) -> Any:
    res = helpers.invoke_cli(url, *args)
    assert res.exit_code == code, (res.stdout, res.stderr)
    return res


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_a_batch_file_through_a_real_worker_and_back(served: tuple[str, Path, Path]) -> None:
    url, tmp, model = served
    helpers.make_images(tmp / "imgs", 2)
    def schema(value: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}

    lines = [
        line("cap-0", png_uri(4), max_tokens=6, model=str(model)),
        line("cap-1", "file://imgs/img0.png", max_tokens=6, model=str(model)),
        line("cap-2", f"file://{tmp / 'imgs' / 'img1.png'}", max_tokens=6,
             model=str(model), stop=["\n\n"]),
        line("ext-0", png_uri(5), max_tokens=200, response_format=schema(SCHEMA)),
        # No receipt fits in 5 tokens: the item fails, cut before its JSON is complete.
        line("cut-0", png_uri(6), max_tokens=5, response_format=schema(RECEIPT)),
    ]
    requests = write(tmp / "requests.jsonl", lines)
    made = json.loads(_cli(url, "enqueue", "--openai-batch", str(requests), "--label",
                           "run=oa", "--json").stdout)
    assert made["batch"] is not None and len(made["jobs"]) == 4  # four sets of settings
    _cli(url, "wait", made["batch"], "--timeout", "240")
    out, errors = tmp / "out.jsonl", tmp / "errors.jsonl"
    _cli(url, "result", made["batch"], "--format", "openai-batch", "-o", str(out),
         "--errors", str(errors))
    good, bad = _lines(out), _lines(errors)
    # Input order, across the four jobs; the cut answer is a 200, as OpenAI gives it.
    assert [x["custom_id"] for x in good] == ["cap-0", "cap-1", "cap-2", "ext-0", "cut-0"]
    assert bad == []
    ids = set()
    for entry in good:
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        assert entry["id"].startswith("batch_req_") and entry["response"]["request_id"]
        body = ChatCompletion.model_validate(entry["response"]["body"], strict=True)
        ids.add(body.id)
        assert body.object == "chat.completion" and body.created > 1_700_000_000
        assert body.model == str(model)  # the worker's own id, from its live stats
        choice = body.choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop",
                                                                               "length")
        assert body.usage is not None and body.usage.total_tokens == (
            body.usage.prompt_tokens + body.usage.completion_tokens) > 0
        if entry["custom_id"] == "ext-0":
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert len(ids) == len(good)
    cut = ChatCompletion.model_validate(good[-1]["response"]["body"], strict=True)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content
    with pytest.raises(json.JSONDecodeError):  # the partial JSON, never a whole value
        json.loads(cut.choices[0].message.content)
    # vlmq's own jsonl keeps it failed: no `json`, the error says it was cut.
    own = {x["custom_id"]: x for x in map(json.loads, _cli(
        url, "result", made["batch"], "--format", "jsonl").stdout.splitlines())}
    assert own["cut-0"]["json"] is None and "max_tokens" in own["cut-0"]["error"]
    assert own["cut-0"]["model_text"] == cut.choices[0].message.content
    # Without --errors: every request, in input order.
    every = [json.loads(x) for x in _cli(url, "result", made["batch"], "--format",
                                         "openai-batch").stdout.splitlines()]
    assert every == good


def test_items_of_a_canceled_job_are_error_lines(served: tuple[str, Path, Path]) -> None:
    url, tmp, _ = served
    requests = write(tmp / "cancel.jsonl", [line("c-0", png_uri(7)), line("c-1", png_uri(8))])
    job_id = _cli(url, "enqueue", "--openai-batch", str(requests), "--queue",
                  "nobody-serves").stdout.strip()
    with Client(url) as client:
        client.batch(job_id).cancel()  # a file is always a batch
    res = _cli(url, "result", job_id, "--format", "openai-batch", "--errors",
               str(tmp / "cancel-errors.jsonl"))
    assert res.stdout == ""
    bad = _lines(tmp / "cancel-errors.jsonl")
    assert [(x["custom_id"], x["response"], x["error"]["code"]) for x in bad] == [
        ("c-0", None, "batch_cancelled"), ("c-1", None, "batch_cancelled")]


def test_errors_file_needs_a_format_that_splits(served: tuple[str, Path, Path]) -> None:
    url, tmp, _ = served
    requests = write(tmp / "one.jsonl", [line("o-0", png_uri(9))])
    job_id = _cli(url, "enqueue", "--openai-batch", str(requests), "--queue",
                  "nobody-serves").stdout.strip()
    res = _cli(url, "result", job_id, "--format", "md", "--errors", str(tmp / "e"), code=2)
    assert "--errors needs --format jsonl or openai-batch" in res.stderr
    res = _cli(url, "enqueue", "--openai-batch", str(requests), "--manifest",
               str(requests), code=2)
    assert "not both" in res.stderr
    res = _cli(url, "enqueue", "--manifest", str(requests), "--model-map", "a=b", code=2)
    assert "--model-map and --strict-model go with --openai-batch" in res.stderr
    with Client(url) as client:
        client.batch(job_id).cancel()


def test_a_model_the_worker_does_not_serve_fails_every_request_when_strict(
        served: tuple[str, Path, Path]) -> None:
    url, tmp, _ = served
    requests = write(tmp / "model.jsonl", [line("m-0", png_uri(10), model="other/model")])
    job_id = _cli(url, "enqueue", "--openai-batch", str(requests),
                  "--strict-model").stdout.strip()
    _cli(url, "wait", job_id, "--timeout", "120", code=1)
    res = _cli(url, "result", job_id, "--format", "openai-batch", code=1)
    (entry,) = [json.loads(x) for x in res.stdout.splitlines()]
    assert (entry["custom_id"], entry["response"], entry["error"]["code"]) == (
        "m-0", None, "batch_failed")
    assert "job asks for model 'other/model'" in entry["error"]["message"]


# --- a file as OpenAI's Batch API docs write it ------------------------------------------------


def _docs_file(tmp: Path) -> list[Any]:
    """Requests as the Batch API guide and the chat completions reference write them:
    `model` on every line, system and developer messages, max_completion_tokens (and the
    legacy max_tokens), seed, sampling knobs, json_schema (strict) and json_object, data:
    images with `detail`, and text-only lines (the Batch guide's own example, and a
    json_schema one); one line refused for good (a web URL) and one Responses API line,
    both to be skipped."""
    def req(custom_id: str, messages: list[Any], **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": URL,
                "body": {"model": "gpt-4o-mini", "messages": messages, **body}}

    def user(text: str, uri: str, detail: str) -> dict[str, Any]:
        return {"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": uri, "detail": detail}}]}

    system = {"role": "system", "content": "You are a helpful assistant."}
    developer = {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}
    receipt = {"type": "json_schema", "json_schema": {
        "name": "receipt", "description": "A receipt's fields", "strict": True,
        "schema": RECEIPT}}
    return [
        req("request-1", [system, user("What is in this image?", png_uri(11), "auto")],
            max_completion_tokens=8, seed=42, temperature=0),
        req("request-2", [developer, user("Describe it.", png_uri(12), "low")],
            max_tokens=6, temperature=0.7, top_p=0.9, seed=7, presence_penalty=0.0,
            frequency_penalty=0.2, n=1, user="user-123", stop=["\n\n"], logprobs=False,
            logit_bias={}, modalities=["text"], stream=False, parallel_tool_calls=True,
            metadata={"run": "docs"}, store=False, service_tier="auto"),
        req("request-3", [system, user("Read the title.", png_uri(13), "high")],
            max_completion_tokens=200, seed=1, response_format={
                "type": "json_schema", "json_schema": {"name": "title", "strict": True,
                                                       "schema": SCHEMA}}),
        req("request-4", [system, user("Answer in JSON.", png_uri(14), "auto")],
            max_completion_tokens=64, response_format={"type": "json_object"}),
        req("request-5", [user("Where is this?", "https://example.com/a.png", "auto")],
            max_completion_tokens=8),
        # No receipt fits in 5 tokens: cut at the limit, answered as OpenAI does.
        req("request-6", [system, user("Read the receipt.", png_uri(15), "high")],
            max_completion_tokens=5, seed=3, response_format=receipt),
        {"custom_id": "request-7", "method": "POST", "url": "/v1/responses",
         "body": {"model": "gpt-4o-mini", "input": "Hello world!"}},
        req("request-8", [system, user("What is in this image?", png_uri(16), "auto")],
            max_completion_tokens=8, seed=42, temperature=0),
        {**json.loads(DOCS_TEXT_LINE), "custom_id": "request-9"},
        req("request-10", [developer, {"role": "user", "content": "Name a title."}],
            max_completion_tokens=200, response_format={
                "type": "json_schema", "json_schema": {"name": "title", "strict": True,
                                                       "schema": SCHEMA}}),
    ]


def test_a_file_written_from_openais_docs_runs_as_it_is(
        served: tuple[str, Path, Path]) -> None:
    url, tmp, model = served
    lines = _docs_file(tmp)
    requests = write(tmp / "docs.jsonl", lines)
    made = json.loads(_cli(url, "enqueue", "--openai-batch", str(requests), "--skip-bad",
                           "--json").stdout)
    assert [r["line"] for r in made["rejected"]] == [5, 7]
    _cli(url, "wait", made["batch"], "--timeout", "240")
    out, errors = tmp / "docs-out.jsonl", tmp / "docs-errors.jsonl"
    _cli(url, "result", made["batch"], "--format", "openai-batch", "-o", str(out),
         "--errors", str(errors))
    good, bad = _lines(out), _lines(errors)
    order = [x["custom_id"] for x in lines]
    # Every input line has exactly one line, in the output or the error file, in order.
    assert [x["custom_id"] for x in good] == [c for c in order if c not in (
        "request-5", "request-7")]
    assert [x["custom_id"] for x in bad] == ["request-5", "request-7"]
    every = [json.loads(x)["custom_id"] for x in _cli(
        url, "result", made["batch"], "--format", "openai-batch").stdout.splitlines()]
    assert every == order
    finish = {}
    for entry in good:
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(entry["response"]["body"], strict=True)
        assert body.model == str(model)  # the model that answered, as OpenAI echoes it
        finish[entry["custom_id"]] = body.choices[0]
    jsonschema.validate(json.loads(finish["request-3"].message.content or ""), SCHEMA)
    # Text-only lines, answered from their prompt alone; json_schema constrained as ever.
    jsonschema.validate(json.loads(finish["request-10"].message.content or ""), SCHEMA)
    assert finish["request-9"].message.content
    if finish["request-4"].finish_reason == "stop":
        assert isinstance(json.loads(finish["request-4"].message.content or ""), dict)
    assert finish["request-6"].finish_reason == "length"
    for entry in bad:
        assert entry["response"] is None
        error = BatchError.model_validate(entry["error"], strict=True)
        assert error.line == order.index(entry["custom_id"]) + 1 and error.message
    assert "http(s) URLs are refused" in bad[0]["error"]["message"]
    assert "Responses API" in bad[1]["error"]["message"]


def test_the_python_path_maps_a_model_and_reads_the_output(
        served: tuple[str, Path, Path]) -> None:
    url, tmp, model = served
    lines = [line("p-1", png_uri(17), max_tokens=4, model="gpt-4o-mini"),
             line("p-2", "http://example.com/x.png", model="gpt-4o-mini"),
             line("p-3", png_uri(18), max_tokens=4, model="gpt-4o-mini", temperature=0.5)]
    requests = write(tmp / "python.jsonl", lines)
    with Client(url) as client:
        batch, skipped = submit_openai_batch(
            client, requests, skip_bad=True,
            models=ModelPolicy.parse([f"gpt-4o-mini={model}"], strict=True))
        assert [s.line for s in skipped] == [2]
        assert all(j.payload().get("model") == str(model) for j in batch.jobs())
        batch.wait(timeout=240)
        views = [JobResults.read(j) for j in batch.jobs()]
        out = [(ok, json.loads(x)) for ok, x in openai_output(views)]
    assert [(ok, x["custom_id"]) for ok, x in out] == [(True, "p-1"), (False, "p-2"),
                                                       (True, "p-3")]
    assert out[1][1]["error"]["code"] == "invalid_request"
