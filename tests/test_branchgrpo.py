"""branchgrpo.py: tree bookkeeping, branch noise, fusion, depth-wise advantages, pruning, and the script end to end."""

import itertools
import math
import signal
import sys
from contextlib import nullcontext

import pytest
import torch
import tyro

import branchgrpo as B
from common import InputError
from common.models import load_model
from tests.helpers import (
    assert_final_loads,
    assert_same_trained_weights,
    assert_survives_kills,
    find_run,
    logged,
    metrics,
    run_until,
)
from tests.helpers import run_script as run
from tests.tiny import build_flux, build_shapes, build_tiny_hps

TINY_RUN = [
    "--iterations",
    "2",
    "--trees-per-device",
    "2",
    "--trees-per-update",
    "1",
    "--num-steps",
    "6",
    "--num-splits",
    "2",
    "--rollout-batch-size",
    "4",
    "--eval-every",
    "2",
    "--eval-samples-per-prompt",
    "1",
    "--eval-steps",
    "4",
    "--sample-every",
    "2",
]


def run_script(args, tmp_path, *rest, **kw):
    return run("branchgrpo.py", args, tmp_path, *rest, **kw)


def args_for(**kw):
    args = B.Args(**kw)
    B.resolve_and_check(args)
    return args


# ---------------------------------------------------------------- tree bookkeeping
def test_dense_tree_counts_match_the_paper():
    forwards, edges = B.Tree(20, (0, 3, 6, 9), 2).counts()
    assert (forwards, edges) == (203, 218)
    assert (round(forwards / 16, 2), edges / 16) == (12.69, 13.625)
    assert B.Tree(20, (0, 3, 6, 9), 2).sizes[:11] == [1, 2, 2, 2, 4, 4, 4, 8, 8, 8, 16]


@pytest.mark.parametrize(
    "steps,splits,k",
    [
        (20, [0, 5, 10, 15], 2),
        (12, [0, 3, 6, 9], 2),
        (10, [2, 5], 3),
        (20, [10, 12, 14, 16], 2),
        (8, [0], 4),
        (6, [4], 2),
    ],
)
def test_tree_counts_closed_form(steps, splits, k):
    """edges = sum_j K^j (s_{j+1} - s_j) with s_0 = 0, s_{m+1} = T (K^j edges at each step after the j-th split),
    and every split adds K - 1 edges per parent without a forward: forwards = edges - (K^m - 1)."""
    bounds = [0, *splits, steps]
    edges = sum(k**j * (bounds[j + 1] - bounds[j]) for j in range(len(splits) + 1))
    assert B.Tree(steps, tuple(splits), k).counts() == (edges - (k ** len(splits) - 1), edges)


def test_named_split_schedules():
    assert B.split_steps("dense", 20, 4) == [0, 3, 6, 9]
    assert B.split_steps("sparse", 20, 4) == [0, 5, 10, 15]
    assert B.split_steps("late", 20, 4) == [10, 12, 14, 16]
    assert B.split_steps("9,0,3,6", 20, 4) == [0, 3, 6, 9]
    with pytest.raises(InputError, match="--split-schedule"):
        args_for(split_schedule="0,3,19", num_steps=20)  # 19 is the deterministic last step
    with pytest.raises(InputError, match="--split-schedule"):
        args_for(split_schedule="a,b")


# ---------------------------------------------------------------- branch noise
def test_branch_noise_keeps_unit_variance_and_has_the_configured_correlation():
    s = 4.0
    rho = 1 / (1 + s)
    z = B.branch_noise(torch.Generator().manual_seed(0), 20000, 2, (8,), rho).view(20000, 2, 8)
    assert abs(z.var().item() - 1) < 0.01
    corr = torch.corrcoef(torch.stack([z[:, 0].flatten(), z[:, 1].flatten()]))[0, 1].item()
    assert abs(corr - rho) < 0.01
    z4 = B.branch_noise(torch.Generator().manual_seed(1), 5000, 4, (8,), 0.5).view(5000, 4, 8)
    c = torch.corrcoef(torch.stack([z4[:, 1].flatten(), z4[:, 3].flatten()]))[0, 1].item()
    assert abs(c - 0.5) < 0.02


