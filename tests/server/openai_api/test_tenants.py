"""`vlmq api` among strangers and several keys: a real `vlmq api` process (waitress on
127.0.0.1), real Redis, the official `openai` SDK where a client is involved and raw
sockets where the bytes on the wire are the point.

A request without a valid key is refused before its body is held (measured: the bytes
the server keeps in files while a keyless 150 MB upload is being sent); one key's uploads
are bounded in size, number and uploads at once; decoded images live as long as their
batch; a key sees only its own batches, by any id; an output whose results are gone is a
clear error, never a short body; deep JSON is a 400; weak keys are refused at start, wrong
keys are limited per client, models are shown by name, and an oversized body is refused
in OpenAI's error shape."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from redis import Redis

from tests.support import helpers
from tests.support import openai_api as T
from vlmq.producer.client import Client
from vlmq.producer.openai_files import submit_openai_batch
from vlmq.server.openai_api.access import KEYS_ENV, load_keys
from vlmq.server.openai_api.app import ApiSettings, create_app

# Keys enough that a test whose figures count per key (files kept, uploads at once, what
# a key sees) has its own.
KEYS = (*T.KEYS, "key-gamma-7391845", "key-delta-2846193", "key-omega-5017362")
MB = 1000 * 1000


@dataclass
class Served:
    base: str
    port: int
    proc: subprocess.Popen[str]
    files: Path
    redis_url: str
    output: list[str] = field(default_factory=list)
    clients: list[httpx.Client] = field(default_factory=list)  # closed at teardown

    def sdk(self, key: str) -> openai.OpenAI:
        """The SDK as a script uses it (no retries: each answer is the test's)."""
        http = httpx.Client(timeout=30)
        self.clients.append(http)
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0,
                             http_client=http)


def _serve(redis_url: str, files: Path, *args: str) -> Iterator[Served]:
    port = T.free_port()
    proc = T.start_api(redis_url, files, port, *args, keys=KEYS)
    served = Served(f"http://127.0.0.1:{port}/v1", port, proc, files, redis_url)

    def drain() -> None:  # the log, read as it comes so the pipe never fills
        assert proc.stdout is not None
        for line in proc.stdout:
            served.output.append(line)

    threading.Thread(target=drain, daemon=True).start()

    def up() -> bool:
        try:
            return httpx.get(served.base + "/models", timeout=2).status_code == 401
        except httpx.TransportError:
            assert proc.poll() is None, "".join(served.output)
            return False

    try:
        helpers.wait_for(up, 60, "vlmq api to answer")
        yield served
    finally:
        for http in served.clients:
            http.close()
        helpers.stop_all([proc])


@pytest.fixture(scope="module")
def api(module_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`vlmq api` with its default limits."""
    yield from _serve(module_redis_url, tmp_path_factory.mktemp("api") / "files")


# --- raw HTTP: what the server holds while a body is on its way --------------------------


def held_bytes(pid: int) -> int:
    """The bytes of the regular files `pid` holds open (temporary files included, deleted
    or not): where a server spools a body it is reading. 0 without /proc (macOS), where
    the bytes the client got onto the wire still show whether the server read on."""
    total = 0
    folder = Path(f"/proc/{pid}/fd")
    for fd in folder.iterdir() if folder.is_dir() else ():
        try:
            st = os.stat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


@dataclass
class Sent:
    status: int
    headers: dict[str, str]
    body: bytes
    sent: int  # body bytes the client got onto the wire before it stopped
    peak_held: int  # the most the server held in files meanwhile, over its baseline


def send_raw(served: Served, path: str, *, length: int, send: int,
             headers: dict[str, str] | None = None) -> Sent:
    """A POST announcing `length` body bytes, of which up to `send` are sent (1 MB at a
    time, in a thread), while the server's held bytes are sampled; then the answer."""
    baseline = held_bytes(served.proc.pid)
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=15)
    head = {"Host": f"127.0.0.1:{served.port}", "Content-Length": str(length),
            "Content-Type": "multipart/form-data; boundary=x", **(headers or {})}
    sock.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"".join(
        f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n")
    sent = [0]

    def body() -> None:
        chunk = b"x" * MB
        try:
            while sent[0] < send:
                sock.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            return  # the server closed: it refused the body

    sender = threading.Thread(target=body, daemon=True)
    sender.start()
    peak = 0
    while sender.is_alive():
        peak = max(peak, held_bytes(served.proc.pid) - baseline)
        time.sleep(0.01)
    time.sleep(0.3)  # what the server still holds once the client stopped sending
    peak = max(peak, held_bytes(served.proc.pid) - baseline)
    raw = b""
    try:
        while b"\r\n\r\n" not in raw or len(raw) < _answer_length(raw):
            got = sock.recv(65536)
            if not got:
                break
            raw += got
    except TimeoutError:
        pass
    finally:
        sock.close()
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0] else 0
    shown = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return Sent(status, shown, rest, sent[0], peak)


