"""`vlmq dashboard` in headless Chromium, with a real worker and the tiny model: the job
page shows the item texts and page 2's image, the overview draws, the console stays
empty, and a running job's progress advances on the page."""

from __future__ import annotations

import html
import io
import re
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from tests.support import helpers
from tests.support.helpers import finish, make_images, make_pdf
from vlmq.producer import Client, JobOptions
from vlmq.server.dashboard import browser
from vlmq.server.dashboard.screenshot import running_dashboard

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(browser.find_chromium() is None,
                                 reason="no Chromium (.ci/dev.py installs it as root)")]
FAST = JobOptions(max_side=112, max_tokens=6)


def visible_colors(png: Path) -> int:
    with Image.open(png) as im:
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20) or []
    total = sum(n for n, _ in colors)
    assert max(n for n, _ in colors) < 0.95 * total, "one colour covers the whole shot"
    return len(colors)


def test_the_console_check_sees_what_a_page_logs() -> None:
    seen = browser.dump_dom("data:text/html,<p>x</p><script>console.error('boom')</script>")
    assert any("boom" in line for line in seen.console), seen.console


def test_job_page_and_overview_in_a_browser(redis_url: str, tiny_model: Path, tmp_path: Path,
                                            procs) -> None:
    client = Client(redis_url)
    job = client.submit("ocr", [make_pdf(tmp_path / "doc.pdf", 3)], FAST)
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    assert job.status() == "finished"
    texts = [r.text or "" for r in job.results()]
    assert len(texts) == 3

    with running_dashboard(redis_url) as (base, _proc):
        seen = browser.dump_dom(f"{base}/jobs/{job.id}?item=1")
        assert seen.console == []
        dom = seen.stdout
        for text in texts:
            assert html.escape(text.strip()[:200], quote=False) in dom, text
        img = re.search(r'<img id="preview" src="([^"]+)" alt="([^"]+)"', dom)
        assert img is not None and img.group(1) == f"/jobs/{job.id}/items/1.png"
        assert img.group(2).endswith("page 2")
        with urllib.request.urlopen(base + img.group(1), timeout=60) as resp:
            png = resp.read()
        with Image.open(io.BytesIO(png)) as page:
            assert page.format == "PNG" and page.height > page.width  # a portrait page

        shot = tmp_path / "overview.png"
        seen = browser.screenshot(f"{base}/", shot)
        assert seen.console == []
        assert visible_colors(shot) > 20

        job_shot = tmp_path / "job.png"
        assert browser.screenshot(f"{base}/jobs/{job.id}?item=1", job_shot).console == []
        assert visible_colors(job_shot) > 50  # the rendered page is in it


def test_running_jobs_progress_advances_on_the_page(redis_url: str,
                                                    tiny_model: Path, tmp_path: Path,
                                                    procs) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 16)
    job = client.caption(images, options=JobOptions(max_side=112, max_tokens=128))
    with running_dashboard(redis_url) as (base, _proc):
        shown: list[int] = []
        misses: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if len(shown) == 1:  # the page has shown the queued job: now work on it
                procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path,
                                                  "--max-batch", "1"))
            seen = browser.dump_dom(f"{base}/jobs/{job.id}")
            assert seen.console == []
            m = re.search(r'<span id="job-done">(\d+)/16</span>', seen.stdout)
            if m is None:  # a dump cut short on a busy machine: look again
                misses.append(seen.stdout[-300:])
                assert len(misses) <= 5, misses
                continue
            shown.append(int(m.group(1)))
            if shown[-1] == 16:
                break
        assert shown[0] == 0 and shown == sorted(shown) and shown[-1] == 16, shown
        assert any(0 < n < 16 for n in shown), f"never saw a partial count: {shown}"
        assert len(set(shown)) >= 3, shown
