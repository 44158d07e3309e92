"""`--model reader` and `--model tiny`: names a user can type, for every command.

Real Redis, real `vlmq` processes, each run from a directory outside the checkout (as a
user's shell would be), so a name that only worked beside the source tree, or that
fell through to the model hub (no network here), fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.helpers import VLMQ, Spawn, finish
from vlmq.cli.common import EXIT_CONFIG
from vlmq.cli.main import main
from vlmq.producer.client import Client
from vlmq.worker.model import names, reader
from vlmq.worker.model.reader import data
from vlmq.worker.model.reader.samples import sample_paths, sample_truth

pytestmark = pytest.mark.slow

MAX_CER = 0.10  # the reader's mean on its demo sample is about 1.4%


def elsewhere(tmp: Path) -> str:
    folder = tmp / "elsewhere"
    folder.mkdir(exist_ok=True)
    return str(folder)


def test_worker_model_reader_reads_the_demo_sample_outside_the_checkout(
        redis_url: str, tmp_path: Path, start_worker: Spawn) -> None:
    client = Client(redis_url)
    # The demo's own settings; model= also checks the job's id matches the name served.
    job = client.ocr(sample_paths(), max_side=reader.MAX_SIDE, max_tokens=96,
                     text_layer="off", result_cache="off", model=names.READER)
    rc, out = finish(start_worker(redis_url, names.READER, tmp_path, "--burst",
                                  cwd=elsewhere(tmp_path)), 300)
    assert rc == 0, out
    assert job.status() == "finished", job.error()
    truth = sample_truth()
    got = sorted(job.results(), key=lambda r: r.index)
    assert len(got) == len(truth) and all(r.error is None for r in got), got
    rates = [data.cer(r.text or "", truth[(Path(r.source).name, r.page or 0)]) for r in got]
    assert sum(rates) / len(rates) <= MAX_CER, [(r.text, rate) for r, rate in
                                                zip(got, rates, strict=True)]


def test_worker_model_tiny_is_built_into_the_cache_dir(
        redis_url: str, tmp_path: Path, start_worker: Spawn) -> None:
    page = tmp_path / "page.png"
    data.pages(1, 1)[0].image.save(page)
    job = Client(redis_url).caption([page], max_tokens=4, result_cache="off")
    rc, out = finish(start_worker(redis_url, names.TINY, tmp_path, "--burst",
                                  cwd=elsewhere(tmp_path)), 300)
    assert rc == 0, out
    assert job.status() == "finished", job.error()
    assert [r.error for r in job.results()] == [None]
    # start_worker's VLMQ_CACHE: the name builds where every command looks for it.
    assert (tmp_path / "cache" / "models" / "tiny-qwen2_vl" / "config.json").is_file()


def test_a_folder_named_reader_in_the_current_directory_wins(
        redis_url: str, tmp_path: Path, start_worker: Spawn) -> None:
    """The user's folder is loaded, not the shipped reader: this one holds no model, so
    the worker refuses it at start (a config error, not a hub lookup)."""
    cwd = elsewhere(tmp_path)
    (Path(cwd) / names.READER).mkdir()
    rc, out = finish(start_worker(redis_url, names.READER, tmp_path, "--burst", cwd=cwd), 120)
    assert rc == EXIT_CONFIG, out
    assert "model folder reader has no config.json" in out, out


def test_model_check_takes_a_name(tmp_path: Path) -> None:
    env = {**os.environ, "VLMQ_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([VLMQ, "model", "check", names.READER, "--json", "--max-tokens", "8",
                           "--max-batch", "2"], cwd=elsewhere(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["model"] == names.READER and report["parity"] is True, report


@pytest.mark.parametrize("command", [["worker"], ["demo"]])
def test_model_help_lists_the_names(command: list[str]) -> None:
    out = CliRunner().invoke(main, [*command, "--help"], terminal_width=200).output
    assert "reader" in out and "tiny" in out and "current directory wins" in out, out
