"""common/evaluate.py's statistics on realistic shapes, by hand: report() on hand-built batch records (4 prompts x 2
samples, two models, three reward columns, two HPDv2 styles interleaved, batches of uneven size), so that a reshape
that mixes the samples of different prompts, a mean over the wrong axis, a standard deviation in place of a standard
error or the wrong rows of a style each give another number; and the evaluation noise (fixed_noise): one draw per
sample index, the same whatever the batching, never shared by two samples."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from common import evaluate as E
from common.sampling import fixed_noise, keyed_generator

# sample j belongs to prompt j // 2; total = a + b / 2 (the rewards' weighted sum, as a reward function returns it)
BASE = {  # the total first, as score_model records it
    "total": [0.6, 2.0, 1.2, 1.9, 0.4, 2.0, 3.2, 0.8],  # per prompt 1.3, 1.55, 1.2, 2.0; overall 12.1 / 8
    "a": [0.1, 0.5, 0.2, 0.9, 0.4, 0.0, 0.7, 0.3],  # per prompt 0.3, 0.55, 0.2, 0.5; overall 3.1 / 8
    "b": [1.0, 3.0, 2.0, 2.0, 0.0, 4.0, 5.0, 1.0],  # per prompt 2, 2, 2, 3; overall 18 / 8
}
TRAINED = {
    "total": [1.6, 1.8, 0.6, 3.4, 2.4, 2.0, 0.4, 3.2],  # per prompt 1.7, 2.0, 2.2, 1.8; overall 15.4 / 8
    "a": [0.6, 0.8, 0.1, 0.9, 0.9, 0.5, 0.4, 0.2],  # per prompt 0.7, 0.5, 0.7, 0.3; overall 4.4 / 8
    "b": [2.0, 2.0, 1.0, 5.0, 3.0, 3.0, 0.0, 6.0],  # per prompt 2, 3, 3, 3; overall 22 / 8
}
PER_PROMPT = {
    "base": {"a": [0.3, 0.55, 0.2, 0.5], "b": [2.0, 2.0, 2.0, 3.0], "total": [1.3, 1.55, 1.2, 2.0]},
    "trained": {"a": [0.7, 0.5, 0.7, 0.3], "b": [2.0, 3.0, 3.0, 3.0], "total": [1.7, 2.0, 2.2, 1.8]},
}
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white circle"]
STYLES = ["anime", "photo", "anime", "photo"]  # interleaved: a style's rows are not a contiguous block


def standard_error(diffs):
    """sqrt(sum (d - mean)^2 / (n - 1)) / sqrt(n), written out."""
    n, m = len(diffs), sum(diffs) / len(diffs)
    return math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n)


def records_of(scores, batch_sizes, grid, image_gen):
    """Batch records as score_model returns them: consecutive batches of the given sizes, the grid samples' images."""
    out, start = [], 0
    for size in batch_sizes:
        sl = slice(start, start + size)
        shown = [j for j in range(start, start + size) if j in grid]
        out.append(
            {
                "batch": len(out),
                "start": start,
                "key": "k",
                "prompts": [PROMPTS[j // 2] for j in range(start, start + size)],
                "scores": {k: torch.tensor(v[sl], dtype=torch.float32) for k, v in scores.items()},
                "grid": torch.rand(len(shown), 3, 16, 16, generator=image_gen),
                "images": torch.zeros(0),  # not ShapesBench: no verifier figures
            }
        )
        start += size
    return out


def test_report_per_prompt_means_paired_differences_and_styles_by_hand(tmp_path):
    gen = torch.Generator().manual_seed(0)
    grid = [0, 4]  # the first samples of prompts 0 and 2
    records = {
        "base": records_of(BASE, [3, 3, 2], grid, gen),  # batches that cut through prompt 1's samples
        "trained": records_of(TRAINED, [4, 4], grid, gen),
    }
    args = SimpleNamespace(samples_per_prompt=2, num_steps=4, shift=3.0, guidance_scale=1.0, seed=0,
                           weights=["trained=/weights"])  # fmt: skip
    setting = {"n_prompts": 4, "samples_per_prompt": 2}
    prompts = [p for p in PROMPTS for _ in range(2)]
    E.report(args, setting, records, PROMPTS, STYLES, prompts, grid, tmp_path)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["settings"] == setting and result["models"]["trained"] == "trained=/weights"

    # the mean of every sample per model (which is also the mean of the per-prompt means: equal samples per prompt)
    figures = result["figures"]
    assert figures["base"] == pytest.approx({"reward": 12.1 / 8, "reward_a": 3.1 / 8, "reward_b": 18 / 8}, rel=1e-6)
    assert figures["trained"] == pytest.approx({"reward": 15.4 / 8, "reward_a": 4.4 / 8, "reward_b": 22 / 8}, rel=1e-6)

    # trained - base per prompt, then their mean and paired standard error over the 4 prompts
    diffs = {"a": [0.4, -0.05, 0.5, -0.2], "b": [0.0, 1.0, 1.0, 0.0], "total": [0.4, 0.45, 1.0, -0.2]}
    for k, d in diffs.items():
        assert d == pytest.approx([t - b for t, b in zip(PER_PROMPT["trained"][k], PER_PROMPT["base"][k])])
    deltas = result["deltas"]["trained"]
    # a: mean 0.65 / 4; deviations .2375, -.2125, .3375, -.3625: sum of squares .346875, / 3, sqrt, / 2
    assert deltas["a"] == pytest.approx([0.1625, math.sqrt(0.346875 / 3) / 2], rel=1e-5)
    assert deltas["b"] == pytest.approx([0.5, math.sqrt(1 / 3) / 2], rel=1e-5)  # deviations +-0.5
    # total: mean 1.65 / 4; deviations -.0125, .0375, .5875, -.6125: sum of squares .721875
    assert deltas["total"] == pytest.approx([0.4125, math.sqrt(0.721875 / 3) / 2], rel=1e-5)
    for k, d in diffs.items():
        assert deltas[k] == pytest.approx([sum(d) / 4, standard_error(d)], rel=1e-5)
    # per style: anime = prompts 0 and 2, photo = prompts 1 and 3; two values d1, d2: se = |d1 - d2| / 2
    assert deltas["a/anime"] == pytest.approx([0.45, 0.05], rel=1e-5)
    assert deltas["a/photo"] == pytest.approx([-0.125, 0.075], rel=1e-5)
    assert deltas["b/anime"] == pytest.approx([0.5, 0.5], rel=1e-5)
    assert deltas["b/photo"] == pytest.approx([0.5, 0.5], rel=1e-5)
    assert deltas["total/anime"] == pytest.approx([0.7, 0.3], rel=1e-5)
    assert deltas["total/photo"] == pytest.approx([0.125, 0.325], rel=1e-5)
    assert set(deltas) == {f"{k}{s}" for k in ("total", "a", "b") for s in ("", "/anime", "/photo")}

    # scores.jsonl: one line per prompt with its style and each model's per-prompt means
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["style"]) for r in rows] == list(zip(PROMPTS, STYLES))
    for i, row in enumerate(rows):
        for m in ("base", "trained"):
            assert row[m] == pytest.approx({k: v[i] for k, v in PER_PROMPT[m].items()}, abs=1e-6)

    # the table: mean per model, and trained - base +- the paired standard error (a: se 0.170019...); per style
    assert (tmp_path / "results.md").read_text() == (
        "4 prompts x 2 samples, 4-step Euler ODE (shift 3.0), guidance 1.0, seed 0; mean per model, trained - base "
        "+- paired standard error over prompts\n"
        "\n"
        "| model | total | a | b |\n"
        "|---|---|---|---|\n"
        "| base | 1.5125 | 0.3875 | 2.2500 |\n"
        "| trained | 1.9250 (+0.4125 +- 0.2453) | 0.5500 (+0.1625 +- 0.1700) | 2.7500 (+0.5000 +- 0.2887) |\n"
        "\n"
        "per style, trained - base +- paired standard error:\n"
        "\n"
        "| model | reward | anime | photo |\n"
        "|---|---|---|---|\n"
        "| trained | total | +0.7000 +- 0.3000 | +0.1250 +- 0.3250 |\n"
        "| trained | a | +0.4500 +- 0.0500 | -0.1250 +- 0.0750 |\n"
        "| trained | b | +0.5000 +- 0.5000 | +0.5000 +- 0.5000 |\n"
    )
    assert (tmp_path / "results.json").read_text().startswith('{\n "settings": {\n  "n_prompts": 4,')  # indent 1
    # the base model alone (no --weights): its means, and no differences per style
    args.weights = []
    E.report(args, setting, {"base": records["base"]}, PROMPTS, STYLES, prompts, grid, tmp_path)
    assert (
        (tmp_path / "results.md")
        .read_text()
        .endswith("| model | total | a | b |\n|---|---|---|---|\n| base | 1.5125 | 0.3875 | 2.2500 |\n")
    )
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_report_one_reward_uses_its_total_and_no_styles(tmp_path):
    """One reward: its column is the reward itself (the total is not repeated); prompts without a style give no
    per-style rows. 3 prompts x 3 samples, batches of 4, 4, 1."""
    base = [0.0, 0.3, 0.6, 1.0, 1.0, 0.1, 0.2, 0.2, 0.5]  # per prompt 0.3, 0.7, 0.3
    trained = [0.9, 0.0, 0.6, 0.4, 0.4, 0.4, 0.0, 0.3, 0.0]  # per prompt 0.5, 0.4, 0.1
    gen = torch.Generator().manual_seed(1)

    def recs(values):
        out = []
        for start, size in ((0, 4), (4, 4), (8, 1)):
            v = torch.tensor(values[start : start + size])
            out.append({"start": start, "scores": {"total": v, "shapes": v.clone()},
                        "grid": torch.rand(int(start == 0), 3, 16, 16, generator=gen), "images": torch.zeros(0)})  # fmt: skip
        return out

    args = SimpleNamespace(samples_per_prompt=3, num_steps=4, shift=3.0, guidance_scale=1.0, seed=0, weights=["w"])
    prompts3 = PROMPTS[:3]
    E.report(args, {}, {"base": recs(base), "w": recs(trained)}, prompts3, [""] * 3,
             [p for p in prompts3 for _ in range(3)], [0], tmp_path)  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    # per-prompt differences 0.2, -0.3, -0.2: mean -0.1; deviations .3, -.2, -.1: sum of squares .14
    assert set(result["deltas"]["w"]) == {"shapes"}
    assert result["deltas"]["w"]["shapes"] == pytest.approx([-0.1, math.sqrt(0.14 / 2) / math.sqrt(3)], rel=1e-5)
    assert result["figures"]["w"]["reward_shapes"] == pytest.approx(3.0 / 9, rel=1e-6)
    assert result["figures"]["base"]["reward"] == pytest.approx(3.9 / 9, rel=1e-6)
    assert "| model | shapes |" in (tmp_path / "results.md").read_text()


