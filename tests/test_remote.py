"""common/remote.py: rewards scored by another process. The VLM judges against a fake OpenAI-compatible server in a
thread (answers, parsing, retries, a failure that stops the run), the reward server against its client and against
malformed requests (4xx with the reason, and it keeps serving), OCR's edit distance by hand."""

import base64
import functools
import http.client
import inspect
import json
import math
import threading
import urllib.error
import urllib.request
from http.server import HTTPServer, ThreadingHTTPServer

import pytest
import torch
import tyro
from hypothesis import given, settings
from hypothesis import strategies as st

from common import InputError, RunError, remote
from common.rewards import CompositeReward, build_reward, check_rewards, parse_rewards
from tests.vlm import JSONHandler

PROMPTS = ['a sign that says "Hello World"', "a red circle on a blue background"]


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)  # the retries' backoff


def start(server: HTTPServer) -> str:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def fake_vlm(answers: list, calls: list) -> HTTPServer:
    """/v1/models lists 'judge'; each chat completion pops the next answer: a string (the message) or an int (an
    HTTP error status)."""

    class Handler(JSONHandler):
        def do_POST(self):
            calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer = answers.pop(0)
            if isinstance(answer, int):
                return self._reply(answer, {"error": "busy"})
            self._reply(200, {"choices": [{"message": {"content": answer}}]})

    return HTTPServer(("127.0.0.1", 0), Handler)


def test_ocr_score_and_parsing_by_hand():
    assert remote.edit_distance("kitten", "sitting") == 3 and remote.edit_distance("", "abc") == 3
    assert remote.quoted_text(PROMPTS[0]) == "Hello World" and remote.quoted_text("no quotes") is None
    assert remote.quoted_text("a mug with \u201cGood Morning\u201d on it") == "Good Morning"
    assert remote.ocr_score("HELLO world", PROMPTS[0]) == 1.0  # case and spaces do not count
    assert remote.ocr_score("Helo World", PROMPTS[0]) == pytest.approx(1 - 1 / 10)  # one deletion of 10 letters
    assert remote.ocr_score("completely different text", PROMPTS[0]) == 0.0  # clipped at 0
    assert remote.unifiedreward_score("It matches well.\nFinal Score: 4", "") == 4.0
    assert remote.unifiedreward_score("Final Score: **3.5**", "") == 3.5
    assert remote.unifiedreward_score("I cannot tell.", "") is None


def test_edit_distance_counts_a_deletion_inside_and_at_either_end_as_one():
    assert remote.edit_distance("abc", "ac") == 1  # a deletion inside: what the DP's row[j] + 1 move counts
    assert remote.edit_distance("abc", "") == 3 and remote.edit_distance("abcd", "bcd") == 1
    assert remote.edit_distance("ac", "abc") == 1 and remote.edit_distance("abc", "abd") == 1


@settings(max_examples=200, deadline=None)
@given(st.text("abc", max_size=6), st.text("abc", max_size=6))
def test_edit_distance_is_the_levenshtein_recursion(a, b):
    @functools.cache
    def d(i: int, j: int) -> int:  # the textbook recursion on the prefixes a[:i], b[:j]
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    assert remote.edit_distance(a, b) == d(len(a), len(b)) == remote.edit_distance(b, a)


def test_ocr_score_of_one_character_and_of_a_prompt_with_nothing_quoted():
    assert remote.ocr_score("B", 'a sign that says "A"') == 0.0  # 1 - 1 / 1: normalised by the target's length
    assert remote.ocr_score("ab", 'a sign that says "A"') == 0.0  # 1 - min(1, 1) / 1
    assert remote.ocr_score("A", 'a sign that says "A"') == 1.0
    # nothing to render: the target is empty, every answer scores 1 (a group of them gets zero advantage)
    assert remote.ocr_score("anything", "a red circle on a blue background") == 1.0


