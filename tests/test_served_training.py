"""A training run whose reward is served (--reward-url shapes=URL on ShapesBench) fails closed. dancegrpo.py's main()
runs in this process against a fake reward server on 127.0.0.1 that scores with ShapesBench's learned reward while it
answers well: the clean run evaluates and draws its sample grids through it too. A second run's server goes wrong after iteration 1's
checkpoint, then answers each bad kind in turn to a resume: NaN, inf, nested lists, booleans, strings, a JSON list,
an answer cut off mid-body, a redirect to another server (which must never be asked, nor see the token), finite
scores too large for their batch's mean and spread (each served number passes, what trains would be NaN). Each ends in exactly one `error:` line naming the URL and the fault, exit status 1, no
traceback, iteration 1's checkpoint intact. Answering 429 once and then well, the last resume finishes with weights
bitwise equal to the clean run's."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import dancegrpo as D
from common import flags, remote
from common.rewards import REWARDS
from tests.helpers import assert_same_trained_weights, find_run, metrics
from tests.test_dancegrpo import TINY_RUN

FLAGS = [*TINY_RUN, "--save-every", "1"]  # 2 iterations of 2 chunks: 2 /score requests an iteration
BAD = {  # what the server sends for /score: (status, body bytes), and what the error line must name
    "nan": (200, b'{"scores": [NaN, 0.5, 0.5, 0.5]}', "scores[0] is nan"),
    "inf": (200, b'{"scores": [0.5, Infinity, 0.5, 0.5]}', "scores[1] is inf"),
    "nested": (200, b'{"scores": [[0.5], [0.5], [0.5], [0.5]]}', "scores[0]"),
    "booleans": (200, b'{"scores": [true, false, true, true]}', "scores[0]"),
    "strings": (200, b'{"scores": ["0.5", "0.5", "0.5", "0.5"]}', "scores[0]"),
    "a list": (200, b"[0.5, 0.5, 0.5, 0.5]", "not an object"),
    "cut off": (200, None, "broke off"),
    "redirect": (307, b"", "HTTP 307, a redirect to 'http://127.0.0.1:"),
    "overflow": (
        200,
        b'{"scores": [3e38, 3e38, -3e38, 3e38]}',
        "the rewards' weighted sum (--reward shapes) reaches 3e+38",
    ),
}
ELSEWHERE = []  # the Authorization header of every request the redirect's target received


class FakeRewardServer(BaseHTTPRequestHandler):
    """GET /health; POST /score: ShapesBench's learned reward on the decoded PNGs while `mode` is 'good' (after `good`
    more requests in another mode, that mode starts), else the mode's bad answer; '429' answers 429 once, then well."""

    state = {"mode": "good", "good": 0}
    shapes = REWARDS["shapes"].factory("cpu")

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        if 300 <= status < 400:  # to a port of this server, under another path: a request there is recorded
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/elsewhere")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"rewards": ["shapes"]}).encode())

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/elsewhere":
            ELSEWHERE.append(self.headers.get("Authorization"))
            return self._send(200, json.dumps({"scores": [0.5] * len(request["prompts"])}).encode())
        state = self.state
        mode = state["mode"] if state["good"] <= 0 else "good"
        state["good"] -= 1
        if mode == "429":
            state["mode"] = "good"
            return self._send(429, b'{"error": "busy"}')
        if mode in BAD:
            status, body, _ = BAD[mode]
            if body is None:  # 10 bytes of a promised 100, then the connection closes
                return self._send(200, b'{"scores":', length=100)
            return self._send(status, body)
        with torch.no_grad():
            scores = self.shapes(remote.decode_images(request["images"]), request["prompts"])
        self._send(200, json.dumps({"scores": scores.tolist()}).encode())

    def log_message(self, *a):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)  # retries without their backoff waits
    monkeypatch.setenv("REWARD_API_KEY", "secret")
    ELSEWHERE.clear()
    FakeRewardServer.state.update(mode="good", good=0)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeRewardServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def run(argv, monkeypatch, capsys) -> tuple[int, list[str], str]:
    """main() through flags.cli, as `python dancegrpo.py ARGV` runs it: (exit status, error lines, stderr)."""
    monkeypatch.setattr("sys.argv", ["dancegrpo.py", *argv])
    try:
        flags.cli(D.main, D.Args)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


def test_a_served_reward_that_answers_wrong_stops_the_run_and_a_resume_finishes_it(
    server, tmp_path, monkeypatch, capsys
):
    served = ["--reward-url", f"shapes={server}", "--output-dir", str(tmp_path)]
    code, errors, err = run([*FLAGS, *served, "--exp-name", "clean"], monkeypatch, capsys)
    assert code == 0 and not errors, err[-2000:]
    evals = [r for r in metrics(find_run(tmp_path / "clean")) if "eval/reward" in r]  # the evaluator, served too
    assert [r["iteration"] for r in evals] == [0, 2] and all(0 < r["eval/reward"] < 1 for r in evals)

    argv = [*FLAGS, *served, "--exp-name", "faulty", "--eval-every", "0", "--sample-every", "0"]  # training alone
    for k, mode in enumerate(BAD):
        FakeRewardServer.state.update(mode=mode, good=2 if k == 0 else 0)  # the first run: iteration 1 scored well
        code, errors, err = run(argv + (["--resume-from", "latest"] if k else []), monkeypatch, capsys)
        assert code == 1 and "Traceback" not in err, (mode, err[-2000:])
        assert (
            len(errors) == 1 and (f"{server}/score" in errors[0] or mode == "overflow") and BAD[mode][2] in errors[0]
        ), (mode, errors)
        checkpoints = find_run(tmp_path / "faulty") / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_000001"], mode
    assert ELSEWHERE == []  # the redirect was not followed: its target never saw a request, nor the token
    FakeRewardServer.state.update(mode="429", good=0)
    code, errors, err = run([*argv, "--resume-from", "latest"], monkeypatch, capsys)
    assert code == 0 and not errors and FakeRewardServer.state["mode"] == "good", err[-2000:]  # a 429, retried
    assert_same_trained_weights(tmp_path / "clean", tmp_path / "faulty")


def test_the_evaluator_stops_at_a_redirect_with_its_own_advice(server, tmp_path, monkeypatch, capsys):
    """python -m common.evaluate, scored by a server that redirects: exit status 1, one `error:` line that says
    what its user can do (run it again: the cache keeps what was scored), not --resume-from (a training flag)."""
    from common import evaluate as E

    FakeRewardServer.state.update(mode="redirect", good=0)
    argv = ["--num-steps", "2", "--samples-per-prompt", "1", "--max-prompts", "4", "--batch-size", "4", "--reward",
            "shapes", "--reward-url", f"shapes={server}", "--grid-prompts", "2", "--out", str(tmp_path / "eval")]  # fmt: skip
    monkeypatch.setattr("sys.argv", ["common/evaluate.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        flags.cli(E.main, E.EvalArgs)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert stopped.value.code == 1 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{server}/score answered HTTP 307, a redirect to" in errors[0] and "--resume-from" not in errors[0]
    assert errors[0].endswith("the evaluation stops here, the batches scored so far cached under --out: the same "
                              "command, run again, goes on")  # fmt: skip
    assert ELSEWHERE == []