def test_paired_mean_and_standard_error_by_hand():
    mean, se = E.paired(torch.tensor([0.4, -0.05, 0.5, -0.2]))
    assert mean == pytest.approx(0.1625, rel=1e-6)
    assert se == pytest.approx(math.sqrt(0.346875 / 3) / 2, rel=1e-5)  # not the std (2x), not the biased one
    mean, se = E.paired(torch.tensor([3.0]))
    assert mean == 3.0 and math.isnan(se)  # one prompt: no standard error


SHAPE = (4, 8, 8)


def test_fixed_noise_is_one_draw_per_sample_index_whatever_the_batching():
    whole = fixed_noise(0, "eval", SHAPE, 0, 6)
    assert whole.shape == (6, *SHAPE)
    assert torch.equal(fixed_noise(0, "eval", SHAPE, 0, 4)[2], fixed_noise(0, "eval", SHAPE, 2, 1)[0])
    for cuts in ([0, 3, 6], [0, 1, 5, 6], [0, 2, 4, 6]):  # batches of any sizes
        parts = [fixed_noise(0, "eval", SHAPE, a, b - a) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole)
    for j in range(6):  # sample j's noise is the draw keyed on (seed, tag, j)
        assert torch.equal(whole[j], torch.randn(SHAPE, generator=keyed_generator(0, "eval", j)))
    # no two samples share noise (shared noise: identical images, diversity 0): nearly uncorrelated draws
    flat = whole.flatten(1)
    corr = torch.corrcoef(flat)
    for i in range(6):
        for j in range(i + 1, 6):
            assert not torch.equal(whole[i], whole[j]) and abs(float(corr[i, j])) < 0.3, (i, j)
    # each is standard normal noise (256 numbers): mean ~0, std ~1
    assert flat.mean(1).abs().max() < 0.3 and ((flat.std(1) - 1).abs() < 0.2).all()
    # the seed and the tag select other draws: evaluation and grid noise differ, and so do seeds
    assert not torch.equal(fixed_noise(0, "grid", SHAPE, 0, 6), whole)
    assert not torch.equal(fixed_noise(1, "eval", SHAPE, 0, 6), whole)


