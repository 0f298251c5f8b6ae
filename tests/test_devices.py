"""GPU-only bugs, found on the CPU: a tensor made without `device=` lands on the default device, which in training is
the CPU while the data are on the GPU, and the first operation that mixes the two fails there, never in a CPU test.
Here every script's algorithm functions (tree, pruning, packing, advantages, losses, steps, the RLR estimator's
pieces) run on CPU inputs with the default device set to 'meta': a tensor made without `device=` lands on 'meta',
mixing it with a CPU tensor raises, and every output must be on the CPU, where its inputs are."""

import math

import pytest
import torch

import branchgrpo as B
import dancegrpo as D
import rlr as R
import vgrpo as V

L = (2, 4, 4)  # a latent


def on_cpu(out):
    """Every tensor in a (nested) output is on the CPU."""
    if isinstance(out, torch.Tensor):
        assert out.device.type == "cpu", out.device
    elif isinstance(out, (list, tuple, set)):
        for o in out:
            on_cpu(o)
    elif isinstance(out, dict):
        for o in out.values():
            on_cpu(o)
    return out


def call(fn, *args, **kw):
    """fn(*args) with 'meta' as the default device; the output must be on the CPU."""
    with torch.device("meta"):
        return on_cpu(fn(*args, **kw))


def test_default_device_meta_catches_a_factory_call_without_device():
    with pytest.raises(RuntimeError, match="device"):
        call(lambda x: x & torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool))
    with pytest.raises(AssertionError):
        call(lambda: torch.zeros(2))


def test_dancegrpo_step_advantages_and_loss():
    x, v, noise = torch.randn(3, *L), torch.randn(3, *L), torch.randn(3, *L)
    sigmas = D.sigma_schedule(6, 3.0)  # made on the CPU, as main does
    g = call(D.noise_g, sigmas, "flow", 0.7)
    x_next, log_prob, mean, std = call(D.sde_step, x, v, sigmas[1], sigmas[2], g[1], noise=noise)
    call(D.sde_step, x, v, torch.full((3,), 0.5), torch.full((3,), 0.4), g[1], prev_sample=x_next)
    adv = call(D.group_advantages, torch.randn(6), 3)
    call(D.combined_advantages, {"r": torch.randn(6)}, {"r": 1.0}, group_size=3, adv_clip_max=5.0)
    for objective in ("clip", "guard", "dppo"):
        call(D.policy_loss, log_prob, log_prob.detach() + 0.01, adv[:3], mean, mean.detach() + 0.2, mean + 0.1, std,
             sigmas[1] - sigmas[2], objective=objective, clip_range=1e-4, kl_mask_threshold=1e-5, kl_beta=0.1)  # fmt: skip
    call(D.cps_step, x, v, sigmas[1], sigmas[2], 0.8, noise=noise)


@pytest.mark.parametrize(
    "pruning, kw",
    [("none", {}), ("depth", {}), ("width", {"width_mode": "parent-top1"}), ("width", {"width_mode": "extreme"}),
     ("mix", {})],
)  # fmt: skip
def test_branchgrpo_tree_pruning_packing_and_edges(pruning, kw):
    tree = B.Tree(8, (0, 3), 2, pruning=pruning, window=2, **kw)  # depth: 2 of the 3 steps after the last split
    sizes = tree.sizes  # nodes per depth of one tree
    n_trees, leaves = 2, sizes[-1]
    sigmas = B.sigma_schedule(8, 3.0)
    g = call(B.noise_g, sigmas, "flow", 0.7)
    log_probs = [torch.randn(n_trees * n) for n in sizes[1:]]
    values = call(B.node_values, torch.randn(n_trees, leaves), log_probs, sizes, "path", 1.0, 1.0)
    adv = call(B.depth_advantages, values)[1:]  # per step i, its children's (depth i + 1), as main takes them
    flags = dict(fusion="path", fusion_gamma=1.0, fusion_temperature=1.0, adv_clip_max=5.0)
    call(B.tree_advantages, {"r": torch.randn(n_trees, leaves)}, {"r": 1.0}, log_probs, sizes, **flags)
    sde_idx = call(B.sde_steps, tree, 0)
    keep = call(B.trained_edges, tree, sde_idx, adv, 0)
    batches = call(B.pack_micro_batches, keep, tree, 4, "cpu")
    grp = {
        "states": [torch.randn(n_trees * n, *L) for n in sizes],
        "keep": keep,
        "adv": adv,
        "log_probs": log_probs,
        "cond": {"prompt_embeds": torch.randn(n_trees, 5, 8)},
    }
    for segments in batches:
        x, sigma, cond, masks, x_child, old_log_prob, a = call(B.micro_batch, grp, segments, sigmas, tree)
        mean, std = call(B.edge_gaussians, x, torch.randn_like(x), segments, masks, sigmas, g, tree)
        log_prob = call(B.gaussian_log_prob, x_child, mean, std)
        call(B.policy_loss, log_prob, old_log_prob, a, mean, mean - 0.1, std, clip_range=1e-4, kl_beta=0.1)
    call(B.step_mean_std, torch.randn(3, *L), torch.randn(3, *L), sigmas[1], sigmas[2], g[1])
    call(B.branch_noise, torch.Generator().manual_seed(0), 2, 2, L, 0.5)  # keyed noise: drawn on the CPU
    for i in range(8):
        call(B.tree_noise, tree, 0, 0, [0, 1], L, i, sizes[i])


