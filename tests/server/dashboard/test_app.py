"""`vlmq dashboard` pages through Flask's test client over a real Redis: what each page
shows, bad requests, downloads, actions only when allowed, and that browsing never
writes to Redis."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis

from tests.support.dashboard_data import CAPTIONS, PAGE_TEXTS, Dataset, dataset, png_size
from tests.support.helpers import pdf_bytes
from vlmq.producer import Client
from vlmq.server.dashboard import markup
from vlmq.server.dashboard.app import Settings, create_app
from vlmq.server.dashboard.render import MAX_PX, RenderError, render
from vlmq.shared import constants as C
from vlmq.shared.keys import Keys


@pytest.fixture
def data(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    with dataset(redis_url, redis, tmp_path) as d:
        yield d


def web(redis_url: str, *, allow_actions: bool = False) -> FlaskClient:
    return create_app(Settings(redis_url, allow_actions=allow_actions)).test_client()


def text(resp) -> str:
    return resp.get_data(as_text=True)


def test_overview_shows_queues_states_and_the_workers_stats(redis_url: str,
                                                            data: Dataset) -> None:
    resp = web(redis_url).get("/")
    assert resp.status_code == 200
    page = text(resp)
    assert 'http-equiv="refresh"' in page
    for queue in ("ocr", "later"):
        assert f">{queue}</a>" in page
    for state in ("finished", "failed", "started", "queued"):
        assert re.search(rf"<b>1</b> {state}", page), state
    assert data.life.worker.name in page
    for figure in ("tiny", "12.5", "openblas", "<dd>42 s</dd>"):
        assert figure in page
    assert "Content-Security-Policy" in resp.headers


def test_throughput_plot_draws_the_sampled_history(redis_url: str, redis: Redis,
                                                   data: Dataset) -> None:
    app = create_app(Settings(redis_url))
    history = app.extensions["vlmq"]["history"]
    history.every_s = 0.0
    client = app.test_client()
    stats = Keys().worker_stats(data.life.worker.name)
    for rate in ("5.0", "30.0", "10.0"):
        redis.hset(stats, "tokens_per_s", rate)
        page = text(client.get("/"))
    points = re.search(r'<polyline[^>]*points="([^"]+)"', page)
    assert points is not None
    ys = [float(p.split(",")[1]) for p in points.group(1).split()]
    assert len(ys) == 3 and ys[1] < ys[2] < ys[0]  # 30 tok/s is drawn highest


def test_jobs_list_filters_by_queue_state_and_label(redis_url: str, data: Dataset) -> None:
    client = web(redis_url)

    def ids(query: str) -> set[str]:
        resp = client.get("/jobs" + query)
        assert resp.status_code == 200
        return set(re.findall(r'href="/jobs/([A-Za-z0-9_-]+)"', text(resp)))

    everything = {data.finished, data.failed, data.running, data.queued}
    assert ids("") == everything
    assert ids("?state=finished") == {data.finished}
    assert ids("?queue=later") == {data.queued}
    assert ids("?label=batch%3Ddec") == {data.failed}
    assert ids("?queue=ocr&state=started") == {data.running}
    page = text(client.get("/jobs?state=started"))
    assert '<progress value="1" max="3">' in page
    assert client.get("/jobs?label=nonsense").status_code == 400
    assert client.get("/jobs?queue=..%2Fx").status_code == 400


def test_job_page_shows_every_item_and_one_side_by_side(redis_url: str, data: Dataset) -> None:
    client = web(redis_url)
    resp = client.get(f"/jobs/{data.finished}?item=1")
    assert resp.status_code == 200
    page = text(resp)
    assert f'src="/jobs/{data.finished}/items/1.png"' in page
    assert "page 2" in page and 'rel="prev"' in page and 'rel="next"' in page
    assert "<table>\n<thead>\n<tr>\n<th>item</th>" in page  # page 2's markdown table
    assert "Ada Lovelace" in page and "Invoice 4711" in page
    assert "3/3</span> items done" in page and "not finished" not in page
    assert "http-equiv" not in page  # a finished job does not refresh
    assert "62 tokens" in page or "63 tokens" in page or "20 + " in page
    first = text(client.get(f"/jobs/{data.finished}"))
    assert "<strong>42.00 EUR</strong>" in first
    assert 'class="muted">← previous' in first


def test_model_output_is_escaped_and_loads_nothing(redis_url: str, data: Dataset) -> None:
    page = text(web(redis_url).get(f"/jobs/{data.finished}?item=2"))
    assert "<script" not in page
    assert "&lt;script&gt;alert" in page
    shown = page.split('id="item-text"')[1].split("</div>")[0]
    assert 'href="javascript' not in shown and "<img" not in shown
    html = markup.markdown("<b>x</b> [a](javascript:alert(1)) ![i](http://evil/i.png)")
    assert "<b>" not in html and 'href="javascript' not in html and "<img" not in html


def test_failed_and_running_jobs(redis_url: str, data: Dataset) -> None:
    client = web(redis_url)
    page = text(client.get(f"/jobs/{data.failed}?item=1"))
    assert "1 of 2 items failed" in page and "image: cannot decode" in page
    assert CAPTIONS[0] in page
    running = text(client.get(f"/jobs/{data.running}"))
    assert 'http-equiv="refresh"' in running and "1/3</span> items done" in running
    assert "pending" in running and "Cancel job" not in running  # read-only by default


def test_previews_are_capped_pngs(redis_url: str, data: Dataset) -> None:
    client = web(redis_url)
    resp = client.get(f"/jobs/{data.finished}/items/1.png")
    assert resp.status_code == 200 and resp.mimetype == "image/png"
    w, h = png_size(resp.data)
    assert max(w, h) <= MAX_PX and min(w, h) > 100
    image = client.get(f"/jobs/{data.failed}/items/0.png")
    assert image.status_code == 200 and png_size(image.data) == (96, 96)


def test_bad_requests_get_a_clear_page(redis_url: str, redis: Redis, data: Dataset) -> None:
    client = web(redis_url)
    cases = {
        "/jobs/nosuchjob": (404, "no job nosuchjob"),
        "/jobs/%3Cscript%3E": (400, "not a valid job id"),
        "/jobs/" + "a" * 200: (400, "not a valid job id"),
        f"/jobs/{data.finished}?item=7": (404, "has no item"),
        f"/jobs/{data.finished}?item=-1": (400, "not an item number"),
        f"/jobs/{data.finished}/items/9.png": (404, "has no item 9"),
        f"/jobs/{data.finished}/download.exe": (404, "no download format"),
        "/nothing-here": (404, "Not Found"),
    }
    for url, (code, message) in cases.items():
        resp = client.get(url)
        assert resp.status_code == code, url
        assert message in text(resp) and "Traceback" not in text(resp), url
    payload = Client(redis_url).job(data.finished).payload()
    redis.delete(Keys().blob(payload.items[0].blob))  # the input expired
    page = text(client.get(f"/jobs/{data.finished}"))
    assert "expired from Redis" in page and "items/0.png" not in page
    gone = client.get(f"/jobs/{data.finished}/items/0.png")
    assert gone.status_code == 404 and "gone from Redis" in text(gone)
    redis.hset(f"rq:job:{data.queued}", "data", b"\x80\x04garbage")  # pickled junk
    odd = client.get(f"/jobs/{data.queued}")
    assert odd.status_code == 200 and "Not a readable vlmq job" in text(odd)
    assert client.get(f"/jobs/{data.queued}/download.md").status_code == 409


def test_raw_jobs_no_reader_can_parse_get_a_clear_answer(redis_url: str, redis: Redis) -> None:
    """Written raw (HSET, RPUSH): data holding a 4,401-digit integer, and a job key stored
    as a list. Their page and download say why, never a 500."""
    client = web(redis_url)
    wire = json.dumps([C.TASK_FUNC, None, [{"v": 1, "task": "ocr", "max_side": 0}], {}])
    redis.hset("rq:job:huge", mapping={
        "data": wire.replace('"max_side": 0', '"max_side": 1' + "0" * 4400),
        "origin": "ocr", "status": "queued"})
    redis.rpush("rq:job:listed", "x")
    page = client.get("/jobs/huge")
    assert page.status_code == 200
    assert "holds a number of 4401 characters" in text(page), text(page)
    assert client.get("/jobs/huge/download.md").status_code == 409
    for url in ("/jobs/listed", "/jobs/listed/download.md", "/jobs/listed/items/0.png"):
        resp = client.get(url)
        assert resp.status_code == 409, url
        assert "its key rq:job:listed is a Redis list, not a job hash" in text(resp), url


def test_downloads(redis_url: str, data: Dataset) -> None:
    client = web(redis_url)
    md = client.get(f"/jobs/{data.finished}/download.md")
    assert md.status_code == 200
    assert f'filename="{data.finished}.md"' in md.headers["Content-Disposition"]
    assert "invoice.pdf — page 2\n" in text(md) and "Ada Lovelace" in text(md)
    lines = [json.loads(x) for x in text(client.get(f"/jobs/{data.finished}/download.jsonl"))
             .splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert {x["job_id"] for x in lines} == {data.finished}
    assert lines[1]["text"] == PAGE_TEXTS[1]
    txt = text(client.get(f"/jobs/{data.finished}/download.txt"))
    assert txt == "".join(t + "\n\n" for t in PAGE_TEXTS)  # as `vlmq result --format txt`


def test_actions_need_the_flag_and_the_form_token(redis_url: str, redis: Redis,
                                                  data: Dataset) -> None:
    readonly = web(redis_url)
    assert readonly.post(f"/jobs/{data.running}/cancel").status_code == 403
    assert redis.hget(f"rq:job:{data.running}", "status") == b"started"

    client = web(redis_url, allow_actions=True)
    page = text(client.get(f"/jobs/{data.running}"))
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None and "Cancel job" in page
    assert client.post(f"/jobs/{data.running}/cancel").status_code == 403  # no token
    assert client.post(f"/jobs/{data.running}/cancel", data={"csrf": token.group(1)},
                       headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.post(f"/jobs/{data.running}/cancel", data={"csrf": "x"}).status_code == 403
    assert redis.hget(f"rq:job:{data.running}", "status") == b"started"

    done = client.post(f"/jobs/{data.running}/cancel", data={"csrf": token.group(1)})
    assert done.status_code == 303
    assert redis.hget(f"rq:job:{data.running}", "status") == b"canceled"
    again = client.post(f"/jobs/{data.running}/cancel", data={"csrf": token.group(1)})
    assert again.status_code == 409 and "already canceled" in text(again)

    retry = client.post(f"/jobs/{data.failed}/retry-failed", data={"csrf": token.group(1)})
    assert retry.status_code == 303
    new_id = retry.headers["Location"].rsplit("/", 1)[1]
    new = Client(redis_url).job(new_id)
    assert new.items == 1 and new.labels["retry_of"] == data.failed


def _snapshot(redis: Redis) -> dict[bytes, object]:
    """Every key's content (not DUMP: a read may rehash a hash and reorder its dump)."""
    read = {b"string": redis.get, b"hash": lambda k: sorted(redis.hgetall(k).items()),
            b"list": lambda k: redis.lrange(k, 0, -1), b"set": lambda k: sorted(redis.smembers(k)),
            b"zset": lambda k: redis.zrange(k, 0, -1, withscores=True),
            b"stream": lambda k: redis.xrange(k)}
    return {k: (redis.type(k), read[redis.type(k)](k)) for k in sorted(redis.scan_iter())}


