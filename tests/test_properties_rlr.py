"""rlr.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

import sys
from pathlib import Path

import pytest
import torch

import rlr as R
from common import InputError


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7:
    2.1 / 2.4 = 0.875."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(R.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert R.sigma_schedule(10, 3.0)[3] == 0.875


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [  # each message whole: a constant bound is the declaration's message, one that reads another flag its own
    (dict(num_steps=1), "--num-steps must be >= 2 (got 1)"),
    (dict(subchain_len=0), "--subchain-len must be >= 1 (got 0)"),
    (dict(subchain_len=10), "h = 10: --subchain-len must be in [1, 9] (= --num-steps - 1)"),
    (
        dict(subchain_stage="fine", subchain_len=3),
        "--subchain-stage fine: no window of 3 steps (--subchain-len) starts in that third of --num-steps 10 and ends before the last step",
    ),
    (dict(memory_budget_gb=20.0, subchain_len=2), "give --subchain-len or --memory-budget-gb, not both"),
    (
        dict(memory_budget_gb=1.0),
        "h = -1 (h* of --memory-budget-gb 1.0): --subchain-len must be in [1, 9] (= --num-steps - 1)",
    ),
    (dict(memory_budget_gb=20.0, zo_step_gb=0.0), "--zo-step-gb must be >= 1e-06 (got 0.0)"),
    (dict(memory_budget_gb=20.0, variance_ratio=-0.1), "--variance-ratio must be >= 0 (got -0.1)"),
    (dict(noise_level=0.0), "--noise-level must be > 0 (got 0.0)"),
    (dict(group_size=1), "--group-size must be >= 2 (got 1)"),
    (dict(rollout_batch_size=5), "--samples-per-device must be a multiple of --rollout-batch-size"),
    (
        dict(terms="fo+ho+zo", zo_perturbations=3),
        "--zo-perturbations must divide --samples-per-device into blocks that are multiples of --rollout-batch-size",
    ),
    (
        dict(terms="fo+ho+zo", zo_perturbations=16),
        "--zo-perturbations must divide --samples-per-device into blocks that are multiples of --rollout-batch-size",
    ),
    (dict(terms="fo+ho+zo", zo_scale=0.0), "--zo-scale must be > 0 (got 0.0)"),
]
ACCEPTED = [
    dict(num_steps=2, subchain_len=1),
    dict(subchain_len=9),
    dict(subchain_stage="fine", subchain_len=2),
    dict(terms="fo+zo"),
    dict(terms="fo+ho+zo", zo_perturbations=8),
    dict(memory_budget_gb=20.0, variance_ratio=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        R.resolve_and_check(R.Args(**flags))
    assert str(e.value) == message


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    R.resolve_and_check(R.Args(**flags))


def test_the_defaults_by_hand():
    """h = min(2, T - 1); one perturbation block per rollout chunk (32 / 4 = 8); flow noise 0.7, dance 0.3; h* of a
    20 GB budget: min(floor((20 - 0.24 * 9) / (8 - 0.24)) = floor(2.299) = 2, floor(10 / 2 - 1) = 4, 9) = 2."""
    flow, dance, short = R.Args(), R.Args(sde_type="dance", exp_name="mine"), R.Args(num_steps=2)
    for a in (flow, dance, short):
        R.resolve_and_check(a)
    assert (flow.subchain_len, flow.zo_perturbations, flow.noise_level, flow.exp_name) == (2, 8, 0.7, "rlr")
    assert (dance.noise_level, dance.exp_name, short.subchain_len) == (0.3, "mine", 1)
    budget = R.Args(memory_budget_gb=20.0)
    R.resolve_and_check(budget)
    assert budget.subchain_len == 2


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(ho_step_gb=0.24), "--ho-step-gb must be > --zo-step-gb: the h* rule divides by their difference"),
        (dict(ho_step_gb=0.2), "--ho-step-gb must be > --zo-step-gb: the h* rule divides by their difference"),
        (dict(variance_ratio=1.0), "--variance-ratio must be < 1 (got 1.0)"),
    ],
)
def test_the_h_star_rules_inputs_are_checked_before_it_divides_by_them(flags, message):
    """--ho-step-gb equal to --zo-step-gb (0.24) or --variance-ratio 1 makes h*'s denominators 0, a smaller
    --ho-step-gb turns its memory rule upside down: one error line naming the flag is expected, not a
    ZeroDivisionError."""
    with pytest.raises(InputError) as e:
        R.resolve_and_check(R.Args(memory_budget_gb=20.0, **flags))
    assert str(e.value) == message


# ---------------------------------------------------------------- the survivors of the generated mutants
def test_a_ddim_step_in_float64_is_exact_to_float64():
    """alphabar given as Python floats is taken in x's dtype: at float64 the step is the float64 formula, not one with
    a_t = 0.3 rounded to float32 first (1.2e-8 away). a 0.3 -> a_prev 0.5, eta 0.5."""
    x = torch.tensor([[0.7, -1.3]], dtype=torch.float64)
    eps = torch.tensor([[0.2, 0.9]], dtype=torch.float64)
    a, ap, eta = 0.3, 0.5, 0.5
    x0 = (x - (1 - a) ** 0.5 * eps) / a**0.5
    std = eta * ((1 - ap) / (1 - a) * (1 - a / ap)) ** 0.5
    mean, s = R.ddim_step(x, eps, a, ap, eta)
    assert mean.dtype == torch.float64 and s.dtype == torch.float64
    torch.testing.assert_close(mean, ap**0.5 * x0 + (1 - ap - std**2) ** 0.5 * eps, rtol=0, atol=1e-15)
    assert abs(s.item() - std) < 1e-15


def test_h_star_is_capped_at_the_steps_before_the_first_order_step():
    """Both of h*'s bounds above T - 1: over 10 steps a budget of 100 GB at 1 GB a sub-chain step and 0.0001 GB a ZO
    step (by memory floor(99.9991 / 0.9999) = 100) and V_h = 0.95 V_z (by variance floor(10 / 0.1 - 1) = 99) give
    T - 1 = 9, the last step being the FO term's; below the cap, the smaller bound (by variance floor(10 / 2 - 1) = 4
    under by memory floor(2.55 / 0.2) = 12)."""
    assert R.optimal_subchain_len(100.0, 10, 1.0, 0.0001, 0.95) == 9
    assert R.optimal_subchain_len(3.0, 10, 0.25, 0.05, 0.0) == 4


def test_zo_perturbations_are_keyed_on_the_block_and_the_step():
    """zo_perturbed(params, key, scale, i) adds scale x the standard normals of the generator seeded by key_seed(*key,
    i): equal for the same key and step, different for another step or another key's block."""
    p = torch.nn.Parameter(torch.zeros(5))

    def seen(key, i):
        with R.zo_perturbed([p], key, 0.5, i):
            return p.detach().clone()

    expected = 0.5 * torch.randn(5, generator=torch.Generator().manual_seed(R.key_seed(0, 3, 1, 2)))
    assert torch.equal(seen((0, 3, 1), 2), expected) and torch.equal(p.detach(), torch.zeros(5))
    assert not torch.equal(seen((0, 3, 1), 1), expected)  # another step
    assert not torch.equal(seen((0, 3, 0), 2), expected)  # another block


