"""Screenshots of the dashboard, for the README: `python -m vlmq.server.dashboard.screenshot`.

Starts `vlmq dashboard` on a free local port against the given Redis, loads a job's page
(and the overview) in headless Chromium, writes PNGs, and stops the dashboard again.
With --enqueue-sample it first OCRs the bundled sample PDF (a worker must be running)
and captures that job, which is how docs/dashboard-job.png was made.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import click

from vlmq.server.dashboard import browser
from vlmq.shared import constants as C

START_TIMEOUT_S = 30.0
# The installed `vlmq` command, run by this interpreter (whose scripts folder may not be on
# PATH): found by its entry point, as an installer finds it, so a server names no CLI module.
_RUN_VLMQ = ("import sys; from importlib.metadata import entry_points; "
             "(vlmq,) = entry_points(group='console_scripts', name='vlmq'); "
             "sys.exit(vlmq.load()())")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_dashboard(redis_url: str, *extra: str, env: Mapping[str, str] | None = None,
                      log: Path | None = None
                      ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A `vlmq dashboard` process on a free port; yields its base URL and the process.
    `env` replaces its environment; `log` receives its output (else a pipe)."""
    port = free_port()
    cmd = [sys.executable, "-c", _RUN_VLMQ, "dashboard",
           "--redis-url", redis_url, "--port", str(port), *extra]
    sink = log.open("w") if log is not None else None
    proc = subprocess.Popen(cmd, stdout=sink or subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(base + "/jobs", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.communicate()[0] if proc.poll() is not None else ""
                    out = out or (log.read_text() if log is not None else "")
                    raise RuntimeError(f"vlmq dashboard did not start: {out}") from None
                time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        if sink is not None:
            sink.close()


@click.command()
@click.option("--redis-url", envvar="REDIS_URL", default=C.DEFAULT_REDIS_URL, show_default=True)
@click.option("--job", "job_id", default=None, help="Job whose page to capture.")
@click.option("--enqueue-sample", is_flag=True,
              help="OCR the bundled sample PDF first (needs a running worker), capture it.")
@click.option("--wait", "wait_s", type=click.FloatRange(1), default=600.0, show_default=True,
              help="How long --enqueue-sample waits for the job.")
@click.option("--item", type=click.IntRange(0), default=0, show_default=True,
              help="Item shown side by side.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("docs/dashboard-job.png"), show_default=True)
@click.option("--overview-out", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also capture the overview page here.")
@click.option("--settle", "settle_s", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Seconds to let the dashboard sample worker stats before the overview "
                   "shot (its throughput plot needs two samples, taken every 5 s).")
def main(redis_url: str, job_id: str | None, enqueue_sample: bool, wait_s: float, item: int,
         out: Path, overview_out: Path | None, settle_s: float) -> None:
    if enqueue_sample:
        job_id = _sample_job(redis_url, wait_s)
    if job_id is None:
        raise click.UsageError("give --job ID or --enqueue-sample")
    with running_dashboard(redis_url) as (base, _proc):
        shots = [(f"{base}/jobs/{job_id}?item={item}", out)]
        if overview_out is not None:
            shots.append((f"{base}/", overview_out))
        for url, path in shots:
            if path is overview_out:
                time.sleep(settle_s)
            seen = browser.screenshot(url, path)
            for line in seen.console:
                click.echo(f"console: {line}", err=True)
            click.echo(f"wrote {path}")


def _sample_job(redis_url: str, wait_s: float) -> str:
    from vlmq.producer.client import Client

    sample = Path(str(resources.files("vlmq.producer").joinpath("samples/document.pdf")))
    with Client(redis_url) as client:
        job = client.submit("ocr", [sample])
        click.echo(f"enqueued {job.id}; waiting for a worker to finish it", err=True)
        status = job.wait(timeout=wait_s)
        if status != "finished":
            raise click.ClickException(f"sample job {job.id} ended {status}")
        return job.id


if __name__ == "__main__":
    main()
