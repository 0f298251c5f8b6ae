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