def _sd1(steps_offset=None):
    """A stand-in SD1.x model for make_schedule: alphabar linspace(0.99, 0.01, 1000), a scheduler config with or
    without steps_offset."""
    from types import SimpleNamespace

    config = {} if steps_offset is None else {"steps_offset": steps_offset}
    return SimpleNamespace(
        kind="sd1",
        alphas_cumprod=torch.linspace(0.99, 0.01, 1000),
        pipe=SimpleNamespace(scheduler=SimpleNamespace(config=config)),
    )


def test_the_ddim_schedule_by_hand_with_and_without_steps_offset():
    """4 of 1000 steps, "leading" spacing: t = 750, 500, 250, 0 (+ steps_offset, 0 when the config has none) and
    alphabar_prev = alphabar(t - 250), 1 where t - 250 < 0; at offset 0 the third step's previous timestep is exactly 0
    (alphabar(0), not 1); eta 0.3 on every step but the last; stochastic=False: eta 0 everywhere."""
    ac = _sd1().alphas_cumprod.double()
    for offset in (None, 0):
        s = R.make_schedule(_sd1(offset), 4, 0.3)
        assert s["t"].tolist() == [750, 500, 250, 0]
        assert torch.equal(s["a_prev"], torch.stack([ac[500], ac[250], ac[0], torch.tensor(1.0).double()]).float())
        assert torch.equal(s["a"], ac[[750, 500, 250, 0]].float())
        assert s["eta"].tolist() == pytest.approx([0.3, 0.3, 0.3, 0.0])
    s = R.make_schedule(_sd1(1), 4, 0.3, stochastic=False)
    assert s["t"].tolist() == [751, 501, 251, 1] and s["a_prev"][-1] == 1 and s["eta"].tolist() == [0.0] * 4


