"""Schedules as main() applies them, read back from its own metrics.jsonl, and the regularisers' magnitudes.

Each run is a tiny in-process main() on ShapesBench with extreme settings; every expected figure is worked out by hand
in the test from the flags (the sigma schedule, the window rule, the tree's edge counts, the warmup), never by calling
the function under test. The magnitude tests wrap the script's own objective and compare what it returned with the
closed form computed here from the exact tensors main() passed it, to 1e-6 relative: a factor of 2 anywhere fails.
"""

import functools
import math

import pytest
import torch
import tyro

import branchgrpo as B
import dancegrpo as D
import rlr as R
import vgrpo as V
from tests.helpers import metrics

QUICK = ["--eval-every", "0", "--sample-every", "0", "--no-save"]

# ShapesBench's shifted schedule (shift 3): sigma' = 3 s / (1 + 2 s) on s = linspace(1, 0, T + 1)
SIGMAS_4 = [1.0, 0.9, 0.75, 0.5, 0.0]  # T = 4: s = 1, .75, .5, .25, 0 -> 1, 2.25/2.5, 1.5/2, .75/1.5, 0
# std of the flow SDE step i (a = 0.7): g_i sqrt(sigma_i - sigma_{i+1}), g_i = a sqrt(sigma_i / (1 - sigma_i)) with
# sigma_1 in the first denominator: step 0: 0.7 sqrt(1 / 0.1) sqrt(0.1) = 0.7; step 1: 0.7 * 3 * sqrt(0.15);
# step 2: 0.7 sqrt(3) * 0.5. Step 3 (to sigma = 0) is the deterministic Euler step.
STEP_STDS_4 = [0.7, 2.1 * math.sqrt(0.15), 0.35 * math.sqrt(3)]
# T = 5: sigma = 1, 12/13, 9/11, 2/3, 3/7, 0; std_i = 0.7 sqrt(sigma_i / (1 - sigma_i) (sigma_i - sigma_{i+1})), sigma_1
# in the first denominator: 0.7; 0.7 sqrt(12 * 15/143); 0.7 sqrt(4.5 * 5/33); 0.7 sqrt(2 * 5/21)
STEP_STDS_5 = [0.7, 0.7 * math.sqrt(180 / 143), 0.7 * math.sqrt(15 / 22), 0.7 * math.sqrt(10 / 21)]


def run_main(module, monkeypatch, tmp_path, flags, record=(), perturb_lora=False):
    """module.main() in this process on `flags` (+ no evaluation, grids or saving); the calls of the module functions
    named in `record` [(args, kwargs, output)], and the training records of metrics.jsonl, one per iteration."""
    calls = {name: [] for name in record}
    for name in record:

        def wrap(fn, name=name):
            @functools.wraps(fn)  # keeps the signature: main() reads policy_loss's keyword-only flags from it
            def recorded(*a, **kw):
                out = fn(*a, **kw)
                calls[name].append((a, kw, out))
                return out

            return recorded

        monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    if perturb_lora:  # the adapter away from 0, so that the policy differs from the base model and the KL is not 0
        make_trainable = module.trainable_denoiser

        def trainable_denoiser(model, args):
            denoiser = make_trainable(model, args)
            gen = torch.Generator().manual_seed(0)
            for name, p in denoiser.named_parameters():
                if "lora_B" in name:
                    p.data = 0.3 * torch.randn(p.shape, generator=gen)
            return denoiser

        monkeypatch.setattr(module, "trainable_denoiser", trainable_denoiser)
    argv = [*flags, *QUICK, "--output-dir", str(tmp_path), "--exp-name", "run"]
    module.main(tyro.cli(module.Args, args=argv))
    records = [r for r in metrics(tmp_path / "run") if "charts/lr" in r]
    assert [r["iteration"] for r in records] == list(range(1, len(records) + 1))
    return calls, records


def column(records, key):
    return [r[key] for r in records]


def approx(values, rel=1e-6):
    return pytest.approx(values, rel=rel, abs=1e-12)