@pytest.fixture(scope="module")
def tiny_shapes(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes")
    build_shapes(path)
    return load_model(str(path))


def grow(model, splits, k, steps=4, batch_size=64, noise="correlated", trees=2):
    prompts = ["a red circle on a blue background", "a green square on a white background"][:trees]
    cond = model.encode_prompts(prompts)
    sigmas = B.sigma_schedule(steps, 3.0)
    g = B.noise_g(sigmas, "flow", 0.7)
    shape = model.latent_shape()

    tree = B.Tree(steps, tuple(splits), k, branch_noise=noise, branch_s=4.0)

    def noise_fn(i, n_parents):
        kk, gens = tree.children(i), [B.rng(0, "t", t, i) for t in range(trees)]
        if kk > 1 and noise == "correlated":
            return torch.cat([B.branch_noise(gg, n_parents, kk, shape, 0.2) for gg in gens])
        return torch.cat([torch.randn((n_parents * kk, *shape), generator=gg) for gg in gens])

    roots = torch.randn((trees, *shape), generator=torch.Generator().manual_seed(0))
    states, lps = B.tree_rollout(
        model, model.transformer, cond, roots, noise_fn, tree, sigmas, g, list(range(steps - 1)), batch_size, 1.0,
        nullcontext,
    )  # fmt: skip
    return states, lps, sigmas, g, cond


def test_sde_step_mean_std_and_log_prob_are_the_closed_form():
    """step_mean_std and gaussian_log_prob against the closed form of docs/math.md, written here independently:
    mean = x + d (v + g^2/2 (x + (1 - sigma) v) / sigma), std = g sqrt(-d), log-density averaged over dimensions."""
    gen = torch.Generator().manual_seed(0)
    x, v, x_next = (torch.randn(3, 2, 4, 4, generator=gen) for _ in range(3))
    for sigma, sigma_next, g in [(0.8, 0.6, 0.7), (0.3, 0.1, 0.3)]:
        d = sigma_next - sigma
        mean, std = B.step_mean_std(x, v, torch.tensor(sigma), torch.tensor(sigma_next), torch.tensor(g))
        torch.testing.assert_close(mean, x + d * (v + g**2 / 2 * (x + (1 - sigma) * v) / sigma))
        assert std == pytest.approx(g * math.sqrt(-d))
        normal = torch.distributions.Normal(mean, g * math.sqrt(-d))
        torch.testing.assert_close(B.gaussian_log_prob(x_next, mean, std), normal.log_prob(x_next).flatten(1).mean(1))


@pytest.mark.parametrize("noise,scale", [("correlated", 1.0), ("scaled", 4.0)])
def test_child_edge_log_prob_is_the_sde_transition(tiny_shapes, noise, scale):
    states, lps, sigmas, g, cond = grow(tiny_shapes, [0, 1], 2, noise=noise)
    assert [len(s) for s in states] == [2, 4, 8, 8, 8]
    x = states[1]  # parents of the split at step 1, tree-major
    with torch.no_grad():
        v = tiny_shapes.velocity(
            tiny_shapes.transformer, x, sigmas[1].expand(4), {k: v.repeat_interleave(2, 0) for k, v in cond.items()}
        )
    mean, std = B.step_mean_std(x, v, sigmas[1], sigmas[2], g[1])
    normal = torch.distributions.Normal(mean.repeat_interleave(2, 0), std * scale)  # scored under the std actually used
    torch.testing.assert_close(lps[1], normal.log_prob(states[2]).flatten(1).mean(1), rtol=1e-5, atol=1e-5)
    assert torch.all(lps[-1] == 0)  # the last step is a deterministic Euler step


def test_batched_rollout_equals_node_at_a_time(tiny_shapes):
    a, lpa, *_ = grow(tiny_shapes, [0, 1], 2, batch_size=64)
    b, lpb, *_ = grow(tiny_shapes, [0, 1], 2, batch_size=1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    for x, y in zip(lpa, lpb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- fusion and advantages
def test_path_fusion_with_beta_zero_is_uniform_and_weights_high_probability_leaves():
    sizes = B.Tree(3, (0, 1), 2).sizes  # [1, 2, 4, 4]
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    lps = [torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.zeros(4)]
    uni = B.node_values(r, lps, sizes, "uniform", 1.0, 1.0)
    zero = B.node_values(r, lps, sizes, "path", 0.0, 1.0)
    for u, z in zip(uni, zero):
        torch.testing.assert_close(u, z)
    path = B.node_values(r, lps, sizes, "path", 1.0, 1.0)
    w = torch.softmax(torch.tensor([0.0, 1.0]), 0)  # leaf 2 (index 1) has path log-prob 1 below node 0 of depth 1
    torch.testing.assert_close(path[1], torch.tensor([[w[0] * 1 + w[1] * 2, 4.0]], dtype=torch.float64))
    # gamma 0.5 and temperature 2 (a softmax of 0.25 lp), every step's edges carrying log-probs: below the root the
    # leaves' paths sum steps 0-2 (0.4 + 0 + 0.5, 0.4 + 1, 0, -1), below depth 1 steps 1-2 (0.5, 1 | 0, -1)
    lps = [torch.tensor([0.4, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0.5, 0.0, 0.0, -1.0])]
    path = B.node_values(r, lps, sizes, "path", 0.5, 2.0)
    w0 = torch.softmax(0.25 * torch.tensor([0.9, 1.4, 0.0, -1.0], dtype=torch.float64), 0)
    w1 = [torch.softmax(0.25 * torch.tensor(x, dtype=torch.float64), 0) for x in ([0.5, 1.0], [0.0, -1.0])]
    torch.testing.assert_close(path[0], (w0 * torch.tensor([1.0, 2.0, 3.0, 5.0])).sum().view(1, 1).double())
    expected = [(w1[0] * torch.tensor([1.0, 2.0])).sum(), (w1[1] * torch.tensor([3.0, 5.0])).sum()]
    torch.testing.assert_close(path[1], torch.stack(expected).view(1, 2).double())
    torch.testing.assert_close(path[2], r.double())  # one leaf below each node of depth 2


def test_depth_advantages_by_hand():
    sizes = B.Tree(3, (0, 1), 2).sizes  # depths: 1 root, 2 nodes, 4 nodes, 4 leaves
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    adv = B.depth_advantages(B.node_values(r, [torch.zeros(4), torch.zeros(8), torch.zeros(8)], sizes, "uniform", 1, 1))
    assert torch.all(adv[0] == 0)  # one node: no baseline, no signal
    d1 = torch.tensor([1.5, 4.0])
    torch.testing.assert_close(adv[1][0], ((d1 - d1.mean()) / (d1.std() + 1e-8)).float())
    leaves = torch.tensor([1.0, 2.0, 3.0, 5.0])
    torch.testing.assert_close(adv[2][0], ((leaves - leaves.mean()) / (leaves.std() + 1e-8)).float())
    assert torch.all(adv[2][1] == 0) and torch.all(adv[1][1] == 0)  # a tree of equal rewards carries no signal


# ---------------------------------------------------------------- pruning
def masks(pruning, iteration=0, window=None, **kw):
    """The trained-edge masks of a 20-step dense tree (splits 0,3,6,9, K = 2) under random advantages, from plain
    values; the windows are the script's defaults unless given (depth: the 9 steps after the last split; Mix: 4)."""
    window = window or {"depth": 9}.get(pruning, 4)
    tree = B.Tree(20, (0, 3, 6, 9), 2, pruning=pruning, window=window, **kw)
    torch.manual_seed(0)
    adv = [torch.randn(1, n) for n in tree.sizes[1:]]
    return B.trained_edges(tree, B.sde_steps(tree, iteration), adv, iteration), adv


def count(keep, steps=None):
    return sum(int(k.sum()) for i, k in enumerate(keep) if steps is None or i in steps)


def test_no_pruning_trains_every_edge_but_the_last_step():
    keep, _ = masks("none")
    assert count(keep) == 218 - 16 and not keep[19].any()


def test_depth_pruning_skips_a_sliding_four_step_window():
    assert args_for(pruning="depth").window == 9 and args_for(pruning="mix").window == 4  # ShapesBench's; 4 = paper
    assert args_for(pruning="depth", num_steps=12).window == 1  # splits 0,3,6,9: only step 10 follows the last split
    for it in (0, 30, 10_000):  # the ShapesBench default: all post-split steps out, 58 edges up to the last split
        keep, _ = masks("depth", it)
        assert [i for i in range(19) if not keep[i].any()] == list(range(10, 19)) and count(keep) == 58, it
    for it, window in [
        (0, [10, 11, 12, 13]),
        (29, [10, 11, 12, 13]),
        (30, [11, 12, 13, 14]),
        (150, [15, 16, 17, 18]),
        (10_000, [15, 16, 17, 18]),
    ]:
        keep, _ = masks("depth", it, window=4)
        assert [i for i in range(19) if not keep[i].any()] == window, it
        assert count(keep) == 218 - 16 - 4 * 16


def depth_cases():
    """(steps, schedule, window, every) over step counts, split schedules and windows, where a step follows the
    last split (resolve_and_check refuses the others: tested below)."""
    for steps, schedule, (window, every) in itertools.product(
        [6, 8, 10, 12, 14, 16, 20, 24, 30], ["dense", "sparse", "late", "0,1", "2"], [(1, 1), (2, 5), (4, 30), (6, 7)]
    ):
        splits = B.split_steps(schedule, steps, 2 if schedule in ("dense", "sparse", "late") else 1)
        if all(0 <= s <= steps - 2 for s in splits) and max(splits) < steps - 2:
            yield steps, schedule, window, every


@pytest.mark.parametrize("steps,schedule,window,every", list(depth_cases()))
def test_depth_window_property(steps, schedule, window, every):
    """Over step counts, split schedules and window sizes: the depth window never holds a split step or a step before
    the last split, never moves backwards, moves one step every `every` iterations until it ends at step T - 2."""
    n_splits = 2 if schedule in ("dense", "sparse", "late") else 1
    splits = B.split_steps(schedule, steps, n_splits)
    last_split, last_trainable = max(splits), steps - 2
    size = min(window, last_trainable - last_split)
    tree = B.Tree(steps, tuple(splits), pruning="depth", window=window, window_shift_every=every)
    prev = None
    for it in range(0, every * (steps + 2)):
        w = tree.window_steps(it)
        assert len(w) == size and w == list(range(w[0], w[0] + size))
        assert w[0] > last_split and w[-1] <= last_trainable and not set(w) & set(splits)
        if prev is not None:
            assert w[0] - prev[0] == (1 if it % every == 0 and prev[-1] < last_trainable else 0), (it, prev, w)
        prev = w
    assert prev[-1] == last_trainable  # it ends at the last trainable step


def test_depth_and_width_need_a_step_after_the_last_split():
    for mode in ("depth", "width"):
        with pytest.raises(InputError, match=f"--pruning {mode}: the last split is step 10"):
            args_for(pruning=mode, num_steps=12, split_schedule="0,10")


def test_width_parent_top1_keeps_the_best_child_chain_of_each_parent():
    keep, adv = masks("width")
    a = adv[9][0]  # advantages of the 16 children of the last split (step 9)
    best = a.view(8, 2).argmax(1) + torch.arange(0, 16, 2)
    for i in range(10, 19):
        assert torch.equal(torch.nonzero(keep[i][0]).flatten(), best)
    assert keep[9].all()  # the split edges themselves are always trained
    assert count(keep) == 218 - 16 - 9 * 8


def test_width_extreme_keeps_the_highest_and_lowest_chains():
    keep, adv = masks("width", width_mode="extreme")
    order = adv[9][0].argsort()
    expected = torch.sort(torch.cat([order[:4], order[-4:]])).values
    for i in range(10, 19):
        assert torch.equal(torch.nonzero(keep[i][0]).flatten(), expected)
    assert count(keep) == 218 - 16 - 9 * 8


def test_mix_trains_only_the_sliding_window_and_the_splits():
    keep, _ = masks("mix", 0)
    assert [i for i in range(20) if keep[i].any()] == [0, 1, 2, 3, 6, 9]
    keep, _ = masks("mix", 60)  # two shifts: window 2..5
    assert [i for i in range(20) if keep[i].any()] == [0, 2, 3, 4, 5, 6, 9]
    assert count(keep) == 2 + 2 + 4 + 4 + 4 + 8 + 16


def test_mode_specific_flags_fail_at_start_up():
    with pytest.raises(InputError, match="--width-mode only applies"):
        args_for(width_mode="extreme")
    with pytest.raises(InputError, match="--fusion-gamma only applies"):
        args_for(fusion_gamma=0.5)
    with pytest.raises(InputError, match="--window only applies"):
        args_for(pruning="width", window=3)
    with pytest.raises(InputError, match="--trees-per-update"):
        args_for(trees_per_device=3, trees_per_update=2)


# ---------------------------------------------------------------- the script
def test_ctrl_c_writes_a_checkpoint_and_the_resumed_run_ends_with_the_same_weights(tmp_path):
    """Ctrl-C (SIGINT) lets the iteration finish, writes a checkpoint and exits with 128 + 2; `--resume-from latest`
    then ends with the weights of an uninterrupted run."""
    common = TINY_RUN + ["--sample-every", "0", "--eval-every", "0", "--save-every", "5", "--iterations", "3"]
    run_script(common + ["--exp-name", "straight"], tmp_path)
    faulty, name = common + ["--exp-name", "faulty"], tmp_path / "faulty"
    status, out = run_until("branchgrpo.py", faulty, tmp_path, lambda p: logged(name, 1), signal.SIGINT)
    assert status == 128 + signal.SIGINT and "SIGINT: stopped after iteration" in out, out[-2000:]
    stopped = int(out.split("SIGINT: stopped after iteration ")[1].split(",")[0])
    assert stopped < 3 and (find_run(name) / "checkpoints" / f"iter_{stopped:06d}").is_dir()  # not due: --save-every 5
    run_script(faulty + ["--resume-from", "latest"], tmp_path)
    assert_same_trained_weights(tmp_path / "straight", name)


def test_end_to_end_shapesbench(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "e2e", "--save-every", "1"], tmp_path)
    run = find_run(tmp_path / "e2e")
    train = [r for r in metrics(run) if "losses/policy" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    # ratio 1 at the first update, to the float32 rounding of a forward whose batch differs from the rollout's
    # (training packs rows across steps): exactly 0 on some CPUs, 1 ulp (1.2e-7) on AVX-512 ones
    assert all(r["losses/first_ratio_max_dev"] < 1e-6 for r in train)
    forwards, edges = B.Tree(6, (0, 3), 2).counts()
    assert all(r["tree/rollout_forwards_per_leaf"] == forwards / 4 for r in train)
    assert all(r["tree/trained_edges_per_leaf"] == (edges - 4) / 4 for r in train)
    assert_final_loads(run)  # the default trains a LoRA adapter, which diffusers' loader reads
    assert (run / "samples" / "samples_000002.png").is_file()


@pytest.mark.parametrize(
    "extra",
    [
        ["--pruning", "depth", "--window", "2"],
        ["--pruning", "width"],
        ["--pruning", "width", "--width-mode", "extreme"],
        ["--pruning", "mix", "--window", "1"],
        ["--branch-noise", "scaled", "--fusion", "path"],
    ],
)
def test_pruning_modes_end_to_end(tmp_path, extra):
    run_script(
        TINY_RUN + ["--exp-name", "p", "--eval-every", "0", "--sample-every", "0", "--iterations", "1"] + extra,
        tmp_path,
    )
    train = [r for r in metrics(tmp_path / "p") if "losses/policy" in r]
    every_edge = (B.Tree(6, (0, 3), 2).counts()[1] - 4) / 4  # all but the deterministic last step's
    if "--branch-noise" in extra:  # no pruning: every edge
        assert train[0]["tree/trained_edges_per_leaf"] == every_edge
    else:
        assert train[0]["tree/trained_edges_per_leaf"] < every_edge
    assert (
        train[0]["losses/first_ratio_max_dev"] < 1e-5
    )  # pruned micro-batches differ from rollout chunks only in batch size


def test_killed_runs_resume_to_the_same_weights(tmp_path):
    common = TINY_RUN + ["--eval-every", "0", "--sample-every", "0"]
    assert_survives_kills("branchgrpo.py", common, tmp_path)


def test_two_processes_keep_identical_weights(tmp_path):
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    # full fine-tuning (the FSDP recipe's mode) with the frozen-copy KL; the default is LoRA
    run_script(
        TINY_RUN + ["--exp-name", "ddp", "--eval-every", "0", "--no-lora"],
        tmp_path,
        launcher,
        {"ACCELERATE_USE_CPU": "1"},
    )
    last = [r for r in metrics(tmp_path / "ddp") if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0


def test_end_to_end_tiny_flux_with_tiny_hps(tmp_path, monkeypatch):
    """In-process (open_clip's tiny-hps config is registered in this process only), the real main()."""

    ckpt = build_tiny_hps(tmp_path)
    from tests.tiny import use_tiny_hps

    use_tiny_hps(monkeypatch)
    build_flux(tmp_path / "flux")
    (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
    argv = TINY_RUN + [
        "--output-dir",
        str(tmp_path),
        "--exp-name",
        "flux",
        "--model-id",
        str(tmp_path / "flux"),
        "--resolution",
        "32",
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--eval-prompts",
        str(tmp_path / "prompts.txt"),
        "--reward",
        "hpsv2.1",
        "--reward-ckpt",
        f"hpsv2.1={ckpt}",
        "--lora",
        "--lora-rank",
        "4",
        "--guidance-scale",
        "3.5",
        "--pruning",
        "depth",
        "--window",
        "2",
        *("--gradient-checkpointing", "--offload-frozen"),  # as the GPU recipes (bf16: gpu_check.sh --tiny)
    ]
    B.main(tyro.cli(B.Args, args=argv))
    train = [r for r in metrics(tmp_path / "flux") if "losses/policy" in r]
    assert len(train) == 2 and all(math.isfinite(r["losses/policy"]) for r in train)
    assert_final_loads(find_run(tmp_path / "flux"), str(tmp_path / "flux"))
