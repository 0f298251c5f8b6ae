"""Several rewards, --advantage-aggregation: 'sum' normalises the weighted sum of the rewards once, 'per-reward'
normalises each reward's scores within its group (BranchGRPO: its tree, per depth) and sums those advantages with the
weights. Both against numbers computed here by hand, then main() of DanceGRPO and BranchGRPO seen passing each reward's
scores and weights under per-reward and the weighted sum under the default."""

import math

import torch

import branchgrpo as B
import dancegrpo as D
import vgrpo as V
from tests.test_direction import BRANCH, DANCE, run_main

A = torch.tensor([1.0, 2.0, 3.0, 6.0])  # one group of 4: mean 3, unbiased variance 14 / 3
C = torch.tensor([0.0, 0.0, 1.0, 3.0])  # mean 1, unbiased variance 2
PER_REWARD = (A - 3) / math.sqrt(14 / 3) + 0.5 * (C - 1) / math.sqrt(2)  # weights 1 and 0.5
WEIGHTED = A + 0.5 * C  # [1, 2, 3.5, 7.5]: mean 3.5, unbiased variance 49 / 6
SUM = (WEIGHTED - 3.5) / math.sqrt(49 / 6)
# the advantage functions' flags (keyword-only, passed from Args by name): clips too wide to act here
DANCE_FLAGS = {"group_size": 4, "adv_clip_max": 5.0}
VGRPO_FLAGS = DANCE_FLAGS | {"adv_soft_clip": 0.0}
BRANCH_FLAGS = {"fusion": "uniform", "fusion_gamma": 1.0, "fusion_temperature": 1.0, "adv_clip_max": 5.0}


def test_group_aggregations_by_hand():
    scores, weights = {"a": A, "c": C}, {"a": 1.0, "c": 0.5}
    torch.testing.assert_close(D.combined_advantages(scores, weights, **DANCE_FLAGS), PER_REWARD)
    torch.testing.assert_close(D.combined_advantages({"sum": WEIGHTED}, {"sum": 1.0}, **DANCE_FLAGS), SUM)
    torch.testing.assert_close(
        D.combined_advantages(scores | {"z": C}, weights | {"z": 0.0}, **DANCE_FLAGS), PER_REWARD
    )
    torch.testing.assert_close(V.combined_advantages(scores, weights, **VGRPO_FLAGS), PER_REWARD)
    torch.testing.assert_close(V.combined_advantages({"sum": WEIGHTED}, {"sum": 1.0}, **VGRPO_FLAGS), SUM)
    assert not torch.allclose(PER_REWARD, SUM, atol=0.05)  # the two choices differ on these numbers
    # a negative weight penalises its reward: a - 0.5 c, by hand; with two groups, each normalised on its own
    against = (A - 3) / math.sqrt(14 / 3) - 0.5 * (C - 1) / math.sqrt(2)
    two = D.combined_advantages({"a": torch.cat([A, C]), "c": torch.cat([C, A])}, {"a": 1.0, "c": -0.5}, **DANCE_FLAGS)
    torch.testing.assert_close(two[:4], against)
    torch.testing.assert_close(two[4:], (C - 1) / math.sqrt(2) - 0.5 * (A - 3) / math.sqrt(14 / 3))
    torch.testing.assert_close(V.combined_advantages({"a": A, "c": C}, {"a": 1.0, "c": -0.5}, **VGRPO_FLAGS), against)


def test_tree_aggregations_by_hand():
    """One tree, two splits of 2 (depths of 1, 2, 4 nodes), uniform fusion: depth 1 is the mean of each half of the
    leaves, z-scored over its 2 nodes (+-1/sqrt(2)); depth 2 the leaves themselves."""
    sizes, log_probs = [1, 2, 4], [torch.zeros(2), torch.zeros(4)]

    def by_hand(r):  # (4,) leaf scores -> advantages at depths 1 and 2
        halves = torch.stack([r[:2].mean(), r[2:].mean()])
        depth1 = (halves - halves.mean()) / halves.std()
        return depth1, (r - r.mean()) / r.std()

    (a1, a2), (c1, c2) = by_hand(A), by_hand(C)
    leaf = {"a": A.view(1, 4).double(), "c": C.view(1, 4).double()}
    adv = B.tree_advantages(leaf, {"a": 1.0, "c": 0.5}, log_probs, sizes, **BRANCH_FLAGS)
    assert [tuple(a.shape) for a in adv] == [(1, 2), (1, 4)]  # per step: the children of the root, then the leaves
    torch.testing.assert_close(adv[0][0], a1 + 0.5 * c1)
    torch.testing.assert_close(adv[1][0], a2 + 0.5 * c2)
    w1, w2 = by_hand(WEIGHTED)
    adv = B.tree_advantages({"sum": WEIGHTED.view(1, 4).double()}, {"sum": 1.0}, log_probs, sizes, **BRANCH_FLAGS)
    torch.testing.assert_close(adv[0][0], w1)
    torch.testing.assert_close(adv[1][0], w2)


def test_main_passes_each_reward_under_per_reward_and_the_weighted_sum_by_default(monkeypatch, tmp_path):
    rewards = ["--reward", "shapes:1,verifier:0.5"]
    for module, flags, name in ((D, DANCE, "combined_advantages"), (B, BRANCH, "tree_advantages")):
        for aggregation in ("sum", "per-reward"):
            argv = [*flags, *rewards, "--advantage-aggregation", aggregation]
            tape, _ = run_main(module, monkeypatch, tmp_path / module.__name__ / aggregation, argv, [name])
            (scores, weights, *_), _, _ = tape.calls[name][0]
            if aggregation == "sum":
                assert weights == {"sum": 1.0}
            else:
                assert weights == {"shapes": 1.0, "verifier": 0.5} and set(weights) <= set(scores)
            monkeypatch.undo()