# ---------------------------------------------------------------------------------------------------
# Schedules, read from metrics.jsonl
# ---------------------------------------------------------------------------------------------------
def test_dancegrpo_mixgrpo_window_slides_and_stops_at_the_last_trainable_step_and_lr_warms_up(monkeypatch, tmp_path):
    flags = ["--iterations", "4", "--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "2",
             "--samples-per-update", "2", "--num-steps", "5", "--sde-window", "2", "--window-shift-every", "1",
             "--learning-rate", "6e-4", "--lr-warmup", "3"]  # fmt: skip
    calls, records = run_main(D, monkeypatch, tmp_path, flags, ["rollout"])
    # T = 5: steps 0..3 are trainable (step 4 lands on x0_hat); window [c, c + 2), c = min(it // 1, 4 - 2)
    assert column(records, "charts/window_start") == [0, 1, 2, 2]
    # the SDE steps the rollout really used: 2 chunks per iteration, each with the window of its iteration
    used = [list(a[7]) for a, _, _ in calls["rollout"]]
    assert used == [[0, 1]] * 2 + [[1, 2]] * 2 + [[2, 3]] * 2 + [[2, 3]] * 2
    # 2 optimizer steps per iteration (4 samples, 2 per update); the last step of iteration k is step 2k + 2 (1-based):
    # lr = 6e-4 * min(1, step / 3): 2/3 of it, then all of it
    assert column(records, "charts/lr") == approx([6e-4 * 2 / 3, 6e-4, 6e-4, 6e-4])
    # --timestep-fraction 1 with a window: both window steps trained; NFE = 5 rollout + 2 trained forwards
    assert column(records, "perf/trained_steps_per_image") == [2] * 4
    assert column(records, "perf/nfe_per_image") == [7] * 4


# BranchGRPO, T = 8, splits 1 and 3, K = 2: nodes per depth 1, 1, 2, 2, 4, 4, 4, 4, 4 (4 leaves); step i's edges
# (into depth i + 1): 1, 2, 2, 4, 4, 4, 4, 4; step 7 (to sigma = 0) is never trained.
# Node forwards per tree: 1 + 1 + 2 + 2 + 4 + 4 + 4 + 4 = 22, i.e. 5.5 per leaf.
BRANCH_TREE = ["--num-steps", "8", "--split-schedule", "1,3", "--window-shift-every", "1", "--iterations", "3",
               "--trees-per-device", "2", "--trees-per-update", "1", "--rollout-batch-size", "8",
               "--learning-rate", "6e-4", "--lr-warmup", "3"]  # fmt: skip


def test_branchgrpo_mix_window_and_trained_edges(monkeypatch, tmp_path):
    _, records = run_main(B, monkeypatch, tmp_path, [*BRANCH_TREE, "--pruning", "mix", "--window", "3"])
    # Mix: a 3-step window from step 0, one step deeper per iteration (cap 6 - 3 + 1 = 4, not reached): 0, 1, 2
    assert column(records, "charts/window_start") == [0, 1, 2]
    # SDE (and trained) steps: the window and the splits {1, 3}
    #   it 0: {0, 1, 2, 3}: 1 + 2 + 2 + 4 = 9 edges per tree;  it 1: {1, 2, 3}: 2 + 2 + 4 = 8;  it 2: {1, 2, 3, 4}: 12
    assert column(records, "tree/trained_edges_per_leaf") == approx([9 / 4, 8 / 4, 12 / 4])
    # parents with a trained child: it 0: 1 + 1 + 2 + 2 = 6; it 1: 1 + 2 + 2 = 5; it 2: 1 + 2 + 2 + 4 = 9 (per tree)
    assert column(records, "tree/train_forwards_per_leaf") == approx([6 / 4, 5 / 4, 9 / 4])
    assert column(records, "tree/rollout_forwards_per_leaf") == approx([22 / 4] * 3)
    # 2 trees, one per optimizer step: 2 steps per iteration; lr = 6e-4 * min(1, step / 3) at steps 2, 4, 6
    assert column(records, "charts/lr") == approx([6e-4 * 2 / 3, 6e-4, 6e-4])