def test_browsing_never_writes_to_redis(redis_url: str, redis: Redis, data: Dataset) -> None:
    before = _snapshot(redis)
    client = web(redis_url)
    urls = ["/", "/jobs", "/jobs?state=failed", "/jobs?label=batch%3Dnov"]
    for job_id in (data.finished, data.failed, data.running, data.queued):
        urls += [f"/jobs/{job_id}", f"/jobs/{job_id}?item=1", f"/jobs/{job_id}/items/0.png",
                 f"/jobs/{job_id}/download.md", f"/jobs/{job_id}/download.jsonl",
                 f"/jobs/{job_id}/download.txt"]
    for url in urls:
        assert client.get(url).status_code == 200, url
    assert client.post(f"/jobs/{data.running}/cancel").status_code == 403
    assert _snapshot(redis) == before


def test_renderer_refuses_garbage_and_gives_up_on_time(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match="cannot render this pdf"):
        render(b"%PDF-1.4 not really", "pdf", 1)
    with pytest.raises(RenderError, match="has 2 pages, not 5"):
        render(pdf_bytes(2), "pdf", 5)
    with pytest.raises(RenderError, match="cannot render this image"):
        render(b"\x89PNG\r\n\x1a\nbroken", "image", None)
    with pytest.raises(RenderError, match="longer than"):
        render(pdf_bytes(2), "pdf", 1, timeout_s=0.01)


