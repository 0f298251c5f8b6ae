"""branchgrpo.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

from contextlib import nullcontext

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
LEAVES = (
    "--branch-factor 2 at 17 split steps makes 2^17 leaves per tree, more than 65536; lower --branch-factor or the "
    "splits (--num-splits, --split-schedule)"
)
REFUSED = [  # each message whole: a constant bound is the declaration's message, one that reads another flag its own
    (dict(num_steps=1, num_splits=1), "--num-steps must be >= 2 (got 1)"),
    (
        dict(num_steps=4, num_splits=4),
        "--split-schedule gives splits [0, 3, 6, 9]: they must be distinct steps in [0, 2] (the last step is deterministic); change --num-splits, --num-steps or --split-schedule",
    ),
    (dict(branch_factor=1), "--branch-factor must be >= 2 (got 1)"),
    (dict(branch_s=0.0), "--branch-s must be > 0 (got 0.0)"),
    (dict(noise_level=0.0), "--noise-level must be > 0 (got 0.0)"),
    (dict(fusion="path", fusion_temperature=0.0), "--fusion-temperature must be > 0 (got 0.0)"),
    (dict(clip_range=0.0), "--clip-range must be > 0 (got 0.0)"),
    (dict(adv_clip_max=0.0), "--adv-clip-max must be > 0 (got 0.0)"),
    (dict(kl_beta=-0.1), "--kl-beta must be >= 0 (got -0.1)"),
    (dict(pruning="width", width_mode="extreme", width_keep_ratio=0.0), "--width-keep-ratio must be > 0 (got 0.0)"),
    (dict(pruning="width", width_mode="extreme", width_keep_ratio=1.5), "--width-keep-ratio must be <= 1 (got 1.5)"),
    (dict(pruning="mix", window_shift_every=0), "--window-shift-every must be >= 1 (got 0)"),
    (dict(pruning="mix", window=0), "--window must be >= 1 (got 0)"),
    (dict(pruning="mix", window=20), "--window must be in [1, 19] (= --num-steps - 1)"),
    (
        dict(pruning="depth", num_steps=5, num_splits=2),
        "--pruning depth: the last split is step 3 = --num-steps - 2, so no trainable step follows it; move the splits earlier (--split-schedule) or raise --num-steps",
    ),
    (dict(trees_per_update=3), "--trees-per-update must divide --trees-per-device"),
    (dict(rollout_batch_size=0), "--rollout-batch-size must be >= 1 (got 0)"),
    (dict(trees_per_device=0), "--trees-per-device must be >= 1 (got 0)"),
    (dict(num_splits=0), "--num-splits must be >= 1 (got 0)"),
    (dict(pruning="depth", window=0), "--window must be >= 1 (got 0)"),
    (dict(pruning="depth", num_splits=0), "--num-splits must be >= 1 (got 0)"),  # refused before the window reads it
    (dict(num_steps=50, num_splits=17), LEAVES),  # dense splits 0, 3, .., 48: 2^17 leaves
    (  # sparse: 30 splits of 20 steps are step 0 thirty times, which was one split, silently
        dict(split_schedule="sparse", num_splits=30),
        f"--split-schedule gives splits {[0] * 30}: they must be distinct steps in [0, 18] (the last step is "
        "deterministic); change --num-splits, --num-steps or --split-schedule",
    ),
    (dict(num_steps=50, split_schedule=",".join(map(str, range(17)))), LEAVES),
    (dict(split_schedule=","), "--split-schedule ',': use dense, sparse, late or a list like 0,3,6,9"),  # no split
]
ACCEPTED = [
    dict(num_steps=2, num_splits=1),
    dict(pruning="width", width_mode="extreme", width_keep_ratio=1.0),
    dict(pruning="mix", window=19, window_shift_every=1),
    dict(pruning="mix", window=1),
    dict(pruning="none", num_steps=5, num_splits=2),
    dict(kl_beta=0.0),
    dict(trees_per_device=1, trees_per_update=1, rollout_batch_size=1),
    dict(num_steps=50, num_splits=16),  # 2^16 leaves, the most
    dict(num_steps=50, split_schedule="0,0,1"),  # a split listed twice is one split: 2^2 leaves
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        B.resolve_and_check(B.Args(**flags))
    assert str(e.value) == message


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    B.resolve_and_check(B.Args(**flags))


def test_the_depth_window_follows_the_last_split_of_each_schedule():
    """Depth pruning's default window is T - 2 - the last split, on the schedule's own splits of T = 20: sparse
    0, 5, 10, 15 gives 3; late 10, 12, 14, 16 gives 2."""
    for schedule, window in (("sparse", 3), ("late", 2)):
        args = B.Args(pruning="depth", split_schedule=schedule, num_splits=4)
        B.resolve_and_check(args)
        assert args.window == window, schedule


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


class Linear:
    """A model whose velocity is v = guidance * c * x + t: every step of a rollout can be done by hand."""

    def velocity(self, denoiser, x, t, cond, guidance_scale=1.0):
        assert denoiser == "denoiser"
        return guidance_scale * cond["c"] * x + t.view(-1, 1)


def test_tree_rollout_by_hand_an_sde_split_then_two_euler_steps():
    """Two trees (x 1 and -2, c 1 and 1.5), guidance 3, so v = 3 c x + t; sigmas 1, 0.75, 0.5, 0, g_0 = 0.4; step 0
    an SDE split into 2, steps 1 (an ODE step, as --pruning mix's) and 2 (the last) Euler; 3 nodes per forward.
    Step 0: d = -0.25, std = 0.4 sqrt(0.25) = 0.2; at sigma 1 the score is -x, so mean = x + d (v + 0.08 x):
    tree 0: v = 4, mean = 1 - 0.25 x 4.08 = -0.02; tree 1: v = -8, mean = -2 + 0.25 x 8.16 = 0.04; the children
    mean + 0.2 z with z = 0.5, -2 | 1.5, 0.25: 0.08, -0.42 | 0.34, 0.09.
    Step 1: x - 0.25 (3 c x + 0.75): -0.1675, -0.2925 | -0.23, -0.19875.
    Step 2: x - 0.5 (3 c x + 0.5): -0.16625, -0.10375 | 0.0375, -0.0015625."""
    import math

    tree = B.Tree(num_steps=3, splits=(0,), branch_factor=2, branch_s=3.0)
    sigmas, g = torch.tensor([1.0, 0.75, 0.5, 0.0]), torch.tensor([0.4, 0.6, 0.0])
    z = torch.tensor([[0.5], [-2.0], [1.5], [0.25]])
    calls = []

    def noise_fn(i, n_parents):
        calls.append((i, n_parents))
        return z

    roots, cond = torch.tensor([[1.0], [-2.0]]), {"c": torch.tensor([[1.0], [1.5]])}
    states, log_probs = B.tree_rollout(Linear(), "denoiser", cond, roots, noise_fn, tree, sigmas, g, [0], 3, 3.0,
                                       nullcontext)  # fmt: skip
    assert calls == [(0, 1)]  # one parent per tree at step 0
    expected = [[1.0, -2.0], [0.08, -0.42, 0.34, 0.09], [-0.1675, -0.2925, -0.23, -0.19875]]
    expected.append([-0.16625, -0.10375, 0.0375, -0.0015625])
    for state, e in zip(states, expected, strict=True):
        assert state.flatten().tolist() == pytest.approx(e, abs=1e-6)
    # N(mean, 0.2^2) at mean + 0.2 z: -z^2 / 2 - log 0.2 - log(2 pi) / 2; the Euler steps' edges carry 0
    lp = [-(v**2) / 2 - math.log(0.2) - 0.5 * math.log(2 * math.pi) for v in (0.5, -2.0, 1.5, 0.25)]
    assert log_probs[0].tolist() == pytest.approx(lp, abs=1e-5)
    assert log_probs[1].tolist() == [0.0] * 4 and log_probs[2].tolist() == [0.0] * 4


def test_branch_noise_is_the_shared_part_plus_each_childs_own():
    """rho 0.25: z_c = 0.5 xi_parent + sqrt(0.75) xi_c, xi_parent drawn first (one per parent), then xi_c (one per
    child), both from the one generator; two parents, three children each."""
    from common.sampling import keyed_generator

    z = B.branch_noise(keyed_generator(7, "b"), 2, 3, (2,), 0.25)
    gen = keyed_generator(7, "b")
    shared, own = torch.randn((2, 1, 2), generator=gen), torch.randn((2, 3, 2), generator=gen)
    torch.testing.assert_close(z, (0.5 * shared + 0.75**0.5 * own).reshape(6, 2))


def test_sde_steps_are_every_step_but_the_last_without_mix():
    for pruning in ("none", "width", "depth"):
        tree = B.Tree(num_steps=5, splits=(0, 1), pruning=pruning, window=1)
        assert B.sde_steps(tree, 0) == B.sde_steps(tree, 100) == [0, 1, 2, 3], pruning


def test_trained_edges_leave_ode_steps_and_the_last_step_out_under_width_pruning():
    """Width pruning (parent-top1) of two trees, K = 3 at the one split (step 0), 5 steps, SDE steps 0, 1, 3, 4: step 2
    an ODE step, and the last step listed (sde_steps never lists it; the mask leaves it out all the same). Each tree
    keeps its best child's chain (children 1 and 0: not the last child, so the one-hot has K columns only if told so)
    on the SDE steps after the split; the split's edges are all trained; step 2 (ODE) and step 4 (the last) none."""
    tree = B.Tree(num_steps=5, splits=(0,), branch_factor=3, pruning="width")
    adv = [torch.tensor([[0.5, 0.9, -1.0], [0.2, -0.3, 0.1]])] + [torch.zeros(2, 3)] * 4
    keep = B.trained_edges(tree, [0, 1, 3, 4], adv, 0)
    chain = [[False, True, False], [True, False, False]]
    none = [[False] * 3] * 2
    assert [k.tolist() for k in keep] == [[[True] * 3] * 2, chain, none, chain, none]


def test_width_extreme_keeps_at_least_two_chains_the_best_and_the_worst():
    """--width-keep-ratio 0.25 of 4 chains is 1, raised to the floor of 2: each tree's lowest and highest advantage
    (tree 0: children 1 and 2; tree 1: children 0 and 3)."""
    tree = B.Tree(num_steps=4, splits=(0,), branch_factor=4, pruning="width", width_mode="extreme",
                  width_keep_ratio=0.25)  # fmt: skip
    adv = [torch.tensor([[0.3, -1.2, 0.8, 0.1], [-0.5, 0.4, 0.2, 0.9]])] + [torch.zeros(2, 4)] * 3
    keep = B.trained_edges(tree, B.sde_steps(tree, 0), adv, 0)
    chain = [[False, True, True, False], [True, False, False, True]]
    assert [k.tolist() for k in keep] == [[[True] * 4] * 2, chain, chain, [[False] * 4] * 2]


def test_path_fusion_of_two_trees_weighs_each_trees_own_leaves():
    """Two trees of splits 0, 1 (K = 2, 4 leaves), gamma 0.5, temperature 2 (a softmax of 0.25 lp): tree 0 as in
    test_branchgrpo.py's path fusion test, tree 1 with other rewards and log-probs; below the root a softmax over the
    tree's own 4 leaves, below a depth-1 node over its 2."""
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0], [4.0, 0.0, -2.0, 6.0]])
    lps = [
        torch.tensor([0.4, 0.0, -0.2, 0.6]),  # step 0: tree 0's 2 edges, then tree 1's
        torch.tensor([0.0, 1.0, 0.0, 0.0, 0.3, -0.4, 0.8, 0.0]),
        torch.tensor([0.5, 0.0, 0.0, -1.0, 0.0, 0.2, -0.6, 1.0]),
    ]
    values = B.node_values(r, lps, [1, 2, 4, 4], "path", 0.5, 2.0)
    # each leaf's path sums steps 0-2 below the root, steps 1-2 below depth 1
    below_root = [[0.9, 1.4, 0.0, -1.0], [0.1, -0.4, 0.8, 1.6]]
    below_one = [[0.5, 1.0, 0.0, -1.0], [0.3, -0.2, 0.2, 1.0]]

    def fused(paths, rewards):
        w = torch.softmax(0.25 * torch.tensor(paths, dtype=torch.float64), 0)
        return float((w * torch.tensor(rewards, dtype=torch.float64)).sum())

    root = [fused(below_root[t], r[t].tolist()) for t in range(2)]
    one = [
        [fused(below_one[t][2 * n : 2 * n + 2], r[t, 2 * n : 2 * n + 2].tolist()) for n in range(2)] for t in range(2)
    ]
    assert values[0].flatten().tolist() == pytest.approx(root, rel=1e-6)
    assert values[1].flatten().tolist() == pytest.approx(one[0] + one[1], rel=1e-6)
    torch.testing.assert_close(values[2], r.double())