def test_score_model_gives_each_sample_its_own_noise_whatever_the_batch_size(tmp_path, monkeypatch):
    """score_model's batches through a sampler that returns the noise it was given: every sample's score is its own
    keyed noise's, for batch sizes 3 and 8 alike, and no two samples' are equal."""
    seen = []

    def sample_prompts(sampler, model, prompts, noise, batch_size, progress=iter):
        seen.append(noise.clone())
        return noise[:, :3]  # "images": the first three latent channels of each sample's noise

    monkeypatch.setattr(E, "sample_prompts", sample_prompts)
    model = SimpleNamespace(latent_shape=lambda: SHAPE, transformer=None)
    accelerator = SimpleNamespace(autocast=None, process_index=0, num_processes=1, is_local_main_process=False)
    reward_fn = lambda images, prompts: (images.mean((1, 2, 3)), {})  # noqa: E731
    prompts = [p for p in PROMPTS[:4] for _ in range(2)]
    scores = {}
    for bs in (3, 8):
        args = SimpleNamespace(seed=5, num_steps=4, shift=3.0, guidance_scale=1.0, guidance_scale_2=None, batch_size=bs)
        recs = E.score_model(args, model, reward_fn, prompts, accelerator, tmp_path / f"cache{bs}", [0], False, "k")
        assert [r["start"] for r in recs] == list(range(0, 8, bs))
        scores[bs] = torch.cat([r["scores"]["total"] for r in recs])
    assert [len(n) for n in seen] == [3, 3, 2, 8]
    expected = torch.stack([torch.randn(SHAPE, generator=keyed_generator(5, "eval", j))[:3].mean() for j in range(8)])
    torch.testing.assert_close(scores[3], expected, rtol=1e-6, atol=1e-7)  # (the mean's summation order may differ)
    torch.testing.assert_close(scores[8], expected, rtol=1e-6, atol=1e-7)
    assert len(set(expected.tolist())) == 8