def test_a_giant_page_is_previewed_at_the_size_cap() -> None:
    import io

    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument.new()
    doc.new_page(14400, 200)  # PDF's largest page: 200 inches wide
    buf = io.BytesIO()
    doc.save(buf)
    doc.close()
    png = render(buf.getvalue(), "pdf", 1)
    assert max(png_size(png)) <= MAX_PX


def test_a_long_jobs_item_table_is_paged(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    from vlmq.server.dashboard.app import ITEMS_PER_PAGE

    pdf = tmp_path / "long.pdf"
    pdf.write_bytes(pdf_bytes(ITEMS_PER_PAGE + 5))
    job = Client(redis_url).submit("ocr", [pdf])
    client = web(redis_url)
    first = text(client.get(f"/jobs/{job.id}"))
    assert f'item={ITEMS_PER_PAGE - 1}">{ITEMS_PER_PAGE - 1}</a>' in first
    assert f'>{ITEMS_PER_PAGE}</a>' not in first and f"items {ITEMS_PER_PAGE}-" in first
    last = text(client.get(f"/jobs/{job.id}?item={ITEMS_PER_PAGE + 4}"))
    assert f'>{ITEMS_PER_PAGE + 4}</a>' in last and '">0</a>' not in last


def test_command_refuses_a_bad_url_and_an_unreachable_redis() -> None:
    from click.testing import CliRunner

    from vlmq.cli.main import main

    runner = CliRunner()
    bad = runner.invoke(main, ["dashboard", "--redis-url", "nope"])
    assert bad.exit_code == 2 and "invalid Redis URL 'nope'" in bad.stderr
    down = runner.invoke(main, ["dashboard", "--redis-url", "redis://127.0.0.1:1/0"])
    assert down.exit_code == 69  # EXIT_UNREACHABLE, as every command
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in down.stderr
    assert "Traceback" not in down.stderr
