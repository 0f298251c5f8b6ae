"""common/remote.py fails closed, at both ends of a served reward. The server (serve()) live on 127.0.0.1 with the
cheap `jpeg` and `verifier` rewards and one that breaks, asked with raw sockets for what no client library sends (a
stall, a lying Content-Length, a non-ASCII token): every bad request gets its 4xx and reason, or is dropped after the
read timeout, and the server goes on serving the others. The client (request_json, Served) against a fake server
whose answers go wrong in every way: what may pass is retried, the rest stops the run with a RunError naming the URL
and what was wrong, never a traceback or a made-up score."""

import base64
import inspect
import io
import json
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from common import InputError, RunError, remote
from common.rewards import REWARDS
from common.shapesbench import sample_batch
from tests.helpers import ROOT

TIMEOUT = 1.0  # the test server's read timeout (10 s in `python -m common.rewards serve`)
DEADLINE = 2.0  # its --request-deadline (60 s)
CONNECTIONS = 4  # its --max-connections (16)
CAP_MB = 0.5  # its --max-mb
SHAPES_PROMPT = "a red circle on a blue background"


def serve_on_a_thread(server) -> str:
    # polled every 0.05 s, not 0.5: shutdown() waits for the poll, and most tests here stop a server of their own
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


@pytest.fixture(scope="module")
def rewards():
    return {"jpeg": REWARDS["jpeg"].factory("cpu"), "verifier": REWARDS["verifier"].factory("cpu")}


@pytest.fixture
def server(rewards):
    """jpeg, verifier and boom (a reward that raises RuntimeError); token 'secret', 4 images and 3 of 32x32 pixels
    a request at most, prompts of 100 characters, 4 connections at once, each request whole within 2 s. A server of
    its own for each test (a bind and a thread): no test sees what another left, and serve() is called inside each
    test that uses it, so that a mutation tool sees which tests reach it (benchmarks/testing/mutation.py)."""

    def score(name, images, prompts):
        if name == "boom":
            raise RuntimeError("the scorer broke\nand said more")
        return rewards[name](images, prompts)

    names = ["jpeg", "verifier", "boom"]
    limits = dict(max_batch=4, max_mb=CAP_MB, max_pixels=3 * 32 * 32, read_timeout=TIMEOUT, max_prompt_chars=100,
                  max_connections=CONNECTIONS, request_deadline=DEADLINE)  # fmt: skip
    httpd = remote.serve(score, names, "127.0.0.1", 0, token="secret", **limits)
    url = serve_on_a_thread(httpd)
    yield url
    httpd.shutdown()
    httpd.server_close()


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def png(size: int = 32, colour=(255, 0, 0), fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format=fmt)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels: its signature, its IHDR chunk and a token IDAT chunk (a real
    decompression bomb has a few KB of zlib there, that unpack to all those pixels)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return remote._PNG_MAGIC + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")


def body(images: list[bytes], reward: str = "jpeg", prompts: list[str] | None = None) -> bytes:
    items = [{"png": base64.b64encode(x).decode()} for x in images]
    return json.dumps({"reward": reward, "prompts": prompts or ["p"] * len(images), "images": items}).encode()


def request(data: bytes | None = None, method: str = "POST", path: str = "/score", **headers) -> bytes:
    """Raw HTTP/1.1 bytes: the token, JSON and the body's length unless `headers` say otherwise (None: left out;
    a header's name with _ for -). Header values are sent UTF-8 encoded, as they are."""
    fields = {"Authorization": "Bearer secret", "Content-Type": "application/json"}
    fields |= {} if data is None else {"Content-Length": str(len(data))}
    fields |= {k.replace("_", "-"): v for k, v in headers.items()}
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"] + [f"{k}: {v}" for k, v in fields.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (data or b"")


def read_answer(sock: socket.socket) -> tuple[int | None, dict | None]:
    """(status, JSON body) of the answer on `sock`, or (None, None) if the server closed it without one. Each recv
    waits at most the socket's timeout (TimeoutError: the test fails)."""
    data = b""
    while True:
        head, found, rest = data.partition(b"\r\n\r\n")
        if found:
            length = int(re.search(rb"Content-Length: *(\d+)", head, re.I).group(1))
            if len(rest) >= length:
                return int(head.split()[1]), json.loads(rest[:length])
        chunk = sock.recv(1 << 16)
        if not chunk:
            assert not data, data  # closed mid-answer
            return None, None
        data += chunk


def ask(url: str, raw: bytes, wait: float = 5.0) -> tuple[int | None, dict | None]:
    """(status, JSON body) of `raw` sent on a new connection. A 503 is asked again for up to 5 s, as the real
    client does (remote.RETRIED): the server counts a connection open until its thread has seen the close, which
    on a loaded machine lags the client's close by a scheduling slice, so a quick run of requests can meet the
    limit for a moment. The tests of the 503 itself read their answer without this."""
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", port(url)), timeout=wait) as sock:
            sock.sendall(raw)
            status, answer = read_answer(sock)
        if status not in (429, 503):
            return status, answer
        time.sleep(0.05)
    return status, answer


def scores_of(url: str, images: list[bytes], **kwargs) -> list[float]:
    status, answer = ask(url, request(body(images, **kwargs)))
    assert status == 200, answer
    return answer["scores"]


# ---------------------------------------------------------------- the server
def test_a_stalled_client_holds_no_one_else_and_gets_a_408_after_the_read_timeout(server, capsys):
    stalled_body = socket.create_connection(("127.0.0.1", port(server)), timeout=TIMEOUT + 3)
    stalled_body.sendall(request(Content_Length="100"))  # headers, then silence: 100 bytes never come
    stalled_headers = socket.create_connection(("127.0.0.1", port(server)), timeout=TIMEOUT + 3)
    stalled_headers.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    sent = time.monotonic()
    client = remote.Served("jpeg", server, token="secret")  # GET /health
    scores = client(torch.rand(2, 3, 32, 32), ["a", "b"])
    assert scores.shape == (2,) and bool((scores < 0).all())  # minus the JPEG's kB
    assert time.monotonic() - sent < 2.0
    for stalled in (stalled_body, stalled_headers):
        status, answer = read_answer(stalled)
        assert status == 408 and answer["error"].endswith(f"stopped arriving for {TIMEOUT:g} s"), answer
    assert TIMEOUT * 0.9 < time.monotonic() - sent < TIMEOUT + 2.0
    stalled_body.close()
    stalled_headers.close()
    assert len(scores_of(server, [png()])) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_pixels_are_counted_from_each_png_header_before_anything_is_decoded(server):
    # 9000x9000 (243 MB of RGB) in 78 bytes: refused from its header (it would not decode: a 400 then)
    started = time.monotonic()
    status, answer = ask(server, request(body([png_header(9000, 9000)])))
    assert status == 413 and "images[0] is 9000x9000, more than 3,072 pixels" in answer["error"], answer
    assert time.monotonic() - started < 1.0
    status, answer = ask(server, request(body([png()] * 4)))  # 4 of 32x32: each fits, not all together
    assert status == 413 and "4,096 pixels in all, more than 3,072" in answer["error"], answer
    assert len(scores_of(server, [png()] * 3)) == 3
    # PIL's own cap (Image.MAX_IMAGE_PIXELS) stands behind ours, and is a refusal of the same kind
    with pytest.raises(remote._TooManyPixels, match="decompression bomb"):
        remote.decode_images([{"png": base64.b64encode(png_header(20_000, 20_000)).decode()}])


