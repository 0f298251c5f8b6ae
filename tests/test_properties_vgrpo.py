"""vgrpo.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/mutation.py generated that the other tests let pass."""

import pytest

import vgrpo as V
from common import InputError

# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [
    (dict(num_steps=0, n_mc=1), "--num-steps must be >= 1"),
    (dict(n_mc=0), "--n-mc must be >= 1"),
    (dict(num_steps=4, n_mc=5), "--n-mc 5 must be <= --num-steps 4"),
    (dict(group_size=1), "--group-size must be >= 2"),
    (dict(rollout_batch_size=24), "--samples-per-device must be a multiple of --rollout-batch-size"),
    (dict(samples_per_update=12), "--samples-per-update must be a multiple of --train-batch-size"),
    (dict(samples_per_update=48), "--samples-per-update must be a multiple of --train-batch-size"),
    (dict(kl_beta=-0.1), "--kl-beta >= 0, --clip-range > 0"),
    (dict(clip_range=0.0), "--kl-beta >= 0, --clip-range > 0"),
    (dict(adv_clip_max=0.0), "--kl-beta >= 0, --clip-range > 0"),
    (dict(adv_soft_clip=-0.1), "--kl-beta >= 0, --clip-range > 0"),
]
ACCEPTED = [
    dict(num_steps=1, n_mc=1),
    dict(num_steps=4, n_mc=4),
    dict(num_steps=4, n_mc=5, stratified=False),
    dict(num_steps=4, n_mc=5, pair_times="uniform"),
    dict(kl_beta=0.0, adv_soft_clip=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        V.resolve_and_check(V.Args(**flags))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    args = V.Args(**flags)
    V.resolve_and_check(args)
    assert args.exp_name == "vgrpo"
    named = V.Args(exp_name="mine", **flags)
    V.resolve_and_check(named)
    assert named.exp_name == "mine"
