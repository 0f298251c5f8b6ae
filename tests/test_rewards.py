"""Rewards: spec parsing, the weighted composite, JPEG, and the real-model rewards (HPSv2.1, PickScore, CLIP)
built from tiny random-weight models saved to disk, so the loading, preprocessing and gradient paths run offline."""

import shutil
import sys
import types

import pytest
import torch
from PIL import Image

from common import rewards
from common.rewards import REWARDS, RewardKind, ScoreFn, build_reward, parse_rewards
from tests.tiny import build_tiny_clip, build_tiny_hps

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def uint8_images(b, h, w, seed=0):
    """Smooth random images on the uint8 grid, so the PIL reference paths see exactly the same pixels. (b,3,h,w)

    Smooth because the reference processors resize uint8 images in two rounded passes, which departs from the
    float path by far more than rounding on pixel noise (bicubic overshoot clipped between the passes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.interpolate(torch.rand(b, 3, 6, 6, generator=g), size=(h, w), mode="bilinear")
    return (x * 255).round() / 255


def to_pil(image):
    return Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())


def assert_finite_grad(reward, images, prompts):
    images = images.clone().requires_grad_(True)
    scores = reward(images, prompts)
    assert scores.shape == (len(images),) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    scores.sum().backward()
    assert torch.isfinite(images.grad).all() and images.grad.abs().sum() > 0
    return scores.detach()


# ---------------------------------------------------------------- spec parsing
def weights(spec: str, *a) -> list[tuple[str, float]]:
    return [(c.name, c.weight) for c in parse_rewards(spec, *a).components]


def build(spec: str, *a, **kw):
    """The composite of --reward spec (with --reward-ckpt items *a), on the CPU."""
    return build_reward(parse_rewards(spec, *a), "cpu", **kw)


def test_parse_rewards_valid():
    assert weights("shapes:1.0,verifier:0.5") == [("shapes", 1.0), ("verifier", 0.5)]
    assert weights("shapes") == [("shapes", 1.0)]
    assert weights(" hps : 2 , jpeg:-0.5") == [("hpsv2.1", 2.0), ("jpeg", -0.5)]  # alias, spaces, sign
    assert weights("hpsv2.1:0") == [("hpsv2.1", 0.0)]  # the dot in the name is not a separator
    spec = parse_rewards("hps:2,unifiedreward:1", ["hps=/w.pt"], ["unifiedreward=http://h:8/v1"])  # paths, URLs apart
    assert [(c.path, c.url) for c in spec.components] == [("/w.pt", None), (None, "http://h:8/v1")]
    assert spec.path("hpsv2.1") == "/w.pt" and spec.weights == {"hpsv2.1": 2.0, "unifiedreward": 1.0}
    assert [c.differentiable for c in spec.components] == [True, False]
    served = parse_rewards("hps", [], ["hps=http://h:8"]).components[0]  # a reward scored by another process
    assert served.url == "http://h:8" and served.path is None and not served.differentiable


@pytest.mark.parametrize(
    "spec", ["shapes:abc", "shapes:", "", ",", "shapes,,jpeg", ":1", "shapes:nan", "shapes:1,shapes:2", "hps,hpsv2.1"]
)
def test_parse_rewards_malformed(spec):
    with pytest.raises(ValueError, match="--reward name:weight,name:weight"):
        parse_rewards(spec)


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match="--reward") as e:
        parse_rewards("shapes:1,hpsv9:1")
    assert "hpsv9" in str(e.value) and all(name in str(e.value) for name in REWARDS)


def test_checkpoint_for_unused_reward_is_rejected():
    with pytest.raises(ValueError, match="--reward-ckpt"):
        build("jpeg", ["hps=/x.pt"])
    with pytest.raises(ValueError, match="--reward-ckpt"):
        build("jpeg", ["jpeg=/x.pt"])  # jpeg takes none
    with pytest.raises(ValueError, match="--reward-ckpt: unknown reward 'hpsv9'"):
        build("jpeg", ["hpsv9=/x.pt"])
    with pytest.raises(ValueError, match="give one --reward-ckpt or --reward-url, not two"):
        parse_rewards("hps", ["hps=/x.pt"], ["hpsv2.1=http://h:8"])


# ---------------------------------------------------------------- composite and JPEG
@pytest.fixture
def dummy(monkeypatch):
    """A cheap differentiable reward: mean brightness."""
    brightness = lambda device, checkpoint=None: ScoreFn(lambda x, p: x.mean((1, 2, 3)), True)  # noqa: E731
    monkeypatch.setitem(REWARDS, "dummy", RewardKind(brightness, differentiable=True))


def test_register_reward_adds_a_name_once_and_says_whether_it_is_differentiable(monkeypatch):
    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))  # the registrations here end with the test
    rewards.register_reward(
        "dark", lambda device, checkpoint=None: ScoreFn(lambda x, p: -x.mean((1, 2, 3)), False), False
    )
    assert not parse_rewards("dark").components[0].differentiable
    assert parse_rewards("hps").components[0].differentiable  # an alias of hpsv2.1
    total, _ = build("dark")(torch.ones(2, 3, 8, 8), PROMPTS)
    assert torch.equal(total, -torch.ones(2))
    with pytest.raises(ValueError, match="registered already"):
        rewards.register_reward("jpeg", rewards.jpeg, False)
    rewards.register_reward(
        "liar", lambda device, checkpoint=None: ScoreFn(lambda x, p: x.mean((1, 2, 3)), True), False
    )
    with pytest.raises(ValueError, match="registered with differentiable=False"):
        build("liar")
    assert not rewards.unregister_reward("dark").differentiable  # its entry back, and the name free again
    with pytest.raises(rewards.InputError, match="unknown reward 'dark'"):
        parse_rewards("dark")
    with pytest.raises(ValueError, match="'dark' is not registered"):
        rewards.unregister_reward("dark")
    rewards.register_reward("dark", rewards.jpeg, False)  # registered again, now as another reward
    assert rewards.REWARDS["dark"].factory is rewards.jpeg


def test_composite_weights_and_components(dummy):
    images = torch.rand(3, 3, 32, 32)
    images[0] = 0.5  # a flat image, so the two components disagree on the ranking
    reward = build("jpeg:0.3,dummy:-2")
    total, scores = reward(images, PROMPTS + ["x"])
    jpeg, bright = REWARDS["jpeg"].factory("cpu")(images, PROMPTS + ["x"]), images.mean((1, 2, 3))
    assert set(scores) == {"jpeg", "dummy"}
    assert torch.equal(scores["jpeg"], jpeg) and torch.equal(scores["dummy"], bright)
    assert torch.equal(total, 0.3 * jpeg + -2 * bright)
    assert not reward.differentiable  # jpeg has a nonzero weight


def test_composite_zero_weight_is_logged_only(dummy):
    images = uint8_images(2, 16, 16).requires_grad_(True)
    reward = build("dummy:2,jpeg:0")
    assert reward.differentiable  # a zero-weight jpeg does not make the sum non-differentiable
    total, scores = reward(images, PROMPTS)
    assert torch.equal(total, 2 * images.mean((1, 2, 3))) and scores["jpeg"].shape == (2,)
    total.sum().backward()
    assert torch.allclose(images.grad, torch.full_like(images, 2 / images[0].numel()))


def test_jpeg_prefers_flat_images():
    images = torch.cat([torch.full((1, 3, 64, 64), 0.4), torch.rand(1, 3, 64, 64)])
    scores = REWARDS["jpeg"].factory("cpu")(images, PROMPTS)
    assert scores.shape == (2,) and scores.dtype == torch.float32 and (scores < 0).all()
    assert scores[0] > scores[1]


# ---------------------------------------------------------------- ShapesBench rewards
def test_shapes_wiring(monkeypatch):
    """Factories call common.shapesbench lazily with the checkpoint and device (a stand-in module here)."""
    calls = {}

    def load_reward_model(path=None, device="cpu"):
        calls.update(path=path, device=device)
        return lambda x, p: x.mean((1, 2, 3))

    fake = types.SimpleNamespace(load_reward_model=load_reward_model, verifier_reward=lambda x, p: x.amax((1, 2, 3)))
    monkeypatch.setitem(sys.modules, "common.shapesbench", fake)
    reward = build("shapes:1,verifier:0", ["shapes=ckpt"])
    assert calls == {"path": "ckpt", "device": "cpu"} and reward.differentiable
    images = uint8_images(2, 32, 32)
    _, scores = reward(images, PROMPTS)
    assert torch.equal(scores["verifier"], images.amax((1, 2, 3)))


def test_verifier_real():
    pytest.importorskip("common.shapesbench")
    scores = build("verifier")(uint8_images(2, 32, 32), PROMPTS)[1]["verifier"]
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_shapes_real():
    shapes = pytest.importorskip("common.shapesbench")
    if not (shapes.REWARD_PATH / "model" / "config.json").exists():
        pytest.skip("the ShapesBench reward model is not trained yet (python -m common.shapesbench.train_reward)")
    assert_finite_grad(REWARDS["shapes"].factory("cpu"), uint8_images(2, 32, 32), PROMPTS)


# ---------------------------------------------------------------- HPSv2.1 with a tiny open_clip model
@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    return build_tiny_hps(tmp_path_factory.mktemp("hps"))


@pytest.mark.parametrize("size", [(64, 64), (96, 160)])  # square; non-square exercises the padding
def test_hps_matches_open_clip_pil_path(tiny_hps, size):
    import open_clip

    reward = REWARDS["hpsv2.1"].factory("cpu", tiny_hps, arch="tiny-hps")
    images = uint8_images(2, *size)
    scores = assert_finite_grad(reward, images, PROMPTS)

    # hand computation: open_clip's eval transform with HPS's resize mode, on PIL images
    model, _, preprocess = open_clip.create_model_and_transforms("tiny-hps", image_resize_mode="longest")
    model.load_state_dict(torch.load(tiny_hps)["state_dict"])
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(to_pil(x)) for x in images]), normalize=True)
        txt = model.encode_text(open_clip.get_tokenizer("tiny-hps")(PROMPTS), normalize=True)
    torch.testing.assert_close(scores, (img * txt).sum(-1), atol=5e-4, rtol=0)  # PIL rounds resized pixels to uint8


def test_hps_offline_without_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub

    # an empty cache, whatever this machine has downloaded
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"--reward-ckpt hpsv2.1=/path/to/HPS_v2.1_compressed.pt"):
        build("hps")
    with pytest.raises(ValueError, match="no such file"):
        build("hps", [f"hps={tmp_path / 'missing.pt'}"])


# ---------------------------------------------------------------- PickScore / CLIP with a tiny transformers CLIPModel
@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A folder with a tiny random CLIPModel, the real CLIP BPE tokenizer (built offline from open_clip's vocab
    file) and a CLIPImageProcessor at 64 px, as --reward-ckpt expects."""
    d = tmp_path_factory.mktemp("clip")
    build_tiny_clip(d)
    return str(d)


