"""branchgrpo.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/mutation.py generated that the other tests let pass."""

import pytest
import torch

import branchgrpo as B
from common import InputError


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7:
    2.1 / 2.4 = 0.875."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(B.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert B.sigma_schedule(10, 3.0)[3] == 0.875


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [
    (dict(num_steps=1, num_splits=1), "--num-steps must be at least 2"),
    (dict(num_steps=4, num_splits=4), "--split-schedule gives splits"),
    (dict(branch_factor=1), "--num-splits >= 1 and --branch-factor >= 2"),
    (
        dict(branch_s=0.0),
        "--branch-s, --noise-level, --fusion-temperature, --clip-range and --adv-clip-max must be > 0",
    ),
    (dict(noise_level=0.0), "--branch-s, --noise-level, --fusion-temperature, --clip-range"),
    (dict(fusion="path", fusion_temperature=0.0), "--branch-s, --noise-level, --fusion-temperature, --clip-range"),
    (dict(clip_range=0.0), "--branch-s, --noise-level, --fusion-temperature, --clip-range"),
    (dict(adv_clip_max=0.0), "--branch-s, --noise-level, --fusion-temperature, --clip-range"),
    (dict(kl_beta=-0.1), "--branch-s, --noise-level, --fusion-temperature, --clip-range"),
    (dict(pruning="width", width_mode="extreme", width_keep_ratio=0.0), "--width-keep-ratio must be in (0, 1]"),
    (dict(pruning="width", width_mode="extreme", width_keep_ratio=1.5), "--width-keep-ratio must be in (0, 1]"),
    (dict(pruning="mix", window_shift_every=0), "--window must be in [1, 19] and --window-shift-every >= 1"),
    (dict(pruning="mix", window=0), "--window must be in [1, 19]"),
    (dict(pruning="mix", window=20), "--window must be in [1, 19]"),
    (dict(pruning="depth", num_steps=5, num_splits=2), "--pruning depth: the last split is step 3"),
    (dict(trees_per_update=3), "--trees-per-update must divide --trees-per-device"),
    (dict(rollout_batch_size=0), "--trees-per-device, --rollout-batch-size >= 1"),
    (dict(trees_per_device=0), "--trees-per-device, --rollout-batch-size >= 1"),
]
ACCEPTED = [
    dict(num_steps=2, num_splits=1),
    dict(pruning="width", width_mode="extreme", width_keep_ratio=1.0),
    dict(pruning="mix", window=19, window_shift_every=1),
    dict(pruning="mix", window=1),
    dict(pruning="none", num_steps=5, num_splits=2),
    dict(kl_beta=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        B.resolve_and_check(B.Args(**flags))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    B.resolve_and_check(B.Args(**flags))


def test_the_modes_defaults_by_hand(capsys):
    """Flow noise 0.7, dance 0.3; depth's window is T - 2 - the last split (dense splits of 20 steps with 4 splits:
    0, 3, 6, 9, so 20 - 2 - 9 = 9), mix's the paper's 4; names by pruning mode; a window longer than what follows the
    last split is a warning."""
    flow, dance = B.Args(), B.Args(sde_type="dance", exp_name="mine")
    B.resolve_and_check(flow)
    B.resolve_and_check(dance)
    assert (flow.noise_level, flow.exp_name, dance.noise_level, dance.exp_name) == (0.7, "branchgrpo", 0.3, "mine")
    depth, mix = B.Args(pruning="depth"), B.Args(pruning="mix")
    B.resolve_and_check(depth)
    B.resolve_and_check(mix)
    assert B.split_steps("dense", 20, 4) == [0, 3, 6, 9]
    assert (depth.window, depth.exp_name, mix.window, mix.exp_name) == (9, "branchgrpo_depth", 4, "branchgrpo_mix")
    assert "warning" not in capsys.readouterr().err
    B.resolve_and_check(B.Args(pruning="depth", window=9))
    assert "warning" not in capsys.readouterr().err  # a window of exactly what follows the last split
    B.resolve_and_check(B.Args(pruning="depth", window=10))
    assert "9 trainable step(s) follow the last split 9, so the 10-step window shrinks to 9" in capsys.readouterr().err


def test_edge_gaussians_at_a_split_with_scaled_noise_by_hand():
    """The release's 'scaled' branch noise multiplies a split step's std by s = 3 (not the other steps'); the means are
    each parent's SDE mean repeated for its trained children. Step 0 (no split) and step 1 (a split into 2), one parent
    each, every child trained; sigmas 1, 0.75, 0.5; g = 0.4, 0.6: std_0 = 0.4 sqrt(0.25), std_1 = 3 x 0.6 sqrt(0.25)."""
    tree = B.Tree(num_steps=3, splits=(1,), branch_factor=2, branch_noise="scaled", branch_s=3.0)
    sigmas, g = torch.tensor([1.0, 0.75, 0.5, 0.0]), torch.tensor([0.4, 0.6, 0.0])
    x, v = torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[[0.5]], [[-1.0]]])  # rows: step 0's parent, step 1's
    segments = [(0, torch.tensor([0])), (1, torch.tensor([0]))]
    masks = [torch.tensor([True]), torch.tensor([True, True])]
    means, stds = B.edge_gaussians(x, v, segments, masks, sigmas, g, tree)
    assert stds.tolist() == pytest.approx([0.4 * 0.5, 3 * 0.6 * 0.5, 3 * 0.6 * 0.5])  # one edge, then two
    m0, _ = B.step_mean_std(x[:1], v[:1], sigmas[0], sigmas[1], g[0])
    m1, _ = B.step_mean_std(x[1:], v[1:], sigmas[1], sigmas[2], g[1])
    torch.testing.assert_close(means, torch.cat([m0, m1, m1]))


