"""The memory plan of one script and its flags: what each script does per phase (batch sizes from its flags, the
rollout data it keeps) and estimate(), the peak per GPU over the phases. Part of benchmarks/gpu/memory.py, whose
docstring describes the plan.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu.memory_configs import CLIP_VIT_L14, GB, MASK2FORMER_SWIN_S, QWEN2_VL_7B
from benchmarks.gpu.memory_fake import (
    autocast,
    build_reward,
    build_text_encoder,
    checkpoint_under_policy,
    fake_world,
    measure,
    nbytes,
)
from benchmarks.gpu.memory_models import (
    MODELS,
    PLANS,
    VIDEO_KINDS,
    Shapes,
    build_denoiser,
    build_vae,
    denoise,
    hps_score,
    model_kind,
    score_samples,
    trained_module,
    vae_decode,
)


# ---------------------------------------------------------------------------------------------------
# What each script does per phase (batch sizes from its flags; rollout data it keeps)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """Batch sizes of the phases (rows = denoiser batch, CFG included) and the rollout data kept on the GPU."""

    prompts: int  # distinct prompts encoded at once (encode_prompts encodes each once)
    rollout_rows: int  # no-grad denoiser batch (rollout, V-GRPO's behaviour pass)
    decode: int  # images per VAE decode
    reward: int  # images per reward call
    train_rows: int  # denoiser batch of a training forward (GRPO) or of one RLR step
    kl_forward: bool  # a no-grad reference forward inside the micro-step (its graph alive)
    kl_copy: bool  # a frozen bf16 copy of the denoiser as KL reference (full fine-tuning)
    data: int  # bytes of rollout data resident through the iteration
    rlr: dict | None = None  # RLR: first-order rows, sub-chain length h, zero-order term
    copies: int = 0  # fp32 copies of the trained weights kept beside them (DiffusionNFT, DGPO: the old policy and the
    # EMA; DanceGRPO, BranchGRPO, V-GRPO: the EMA with --ema)


def _bytes(shape, count=1, element=4) -> int:
    n = count * element
    for s in shape:
        n *= s
    return n


def distinct_prompts(S: int, G: int) -> int:
    """The most groups a process's S samples meet, groups of G in global order (process r owns samples [r S, (r + 1)
    S), which start gcd(S, G)-aligned within a group, at most G - gcd(S, G) into it): the prompts encode_prompts
    encodes, each distinct prompt once."""
    return min(S, (G - math.gcd(S, G) + S - 1) // G + 1)


def workload(script: str, args, shapes: Shapes, cfg: bool, frozen_bytes: int) -> Workload:
    """From the script's parsed Args: its batches and the tensors it keeps (fp32 latents and images or videos,
    conditioning in the text encoders' dtype), read off its main loop."""
    mult = 2 if cfg else 1
    L, img = shapes.latent, shapes.sample  # an image, or a video (F, 3, H, W)
    # per prompt (CFG's uncond: one more), in the text encoders' dtype but where the kind keeps another (a video's
    # fp32 first-frame condition, masks)
    cond = sum(_bytes(s, element=shapes.cond_bytes.get(k, frozen_bytes)) for k, s in shapes.cond.items())
    if script == "dancegrpo":
        S, R, T = args.samples_per_device, args.rollout_batch_size, args.num_steps
        # chunks: latents (S, T + 1, *L), each step's mean (S, T, *L) and log-probs (S, T); images (S, 3, H, W); the
        # prompts' conditioning
        data = _bytes(L, S * (T + 1)) + _bytes(L, S * T) + _bytes((S, T)) + _bytes(img, S) + cond * (S + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, R * mult, R, S, R * mult, args.kl_beta > 0, full_ft_kl, data, copies=int(args.ema))
    if script == "branchgrpo":
        import branchgrpo

        splits = branchgrpo.split_steps(args.split_schedule, args.num_steps, args.num_splits)
        sizes = branchgrpo.Tree(args.num_steps, tuple(splits), args.branch_factor).sizes  # nodes per depth
        P, Pu, M, R = args.trees_per_device, args.trees_per_update, sizes[-1], args.rollout_batch_size
        # every tree's node states (fp32) and edge log-probs; every leaf's image; the trees' conditioning
        data = _bytes(L, P * sum(sizes)) + _bytes((P * sum(sizes[1:]),)) + _bytes(img, P * M) + cond * (P + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        return Workload(Pu, R * mult, Pu * M, P * M, R * mult, args.kl_beta > 0, full_ft_kl, data, copies=int(args.ema))
    if script == "vgrpo":
        S, R, B, N = args.samples_per_device, args.rollout_batch_size, args.train_batch_size, args.n_mc
        kl = args.kl_beta > 0
        # final latents (S, *L), images, conditioning, behaviour values; with KL the reference's x0 (S, N, *L)
        data = _bytes(L, S) + _bytes(img, S) + cond * (S + 1) + _bytes((S, N)) + (_bytes(L, S * N) if kl else 0)
        full_ft_kl = kl and args.kl_ref == "base" and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, max(R, B * N) * mult, R, S, B * N * mult, False, full_ft_kl, data, copies=int(args.ema))
    if script == "rlr":
        S, B, T = args.samples_per_device, args.rollout_batch_size, args.num_steps
        h = args.subchain_len
        if h is None:
            import rlr

            h = (
                rlr.optimal_subchain_len(
                    args.memory_budget_gb, T, args.ho_step_gb, args.zo_step_gb, args.variance_ratio
                )
                if args.memory_budget_gb is not None
                else min(2, T - 1)
            )
        h = h if "ho" in args.terms else 0
        # chunks: latents (S, T, *L) and their step noise (S, T - 1, *L) on the device; conditioning
        data = _bytes(L, S * T) + _bytes(L, S * (T - 1)) + cond * (S + 1)
        zo = "zo" in args.terms
        P = distinct_prompts(S, args.group_size)
        return Workload(P, B * mult, B, B, B * mult, False, False, data, rlr={"rows": B, "h": h, "zo": zo})
    if script == "diffusionnft":
        S, R, B = args.samples_per_device, args.rollout_batch_size, args.train_batch_size
        # final latents (S, *L) and decoded images, each chunk's sent to the reward as it is decoded; conditioning.
        # The old policy's and the base's no-grad forwards run before the trained one's, so no graph is alive then.
        # copies=2: the old policy and the EMA; evaluation swaps the EMA in one tensor at a time (no third copy).
        data = _bytes(L, S) + _bytes(img, S) + cond * (S + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, R * mult, R, R, B * mult, False, full_ft_kl, data, copies=2)
    if script == "dgpo":
        S, R, B = args.samples_per_device, args.rollout_batch_size, args.train_batch_size
        # as diffusionnft.py: final latents, decoded images, conditioning; the old policy and the EMA (copies=2); the
        # base model's and the old policy's no-grad forwards run before the trained one's (no graph alive then), and
        # d_ref always needs the base: a frozen copy in full fine-tuning. Training forwards: --train-guidance-scale.
        data = _bytes(L, S) + _bytes(img, S) + cond * (S + 1)
        rows = B * (2 if cfg and args.train_guidance_scale > 1 else 1)
        P = distinct_prompts(S, args.group_size)
        return Workload(P, R * mult, R, R, rows, False, not args.lora, data, copies=2)
    raise ValueError(f"unknown script {script}")