def test_judge_scores_retries_and_counts_unparsed_answers(monkeypatch):
    calls = []
    answers = [503, "Fine.\nFinal Score: 4", "no score", "still none", "Final Score: 2"]
    url = start(fake_vlm(answers, calls)) + "/v1"
    judge = remote.Judge("unifiedreward", url, concurrency=1, max_unparsed=0.5)
    images = torch.rand(3, 3, 8, 8)
    scores = judge(images, ["a cat", "a dog", "a cow"])
    # image 1: a 503, retried, then 4; image 2: no score twice (asked once more), so the mean of the others; image 3: 2
    assert scores.tolist() == [4.0, 3.0, 2.0] and judge.unparsed.tolist() == [0, 1, 0]
    assert len(calls) == 5 and calls[0]["model"] == "judge" and calls[0]["temperature"] == 0
    content = calls[0]["messages"][0]["content"]
    assert (
        content[0]["image_url"]["url"].startswith("data:image/png;base64,") and "Caption: a cat" in content[1]["text"]
    )
    # through build_reward: the composite logs the unparsed fraction next to the score
    answers += ["Final Score: 5", "Final Score: 3"]
    composite = build_reward(parse_rewards("unifiedreward", urls=[f"unifiedreward={url}"]), "cpu")
    total, parts = composite(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert sorted(total.tolist()) == [3.0, 5.0] and parts["unifiedreward_unparsed"].tolist() == [0, 0]
    assert not parse_rewards("unifiedreward", urls=[f"unifiedreward={url}"]).components[0].differentiable


def test_a_judge_that_keeps_failing_stops_the_run_naming_the_url():
    url = start(fake_vlm([503] * 5, [])) + "/v1"
    judge = remote.Judge("ocr_judge", url)
    with pytest.raises(RunError, match=f"{url}/chat/completions failed after 5 tries.*resume-from latest"):
        judge(torch.rand(1, 3, 8, 8), PROMPTS[:1])
    many_unparsed = remote.Judge("unifiedreward", start(fake_vlm(["?"] * 4, [])) + "/v1", max_unparsed=0.4)
    with pytest.raises(RunError, match="2 of 2 answers had no score"):
        many_unparsed(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_judges_need_a_url_and_a_server_that_answers_at_start_up():
    with pytest.raises(InputError, match="--reward-url ocr_judge=http://HOST:PORT/v1"):
        check_rewards(parse_rewards("ocr_judge"))
    with pytest.raises(RunError, match="http://127.0.0.1:9/v1/models failed after 1 tries"):
        # port 9 (discard): nothing listens
        check_rewards(parse_rewards("ocr_judge", urls=["ocr_judge=http://127.0.0.1:9/v1"]))


def post(url, body, token=None, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_reward_server_scores_for_its_client_and_refuses_bad_requests(monkeypatch):
    seen = []

    def score(name, images, prompts):  # mean brightness: checks that the images arrive as sent
        seen.append((name, images.shape, prompts))
        return images.mean((1, 2, 3))

    url = start(remote.serve(score, ["bright"], "127.0.0.1", 0, token="secret", max_batch=4, max_mb=1))
    client = remote.Served("bright", url, token="secret")
    images = torch.rand(2, 3, 16, 16)
    torch.testing.assert_close(client(images, PROMPTS), (images * 255).round().mean((1, 2, 3)) / 255)
    assert seen == [("bright", (2, 3, 16, 16), PROMPTS)]
    # raw uint8 images are accepted too
    pixels = bytes(range(12))
    body = {
        "reward": "bright",
        "prompts": ["p"],
        "images": [{"uint8": base64.b64encode(pixels).decode(), "shape": [2, 2, 3]}],
    }
    assert post(f"{url}/score", body, "secret") == (200, {"scores": [pytest.approx(5.5 / 255)]})
    # refused with the reason, and the server goes on
    for body, token, raw, code, reason in [
        ({}, None, None, 401, "token"),
        (None, "secret", b"not json", 400, "JSONDecodeError"),
        ({"reward": "dark", "prompts": ["p"], "images": [{"png": ""}]}, "secret", None, 400, "'reward' must be one of"),
        ({"reward": "bright", "prompts": ["p"] * 5, "images": [{"png": ""}] * 5}, "secret", None, 400, "1 to 4"),
        ({"reward": "bright", "prompts": ["p"], "images": [{"path": "/etc/passwd"}]}, "secret", None, 400, "'png' or"),
        ({"reward": "bright", "prompts": ["p"], "images": [{"png": "%%%"}]}, "secret", None, 400, "Error"),
    ]:
        status, answer = post(f"{url}/score", body, token, raw)
        assert status == code and reason in answer["error"], (status, answer)
    # a body over --max-mb is refused from its Content-Length, before it is read
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
    conn.putrequest("POST", "/score")
    conn.putheader("Authorization", "Bearer secret")
    conn.putheader("Content-Length", "2000000")
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 413 and "1 MB" in json.loads(answer.read())["error"]
    conn.close()
    assert client(images, PROMPTS).shape == (2,)
    with pytest.raises(InputError, match="scores \\['bright'\\], not 'hpsv2.1'"):
        remote.Served("hpsv2.1", url, token="secret")


def test_served_scores_arrive_while_the_next_chunk_samples():
    """CompositeReward.request() asks the served components on a background thread as each rollout chunk is done;
    collect() gives what one call on all the chunks gives, and waits only for answers still out (wait_s). A served
    failure raises at collect()."""
    pause = threading.Event().wait  # time.sleep is a no-op in this file (no_waiting)

    def score(name, images, prompts):
        pause(0.3)  # a slow scorer: 0.3 s a chunk
        return images.mean((1, 2, 3))

    url = start(remote.serve(score, ["bright"], "127.0.0.1", 0))
    jpeg = build_reward(parse_rewards("jpeg"), "cpu").components[0][2]
    composite = CompositeReward([("bright", 1.0, remote.Served("bright", url)), ("jpeg", 0.5, jpeg)])
    images, prompts = torch.rand(6, 3, 16, 16), ["a", "b", "c", "d", "e", "f"]
    handles = []
    for c in range(0, 6, 2):
        handles.append(composite.request(images[c : c + 2], prompts[c : c + 2]))
        pause(0.5)  # sampling the next chunk
    total, parts = composite.collect(handles)
    assert composite.wait_s < 0.15, composite.wait_s  # 0.9 s of scoring, all while the chunks were sampled
    expected_total, expected_parts = composite(images, prompts)
    torch.testing.assert_close(total, expected_total)
    assert parts.keys() == expected_parts.keys() == {"bright", "jpeg"}
    torch.testing.assert_close(parts["bright"], expected_parts["bright"])

    # a judge asked chunk by chunk: its unparsed answers are flagged per image, as in one call (an image is asked
    # twice before it counts as unparsed; chunks of one image, so that the answers come in this order)
    answers = ["Final Score: 4", "no score here", "none again", "Final Score: 2"]
    judge_url = start(fake_vlm(answers, [])) + "/v1"
    judge = build_reward(parse_rewards("unifiedreward", urls=[f"unifiedreward={judge_url}"]), "cpu")
    judge.components[0][2].max_unparsed = 1.0  # chunk 2 alone is all unparsed
    total, parts = judge.collect([judge.request(images[i : i + 1], prompts[i : i + 1]) for i in range(3)])
    assert parts["unifiedreward_unparsed"].tolist() == [0.0, 1.0, 0.0] and parts["unifiedreward"][0] == 4.0

    judge_url = start(fake_vlm(["Final Score: 4", 400], [])) + "/v1"
    judge = build_reward(parse_rewards("unifiedreward", urls=[f"unifiedreward={judge_url}"]), "cpu")
    handles = [judge.request(images[:1], prompts[:1]), judge.request(images[1:2], prompts[1:2])]
    with pytest.raises(RunError, match="HTTP 400"):
        judge.collect(handles)


def test_tiny_flux_trains_on_hps_imagereward_and_a_served_judge_that_dies_then_comes_back_slow(
    tmp_path, monkeypatch, capsys, tiny_imagereward
):
    """dancegrpo.py's main() on tiny FLUX with hpsv2.1 + imagereward (tiny random weights) + unifiedreward from a
    tiny random LLaVA behind a local OpenAI-compatible server. The server dies after iteration 1's checkpoint: the
    run ends with one `error:` line naming the URL and that checkpoint intact. Back (on the same port) but slow, the
    resumed run completes iteration 2 and logs every component and the time it waited for the judge."""

    import dancegrpo as D
    from common import flags, runs
    from tests.helpers import find_run, metrics
    from tests.test_dancegrpo import TINY_RUN
    from tests.tiny import build_flux, build_tiny_hps
    from tests.vlm import TinyJudge

    hps = build_tiny_hps(tmp_path)
    from tests.tiny import use_tiny_hps

    use_tiny_hps(monkeypatch)
    build_flux(tmp_path / "flux")
    (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
    judge = TinyJudge()
    argv = [*TINY_RUN, "--save-every", "1", "--output-dir", str(tmp_path), "--exp-name", "flux"]
    argv += ["--model-id", str(tmp_path / "flux"), "--resolution", "32", "--guidance-scale", "3.5"]
    argv += ["--prompts", str(tmp_path / "prompts.txt"), "--eval-prompts", str(tmp_path / "prompts.txt")]
    argv += ["--reward", "hpsv2.1:1,imagereward:1,unifiedreward:1", "--reward-ckpt", f"hpsv2.1={hps}"]
    argv += ["--reward-ckpt", f"imagereward={tiny_imagereward[1]}", "--reward-url", f"unifiedreward={judge.url}"]
    argv += ["--lora", "--lora-rank", "4", "--gradient-checkpointing", "--offload-frozen"]  # as the GPU recipes
    checkpoint = runs.Run.checkpoint

    def checkpoint_then_kill_the_judge(self, iteration, final=False):
        checkpoint(self, iteration, final)
        if iteration == 1:
            judge.stop()

    monkeypatch.setattr(runs.Run, "checkpoint", checkpoint_then_kill_the_judge)
    monkeypatch.setattr("sys.argv", ["dancegrpo.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        flags.cli(D.main, D.Args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert stopped.value.code == 1 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and f"{judge.url}/chat/completions failed after 5 tries" in errors[0], errors
    run = find_run(tmp_path / "flux")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001"]

    monkeypatch.setattr(runs.Run, "checkpoint", checkpoint)
    slow = TinyJudge(port=judge.port, delay=0.2)  # back on the same port, 0.2 s an answer
    D.main(tyro.cli(D.Args, args=[*argv, "--resume-from", "latest"]))
    train = [r for r in metrics(tmp_path / "flux") if "losses/policy" in r]
    assert [r["iteration"] for r in train] == [1, 2] and all(r["losses/first_ratio_max_dev"] == 0 for r in train)
    for name in ("hpsv2.1", "imagereward", "unifiedreward"):
        assert all(math.isfinite(r[f"rewards/{name}"]) for r in train), name
    assert train[1]["rewards/unifiedreward_unparsed"] == 0 and train[1]["perf/reward_wait_s"] > 0.1
    assert slow.requests >= 8  # iteration 2's samples, and the final evaluation
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
    slow.stop()


def test_the_weighted_sum_is_checked_where_it_is_formed_not_only_each_score():
    """Each component finite, what trains not: 2e38 + 2e38 overflows float32 to inf; 3e38 alone is finite but its
    batch's mean and spread (what every script's advantages take) are not. Both stop with one RunError naming
    --reward; 1e18 passes (4 x 2 x 1e36 is finite)."""

    def constant(value):
        return lambda images, prompts: torch.full((len(images),), value)

    class Local:
        differentiable, video, parts = False, False, None

        def __init__(self, value):
            self.fn = constant(value)

        def __call__(self, images, prompts):
            return self.fn(images, prompts)

    images, prompts = torch.zeros(2, 3, 4, 4), ["a", "b"]
    spec = parse_rewards("shapes:1,verifier:1")
    both = CompositeReward([("shapes", 1.0, Local(2e38)), ("verifier", 1.0, Local(2e38))], spec=spec)
    with pytest.raises(
        RunError, match=r"weighted sum \(--reward shapes:1,verifier:1\) is inf for image 0 \(prompt 'a'\)"
    ):
        both(images, prompts)
    alone = CompositeReward([("shapes", 1.0, Local(3e38))], spec=parse_rewards("shapes"))
    with pytest.raises(
        RunError, match=r"\(--reward shapes\) reaches 3e\+38 \(image 0\), too large for its batch's mean"
    ):
        alone(images, prompts)
    total, parts = CompositeReward([("shapes", 1.0, Local(1e18))], spec=parse_rewards("shapes"))(images, prompts)
    assert torch.equal(total, torch.full((2,), 1e18)) and torch.isfinite(total.square().sum() * 4)


class Recorder:
    """An OpenAI-compatible judge and a reward server in one, which records each request as it arrived: (method,
    raw path, Authorization header, JSON body or None) and the most requests it held at once. A chat answer is chosen
    by the caption in the request's text: `answers[caption]` (a string, None for a null content, or a dict sent as the
    whole answer); /score answers `scores`; /health answers `health`; any other GET lists `models`."""

    def __init__(self, answers=None, scores=None, health=None, models=None, hold=0.0):
        self.answers, self.scores, self.health = answers or {}, scores, health or {"rewards": ["jpeg"]}
        self.models = [{"id": "judge"}] if models is None else models
        self.requests, self.lock, self.in_flight, self.most, self.hold = [], threading.Lock(), 0, 0, hold
        rec = self

        class Handler(JSONHandler):
            def _record(self, body):
                with rec.lock:
                    rec.requests.append((self.command, self.path, self.headers.get("Authorization"), body))

            def do_GET(self):
                self._record(None)
                self._reply(200, rec.health if self.path.endswith("/health") else {"data": rec.models})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._record(body)
                if self.path.endswith("/score"):
                    return self._reply(200, {"scores": rec.scores})
                with rec.lock:
                    rec.in_flight += 1
                    rec.most = max(rec.most, rec.in_flight)
                threading.Event().wait(rec.hold)  # not time.sleep, a no-op in this file
                with rec.lock:
                    rec.in_flight -= 1
                caption = body["messages"][0]["content"][1]["text"].rpartition("Caption: ")[2].split("\n")[0]
                answer = rec.answers.get(caption, "Final Score: 3")
                self._reply(
                    200, answer if isinstance(answer, dict) else {"choices": [{"message": {"content": answer}}]}
                )

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # not 5: 16 connections at once must not wait for a SYN's retransmission

        self.url = start(Server(("127.0.0.1", 0), Handler))


@pytest.fixture
def calls(monkeypatch):
    """Each request_json call as (url, token, timeout, tries), its arguments bound to their names."""
    made, real = [], remote.request_json

    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        made.append(tuple(bound.arguments[k] for k in ("url", "token", "timeout", "tries")))
        return real(*args, **kwargs)

    monkeypatch.setattr(remote, "request_json", spy)
    return made


def test_the_judge_asks_what_the_chat_completions_protocol_asks_by_hand(calls):
    rec = Recorder()
    judge = remote.Judge(
        "unifiedreward", rec.url + "/X/", token="tok", timeout=7.5
    )  # a trailing "/" (and "X") to strip
    image = torch.rand(1, 3, 8, 8)
    assert judge(image, ["a cat"]).tolist() == [3.0]
    text = remote.UNIFIEDREWARD_PROMPT.format(prompt="a cat")
    body = {
        "model": "judge",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + remote.png_base64(image[0])}},
                    {"type": "text", "text": text},
                ],
            }
        ],
        "temperature": 0.0,
        "max_tokens": 512,
    }
    assert rec.requests == [
        ("GET", "/X/models", "Bearer tok", None),
        ("POST", "/X/chat/completions", "Bearer tok", body),
    ]
    # /models at start-up: 10 s a try, 2 tries; each answer: the judge's timeout, request_json's 5 tries
    assert calls == [(rec.url + "/X/models", "tok", 10, 2), (rec.url + "/X/chat/completions", "tok", 7.5, 5)]
    calls.clear()
    remote.Judge("unifiedreward", rec.url + "/v1")(image, ["a cat"])
    assert calls[1][2] == 120.0  # the default timeout of an answer
    rec.requests.clear()
    remote.request_json(rec.url, tries=1)  # a URL without a path asks for "/"
    assert rec.requests == [("GET", "/", None, None)]


def test_the_judge_asks_16_at_a_time_and_stops_past_a_tenth_unparsed():
    """The defaults are what a run uses (build_reward passes none): 16 answers in flight, and a batch stops when
    more than 10% of its answers have no score (1 of 10 passes, exactly at the limit; 2 of 10 stop)."""
    rec = Recorder(answers={"x0": "no score", "x1": "none either"}, hold=0.5)
    judge = remote.Judge("unifiedreward", rec.url + "/v1")
    scores = judge(torch.rand(20, 3, 8, 8), [f"p{k}" for k in range(20)])
    assert rec.most == 16 and scores.tolist() == [3.0] * 20
    rec.hold = 0.0
    prompts = ["x0"] + [f"p{k}" for k in range(9)]
    assert judge(torch.rand(10, 3, 8, 8), prompts).tolist() == [3.0] * 10  # the unparsed one gets the mean, 3
    assert judge.unparsed.tolist() == [1.0] + [0.0] * 9
    with pytest.raises(RunError, match="2 of 10 answers had no score"):
        judge(torch.rand(10, 3, 8, 8), ["x0", "x1"] + [f"p{k}" for k in range(8)])
    everyone = remote.Judge("unifiedreward", rec.url + "/v1", max_unparsed=1.0)  # no parsed score to take the mean of
    assert everyone(torch.rand(2, 3, 8, 8), ["x0", "x1"]).tolist() == [0.0, 0.0] and everyone.unparsed.tolist() == [
        1,
        1,
    ]


def test_the_ocr_judge_reads_its_caption_and_a_null_answer_as_no_text():
    rec = Recorder(answers={remote.OCR_PROMPT: None})  # the OCR request holds no caption: the client reads it
    judge = remote.Judge("ocr_judge", rec.url + "/v1")
    assert judge(torch.rand(1, 3, 8, 8), ['a sign that says "XXXX"']).tolist() == [0.0]  # "" is 4 edits from XXXX
    rec.answers = {remote.OCR_PROMPT: "HI"}
    assert judge(torch.rand(1, 3, 8, 8), ['a sign that says "Hi"']).tolist() == [1.0]
    rec.answers = {remote.OCR_PROMPT: "Ho"}
    assert judge(torch.rand(1, 3, 8, 8), ['a sign that says "Hi"']).tolist() == [0.5]


def test_what_is_not_a_chat_completion_or_a_model_list_is_named_in_the_error():
    rec = Recorder(answers={"a": {"choices": []}, "b": {"error": "x" * 400}})
    judge = remote.Judge("unifiedreward", rec.url + "/v1")
    with pytest.raises(RunError) as e:
        judge(torch.rand(1, 3, 8, 8), ["a"])
    assert str(e.value) == f"{rec.url}/v1/chat/completions: not a chat completion: {{'choices': []}}"
    with pytest.raises(RunError) as e:
        judge(torch.rand(1, 3, 8, 8), ["b"])
    assert str(e.value) == f"{rec.url}/v1/chat/completions: not a chat completion: {str({'error': 'x' * 400})[:300]}"
    rec.models = []
    with pytest.raises(InputError) as e:
        remote.Judge("ocr_judge", rec.url + "/v1/")
    assert str(e.value) == f"--reward-url ocr_judge={rec.url}/v1/: {rec.url}/v1/models lists no model"


def test_the_served_client_asks_health_then_score_by_hand(calls):
    rec = Recorder(scores=[1, 2])  # whole numbers in JSON: the scores are float32 all the same
    client = remote.Served("jpeg", rec.url + "/X/", token="tok", timeout=7.5)  # a trailing "/" (and "X") to strip
    scores = client(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 2.0]
    assert [r[:3] for r in rec.requests] == [("GET", "/X/health", "Bearer tok"), ("POST", "/X/score", "Bearer tok")]
    assert calls == [(rec.url + "/X/health", "tok", 10, 2), (rec.url + "/X/score", "tok", 7.5, 5)]
    calls.clear()
    remote.Served("jpeg", rec.url)(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert calls[1][2] == 300.0  # the default timeout of a batch's scores
    # through build_reward, as a run builds it: a registered reward with a URL is served
    composite = build_reward(parse_rewards("jpeg", urls=[f"jpeg={rec.url}"]), "cpu", offload=True)
    assert composite(torch.rand(2, 3, 8, 8), ["a", "b"])[0].tolist() == [1.0, 2.0]
    rec.health = {"status": "o" * 300}
    with pytest.raises(InputError) as e:
        remote.Served("jpeg", rec.url)
    assert str(e.value).startswith(
        f"--reward-url jpeg={rec.url}: {rec.url}/health answered {json.dumps(rec.health)[:200]}, not a reward server's"
    )
