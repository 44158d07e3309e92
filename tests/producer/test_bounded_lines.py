"""Lines read with bounds: a number too long to convert, one that overflows a float, NaN,
JSON nested thousands deep or a number past a field's range is that line's error, naming
the line and the field, in an OpenAI batch file and in a manifest alike; the CLI prints
it with no traceback. A file of more requests than OpenAI takes (50,000) is refused at its
first request over, as OpenAI refuses it, without reading the rest."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from openai.types.chat import ChatCompletionUserMessageParam
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming

from tests.support import helpers
from vlmq.producer.manifest import ManifestError, TooManyRequests, read_manifest
from vlmq.producer.openai_files import MAX_REQUESTS, read_batch_file
from vlmq.producer.options import JobOptions

URL = "/v1/chat/completions"


def request(custom_id: str, text: str = "Say hi.", **extra: Any) -> str:
    """A text-only chat request, its body typed as the `openai` package types one."""
    user: ChatCompletionUserMessageParam = {"role": "user", "content": text}
    body: CompletionCreateParamsNonStreaming = {"model": "gpt-4o-mini", "messages": [user],
                                                "max_completion_tokens": 8}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL,
                       "body": {**body, **extra}})


def raw_request(custom_id: str, field: str, literal: str) -> str:
    """A request whose body field `field` is the JSON text `literal`, as a hostile
    producer would write it (no JSON library writes these)."""
    return request(custom_id)[:-2] + f', "{field}": {literal}}}}}'


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (line text, the field named, words of the reason)
HOSTILE = [
    (raw_request("t", "temperature", "1" * 401), "body.temperature", "401 characters"),
    (raw_request("m", "max_tokens", "1" * 4300), "body.max_tokens", "4,300 characters"),
    (raw_request("s", "seed", "1" * 4300), "body.seed", "4,300 characters"),
    (raw_request("s2", "seed", "1" * 4301), "body.seed", "4,301 characters"),
    (raw_request("f", "temperature", "1e400"), "body.temperature", "too large a number"),
    (raw_request("n", "top_p", "NaN"), "body.top_p", "not a JSON number"),
    (raw_request("i", "frequency_penalty", "-Infinity"), "body.frequency_penalty",
     "not a JSON number"),
    (raw_request("s3", "seed", str(2**63)), "body.seed", "must be between"),
    (raw_request("d", "metadata", nested(5000)), "(line)", "nests JSON deeper than"),
    (raw_request("d2", "metadata", nested(200)), "(line)", "nests JSON deeper than"),
    ("1" * 5000, "(line)", "5,000 characters"),
]


# Values of the wrong type where a check expects another: each that line's error too.
WRONG_TYPES = [
    (raw_request("w1", "temperature", "[1]"), "body.temperature"),
    (raw_request("w2", "seed", '"7"'), "body.seed"),
    (raw_request("w3", "stop", '{"a": 1}'), "body.stop"),
    (raw_request("w4", "response_format", '{"type": {"a": 1}}'), "body.response_format.type"),
    (raw_request("w5", "n", "[[[]]]"), "body.n"),
    (request("w6")[:-2].replace('"content": "Say hi."', '"content": [{"type": ["text"]}]')
     + "}}", "body.messages[0].content[0].type"),
    (request("w7").replace('"role": "user"', '"role": {"r": 1}'), "body.messages[0].role"),
    ('{"custom_id": ["x"], "method": "POST", "url": "/v1/chat/completions", "body": {}}',
     "custom_id"),
]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return path


def test_hostile_numbers_and_nesting_are_line_errors(tmp_path: Path) -> None:
    lines = [request("ok-1"), *(text for text, _, _ in HOSTILE), request("ok-2")]
    read = read_batch_file(write(tmp_path / "in.jsonl", lines), JobOptions(),
                           spool=tmp_path, skip_bad=True)
    assert [s.line for s in read.skipped] == list(range(2, len(HOSTILE) + 2))
    for skipped, (_, field, words) in zip(read.skipped, HOSTILE, strict=True):
        assert skipped.param == field and words in skipped.reason, skipped
        assert len(skipped.reason) < 200
    # The custom_id of a line refused for a number is still known (the error file's).
    assert read.skipped[0].custom_id == "t"
    assert [i.custom_id for g in read.groups for i in g.prepared.items] == ["ok-1", "ok-2"]


def test_values_of_the_wrong_type_are_line_errors(tmp_path: Path) -> None:
    lines = [text for text, _ in WRONG_TYPES]
    read = read_batch_file(write(tmp_path / "in.jsonl", [request("ok"), *lines]),
                           JobOptions(), spool=tmp_path, skip_bad=True)
    assert [(s.line, s.param) for s in read.skipped] == [
        (n, field) for n, (_, field) in enumerate(WRONG_TYPES, start=2)], read.skipped
    assert all("cannot be read" not in s.reason for s in read.skipped)


def test_a_manifest_line_is_read_with_the_same_bounds(tmp_path: Path) -> None:
    helpers.make_images(tmp_path, 1)
    good = {"custom_id": "ok", "task": "caption", "file": "img0.png"}
    lines = [json.dumps(good),
             json.dumps({**good, "custom_id": "m"})[:-1] + ', "max_tokens": ' + "9" * 4300
             + "}",
             json.dumps({**good, "custom_id": "t"})[:-1] + ', "temperature": ' + "1" * 401
             + "}",
             json.dumps({**good, "custom_id": "d"})[:-1] + ', "labels": ' + nested(3000)
             + "}"]
    with pytest.raises(ManifestError) as info:
        read_manifest(write(tmp_path / "m.jsonl", lines), JobOptions())
    assert [n for n, _ in info.value.errors] == [2, 3, 4]
    assert "field 'max_tokens' is a number of 4,300 characters" in info.value.errors[0][1]
    assert "field 'temperature' is a number of 401 characters" in info.value.errors[1][1]
    assert "nests JSON deeper than" in info.value.errors[2][1]


def _no_traceback(res: Result) -> str:
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    return res.stderr


def test_the_cli_names_the_line_and_prints_no_traceback(run_cli: Any, tmp_path: Path) -> None:
    lines = [request("ok"), HOSTILE[1][0]]
    err = _no_traceback(run_cli("enqueue", "--openai-batch",
                                str(write(tmp_path / "in.jsonl", lines))))
    assert "line 2: field 'body.max_tokens' is a number of 4,300 characters" in err
    helpers.make_images(tmp_path, 1)
    manifest = json.dumps({"custom_id": "a", "task": "caption", "file": "img0.png"})[:-1] \
        + ', "temperature": ' + "1" * 401 + "}"
    err = _no_traceback(run_cli("enqueue", "--manifest",
                                str(write(tmp_path / "m.jsonl", [manifest]))))
    assert "line 1: field 'temperature' is a number of 401 characters" in err


def test_more_requests_than_openai_takes_are_refused_unread(tmp_path: Path) -> None:
    assert MAX_REQUESTS == 50_000  # OpenAI's batches.create: "up to 50,000 requests"
    path = tmp_path / "big.jsonl"
    one = request("x")
    with path.open("w") as f:
        for i in range(MAX_REQUESTS):
            f.write(one.replace('"x"', f'"r{i}"') + "\n")
            if i % 1000 == 0:
                f.write("\n")  # blank lines are no requests
        f.write(request("over") + "\n")
        f.write("{not even JSON\n" * 1000)  # never read
    t0 = time.monotonic()
    with pytest.raises(TooManyRequests) as info:
        read_batch_file(path, JobOptions(), spool=tmp_path, skip_bad=True)
    assert info.value.line == MAX_REQUESTS + MAX_REQUESTS // 1000 + 1
    assert "more than 50,000 requests" in str(info.value)
    assert time.monotonic() - t0 < 120