def test_the_flow_schedule_reads_the_pipeline_grid_and_the_sde_type():
    """shift 'pipeline' takes the model's own grid (model.sigmas(T)); the noise is noise_g's of --sde-type; an ODE
    schedule has g = 0 on every step."""
    from types import SimpleNamespace

    grid = torch.tensor([1.0, 0.9, 0.5, 0.0])
    model = SimpleNamespace(kind="flux", sigmas=lambda n: grid if n == 3 else None)
    s = R.make_schedule(model, 3, 0.7, shift="pipeline", sde_type="dance")
    assert torch.equal(s["sigmas"], grid) and s["g"].tolist() == pytest.approx([0.7, 0.7, 0.0])
    s = R.make_schedule(model, 3, 0.7, shift="pipeline", sde_type="flow")
    # Flow-GRPO's a sqrt(s / (1 - s)), sigmas[1] = 0.9 standing in for 1 in the first denominator
    assert s["g"][:2].tolist() == pytest.approx([0.7 * (1.0 / 0.1) ** 0.5, 0.7 * (0.9 / 0.1) ** 0.5])
    assert R.make_schedule(model, 3, 0.7, shift="pipeline", stochastic=False)["g"].tolist() == [0.0] * 3


def test_a_transition_passes_its_guidance_and_takes_an_sde_step_at_g_1():
    """Step 0 at g = 1 (sigma 0.8 -> 0.6) is the SDE step: x0_hat = x - 0.8 v, score = -(x - 0.2 x0_hat) / 0.64,
    mean = x - 0.2 (v - score / 2), std = sqrt(0.2); step 1 at g = 0 is Euler, x - 0.6 v; the model is called with
    the guidance scale 4 (and SD1.x's eps with it too)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    seen = []
    v = torch.tensor([[0.5, -1.0]])

    def velocity(module, x, sigma, cond, guidance_scale):
        seen.append(guidance_scale)
        return v

    model = SimpleNamespace(kind="flux", velocity=velocity)
    sched = {"sigmas": torch.tensor([0.8, 0.6, 0.0]), "g": torch.tensor([1.0, 0.0])}
    x = torch.tensor([[1.0, 2.0]])
    mean, std = R.transition(model, None, sched, 0, x, {}, 4.0, nullcontext)
    x0 = x - 0.8 * v
    score = -(x - 0.2 * x0) / 0.64
    torch.testing.assert_close(mean, x - 0.2 * (v - score / 2))
    assert std.flatten().tolist() == pytest.approx([0.2**0.5])
    mean, std = R.transition(model, None, sched, 1, x, {}, 4.0, nullcontext)
    torch.testing.assert_close(mean, x - 0.6 * v)
    assert float(std) == 0
    sd1 = SimpleNamespace(kind="sd1", eps=lambda module, x, t, cond, guidance_scale: seen.append(guidance_scale) or x)
    R.transition(sd1, None, R.make_schedule(_sd1(1), 4, 0.3), 0, x, {}, 4.0, nullcontext)
    assert seen == [4.0, 4.0, 4.0]


def test_key_seed_is_the_first_8_bytes_of_the_sha256_little_endian_under_2_63():
    """key_seed(*keys) = the first 8 bytes of sha256(repr(keys)), little-endian, with the top bit cleared (a
    generator's seed must fit in 63 bits): by hand with hashlib, for keys whose 8th byte has its top bit set."""
    import hashlib

    for keys in [(0, 3, 1, 2), (7, "zo", 5)]:
        digest = hashlib.sha256(repr(keys).encode()).digest()
        assert R.key_seed(*keys) == int.from_bytes(digest[:8], "little") % 2**63
    top = next(k for k in range(100) if hashlib.sha256(repr((k,)).encode()).digest()[7] >= 128)
    assert R.key_seed(top) < 2**63 and R.key_seed(top) != int.from_bytes(
        hashlib.sha256(repr((top,)).encode()).digest()[:8], "little"
    )


def test_the_flow_schedule_defaults_are_shift_3_and_flow_grpo_noise():
    """make_schedule(model, T, a) without shift or sde_type: the static shift 3 grid and Flow-GRPO's g."""
    from types import SimpleNamespace

    s = R.make_schedule(SimpleNamespace(kind="flux"), 4, 0.7)
    assert torch.equal(s["sigmas"], R.sigma_schedule(4, 3.0))
    expected = R.noise_g(R.sigma_schedule(4, 3.0), "flow", 0.7)
    assert torch.equal(s["g"][:3], expected[:3]) and s["g"][3] == 0 and expected[0] != expected[1]


def test_zo_noise_and_its_gradient_keep_the_parameters_dtype():
    """Float64 parameters get float64 perturbations, 0.5 x the standard normals of the seeded generator drawn in
    float64; the ZO gradient -coef zeta / scale^2 lands in the parameter's dtype even for a float64 coefficient on a
    float32 parameter (a float64 gradient would be refused on it)."""
    p64 = torch.zeros(4, dtype=torch.float64)
    (z,) = R.zo_noise([p64], 11, 0.5)
    expected = 0.5 * torch.randn(4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert z.dtype == torch.float64 and torch.equal(z, expected)
    p = torch.nn.Parameter(torch.zeros(3))
    coef = torch.full((3,), 0.25, dtype=torch.float64)  # one per element: a float64 tensor that promotes zeta
    R.add_zo_grad([p], [torch.tensor([1.0, -2.0, 0.5])], coef, 0.5)
    assert p.grad.dtype == torch.float32 and p.grad.tolist() == [-1.0, 2.0, -0.5]  # -0.25 zeta / 0.25


def test_a_subchain_log_prob_in_float64_is_exact_to_float64():
    """Steps j = 0 .. 1 (h = 2) of the chain m(x) = 0.5 x with std 0.3 given as a Python float: x1 = 0.5 x0 + 0.3 z0,
    log N(x2; 0.5 x1, 0.09) summed over dims, in float64 throughout (the std not rounded to float32 first); the
    deviation is |0.5 x1 + 0.3 z1 - x2|'s max."""
    import math

    latents = torch.tensor([[[0.2, -0.4], [0.1, 0.3], [0.7, -0.1]]], dtype=torch.float64)  # (B, T + 1, D)
    noise = torch.tensor([[[1.0, -0.5], [0.25, 2.0]]], dtype=torch.float64)  # (B, T, D)
    log_prob, deviation = R.subchain_log_prob(lambda k, x: (0.5 * x, 0.3), latents, noise, 0, 2)
    x1 = 0.5 * latents[:, 0] + 0.3 * noise[:, 0]
    m = 0.5 * x1
    expected = (-((latents[:, 2] - m) ** 2) / (2 * 0.09) - math.log(0.3) - 0.5 * math.log(2 * math.pi)).sum(1)
    torch.testing.assert_close(log_prob, expected, rtol=0, atol=1e-12)
    assert deviation.item() == pytest.approx((m + 0.3 * noise[:, 1] - latents[:, 2]).abs().max().item(), abs=1e-15)


def test_the_zo_baseline_by_hand_with_one_sample_in_the_other_block():
    """zo_baseline (eq. 6's ZO baseline): the mean of the sample's group in other blocks; with none there, of every
    sample in other blocks; with none at all, 0. Cases where exactly one sample is counted (a count test of > 1, or a
    count clamped to 2, would show) and where every sample shares one block."""
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])  # groups {0, 1}, {2, 3}; blocks alternate: one other-block sample each
    assert R.zo_baseline(r, 2, torch.tensor([0, 1, 0, 1])).tolist() == [2.0, 1.0, 5.0, 3.0]
    # groups {0, 1}, {2}: samples 0 and 1 have no group member in another block, so all other blocks: sample 2 alone;
    # sample 2's group has no one else, so all other blocks: (1 + 2) / 2
    three = torch.tensor([1.0, 2.0, 4.0])
    assert R.zo_baseline(three, 2, torch.tensor([0, 0, 1])).tolist() == [4.0, 4.0, 1.5]
    assert R.zo_baseline(torch.tensor([1.0, 2.0]), 2, torch.tensor([0, 0])).tolist() == [0.0, 0.0]  # one block