def grpo_train(shapes: Shapes, module, work: Workload, mp: str, optimizer, tracker=None) -> int:
    """Peak of one GRPO micro-step above its resident state: the micro-batch's forward with a graph (and the KL
    reference's no-grad forward while that graph is alive), backward, and the AdamW step (None under FSDP)."""

    def step():
        x = torch.zeros(work.train_rows, *shapes.latent)
        with autocast(mp):
            v = denoise(shapes, module, x)
        loss = v.square().mean()
        if work.kl_forward:  # LoRA: the adapter switched off; full fine-tuning: a frozen copy (same activations)
            with torch.no_grad(), autocast(mp):
                v_ref = denoise(shapes, module, x)
            loss = loss + (v - v_ref).square().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    return measure(step, module, *([optimizer] if optimizer is not None else []), tracker=tracker)


def rlr_train(shapes: Shapes, module, vae, reward, work: Workload, cfg: bool, mp: str, optimizer) -> int:
    """Peak of rlr.py's train phase above its resident state, the larger of its two backward passes: the first-order
    term (the last step with a graph, the VAE decode and HPS, backward) and the half-order term (h steps with a graph
    from a constant x_j, backward; then the AdamW step)."""
    import rlr

    rows, h = work.rlr["rows"], work.rlr["h"]

    def transition(x):  # rlr.transition: CFG as common.models._cfg, then the DDIM step (SD1.x) or the flow SDE step
        with autocast(mp):
            out = denoise(shapes, module, torch.cat([x, x]) if cfg else x)
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + 5.0 * (cond - uncond)
        if shapes.kind == "sd1":
            return rlr.ddim_step(x, out, 0.5, 0.6, 1.0)
        return rlr.sde_step(x, out, 0.5, 0.4, 0.7, prev_sample=x)[2:]

    def first_order():
        mean, _ = transition(torch.zeros(rows, *shapes.latent))
        (-hps_score(reward, vae_decode(vae, shapes, mean)).sum()).backward()

    def half_order():
        x, target = torch.zeros(rows, *shapes.latent), torch.zeros(rows, *shapes.latent)  # x_j and x_{j+h}
        for k in range(h):
            mean, std = transition(x)
            if k < h - 1:
                x = mean + std * torch.zeros_like(mean)  # the window's inner noises are fixed
        (((target - mean) ** 2) / (2 * std**2)).flatten(1).sum(1).sum().backward()
        if optimizer is not None:
            optimizer.step()

    if reward is None:
        raise ValueError("rlr.py's first-order term needs a differentiable reward model (HPSv2.1 here)")
    resident = [module, vae, reward, *([optimizer] if optimizer is not None else [])]
    return max(measure(first_order, *resident), measure(half_order, *resident) if h else 0)