def test_branchgrpo_depth_window_after_the_last_split_and_trained_edges(monkeypatch, tmp_path):
    _, records = run_main(B, monkeypatch, tmp_path, [*BRANCH_TREE, "--pruning", "depth", "--window", "2"])
    # depth: the window of left-out steps starts right after the last split (step 4) and ends at step T - 2 = 6 at the
    # latest: start = min(4 + it, 6 - 2 + 1) = 4, 5, 5
    assert column(records, "charts/window_start") == [4, 5, 5]
    # every step 0..6 is SDE; trained: all but the window. it 0: steps 0, 1, 2, 3, 6: 1 + 2 + 2 + 4 + 4 = 13;
    # it 1 and 2: steps 0..4: 1 + 2 + 2 + 4 + 4 = 13 (of the 21 trainable edges)
    assert column(records, "tree/trained_edges_per_leaf") == approx([13 / 4] * 3)
    # parents: it 0: 1 + 1 + 2 + 2 + 4 (step 6) = 10; it 1, 2: 1 + 1 + 2 + 2 + 4 (step 4) = 10
    assert column(records, "tree/train_forwards_per_leaf") == approx([10 / 4] * 3)
    assert column(records, "charts/lr") == approx([6e-4 * 2 / 3, 6e-4, 6e-4])


def test_vgrpo_stratified_grid_pairs_come_from_the_rollout_schedule_never_sigma_0(monkeypatch, tmp_path):
    flags = ["--iterations", "3", "--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "4",
             "--train-batch-size", "2", "--samples-per-update", "2", "--num-steps", "4", "--n-mc", "2",
             "--pair-times", "grid", "--stratified", "--learning-rate", "4e-4", "--lr-warmup", "5"]  # fmt: skip
    calls, records = run_main(V, monkeypatch, tmp_path, flags, ["draw_pairs"])
    # grid = sigma_0..sigma_3 = 1, 0.9, 0.75, 0.5 (not sigma_4 = 0); stratified over 2 chunks: {1, 0.9}, {0.75, 0.5}
    first, second = {1.0, 0.9}, {0.75, 0.5}
    assert len(calls["draw_pairs"]) == 3
    for (_, _, (t, _)), record in zip(calls["draw_pairs"], records):
        assert t.shape == (4, 2) and torch.equal(t, t[:1].expand(4, 2))  # shared by every image
        a, b = float(t[0, 0]), float(t[0, 1])
        assert any(a == pytest.approx(s) for s in first) and any(b == pytest.approx(s) for s in second), (a, b)
        assert bool((t > 0).all())  # a pair at sigma = 0 has x0_hat = x and carries no signal
        # the logged figure is the mean of the two timesteps: one of (1 + .75) / 2, (1 + .5) / 2, (.9 + .75) / 2, ...
        assert record["surrogate/t_mean"] == pytest.approx((a + b) / 2, rel=1e-6)
        assert any(record["surrogate/t_mean"] == pytest.approx(m, rel=1e-6) for m in (0.875, 0.75, 0.825, 0.7))
    # forwards per image: 4 rollout steps + 2 pairs behaviour + 2 pairs policy
    assert column(records, "perf/nfe_per_image") == [8] * 3
    # 2 optimizer steps per iteration, warmup 5: steps 2, 4, 6 -> 2/5, 4/5, 1 of 4e-4
    assert column(records, "charts/lr") == approx([4e-4 * 2 / 5, 4e-4 * 4 / 5, 4e-4])