def test_vgrpo_solver_pairs_advantages_and_loss():
    x, d = torch.randn(3, *L), torch.randn(3, *L)
    call(V.dpm_solver_2m_step, x, d, d.clone(), 0.8, 0.6, 0.4)
    sigmas = V.sigma_schedule(6, 3.0)
    for grid, shared in ((sigmas[1:-1], True), (None, False)):
        t, eps = call(V.draw_pairs, grid, 4, L, (0, 1), range(3), shared=shared)
    values, _ = call(V.pair_values, torch.randn(12, *L), torch.randn(12, *L), torch.randn(12, *L), eps.flatten(0, 1),
                     t.flatten())  # fmt: skip
    parts = {"a": torch.randn(6), "b": torch.randn(6)}
    adv = call(V.combined_advantages, parts, {"a": 1.0, "b": 0.5}, group_size=3, adv_clip_max=5.0, adv_soft_clip=3.0)
    x0, x0_ref = torch.randn(3, 4, *L), torch.randn(3, 4, *L)
    call(V.policy_loss, values.view(3, 4), values.view(3, 4).detach() - 0.01, adv[:3], x0, x0_ref, clip_range=6e-3,
         kl_beta=0.5)  # fmt: skip


def test_rlr_steps_window_baselines_and_zo_pieces():
    x, eps = torch.randn(4, *L), torch.randn(4, *L)
    mean, std = call(R.ddim_step, x, eps, 0.5, 0.7, 1.0)
    call(R.sde_step, x, eps, 0.8, 0.6, 0.3, noise=torch.randn_like(x))
    theta = torch.zeros(1, requires_grad=True)

    def mean_std(i, x):  # a linear-Gaussian chain step with one parameter
        return 0.9 * x + theta, 0.1 * (i + 1)

    T, j, h = 6, 2, 2
    latents = call(R.rollout, mean_std, x, torch.randn(4, T - 1, *L), R.zo_steps_of(T, j, h), lambda i: R.perturbed(
        [theta], [torch.full((1,), 1e-3)]))  # fmt: skip
    log_prob, deviation = call(R.subchain_log_prob, mean_std, latents, torch.randn(4, T - 1, *L), j, h)
    rewards, block = torch.randn(8), torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    call(R.loo_baseline, rewards, 4)
    call(R.zo_baseline, rewards, 4, block)
    mask = torch.zeros(8, T, dtype=torch.bool)
    mask[:, :2] = True
    _, _, coef, _ = call(R.term_weights, rewards, block, mask, 2, group_size=4)
    params = [torch.zeros(3, requires_grad=True)]
    zeta = call(R.zo_noise, params, 7, 1e-3)
    with torch.device("meta"), R.perturbed(params, zeta):
        pass
    call(R.add_zo_grad, params, zeta, coef[0, 0], 1e-3)
    assert math.isfinite(float(params[0].grad.sum()))