def test_score_model_samples_with_the_runs_settings_and_shows_its_progress_on_the_main_process(
    tmp_path, monkeypatch, capsys
):
    """The sampler score_model builds: the model's transformer, the grid of --shift ('pipeline': the model's own),
    --guidance-scale and the accelerator's autocast; A14B's --guidance-scale-2 set on the model; a progress bar
    named after the cache folder on the local main process only."""
    built = {}

    def ode_sampler(model, transformer, sigmas, guidance_scale, autocast):
        built.update(
            model=model, transformer=transformer, sigmas=sigmas, guidance_scale=guidance_scale, autocast=autocast
        )
        return None

    monkeypatch.setattr(E, "ode_sampler", ode_sampler)
    monkeypatch.setattr(E, "sample_prompts", lambda sampler, model, prompts, noise, bs: noise[:, :3])
    grid = torch.tensor([1.0, 0.7, 0.4, 0.2, 0.1, 0.0])  # the model's own grid; 3 steps read its first 4 points
    model = SimpleNamespace(latent_shape=lambda: SHAPE, transformer="the transformer", sigmas=lambda n: grid[: n + 1])
    autocast = object()
    args = SimpleNamespace(
        seed=5, num_steps=3, shift="pipeline", guidance_scale=4.5, guidance_scale_2=2.5, batch_size=2
    )
    reward_fn = lambda images, prompts: (images.mean((1, 2, 3)), {})  # noqa: E731
    prompts = PROMPTS[:4]
    for main_process in (True, False):
        accelerator = SimpleNamespace(autocast=autocast, process_index=0, num_processes=1,
                                      is_local_main_process=main_process)  # fmt: skip
        cache = tmp_path / f"cache_{main_process}"
        E.score_model(args, model, reward_fn, prompts, accelerator, cache, [0], False, "k")
        assert built["model"] is model and built["transformer"] == "the transformer"
        assert (
            torch.equal(built["sigmas"], grid[:4]) and built["guidance_scale"] == 4.5 and built["autocast"] is autocast
        )
        assert model.guidance_scale_2 == 2.5
        err = capsys.readouterr().err
        assert (f"{cache.name}: 100%" in err) == main_process and ("2/2" in err) == main_process, err