def test_rlr_subchain_windows_in_the_medium_third_and_the_half_order_weights(monkeypatch, tmp_path):
    flags = ["--iterations", "2", "--samples-per-device", "6", "--group-size", "3", "--rollout-batch-size", "2",
             "--num-steps", "9", "--subchain-len", "3", "--subchain-stage", "medium", "--terms", "fo+ho",
             "--learning-rate", "1e-4", "--lr-warmup", "4"]  # fmt: skip
    calls, records = run_main(R, monkeypatch, tmp_path, flags, ["subchain_log_prob", "term_weights"])
    # T = 9, h = 3: a window j..j+2 must end before step 8, so j <= 5; the medium third is 3 j // 9 == 1: j in 3..5
    allowed = {3, 4, 5}
    js = [a[3] for a, _, _ in calls["subchain_log_prob"]]
    assert len(js) == 2 * 3 and set(js) <= allowed, js  # 3 chunks per iteration
    assert all(a[4] == 3 for a, _, _ in calls["subchain_log_prob"])  # h
    for k, record in enumerate(records):
        assert record["rlr/window_start"] == pytest.approx(sum(js[3 * k : 3 * k + 3]) / 3, rel=1e-6)
        assert 3 <= record["rlr/window_start"] <= 5
    assert column(records, "rlr/subchain_len") == [3, 3]
    assert column(records, "perf/nfe_per_image") == [9 + 3] * 2  # T rollout forwards + h recomputed in the window
    assert column(records, "rlr/zo_steps") == [0, 0]
    assert column(records, "charts/lr") == approx([1e-4 / 4, 1e-4 * 2 / 4])  # one optimizer step per iteration

    # HO weights: R - the mean of the OTHER two samples of the group (groups of 3 consecutive samples), by hand
    assert len(calls["term_weights"]) == 2
    for (a, kw, (w_ho, _, _, _)), record in zip(calls["term_weights"], records):
        rewards, group_size = a[0].double().tolist(), kw["group_size"]
        assert group_size == 3 and len(rewards) == 6
        expected = []
        for i, r in enumerate(rewards):
            g = i // 3
            others = [rewards[j] for j in range(3 * g, 3 * g + 3) if j != i]
            expected.append(r - (others[0] + others[1]) / 2)
        # float32 rewards of size ~1: R - b carries their rounding (~1e-7), so an absolute tolerance of 1e-6
        assert w_ho.double().tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
        assert record["rlr/ho_adv_abs"] == pytest.approx(sum(abs(w) for w in expected) / 6, rel=1e-6, abs=1e-6)
        assert record["rlr/ho_adv_abs"] == pytest.approx(float(w_ho.abs().mean()), rel=1e-6)
        assert record["rewards/mean"] == pytest.approx(sum(rewards) / 6, rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# Magnitudes: each objective's KL and loss against their closed forms on the tensors main() passed
# ---------------------------------------------------------------------------------------------------
BETA = 0.3


def ppo_surrogate(log_prob, old_log_prob, adv, clip_range):
    """max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(log_prob - old_log_prob), in float64."""
    ratio = torch.exp(log_prob.detach().double() - old_log_prob.detach().double())
    adv = adv.detach().double()
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))


def assert_sum_close(loss, surrogate, kl_term):
    """loss == surrogate + kl_term per row, to 1e-6 of the terms' sizes (float32 rounds each term, and a row where the
    two nearly cancel keeps that absolute error); the KL term is no rounding error next to the surrogate, so a beta
    off by a factor 2 moves the loss 100 times the tolerance."""
    loss = loss.detach().double()
    scale = surrogate.abs() + kl_term.abs()
    assert bool(((loss - (surrogate + kl_term)).abs() <= 1e-6 * scale + 1e-12).all()), (loss, surrogate, kl_term)
    assert float(kl_term.min()) > 1e-4 * float(surrogate.abs().max())


def check_gaussian_kl_calls(calls, clip_range, stds):
    """Per policy_loss call of dancegrpo / branchgrpo: the KL figure is mean over dims of (mean - mean_ref)^2 /
    (2 std^2) averaged over rows, the loss surrogate + BETA * KL per row; returns the KL figures (by hand)."""
    figures = []
    for a, kw, (loss, figs) in calls:
        if len(a) == 8:  # dancegrpo.py's: the rollout's mean and the step size too, and its --objective
            log_prob, old_log_prob, adv, mean, _, mean_ref, std, _ = a
        else:
            log_prob, old_log_prob, adv, mean, mean_ref, std = a
        assert (kw["clip_range"], kw["kl_beta"]) == (clip_range, BETA)  # whatever else a fork's loss takes
        assert mean_ref is not None
        s = std.detach().double().flatten()
        for value in s.unique().tolist():  # each a step's std g_i sqrt(sigma_i - sigma_{i+1}), by hand above
            assert any(value == pytest.approx(h, rel=1e-6) for h in stds), value
        kl = (mean.detach().double() - mean_ref.detach().double()).square().flatten(1).mean(1) / (2 * s**2)
        assert float(kl.min()) > 1e-6  # a KL that matters: the adapter moved the policy away from the base
        assert float(figs["kl"]) == pytest.approx(float(kl.mean()), rel=1e-6)
        surrogate = ppo_surrogate(log_prob, old_log_prob, adv, clip_range)
        assert_sum_close(loss, surrogate, BETA * kl)
        # (the mean of rows of both signs: to 1e-6 of their sizes)
        assert float(figs["policy"]) == pytest.approx(float(surrogate.mean()), abs=1e-6 * float(surrogate.abs().mean()))
        figures.append(float(kl.mean()))
    return figures