def test_an_image_that_is_not_a_readable_png_is_a_400_with_the_reason(server, capsys):
    cases = [
        (body([png(fmt="JPEG")]), "'png' holds a JPEG, not a PNG"),
        (body([png()[:60]]), "images[0]: not a readable PNG"),  # cut short: the header is there, the pixels not
        (body([b"just some text"]), "bytes starting 6a 75 73 74"),
        (json.dumps({"reward": "jpeg", "prompts": ["p"], "images": [{"png": "@@@"}]}).encode(), "is not base64"),
        (json.dumps({"reward": "jpeg", "prompts": ["p"], "images": [{"png": 7}]}).encode(), "is not base64"),
        (body([png(), png(16)]), "images of different sizes"),
    ]
    for data, reason in cases:
        status, answer = ask(server, request(data))
        assert status == 400 and reason in answer["error"], (reason, status, answer)
    assert len(scores_of(server, [png()])) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_malformed_http_is_refused_with_the_reason_and_a_lying_length_is_dropped(server, capsys):
    good = body([png()])
    cases = [
        (request(good, Content_Length="abc"), 400, "Content-Length must be one number of bytes, not 'abc'"),
        (request(good, Content_Length="-5"), 400, "not '-5'"),
        (request(good, Content_Length=None), 411, "needs a Content-Length"),
        (request(good, Transfer_Encoding="chunked"), 411, "no Transfer-Encoding"),
        (request(b""), 400, "an empty body"),
        (request(good, Content_Type="text/plain"), 415, "not 'text/plain'"),
        (request(good, Content_Type=None), 415, "application/json, not 'none'"),
        (request(b"[" * 200_000), 400, "nested too deep"),
        (request(b"[1, 2]"), 400, "must be a JSON object"),
        (request(b"not json"), 400, "JSONDecodeError"),
        (request(good, path="/score/../etc"), 404, "POST /score"),
        (request(method="GET", path="/nope"), 404, "GET /health"),
        (request(good, method="PUT"), 501, "Unsupported method ('PUT')"),
        (b"GET /a b HTTP/1.1\r\n\r\n", 400, "Bad request syntax"),  # http.server's own refusal, in JSON too
    ]
    for raw, code, reason in cases:
        status, answer = ask(server, raw)
        assert status == code and reason in answer["error"], (raw[:80], status, answer)
    status, answer = ask(server, request(good, Content_Type="application/json; charset=utf-8"))
    assert status == 200 and len(answer["scores"]) == 1
    # a Content-Length longer than the body: answered once the rest has not come for the read timeout
    started = time.monotonic()
    status, answer = ask(server, request(good, Content_Length=str(len(good) + 100)))
    assert status == 408 and time.monotonic() - started < TIMEOUT + 2.0
    assert len(scores_of(server, [png()])) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_body_over_the_cap_gets_a_413_the_client_reads(server):
    # sent whole by urllib before it reads: the server reads and drops it (up to twice the cap) to be heard
    over = b" " * int(CAP_MB * 1e6 * 1.5)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer secret"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(f"{server}/score", over, headers), timeout=10)
    assert refused.value.code == 413 and "1 byte to 0.5 MB, not 750,000" in json.loads(refused.value.read())["error"]
    # far over (past twice the cap): answered at once from the Content-Length, and the connection closed
    status, answer = ask(server, request(Content_Length="10000000"))
    assert status == 413 and "not 10,000,000" in answer["error"]
    assert len(scores_of(server, [png()])) == 1


def test_the_rewards_own_refusal_is_a_422_and_its_failure_a_500_and_both_leave_it_serving(server, capsys):
    status, answer = ask(server, request(body([png()], "verifier", ["a cat"])))
    assert status == 422 and "verifier: ValueError: not a ShapesBench prompt: 'a cat'" in answer["error"], answer
    assert "Traceback" not in capsys.readouterr().err
    images, prompts = sample_batch(2, torch.Generator().manual_seed(0), [SHAPES_PROMPT])  # the world's own renders
    assert remote.Served("verifier", server, token="secret")(images, prompts).tolist() == [1.0, 1.0]
    status, answer = ask(server, request(body([png()], "boom")))
    assert (status, answer) == (500, {"error": "boom: RuntimeError: the scorer broke"})
    assert "RuntimeError: the scorer broke" in capsys.readouterr().err  # the operator's trace, on the server's side
    assert len(scores_of(server, [png()])) == 1


def test_the_token_is_checked_as_bytes_and_bearer_in_any_case(server, capsys):
    for authorization, code in [
        (None, 401),
        ("Bearer wrong", 401),
        ("Basic secret", 401),
        ("Bearer secret2", 401),
        ("Bearer s\u00e9cret", 401),  # UTF-8 bytes c3 a9: compared as bytes, no crash
        ("Bearer \u2603", 401),
        ("bearer secret", 200),
        ("BEARER  secret ", 200),
    ]:
        status, answer = ask(server, request(method="GET", path="/health", Authorization=authorization))
        assert status == code, (authorization, answer)
        expected = {"rewards": ["jpeg", "verifier", "boom"]}
        assert answer == expected if code == 200 else "wrong token" in answer["error"], (authorization, answer)
    status, answer = ask(server, b"GET /health HTTP/1.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")  # not UTF-8 at all
    assert status == 401
    assert "Traceback" not in capsys.readouterr().err
    # a non-ASCII token works end to end: the client sends it UTF-8 encoded, the server compares those bytes
    other = remote.serve(lambda n, im, p: im.mean((1, 2, 3)), ["bright"], "127.0.0.1", 0, token="s\u00e9cret")
    url = serve_on_a_thread(other)
    assert remote.Served("bright", url, token="s\u00e9cret")(torch.ones(1, 3, 8, 8), ["p"]).tolist() == [1.0]
    with pytest.raises(RunError, match=f"{url}/health failed after 1 tries \\(HTTP 401: .*wrong token"):
        remote.Served("bright", url, token="secret")
    other.shutdown()
    other.server_close()


def trickle(url: str, at_once: bytes, slowly: bytes, every: float = 0.25, limit: float = 6.0):
    """Send `at_once`, then `slowly` a byte every `every` seconds (never a read timeout's pause), until the server
    answers or closes: (status, JSON body, seconds from the first byte). At most `limit` seconds."""
    with socket.create_connection(("127.0.0.1", port(url)), timeout=limit) as sock:
        started = time.monotonic()
        sock.sendall(at_once)
        for k in range(len(slowly)):
            if select.select([sock], [], [], every)[0] or time.monotonic() - started > limit:
                break  # an answer (or the close) is waiting
            sock.sendall(slowly[k : k + 1])
        status, answer = read_answer(sock)
        return status, answer, time.monotonic() - started


def test_a_request_trickling_in_gets_a_408_at_its_deadline_not_after_each_read(server, capsys):
    # a byte every 0.25 s never lets a read wait the read timeout (1 s): the deadline from the connection (2 s)
    # ends it, in its headers or in its body, on its own thread while the server serves others
    whole = request(body([png()]))
    head = whole[: whole.index(b"\r\n\r\n") + 4]
    answers = {}
    threads = [
        threading.Thread(target=lambda: answers.update(headers=trickle(server, b"", whole))),
        threading.Thread(target=lambda: answers.update(body=trickle(server, head, whole[len(head) :]))),
    ]
    for t in threads:
        t.start()
    assert len(scores_of(server, [png()])) == 1
    for t in threads:
        t.join()
    for name, (status, answer, seconds) in answers.items():
        assert status == 408 and answer["error"].endswith(f"did not arrive whole within {DEADLINE:g} s "
                                                          "(--request-deadline)"), (name, answer)  # fmt: skip
        assert DEADLINE - 0.05 < seconds < DEADLINE + 1.0, (name, seconds)  # not 6 s: the trickle's end
    assert "Traceback" not in capsys.readouterr().err