def test_term_weights_log_the_mean_size_of_each_terms_weight():
    """term_weights' figures (logged as rlr/ho_adv_abs and rlr/zo_adv_abs): the mean |R - b| of the HO term and
    |R - b'| of the ZO term, and 0 for the ZO term when no step is a ZO step."""
    r, block = torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.tensor([0, 1, 0, 1])
    zo = torch.zeros(4, 3, dtype=torch.bool)
    zo[1, 2] = True
    # loo baselines [2, 1, 5, 3] and zo baselines [2, 1, 5, 3] (above): |R - b| = [1, 1, 2, 2] for both
    *_, figures = R.term_weights(r, block, zo, 2, group_size=2)
    assert set(figures) == {"ho_adv_abs", "zo_adv_abs"}
    assert (figures["ho_adv_abs"].item(), figures["zo_adv_abs"].item()) == (1.5, 1.5)
    *_, figures = R.term_weights(r, block, torch.zeros_like(zo), 2, group_size=2)
    assert (figures["ho_adv_abs"].item(), figures["zo_adv_abs"].item()) == (1.5, 0.0)  # no ZO step: 0


def test_the_flag_defaults_rlr_derives_by_hand(tmp_path):
    """h* from --memory-budget-gb reads --variance-ratio (T = 10, B_h 8, B_z 0.24 GB, 200 GB: by memory
    floor(197.84 / 7.76) = 25; by variance floor(10 / (2 (1 - v)) - 1): 4 at v = 0, 9 at v = 0.5); one ZO block per
    rollout chunk, chunks of 1 included; an SD1.5 model's default noise is DDIM's eta 1."""
    for v, h in ((0.0, 4), (0.5, 9)):
        args = R.Args(memory_budget_gb=200.0, variance_ratio=v)
        R.resolve_and_check(args)
        assert args.subchain_len == h, v
    args = R.Args(rollout_batch_size=1, samples_per_device=4, group_size=2)
    R.resolve_and_check(args)
    assert args.zo_perturbations == 4
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')  # what sd1 is read from
    (tmp_path / "prompts.txt").write_text("a photo of a cat\n")
    prompts = str(tmp_path / "prompts.txt")
    clip = [f"clip={tmp_path}"]  # a differentiable reward of real images, its weights given (no hub lookup)
    args = R.Args(model_id=str(tmp_path), reward="clip", reward_ckpt=clip, prompts=prompts, eval_prompts=prompts)
    R.resolve_and_check(args)
    assert args.noise_level == 1.0


