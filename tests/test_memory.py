"""benchmarks/memory.py: the per-GPU memory plan, on a tiny FLUX (fake tensors, a few seconds each).

    .venv/bin/python -m pytest tests/test_memory.py -q                 # ~30 s on one thread
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_memory.py -q

The plan's figures that decide whether a recipe fits: what LoRA keeps in which dtype, what AdamW adds, what gradient
checkpointing saves and what FSDP shards; and that every GPU recipe of run.sh parses.
"""

import pytest

from benchmarks import memory

GB = memory.GB
# dancegrpo.py on FLUX.1-dev's kind at 64 px (the tiny VAE halves it: 32 x 32 latents, 256 tokens), micro-batch 2
FLAGS = [
    "--model-id", "black-forest-labs/FLUX.1-dev", "--resolution", "64", "--mixed-precision", "bf16",
    "--reward", "hpsv2.1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
    "--trajectories-per-update", "4", "--kl-beta", "0",
]  # fmt: skip
LORA = ["--lora", "--lora-rank", "4", "--lora-alpha", "8"]


def plan(flags, num_processes=1, fsdp=False, blocks=1):
    config = dict(memory.TINY_FLUX, denoiser={**memory.TINY_FLUX["denoiser"], "num_layers": blocks})
    config["denoiser"]["num_single_layers"] = blocks
    return memory.estimate("dancegrpo.py", FLAGS + flags, num_processes, fsdp, model_config=config)


def test_lora_keeps_the_base_in_bf16_and_trains_an_fp32_adapter_with_two_adamw_states():
    e = plan(LORA)
    n_base = e["params"]["denoiser"] - e["params"]["trainable"]
    n_adapter = e["params"]["trainable"]
    assert 0 < n_adapter < n_base / 10
    assert e["gb"]["frozen"] * GB == pytest.approx(2 * n_base)  # bf16 under --mixed-precision bf16
    assert (e["gb"]["trainable"] + e["gb"]["optimizer"]) * GB == pytest.approx(12 * n_adapter)  # fp32 + 2 fp32 states
    assert e["gb"]["grads"] == e["gb"]["trainable"]
    # the peak is the largest phase, and each phase holds at least the resident weights and AdamW state
    assert e["peak"] == max(e["phases"].values()) == e["phases"][e["peak_phase"]]
    resident = sum(e["gb"][k] for k in ("trainable", "frozen", "optimizer", "rollout_data"))
    assert min(e["phases"].values()) > resident


def test_gradient_checkpointing_lowers_the_training_activations():
    plain = plan(LORA, blocks=3)
    checkpointed = plan(LORA + ["--gradient-checkpointing"], blocks=3)
    assert checkpointed["gradient_checkpointing"] and not plain["gradient_checkpointing"]
    assert 0 < checkpointed["gb"]["activations"] < 0.7 * plain["gb"]["activations"]
    # what is resident does not change
    assert checkpointed["gb"]["frozen"] == plain["gb"]["frozen"]


def test_fsdp_shards_full_fine_tuning_weights_gradients_and_adamw_state_by_the_process_count():
    single = plan(["--no-lora"])
    sharded = plan(["--no-lora"], num_processes=8, fsdp=True)
    n = single["params"]["trainable"]
    assert n == single["params"]["denoiser"]  # every weight trains
    assert single["gb"]["trainable"] * GB == pytest.approx(4 * n)  # fp32 master weights
    assert single["gb"]["optimizer"] * GB == pytest.approx(8 * n)
    for part in ("trainable", "grads", "optimizer"):
        assert sharded["gb"][part] == pytest.approx(single["gb"][part] / 8)
    assert sharded["gb"]["frozen"] == 0 and sharded["gb"]["dist_buffers"] > 0  # gathered units instead
    # DDP keeps every weight and adds its gradient buckets
    ddp = plan(["--no-lora"], num_processes=8)
    assert ddp["gb"]["dist_buffers"] == pytest.approx(single["gb"]["grads"])


def test_offloading_the_frozen_parts_takes_them_out_of_the_training_phase():
    kept, offloaded = plan(LORA), plan(LORA + ["--offload-frozen"])
    frozen_parts = sum(kept["gb"][k] for k in ("text_encoders", "vae", "reward"))
    assert kept["phases"]["train"] - offloaded["phases"]["train"] == pytest.approx(frozen_parts)


def test_every_gpu_recipe_of_run_sh_parses_into_a_script_model_and_process_count():
    names = memory.gpu_recipes()
    assert any("flux" in n for n in names) and not any(n.endswith("-multinode") for n in names)
    for name in names:
        r = memory.recipe(name)
        args = memory.parse_args(r.script, r.flags)
        assert memory.model_kind(args.model_id) in memory.MODELS
        assert r.num_processes == (1 if name.endswith("1gpu") else 8)
        assert r.fsdp == ("fsdp" in name) and (not r.fsdp or r.fsdp_config)