@pytest.fixture(scope="module")
def clip_setup(tiny_clip):
    """Both rewards loaded through --reward-ckpt, plus the reference model and processor (loading takes ~1 s)."""
    from transformers import CLIPModel, CLIPProcessor

    rewards = {name: REWARDS[name].factory("cpu", tiny_clip) for name in ("pickscore", "clip")}
    return rewards, CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)


@pytest.mark.parametrize("name", ["pickscore", "clip"])
@pytest.mark.parametrize("size", [(64, 64), (48, 80), (100, 70)])  # square; shortest side is height, then width
def test_clip_rewards_match_processor_pil_path(clip_setup, name, size):
    rewards, model, processor = clip_setup
    images = uint8_images(2, *size)
    scores = assert_finite_grad(rewards[name], images, PROMPTS)

    inputs = processor(text=PROMPTS, images=[to_pil(x) for x in images], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()  # logit_scale.exp() * cosine
    expected = logits if name == "pickscore" else 100 * logits / model.logit_scale.exp()
    torch.testing.assert_close(scores, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("size", [(64, 64), (48, 80)])
def test_aesthetic_matches_the_reference_computation(tiny_clip, tmp_path, size):
    """The LAION aesthetic predictor v2 on a tiny CLIP and a random MLP saved under the original's keys, against the
    reference computation written here: CLIP's projected image embedding, L2-normalised, through the five linear
    layers one by one (no activations). Exactly on the same pixels; within the preprocessing's rounding on
    CLIPProcessor's PIL path."""
    from transformers import CLIPModel, CLIPProcessor

    from common.rewards import aesthetic, clip_pixels

    folder = tmp_path / "aesthetic"
    shutil.copytree(tiny_clip, folder)
    g, dims, state = torch.Generator().manual_seed(1), [32, 1024, 128, 64, 16, 1], {}  # 32: the tiny projection
    for n, i in enumerate((0, 2, 4, 6, 7)):  # Linear layers between the original's dropouts
        state[f"layers.{i}.weight"] = torch.randn(dims[n + 1], dims[n], generator=g) / dims[n] ** 0.5
        state[f"layers.{i}.bias"] = 0.1 * torch.randn(dims[n + 1], generator=g)
    torch.save(state, folder / "sac+logos+ava1-l14-linearMSE.pth")
    reward = aesthetic("cpu", str(folder))
    images = uint8_images(2, *size)
    scores = assert_finite_grad(reward, images, PROMPTS)
    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)

    def reference(pixels):
        with torch.no_grad():
            x = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
            x = x / x.norm(dim=-1, keepdim=True)
            for i in (0, 2, 4, 6, 7):
                x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
        return x[:, 0]

    torch.testing.assert_close(scores, reference(clip_pixels(images, processor)), atol=1e-5, rtol=1e-5)
    # CLIPProcessor's uint8 PIL path rounds twice (the CLIP tests above bound it); a random head amplifies it
    expected = reference(processor(images=[to_pil(x) for x in images], return_tensors="pt").pixel_values)
    torch.testing.assert_close(scores, expected, atol=1e-2 * expected.abs().max().item(), rtol=0)
    (folder / "second.pth").write_bytes(b"")  # two candidate MLPs: refused, with the count
    with pytest.raises(ValueError, match="expected one .pth"):
        aesthetic("cpu", str(folder))


@pytest.mark.parametrize("name", ["pickscore", "clip", "aesthetic"])
def test_clip_rewards_offline_without_checkpoint(tmp_path, monkeypatch, name):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=f"--reward-ckpt {name}="):
        build(name)