def _answer_length(raw: bytes) -> int:
    head, sep, _ = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + len(sep) + int(value)
    return len(raw) + 1


def openai_error(body: bytes) -> dict[str, Any]:
    """OpenAI's error shape, or AssertionError."""
    shown = json.loads(body)
    assert set(shown) == {"error"} and set(shown["error"]) == {"message", "type", "param",
                                                               "code"}, shown
    return dict(shown["error"])


def test_a_keyless_upload_is_refused_before_its_body_is_held(api: Served) -> None:
    for auth in ({}, {"Authorization": "Bearer not-a-key-of-this-server"}):
        got = send_raw(api, "/v1/files", length=150 * MB, send=40 * MB, headers=auth)
        print(f"keyless 150 MB upload ({auth or 'no key'}): sent {got.sent / MB:.0f} MB "
              f"before the server stopped reading; the server held at most "
              f"{got.peak_held / 1000:.0f} kB in files")
        assert got.peak_held < 256 * 1000, got.peak_held
        assert got.status == 401, got
        assert openai_error(got.body)["type"] == "invalid_request_error"
        assert got.sent < 40 * MB  # it stopped reading long before the end


def test_an_oversized_body_is_refused_in_openais_shape(api: Served) -> None:
    got = send_raw(api, "/v1/files", length=250 * MB, send=8 * MB,
                   headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert got.status == 413, got
    assert "200000000" in openai_error(got.body)["message"].replace(",", "")
    assert got.peak_held < 256 * 1000, got.peak_held
    # A JSON route takes 1 MB at most, refused as soon as its length says more.
    got = send_raw(api, "/v1/batches", length=5 * MB, send=5 * MB,
                   headers={"Authorization": f"Bearer {KEYS[0]}",
                            "Content-Type": "application/json"})
    assert got.status == 413 and got.peak_held < 256 * 1000, got
    openai_error(got.body)


def exchange(served: Served, head: str, body: bytes = b"") -> bytes:
    """A request's bytes as given (the body sent only after a first answer has had time
    to come), and everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(head.encode())
        sock.settimeout(1)
        got = b""
        with contextlib.suppress(TimeoutError):
            got = sock.recv(65536)
        if body:
            with contextlib.suppress(OSError):  # the server closed: it refused the body
                sock.sendall(body)
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def test_refusals_come_before_the_body_however_it_is_framed(api: Served) -> None:
    host = f"Host: 127.0.0.1:{api.port}\r\n"
    # A client that waits for 100 Continue is answered at once, and sends nothing.
    got = exchange(api, f"POST /v1/files HTTP/1.1\r\n{host}Content-Length: {150 * MB}\r\n"
                        "Expect: 100-continue\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in got, got[:200]
    openai_error(got.partition(b"\r\n\r\n")[2])
    # A chunked body: without a key, refused at its headers; with one, past 1 MiB of JSON.
    chunked = f"POST /v1/batches HTTP/1.1\r\n{host}Transfer-Encoding: chunked\r\n" \
              "Content-Type: application/json\r\n"
    got = exchange(api, chunked + "\r\n", b"100000\r\n" + b" " * 0x100000 + b"\r\n")
    assert got.startswith(b"HTTP/1.1 401 "), got[:200]
    body = b"".join(b"10000\r\n" + b" " * 0x10000 + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"
    got = exchange(api, chunked + f"Authorization: Bearer {KEYS[0]}\r\n\r\n", body)
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert "1,048,576" in openai_error(got.partition(b"\r\n\r\n")[2])["message"]
    # A foreign Host is 421 before the key is looked at (DNS rebinding), body unread.
    got = exchange(api, f"POST /v1/files HTTP/1.1\r\nHost: evil.example\r\nContent-Length: "
                        f"{150 * MB}\r\n\r\n", b"x" * (2 * MB))
    assert got.startswith(b"HTTP/1.1 421 "), got[:200]
    # A malformed request is refused in OpenAI's shape too, not waitress' plain text.
    got = exchange(api, f"GET /v1/models HTTP/1.1\r\n{host}Content-Length: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    openai_error(got.partition(b"\r\n\r\n")[2])


# --- one key's uploads: size, number and at once ------------------------------------------


@pytest.fixture(scope="module")
def tight(module_redis_url: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Served]:
    """`vlmq api` with small limits, to reach them cheaply."""
    yield from _serve(module_redis_url, tmp_path_factory.mktemp("tight") / "files",
                      "--max-upload-mb", "2", "--max-files-per-key", "3",
                      "--max-stored-gb-per-key", "0.004", "--max-uploads-per-key", "2")


def test_a_keys_uploads_are_bounded(tight: Served, tmp_path: Path) -> None:
    api = tight.sdk(KEYS[1])
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (2 * MB + 1))
    with pytest.raises(openai.APIStatusError) as refused:
        api.files.create(file=big, purpose="batch")
    assert refused.value.status_code == 413 and "2,000,000" in str(refused.value)
    small = T.batch_file(tmp_path / "small.jsonl", 2)
    made = [api.files.create(file=small, purpose="batch").id for _ in range(3)]
    with pytest.raises(openai.BadRequestError, match="3 files"):
        api.files.create(file=small, purpose="batch")
    api.files.delete(made.pop())
    made.append(api.files.create(file=small, purpose="batch").id)  # room again
    for file_id in made:
        api.files.delete(file_id)
    # Stored bytes: 4 MB a key here, so a third 1.5 MB file does not fit.
    mid = tmp_path / "mid.jsonl"
    mid.write_bytes(b"x" * (3 * MB // 2))
    kept = [api.files.create(file=mid, purpose="batch").id for _ in range(2)]
    with pytest.raises(openai.BadRequestError, match="4,000,000"):
        api.files.create(file=mid, purpose="batch")
    for file_id in kept:
        api.files.delete(file_id)
    # Two uploads at once a key: a third waits its turn (429), another key does not.
    auth = {"Authorization": f"Bearer {KEYS[2]}"}
    slow = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", tight.port), timeout=15)
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{tight.port}\r\n"
                     f"Authorization: {auth['Authorization']}\r\nContent-Length: "
                     f"{MB}\r\nContent-Type: multipart/form-data; boundary=x\r\n\r\n"
                     .encode() + b"x" * 1000)
        slow.append(sock)
    time.sleep(1)  # for the server to read their headers
    with pytest.raises(openai.RateLimitError, match="2 uploads"):
        tight.sdk(KEYS[2]).files.create(file=small, purpose="batch")
    api.files.delete(api.files.create(file=small, purpose="batch").id)
    for sock in slow:
        sock.close()

    def room() -> bool:
        try:
            tight.sdk(KEYS[2]).files.delete(
                tight.sdk(KEYS[2]).files.create(file=small, purpose="batch").id)
            return True
        except openai.RateLimitError:
            return False

    helpers.wait_for(room, 10, "the key's uploads to end with their connections")


# --- decoded images live as long as their batch -------------------------------------------


def settle(api: openai.OpenAI, batch_id: str, leave: tuple[str, ...]) -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status not in leave:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} stayed {leave}")


def create(api: openai.OpenAI, path: Path) -> tuple[str, str]:
    """(file id, batch id) of `path` uploaded and made a batch."""
    made = api.files.create(file=path, purpose="batch")
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    return made.id, batch.id


def images(served: Served) -> list[Path]:
    return sorted(p for p in (served.files / "images").rglob("*") if p.is_file())


def test_decoded_images_live_as_long_as_their_batch(api: Served, tmp_path: Path) -> None:
    sdk = api.sdk(KEYS[0])
    file_id, batch_id = create(sdk, T.batch_file(tmp_path / "in.jsonl", 4, images=3))
    assert settle(sdk, batch_id, ("validating",)).status == "in_progress"
    folder = api.files / "images" / batch_id
    assert len([p for p in folder.iterdir()]) == 3, images(api)  # one file an image
    sdk.files.delete(file_id)  # the running batch still needs them
    assert len(list(folder.iterdir())) == 3
    sdk.batches.cancel(batch_id)
    assert settle(sdk, batch_id, ("validating", "in_progress", "cancelling")
                  ).status == "cancelled"
    assert not folder.exists(), images(api)
    # A file that fails validation leaves none of the images its good lines decoded.
    bad = T.batch_file(tmp_path / "bad.jsonl", 6, images=5)
    with bad.open("a") as f:
        f.write(T.line("web", "https://example.com/x.png"))
    file_id, batch_id = create(sdk, bad)
    assert settle(sdk, batch_id, ("validating",)).status == "failed"
    sdk.files.delete(file_id)
    assert images(api) == []


# --- a key sees only its own, by any id ---------------------------------------------------


def test_a_key_sees_only_its_own_batches_by_any_id(api: Served, tmp_path: Path) -> None:
    owner, other = api.sdk(KEYS[3]), api.sdk(KEYS[4])
    file_id, batch_id = create(owner, T.batch_file(tmp_path / "in.jsonl", 3))
    settle(owner, batch_id, ("validating",))
    owner.batches.cancel(batch_id)
    ended = settle(owner, batch_id, ("in_progress", "cancelling"))
    assert ended.error_file_id is not None
    client = Client(api.redis_url)
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch_id), "vlmq_batch").decode()
    cli_batch, _ = submit_openai_batch(client, T.batch_file(tmp_path / "cli.jsonl", 2))
    for internal in (vlmq_batch, cli_batch.id):
        for sdk in (other, owner):  # the API's ids only, and only the owner's
            with pytest.raises(openai.NotFoundError):
                sdk.batches.retrieve(internal)
            with pytest.raises(openai.NotFoundError):
                sdk.batches.cancel(internal)
            for virtual in (f"file-out-{internal}", f"file-err-{internal}"):
                with pytest.raises(openai.NotFoundError):
                    sdk.files.retrieve(virtual)
                with pytest.raises(openai.NotFoundError):
                    sdk.files.content(virtual)
    for sdk in (other,):
        with pytest.raises(openai.NotFoundError):
            sdk.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(ended.error_file_id)
    assert owner.files.content(ended.error_file_id).text.count("\n") == 3
    owner.files.delete(file_id)
    client.close()


# --- an output whose results are gone ----------------------------------------------------


def test_an_output_whose_results_expired_is_a_clear_error(api: Served, tmp_path: Path
                                                          ) -> None:
    sdk = api.sdk(KEYS[0])
    file_id, batch_id = create(sdk, T.batch_file(tmp_path / "in.jsonl", 5))
    settle(sdk, batch_id, ("validating",))
    sdk.batches.cancel(batch_id)
    ended = settle(sdk, batch_id, ("in_progress", "cancelling"))
    assert ended.error_file_id is not None and ended.errors is None
    whole = sdk.files.content(ended.error_file_id).text
    assert whole.count("\n") == 5
    client = Client(api.redis_url)
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch_id), "vlmq_batch").decode()
    jobs = client.batch(vlmq_batch).job_ids()
    assert len(jobs) == 2  # the json_schema line is a job of its own
    # One job's results gone (as results expire before API records): never a short body.
    client.redis.delete(client.keys.rq_job(jobs[0]), client.keys.job_items(jobs[0]))
    with pytest.raises(openai.NotFoundError, match="expired") as refused:
        sdk.files.content(ended.error_file_id)
    assert refused.value.body is not None
    shown = sdk.batches.retrieve(batch_id)
    assert shown.errors is not None and shown.errors.data is not None
    assert [e.code for e in shown.errors.data] == ["results_expired"]
    # All of them gone: the same answer, not a 500.
    client.redis.delete(client.keys.batch(vlmq_batch), client.keys.batch_jobs(vlmq_batch),
                        *(client.keys.rq_job(j) for j in jobs))
    with pytest.raises(openai.NotFoundError, match="expired"):
        sdk.files.content(ended.error_file_id)
    assert not any("Traceback" in line for line in api.output), "".join(api.output)
    sdk.files.delete(file_id)
    client.close()


def test_results_gone_before_anyone_reads_say_so(api: Served, tmp_path: Path) -> None:
    sdk = api.sdk(KEYS[0])
    file_id, batch_id = create(sdk, T.batch_file(tmp_path / "in.jsonl", 2))
    settle(sdk, batch_id, ("validating",))
    sdk.batches.cancel(batch_id)
    ended = settle(sdk, batch_id, ("in_progress", "cancelling"))
    client = Client(api.redis_url)
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch_id), "vlmq_batch").decode()
    client.redis.delete(client.keys.batch(vlmq_batch))  # its results expired
    shown = sdk.batches.retrieve(batch_id)
    assert shown.status == ended.status == "cancelled"
    assert shown.errors is not None and shown.errors.data is not None
    assert shown.errors.data[0].code == "results_expired"
    assert "expired" in (shown.errors.data[0].message or "")
    listed = [b for b in sdk.batches.list() if b.id == batch_id]
    assert listed[0].errors is not None
    sdk.files.delete(file_id)
    client.close()


# --- deep JSON -----------------------------------------------------------------------------


def test_deeply_nested_json_is_a_400(api: Served) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"metadata": ' + b"[" * 50_000):
        resp = httpx.post(api.base + "/batches", content=body, timeout=30, headers={
            "Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "JSON" in openai_error(resp.content)["message"]
    assert not any("RecursionError" in line for line in api.output), "".join(api.output)
    assert api.sdk(KEYS[0]).batches.list().data is not None  # it goes on


# --- keys: strength, wrong ones, and what they see -------------------------------------


def test_weak_keys_are_refused_at_configuration(tmp_path: Path, redis_url: str) -> None:
    for weak in ("weakweak", "aaaaaaaaaaaaaaaaaaaaaaaa", "0123401234012340"):
        with pytest.raises(ValueError, match="too weak") as refused:
            load_keys(None, {KEYS_ENV: f"{KEYS[0]},{weak}"})
        assert weak not in str(refused.value)  # a key is never echoed
        with pytest.raises(ValueError, match="too weak"):
            create_app(ApiSettings(redis_url=redis_url, files_dir=tmp_path / "files",
                                   keys=(KEYS[0], weak)))
    assert load_keys(None, {KEYS_ENV: ",".join(KEYS)}) == list(KEYS)


def test_wrong_keys_are_limited_per_client(redis_url: str, tmp_path: Path) -> None:
    served = _serve(redis_url, tmp_path / "files")  # its own: it locks 127.0.0.1 out
    api = next(served)
    try:
        for _ in range(12):  # a request without a key is no guess
            assert httpx.get(api.base + "/models", timeout=5).status_code == 401
        guesser = api.sdk("key-guess-0000001")
        for _ in range(10):
            with pytest.raises(openai.AuthenticationError):
                guesser.models.list()
        with pytest.raises(openai.RateLimitError) as limited:
            guesser.models.list()
        assert 0 < int(limited.value.response.headers["Retry-After"]) <= 60
        # While it lasts, that address is refused unchecked, a right key too (as the
        # dashboard does: a guess that happened to be right must not be told so).
        with pytest.raises(openai.RateLimitError):
            api.sdk(KEYS[0]).models.list()
    finally:
        served.close()
    # Per address: another client is answered (the app asks the same gate).
    app = create_app(ApiSettings(redis_url=redis_url, files_dir=tmp_path / "in-process",
                                 keys=KEYS))
    http = app.test_client()
    for _ in range(11):
        http.get("/v1/models", headers={"Authorization": "Bearer key-guess-0000001"},
                 environ_base={"REMOTE_ADDR": "10.0.0.1"})
    right = {"Authorization": f"Bearer {KEYS[0]}"}
    assert http.get("/v1/models", headers=right,
                    environ_base={"REMOTE_ADDR": "10.0.0.1"}).status_code == 429
    assert http.get("/v1/models", headers=right,
                    environ_base={"REMOTE_ADDR": "10.0.0.2"}).status_code == 200
    app.extensions["vlmq_api"]["client"].close()


def test_models_are_shown_by_name_not_by_local_path(api: Served) -> None:
    redis = Redis.from_url(api.redis_url)
    client = Client(api.redis_url)
    redis.sadd(client.keys.workers, "w-path", "w-hub")
    redis.hset(client.keys.worker_stats("w-path"), "model", "/home/ops/models/secret-tiny")
    redis.hset(client.keys.worker_stats("w-hub"), "model", "mlx-community/Qwen2-VL-2B")
    try:
        names = sorted(m.id for m in api.sdk(KEYS[0]).models.list())
        assert names == ["mlx-community/Qwen2-VL-2B", "secret-tiny"], names
    finally:
        redis.srem(client.keys.workers, "w-path", "w-hub")
        redis.close()
        client.close()


def test_the_limits_table_is_the_documented_one() -> None:
    from vlmq.server.openai_api.limits import doc_table

    page = (Path(__file__).resolve().parents[3] / "docs" / "openai-api.md").read_text()
    assert doc_table() in page, "docs/openai-api.md's limits table differs from LIMITS"