def test_rlr_refuses_what_its_first_order_term_cannot_take_and_reads_dcot_prompts(tmp_path):
    """RLR backpropagates through the reward into images: a reward that is not differentiable and a video model are
    refused, each in one line; --zo-perturbations 0 is one line too (not a division by zero) and 1 is taken;
    --dcot-prompts gives the training prompts (its first column) and refuses a --prompts beside it."""

    def refused(**flags):
        with pytest.raises(InputError) as e:
            R.resolve_and_check(R.Args(**flags))
        return str(e.value)

    assert refused(reward="jpeg").startswith(
        "--reward jpeg: jpeg is not differentiable, and this script backpropagates"
    )
    assert refused(terms="fo+ho+zo", zo_perturbations=0) == "--zo-perturbations must be >= 1 (got 0)"
    R.resolve_and_check(R.Args(terms="fo+ho+zo", zo_perturbations=1))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    wan = tmp_path / "wan"
    wan.mkdir()
    (wan / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    video = refused(model_id=str(wan), reward="clip", reward_ckpt=[f"clip={tmp_path}"], prompts=str(prompts),
                    eval_prompts=str(prompts))  # fmt: skip
    script = Path(sys.argv[0]).name  # the message names the running program (rlr.py in a run)
    assert video == (
        f"--model-id {wan} is a video model (wan), and {script} trains image models only (as its paper); train video "
        "with dancegrpo.py, branchgrpo.py or vgrpo.py"
    )
    (tmp_path / "dcot.tsv").write_text(
        "a red circle on a blue background\tc1\tm1\tf1\na blue square on a red background\tc2\tm2\tf2\n"
    )
    train, _, _ = R.resolve_and_check(R.Args(dcot_prompts=str(tmp_path / "dcot.tsv")))
    assert train == ["a red circle on a blue background", "a blue square on a red background"]
    (tmp_path / "other.tsv").write_text("a red circle on a blue background\tc\tm\tf\na dog\tc\tm\tf\n")
    assert refused(dcot_prompts=str(tmp_path / "other.tsv")).startswith(  # read by the reward as --prompts would be
        "--dcot-prompts: prompt 2: not a ShapesBench prompt: 'a dog'"
    )
    shapes = tmp_path / "shapes.txt"  # prompts the default reward reads: only --dcot-prompts is wrong here
    shapes.write_text("a red circle on a blue background\n")
    assert refused(dcot_prompts=str(tmp_path / "dcot.tsv"), prompts=str(shapes)) == (
        "--dcot-prompts replaces --prompts: give one of them"
    )