def test_a_request_that_goes_quiet_inside_the_last_read_timeout_gets_its_408_at_the_deadline(server):
    # body bytes every 0.2 s up to 0.2 s before the deadline (2 s), then nothing: the last read may wait only what
    # is left of the deadline, not a whole read timeout (1 s), which would answer 0.8 s late
    whole = request(body([png()]))
    head = whole.index(b"\r\n\r\n") + 4
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(whole[:head])
        for k in range(head, len(whole) - 1):
            if time.monotonic() - started > DEADLINE - 0.15:
                break
            sock.sendall(whole[k : k + 1])
            quiet = time.monotonic() - started  # the last byte sent
            time.sleep(0.2)
        status, answer = read_answer(sock)
        seconds = time.monotonic() - started
    assert DEADLINE - 0.45 < quiet < DEADLINE - 0.15, quiet  # the 408 of a whole last read would come 0.55 s late
    assert (
        status == 408 and answer["error"] == f"the body did not arrive whole within {DEADLINE:g} s (--request-deadline)"
    )
    assert DEADLINE - 0.05 < seconds < DEADLINE + 0.35, seconds


def test_a_request_past_its_headers_takes_a_turn_and_one_more_waits_the_read_timeout_then_gets_a_503(capsys):
    """4 turns, each held by a request being scored (the scorer waits on an event): a fifth request waits its read
    timeout (0.5 s) for a turn, then gets a 503 asking it to come back in 1 s, and is served once a turn is free."""
    release, scored = threading.Event(), []

    def score(name, images, prompts):
        release.wait(10)
        scored.append(len(images))
        return images.mean((1, 2, 3))

    httpd = remote.serve(score, ["slow"], "127.0.0.1", 0, read_timeout=0.5, max_connections=4, request_deadline=30)
    url = serve_on_a_thread(httpd)
    held = [socket.create_connection(("127.0.0.1", port(url)), timeout=10) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(request(body([png(4)], reward="slow"), Authorization=None))
        time.sleep(0.3)  # all four read and waiting to be scored, each holding its turn
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
            sock.sendall(request(method="GET", path="/health", Authorization=None))
            data = sock.recv(1 << 16)
            waited = time.monotonic() - started
            while chunk := sock.recv(1 << 16):  # the body may come in a segment of its own (a loaded machine)
                data += chunk
        busy = "no turn within 0.5 s: 4 requests at once already (--max-connections)"
        assert data.startswith(b"HTTP/1.0 503 ") and b"\r\nRetry-After: 1\r\n" in data, data
        assert json.loads(data.partition(b"\r\n\r\n")[2]) == {"error": busy}
        assert 0.45 < waited < 1.5, waited
        release.set()
        assert [read_answer(sock)[0] for sock in held] == [200] * 4 and scored == [1] * 4
        assert ask(url, request(method="GET", path="/health", Authorization=None)) == (200, {"rewards": ["slow"]})
        assert "Traceback" not in capsys.readouterr().err
    finally:
        release.set()
        for sock in held:
            sock.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_client_gone_is_not_reported_and_any_other_failure_is_with_its_address(capsys):
    httpd = remote._Server(("127.0.0.1", 0), BaseHTTPRequestHandler, 1)
    try:
        for error in (ConnectionResetError("reset by peer"), BrokenPipeError("broken pipe")):
            try:
                raise error
            except OSError:
                httpd.handle_error(None, ("10.0.0.7", 4321))
        assert capsys.readouterr().err == ""
        try:
            raise RuntimeError("a bug in the handler")
        except RuntimeError:
            httpd.handle_error(None, ("10.0.0.7", 4321))
        err = capsys.readouterr().err
        assert "from ('10.0.0.7', 4321)" in err and "RuntimeError: a bug in the handler" in err
    finally:
        httpd.server_close()


def two_headers(first: tuple[int, int], second: tuple[int, int]) -> bytes:
    """A PNG with two IHDR chunks, `first` = (width, height) and `second`, and the pixels of `second` (zeros):
    PIL's decoder takes the last header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    width, height = second
    rows = b"".join(b"\0" + bytes(3 * width) for _ in range(height))
    ihdr = [chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) for w, h in (first, second)]
    return remote._PNG_MAGIC + b"".join(ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def test_the_pixel_cap_counts_the_size_the_decoder_decodes(server):
    bomb = two_headers((1, 1), (2000, 2000))  # 4 M pixels from 12 KB, behind a 1x1 header
    assert remote.decode_images([{"png": base64.b64encode(two_headers((1, 1), (40, 30))).decode()}]).shape == (
        1, 3, 30, 40)  # fmt: skip  # the attack is real: without a cap, the second header is what decodes
    started = time.monotonic()
    status, answer = ask(server, request(body([bomb])))
    assert status == 413 and "images[0] is 2000x2000, more than 3,072 pixels" in answer["error"], answer
    assert time.monotonic() - started < 1.0
    status, answer = ask(server, request(body([png(), two_headers((32, 32), (32, 33))])))  # a pair of one "size"
    assert status == 400 and "images of different sizes" in answer["error"], answer


def test_a_malformed_raw_pixel_shape_is_a_400_with_the_reason(server, capsys):
    pixels = base64.b64encode(bytes(3)).decode()
    for shape in ([True, True, 3], [1, 1, 3.0], ["1", 1, 3], [1, 1], [1, 1, 3, 1], [0, 1, 3], [-1, -1, 3],
                  [1, 1, 4], {"h": 1}, None, [10**30, 1, 3], [[1], 1, 3]):  # fmt: skip
        data = json.dumps({"reward": "jpeg", "prompts": ["p"], "images": [{"uint8": pixels, "shape": shape}]})
        status, answer = ask(server, request(data.encode()))
        assert status == 400 and "'shape' must be [H, W, 3]" in answer["error"] or status == 400 and (
            "bytes for shape" in answer["error"]), (shape, status, answer)  # fmt: skip
    data = json.dumps({"reward": "jpeg", "prompts": ["p"], "images": [{"uint8": pixels, "shape": [1, 1, 3]}]})
    assert ask(server, request(data.encode()))[0] == 200
    assert "Traceback" not in capsys.readouterr().err


def test_prompts_that_are_not_text_or_too_long_are_refused_and_not_retried(server, monkeypatch):
    lone = b'{"reward": "jpeg", "prompts": ["a \\ud800 b"], "images": [{"png": "%s"}]}' % base64.b64encode(png())
    status, answer = ask(server, request(lone))
    assert status == 400 and answer == {"error": "prompts[0] is not text: surrogates not allowed at character 2"}
    status, answer = ask(server, request(body([png()], prompts=["x" * 101])))
    assert status == 413 and "prompts[0] has 101 characters, more than 100 (--max-prompt-chars)" in answer["error"]
    monkeypatch.setattr(remote.time, "sleep", lambda s: pytest.fail("a refusal retried"))
    client = remote.Served("jpeg", server, token="secret")
    with pytest.raises(RunError, match=r"failed after 1 tries \(HTTP 400: .*not text"):
        client(torch.rand(1, 3, 32, 32), ["a \ud800 b"])
    # JSON values are counted before the body is parsed: 30,000 empty objects in 90 KB
    crowd = b'{"reward": "jpeg", "prompts": ["p"], "images": [' + b"{}," * 30_000 + b"{}]}"
    status, answer = ask(server, request(crowd))
    count, bound = crowd.count(b",") + crowd.count(b":"), 64 + 8 * 4 + 4 * 100
    assert status == 400 and f"{count:,} JSON separators, more than a request can need ({bound})" in answer["error"]


def test_the_servers_memory_is_bounded_by_its_caps_times_two_decoding_plus_its_connections(tmp_path):
    """`python -m common.rewards serve` in its own process, 8 connections at once, each a request of 2 noisy
    1024x1024 PNGs at the pixel cap (8.4 MB of body): its peak memory above its resting memory stays within
    docs/models.md's bound, 2 x (5 x body + 23 x pixels) + connections x 2 x body (+ 32 MB for the jpeg reward and
    the threads), which 8 requests decoded at once would pass twice over."""
    connections, pixels, cap_mb = 8, 2**21, 12
    argv = ["--reward", "jpeg", "--port", "0", "--device", "cpu", "--max-pixels", str(pixels), "--max-mb", str(cap_mb),
            "--max-connections", str(connections), "--request-deadline", "30", "--max-batch", "4"]  # fmt: skip
    # stdout a pipe, as under a log collector, and block-buffered as Python makes it without PYTHONUNBUFFERED: the
    # "serving" line must come all the same (flushed), or a launcher waiting for it waits forever
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "common.rewards", "serve", *argv], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    watchdog = threading.Timer(60, server.kill)  # a line that never comes fails the test instead of hanging it
    watchdog.start()
    try:
        line = next((line for line in server.stdout if line.startswith("serving")), "no line")
        watchdog.cancel()
        assert line.startswith("serving"), "no 'serving' line within 60 s: is it flushed?"
        url = re.search(r"http://[0-9.]+:[0-9]+", line).group(0)
        noise = torch.randint(0, 256, (1024, 1024, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        buffer = io.BytesIO()
        Image.fromarray(noise.numpy()).save(buffer, format="PNG", compress_level=1)
        data = body([buffer.getvalue()] * 2)
        raw = request(data, Authorization=None)

        def memory(field: str) -> int:
            return (
                int(re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{server.pid}/status").read_text()).group(1)) * 1024
            )

        assert ask(url, raw, wait=30)[0] == 200  # every import and the reward's first call done
        time.sleep(0.3)
        resting = memory("VmRSS")
        answers = []
        threads = [
            threading.Thread(target=lambda: answers.append(ask(url, raw, wait=30)[0])) for _ in range(connections)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [200] * connections
        peak = memory("VmHWM") - resting
    finally:
        server.terminate()
        server.wait(10)
    heavy = 5 * len(data) + 23 * pixels  # one request parsed and decoded (docs/models.md)
    bound = 2 * heavy + connections * 2 * len(data) + 32e6
    assert peak < bound < connections * heavy / 2, (peak / 1e6, bound / 1e6)


def test_a_bug_in_the_server_is_still_an_answer_with_a_body(server, monkeypatch, capsys):
    def broken(*a, **kw):
        raise KeyError("a bug")

    monkeypatch.setattr(remote, "parse_request", broken)
    assert ask(server, request(body([png()]))) == (500, {"error": "the server failed: KeyError: 'a bug'"})
    assert "KeyError: 'a bug'" in capsys.readouterr().err  # the operator's trace
    monkeypatch.undo()
    assert len(scores_of(server, [png()])) == 1


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ITEM = st.one_of(
    JSON,
    st.fixed_dictionaries({"png": st.sampled_from([base64.b64encode(png(4)).decode(), "", "@@", "iVBORw0KGgo="])}),
    st.fixed_dictionaries(
        {"uint8": st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode()), "shape": JSON}
    ),
    st.fixed_dictionaries({"uint8": st.just(base64.b64encode(bytes(12)).decode()), "shape": st.lists(
        st.integers(-2, 5) | st.booleans() | st.floats(0, 5), min_size=2, max_size=4)}),
)  # fmt: skip
BODY = st.fixed_dictionaries(
    {
        "reward": st.sampled_from(["jpeg", "boom", 1, None]),
        "prompts": st.lists(st.text(max_size=12) | JSON, max_size=5),
        "images": st.lists(ITEM, max_size=5),
    }  # fmt: skip
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), JSON.map(lambda x: json.dumps(x).encode()),
                 BODY.map(lambda x: json.dumps(x).encode())))  # fmt: skip
def test_the_request_parser_answers_any_body_with_scores_input_or_a_4xx(raw):
    try:
        name, prompts, images = remote.parse_request(raw, ["jpeg", "boom"], 4, 3 * 32 * 32, 10)
    except remote._Failed as e:
        assert 400 <= e.code < 500 and e.reason, e
        return
    body = json.loads(raw)
    assert name == body["reward"] and prompts == body["prompts"] and 1 <= len(prompts) <= 4
    assert images.dtype == torch.float32 and images.shape[:2] == (len(prompts), 3)
    assert images.shape[2] * images.shape[3] * len(prompts) <= 3 * 32 * 32 and 0 <= images.min() <= images.max() <= 1


# ---------------------------------------------------------------- the client
class Fake:
    """A reward server whose POST /score answers are `answers`, one a request, the last one repeated: (status, raw
    body[, Location]), "cut" (Content-Length 100, 10 bytes, closed), "drop" (closed with no answer), "trickle" (a
    good answer, a byte every 0.2 s), "trickle body" or "trickle to the close" (its HTTP/1.0 head at once, with or
    without a Content-Length, its body a byte every 0.2 s) or "busy CODE SECONDS" (that status, with Retry-After:
    SECONDS). GET /health answers `health`. `posts` counts the requests, `tokens` keeps the
    Authorization header of each request (GET and POST)."""

    def __init__(self):
        self.answers, self.health, self.posts, self.tokens = [], b'{"rewards": ["fake"]}', 0, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _raw(self, status: int, data: bytes, location: str | None = None, length: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                if location is not None:
                    self.send_header("Location", location)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.tokens.append(self.headers.get("Authorization"))
                self._raw(200, fake.health)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                fake.posts += 1
                fake.tokens.append(self.headers.get("Authorization"))
                answer = fake.answers.pop(0) if len(fake.answers) > 1 else fake.answers[0]
                if answer == "cut":
                    self._raw(200, b'{"scores":', length=100)
                elif isinstance(answer, str) and answer.startswith("busy "):  # "busy CODE RETRY-AFTER"
                    code, _, after = answer[5:].partition(" ")
                    self.send_response(int(code))
                    self.send_header("Retry-After", after)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                elif answer in ("trickle body", "trickle to the close"):
                    length = f"Content-Length: {len(GOOD[1])}\r\n" if answer == "trickle body" else ""
                    try:
                        self.wfile.write(f"HTTP/1.0 200 OK\r\n{length}\r\n".encode())
                        for k in range(len(GOOD[1])):  # 4.6 s in all, unless the client hangs up first
                            self.wfile.write(GOOD[1][k : k + 1])
                            time.sleep(0.2)
                    except OSError:
                        pass
                elif answer == "trickle":
                    raw = b"HTTP/1.0 200 OK\r\nContent-Length: 23\r\n\r\n" + GOOD[1]
                    try:
                        for k in range(len(raw)):  # 13 s in all, unless the client hangs up first
                            self.wfile.write(raw[k : k + 1])
                            time.sleep(0.2)
                    except OSError:
                        pass
                elif answer != "drop":
                    self._raw(*answer)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = serve_on_a_thread(self.server)

    def reset(self, *answers) -> None:
        self.answers, self.posts = list(answers), 0


@pytest.fixture(scope="module")
def fake():
    server = Fake()
    yield server
    server.server.shutdown()
    server.server.server_close()


GOOD = (200, b'{"scores": [0.5, 0.25]}')


def test_the_client_stops_at_an_answer_that_is_not_one_finite_number_per_image(fake):
    client = remote.Served("fake", fake.url)
    images, prompts = torch.rand(2, 3, 8, 8), ["a", "b"]
    for raw, problem in [
        (b'{"scores": [NaN, 1.0]}', "scores[0] is nan, not a finite number"),
        (b'{"scores": [1.0, Infinity]}', "scores[1] is inf, not a finite number"),
        (b'{"scores": [-Infinity, 1.0]}', "scores[0] is -inf"),
        (b'{"scores": [1.0, 1e999]}', "scores[1] is inf"),
        (b'{"scores": [1' + b"0" * 400 + b", 1]}", "scores[0] is 1000"),
        (b'{"scores": [0.5, -1e300]}', "scores[1] is -1e+300, not a finite number (as float32)"),
        (b'{"scores": [[0.5], [0.25]]}', "scores[0] is [0.5], not a number"),
        (b'{"scores": [true, false]}', "scores[0] is true, not a number"),
        (b'{"scores": [0.5, "0.25"]}', 'scores[1] is "0.25", not a number'),
        (b'{"scores": [null, 0.25]}', "scores[0] is null, not a number"),
        (b'{"scores": [0.5]}', "1 scores for 2 images"),
        (b'{"scores": [0.5, 0.25, 0.125]}', "3 scores for 2 images"),
        (b'{"scores": 0.5}', "no list of scores ('scores': 0.5)"),
        (b'{"error": "?"}', "no list of scores ('scores': null)"),
        (b"[0.5, 0.25]", "JSON that is not an object: [0.5, 0.25]"),
        (b"<html>busy</html>", "an answer that is not JSON (JSONDecodeError"),
        (b"[" * 100_000, "an answer that is not JSON (RecursionError"),
    ]:
        fake.reset((200, raw))
        with pytest.raises(RunError) as stopped:
            client(images, prompts)
        message = str(stopped.value)
        assert message.startswith(f"{fake.url}/score answered ") and problem in message, (problem, message)
        assert "--resume-from latest" in message and fake.posts == 1  # not retried: the same answer would come
    fake.reset(GOOD)
    assert client(images, prompts).tolist() == [0.5, 0.25]


def test_the_client_retries_what_may_pass_and_nothing_else(fake):
    payload = {"reward": "fake", "prompts": ["a", "b"], "images": []}
    ask_fake = lambda tries=5: remote.request_json(f"{fake.url}/score", payload, tries=tries, backoff=0.01)
    for first in [*((code, b'{"error": "busy"}') for code in (429, 500, 502, 503, 504)), "cut", "drop"]:
        fake.reset(first, GOOD)
        assert ask_fake() == {"scores": [0.5, 0.25]} and fake.posts == 2, first
    for answer, why in [("cut", "IncompleteRead(10 bytes read, 90 more expected)"), ("drop", "RemoteDisconnected(")]:
        fake.reset(answer)
        with pytest.raises(
            RunError, match=re.escape(f"{fake.url}/score failed after 3 tries (the answer broke off: {why}")
        ):
            ask_fake(tries=3)
        assert fake.posts == 3
    for code in (400, 404, 413, 422):
        fake.reset((code, b'{"error": "your request is wrong"}'), GOOD)
        with pytest.raises(RunError, match=f"failed after 1 tries \\(HTTP {code}: .*your request is wrong"):
            ask_fake()
        assert fake.posts == 1
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(RunError, match=f"{closed}/score failed after 2 tries \\(ConnectionRefusedError: .*refused"):
        remote.request_json(f"{closed}/score", payload, tries=2, backoff=0.01)
    with pytest.raises(RunError, match="the token \\(\\$REWARD_API_KEY\\) holds a line break"):
        remote.request_json(f"{fake.url}/score", payload, token="secret\r\nX-Evil: 1")
    for not_a_url in ("127.0.0.1:8100/score", "scorer-node/score", "ftp://scorer-node/score", "http://h\u00e9/score",
                      "http://:80/score", "http://host:99999/score", "http://host/a b"):  # fmt: skip
        with pytest.raises(RunError, match=f"{re.escape(not_a_url)} is not an http:// or https:// URL"):
            remote.request_json(not_a_url, payload)


def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(fake):
    elsewhere = Fake()  # where the redirects point: it must never be asked
    elsewhere.reset(GOOD)
    client = remote.Served("fake", fake.url, token="secret")
    for code in (301, 302, 303, 307, 308):
        fake.reset((code, b"", f"{elsewhere.url}/score"))
        with pytest.raises(RunError) as stopped:
            client(torch.rand(2, 3, 8, 8), ["a", "b"])
        assert str(stopped.value).startswith(f"{fake.url}/score answered HTTP {code}, a redirect to "
                                             f"'{elsewhere.url}/score', which is not followed (nor sent the token)")  # fmt: skip
        assert fake.posts == 1  # not retried either
    assert elsewhere.posts == 0 and elsewhere.tokens == [] and set(fake.tokens[-6:]) == {"Bearer secret"}
    elsewhere.server.shutdown()
    elsewhere.server.server_close()


def test_the_client_gives_up_on_a_trickling_answer_at_its_deadline(fake):
    # a good answer, a byte every 0.2 s: no read waits 1 s, but no try may last more than 1 s in all
    fake.reset("trickle")
    started = time.monotonic()
    with pytest.raises(RunError, match=re.escape("failed after 2 tries (no whole answer within 1 s (the deadline")):
        remote.request_json(f"{fake.url}/score", {"x": 1}, timeout=1.0, tries=2, backoff=0.01)
    assert 2.0 <= time.monotonic() - started < 3.5 and fake.posts == 2  # not 13 s: the trickle's end


def test_the_client_gives_up_on_an_http_1_0_answer_whose_body_trickles_at_its_deadline(fake):
    # the head arrives at once and the answer closes its connection (HTTP/1.0): http.client hands the socket to the
    # answer, and the deadline must still shut it
    for answer in ("trickle body", "trickle to the close"):
        fake.reset(answer)
        started = time.monotonic()
        with pytest.raises(RunError, match=re.escape("failed after 1 tries (no whole answer within 1 s (the deadline")):
            remote.request_json(f"{fake.url}/score", {"x": 1}, timeout=1.0, tries=1)
        assert 1.0 <= time.monotonic() - started < 1.5, answer  # not 4.6 s: the trickle's end


def test_the_client_waits_what_a_busy_servers_retry_after_asks_up_to_30_s(fake, monkeypatch):
    waits, here, sleep = [], threading.current_thread(), time.sleep
    # this thread's waits recorded, not made; another (a fake server's handler still trickling) sleeps as before
    monkeypatch.setattr(
        remote.time, "sleep", lambda s: waits.append(s) if threading.current_thread() is here else sleep(s)
    )
    for busy, backoff, waited in [
        ("busy 503 3", 1.0, 3.0),  # longer than the backoff: heeded
        ("busy 429 2", 1.0, 2.0),
        ("busy 503 1000", 1.0, remote.MAX_RETRY_AFTER),  # bounded
        ("busy 503 1", 5.0, 5.0),  # shorter than the backoff: the backoff
        ("busy 503 Wed, 21 Oct 2065 07:28:00 GMT", 1.0, 1.0),  # a date: not read
        ("busy 500 9", 1.0, 1.0),  # Retry-After is a 429's or a 503's
    ]:
        fake.reset(busy, GOOD)
        waits.clear()
        assert remote.request_json(f"{fake.url}/score", {}, backoff=backoff) == {"scores": [0.5, 0.25]}
        assert waits == [waited] and fake.posts == 2, busy
    assert remote.MAX_RETRY_AFTER == 30.0


def test_a_server_that_is_not_a_reward_server_is_refused_at_start_up(fake):
    for health, error, reason in [
        (b'{"rewards": "fake"}', InputError, "not a reward server's"),
        (b'{"models": ["fake"]}', InputError, "not a reward server's"),
        (b'{"rewards": ["other"]}', InputError, "that server scores ['other'], not 'fake'"),
        (b'["fake"]', RunError, "/health answered JSON that is not an object"),
    ]:
        fake.health = health
        with pytest.raises(error, match=re.escape(reason)):
            remote.Served("fake", fake.url)
    fake.health = b'{"rewards": ["fake"]}'


def test_the_answer_validator_takes_float32s_largest_value_and_not_the_next_double():
    biggest = 3.4028234663852886e38  # float32's max, exactly a double
    assert remote._wrong_scores([biggest, -biggest], 2) is None
    assert remote._wrong_scores([1.0, biggest * (1 + 2**-52)], 2) == (
        f"scores[1] is {str(biggest * (1 + 2**-52))[:50]}, not a finite number (as float32)"
    )


@settings(max_examples=300, deadline=None)
@given(JSON | st.lists(st.integers() | st.floats() | st.booleans() | JSON, max_size=4), st.integers(0, 4))
def test_the_answer_validator_takes_exactly_n_numbers_finite_as_float32(scores, n):
    # written apart from _wrong_scores: a list of n ints or floats (not booleans), each within float32's range
    def number(s):
        return type(s) in (int, float) and abs(s) <= 3.4028234663852886e38  # NaN and inf compare False

    expected_ok = isinstance(scores, list) and len(scores) == n and all(map(number, scores))
    wrong = remote._wrong_scores(json.loads(json.dumps(scores)), n)  # as it comes off the wire
    assert (wrong is None) == expected_ok, (scores, n, wrong)
    if wrong is None:
        assert torch.isfinite(torch.tensor(scores, dtype=torch.float32)).all()


# ---------------------------------------------------------------- the request parser's answers, each by hand
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refused(raw, max_batch: int = 4, max_chars: int = 10) -> tuple[int, str]:
    with pytest.raises(remote._Failed) as e:
        remote.parse_request(raw if isinstance(raw, bytes) else json.dumps(raw).encode(), ["jpeg"], max_batch,
                             3 * 32 * 32, max_chars)  # fmt: skip
    return e.value.code, e.value.reason


def test_each_refusal_of_the_request_parser_by_hand():
    one = {"png": b64(png(4))}
    ok = {"reward": "jpeg", "prompts": ["p"], "images": [one]}
    assert refused([ok]) == (400, 'the body must be a JSON object with "reward", "prompts" and "images"')
    assert refused(ok | {"prompts": "p"}) == (400, "'prompts' must be a list of strings")
    assert refused(ok | {"prompts": [], "images": []}) == (
        400, "'images' must be a list as long as 'prompts', 1 to 4 items")  # fmt: skip
    assert refused(b"[" * 100_000 + b"]" * 100_000) == (400, "JSON nested too deep")
    assert refused(ok | {"images": [[1]]}) == (400, "ValueError: images[0]: expected an object")
    bad = b'{"reward": "jpeg",}'
    try:
        json.loads(bad)
    except ValueError as e:
        assert refused(bad) == (400, f"JSONDecodeError: {e}")
    # the limits are inclusive: a prompt of exactly --max-prompt-chars, a body of exactly as many separators
    assert remote.parse_request(json.dumps(ok | {"prompts": ["x" * 10]}).encode(), ["jpeg"], 1, 16, 10)[1] == ["x" * 10]
    bound = 64 + 8 * 1 + 1 * 10
    raw = json.dumps(ok).encode()
    pad = bound - raw.count(b",") - raw.count(b":") - 1  # the pad's own ":" counts too
    exact = raw[:-1] + b', "pad": "' + b"," * (pad - 1) + b'"}'
    assert exact.count(b",") + exact.count(b":") == bound
    assert remote.parse_request(exact, ["jpeg"], 1, 16, 10)[0] == "jpeg"
    over = exact[:-2] + b',"}'
    assert refused(over, max_batch=1) == (
        400, f"the body holds {bound + 1:,} JSON separators, more than a request can need ({bound:,})")  # fmt: skip


def apng() -> bytes:
    buffer = io.BytesIO()
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(buffer, format="PNG", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def test_each_refusal_of_the_image_decoder_by_hand():
    """Each message names the item (images[1] here: the index is the item's, not the first's)."""
    first = {"png": b64(png(4))}

    def why(item, max_pixels=None) -> str:
        with pytest.raises(ValueError) as e:
            remote.decode_images([first, item], max_pixels)
        return str(e.value)

    assert why([1]) == "images[1]: expected an object"
    assert why({"png": b64(png(4, fmt="JPEG"))}) == "images[1]: 'png' holds a JPEG, not a PNG"
    assert (
        why({"png": b64(bytes(range(12)))})
        == "images[1]: 'png' holds bytes starting 00 01 02 03 04 05 06 07, not a PNG"
    )
    assert why({"png": ""}) == "images[1]: 'png' holds bytes starting nowhere, not a PNG"
    assert why({"png": "@@"}).startswith("images[1]: 'png' is not base64 (Error: ")
    assert why({"uint8": "@@", "shape": [1, 1, 3]}).startswith("images[1]: 'uint8' is not base64 (Error: ")
    assert why({"png": b64(apng())}) == "images[1]: an animated PNG (one frame per image)"
    broken = png(4)[:-30]  # the header whole, the pixels cut short
    assert why({"png": b64(broken)}) == "images[1]: not a readable PNG (OSError: image file is truncated)"
    assert why({"png": b64(remote._PNG_MAGIC + b"garbage")}).startswith(
        "images[1]: not a readable PNG (UnidentifiedImageError: cannot identify image file"
    )  # PIL's reader refuses it before a pixel is decoded
    shape = [0, 4, 3]
    assert (
        why({"uint8": "", "shape": shape}) == f"images[1]: 'shape' must be [H, W, 3] of positive integers, not {shape}"
    )
    long = [1, 1, 3] + [1] * 40
    assert why({"uint8": "", "shape": long}) == (
        f"images[1]: 'shape' must be [H, W, 3] of positive integers, not {str(long)[:60]}"
    )
    assert why({"png": b64(png(5))}) == "images of different sizes in one request"
    with pytest.raises(ValueError) as e:
        remote.decode_images([])
    assert str(e.value) == "no images"
    assert remote.decode_images([first, first], max_pixels=2 * 16).shape == (2, 3, 4, 4)  # exactly at the cap


def test_raw_pixels_of_any_shape_and_pngs_of_any_mode_decode_to_rgb_by_hand():
    raw = bytes(range(18))  # 2 rows of 3 pixels, RGB: pixel (i, j) holds 9 i + 3 j + c
    out = remote.decode_images([{"uint8": b64(raw), "shape": [2, 3, 3]}])
    assert out.shape == (1, 3, 2, 3)
    assert out[0, :, 1, 2].mul(255).round().tolist() == [15, 16, 17]  # row 1, column 2
    for mode, colour in (("RGBA", (10, 20, 30, 40)), ("L", 77), ("P", 5)):
        buffer = io.BytesIO()
        Image.new(mode, (2, 3), colour).save(buffer, format="PNG")
        out = remote.decode_images([{"png": b64(buffer.getvalue())}])
        rgb = np.array(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))[0, 0].tolist()
        assert out.shape == (1, 3, 3, 2) and out[0, :, 0, 0].mul(255).round().tolist() == rgb, mode


def test_the_client_sends_its_images_clamped_and_rounded_to_8_bits():
    image = torch.tensor([-0.5, 0.2, 0.5, 1.0, 1.5, 0.999]).view(1, 2, 3).expand(3, 2, 3)
    sent = np.array(Image.open(io.BytesIO(base64.b64decode(remote.png_base64(image)))))
    assert sent.shape == (2, 3, 3) and sent[..., 0].tolist() == [[0, 51, 128], [255, 255, 255]]  # 127.5 to 128


def test_a_closed_connection_frees_exactly_its_place_and_one_past_sixteen_per_turn_gets_a_503(capsys):
    httpd = remote.serve(lambda n, x, p: x.mean((1, 2, 3)), ["jpeg"], "127.0.0.1", 0, max_connections=1)
    url = serve_on_a_thread(httpd)
    full = remote.OPEN_PER_TURN  # connections open at once, per turn: 16
    held = []
    try:
        held = [socket.create_connection(("127.0.0.1", port(url)), timeout=5) for _ in range(full - 2)]
        for sock in held:
            sock.sendall(b"POST /score HTTP/1.1\r\n")  # headers begun, never ended: no turn held
        assert ask(url, request(body([png(4)], prompts=["p"]), Authorization=None))[0] == 200  # the one turn is free
        for _ in range(100):  # the finished connection's thread ends a moment after its answer
            if httpd.open == full - 2:
                break
            time.sleep(0.02)
        assert httpd.open == full - 2  # the held ones
        with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as second:
            second.sendall(b"POST /score HTTP/1.1\r\n")
            with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as last:
                last.sendall(b"POST /score HTTP/1.1\r\n")
                time.sleep(0.2)
                assert httpd.open == full
                started = time.monotonic()
                with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as third:
                    status, answer = read_answer(third)  # answered before it sends
                assert (status, answer) == (503, {"error": f"{full} connections open at once already "
                                                           f"({full} x --max-connections)"})  # fmt: skip
                assert time.monotonic() - started < 1.0
        for sock in held:
            sock.close()
        assert ask(url, request(method="GET", path="/health", Authorization=None))[0] == 200
        assert "Traceback" not in capsys.readouterr().err  # the 503's connection closed without an error
    finally:
        for sock in held:
            sock.close()
        httpd.shutdown()
        httpd.server_close()


def test_an_https_url_speaks_tls_and_a_plain_server_is_not_one(fake):
    with pytest.raises(RunError, match=r"failed after 1 tries \(SSLError"):
        remote.request_json(fake.url.replace("http://", "https://") + "/health", tries=1, timeout=5)


def test_a_connection_that_is_never_accepted_is_given_up_at_the_calls_timeout():
    """A listener whose queue is full (listen(0), filled) drops new SYNs: connect() would wait minutes for the
    kernel's retries; the call gives up at its timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = [socket.socket() for _ in range(4)]
    try:
        for sock in queued:
            sock.setblocking(False)
            sock.connect_ex(listener.getsockname())
        time.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(RunError, match="failed after 1 tries"):
            remote.request_json(f"http://127.0.0.1:{listener.getsockname()[1]}/health", timeout=0.5, tries=1)
        assert time.monotonic() - started < 2.0
    finally:
        for sock in [*queued, listener]:
            sock.close()


