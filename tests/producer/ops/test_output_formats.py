"""One definition per output format: `vlmq result` and the dashboard's downloads give the
same bytes for the same job, in every state a job can be in, over a real Redis."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from flask.testing import FlaskClient
from redis import Redis

from tests.support.dashboard_data import CAPTIONS, Dataset, dataset
from vlmq.cli.main import main
from vlmq.producer.ops.output_formats import FORMATS
from vlmq.server.dashboard.app import Settings, create_app


@pytest.fixture
def data(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    with dataset(redis_url, redis, tmp_path) as d:
        yield d


def _cli(redis_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--redis-url", redis_url, "result", *args],
                              catch_exceptions=False)


def _cli_formats() -> set[str]:
    result = main.get_command(click.Context(main), "result")  # loaded on demand
    assert result is not None
    option = next(p for p in result.params if p.name == "fmt")
    assert isinstance(option.type, click.Choice)
    return {str(c) for c in option.type.choices}


def _dashboard_formats(web: FlaskClient, job_id: str) -> set[str]:
    page = web.get(f"/jobs/{job_id}").get_data(as_text=True)
    return set(re.findall(rf'href="/jobs/{job_id}/download\.(\w+)"', page))


def _download(web: FlaskClient, job_id: str, fmt: str) -> bytes:
    resp = web.get(f"/jobs/{job_id}/download.{fmt}")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert f'filename="{job_id}.{fmt}"' in resp.headers["Content-Disposition"]
    return resp.get_data()


def test_cli_and_dashboard_give_the_same_bytes_for_every_format(
        redis_url: str, data: Dataset) -> None:
    web = create_app(Settings(redis_url)).test_client()
    jobs = {"finished": data.finished, "failed": data.failed, "running": data.running,
            "queued": data.queued}
    both = _cli_formats() & _dashboard_formats(web, data.finished)
    assert {"md", "jsonl", "txt"} <= both
    for state, job_id in jobs.items():
        for fmt in sorted(both):
            res = _cli(redis_url, job_id, "--format", fmt)
            assert res.exit_code == (1 if state == "failed" else 0), res.output
            assert res.stdout_bytes == _download(web, job_id, fmt), (state, fmt)


def test_txt_is_the_texts_a_blank_line_apart_without_failed_items(
        redis_url: str, data: Dataset) -> None:
    web = create_app(Settings(redis_url)).test_client()
    assert _download(web, data.failed, "txt") == (CAPTIONS[0] + "\n\n").encode()
    res = _cli(redis_url, data.failed, "--format", "txt")
    assert "item 1 (img1.png) failed: image: cannot decode" in res.stderr
    # Several jobs: one after the other, as their downloads would be put together.
    for fmt in ("txt", "jsonl"):
        res = _cli(redis_url, data.finished, data.running, "--format", fmt)
        assert res.exit_code == 0, res.output
        assert res.stdout_bytes == (_download(web, data.finished, fmt)
                                    + _download(web, data.running, fmt))


def test_errors_file_splits_the_jsonl_download(redis_url: str, data: Dataset,
                                               tmp_path: Path) -> None:
    web = create_app(Settings(redis_url)).test_client()
    lines = _download(web, data.failed, "jsonl").decode().splitlines(keepends=True)
    errors = tmp_path / "errors.jsonl"
    res = _cli(redis_url, data.failed, "--errors", str(errors))
    assert res.exit_code == 1
    assert (res.stdout, errors.read_text()) == (lines[0], lines[1])


def test_every_format_is_documented_where_it_is_offered() -> None:
    text = " ".join(CliRunner().invoke(main, ["result", "--help"]).stdout.split())
    for name, form in FORMATS.items():
        assert form.summary and form.render.__doc__, name
        assert f"{name}: {form.summary}" in text, name