def test_each_refusal_of_check_rewards_by_hand(monkeypatch, tmp_path):
    """check_rewards at start-up: each refusal whole, and what it asks of a served reward and of hub weights."""
    from common.rewards import check_rewards
    from common.rewards import parse_rewards as spec

    def refused(**kw):
        with pytest.raises(rewards.InputError) as e:
            check_rewards(**kw)
        return str(e.value)

    assert refused(spec=spec("jpeg:0,verifier:0")) == (
        "--reward jpeg:0,verifier:0: every weight is 0, so no reward trains the model (weight 0 logs only)"
    )
    # the differentiable rewards of images, as the registry has them now (a fork's own registered from its script
    # joins them): common/'s own, each once, in the order they were registered, and no other kind of reward
    good = [name for name, kind in REWARDS.items() if kind.differentiable and not kind.video]
    own = ["shapes", "hpsv2.1", "pickscore", "clip", "aesthetic", "imagereward", "hpsv3"]
    assert [name for name in good if name in own] == own and not {"jpeg", "verifier", "temporal"} & set(good)
    assert refused(spec=spec("shapes,verifier:0.5,jpeg"), differentiable=True) == (
        "--reward shapes,verifier:0.5,jpeg: verifier, jpeg is not differentiable, and this script backpropagates "
        f"through the reward (RLR's first-order term); use a differentiable one ({', '.join(good)}, not served over "
        "--reward-url) or give it weight 0 to log it"
    )
    check_rewards(spec("shapes,verifier:0"), differentiable=True)  # weight 0: logged only, no gradient needed
    check_rewards(spec("jpeg"))  # not asked to be differentiable
    assert refused(spec=spec("verifier"), real_model="flux") == (
        "--reward verifier: verifier is ShapesBench's, for --model-id shapesbench only; with --model-id flux pass a "
        "reward of real images, e.g. --reward hpsv2.1 (or pickscore, clip, aesthetic, jpeg)"
    )
    assert refused(spec=spec("shapes,verifier"), real_model="sd35").startswith(
        "--reward shapes,verifier: shapes and verifier are ShapesBench's, for --model-id shapesbench only; with "
        "--model-id sd35 pass"
    )
    check_rewards(spec("shapes,verifier"))  # on ShapesBench
    assert refused(spec=spec("temporal"), video=True, frames=1) == (
        "--reward temporal: temporal compares neighbouring frames, and --num-frames 1 gives one"
    )
    check_rewards(spec("temporal"), video=True, frames=2)
    assert refused(spec=spec("temporal"), frames=2) == (
        "--reward temporal: 'temporal' scores videos, and --model-id gives images"
    )
    assert refused(spec=spec("ocr_judge")) == rewards._needs_url("ocr_judge")
    assert refused(spec=spec("jpeg:0.5", ckpts=[f"jpeg={tmp_path / 'none'}"])) == (
        f"--reward-ckpt jpeg={tmp_path / 'none'}: no such file or folder"
    )
    check_rewards(spec("jpeg:0.5", ckpts=[f"jpeg={tmp_path}"]))  # a path that exists
    # served: one try of /models (a judge) or /health, 10 s, with the token; hub weights: looked up, not downloaded
    asked, hub = [], []
    monkeypatch.setattr(rewards, "request_json", lambda url, **kw: asked.append((url, kw)))
    monkeypatch.setattr(rewards, "_hub_file", lambda name, download=True: hub.append((name, download)))
    monkeypatch.setenv("REWARD_API_KEY", "k")
    check_rewards(spec("ocr_judge,jpeg:0.5", urls=["ocr_judge=http://h:1/v1/", "jpeg=http://h:2/X/"]))  # behind a path
    assert asked == [("http://h:1/v1/models", dict(token="k", timeout=10, tries=1)),
                     ("http://h:2/X/health", dict(token="k", timeout=10, tries=1))]  # fmt: skip
    check_rewards(spec("hpsv2.1:1,jpeg:0.5,pickscore:0"))
    check_rewards(spec("clip", ckpts=[f"clip={tmp_path}"]))  # its own weights: no hub
    assert hub == [("hpsv2.1", False), ("pickscore", False)]