def test_the_clients_retries_wait_1_2_4_times_the_backoff(fake, monkeypatch):
    waits = []
    monkeypatch.setattr(remote.time, "sleep", waits.append)
    fake.reset((503, b'{"error": "busy"}'))
    with pytest.raises(RunError, match="failed after 4 tries"):
        remote.request_json(f"{fake.url}/score", {}, tries=4)
    assert waits == [1.0, 2.0, 4.0] and fake.posts == 4  # the default backoff: 1 s
    waits.clear()
    with pytest.raises(RunError, match="failed after 3 tries"):
        remote.request_json(f"{fake.url}/score", {}, tries=3, backoff=0.25)
    assert waits == [0.25, 0.5]


def test_each_answer_the_client_stops_at_is_named_whole(fake, monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    url = f"{fake.url}/score"

    def stopped(*answer) -> str:
        fake.reset(answer)
        with pytest.raises(RunError) as e:
            remote.request_json(url, {}, tries=2)
        return str(e.value)

    far = "http://elsewhere.example/" + "x" * 300
    assert stopped(300, b'{"scores": [1]}', far) == (
        f"{url} answered HTTP 300, a redirect to {far[:200]!r}, which is not followed (nor sent the token): give "
        f"--reward-url the address that answers itself; {remote.RESUME}"
    )  # 300 (Multiple Choices) is a redirect too, whatever its body
    wrong = b"\xff" + b"e" * 400  # not UTF-8, and long
    assert stopped(400, wrong) == (
        f"{url} failed after 1 tries (HTTP 400: {wrong[:300].decode(errors='replace')}); {remote.RESUME}"
    )
    assert stopped(200, b"{not json") == (
        f"{url} answered an answer that is not JSON (JSONDecodeError: Expecting property name enclosed in double "
        f"quotes: line 1 column 2 (char 1)); {remote.RESUME}"
    )
    array = json.dumps(list(range(100))).encode("utf-16")  # JSON in UTF-16 (json.loads reads it), 600 bytes
    assert stopped(200, array) == (
        f"{url} answered JSON that is not an object: {array[:200].decode(errors='replace')}; {remote.RESUME}"
    )
    big = remote.MAX_ANSWER + 1  # a Content-Length over the cap: refused before the body is read
    assert stopped(200, b"{}", None, big) == (
        f"{url} answered an answer of {big:,} bytes, more than {remote.MAX_ANSWER:,}; {remote.RESUME}"
    )
    with pytest.raises(RunError, match="failed after 1 tries \\(ConnectionRefusedError"):
        remote.request_json("http://127.0.0.1:1/score", {}, tries=1)  # port 1 is a port like any other


def test_the_answer_validator_cuts_each_value_it_names():
    long = "s" * 300
    assert remote._wrong_scores({"x": long}, 1) == f"no list of scores ('scores': {json.dumps({'x': long})[:200]})"
    assert remote._wrong_scores([long], 1) == f"scores[0] is {json.dumps(long)[:100]}, not a number"
    huge = 10**80  # an int of 81 digits: no float32
    assert remote._wrong_scores([0, huge], 2) == f"scores[1] is {str(huge)[:50]}, not a finite number (as float32)"


def test_two_requests_at_once_are_decoded_and_one_scored(monkeypatch):
    """The server's memory bound (docs/models.md) counts two requests decoding at once, and one model scoring."""
    lock, inside, most = threading.Lock(), {"decode": 0, "score": 0}, {"decode": 0, "score": 0}
    pause = threading.Event().wait

    def counted(what, fn):
        def run(*a, **kw):
            with lock:
                inside[what] += 1
                most[what] = max(most[what], inside[what])
            pause(0.15)
            with lock:
                inside[what] -= 1
            return fn(*a, **kw)

        return run

    monkeypatch.setattr(remote, "decode_images", counted("decode", remote.decode_images))
    score = counted("score", lambda name, images, prompts: images.mean((1, 2, 3)))
    httpd = remote.serve(score, ["jpeg"], "127.0.0.1", 0)  # its defaults: 8 connections at once
    url = serve_on_a_thread(httpd)
    try:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(ask(url, request(body([png(4)]))))) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [status for status, _ in answers] == [200] * 5
        assert most == {"decode": 2, "score": 1}
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_read_timeout_python_m_common_rewards_serve_runs_with_is_10_s():
    """`python -m common.rewards serve` has no flag for it: serve()'s default is the figure docs/models.md gives."""
    assert inspect.signature(remote.serve).parameters["read_timeout"].default == 10.0


