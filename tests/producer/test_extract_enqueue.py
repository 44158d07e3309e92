"""Getting an extract job into Redis: the schema is checked where it enters
(CLI, client, manifest, schedule, enqueue.lua), a bad one is refused with the problem named
and Redis unchanged, and a good one reaches the payload exactly as given."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from redis import Redis

from tests.support.factories import SHA
from tests.support.helpers import make_images, make_pdf
from tests.support.lua_calls import call, refused, store_blob
from vlmq.producer import Client
from vlmq.producer.ops.schedules import ScheduleStore
from vlmq.producer.options import JobOptions
from vlmq.shared import bounded_reads, extract_schema
from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.messages import Item, parse_payload

Cli = Callable[..., Result]

RECEIPT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "description": "Who sold it"},
        "total": {"type": "number", "minimum": 0},
        "lines": {"type": "array", "minItems": 1, "maxItems": 5,
                  "items": {"type": "object", "required": ["name"],
                            "properties": {"name": {"type": "string"},
                                           "qty": {"type": "integer", "minimum": 1}}}},
        "kind": {"enum": ["food", "fuel"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]+$"},
    },
    "required": ["vendor", "total"],
}
OTHER: dict[str, Any] = {"type": "object", "properties": {"title": {"type": "string"}},
                         "required": ["title"]}


def _snapshot(redis: Redis) -> dict[bytes, bytes]:
    return {k: redis.type(k) for k in redis.scan_iter()}


def _write(path: Path, value: Any) -> Path:
    path.write_text(value if isinstance(value, str) else json.dumps(value), encoding="utf-8")
    return path


def _payload_of(redis_url: str, job_id: str) -> dict[str, Any]:
    """The payload as Redis holds it (RQ job data), not as the client parses it."""
    with Client(redis_url) as client:
        return client.job(job_id).payload().to_dict()


# --- shared/extract_schema.py -------------------------------------------------------------------


def test_a_good_schema_comes_back_as_a_plain_copy_in_its_own_key_order() -> None:
    given = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    got = extract_schema.check_schema(given)
    assert got == given and got is not given
    assert list(got["properties"]) == ["z", "a"]
    assert extract_schema.schema_text(got) == ('{"type":"object","properties":'
                                               '{"z":{"type":"string"},"a":{"type":"integer"}}}')
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **RECEIPT}
    assert extract_schema.check_schema(draft7) == draft7


BAD_SCHEMAS = [
    ("not an object", ["a"], "must be a non-empty JSON object (a JSON Schema), got an array"),
    ("a boolean schema", True, "got a boolean"),
    ("empty", {}, "got an empty object"),
    ("invalid", {"type": "strin"}, "is not a valid JSON Schema: 'strin' is not valid"),
    ("invalid deep", {"type": "object", "properties": {"a": {"minLength": "x"}}},
     "(at properties.a.minLength)"),
    ("unsupported", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "llguidance) cannot follow it: Unimplemented keys: [\"not\"]"),
    ("unsatisfiable", {"type": "integer", "minimum": 5, "maximum": 1},
     "minimum (5) is greater than maximum (1)"),
    ("unknown $schema", {"$schema": "https://example.com/mine", "type": "object"},
     "is not a JSON Schema draft this checker knows"),
    ("too big", {"description": "x" * C.MAX_SCHEMA_BYTES},
     f"bytes of compact JSON, over the {C.MAX_SCHEMA_BYTES}-byte limit"),
    ("too deep", None, None),  # built in the test
    ("not JSON", {"default": float("nan"), "type": "number"}, "is not JSON"),
    ("lone surrogate", {"description": "\ud800"}, "lone surrogate"),
]


@pytest.mark.parametrize(("value", "needle"), [(v, n) for _, v, n in BAD_SCHEMAS],
                         ids=[name for name, _, _ in BAD_SCHEMAS])
def test_a_bad_schema_is_refused_naming_where_and_why(value: Any, needle: str | None) -> None:
    if needle is None:  # too deep: one level past the limit
        value = _nested(extract_schema.MAX_SCHEMA_DEPTH + 1)
        needle = f"nests deeper than {extract_schema.MAX_SCHEMA_DEPTH} levels"
    with pytest.raises(PayloadError) as info:
        extract_schema.check_schema(value, where="in.json")
    assert info.value.field == "in.json"
    assert needle in info.value.problem, info.value.problem


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "array"}
    for _ in range(depth - 1):
        value = {"type": "array", "items": value}
    return value


def test_the_deepest_schema_allowed_fits_in_job_data_the_worker_reads() -> None:
    schema = extract_schema.check_schema(_nested(extract_schema.MAX_SCHEMA_DEPTH))
    data = [C.TASK_FUNC, None, [_lua_payload(schema=schema)], {}]
    assert bounded_reads.loads(json.dumps(data))[2][0]["schema"] == schema
    with pytest.raises(bounded_reads.BoundError):
        bounded_reads.loads(json.dumps([C.TASK_FUNC, None, [_lua_payload(
            schema=_nested(extract_schema.MAX_SCHEMA_DEPTH + 1))], {}]))


def test_a_pydantic_model_schema_is_accepted() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Line(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        name: str
        qty: int = pydantic.Field(ge=1, le=100)

    class Receipt(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        vendor: str = pydantic.Field(description="Who sold it")
        total: float
        lines: list[Line]
        note: str | None = None

    schema = extract_schema.check_schema(extract_schema.as_schema(Receipt))
    assert schema == Receipt.model_json_schema()
    assert extract_schema.as_schema(Receipt(vendor="v", total=1.0, lines=[])) == schema


def test_as_schema_takes_json_text_and_refuses_text_that_is_not() -> None:
    assert extract_schema.as_schema(json.dumps(RECEIPT)) == RECEIPT
    assert extract_schema.as_schema(RECEIPT) is RECEIPT
    with pytest.raises(PayloadError, match="schema: is a string but not JSON"):
        extract_schema.as_schema("receipt.json")


def test_the_default_prompt_lists_the_fields_and_quotes_the_schema() -> None:
    prompt = extract_schema.default_prompt(RECEIPT)
    assert "one JSON object only" in prompt
    assert "- vendor: Who sold it\n- total\n- lines\n- kind\n- code\n" in prompt
    assert prompt.endswith(extract_schema.schema_text(RECEIPT))
    assert "one JSON value" in extract_schema.default_prompt({"type": "array",
                                                              "items": {"type": "string"}})


def test_extract_needs_a_schema_and_other_tasks_take_none() -> None:
    item = {"kind": "image", "blob": SHA, "source": "a.png"}
    base = {"v": 1, "items": [item]}
    with pytest.raises(PayloadError) as info:
        parse_payload({**base, "task": "extract"})
    assert (info.value.field, info.value.problem) == ("schema", "is required for task extract")
    for task in ("ocr", "caption", "generate"):
        with pytest.raises(PayloadError) as info:
            parse_payload({**base, "task": task, "prompt": "p", "schema": RECEIPT})
        assert info.value.field == "schema"
        assert info.value.problem == f"is only allowed with task extract, not {task}"
    with pytest.raises(PayloadError, match="schema: is not a valid JSON Schema"):
        parse_payload({**base, "task": "extract", "schema": {"type": 5}})
    parsed = parse_payload({**base, "task": "extract", "schema": RECEIPT})
    assert parsed.get("schema") == RECEIPT
    # JobOptions.payload runs the same parse, so the producer refuses what the worker would.
    with pytest.raises(PayloadError, match="schema: is only allowed"):
        JobOptions(schema=RECEIPT).payload("ocr", [Item(kind="image", blob=SHA, source="a")])


# --- enqueue.lua -----------------------------------------------------------------------------


def _lua_payload(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"v": 1, "task": "extract", "schema": RECEIPT,
                           "items": [{"kind": "image", "blob": SHA, "source": "a.png"}]}
    out.update(fields)
    return {k: v for k, v in out.items() if v is not ...}


@pytest.fixture
def blob(redis: Redis) -> Redis:
    return store_blob(redis)


LUA_REFUSED = [
    ("extract without schema", _lua_payload(schema=...), "schema: is required for task extract"),
    ("extract with null schema", _lua_payload(schema=None),
     "schema: is required for task extract"),
    ("schema on ocr", _lua_payload(task="ocr"),
     "schema: is only allowed with task extract, not ocr"),
    ("schema on caption", _lua_payload(task="caption"),
     "schema: is only allowed with task extract, not caption"),
    ("schema a string", _lua_payload(schema=json.dumps(RECEIPT)),
     "schema: must be a non-empty JSON object (a JSON Schema)"),
    ("schema an array", _lua_payload(schema=[RECEIPT]), "schema: must be a non-empty JSON object"),
    ("schema empty", _lua_payload(schema={}), "schema: must be a non-empty JSON object"),
    ("schema a number", _lua_payload(schema=7), "schema: must be a non-empty JSON object"),
    ("schema too big", _lua_payload(schema={"description": "é/" * 30_000}),
     "schema: is 90018 bytes of compact JSON, over the 65536-byte limit"),
]


@pytest.mark.parametrize(("data", "needle"), [(d, n) for _, d, n in LUA_REFUSED],
                         ids=[name for name, _, _ in LUA_REFUSED])
def test_enqueue_lua_refuses_a_bad_schema_and_writes_nothing(blob: Redis, data: dict[str, Any],
                                                             needle: str) -> None:
    refused(blob, needle, data=data, queue="extract")


def test_enqueue_lua_takes_an_extract_job_with_its_schema(blob: Redis) -> None:
    assert call(blob, data=_lua_payload(), queue="extract") == 1
    assert blob.lrange("rq:queue:extract", 0, -1) == [b"j1"]
    data = json.loads(blob.hget("rq:job:j1", "data") or b"")
    assert data[2][0]["schema"] == RECEIPT


# --- vlmq enqueue extract --------------------------------------------------------------------


def test_cli_enqueues_images_and_pdf_pages_with_the_schema_on_queue_extract(
        run_cli: Cli, redis_url: str, redis: Redis, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 2)
    make_pdf(tmp_path / "in" / "doc.pdf", 3)
    schema = _write(tmp_path / "receipt.json", json.dumps(RECEIPT, indent=2))
    res = run_cli("enqueue", "extract", str(tmp_path / "in"), "--schema", str(schema),
                  "--pages", "2-3", "--json", code=0)
    job = json.loads(res.stdout)
    assert (job["task"], job["queue"], job["items"]) == ("extract", "extract", 4)
    assert redis.lrange("rq:queue:extract", 0, -1) == [job["id"].encode()]
    payload = _payload_of(redis_url, job["id"])
    assert payload["task"] == "extract"
    assert payload["schema"] == RECEIPT
    assert list(payload["schema"]["properties"]) == list(RECEIPT["properties"])  # order kept
    assert "prompt" not in payload  # the worker builds it from the schema
    assert sorted((i["kind"], i.get("page")) for i in payload["items"]) == [
        ("image", None), ("image", None), ("pdf", 2), ("pdf", 3)]
    res = run_cli("enqueue", "extract", str(tmp_path / "in"), "--schema", str(schema),
                  "--prompt", "Read the receipt.", "--queue", "receipts", code=0)
    payload = _payload_of(redis_url, res.stdout.strip())
    assert payload["prompt"] == "Read the receipt." and payload["schema"] == RECEIPT
    assert redis.llen("rq:queue:receipts") == 1


CLI_BAD = [
    ("not JSON", "{\"type\": ", "is not JSON: Expecting value"),
    ("not an object", "[1, 2]", "must be a non-empty JSON object (a JSON Schema), got an array"),
    ("empty object", "{}", "got an empty object"),
    ("invalid schema", json.dumps({"type": "object", "required": "vendor"}),
     "is not a valid JSON Schema: 'vendor' is not of type 'array' (at required)"),
    ("unsupported", json.dumps({"type": "object", "if": {"type": "object"},
                                "then": {"required": ["a"]}}),
     "is not supported: the decoder's matcher (llguidance) cannot follow it"),
    ("too big", json.dumps({"description": "x" * C.MAX_SCHEMA_BYTES}),
     "over the 65536-byte limit"),
    ("not UTF-8", b"{\"description\": \"\xff\"}", "is not UTF-8 text"),
]


@pytest.mark.parametrize(("content", "needle"), [(c, n) for _, c, n in CLI_BAD],
                         ids=[name for name, _, _ in CLI_BAD])
def test_cli_refuses_a_bad_schema_with_exit_2_and_redis_unchanged(
        run_cli: Cli, redis: Redis, tmp_path: Path, content: str | bytes, needle: str) -> None:
    make_images(tmp_path / "in", 1)
    schema = tmp_path / "bad.json"
    if isinstance(content, bytes):
        schema.write_bytes(content)
    else:
        schema.write_text(content, encoding="utf-8")
    before = _snapshot(redis)
    res = run_cli("enqueue", "extract", str(tmp_path / "in"), "--schema", str(schema), code=2)
    assert f"{schema}: " in res.stderr and needle in res.stderr, res.stderr
    assert "--schema" in res.stderr
    assert _snapshot(redis) == before


def test_cli_refuses_extract_without_schema_and_schema_on_other_tasks(
        run_cli: Cli, redis: Redis, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 1)
    schema = _write(tmp_path / "s.json", RECEIPT)
    before = _snapshot(redis)
    res = run_cli("enqueue", "extract", str(tmp_path / "in"), code=2)
    assert "Missing option '--schema'" in res.stderr
    res = run_cli("enqueue", "extract", str(tmp_path / "in"), "--schema",
                  str(tmp_path / "missing.json"), code=2)
    assert "missing.json: cannot read the schema: No such file" in res.stderr
    for task in ("ocr", "caption"):
        res = run_cli("enqueue", task, str(tmp_path / "in"), "--schema", str(schema), code=2)
        assert "No such option" in res.stderr and "--schema" in res.stderr
    assert _snapshot(redis) == before


# --- the Python client -----------------------------------------------------------------------


def test_client_extract_takes_a_dict_json_text_and_a_model(redis_url: str, redis: Redis,
                                                           tmp_path: Path) -> None:
    images = make_images(tmp_path / "in", 2)

    class Model:  # duck-typed like a pydantic model class: no pydantic needed
        @staticmethod
        def model_json_schema() -> dict[str, Any]:
            return OTHER

    with Client(redis_url) as client:
        by_dict = client.extract(tmp_path / "in", schema=RECEIPT, max_tokens=64)
        by_text = client.extract(images[0], schema=json.dumps(OTHER))
        by_model = client.extract(images, Model, prompt="Title?")
    assert by_dict.queue == "extract" and by_dict.items == 2 and by_dict.task == "extract"
    payload = _payload_of(redis_url, by_dict.id)
    assert (payload["schema"], payload["generation"]["max_tokens"]) == (RECEIPT, 64)
    assert _payload_of(redis_url, by_text.id)["schema"] == OTHER
    assert _payload_of(redis_url, by_model.id)["schema"] == OTHER
    assert _payload_of(redis_url, by_model.id)["prompt"] == "Title?"
    assert redis.llen("rq:queue:extract") == 3


def test_client_extract_with_a_pydantic_model(redis_url: str, tmp_path: Path) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Receipt(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        vendor: str = pydantic.Field(description="Who sold it")
        total: float = pydantic.Field(ge=0)

    make_images(tmp_path / "in", 1)
    with Client(redis_url) as client:
        job = client.extract(tmp_path / "in", schema=Receipt)
    assert _payload_of(redis_url, job.id)["schema"] == Receipt.model_json_schema()


def test_client_refuses_bad_schemas_and_misplaced_ones_before_writing(
        redis_url: str, redis: Redis, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 1)
    before = _snapshot(redis)
    with Client(redis_url) as client:
        with pytest.raises(PayloadError, match=r"schema: is not supported"):
            client.extract(tmp_path / "in", schema={"type": "object", "not": {}})
        with pytest.raises(PayloadError, match="schema: must be a non-empty JSON object"):
            client.extract(tmp_path / "in", schema=[RECEIPT])
        with pytest.raises(PayloadError, match="schema: is required for task extract"):
            client.submit("extract", tmp_path / "in")
        with pytest.raises(PayloadError, match="schema: is only allowed with task extract"):
            client.submit("caption", tmp_path / "in", JobOptions(schema=RECEIPT))
        with pytest.raises(PayloadError, match="schema: is only allowed with task extract"):
            client.submit_set("ocr", tmp_path / "in", JobOptions(schema=RECEIPT))
    assert _snapshot(redis) == before


# --- manifests -------------------------------------------------------------------------------


def _manifest(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def test_manifest_schemas_inline_and_from_files_and_grouping(
        run_cli: Cli, redis_url: str, tmp_path: Path) -> None:
    images = make_images(tmp_path / "imgs", 4)
    (tmp_path / "schemas").mkdir()
    _write(tmp_path / "schemas" / "receipt.json", json.dumps(RECEIPT, indent=1))
    _write(tmp_path / "schemas" / "other.json", OTHER)
    manifest = _manifest(tmp_path / "requests.jsonl", [
        {"custom_id": "a", "task": "extract", "file": f"imgs/{images[0].name}",
         "schema": RECEIPT},
        # the same schema from a file: the same settings, so the same job as line 1
        {"custom_id": "b", "task": "extract", "file": f"imgs/{images[1].name}",
         "schema": "schemas/receipt.json"},
        {"custom_id": "c", "task": "extract", "file": f"imgs/{images[2].name}",
         "schema": "schemas/other.json", "prompt": "Title?"},
        {"custom_id": "d", "task": "caption", "file": f"imgs/{images[3].name}"},
    ])
    res = run_cli("enqueue", "--manifest", str(manifest), "--json", code=0)
    jobs = json.loads(res.stdout)["jobs"]
    assert sorted((j["task"], j["queue"], j["items"]) for j in jobs) == [
        ("caption", "caption", 1), ("extract", "extract", 1), ("extract", "extract", 2)]
    by_ids = {}
    for j in jobs:
        payload = _payload_of(redis_url, j["id"])
        by_ids[tuple(sorted(i["custom_id"] for i in payload["items"]))] = payload
    assert by_ids[("a", "b")]["schema"] == RECEIPT
    assert by_ids[("c",)]["schema"] == OTHER and by_ids[("c",)]["prompt"] == "Title?"
    assert "schema" not in by_ids[("d",)]


def test_manifest_lines_with_bad_or_misplaced_schemas_are_named(
        run_cli: Cli, redis: Redis, tmp_path: Path) -> None:
    image = make_images(tmp_path, 1)[0].name
    _write(tmp_path / "bad.json", {"type": "object", "properties": {"a": {"type": "strin"}}})
    manifest = _manifest(tmp_path / "m.jsonl", [
        {"custom_id": "ok", "task": "extract", "file": image, "schema": RECEIPT},
        {"custom_id": "1", "task": "extract", "file": image},
        {"custom_id": "2", "task": "ocr", "file": image, "schema": RECEIPT},
        {"custom_id": "3", "task": "extract", "file": image, "schema": "missing.json"},
        {"custom_id": "4", "task": "extract", "file": image, "schema": "bad.json"},
        {"custom_id": "5", "task": "extract", "file": image, "schema": {"type": "object",
                                                                        "not": {}}},
        {"custom_id": "6", "task": "extract", "file": image, "schema": ["a"]},
    ])
    before = _snapshot(redis)
    res = run_cli("enqueue", "--manifest", str(manifest), code=2)
    err = res.stderr
    assert "line 2: field 'schema' is required for task extract" in err, err
    assert "line 3: field 'schema' is only allowed with task extract, not ocr" in err
    assert f"line 4: field 'schema' {tmp_path / 'missing.json'}: cannot read the schema" in err
    assert f"line 5: field 'schema' {tmp_path / 'bad.json'}: is not a valid JSON Schema" in err
    assert "line 6: field 'schema' is not supported" in err
    assert "line 7: field 'schema' must be a non-empty JSON object" in err
    assert "line 1:" not in err
    assert _snapshot(redis) == before


# --- schedules -------------------------------------------------------------------------------


def test_schedule_add_stores_the_schema_and_its_run_enqueues_it(
        run_cli: Cli, redis_url: str, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 2)
    schema = _write(tmp_path / "receipt.json", RECEIPT)
    run_cli("schedule", "add", "receipts", "extract", str(tmp_path / "in"), "--every", "3600",
            "--schema", str(schema), "--max-tokens", "64", code=0)
    with Client(redis_url) as client:
        stored = ScheduleStore(client).get("receipts")
        assert stored.task == "extract" and stored.settings["schema"] == RECEIPT
        first_hash = stored.settings_hash()
    res = run_cli("schedule", "run", "receipts", "--json", code=0)
    run = json.loads(res.stdout)
    assert run["items"] == 2
    payload = _payload_of(redis_url, run["job_id"])
    assert (payload["task"], payload["schema"]) == ("extract", RECEIPT)
    # A changed schema decides other text: the files are due again under it.
    _write(schema, OTHER)
    run_cli("schedule", "add", "receipts", "extract", str(tmp_path / "in"), "--every", "3600",
            "--schema", str(schema), "--replace", code=0)
    with Client(redis_url) as client:
        assert ScheduleStore(client).get("receipts").settings_hash() != first_hash


def test_schedule_add_refuses_extract_without_schema_and_schema_on_ocr(
        run_cli: Cli, redis: Redis, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 1)
    schema = _write(tmp_path / "s.json", RECEIPT)
    bad = _write(tmp_path / "bad.json", "[]")
    before = _snapshot(redis)
    res = run_cli("schedule", "add", "n", "extract", str(tmp_path / "in"), "--every", "60",
                  code=2)
    assert "--schema is required for task extract" in res.stderr
    res = run_cli("schedule", "add", "n", "ocr", str(tmp_path / "in"), "--every", "60",
                  "--schema", str(schema), code=2)
    assert "--schema is only allowed with task extract, not ocr" in res.stderr
    res = run_cli("schedule", "add", "n", "extract", str(tmp_path / "in"), "--every", "60",
                  "--schema", str(bad), code=2)
    assert f"{bad}: must be a non-empty JSON object" in res.stderr
    assert _snapshot(redis) == before
