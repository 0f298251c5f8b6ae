"""benchmarks/claims/nft_vs_vgrpo.py: steps to a threshold, censoring, the median's interval and the ratios on hand-made
curves worked out by hand; each setting's flags (the papers' numbers) as the scripts parse them; the child process's
evaluation flags and the paper's old-policy pace; vgrpo.py --ema by hand at a non-neutral decay, and the default
run (no EMA) unchanged."""

import importlib.util
import json
import sys

import pytest
import torch
from accelerate import Accelerator

import diffusionnft as N
import vgrpo as V
from common.checkpoints import Carried
from common.flags import parse_flags
from common.runs import Run
from tests.helpers import ROOT
from tests.test_flags_applied import QUIET, run_flags, train_rows


def load():
    spec = importlib.util.spec_from_file_location("nft_vs_vgrpo", ROOT / "benchmarks" / "claims" / "nft_vs_vgrpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = load()


def curve(steps, rewards, s_per_iteration=0.0, forwards=0.0):
    """compare.curves' shape: evaluations (iteration, optimizer steps, learned reward), the median seconds of a
    training iteration and the transformer forwards per image."""
    evals = [{"iteration": i, "steps": s, "reward_mean": r} for i, (s, r) in enumerate(zip(steps, rewards))]
    return {"evals": evals, "s_per_iteration": s_per_iteration, "forwards": forwards}


# ---------------------------------------------------------------- statistics by hand
def test_steps_to_a_threshold_counts_an_exact_hit_and_censors_a_miss():
    c = curve([0, 2, 4, 6], [0.5, 0.5625, 0.625, 0.5625])  # binary fractions: the sums below are exact
    assert B.steps_to(c["evals"], 0.5 + 0.125) == (4, False)  # reached at exactly the threshold
    assert B.steps_to(c["evals"], 0.5 + 0.0625) == (2, False)  # the first evaluation that reaches it, not the last
    assert B.steps_to(c["evals"], 0.5 + 0.25) == (6, True)  # never: censored at the run's last steps (> 6)
    assert B.steps_to(c["evals"], 0.5) == (0, False)  # the start itself reaches a zero gain


def test_median_interval_and_ratio_with_censored_runs():
    s = B.summary([(4, False), (6, True), (2, False)])
    assert (s["median"], s["low"], s["high"], s["reached"], s["n"]) == ((4, False), (2, False), (6, True), 2, 3)
    assert s["coverage"] == 0.75  # P(min < median < max) = 1 - 2 x (1/2)^3
    assert B.cell(s) == "4 [2, >6] (2/3)"
    assert B.summary([(2, False)] * 5)["coverage"] == 1 - 2 / 32
    even = B.summary([(6, True), (2, False)])  # (2 + x) / 2 with x > 6: > 4
    assert even["median"] == (4, True) and B.cell(even) == ">4 [2, >6] (1/2)"
    none = B.summary([(6, True)] * 3)
    assert B.cell(none) == ">6 [>6, >6] (0/3)"
    reached = B.summary([(4, False)] * 3)
    assert B.step_ratio(B.summary([(8, False)] * 3), reached) == "2.00"
    assert B.step_ratio(B.summary([(12, True)] * 3), reached) == ">3.00"  # DiffusionNFT never got there: a bound
    assert B.step_ratio(reached, B.summary([(8, True)] * 3)) == "<0.50"
    assert B.step_ratio(none, none) == "n/a"


def results_by_hand():
    """Every run kind, seeds 0 and 1 (starting at 0.5 and 0.25); V-GRPO reaches +0.125 at steps 2 and 4, DiffusionNFT
    at 4 in seed 0 and never in seed 1 (6 steps); 2 optimizer steps per iteration, a median iteration of 2 and 4 s
    (seed 1: 2 and 8), so 1 and 2 s per step (seed 1: 1 and 4)."""
    v = [curve([0, 2, 4, 6], [0.5, 0.625, 0.75, 0.75], 2.0, 18), curve([0, 2, 4, 6], [0.25, 0.25, 0.375, 0.5], 2.0, 18)]
    n = [curve([0, 2, 4, 6], [0.5, 0.5, 0.625, 0.75], 4.0, 22), curve([0, 2, 4, 6], [0.25, 0.25, 0.25, 0.25], 8.0, 22)]
    return {k: (v if m == "vgrpo" else n) for k, (m, _, _) in B.configs().items()}


def test_thresholds_are_each_seeds_start_plus_the_gain_and_a_miss_is_counted():
    rows = B.threshold_rows(results_by_hand(), [0, 1], [0.125, 0.25])
    assert len(rows) == 2 * 2 * 2  # settings x weights x gains
    r = rows[0]
    assert (r["setting"], r["weights"], r["gain"]) == ("default", "live", 0.125)
    assert r["target"] == 0.375 + 0.125  # the mean threshold over the seeds (0.625 and 0.375)
    # V-GRPO: seed 0 reaches 0.625 at step 2, seed 1 0.375 at step 4; median of 2 = their mean
    assert B.cell(r["vgrpo"]) == "3 [2, 4] (2/2)"
    # DiffusionNFT: seed 0 at step 4, seed 1 never (> 6): median (4 + x) / 2 > 5
    assert B.cell(r["diffusionnft"]) == ">5 [4, >6] (1/2)" and r["ratio"] == ">1.67"
    r = rows[1]  # +0.25: V-GRPO seed 0 at 4 (0.75), seed 1 at 6 (0.5); DiffusionNFT seed 0 at 6, seed 1 never
    assert B.cell(r["vgrpo"]) == "5 [4, 6] (2/2)" and B.cell(r["diffusionnft"]) == ">6 [6, >6] (1/2)"


def test_wall_time_per_step_ratio_of_the_means_with_the_seeds_range():
    (r, *_) = B.time_rows(results_by_hand())
    assert (r["vgrpo"], r["diffusionnft"]) == (1.0, 3.0)  # 2 s / 2 steps per seed; (4 / 2 + 8 / 2) / 2
    assert r["ratio"] == 3.0 and (r["low"], r["high"]) == (2.0, 4.0)
    assert r["forwards"] == {"vgrpo": 18, "diffusionnft": 22}


# ---------------------------------------------------------------- each setting's flags
def parsed(module, key):
    return parse_flags(module.Args, B.flags_of(*B.configs()[key], 30))


def test_the_defaults_are_the_scripts_own_and_the_weights_flags_differ_only_in_the_ema():
    assert B.flags_of("vgrpo", "default", "live", 30) == [] and B.flags_of("diffusionnft", "default", "ema", 30) == []
    assert parsed(V, "vgrpo_default_live") == parse_flags(V.Args, [])
    assert parsed(V, "vgrpo_default_ema").ema and not parsed(V, "vgrpo_default_live").ema
    assert parsed(N, "diffusionnft_default_ema").ema and not parsed(N, "diffusionnft_default_live").ema
    assert len(B.configs()) == 8


def test_the_papers_settings_as_the_scripts_read_them():
    v = parsed(V, "vgrpo_paper_live")  # arXiv 2604.23380, SD3.5-M stage 1
    assert v.samples_per_device // v.samples_per_update == 1  # one optimizer step per iteration
    assert (v.n_mc, v.adv_soft_clip, v.kl_beta, v.pair_times) == (4, 3.0, 0.0, "grid")
    n = parsed(N, "diffusionnft_paper_live")  # arXiv 2509.16117, the multi-reward config
    assert n.samples_per_device // n.samples_per_update == 1
    assert N.n_train_timesteps(n.num_steps, n.timestep_fraction) == 9  # 9 of 10 grid timesteps
    assert (n.beta, n.old_decay, n.kl_beta, n.ema) == (0.1, "linear", 1e-4, False)
    # the schedule at the paper's pace: 1700 paper steps over 30 here, so eta's cap 0.5 comes after 500 / 56.7 steps
    k = n.old_decay_speed
    assert k == pytest.approx(1700 / 30, rel=1e-6)
    assert N.old_decay(8, "linear", k) == pytest.approx(0.001 * 8 * 1700 / 30) and N.old_decay(9, "linear", k) == 0.5
    assert parsed(N, "diffusionnft_default_live").old_decay_speed == 1  # the script's own pace elsewhere


def test_the_child_evaluates_every_iteration_and_passes_the_papers_pace(monkeypatch):
    seen = {}
    monkeypatch.setattr(sys, "argv", sys.argv)  # the child sets it; given back after the test
    monkeypatch.setattr(N, "main", lambda args: seen.update(args=args))
    argv = B.child_argv("diffusionnft_paper_ema", 10, 2, 16)
    assert argv[:3] == ["benchmarks/claims/nft_vs_vgrpo.py", "--train", "diffusionnft.py"]
    # what run_one appends after the argv: its own evaluation schedule, which the child's overrides
    B.train([*argv[2:], "--seed", "1", "--eval-every", "5", "--eval-samples-per-prompt", "4"])
    a = seen["args"]
    assert (a.eval_every, a.eval_samples_per_prompt, a.eval_max_prompts, a.seed, a.iterations) == (1, 2, 16, 1, 10)
    assert a.beta == 0.1 and a.ema and a.old_decay_speed == 170  # 1700 paper steps over 10 here
    with pytest.raises(SystemExit):
        B.train(["vgrpo.py", "--eval-samples", "0", "--"])


# ---------------------------------------------------------------- vgrpo.py --ema
TINY = ["--iterations", "1", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
        "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "2", "--n-mc", "2",
        "--learning-rate", "1e-2", *QUIET]  # fmt: skip


def finals_and_registered(monkeypatch):
    """The trained tensors handed to final/ and the Carried tensors registered for checkpointing, recorded."""
    finals, registered = [], []
    save_final, register = Run.save_final, Accelerator.register_for_checkpointing

    def recorded_save_final(self, model, prepared, lora):
        finals.append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    def recorded_register(self, *objects):
        registered.extend(o for o in objects if isinstance(o, Carried))  # the run's counters apart
        return register(self, *objects)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    monkeypatch.setattr(Accelerator, "register_for_checkpointing", recorded_register)
    return finals, registered


def test_vgrpo_ema_by_hand_at_a_non_neutral_decay(monkeypatch, tmp_path):
    """2 optimizer steps with --ema-max-decay 0.2: the EMA's decay is min(2 / 11, 0.2) = 2/11 after the first step
    and min(3 / 12, 0.2) = 0.2 after the second, so final/ gets 0.2 (2/11 p0 + 9/11 p1) + 0.8 p2; the EMA is carried
    in the checkpoints."""
    finals, registered = finals_and_registered(monkeypatch)
    _, record = run_flags(V, monkeypatch, tmp_path, [*TINY, "--ema", "--ema-max-decay", "0.2"])
    steps = record["steps"]
    assert len(steps) == 2
    (final,) = finals
    for p0, p1, p2, f in zip(steps[0]["before"], steps[0]["after"], steps[1]["after"], final, strict=True):
        torch.testing.assert_close(f, 0.2 * (2 / 11 * p0 + 9 / 11 * p1) + 0.8 * p2, rtol=0, atol=1e-6)
    assert any(not torch.equal(f, p) for f, p in zip(final, steps[1]["after"]))  # not the live weights
    (row,) = train_rows(record)
    assert row["charts/ema_decay"] == pytest.approx(0.2)
    (carried,) = registered
    assert len(carried.tensors["ema"]) == len(final)


def test_vgrpo_default_saves_the_live_weights_and_carries_nothing_more(monkeypatch, tmp_path):
    """Without --ema (the default) final/ gets the last step's weights, nothing more is registered for the checkpoints
    and nothing more is logged: the default run as before the flag."""
    finals, registered = finals_and_registered(monkeypatch)
    _, record = run_flags(V, monkeypatch, tmp_path, TINY)
    (final,) = finals
    assert all(torch.equal(f, p) for f, p in zip(final, record["steps"][-1]["after"], strict=True))
    assert registered == [] and "charts/ema_decay" not in train_rows(record)[0]
    assert not V.Args().ema


def test_the_report_lists_every_run_and_the_censored_cells():
    results = results_by_hand()
    shown = {k: B.describe(k, 30) for k in results}
    text = B.report(results, [0, 1], [0.125], shown, "python benchmarks/claims/nft_vs_vgrpo.py", 1, 1)
    assert "| `diffusionnft_paper_live` | `diffusionnft.py --samples-per-update 64" in text
    assert "--old-decay-speed 56.6667" in text and text.count("--old-decay-speed") == 2
    assert (
        "| ShapesBench defaults | live weights | +0.125 (0.500) | 3 [2, 4] (2/2) | >5 [4, >6] (1/2) | >1.67 |" in text
    )
    assert "a 50% distribution-free confidence interval for the median with 2 seeds" in text


def test_the_results_section_is_spliced_in_place_of_the_old_one_and_compare_writes_the_same(tmp_path):
    record = {
        "command": "python benchmarks/claims/nft_vs_vgrpo.py",
        "commit": "abc1234",
        "seeds": [0, 1],
        "gains": [0.125],
    }
    record["curves"] = results_by_hand()
    section = B.results_section(record)
    assert section[0] == "## V-GRPO against DiffusionNFT" and "seeds 0, 1; made by" in section[2]
    assert (
        "| ShapesBench defaults | live weights | +0.125 (0.500) | 3 [2, 4] (2/2) | >5 [4, >6] (1/2) | >1.67 |"
        in section
    )
    # every row's ratio is >1.67 (DiffusionNFT's median censored): no plain ratio, so no range line before the times
    assert section[-4].startswith("Wall time per optimizer step")
    # 1 and 3 s per step: ratio 3, the seeds' own ratios 2 and 4; the same at every setting and weights here
    assert "3.00 [2.00, 4.00] (papers' settings, EMA weights)" in section[-4]
    both_reach = {**record, "curves": {k: results_by_hand()["vgrpo_default_live"] for k in B.configs()}}
    assert B.results_section(both_reach)[-4].startswith(  # the same curves: ratio 1 in every row
        "The step ratio DiffusionNFT / V-GRPO (medians) ranges from 1.00 to 1.00 over the 4 rows (0 of them a bound"
    )
    assert section[-4].endswith("18 and 22 (ShapesBench defaults), 18 and 22 (papers' settings).")
    old = ["# Results", "table", "## V-GRPO against DiffusionNFT", "58 vs 60 steps", "", "## Next", "kept"]
    text = B.splice("\n".join(old), section)
    assert "58 vs 60 steps" not in text and text.count("## V-GRPO against DiffusionNFT") == 1
    assert text.startswith("# Results\ntable\n## V-GRPO") and text.endswith("\n## Next\nkept")
    assert B.splice("# Results", section) == "\n".join(["# Results", "", *section])  # no section yet: appended
    assert B.splice(B.splice("# Results", section), section) == B.splice("# Results", section)  # idempotent
    # benchmarks/claims/compare.py, rewriting docs/results.md, writes the same section from the record on disk
    from benchmarks.claims import compare

    assert compare.nft_vs_vgrpo_section(tmp_path) == []  # before the benchmark has run: no section
    (tmp_path / "nft_vs_vgrpo.json").write_text(json.dumps(record))
    assert compare.nft_vs_vgrpo_section(tmp_path) == ["", *section]