# ---------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------
_CACHE: dict = {}


def _cached(key, fn):
    """Phases with the same key (same module, batch, flags) measure the same: 1- and 8-GPU recipes share them."""
    key = json.dumps(key, sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = fn()
    return _CACHE[key]


def _units(module, names) -> tuple[int, int]:
    """(largest unit, root) parameter counts of FSDP units wrapping the module classes `names`."""
    units = [m for m in module.modules() if type(m).__name__ in names]
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_units)
    return max((sum(p.numel() for p in u.parameters()) for u in units), default=0), root


def parse_args(script: str, flags: list[str]):
    """The script's own Args (tyro), as `accelerate launch script.py FLAGS` would parse them."""
    import tyro

    module = importlib.import_module(script)
    return tyro.cli(module.Args, args=list(flags))


def reward_model(spec: str, parts: dict) -> dict:
    """The reward networks' configs for --reward: name -> config, HPSv2.1's, HPSv3's, GenEval's and image_similarity's
    ({}: the reward has no GPU network, e.g. jpeg, or ocr, whose PP-OCR models run on the CPU)."""
    from common.rewards import parse_rewards

    names = set(parse_rewards(spec).weights)  # every component runs, weight 0 too (for logging)
    unknown = names & {"pickscore", "clip"}
    if unknown:
        raise ValueError(f"--reward {spec}: {', '.join(sorted(unknown))} is not modelled here (HPSv2.1 and HPSv3 are)")
    geneval = (MASK2FORMER_SWIN_S, CLIP_VIT_L14)  # one judge for geneval and geneval_accuracy (common.rewards)
    known = (
        ("hpsv2.1", parts["reward"]), ("hpsv3", QWEN2_VL_7B), ("geneval", geneval), ("geneval_accuracy", geneval),
        ("image_similarity", CLIP_VIT_L14),  # its own CLIP ViT-L/14 (common.rewards.image_similarity)
    )  # fmt: skip
    out = {n: c for n, c in known if n in names}
    if "geneval" in out and "geneval_accuracy" in out:
        del out["geneval_accuracy"]
    return out


