"""Batch manifests: every line checked first, errors name line and field, --skip-bad,
lines grouped into jobs, and custom_id carried into both output files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import finish, make_images, make_pdf
from vlmq.producer import Client
from vlmq.producer.manifest import ManifestError, read_manifest
from vlmq.producer.options import JobOptions
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.keys import Keys


def write_manifest(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines), encoding="utf-8")
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    pdfs = [make_pdf(tmp_path / f"doc{i}.pdf", 3) for i in range(3)]
    images = make_images(tmp_path / "imgs", 4)
    return pdfs, images


def requests(pdfs: list[Path], images: list[Path]) -> list[object]:
    out: list[object] = [
        {"custom_id": f"pdf-{i}", "task": "ocr", "file": p.name, "pages": "1-2",
         "max_tokens": 4} for i, p in enumerate(pdfs)]
    out += [{"custom_id": f"img-{i}", "task": "caption", "file": str(p), "max_tokens": 4}
            for i, p in enumerate(images)]
    return out


def test_bad_lines_are_named_and_nothing_is_enqueued(run_cli, redis: Redis, tmp_path: Path,
                                                     inputs) -> None:
    pdfs, images = inputs
    lines = requests(pdfs, images)
    lines.insert(2, {"custom_id": "bad", "task": "ocr", "file": pdfs[0].name, "pages": "9"})
    manifest = write_manifest(tmp_path / "requests.jsonl", lines)
    res = run_cli("enqueue", "--manifest", str(manifest))
    assert res.exit_code == 2
    assert "line 3: field 'file'" in res.stderr and "page 9" in res.stderr
    assert "nothing was enqueued" in res.stderr
    assert redis.dbsize() == 1  # the test's db claim only


@pytest.mark.parametrize(("line", "needle"), [
    ("{not json", "line 1: field '(line)' is not JSON"),
    ({"task": "ocr", "file": "x"}, "line 1: field 'custom_id' is required"),
    ({"custom_id": "a", "task": "translate", "file": "x"}, "line 1: field 'task' must be one"),
    ({"custom_id": "a", "task": "generate", "file": "doc0.pdf"},
     "line 1: field 'prompt' is required for task generate"),
    ({"custom_id": "a", "task": "ocr", "file": "doc0.pdf", "max_tokens": 0},
     "line 1: field 'max_tokens' must be between 1 and 32768"),
    ({"custom_id": "a", "task": "ocr", "file": "doc0.pdf", "dpi": 300},
     "line 1: field 'dpi' unknown field"),
    ({"custom_id": "a" * 257, "task": "ocr", "file": "doc0.pdf"},
     "line 1: field 'custom_id' must be a string of 1 to 256"),
    ({"custom_id": "a", "task": "ocr", "file": "missing.pdf"}, "line 1: field 'file'"),
    ({"custom_id": "a", "task": "caption", "file": "imgs/img0.png", "pages": "1"},
     "line 1: field 'pages' applies to PDFs"),
])
def test_each_field_error_names_line_and_field(tmp_path: Path, inputs, line: object,
                                               needle: str) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [line])
    with pytest.raises(ManifestError) as info:
        read_manifest(manifest, JobOptions())
    assert needle in str(info.value), str(info.value)


def test_duplicate_custom_id_is_refused(tmp_path: Path, inputs) -> None:
    pdfs, _ = inputs
    line = {"custom_id": "same", "task": "ocr", "file": pdfs[0].name}
    with pytest.raises(ManifestError, match="line 2: field 'custom_id' 'same' is already "
                                            "used on line 1"):
        read_manifest(write_manifest(tmp_path / "m.jsonl", [line, line]), JobOptions())


def test_lines_with_the_same_settings_share_a_job(tmp_path: Path, inputs) -> None:
    pdfs, images = inputs
    lines = requests(pdfs, images)
    lines.append({"custom_id": "long", "task": "caption", "file": str(images[0]),
                  "max_tokens": 9})
    groups, rejected = read_manifest(write_manifest(tmp_path / "m.jsonl", lines),
                                     JobOptions(queue="q1"))
    assert rejected == []
    shape = sorted((g.task, g.options.max_tokens, len(g.prepared.items)) for g in groups)
    assert shape == [("caption", 4, 4), ("caption", 9, 1), ("ocr", 4, 6)]
    assert {g.options.queue for g in groups} == {"q1"}
    ocr = next(g for g in groups if g.task == "ocr")
    assert [(i.custom_id, i.page) for i in ocr.prepared.items] == [
        ("pdf-0", 1), ("pdf-0", 2), ("pdf-1", 1), ("pdf-1", 2), ("pdf-2", 1), ("pdf-2", 2)]


@pytest.mark.slow
def test_manifest_skip_bad_runs_and_custom_id_reaches_both_files(
        run_cli, redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        inputs) -> None:
    pdfs, images = inputs
    lines = requests(pdfs, images)
    lines.insert(4, {"custom_id": "bad", "task": "caption", "file": "nope.png"})
    manifest = write_manifest(tmp_path / "requests.jsonl", lines)
    res = run_cli("enqueue", "--manifest", str(manifest), "--skip-bad", "--json",
                  "--label", "batch=m1")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["rejected"] == [{"line": 5, "reason": out["rejected"][0]["reason"]}]
    assert "nope.png" in out["rejected"][0]["reason"]
    job_ids = [j["id"] for j in out["jobs"]]
    assert sorted((j["task"], j["items"]) for j in out["jobs"]) == [("caption", 4), ("ocr", 6)]
    assert "no live worker serves queue 'ocr'" in res.stderr
    # One image's bytes go bad after enqueue: that item fails, the rest succeed.
    redis.set(Keys().blob(sha256_hex(images[2].read_bytes())), b"garbage")

    proc = helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "4")
    rc, log = finish(proc)
    assert rc == 0, log
    ok_path, err_path = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    res = run_cli("result", *job_ids, "--format", "jsonl", "-o", str(ok_path),
                  "--errors", str(err_path))
    assert res.exit_code == 0, res.stderr
    ok = [json.loads(x) for x in ok_path.read_text().splitlines()]
    bad = [json.loads(x) for x in err_path.read_text().splitlines()]
    assert sorted(d["custom_id"] for d in ok) == sorted(
        ["pdf-0"] * 2 + ["pdf-1"] * 2 + ["pdf-2"] * 2 + ["img-0", "img-1", "img-3"])
    assert [d["custom_id"] for d in bad] == ["img-2"] and bad[0]["error"]
    assert all(d["job_id"] in job_ids and d["text"] for d in ok)
    client = Client(redis_url)
    assert {r.custom_id for j in job_ids for r in client.job(j).results()} == {
        "pdf-0", "pdf-1", "pdf-2", "img-0", "img-1", "img-2", "img-3"}
    ocr_id = next(j["id"] for j in out["jobs"] if j["task"] == "ocr")
    md = run_cli("result", ocr_id, "--format", "md").stdout
    assert f"## {pdfs[1]} — page 2 (pdf-1)" in md
    items = json.loads(run_cli("result", ocr_id, "--format", "json").stdout)["items"]
    assert [i["custom_id"] for i in items] == ["pdf-0", "pdf-0", "pdf-1", "pdf-1", "pdf-2",
                                               "pdf-2"]