def test_serve_main_refuses_what_it_cannot_serve_and_says_where_it_serves(monkeypatch, capsys):
    """A judge or a video reward is refused by name (exit with one error line), as an unknown reward is; the server
    scores with the reward of the asked name on its device, and the line printed names the rewards, the address,
    the port the server bound and whether a token is asked."""
    from common import remote

    served = {}

    class Probe:
        def __init__(self, device, checkpoint=None):
            self.device = device

        def __call__(self, images, prompts):
            return images.flatten(1).sum(1) + len(prompts)

    def serve(score, names, host, port, token, *limits, **kw):
        served.update(score=score, names=names, token=token)
        return types.SimpleNamespace(server_port=4321, serve_forever=lambda: None)

    monkeypatch.setitem(rewards.REWARDS, "probe", RewardKind(Probe, differentiable=False))
    monkeypatch.setattr(remote, "serve", serve)  # serve_main imports it from common.remote when it runs
    for reward, error in (
        (
            "ocr_judge,probe",
            "error: --reward ocr_judge,probe: ocr_judge cannot be served here (judges and video rewards)",
        ),
        ("temporal", "error: --reward temporal: temporal cannot be served here (judges and video rewards)"),
        (
            "ocr_judge,temporal",
            "error: --reward ocr_judge,temporal: ocr_judge, temporal cannot be served here (judges and video rewards)",
        ),
        ("nope", "error: --reward: unknown reward 'nope'; valid names: "),
    ):
        with pytest.raises(SystemExit) as e:
            rewards.serve_main(["serve", "--reward", reward, "--device", "cpu"])
        assert str(e.value).startswith(error), (reward, str(e.value))
    monkeypatch.delenv("REWARD_API_KEY", raising=False)
    rewards.serve_main(["serve", "--reward", "probe", "--device", "cpu", "--host", "0.0.0.0", "--port", "0"])
    out = capsys.readouterr().out
    assert out.endswith("serving ['probe'] at http://0.0.0.0:4321 (GET /health, POST /score); token: False\n"), out
    assert served["names"] == ["probe"] and served["token"] is None
    scores = served["score"]("probe", torch.ones(2, 3, 2, 2), ["a", "b"])
    assert scores.tolist() == [14.0, 14.0]  # 12 ones + 2 prompts, from the reward named
    monkeypatch.setenv("REWARD_API_KEY", "s3cret")
    rewards.serve_main(["serve", "--reward", "probe", "--device", "cpu"])
    assert capsys.readouterr().out.endswith("at http://127.0.0.1:4321 (GET /health, POST /score); token: True\n")
    assert served["token"] == "s3cret"