def test_report_runs_the_shapesbench_figures_with_the_given_reward_and_leaves_unparsed_counts_out_of_the_columns(
    tmp_path, monkeypatch, capsys
):
    """On ShapesBench (records with images): the learned reward of `shapes_ckpt` is loaded once and every model's
    images, in sample order, go to shapesbench.evaluate with it; its figures join the model's and get their table;
    the grid's badges are the verifier's verdicts. A judge's `<name>_unparsed` count is a figure, not a column. One
    batch per model (the records' first batch gives the keys)."""
    loaded, evaluated, verified = [], [], []
    monkeypatch.setattr(E.shapesbench, "load_reward_model", lambda path: loaded.append(path) or f"reward of {path}")

    def evaluate(images, prompts, reward):
        evaluated.append((images.clone(), list(prompts), reward))
        m = images.mean().item()
        return {"shape_acc": m, "all_acc": m / 2, "clean_acc": 0.25, "diversity": 0.5, "diversity_kept": 0.75}

    def verify(images, prompts):
        verified.append(list(prompts))
        return {"all": torch.tensor([True, False] * (len(prompts) // 2))}

    monkeypatch.setattr(E.shapesbench, "evaluate", evaluate)
    monkeypatch.setattr(E.shapesbench, "verify", verify)
    grids = []
    monkeypatch.setattr(
        E, "save_grid", lambda path, images, captions, ok, ncol, title, flag, within: grids.append(locals())
    )
    prompts = PROMPTS[:2]
    samples = [p for p in prompts for _ in range(2)]

    def record(values, fill):
        images = torch.full((4, 3, 8, 8), fill) + torch.arange(4.0).view(4, 1, 1, 1) / 10  # sample j: fill + j / 10
        scores = {
            "total": torch.tensor(values),
            "a": torch.tensor(values),
            "a_unparsed": torch.tensor([1 / 7, 0, 0, 0]),
        }
        return [{"start": 0, "scores": scores, "grid": images[[0, 2]], "images": images}]

    records = {"base": record([0.1, 0.3, 0.5, 0.7], 0.2), "w": record([0.2, 0.4, 0.9, 0.9], 0.4)}
    args = SimpleNamespace(samples_per_prompt=2, num_steps=4, shift=3.0, guidance_scale=1.0, seed=0, weights=["w"])
    E.report(args, {}, records, prompts, ["", ""], samples, [0, 2], tmp_path, shapes_ckpt="runs/shapes_reward")
    assert loaded == ["runs/shapes_reward"]
    assert [(p, r) for _, p, r in evaluated] == [(samples, "reward of runs/shapes_reward")] * 2
    for (images, _, _), fill in zip(evaluated, (0.2, 0.4)):
        assert torch.allclose(images[:, 0, 0, 0], torch.tensor([fill, fill + 0.1, fill + 0.2, fill + 0.3]))
    result = json.loads((tmp_path / "results.json").read_text())
    assert (
        result["figures"]["w"]["shape_acc"] == pytest.approx(0.55) and result["figures"]["w"]["diversity_kept"] == 0.75
    )
    assert result["figures"]["base"]["reward_a_unparsed"] == pytest.approx(1 / 28)  # a figure, not a column
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert rows[0]["base"] == {"total": 0.2, "a": 0.2, "a_unparsed": 0.071429}  # 1/14, to 6 decimals
    assert set(result["deltas"]["w"]) == {"a"}  # one reward: its column is itself; the count is no column
    assert (tmp_path / "results.md").read_text() == (
        "2 prompts x 2 samples, 4-step Euler ODE (shift 3.0), guidance 1.0, seed 0; mean per model, trained - base "
        "+- paired standard error over prompts\n"
        "\n"
        "| model | a |\n"
        "|---|---|\n"
        "| base | 0.4000 |\n"
        "| w | 0.6000 (+0.2000 +- 0.1000) |\n"
        "\n"
        "| model | shape_acc | all_acc | clean_acc | diversity | diversity_kept |\n"
        "|---|---|---|---|---|---|\n"
        "| base | 0.350 | 0.175 | 0.250 | 0.500 | 0.750 |\n"
        "| w | 0.550 | 0.275 | 0.250 | 0.500 | 0.750 |\n"
    )
    assert verified == [[samples[0], samples[2]] * 2]  # the grid's samples, a row per model
    (grid,) = grids
    assert grid["path"] == tmp_path / "grid.png" and grid["ncol"] == 2 and grid["ok"] == [True, False, True, False]
    assert (grid["flag"], grid["within"]) == ("--out", tmp_path)  # written whole, never through a link below --out
    assert grid["captions"] == [f"{m}\n{p}" for m in ("base", "w") for p in (samples[0], samples[2])]
    assert grid["title"] == (
        "first sample of evenly spaced prompts, the same noise in a column; a row per model; badge: the verifier's "
        "verdict"
    )
    torch.testing.assert_close(grid["images"][:, 0, 0, 0], torch.tensor([0.2, 0.4, 0.4, 0.6]))  # samples 0 and 2
    out = capsys.readouterr().out
    assert out == (tmp_path / "results.md").read_text() + (
        f"written: {tmp_path / 'results.md'}, results.json, scores.jsonl, grid.png\n"
    )


def test_report_shows_a_videos_middle_frame_in_the_grid(tmp_path, monkeypatch):
    """Videos (n, F, 3, H, W): the grid shows frame F // 2 of each (frame 2 of 5), without the verifier's badges."""
    grids = []
    monkeypatch.setattr(
        E, "save_grid", lambda path, images, captions, ok, ncol, title, flag, within: grids.append(locals())
    )
    video = torch.arange(5.0).view(1, 5, 1, 1, 1).expand(1, 5, 3, 2, 2)  # frame f filled with f
    record = {"start": 0, "scores": {"total": torch.tensor([0.5, 0.7])}, "grid": video, "images": torch.zeros(0)}
    args = SimpleNamespace(samples_per_prompt=2, num_steps=4, shift=3.0, guidance_scale=1.0, seed=0, weights=[])
    E.report(args, {}, {"base": [record]}, ["p"], [""], ["p", "p"], [0], tmp_path)
    (grid,) = grids
    assert grid["images"].shape == (1, 3, 2, 2) and torch.all(grid["images"] == 2.0) and grid["ok"] is None
    assert grid["title"] == "first sample of evenly spaced prompts, the same noise in a column; a row per model"


def test_the_grid_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """grid.png (and every sample grid) goes through the atomic writer: a disk that fills half-way through the PNG is
    one RunError naming the file, the grid of the last evaluation kept whole and no temporary file left; a link in
    its place is refused, nothing written through it."""
    from PIL import Image

    from common import InputError, RunError
    from common.viz import save_grid

    images, path = torch.rand(2, 3, 8, 8), tmp_path / "grid.png"
    save_grid(path, images, ["a", "b"], ncol=2, flag="--out", within=tmp_path)
    before = path.read_bytes()
    real_save = Image.Image.save

    def full_disk(self, fp, format=None, **kw):
        real_save(self, fp, format=format, **kw)
        with open(fp, "r+b") as f:
            f.truncate(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(RunError, match=r"^cannot write .*grid.png \(OSError: \[Errno 28\] No space left on device\)"):
        save_grid(path, torch.zeros(2, 3, 8, 8), ["a", "b"], ncol=2, flag="--out", within=tmp_path)
    monkeypatch.setattr(Image.Image, "save", real_save)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]
    path.unlink()
    (tmp_path / "theirs.png").write_bytes(b"theirs")
    path.symlink_to(tmp_path / "theirs.png")
    with pytest.raises(InputError, match=r"^--out: .*grid.png is a symbolic link, where the sample grid writes"):
        save_grid(path, images, ["a", "b"], ncol=2, flag="--out", within=tmp_path)
    assert (tmp_path / "theirs.png").read_bytes() == b"theirs"
