"""What a new user hit, each pinned: help texts, one queue form,
ocr's --skip-bad/--recursive, retention options, progress without a TTY, unserved queues."""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.core import UNSET
from PIL import Image
from redis import Redis
from rq.job import JobStatus
from rq.results import Result

from tests.support.helpers import pdf_bytes
from tests.support.lua_calls import write_items
from vlmq.cli.worker import worker_cmd
from vlmq.producer import Client, JobOptions
from vlmq.shared import constants as C
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.enqueue import fetch_job
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult
from vlmq.worker.options import BY_NAME


def png(path: Path, color: tuple[int, int, int] = (10, 200, 30)) -> Path:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, "PNG")
    path.write_bytes(buf.getvalue())
    return path


def test_worker_help_shows_one_queue_form(run_cli) -> None:
    text = run_cli("worker", "--help").stdout
    assert "EXTRA_QUEUES" not in text and "Usage: main worker [OPTIONS]\n" in text
    queues = next(p for p in worker_cmd.params if p.name == "queues")
    assert isinstance(queues, click.Option) and queues.opts == ["--queues"]
    assert queues.help == BY_NAME["queues"].help and queues.metavar == "Q1,Q2,..."
    assert "--queues Q1,Q2,..." in text


def test_generate_help_says_prompt_is_required_without_a_default(run_cli) -> None:
    text = " ".join(run_cli("enqueue", "generate", "--help").stdout.split())
    assert "--prompt TEXT Prompt text. [required]" in text
    assert "default: the model's own" not in text.split("--prompt")[1].split("--model")[0]


def help_pages() -> Iterator[tuple[list[str], click.Command, str]]:
    """Every command and subcommand under the root group, with its --help as printed."""
    from click.testing import CliRunner

    from vlmq.cli.main import main

    def walk(path: list[str], command: click.Command) -> Iterator[tuple[list[str],
                                                                       click.Command, str]]:
        res = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
        assert res.exit_code == 0, (path, res.output)
        yield path, command, res.output
        if isinstance(command, click.Group):
            with click.Context(command) as ctx:
                for name in command.list_commands(ctx):
                    sub = command.get_command(ctx, name)
                    assert sub is not None, name
                    yield from walk([*path, name], sub)

    yield from walk([], main)


def option_rows(text: str) -> list[list[str]]:
    """The flags of each row of a help page's Options section (a row starts at column 2;
    its help's wrapped lines start further in)."""
    section = text.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]
    heads = [re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
             for line in section.splitlines() if re.match(r"  -", line)]
    return [[w for w in re.split(r"[ ,/]+", head) if w.startswith("-")] for head in heads]


def test_every_help_page_states_each_option_once_with_its_choices_and_default() -> None:
    pages = list(help_pages())
    assert {"enqueue", "enqueue ocr", "worker", "model make-tiny"} <= {
        " ".join(path) for path, _, _ in pages}
    for path, command, text in pages:
        where = " ".join(["vlmq", *path])
        flat = " ".join(text.split())
        assert "(required). [required]" not in flat, where
        flags = [flag for row in option_rows(text) for flag in row]
        assert len(flags) == len(set(flags)), (where, sorted(f for f in flags
                                                              if flags.count(f) > 1))
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            assert set(param.opts) <= set(flags), (where, param.opts)
            if isinstance(param.type, click.Choice):
                shown = "|".join(map(str, param.type.choices))
                assert shown in flat, (where, param.opts, "choices not shown")
            has_default = not param.is_flag and param.default not in (None, (), UNSET)
            if has_default and not param.show_default:
                assert "default" in (param.help or "").lower(), (where, param.opts)


def test_text_layer_shows_its_choices(run_cli) -> None:
    text = " ".join(run_cli("enqueue", "ocr", "--help").stdout.split())
    assert "--text-layer [off|fallback|prefer]" in text


def test_caption_help_says_pdfs_are_captioned_page_by_page(run_cli) -> None:
    text = " ".join(run_cli("enqueue", "caption", "--help").stdout.split())
    assert "A PDF is captioned page by page" in text