def test_each_served_component_is_asked_on_its_own_thread_one_chunk_at_a_time(monkeypatch):
    """request() gives each served component one worker of its own: two components are asked at once (neither waits
    for the other's answers), and one component's chunks one after another, in order (a server is not asked for a
    second chunk of a run before it answered the first). collect() of one chunk gives that chunk's scores."""
    import threading

    from common.remote import Served
    from common.rewards import CompositeReward

    lock, in_flight, most, order = threading.Lock(), {"a": 0, "b": 0, "all": 0}, {"a": 0, "b": 0, "all": 0}, []

    def served(reward, images, prompts):  # what a server's answer takes: 0.1 s
        with lock:
            for k in (reward.tag, "all"):
                in_flight[k] += 1
                most[k] = max(most[k], in_flight[k])
            order.append((reward.tag, prompts[0]))
        threading.Event().wait(0.1)
        with lock:
            for k in (reward.tag, "all"):
                in_flight[k] -= 1
        return images.mean((1, 2, 3)) + (reward.tag == "b"), torch.zeros(len(images))

    a, b = Served.__new__(Served), Served.__new__(Served)  # clients in name only: _served is the test's
    a.tag, b.tag = "a", "b"
    composite = CompositeReward([("a", 1.0, a), ("b", 0.5, b)])
    assert composite.weights == {"a": 1.0, "b": 0.5} and composite.wait_s == 0.0  # no wait before a collect()
    monkeypatch.setattr(composite, "_served", served)
    images = torch.rand(6, 3, 4, 4)
    handles = [composite.request(images[c : c + 2], [f"chunk {c}"] * 2) for c in range(0, 6, 2)]
    results = [{n: f.result()[0] for n, f in h[2].items()} for h in handles]
    assert most == {"a": 1, "b": 1, "all": 2}, most
    assert (
        [p for tag, p in order if tag == "a"]
        == [p for tag, p in order if tag == "b"]
        == ["chunk 0", "chunk 2", "chunk 4"]
    )
    torch.testing.assert_close(results[1]["b"], images[2:4].mean((1, 2, 3)) + 1)
    total, parts = composite.collect(handles[2:])
    torch.testing.assert_close(parts["a"], images[4:].mean((1, 2, 3)))
    torch.testing.assert_close(total, images[4:].mean((1, 2, 3)) * 1.5 + 0.5)