def test_micro_batch_picks_each_parents_own_children_at_a_split():
    """Steps 0 and 1 split each node into 2: parents 0 and 1 at depth 1 have children 0, 1 and 2, 3 at depth 2. With
    child 1 untrained, the micro-batch holds children 0, 2, 3: their states, old log-probs and advantages, and masks."""
    tree = B.Tree(num_steps=3, splits=(0, 1), branch_factor=2)
    states = [torch.zeros(1, 1), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0], [22.0], [23.0]])]
    states.append(states[-1].clone())
    grp = {
        "states": states,
        "keep": [torch.ones(1, 2, dtype=torch.bool), torch.tensor([[True, False, True, True]]), None],
        "adv": [torch.zeros(1, 2), torch.tensor([[0.5, -0.5, 1.5, -1.5]]), None],
        "log_probs": [torch.zeros(2), torch.tensor([-1.0, -2.0, -3.0, -4.0]), None],
        "cond": {"emb": torch.tensor([[7.0]])},
    }
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.0])
    x, sigma, cond, masks, x_child, old_lp, adv = B.micro_batch(grp, [(1, torch.tensor([0, 1]))], sigmas, tree)
    assert x.flatten().tolist() == [10.0, 11.0] and sigma.tolist() == [0.75, 0.75]
    assert masks[0].tolist() == [True, False, True, True] and cond["emb"].flatten().tolist() == [7.0, 7.0]
    assert x_child.flatten().tolist() == [20.0, 22.0, 23.0]
    assert old_lp.tolist() == [-1.0, -3.0, -4.0] and adv.tolist() == [0.5, 1.5, -1.5]