def test_ocr_takes_skip_bad_and_recursive(run_cli, redis_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "scans"
    (folder / "deep").mkdir(parents=True)
    (folder / "deep" / "doc.pdf").write_bytes(pdf_bytes(2))
    png(folder / "page.png")
    (folder / "broken.png").write_bytes(b"not an image")
    res = run_cli("enqueue", "ocr", str(folder), "--recursive")
    assert res.exit_code == 2 and "broken.png" in res.stderr
    res = run_cli("enqueue", "ocr", str(folder), "--recursive", "--skip-bad")
    assert res.exit_code == 0, res.stderr
    assert "skipped" in res.stderr and "broken.png" in res.stderr
    job_id = res.stdout.strip()
    items = Client(redis_url).job(job_id).payload().items
    assert sorted((Path(i.source).name, i.page) for i in items) == [
        ("doc.pdf", 1), ("doc.pdf", 2), ("page.png", None)]


def test_result_and_blob_ttl_are_set_per_job(run_cli, redis: Redis, tmp_path: Path) -> None:
    img = png(tmp_path / "a.png")
    res = run_cli("enqueue", "caption", str(img), "--result-ttl", "3600", "--blob-ttl", "7200")
    assert res.exit_code == 0, res.stderr
    job_id = res.stdout.strip()
    assert fetch_job(redis, job_id).result_ttl == 3600
    assert 7100 < redis.ttl(Keys().blob(sha256_hex(img.read_bytes()))) <= 7200
    # Defaults are the documented 7 days.
    other = png(tmp_path / "b.png", (1, 2, 3))
    job_id = run_cli("enqueue", "caption", str(other)).stdout.strip()
    assert fetch_job(redis, job_id).result_ttl == C.RESULT_TTL_S
    assert redis.ttl(Keys().blob(sha256_hex(other.read_bytes()))) > C.BLOB_TTL_S - 100
    res = run_cli("enqueue", "caption", str(img), "--result-ttl", "0")
    assert res.exit_code == 2 and "--result-ttl" in res.stderr
    with pytest.raises(PayloadError, match="blob_ttl: must be between 1 and"):
        JobOptions(blob_ttl=-5)


def test_enqueue_warns_when_no_worker_serves_the_queue(run_cli, redis: Redis,
                                                       tmp_path: Path) -> None:
    img = png(tmp_path / "a.png")
    res = run_cli("enqueue", "caption", str(img), "--queue", "nobody")
    assert res.exit_code == 0
    assert "warning: no live worker serves queue 'nobody'" in res.stderr
    redis.sadd("rq:workers:served", "w1")  # what a live RQ worker registers
    res = run_cli("enqueue", "caption", str(img), "--queue", "served")
    assert res.exit_code == 0 and "warning" not in res.stderr


def test_wait_timeout_names_the_unserved_queue(run_cli, tmp_path: Path) -> None:
    job_id = run_cli("enqueue", "caption", str(png(tmp_path / "a.png")), "--queue",
                 "lonely").stdout.strip()
    res = run_cli("wait", job_id, "--timeout", "0.5")
    assert res.exit_code == 124
    assert "no live worker serves queue(s) lonely" in res.stderr


def test_wait_without_a_tty_prints_progress_lines(run_cli, redis: Redis, tmp_path: Path) -> None:
    doc = tmp_path / "doc.pdf"
    doc.write_bytes(pdf_bytes(4))
    job_id = run_cli("enqueue", "ocr", str(doc)).stdout.strip()
    keys = Keys()

    def work() -> None:
        for i in range(4):
            time.sleep(0.3)
            write_items(redis, keys, job_id, ItemResult(
                index=i, source=str(doc), page=i + 1, text="t", finish_reason="stop",
                prompt_tokens=1, completion_tokens=1, vision_cache_hit=False, error=None))
        job = fetch_job(redis, job_id)
        Result.create(job, Result.Type.SUCCESSFUL, ttl=60, return_value={"items": 4})
        job.set_status(JobStatus.FINISHED)

    thread = threading.Thread(target=work)
    thread.start()
    res = run_cli("wait", job_id, "--timeout", "30")
    thread.join()
    assert res.exit_code == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("items ")]
    # CliRunner's stderr is not a TTY: one line per 10 % step seen, ending at 100 %.
    assert len(lines) >= 3 and lines[-1].startswith("items 4/4 (100%)"), res.stderr
    assert f"{job_id}: finished" in res.stdout


def test_readme_first_ocr_example_runs_on_the_bundled_sample(run_cli, redis_url: str) -> None:
    """The first OCR example on the bundled sample: in docs/jobs.md since the README
    starts with the quickstart (which tests/project/test_docs_commands.py runs)."""
    import shlex

    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", root / "docs" / "jobs.md"]
    line = next(ln for page in pages for ln in page.read_text(encoding="utf-8").splitlines()
                if ln.startswith("vlmq enqueue ocr producer/samples/"))
    args = shlex.split(line.split("#")[0])[1:]
    args = [str(root / a) if a.startswith("producer/samples/") else a for a in args]
    res = run_cli(*args)
    assert res.exit_code == 0, res.stderr
    job = Client(redis_url).job(res.stdout.strip())
    assert [i.page for i in job.payload().items] == [1, 2, 3]
    assert job.labels == {"batch": "nov"}


def test_a_shorter_blob_ttl_never_cuts_a_longer_one(run_cli, redis: Redis, tmp_path: Path) -> None:
    from vlmq.shared.blobs import BlobStore

    img = png(tmp_path / "a.png")
    key = Keys().blob(sha256_hex(img.read_bytes()))
    month = 30 * 86400
    assert run_cli("enqueue", "caption", str(img), "--blob-ttl", str(month)).exit_code == 0
    assert run_cli("enqueue", "caption", str(img), "--blob-ttl", "60").exit_code == 0
    BlobStore(redis, Keys()).touch(sha256_hex(img.read_bytes()))  # a worker's default touch
    assert redis.ttl(key) > month - 100
    assert run_cli("enqueue", "caption", str(img), "--blob-ttl", str(2 * month)).exit_code == 0
    assert redis.ttl(key) > 2 * month - 100  # a longer one extends it
    assert not BlobStore(redis, Keys()).touch("ab" * 32)  # missing: falsy, nothing created
    assert not redis.exists(Keys().blob("ab" * 32))