def estimate(
    script: str,
    flags: list[str],
    num_processes: int = 1,
    fsdp: bool = False,
    model_config: dict | None = None,
    *,
    fsdp_config: dict | None = None,
) -> dict:
    """Per-GPU memory plan of `script` ("dancegrpo" or "dancegrpo.py", ...) run with `flags` on `num_processes` GPUs:
    data parallel, or FSDP (FULL_SHARD) with `fsdp`, `fsdp_config` being the accelerate config's fsdp_config (units to
    wrap, activation checkpointing). `model_config` overrides parts of the --model-id kind's published configuration
    (keys of MODELS[kind]: `denoiser` and `vae` are merged into the published dicts, `text`, `reward`,
    `resolution` and `frames` replace them), e.g. TINY_FLUX or TINY_WAN. A video model (Wan2.1) decodes, keeps and
    scores videos of --num-frames frames.

    Returns {"peak": GB, "peak_phase", "phases": {phase: GB}, "gb": {component: GB}, "goal": GB, "fits", "params":
    {"denoiser", "trainable"}, and the setting (model, resolution, frames, lora, checkpointing, offload, batches,
    ...)}."""
    script = Path(script).stem
    args = parse_args(script, flags)
    kind = model_kind(args.model_id)
    parts = dict(MODELS[kind])
    for name, value in (model_config or {}).items():
        parts[name] = {**parts[name], **value} if name in ("denoiser", "vae") else value
    if script == "rlr" and kind in VIDEO_KINDS:
        raise ValueError(f"rlr.py trains image models only; --model-id {args.model_id} is a video model")
    resolution = args.resolution or parts["resolution"]  # a side, or (height, width) (Wan2.1's native 480 x 832)
    frames = (args.num_frames or parts["frames"]) if kind in VIDEO_KINDS else None
    shapes = Shapes.of(kind, parts, resolution, frames)
    height, width = shapes.image[1:]
    mp = args.mixed_precision
    frozen_dtype, esize = (torch.bfloat16, 2) if mp == "bf16" else (torch.float32, 4)  # load_model's dtype
    fsdp_config = fsdp_config or {}
    checkpointing = args.gradient_checkpointing or (fsdp and bool(fsdp_config.get("fsdp_activation_checkpointing")))
    offload, ddp = args.offload_frozen, num_processes > 1 and not fsdp
    # FLUX.1-dev's guidance is embedded; HunyuanVideo-1.5's guider, as its pipeline's, guides at every scale but 1
    cfg = PLANS[kind].cfg and (args.guidance_scale != 1 if kind == "hunyuan15" else args.guidance_scale > 1)
    work = workload(script, args, shapes, cfg, esize)
    if fsdp and work.copies:
        raise ValueError(
            f"{script}.py refuses FSDP here: it keeps copies of the trained weights (an old policy, an EMA)"
        )
    if fsdp and work.kl_copy:
        raise ValueError("the scripts refuse a frozen KL reference copy under FSDP (--kl-beta 0, or --lora)")
    evaluates = args.eval_every > 0 or args.sample_every > 0
    n_eval = args.eval_max_prompts * args.eval_samples_per_prompt if args.eval_every > 0 else 0  # at most
    # Evaluator.grid: 8 prompts x 2 seeds, sampled and decoded in chunks of the Evaluator's batch (the rollout batch)
    n_grid_all = 16 if args.sample_every > 0 else 0
    n_grid = min(n_grid_all, args.rollout_batch_size)
    reward_cfg = reward_model(args.reward, parts)
    if script == "rlr" and "hpsv3" in reward_cfg:
        raise ValueError(
            "rlr.py's first-order term backpropagates through the reward: through HPSv3 it is not modelled"
        )
    key = dict(kind=kind, den=parts["denoiser"], latent=shapes.latent, cond=shapes.cond, mp=mp, lora=args.lora)
    key |= dict(rank=args.lora_rank, alpha=args.lora_alpha, ckpt=checkpointing, fsdp=fsdp)

    with fake_world():
        # ---------------------------------------------------------------- the denoiser, as trained
        if fsdp:  # modelled: the unsharded module in the FSDP compute dtype; the fp32 shards are counted below
            module = build_denoiser(kind, parts["denoiser"], frozen_dtype).train()
            if checkpointing:
                module.enable_gradient_checkpointing(checkpoint_under_policy)
        else:
            module = trained_module(kind, parts["denoiser"], args, frozen_dtype, checkpointing)
        n_all = sum(p.numel() for p in module.parameters())
        trainable = [p for p in module.parameters() if p.requires_grad]
        n_train = sum(p.numel() for p in trainable)
        if fsdp:
            unit, root = _units(module, fsdp_config.get("fsdp_transformer_layer_cls_to_wrap") or parts["fsdp_units"])
            w_train = g_train = 4 * n_train / num_processes  # fp32 shards of the flat parameters and gradients
            opt, frozen = 8 * n_train / num_processes, 0
            working = esize * (root + 2 * unit)  # the gathered root unit and two block units
            working_train = working + esize * unit  # + one unit's unsharded gradients before the reduce-scatter
        else:
            w_train = sum(nbytes(p) for p in trainable)
            frozen = sum(nbytes(p) for p in module.parameters() if not p.requires_grad)
            g_train, opt = w_train, 2 * w_train  # gradients like the weights (fp32); AdamW exp_avg, exp_avg_sq
            working = working_train = 0
        experts = parts.get("experts", 1)  # Wan2.2-A14B: both experts' weights and state, one expert's activations
        w_train, g_train, opt, frozen = (experts * v for v in (w_train, g_train, opt, frozen))
        n_all, n_train = experts * n_all, experts * n_train
        frozen += n_all * esize if work.kl_copy else 0  # frozen_copy(): the KL reference of full fine-tuning
        buckets = g_train if ddp else 0  # DDP's gradient buckets, allocated at prepare()

        # ---------------------------------------------------------------- no-grad forwards: rollout, grid
        def forward(rows):
            with torch.no_grad(), autocast(mp):
                denoise(shapes, module, torch.zeros(rows, *shapes.latent))

        act_rollout = _cached(
            [key, "forward", work.rollout_rows], lambda: measure(lambda: forward(work.rollout_rows), module)
        )
        grid_rows = n_grid * (2 if cfg else 1)
        act_grid = (
            _cached([key, "forward", grid_rows], lambda: measure(lambda: forward(grid_rows), module)) if n_grid else 0
        )

        # ---------------------------------------------------------------- the training micro-step
        optimizer = None
        if fsdp:  # each gradient is reduce-scattered (and freed) once accumulated; AdamW steps on the shards below
            for p in trainable:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        else:  # a micro-step after the first: the gradients accumulated so far and the AdamW state exist
            for p in trainable:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
            optimizer.step()
        vae = build_vae(kind, parts["vae"], frozen_dtype)
        nets = {name: build_reward(name, c) for name, c in reward_cfg.items()}
        reward = nets.get("hpsv2.1")  # rlr.py's differentiable reward
        if work.rlr is not None:  # the first-order term backpropagates through the VAE and the reward model
            act_train = _cached(
                [key, "rlr", work.rlr, cfg, parts["vae"], reward_cfg],
                lambda: rlr_train(shapes, module, vae, reward, work, cfg, mp, optimizer),
            )
        else:
            act_train = _cached(
                [key, "train", work.train_rows, work.kl_forward],
                lambda: grpo_train(shapes, module, work, mp, optimizer),
            )
        act_step = 0
        if fsdp:  # AdamW (foreach) on this process's fp32 shard, after the backward passes
            shard = torch.zeros(max(1, n_train // num_processes), requires_grad=True)
            shard.grad = torch.zeros_like(shard)
            shard_optimizer = torch.optim.AdamW([shard], lr=1e-4, foreach=True)
            shard_optimizer.step()
            act_step = measure(shard_optimizer.step, shard, shard_optimizer)

        # ---------------------------------------------------------------- frozen parts: encode, decode, score
        encoders = [
            (f, build_text_encoder(f, c, frozen_dtype, PLANS[kind].clip_projection), n) for f, c, n in parts["text"]
        ]
        text = sum(nbytes(m) for _, m, _ in encoders)
        plan = PLANS[kind]  # its prompts' encoding: the text encoders, and the images a prompt brings (the VAE)
        encode_key = [kind, parts["text"], mp, "encode", work.prompts]
        encode_key += [shapes.image, frames, shapes.images, parts["vae"]] if plan.encodes_images else []
        act_encode = _cached(
            encode_key,
            lambda: measure(
                lambda: plan.encode(shapes, encoders, vae, work.prompts), *[m for _, m, _ in encoders], vae
            ),
        )

        def decode(n):
            with torch.no_grad():
                vae_decode(vae, shapes, torch.zeros(n, *shapes.latent))

        def score(n):  # above the decoded samples, which the scripts keep (torch.cat of the decode batches)
            samples = torch.zeros(n, *shapes.sample)
            with torch.no_grad():
                run = lambda: score_samples(nets, args.reward, args.reward_frames, samples)  # noqa: E731
                return measure(run, *nets.values(), samples)

        vae_key = [kind, parts["vae"], shapes.vae_latent, shapes.sample, mp, "decode"]
        act_decode = _cached([*vae_key, work.decode], lambda: measure(lambda: decode(work.decode), vae))
        act_decode_grid = _cached([*vae_key, n_grid], lambda: measure(lambda: decode(n_grid), vae)) if n_grid else 0
        score_key = [reward_cfg, args.reward, args.reward_frames if frames else None, shapes.sample, "score"]
        act_reward = _cached([*score_key, work.reward], lambda: score(work.reward))
        act_reward_grid = _cached([*score_key, n_grid_all], lambda: score(n_grid_all)) if n_grid_all else 0
        act_reward_eval = _cached([*score_key, n_eval], lambda: score(n_eval)) if n_eval else 0
        vae_bytes, reward_bytes = nbytes(vae), nbytes(*nets.values())

    # ---------------------------------------------------------------- phases: resident state + the phase's own
    state = w_train * (1 + work.copies) + frozen + opt + buckets + work.data
    zo = 2 * w_train if work.rlr and work.rlr["zo"] else 0  # RLR's ZO: a saved copy of the weights + a perturbation
    scorers = vae_bytes + reward_bytes
    text_out = 0 if offload else text  # text encoders outside the encode phase
    # with --offload-frozen the scripts park the VAE and the reward before training and the Evaluator parks them after
    # its work; rlr.py's first-order term (in the train phase here) fetches them chunk by chunk
    scorers_sampling = scorers if not offload else 0
    scorers_train = scorers if not offload or work.rlr else 0
    # decoded samples (images or videos, fp32) are kept: the batches decoded so far, then their torch.cat, while the
    # previous iteration's (in work.data) are still referenced; then the reward scores them all at once
    sample = lambda n: _bytes(shapes.sample, max(n, 0))  # noqa: E731
    decoding = max(sample(work.reward - work.decode) + act_decode, 2 * sample(work.reward), act_reward)
    # a kind whose prompts bring images VAE-encodes them while encoding: with --offload-frozen the VAE visits then
    vae_encoding = vae_bytes if offload and PLANS[kind].encodes_images else 0
    phases = {
        "encode": state + text + scorers_sampling + vae_encoding + act_encode,
        "rollout": state + text_out + scorers_sampling + working + act_rollout + zo,
        "decode": state + text_out + scorers + decoding,
        "train": state + text_out + scorers_train + g_train + working_train + max(act_train, act_step) + zo,
    }
    if work.rlr is not None:  # decoding and scoring happen in the first-order term, inside the train phase
        del phases["decode"]
    if evaluates:  # Evaluator: the grid, then the held-out evaluation
        resident = 0 if offload else scorers  # --offload-frozen: training parked the VAE and the reward before
        # sample_prompts: a batch (the rollout batch) at a time, the earlier batches' samples kept, then torch.cat
        grid_kept, eval_kept = sample(n_grid_all - n_grid), sample(n_eval - args.rollout_batch_size)
        steps = [
            (text if offload else 0) + scorers + act_encode,  # prompts: the text encoders visit
            resident + grid_kept + act_grid,  # the grid's denoiser forwards
            (vae_bytes if offload else scorers) + grid_kept + act_decode_grid,  # and their VAE decodes
            scorers + sample(n_grid_all) + max(sample(n_grid_all), act_reward_grid),  # torch.cat, then the reward
        ]
        if n_eval:
            steps += [
                scorers + eval_kept + max(act_rollout, act_decode),  # the held-out evaluation's sampling
                scorers + sample(n_eval) + max(sample(n_eval), act_reward_eval),  # its torch.cat, then the reward
            ]
        phases["evaluate"] = state + text_out + working + max(steps)
    peak_phase = max(phases, key=phases.get)
    n_base = n_all - (n_train if args.lora else 0)  # the model's own weights (FLUX.1-dev: 11.9B, under 12B)
    goal = 80 if not args.lora or max(height, width) > 512 or n_base > 12e9 else 48  # Qwen-Image's 20B: one 80 GB GPU
    peak = phases[peak_phase] / GB
    return {
        "script": script,
        "model": kind,
        "resolution": height if height == width else f"{height}x{width}",
        "frames": frames,
        "images": shapes.images,  # per prompt: an edit's sources or references, a first frame
        "lora": args.lora,
        "lora_rank": args.lora_rank if args.lora else None,
        "num_processes": num_processes,
        "fsdp": fsdp,
        "gradient_checkpointing": bool(checkpointing),
        "offload_frozen": offload,
        "train_rows": work.train_rows,
        "rollout_rows": work.rollout_rows,
        "params": {"denoiser": n_all, "trainable": n_train},
        "gb": {
            "trainable": w_train * (1 + work.copies) / GB,  # DiffusionNFT: with its old policy and EMA copies
            "frozen": frozen / GB,
            "grads": g_train / GB,
            "optimizer": opt / GB,
            "activations": max(act_train, act_step) / GB,
            "text_encoders": text / GB,
            "vae": vae_bytes / GB,
            "vae_decode": act_decode / GB,
            "reward": reward_bytes / GB,
            "reward_activations": act_reward / GB,
            "encode_activations": act_encode / GB,
            "rollout_activations": act_rollout / GB,
            "grid_activations": max(act_grid, act_decode_grid) / GB,
            "rollout_data": work.data / GB,
            "dist_buffers": (buckets + working_train) / GB,
        },
        "phases": {name: v / GB for name, v in phases.items()},
        "peak": peak,
        "peak_phase": peak_phase,
        "goal": goal,
        "fits": peak <= goal,
    }