def test_dancegrpo_kl_and_loss_are_their_closed_forms(monkeypatch, tmp_path):
    flags = ["--iterations", "1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
             "--samples-per-update", "2", "--num-steps", "4", "--timestep-fraction", "1.0", "--kl-beta", str(BETA),
             "--clip-range", "1e-3", "--learning-rate", "1e-3", "--lr-warmup", "0"]  # fmt: skip
    calls, (record,) = run_main(D, monkeypatch, tmp_path, flags, ["policy_loss"], perturb_lora=True)
    assert len(calls["policy_loss"]) == 2 * 3  # 2 chunks x the 3 SDE steps
    kls = check_gaussian_kl_calls(calls["policy_loss"], 1e-3, STEP_STDS_4)
    assert record["losses/kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-6)  # the mean of the per-call figures
    assert record["perf/nfe_per_image"] == 4 + 3 * 2  # rollout + policy and reference forwards of the 3 steps


def test_branchgrpo_kl_and_loss_are_their_closed_forms(monkeypatch, tmp_path):
    # T = 5, splits 0 and 1: nodes per depth 1, 2, 4, 4, 4, 4; trained steps 0..3: 2 + 4 + 4 + 4 = 14 edges per tree
    flags = ["--iterations", "1", "--trees-per-device", "2", "--trees-per-update", "1", "--num-steps", "5",
             "--split-schedule", "0,1", "--rollout-batch-size", "4", "--kl-beta", str(BETA), "--clip-range", "1e-3",
             "--learning-rate", "1e-3", "--lr-warmup", "0"]  # fmt: skip
    calls, (record,) = run_main(B, monkeypatch, tmp_path, flags, ["policy_loss"], perturb_lora=True)
    assert sum(len(a[0]) for a, _, _ in calls["policy_loss"]) == 2 * 14  # every trained edge once
    kls = check_gaussian_kl_calls(calls["policy_loss"], 1e-3, STEP_STDS_5)
    assert record["losses/kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-6)
    assert record["tree/trained_edges_per_leaf"] == pytest.approx(14 / 4)


def test_branchgrpo_short_chain_without_a_window_is_accepted():
    """--pruning none uses no window, so its default (4) is not checked against --num-steps 4 (found here and fixed in
    f5e8c36: '--window must be in [1, 3]' refused the run, and passing --window was refused too)."""
    args = tyro.cli(B.Args, args=["--num-steps", "4", "--split-schedule", "0,1"])
    B.resolve_and_check(args)


def test_vgrpo_kl_and_loss_are_their_closed_forms(monkeypatch, tmp_path):
    flags = ["--iterations", "1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
             "--train-batch-size", "2", "--samples-per-update", "2", "--num-steps", "4", "--n-mc", "4",
             "--kl-beta", str(BETA), "--kl-ref", "base", "--clip-range", "6e-3", "--learning-rate", "1e-3",
             "--lr-warmup", "0"]  # fmt: skip
    calls, (record,) = run_main(V, monkeypatch, tmp_path, flags, ["policy_loss"], perturb_lora=True)
    assert len(calls["policy_loss"]) == 2  # 2 micro-batches of 2 images
    kls = []
    for a, kw, (loss, figs) in calls["policy_loss"]:
        values, old_values, adv, x0_hat, ref_x0 = a
        assert (kw["clip_range"], kw["kl_beta"]) == (6e-3, BETA)
        assert values.shape == (2, 4) and x0_hat.shape[:2] == (2, 4) and ref_x0.shape == x0_hat.shape
        kl = (x0_hat.detach().double() - ref_x0.double()).square().flatten(1).mean(1)  # over pairs and dims
        assert float(kl.min()) > 1e-6
        assert float(figs["kl"]) == pytest.approx(float(kl.mean()), rel=1e-6)
        log_ratio = values.detach().double().mean(1) - old_values.double().mean(1)  # pairs averaged first
        surrogate = ppo_surrogate(log_ratio, torch.zeros_like(log_ratio), adv, 6e-3)
        assert_sum_close(loss, surrogate, BETA * kl)
        kls.append(float(kl.mean()))
    assert record["losses/kl"] == pytest.approx(sum(kls) / 2, rel=1e-6)
    # 4 pairs, one per grid point when n_mc = T: t_mean = (1 + 0.9 + 0.75 + 0.5) / 4, whatever the draw
    assert record["surrogate/t_mean"] == pytest.approx(3.15 / 4, rel=1e-6)
    assert record["perf/nfe_per_image"] == 4 + 3 * 4  # rollout + behaviour, base and policy forwards of 4 pairs