def test_the_policy_figures_by_hand():
    """Ratios 1.25, 1, 0.5 on old log-probs of -0.7, clip 0.25: the logged figures by name. ratio_mean holds the
    ratios (summarize takes their mean), ratio_max_dev = max |r - 1| = 0.5, clipfrac counts |r - 1| > 0.25 strictly
    (1.25 sits on the edge: 1/3), approx_kl = mean(0.5 d^2) over d = log r = (0.223144, 0, -0.693147): 0.088374."""
    import math

    d = [math.log(1.25), 0.0, -math.log(2.0)]
    old = torch.full((3,), -0.7, dtype=torch.float64)
    log_prob = old + torch.tensor(d, dtype=torch.float64)
    edge = float(torch.exp(log_prob[0] - old[0])) - 1  # 0.25 as the ratio computes it
    mean = torch.zeros(3, 1, dtype=torch.float64)
    _, figures = B.policy_loss(log_prob, old, torch.ones(3), mean, None, torch.ones(3), clip_range=edge, kl_beta=0.0)
    assert set(figures) == {"policy", "ratio_mean", "ratio_max_dev", "clipfrac", "approx_kl"}
    assert figures["ratio_mean"].tolist() == pytest.approx([1.25, 1.0, 0.5])
    assert figures["ratio_max_dev"].item() == pytest.approx(0.5)
    assert figures["clipfrac"].item() == pytest.approx(1 / 3)
    assert figures["approx_kl"].item() == pytest.approx(0.088374, abs=1e-6)


def test_a_near_tie_is_scaled_by_the_floor_of_the_std():
    """Depth values 0 and 2e-6 (unbiased std sqrt(2) 1e-6, above the 1e-6 below which a depth gets 0): the advantages
    are +-1e-6 / (sqrt(2) 1e-6 + 1e-8) = +-0.702137, the 1e-8 floor added (subtracted: +-0.712121)."""
    (_, adv) = B.depth_advantages(
        [torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[0.0, 2e-6]], dtype=torch.float64)]
    )
    expected = 1e-6 / (2**0.5 * 1e-6 + 1e-8)
    assert adv.flatten().tolist() == pytest.approx([-expected, expected], rel=1e-6)


def test_tree_advantages_with_path_fusion_by_hand():
    """One tree, K = 3 children at steps 0 and 1 (9 leaves); path fusion with gamma 2, temperature 0.5: a depth-1
    node's value is sum_l w_l r_l over its 3 leaves, w = softmax(2 lp_l / 0.5), lp_l the leaf's step-1 log-prob; its
    advantage the z-score over the 3 nodes; the leaves' the z-score of the rewards; each clipped to +-1.2."""
    import math

    rewards = [0.1, 0.9, 0.4, 0.3, 0.8, 0.2, 0.7, 0.5, 0.6]
    lp1 = [-0.2, 0.1, -0.5, 0.3, -0.1, 0.0, 0.2, -0.3, 0.4]  # step 1's edge log-prob of each leaf
    log_probs = [torch.tensor([0.05, -0.05, 0.1]), torch.tensor(lp1)]
    flags = dict(fusion="path", fusion_gamma=2.0, fusion_temperature=0.5, adv_clip_max=1.2)
    adv = B.tree_advantages({"r": torch.tensor([rewards], dtype=torch.float64)}, {"r": 1.0}, log_probs, [1, 3, 9],
                            **flags)  # fmt: skip

    def zscore(v):
        m = sum(v) / len(v)
        s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
        return [max(-1.2, min(1.2, (x - m) / (s + 1e-8))) for x in v]

    values = []
    for node in range(3):
        w = [math.exp(2.0 * lp1[3 * node + k] / 0.5) for k in range(3)]
        values.append(sum(wk * rewards[3 * node + k] for k, wk in enumerate(w)) / sum(w))
    assert len(adv) == 2 and adv[0].flatten().tolist() == pytest.approx(zscore(values), rel=1e-5)
    assert adv[1].flatten().tolist() == pytest.approx(zscore(rewards), rel=1e-5)
    assert max(abs(x) for x in zscore(rewards)) == 1.2  # the clip acts on the leaves


def test_tree_noise_is_the_keyed_stream_of_each_tree_and_step():
    """At a step without a split every node's noise is its tree's own draw from keyed_generator(seed, iteration,
    'tree', tree, step): trees 0 and 2 at step 1 of iteration 5 under seed 3."""
    from common.sampling import keyed_generator

    tree = B.Tree(num_steps=4, splits=(0,), branch_factor=2)
    noise = B.tree_noise(tree, 3, 5, [0, 2], (2, 2), 1, 2)
    expected = [torch.randn((2, 2, 2), generator=keyed_generator(3, 5, "tree", t, 1)) for t in (0, 2)]
    assert torch.equal(noise, torch.cat(expected))
