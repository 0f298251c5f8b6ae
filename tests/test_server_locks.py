"""The reward server (common/remote.py serve(), `python -m common.rewards serve`) cannot be locked by connections
that never send their headers: they hold no turn, get a 408 at the header timeout, and every client meanwhile is
answered on its first try. Headers are capped in bytes. At start-up, a flag the server cannot run with (a number
that is not finite, a port out of range or taken, a host that does not resolve, a device this machine does not
have) is one `error:` line naming it, never a traceback. Loopback only; every server is stopped at the test's end."""

import select
import socket
import threading
import time

import pytest
import torch

from common import RunError, remote, rewards
from tests.test_server import port, read_answer, request, serve_on_a_thread


def test_eight_stalled_connections_lock_no_one_out_and_fifty_clients_are_answered_on_their_first_try(capsys):
    """At the defaults (8 turns, a read timeout of 10 s, a deadline of 60 s), 8 connections that never end their
    headers (4 silent, 4 stopped mid-headers) hold no turn: 50 clients at once, none retrying, are all scored while
    they are held, and the 8 get their 408 at the header timeout (3 s here), not after a read timeout or the
    deadline."""
    httpd = remote.serve(lambda n, x, p: x.mean((1, 2, 3)), ["bright"], "127.0.0.1", 0, header_timeout=3.0)
    url = serve_on_a_thread(httpd)
    stalled = []
    try:
        started = time.monotonic()
        stalled = [socket.create_connection(("127.0.0.1", port(url)), timeout=5) for _ in range(8)]
        for sock in stalled[4:]:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        time.sleep(0.2)  # all 8 accepted, each on its thread, before the clients come
        payload = {"reward": "bright", "prompts": ["p"], "images": [{"png": remote.png_base64(torch.ones(3, 4, 4))}]}
        answers, failures = [], []

        def client() -> None:
            try:
                answers.append(remote.request_json(f"{url}/score", payload, timeout=5, tries=1)["scores"])
            except RunError as e:
                failures.append(str(e))

        clients = [threading.Thread(target=client) for _ in range(50)]
        asked = time.monotonic()
        for t in clients:
            t.start()
        for t in clients:
            t.join(10)
        answered = time.monotonic() - asked
        assert failures == [] and answers == [[1.0]] * 50, failures[:3]
        assert select.select(stalled, [], [], 0)[0] == [] and answered < 2.5, answered  # all 50 while the 8 are held
        for sock in stalled:
            status, answer = read_answer(sock)
            assert (status, answer) == (408, {"error": "the request headers did not arrive whole within 3 s "
                                                       "(the header timeout)"})  # fmt: skip
        assert 2.95 < time.monotonic() - started < 4.5  # the header timeout, not the read timeout (10 s)
        assert "Traceback" not in capsys.readouterr().err
    finally:
        for sock in stalled:
            sock.close()
        httpd.shutdown()
        httpd.server_close()


def test_headers_over_the_byte_cap_are_a_431_and_the_server_serves_on():
    httpd = remote.serve(lambda n, x, p: x.mean((1, 2, 3)), ["bright"], "127.0.0.1", 0)
    url = serve_on_a_thread(httpd)
    try:
        pads = "".join(f"X-Pad-{k}: {'a' * 2000}\r\n" for k in range(90))  # 90 headers (under http.server's 100)
        raw = f"GET /health HTTP/1.1\r\nHost: x\r\n{pads}\r\n".encode()
        assert len(raw) > remote.HEADER_BYTES == 131_072
        with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
            sock.sendall(raw)
            status, answer = read_answer(sock)
        assert (status, answer) == (431, {"error": "the request headers ran past 131,072 bytes"})
        fewer = "".join(f"X-Pad-{k}: {'a' * 2000}\r\n" for k in range(60))  # 120 KB: read
        within = f"GET /health HTTP/1.1\r\nHost: x\r\n{fewer}\r\n".encode()
        with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
            sock.sendall(within)
            assert read_answer(sock) == (200, {"rewards": ["bright"]})
        with socket.create_connection(("127.0.0.1", port(url)), timeout=5) as sock:
            sock.sendall(request(method="GET", path="/health", Authorization=None))
            assert read_answer(sock) == (200, {"rewards": ["bright"]})
    finally:
        httpd.shutdown()
        httpd.server_close()


def refusal(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `python -m common.rewards serve --reward jpeg --device cpu ARGV`, in this process."""
    with pytest.raises(SystemExit) as stopped:
        rewards.serve_main(["serve", "--reward", "jpeg", "--device", "cpu", *argv])
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag, said",
    [
        (["--max-mb", "inf"], "--max-mb", "must be a finite number (got inf)"),
        (["--request-deadline", "inf"], "--request-deadline", "must be a finite number (got inf)"),
        (["--max-mb", "nan"], "--max-mb", "must be a finite number (got nan)"),
        (["--max-connections", "-1"], "--max-connections", "must be >= 1 (got -1)"),
        (["--port", "70000"], "--port", "must be <= 65535 (got 70000)"),
        (["--port", "-1"], "--port", "must be >= 0 (got -1)"),
        (["--device", "nonsense"], "--device", "'nonsense' is not a device"),
        (["--host", "no-such-host.invalid"], "--host", "no-such-host.invalid: no such address"),
    ],
)
def test_a_flag_the_server_cannot_run_with_is_one_error_line_naming_it_and_status_2(argv, flag, said, capsys):
    code, err = refusal(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} "), err
    assert said in lines[0], err


def test_a_device_this_machine_lacks_is_named_at_start_up(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refusal(["--device", "cuda"], capsys) == (
        2,
        "error: --device cuda: this machine has no cuda device\n",
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert refusal(["--device", "cuda:7"], capsys) == (
        2,
        "error: --device cuda:7: this machine has 2 cuda devices\n",
    )


def test_a_port_in_use_is_one_error_line_and_status_1(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        number = taken.getsockname()[1]
        code, err = refusal(["--port", str(number)], capsys)
    assert code == 1 and err.strip().splitlines() == [
        f"error: --port {number}: Address already in use (another server there? --port 0 takes a free one)"
    ], err