def answer_and_close(url: str, raw: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Everything the server sends on one connection for `raw` (sent whole, then `pause` s), and the seconds from
    the first byte of its answer to its close."""
    with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
        sock.sendall(raw)
        time.sleep(pause)
        data = sock.recv(1 << 16)
        first = time.monotonic()
        while chunk := sock.recv(1 << 16):
            data += chunk
        return data, time.monotonic() - first


def test_every_answer_is_one_json_answer_and_the_connection_closes_at_once(server):
    """After a refusal the unread body is read and dropped (so that a client still sending reads the answer), and
    nothing more: the connection closes at once, with one answer on it, of Content-Type application/json."""
    refused = request(b" " * 400_000, Content_Type="text/plain")  # 415, its body sent whole and left unread
    data, closing = answer_and_close(server, refused, pause=0.3)
    assert data.startswith(b"HTTP/1.0 415 ") and data.count(b"HTTP/1.") == 1 and closing < 0.5, (data[:200], closing)
    assert b"\r\nContent-Type: application/json\r\n" in data
    wrong = request(body([png()], reward="verifier", prompts=["a poem"]))  # read whole, then refused by the reward
    data, closing = answer_and_close(server, wrong)
    assert data.startswith(b"HTTP/1.0 422 ") and closing < 0.5, (data[:200], closing)
    data, closing = answer_and_close(server, request(b"{", Content_Length="10"))
    assert data.startswith(b"HTTP/1.0 408 ") and data.count(b"HTTP/1.") == 1, data  # one 408, at the read timeout
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.shutdown(socket.SHUT_WR)  # a connection closed without a request: no answer
        assert sock.recv(1 << 16) == b""
    long_line = f"GET /{'x' * 70_000} HTTP/1.1\r\n\r\n".encode()  # http.server's own refusal, in JSON too
    assert ask(server, long_line) == (414, {"error": "Request-URI Too Long"})


def how_it_closes(url: str, raw: bytes, late: float = 0.0) -> tuple[int | None, str]:
    """(status, "closed" or "reset"): after its answer, whether the server closed the connection having read all
    that was sent (a FIN: the next recv is b"") or with bytes unread (the kernel then answers them with a reset: an
    error on the client's send, on its next recv or pending on the socket; the answer itself is read before it).
    `raw` is sent from a thread (past the socket buffers it blocks until the server reads), its last byte `late` s
    after the rest."""
    failed = []

    def send() -> None:
        try:
            sock.sendall(raw[:-1])
            time.sleep(late)
            sock.sendall(raw[-1:])
        except OSError as e:
            failed.append(e)

    with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        status, _ = read_answer(sock)
        sender.join(5)  # the whole request sent, or stopped by the reset
        time.sleep(0.1)  # for a reset in answer to the last bytes to come back
        try:
            rest = sock.recv(1 << 16)
        except ConnectionResetError:
            return status, "reset"
        # after the FIN, recv gives b"" and the reset is kept as the socket's pending error (EPIPE)
        reset = failed or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return status, "reset" if reset else "closed" if rest == b"" else f"more bytes: {rest[:40]!r}"


def test_a_refused_body_is_drained_up_to_exactly_twice_the_cap_and_one_of_untrusted_length_not_at_all(server):
    """The drain after a refusal is what lets a client still sending read its answer: the body is read and dropped
    up to twice --max-mb (here 2 x 0.5 MB = 1,000,000 bytes), and the connection then closes cleanly; one byte more,
    or a Content-Length beside a Transfer-Encoding (whose length the server does not trust), is not read at all and
    the close resets. On loopback the answer arrives either way; the reset after it shows what was left unread."""
    twice = int(2 * CAP_MB * 1e6)
    # its last byte sent 0.3 s after the rest: read too (stopping one byte short, the server closes first, and that
    # byte then meets a closed socket: a reset)
    assert how_it_closes(server, request(b" " * twice), late=0.3) == (413, "closed")
    assert how_it_closes(server, request(b" " * (twice + 1))) == (413, "reset")  # past twice the cap: not read
    # under the cap too; each body past the server's 64 KiB read buffer, so that its rest waits in the kernel
    assert how_it_closes(server, request(b" " * 300_000, Content_Type="text/plain")) == (415, "closed")
    chunked = request(b" " * 300_000, Transfer_Encoding="chunked")  # both headers: the length is not believed
    assert how_it_closes(server, chunked) == (411, "reset")
    assert len(scores_of(server, [png()])) == 1


def test_the_body_cap_is_exact_in_bytes_and_a_servers_failure_is_cut_at_200_characters(monkeypatch, capsys):
    def broken(*a, **kw):
        raise KeyError("k" * 300)

    httpd = remote.serve(lambda n, x, p: x.mean((1, 2, 3)), ["jpeg"], "127.0.0.1", 0, max_mb=2)
    url = serve_on_a_thread(httpd)
    try:
        status, answer = ask(url, request(Content_Length="2000001", Authorization=None))
        assert status == 413 and answer["error"].endswith("1 byte to 2 MB, not 2,000,001")
        monkeypatch.setattr(remote, "parse_request", broken)
        status, answer = ask(url, request(body([png()]), Authorization=None))
        assert (status, answer) == (500, {"error": f"the server failed: KeyError: {str(KeyError('k' * 300))[:200]}"})
        assert "KeyError" in capsys.readouterr().err
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_each_refusal_of_the_server_whole(server):
    """(status, {"error": reason}) of each refusal, by hand; a body of exactly the cap is read."""
    good = body([png()])
    no_token = request(good, Authorization=None)
    assert ask(server, no_token) == (401, {"error": "missing or wrong token (Authorization: Bearer TOKEN)"})
    assert ask(server, request(good, path="/other")) == (404, {"error": "POST /score or GET /health"})
    assert ask(server, request(method="GET", path="/other")) == (404, {"error": "GET /health or POST /score"})
    chunked = request(good, Transfer_Encoding="chunked")
    assert ask(server, chunked) == (411, {"error": "the body needs a Content-Length (and no Transfer-Encoding)"})
    assert ask(server, request(b"", Content_Length="0")) == (400, {"error": "an empty body"})
    twice = ("1" * 30, "2" * 30)  # two Content-Length headers: named, cut at 40 characters
    raw = request(good).replace(b"Content-Length:", f"Content-Length: {twice[0]}\r\nContent-Length:".encode(), 1)
    raw = raw.replace(f"Content-Length: {len(good)}".encode(), f"Content-Length: {twice[1]}".encode())
    shown = ", ".join(twice)[:40]
    assert ask(server, raw) == (400, {"error": f"Content-Length must be one number of bytes, not {shown!r}"})
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:  # a body that ends early
        sock.sendall(request(b"{}", Content_Length="10"))
        sock.shutdown(socket.SHUT_WR)
        assert read_answer(sock) == (400, {"error": "the body ended after 2 of its 10 bytes"})
    cap = int(CAP_MB * 1e6)
    exact = good[:-1] + b" " * (cap - len(good)) + b"}"  # JSON padded to exactly the cap
    assert len(exact) == cap and ask(server, request(exact))[0] == 200


def test_a_rewards_failure_is_a_500_naming_its_first_line_and_a_wrong_count_too(capsys):
    def score(name, images, prompts):
        if name == "two":
            return torch.tensor([0.5, 0.25])  # two scores for one image
        raise RuntimeError({"silent": "", "long": "y" * 400 + "\nsecond line"}[name])

    httpd = remote.serve(score, ["two", "silent", "long"], "127.0.0.1", 0)
    url = serve_on_a_thread(httpd)
    try:
        assert ask(url, request(body([png()], reward="two"), Authorization=None)) == (
            500, {"error": "two returned [0.5, 0.25] for 1 images"})  # fmt: skip
        assert ask(url, request(body([png()], reward="silent"), Authorization=None)) == (
            500, {"error": "silent: RuntimeError: "})  # fmt: skip
        assert ask(url, request(body([png()], reward="long"), Authorization=None)) == (
            500, {"error": "long: RuntimeError: " + "y" * 300})  # fmt: skip
        assert capsys.readouterr().err.count("Traceback") == 2  # the operator's traces
    finally:
        httpd.shutdown()
        httpd.server_close()


def raw_server(answer: bytes) -> tuple[ThreadingHTTPServer, str]:
    """A server that answers every request with `answer`, bytes as they are, and closes."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.wfile.write(answer)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    return httpd, serve_on_a_thread(httpd)


def test_an_answer_up_to_the_cap_is_read_and_one_byte_more_is_refused_with_or_without_its_length(fake, monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    cap = remote.MAX_ANSWER
    for size, length in ((cap, False), (cap + 1, False), (cap, True)):
        head = b"HTTP/1.0 200 OK\r\n" + (f"Content-Length: {size}\r\n".encode() if length else b"") + b"\r\n"
        httpd, url = raw_server(head + b"{}" + b" " * (size - 2))  # up to the close, or as long as it says
        try:
            if size == cap:
                assert remote.request_json(url + "/x", tries=1) == {}
            else:
                with pytest.raises(RunError) as e:
                    remote.request_json(url + "/x", tries=1)
                assert str(e.value) == f"{url}/x answered an answer of more than {cap:,} bytes; {remote.RESUME}"
        finally:
            httpd.shutdown()
            httpd.server_close()
    # a redirect without a Location: named as such, not a crash
    fake.reset((302, b"{}"))
    with pytest.raises(RunError, match=re.escape("HTTP 302, a redirect to '', which is not followed")):
        remote.request_json(f"{fake.url}/score", {}, tries=1)