def test_serve_main_defaults_help_and_a_wrong_flag_by_hand(monkeypatch, capsys):
    """`python -m common.rewards serve` with no option but --reward: this machine only, port 8100, the CPU here, the
    caps of docs/models.md; --help names each option with its help; a wrong flag is one line that says where to look."""
    from common import remote

    served, backend, scores = [], [], []
    probe = RewardKind(lambda device, checkpoint=None: lambda images, prompts: images.flatten(1).sum(1), False)
    monkeypatch.setitem(rewards.REWARDS, "probe", probe)
    monkeypatch.setattr(rewards, "set_attention_backend", lambda name, device: backend.append((name, device)) or "")

    def serve(score, names, host, port, token, *limits, **kw):
        served.append((host, port, limits, kw))
        scores.append(score)
        return types.SimpleNamespace(server_port=port, serve_forever=lambda: None)

    monkeypatch.setattr(remote, "serve", serve)
    rewards.serve_main(["serve", "--reward", "probe"])
    limits = dict(max_prompt_chars=2000, max_connections=8, request_deadline=60.0)
    assert served == [("127.0.0.1", 8100, (64, 64.0, 2**25), limits)] and backend == [("auto", "cpu")]
    monkeypatch.setattr(rewards.torch.cuda, "is_available", lambda: True)  # on a GPU machine: the GPU by default
    rewards.serve_main(["serve", "--reward", "probe", "--max-mb", "0.5", "--request-deadline", "0.25"])
    assert backend[-1] == ("auto", "cuda") and served[-1][2][1] == 0.5 and served[-1][3]["request_deadline"] == 0.25
    rewards.serve_main(["serve", "--reward", "probe", "--device", "meta"])  # the images go to --device to be scored
    assert scores[-1]("probe", torch.ones(2, 3, 2, 2), ["a", "b"]).device == torch.device("meta")
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")  # each option and its help on one line
    with pytest.raises(SystemExit) as e:
        rewards.serve_main(["serve", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # tyro's box, drawn in Unicode
    assert text.startswith("usage: python -m common.rewards serve [-h] [OPTIONS]")
    assert "`python -m common.rewards serve --reward hpsv2.1,aesthetic --port 8100`: host registered rewards for " \
        "training runs elsewhere" in text  # fmt: skip
    for line in (
        "--reward STR comma-separated registered rewards, e.g. hpsv2.1,aesthetic (required)",
        "--reward-ckpt STR NAME=PATH, as the training scripts take (repeatable)",
        "--host STR address to bind (127.0.0.1: this machine only) (default: 127.0.0.1)",
        "--port INT TCP port (0: any free one) (default: 8100)",
        "where the reward models score (default: cuda on a GPU machine, else cpu)",
        "--attention-backend {auto,flash,efficient,math,cudnn} attention kernels of the reward models "
        "(common/attention.py; auto: no cuDNN) (default: auto)",
        "--max-batch INT images per request, at most (default: 64)",
        "--max-mb FLOAT request body size in MB, at most (default: 64.0)",
        "--max-pixels INT decoded pixels per request, all its images together (and so per image), at most; "
        "read from each PNG's header before it is decoded (default 2**25: 64 images of 720x720, 32 of 1024x1024) "
        "(default: 33554432)",
        "--max-prompt-chars INT characters per prompt, at most (default: 2000)",
        "--max-connections INT connections at once, at most (one more is answered 429) (default: 8)",
        "--request-deadline FLOAT seconds a request may take to arrive whole, headers and body, from its "
        "connection (else 408) (default: 60.0)",
    ):
        assert line in text, line
    listed = "; `python -m common.rewards serve --help` lists every flag\n"
    for argv, said in (
        (["serve", "--reward", "probe", "--prot", "1"], "error: Unrecognized options: --prot, 1 (perhaps you meant "
         f"--port INT){listed}"),
        (["--reward", "probe"], "error: the command is `python -m common.rewards serve`, not `python -m "
         "common.rewards --reward probe`\n"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            rewards.serve_main(argv)
        assert e.value.code == 2 and capsys.readouterr().err == said


def test_the_composite_by_hand_grad_modes_non_finite_scores_an_overflowing_sum_and_video_frames():
    """CompositeReward's combination at values where each part shows: a reward of weight 0 scored without autograd
    (and every reward under no_grad), a non-finite score or weighted sum named with its image and prompt (off with
    check=False), a judge's unparsed flags, and an image reward on videos: frame_subset's frames, video-major, their
    mean per video."""
    from common.remote import STOPS, Judge
    from common.rewards import CompositeReward, RunError

    modes = []

    def reward(value):
        def fn(images, prompts):
            modes.append(torch.is_grad_enabled())
            return torch.tensor(value, dtype=torch.float32)

        return ScoreFn(fn, differentiable=True)

    images, prompts = torch.zeros(3, 3, 2, 2), ["a", "b", "c"]
    composite = CompositeReward([("one", 1.0, reward([1.0, 2.0, 3.0])), ("off", 0.0, reward([5.0, 5.0, 5.0]))])
    total, parts = composite(images, prompts)
    assert total.tolist() == [1.0, 2.0, 3.0] and parts["off"].tolist() == [5.0] * 3 and modes == [True, False]
    with torch.no_grad():
        composite(images, prompts)
    assert modes[2:] == [False, False]

    bad = CompositeReward([("one", 1.0, reward([1.0, float("nan"), 3.0])), ("two", 0.5, reward([0.0, 1.0, 2.0]))])
    with pytest.raises(RunError) as e:
        bad(images, prompts)
    assert str(e.value) == f"reward 'one' gave nan for image 1 (prompt 'b'), not a finite number; {STOPS}"
    unchecked = CompositeReward(bad.components, check=False)
    assert unchecked(images, prompts)[0][1].isnan()  # check=False: the memory plan's tensors pass through

    # the weighted sum: 4 x its sum of squares must be finite in float32 (max 3.4028e38)
    fine = CompositeReward([("one", 1.0, reward([8.7e18, 0.0, 0.0])), ("two", 0.5, reward([0.0, 0.0, 0.0]))])
    fine(images, prompts)  # 4 x 7.57e37 = 3.03e38: finite (5 x it would not be)
    over = CompositeReward([("one", 1.0, reward([0.0, 9.3e18, 0.0])), ("two", 0.5, reward([0.0, 0.0, 0.0]))])
    with pytest.raises(RunError) as e:
        over(images, prompts)
    assert "the rewards' weighted sum (--reward one:1,two:0.5) " in str(e.value)
    assert str(e.value).endswith(f", though each score was finite; check the weights and the scores; {STOPS}")

    class FlaggingJudge(Judge):  # a judge without a server: one unparsed answer of every two frames or images
        video, differentiable, parts = False, False, None

        def __init__(self):
            pass

        def __call__(self, images, prompts):
            self.seen = (images[:, 0, 0, 0].tolist(), list(prompts))
            self.unparsed = torch.tensor([1.0, 0.0] * (len(images) // 2))
            return images.mean((1, 2, 3))

    judge = FlaggingJudge()
    composite = CompositeReward([("judge", 1.0, judge)], frames=3)
    video = torch.arange(5.0).view(1, 5, 1, 1, 1).expand(2, 5, 3, 2, 2) + torch.tensor([0.0, 10.0]).view(2, 1, 1, 1, 1)
    video = video.clone()
    video[1, :, 1] = 40.0  # video 1's second channel, so that a mean over the wrong axis shows
    total, parts = composite(video, ["p", "q"])
    # frame_subset(5, 3) = [0, 2, 4]; the judge sees video 0's three frames, then video 1's
    assert judge.seen == ([0.0, 2.0, 4.0, 10.0, 12.0, 14.0], ["p", "p", "p", "q", "q", "q"])
    # per video the mean of its frames' scores: video 0's frames score 0, 2, 4: 2; video 1's (2 (10 + f) + 40) / 3 at
    # f = 0, 2, 4: 64 / 3
    torch.testing.assert_close(total, torch.tensor([2.0, 64 / 3]))
    assert parts["judge_unparsed"].tolist() == pytest.approx([2 / 3, 1 / 3])  # flags 1, 0, 1 and 0, 1, 0


def test_each_malformed_reward_ckpt_or_url_item_and_an_unknown_name_is_refused_by_hand():
    """A --reward-ckpt or --reward-url item without "=", a URL that is not http(s), an unknown name (for either
    flag): each its own message; a value may hold "=" itself (split at the first), and https is a URL."""

    def refused(*args, **kw):
        with pytest.raises(rewards.InputError) as e:
            parse_rewards(*args, **kw)
        return str(e.value)

    assert refused("jpeg", ckpts=["jpeg"]) == "--reward-ckpt 'jpeg': expected NAME=PATH"
    assert refused("jpeg", urls=["jpeg"]) == "--reward-url 'jpeg': expected NAME=URL"
    assert refused("jpeg", urls=["jpeg=ftp://h"]) == "--reward-url jpeg=ftp://h: expected an http(s):// URL"
    valid = ", ".join(sorted(REWARDS)) + " (hps = hpsv2.1)"
    assert refused("nope") == f"--reward: unknown reward 'nope'; valid names: {valid}"
    assert refused("jpeg", ckpts=["nope=/w"]) == f"--reward-ckpt: unknown reward 'nope'; valid names: {valid}"
    spec = parse_rewards("jpeg,clip", ckpts=["clip=/w/a=b.pt"], urls=["jpeg=https://h/score?k=v"])
    assert spec.path("clip") == "/w/a=b.pt" and [c.url for c in spec.components] == ["https://h/score?k=v", None]


def test_a_prompt_shapesbench_cannot_read_is_one_line_before_anything_is_sampled(tmp_path, monkeypatch, capsys):
    """ShapesBench's verifier and learned reward read 'a <colour> <shape> on a <colour> background' only: a prompt
    file holding another prompt is refused at start-up, naming the flag and the prompt's line, where it failed in the
    middle of sampling (a ShapesBench reward, even of weight 0) or after every model was scored (the evaluation's
    verifier figures); another reward on other prompts is not concerned."""
    import dancegrpo
    from common import InputError
    from common import evaluate as E
    from common.flags import cli

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle on a blue background\na dog\n")
    said = "prompt 2: not a ShapesBench prompt: 'a dog' (expected 'a <colour> <shape> on a <colour> background'"
    for flags, flag in (
        (dict(prompts=str(prompts)), "--prompts"),
        (dict(prompts=str(prompts), reward="verifier,shapes:0"), "--prompts"),
        (dict(eval_prompts=str(prompts)), "--eval-prompts"),  # the ShapesBench model's evaluation reads them
        (dict(eval_prompts=str(prompts), reward="verifier"), "--eval-prompts"),
    ):
        with pytest.raises(InputError) as e:
            dancegrpo.resolve_and_check(dancegrpo.Args(output_dir=str(tmp_path / "runs"), **flags))
        assert str(e.value).startswith(f"{flag}: {said}"), str(e.value)
    rewards.check_reward_prompts(parse_rewards("jpeg", [], []), ["a dog"], "--prompts")  # no ShapesBench reward
    sampled = []
    monkeypatch.setattr(E, "score_model", lambda *a, **kw: sampled.append(a))
    monkeypatch.setattr("sys.argv", ["common/evaluate.py", "--prompts", str(prompts), "--out", str(tmp_path / "e")])
    with pytest.raises(SystemExit) as stopped:
        cli(E.main, E.EvalArgs)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(f"error: --prompts: {said}") and len(err.splitlines()) == 1
    assert not sampled and not (tmp_path / "e").exists()
