#!/usr/bin/env bash
# Launch recipes: bash run.sh <recipe> [extra flags, passed to the script; later flags win]
#   set up first with: bash scripts/setup.sh   (this file installs nothing)
#
#   dancegrpo-cpu          DanceGRPO on ShapesBench, 1 CPU process 
#   dancegrpo-verifier-cpu DanceGRPO on ShapesBench rewarded by the programmatic verifier 
#   mixgrpo-cpu            MixGRPO (4-step sliding SDE window) on ShapesBench, KL 0.2 to the base (keeps diversity)
#   dancegrpo-cpu-2proc    the same, 2 CPU processes (gloo): groups span processes
#   dancegrpo-flux-1gpu    FLUX.1-dev + HPSv2.1, LoRA r128, 720 px, 1 GPU; 41 GB per GPU
#   dancegrpo-flux-8gpu    FLUX.1-dev + HPSv2.1, LoRA r128, 720 px, 8 GPUs (DDP); 42 GB per GPU
#   dancegrpo-flux-fsdp8   FLUX.1-dev + HPSv2.1, full fine-tuning, 720 px, 8 GPUs (FSDP); 34 GB per GPU
#   dancegrpo-sd35-8gpu    SD3.5-Medium + HPSv2.1 (Flow-GRPO's setting), LoRA r32, 512 px, 8 GPUs (DDP); 24 GB per GPU
#   dancegrpo-sd35-geneval-8gpu  Flow-GRPO's GenEval run: SD3.5-Medium, GenEval's partial score, its prompts; 22 GB per GPU
#   dancegrpo-sd35-ocr-8gpu      Flow-GRPO's OCR run: SD3.5-Medium, the PP-OCR reward, its prompts; 20 GB per GPU
#   grpoguard-sd35-8gpu    GRPO-Guard (dancegrpo.py --objective guard), SD3.5-Medium, the official setting, 8 GPUs; 24 GB per GPU
#   flowdppo-sd35-8gpu     Flow-DPPO (dancegrpo.py --objective dppo), SD3.5-Medium, the official setting, 8 GPUs; 24 GB per GPU
#   mixgrpo-flash-flux-8gpu  MixGRPO-Flash (--ode-solver dpm2), FLUX.1-dev, LoRA r128, 720 px, 8 GPUs; 42 GB per GPU
#   dancegrpo-flux-multinode  LoRA on NUM_MACHINES x 8 GPUs; needs MAIN_IP, MACHINE_RANK, NUM_MACHINES (MAIN_PORT=29500)
#   branchgrpo-cpu         BranchGRPO on ShapesBench, 1 CPU process ; add --pruning depth|width|mix (depth: with --iterations 30)
#   branchgrpo-verifier-cpu  BranchGRPO on ShapesBench rewarded by the programmatic verifier
#   branchgrpo-cpu-2proc   the same, 2 CPU processes (gloo)
#   branchgrpo-flux-1gpu   FLUX.1-dev + HPSv2.1, LoRA r128, depth pruning, 720 px, 1 GPU; 44 GB per GPU
#   branchgrpo-flux-8gpu   FLUX.1-dev + HPSv2.1, LoRA r128, depth pruning, 720 px, 8 GPUs (DDP); 45 GB per GPU
#   branchgrpo-flux-fsdp8  FLUX.1-dev + HPSv2.1, full fine-tuning (the paper's setting), depth pruning, 8 GPUs (FSDP); 39 GB per GPU
#   branchgrpo-flux-multinode  LoRA on NUM_MACHINES x 8 GPUs; needs MAIN_IP, MACHINE_RANK, NUM_MACHINES
#   vgrpo-cpu              V-GRPO on ShapesBench, 1 CPU process
#   vgrpo-verifier-cpu     V-GRPO on ShapesBench rewarded by the programmatic verifier
#   vgrpo-nokl-cpu         over-optimisation on purpose: all weights, no KL, no weight decay (one image per prompt)
#   vgrpo-naive-cpu        the naive ELBO surrogate (no stratification, no shared pairs, no self-normalisation)
#   vgrpo-cpu-2proc        the same as vgrpo-cpu, 2 CPU processes (gloo): groups span processes
#   vgrpo-flux-1gpu        FLUX.1-dev + HPSv2.1, LoRA r128, 720 px, 1 GPU; 40 GB per GPU
#   vgrpo-flux-8gpu        FLUX.1-dev + HPSv2.1, LoRA r128, 720 px, 8 GPUs (DDP); 41 GB per GPU
#   vgrpo-flux-fsdp8       FLUX.1-dev + HPSv2.1, full fine-tuning, 720 px, 8 GPUs (FSDP); 34 GB per GPU
#   vgrpo-sd35-8gpu        SD3.5-Medium + HPSv2.1 (the paper's stage 1), LoRA r32, 512 px, 8 GPUs (DDP); 24 GB per GPU
#   vgrpo-sd35-geneval-8gpu  the same setting on GenEval (Flow-GRPO's prompts, its partial score); 22 GB per GPU
#   vgrpo-sd35-ocr-8gpu      the same setting on OCR (Flow-GRPO's prompts, the PP-OCR reward); 20 GB per GPU
#   vgrpo-flux-multinode   LoRA on NUM_MACHINES x 8 GPUs; needs MAIN_IP, MACHINE_RANK, NUM_MACHINES
#   dancegrpo-wan-1gpu     Wan2.1-T2V-1.3B video + HPSv2.1 on 4 frames + temporal, LoRA r128, 480x832, 33 frames, 1 GPU; 35 GB per GPU
#   dancegrpo-wan-8gpu     the same on 8 GPUs (DDP); 35 GB per GPU
#   branchgrpo-wan-1gpu    Wan2.1-T2V-1.3B video, 16-leaf trees, depth pruning, LoRA r128, 480x832, 33 frames, 1 GPU; 58 GB per GPU
#   branchgrpo-wan-8gpu    the same on 8 GPUs (DDP); 59 GB per GPU
#   vgrpo-wan-8gpu         Wan2.1-T2V-1.3B video, V-GRPO, LoRA r128, 480x832, 33 frames, 8 GPUs (DDP); 33 GB per GPU
#   dancegrpo-qwen-8gpu    Qwen-Image + HPSv2.1, Flow-Factory's GRPO setting: LoRA r64, 512 px, CFG 4, offload, 8 GPUs (DDP); 67 GB per GPU
#   branchgrpo-qwen-8gpu   Qwen-Image, 16-leaf trees, depth pruning, LoRA r64, 512 px, CFG 4, offload, 8 GPUs (DDP); 66 GB per GPU
#   vgrpo-qwen-8gpu        Qwen-Image, V-GRPO, LoRA r64, 512 px, CFG 4, offload, 8 GPUs (DDP); 66 GB per GPU
#   diffusionnft-qwen-8gpu Qwen-Image, Flow-Factory's NFT setting: LoRA r64, 512 px, 30 steps, offload, 8 GPUs (DDP); 67 GB per GPU
#   dancegrpo-flux2-8gpu   FLUX.2 [klein] base 4B, Flow-Factory's GRPO setting: LoRA r64, 384 px, CFG 4, 8 GPUs (DDP); 24 GB per GPU
#   dancegrpo-wan22-8gpu   Wan2.2-TI2V-5B video, verl-omni's DanceGRPO size: LoRA r128, 704x1280, 9 frames, 8 GPUs (DDP); 55 GB per GPU
#   dancegrpo-ltx2-8gpu    LTX-2.3 video (no audio), Flow-Factory / VeRL-Omni's CPS setting: 3-step SDE window in the first 10 of 24 steps, LoRA r32, 320 px, 81 frames, 8 GPUs (DDP); 80 GB per GPU
#   dancegrpo-hunyuan15-8gpu  HunyuanVideo-1.5 480p video, UniRL's DanceGRPO setting: Flow-SDE eta 0.25 on 8 of 16 steps, shift 5, no CFG, LoRA r32, 480 px, 5 frames, 8 GPUs (DDP); 42 GB per GPU
#   dancegrpo-kontext-8gpu FLUX.1-Kontext-dev edits (EDITS), Flow-GRPO's Kontext setting: 6 steps, a = 0.9, guidance 2.5, 21 per group, LoRA r64, 512 px, offload, 8 GPUs (DDP); 42 GB per GPU
#   dancegrpo-qwen-edit-8gpu  Qwen-Image-Edit-2509 edits (EDITS), DanceGRPO's Qwen-Image-Edit setting: 20 steps, eta 0.3, no CFG, 8 per group, LoRA r64, 512 px, offload, 8 GPUs (DDP); 67 GB per GPU
#   dancegrpo-wan-i2v-8gpu Wan2.1-I2V-14B-480P image-to-video (EDITS: first frames), DanceGRPO's I2V setting: 16 steps, eta 0.3, CFG 5, 8 per group, LoRA r64, 480x832, 33 frames, offload, 8 GPUs (DDP); 63 GB per GPU
#   diffusionnft-cpu       DiffusionNFT on ShapesBench, 1 CPU process
#   diffusionnft-cpu-2proc the same, 2 CPU processes (gloo): groups span processes
#   diffusionnft-sd35-8gpu SD3.5-Medium + HPSv2.1, the official sd3_hpsv2 config: LoRA r32, 512 px, 8 GPUs (DDP); 25 GB per GPU
#   diffusionnft-sd35-geneval-8gpu  the official sd3_geneval config: GenEval's partial score, Flow-GRPO's prompts; 23 GB per GPU
#   diffusionnft-sd35-ocr-8gpu      the official sd3_ocr config: the PP-OCR reward, beta 0.1; 21 GB per GPU
#   diffusionnft-sd35-curriculum-8gpu  the paper's five stages (800/300/200/200/100 iterations), each resuming the last;
#                          needs PICKAPIC_PROMPTS; FROM_STAGE=k restarts at stage k
#   diffusionnft-flux-8gpu FLUX.1-dev + HPSv2.1, Flow-Factory's NFT setting: LoRA r64, 384 px, offload, 8 GPUs (DDP); 41 GB per GPU
#   diffusionnft-kontext-8gpu  FLUX.1-Kontext-dev edits (EDITS), Flow-Factory's NFT setting: 20 ODE steps, guidance 2.5, LoRA r64, 512 px, offload, 8 GPUs (DDP); 44 GB per GPU
#   diffusionnft-qwen-edit-8gpu  Qwen-Image-Edit-2509 edits (EDITS), Flow-Factory's NFT setting: 30 ODE steps, no CFG, LoRA r64, 512 px, offload, 8 GPUs (DDP); 69 GB per GPU
#   dgpo-cpu               DGPO on ShapesBench, 1 CPU process
#   dpo-cpu                online Diffusion-DPO (dgpo.py --objective dpo) on ShapesBench, best vs worst of each group
#   dgpo-cpu-2proc         DGPO, 2 CPU processes (gloo)
#   dgpo-sd35-geneval-8gpu DGPO's official GenEval setting: SD3.5-Medium, GenEval's partial score, LoRA r64; 26 GB per GPU
#   dgpo-sd35-ocr-8gpu     DGPO's official OCR setting: SD3.5-Medium, the PP-OCR reward, LoRA r64; 24 GB per GPU
#   dgpo-flux-8gpu         DGPO on FLUX.1-dev + HPSv2.1 (no official setting: the SD3.5 objective), LoRA r64, 512 px; 41 GB per GPU
#   rlr-cpu                RLR on ShapesBench, 1 CPU process: ablation V2 (no zero-order term), DCoT stage coarse
#   rlr-full-cpu           RLR's full, unbiased estimator (FO + HO + ZO, window anywhere): learns nothing here
#   rlr-v1-cpu             RLR ablation V1: first-order term only (AlignProp with K = 1)
#   rlr-v2-cpu             RLR ablation V2 (biased) with the window anywhere, as the paper's ablation
#   rlr-cpu-2proc          2 CPU processes (gloo)
#   rlr-sd15-1gpu          SD1.5 + HPSv2.1, DDIM eta 1, LoRA r4, 512 px, 1 GPU; 17 GB per GPU
#   rlr-sd15-8gpu          SD1.5 + HPSv2.1, LoRA r4, 512 px, 8 GPUs (DDP); 17 GB per GPU
#   rlr-sd15-multinode     LoRA on NUM_MACHINES x 8 GPUs; needs MAIN_IP, MACHINE_RANK, NUM_MACHINES
#   compare                every method at its defaults, side by side (benchmarks/claims/compare.py); add --quick
#   evaluate-flux          FLUX.1-dev base vs --weights runs/<run> on HPDv2's test prompts: HPSv2.1, PickScore, ImageReward
#   evaluate-sd35          the same for SD3.5-Medium (add --guidance-scale 1 for V-GRPO's evaluation without CFG)
#   evaluate-sd35-geneval  SD3.5-Medium base vs --weights on GenEval's 553 prompts x 4: the per-task table and overall
#   evaluate-sd35-geneval-flowgrpo  the same with Flow-GRPO's released GenEval LoRA (FLOWGRPO_GENEVAL_LORA); published: 94.08% of images
#   evaluate-sd35-ocr      SD3.5-Medium base vs --weights on Flow-GRPO's 1018 OCR test prompts: OCR accuracy
#
# GPU recipes (flux, sd35, sd15, wan, qwen) need:
#   PROMPTS       training prompts, one per line (required). HPDv2's 3200 test prompts (Hugging Face dataset
#                 zhwang/HPDv2, benchmark/*.json) make one: python -m common.prompts hpdv2 prompts/hpdv2_test.txt
#   EVAL_PROMPTS  held-out prompts (default: PROMPTS); evaluation uses a fixed subset of 48 (--eval-max-prompts)
#   HPS           HPS_v2.1_compressed.pt (default: downloaded from the hub, xswu/HPSv2, on first use)
#   MODEL_ID      a local diffusers folder, if the hub is not reachable (default: the hub id of the recipe's model)
# The editing and image-to-video recipes (kontext, qwen-edit, wan-i2v) read an edit file instead of PROMPTS:
#   EDITS         training edits (required): a .jsonl file, one {"instruction": ..., "image": PATH} a line (Wan I2V:
#                 the image is the first frame; docs/editing.md)
#   EVAL_EDITS    held-out edits (default: EDITS)
#   CLIP_SIM      a CLIP ViT-L/14 folder for the image_similarity reward (default: the hub's openai/clip-vit-large-patch14)
# GB per GPU: the plan of benchmarks/gpu/memory.py (docs/gpu.md), not a measurement: no recipe has run at full size yet.
# --print shows a recipe's command; multinode recipes have the per-GPU memory of their 8gpu one.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
LAUNCH=("$PY" -m accelerate.commands.launch)  # = `accelerate launch`, minus the console script's timm import
mode=run
case "${1:-}" in
  --print) mode=print; shift ;;  # print the recipe's command instead of running it
  --list) sed -n 's/^  \([a-z][a-z0-9-]*\)) .*/\1/p' "$0"; exit 0 ;;
esac
recipe=${1:-dancegrpo-cpu}
shift || true

go() {  # run the command, or print it (bash run.sh --print RECIPE): one line, quoted where the shell needs it
  if [ "$mode" = run ]; then "$@"; return; fi
  local out=() w plain='^[-A-Za-z0-9_./:=,+@%$()*]+$'  # plain words, $VAR and $((...)) placeholders
  for w in "$@"; do
    if [[ "$w" =~ $plain ]]; then out+=("$w"); else out+=("$(printf '%q' "$w")"); fi
  done
  echo "${out[*]}"
}

need_env() {  # a GPU recipe's required variable; --print shows $NAME in its place
  if [ -z "${!1:-}" ]; then
    if [ "$mode" = print ]; then printf -v "$1" '%s' "\$$1"; return; fi
    echo "error: run.sh $recipe: set $1 ($2)" >&2
    exit 2
  fi
}

case "$recipe" in evaluate-*|*curriculum*|*-geneval-*|*-ocr-*) ;; *kontext*|*qwen-edit*|*wan-i2v*)
  need_env EDITS "an edit file, one JSON object a line: {\"instruction\": ..., \"image\": PATH} (docs/editing.md)"
  EVAL_EDITS=${EVAL_EDITS:-$EDITS} ;; *flux*|*sd35*|*sd15*|*wan*|*qwen*|*ltx2*|*hunyuan15*)
  need_env PROMPTS "a prompt file, one prompt per line; HPDv2's 3200 test prompts, from the Hugging Face dataset \
zhwang/HPDv2 (benchmark/*.json), are written to one by: python -m common.prompts hpdv2 prompts/hpdv2_test.txt"
  EVAL_PROMPTS=${EVAL_PROMPTS:-$PROMPTS} ;;
esac
HPS_CKPT=()  # without HPS the reward downloads its checkpoint from the hub
[ -n "${HPS:-}" ] && HPS_CKPT=(--reward-ckpt "hpsv2.1=$HPS")
GPU_MEMORY=(--mixed-precision bf16 --gradient-checkpointing)
GPU_PROMPTS=(--prompts "${PROMPTS:-}" --eval-prompts "${EVAL_PROMPTS:-}" --weight-decay 0 --lr-warmup 0)
GPU_COMMON=("${GPU_MEMORY[@]}" --reward hpsv2.1 "${HPS_CKPT[@]}" "${GPU_PROMPTS[@]}")
SIM_CKPT=()  # without CLIP_SIM image_similarity downloads CLIP ViT-L/14 from the hub
[ -n "${CLIP_SIM:-}" ] && SIM_CKPT=(--reward-ckpt "image_similarity=$CLIP_SIM")
EDIT_PROMPTS=(--prompts "${EDITS:-}" --eval-prompts "${EVAL_EDITS:-}" --lr-warmup 0)

# DanceGRPO's FLUX setting (https://github.com/XueZeyue/DanceGRPO, scripts/finetune/finetune_flux_grpo*.sh), LoRA
# variant: 720 px, 16 steps, constant eta 0.3, 12 images per prompt sharing their initial noise, rollout batch 1,
# clip 1e-4, no KL, embedded guidance 3.5. The schedule is the official code's static shift 3 (--shift 3), not
# FluxPipeline's by-resolution one (the default --shift pipeline: docs/models.md).
FLUX_DANCE=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 720 "${GPU_COMMON[@]}" --shift 3
  --num-steps 16 --sde-type dance --noise-level 0.3 --guidance-scale 3.5 --group-size 12 --samples-per-device 12
  --rollout-batch-size 1 --samples-per-update 4 --same-noise --clip-range 1e-4 --kl-beta 0 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
FLUX_LORA=(--lora --lora-rank 128 --lora-alpha 256 --learning-rate 3e-4 --offload-frozen)
FLUX_FULL=(--no-lora --learning-rate 1e-5 --offload-frozen)
# BranchGRPO's FLUX setting (https://github.com/Fredreic1849/BranchGRPO, scripts/finetune/finetune_flux_branchgrpo_8gpus.sh):
# 20 steps, dense splits 0,3,6,9, K = 2 (16 leaves), constant eta 0.3, 2 prompts per GPU, no KL, lr 1e-5 (full
# fine-tuning); clip 1e-4, DanceGRPO's, which the paper's appendix A says all methods share (the release's launcher: 1e-3).
# The official code's static shift 3, as DanceGRPO's (--shift 3; FluxPipeline's own is the default, --shift pipeline).
FLUX_BRANCH=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 720 "${GPU_COMMON[@]}" --shift 3
  --num-steps 20 --split-schedule dense --num-splits 4 --branch-factor 2 --sde-type dance --noise-level 0.3
  --guidance-scale 3.5 --trees-per-device 2 --trees-per-update 1 --rollout-batch-size 8 --clip-range 1e-4
  --kl-beta 0 --iterations 300 --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10
  --save-every 20 --pruning depth --window 4)
# V-GRPO's FLUX setting (arXiv 2604.23380, experiments and appendix): 720 px, 16-step DPM-Solver++ ODE, N_MC 4, 12
# images per prompt (one prompt per GPU), clip 6e-3, no KL, embedded guidance 3.5, 3 optimizer steps per iteration;
# the static shift 3 of the DanceGRPO code it builds on (--shift 3; FluxPipeline's own is the default, --shift pipeline).
FLUX_VGRPO=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 720 "${GPU_COMMON[@]}" --shift 3
  --num-steps 16 --solver dpm++2m --n-mc 4 --guidance-scale 3.5 --group-size 12 --samples-per-device 12
  --rollout-batch-size 1 --train-batch-size 1 --samples-per-update 4 --clip-range 6e-3 --kl-beta 0 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
# Flow-GRPO's SD3.5-Medium setting (arXiv 2505.05470, config/grpo.py), which dancegrpo.py's flow SDE is: 512 px,
# 10 steps, a = 0.7, CFG 4.5 in training, 24 images per prompt, LoRA r32 alpha 64, lr 3e-4, clip 1e-4, KL 0.04.
FLOWGRPO_SD35=(--shift 3
  --num-steps 10 --sde-type flow --noise-level 0.7 --guidance-scale 4.5 --group-size 24 --samples-per-device 24
  --rollout-batch-size 8 --samples-per-update 24 --timestep-fraction 1.0 --clip-range 1e-4 --kl-beta 0.04
  --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
SD35=(--model-id "${MODEL_ID:-stabilityai/stable-diffusion-3.5-medium}" --resolution 512)
SD35_DANCE=("${SD35[@]}" "${GPU_COMMON[@]}" "${FLOWGRPO_SD35[@]}")
# The field's yardsticks on SD3.5-Medium (docs/evaluate.md): Flow-GRPO's GenEval and OCR runs (config/grpo.py,
# geneval_sd3 and general_ocr_sd3: the setting above, rewarded by GenEval's partial score or the OCR reward, on its
# own prompt sets). Not here: its EMA, and its advantage's std over all prompts (here: each prompt's group's). The
# prompt sets are written once by `python -m common.prompts NAME FILE` (the defaults below: flowgrpo-geneval-train,
# flowgrpo-geneval-test, flowgrpo-ocr-train, flowgrpo-ocr-test, geneval); GENEVAL_CKPT: a folder with mask2former/
# and clip/ (default: the hub's facebook/mask2former-swin-small-coco-instance and openai/clip-vit-large-patch14).
GENEVAL_CKPTS=()
[ -n "${GENEVAL_CKPT:-}" ] && GENEVAL_CKPTS=(--reward-ckpt "geneval=$GENEVAL_CKPT")
GENEVAL_TASK=(--reward geneval "${GENEVAL_CKPTS[@]}" --prompts "${GENEVAL_PROMPTS:-prompts/flowgrpo_geneval_train.jsonl}"
  --eval-prompts "${GENEVAL_EVAL_PROMPTS:-prompts/flowgrpo_geneval_test.jsonl}")
OCR_TASK=(--reward ocr --prompts "${OCR_PROMPTS:-prompts/flowgrpo_ocr_train.txt}"
  --eval-prompts "${OCR_EVAL_PROMPTS:-prompts/flowgrpo_ocr_test.txt}")
SD35_YARD=("${SD35[@]}" "${GPU_MEMORY[@]}" --weight-decay 0 --lr-warmup 0)
# GRPO-Guard's SD3.5-Medium setting (arXiv 2510.22319; flow_grpo's config/grpo_guard.py, general_ocr_sd3_rationorm):
# Flow-GRPO's sampling (512 px, 10 steps, a = 0.7, CFG 4.5, 24 images per prompt), its 9 of 10 steps trained (here the
# 9 trainable SDE steps), the normalised ratio in a 2e-6 clip, lr 1e-4, no KL. Not here: its EMA and fp16.
SD35_GUARD=(--model-id "${MODEL_ID:-stabilityai/stable-diffusion-3.5-medium}" --resolution 512 "${GPU_COMMON[@]}" --shift 3
  --num-steps 10 --sde-type flow --noise-level 0.7 --guidance-scale 4.5 --group-size 24 --samples-per-device 24
  --rollout-batch-size 8 --samples-per-update 24 --timestep-fraction 1.0 --objective guard --kl-beta 0
  --lora --lora-rank 32 --lora-alpha 64 --learning-rate 1e-4 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
# Flow-DPPO's SD3.5 setting (arXiv 2606.11025; UniRL's FlowDPPO/config.yaml): 10 steps, a = 0.7, no CFG, 16 images
# per prompt, 3 SDE steps in the first half of the trajectory (here a 3-step window that slides from step 0 to 2 over
# 300 iterations), 2 updates per batch, KL mask 1e-5, lr 3e-4, no KL term. Its advantages use the batch's std, here
# the group's.
SD35_DPPO=(--model-id "${MODEL_ID:-stabilityai/stable-diffusion-3.5-medium}" --resolution 512 "${GPU_COMMON[@]}" --shift 3
  --num-steps 10 --sde-type flow --noise-level 0.7 --guidance-scale 1 --group-size 16 --samples-per-device 16
  --rollout-batch-size 8 --samples-per-update 8 --sde-window 3 --window-shift-every 100 --objective dppo
  --kl-mask-threshold 1e-5 --kl-beta 0 --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
# MixGRPO-Flash's FLUX setting (arXiv 2507.21802; https://github.com/Tencent-Hunyuan/MixGRPO,
# scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh): 25 steps at the static shift 3, Flow-GRPO's SDE (a = 0.7)
# in a 4-step window that moves every 20 iterations, DPM-Solver++(2M) after it on 0.4 of the remaining steps, clip
# 1e-4, 12 images per prompt, the DanceGRPO FLUX setting otherwise.
FLUX_FLASH=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 720 "${GPU_COMMON[@]}"
  --num-steps 25 --shift 3 --sde-type flow --noise-level 0.7 --sde-window 4 --window-shift-every 20 --ode-solver dpm2
  --post-window-compress 0.4 --guidance-scale 3.5 --group-size 12 --samples-per-device 12 --rollout-batch-size 1
  --samples-per-update 4 --same-noise --clip-range 1e-4 --kl-beta 0 --iterations 300 --eval-every 20
  --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
# V-GRPO's SD3.5-Medium stage 1 (arXiv 2604.23380, appendix): 512 px, 40-step ODE without CFG, N_MC 4, 24 images per
# prompt, one optimizer step per iteration, advantage soft clip eta 3, no ratio clip in effect, no KL, LoRA r32 alpha 64,
# lr 3e-4 (the paper's reward is HPSv2.1 + PickScore + CLIP score; HPSv2.1 alone here).
VGRPO_SD35=(--shift 3
  --num-steps 40 --solver dpm++2m --n-mc 4 --guidance-scale 1 --group-size 24 --samples-per-device 24
  --rollout-batch-size 8 --train-batch-size 2 --samples-per-update 24 --adv-soft-clip 3 --kl-beta 0
  --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
SD35_VGRPO=("${SD35[@]}" "${GPU_COMMON[@]}" "${VGRPO_SD35[@]}")
# DGPO's SD3.5-Medium settings (github.com/Luo-Yihong/DGPO, config/dgpo.py: geneval_sd3_4gpu, general_ocr_sd3_4gpu;
# its README: 4 GPUs): 512 px, 10-step DPM-Solver ODE rollouts with shift 3 and CFG 4.5, training forwards without CFG,
# 16 images per prompt, 8 prompts per iteration on 4 GPUs (here 16 on 8: the same 32 images per GPU), one optimizer
# step per iteration, 4 shared timesteps of the grid's first 5 (GenEval) or 7 (OCR), DPO beta 100, clip 1e-2, KL 0.02,
# rollouts from the EMA reference after 500 (GenEval) or 200 steps, the evaluation EMA 0.9 every 8 steps, LoRA r64
# alpha 128, lr 3e-4, weight decay 1e-4; OCR divides by the std of all rewards. Its monitoring evaluation: 14 steps.
DGPO_SD35=("${SD35[@]}" "${GPU_MEMORY[@]}" --lr-warmup 0 --weight-decay 1e-4 --shift 3 --num-steps 10 --solver dpm2 --guidance-scale 4.5
  --train-guidance-scale 1 --group-size 16 --samples-per-device 32 --rollout-batch-size 16 --train-batch-size 16
  --samples-per-update 32 --train-timesteps 4 --beta 100 --clip-range 1e-2 --kl-beta 0.02 --ema-every 8
  --lora --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --iterations 600 --eval-every 20
  --eval-samples-per-prompt 1 --eval-steps 14 --sample-every 10 --save-every 20)
DGPO_GENEVAL=("${DGPO_SD35[@]}" --trunc-steps 4 --switch-ema-ref 500 "${GENEVAL_TASK[@]}")
DGPO_OCR=("${DGPO_SD35[@]}" --trunc-steps 6 --switch-ema-ref 200 --global-std "${OCR_TASK[@]}")
# DGPO on FLUX.1-dev: no official setting exists (the official code, Flow-Factory's and VeRL-Omni's ports train
# SD3.5-Medium only); DGPO_SD35's objective (16 images per prompt, 4 shared timesteps of the grid's first 7, beta 100,
# clip 1e-2, KL 0.02, LoRA r64) on the FLUX recipes' model side: embedded guidance 3.5 in rollouts and training, the
# official code's static shift 3, HPSv2.1 on HPDv2 prompts, 512 px (a micro-batch holds a whole group of 16).
DGPO_FLUX=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 512 "${GPU_COMMON[@]}" --shift 3
  --num-steps 10 --solver dpm2 --guidance-scale 3.5 --train-guidance-scale 3.5 --group-size 16 --samples-per-device 32
  --rollout-batch-size 8 --train-batch-size 16 --samples-per-update 32 --train-timesteps 4 --trunc-steps 6 --beta 100
  --clip-range 1e-2 --kl-beta 0.02 --ema-every 8 --lora --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4
  --offload-frozen --iterations 300 --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10
  --save-every 20)
# RLR's SD setting (arXiv 2502.00639 §5; https://github.com/RTkenny/RLR-Optimizer, scripts/hps_RLR.sh): SD1.5 (paper:
# SD1.4), 50 DDIM steps eta 1, CFG 5, LoRA r = 4, lr 1e-4, h = 2 (the paper's 30-40 GB choice), 4 images per prompt.
SD15_RLR=(--model-id "${MODEL_ID:-stable-diffusion-v1-5/stable-diffusion-v1-5}" "${GPU_COMMON[@]}"
  --num-steps 50 --noise-level 1.0 --guidance-scale 5 --group-size 4 --samples-per-device 4 --rollout-batch-size 2
  --subchain-len 2 --terms fo+ho --subchain-stage any --lora --lora-rank 4 --lora-alpha 4 --learning-rate 1e-4
  --iterations 100 --eval-every 10 --eval-samples-per-prompt 1 --eval-steps 50 --sample-every 5 --save-every 10)
# DiffusionNFT's SD3.5-Medium setting (https://github.com/NVlabs/DiffusionNFT, config/nft.py, sd3_hpsv2): 512 px,
# 10-step DPM-Solver-2 rollouts without CFG, 24 images per prompt, 48 prompts per iteration (144 images per GPU on 8),
# one optimizer step per iteration, 9 of the 10 grid timesteps per image, NFT beta 1, KL 1e-4, old policy
# eta = min(0.001 s, 0.5), EMA 0.9, LoRA r32 alpha 64, lr 3e-4, weight decay 1e-4, 40-step Euler evaluation; the
# grid the official pipeline samples on (SD3's scheduler at its shift 3: --shift pipeline), its training times too.
SD35_NFT_BASE=(--model-id "${MODEL_ID:-stabilityai/stable-diffusion-3.5-medium}" --resolution 512 "${GPU_MEMORY[@]}"
  --num-steps 10 --solver dpm2 --shift pipeline --guidance-scale 1 --group-size 24 --samples-per-device 144
  --rollout-batch-size 9 --train-batch-size 9 --samples-per-update 144 --timestep-fraction 0.99 --beta 1
  --kl-beta 1e-4 --old-decay linear --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --lr-warmup 0
  --weight-decay 1e-4 --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
SD35_NFT=("${SD35_NFT_BASE[@]}" --reward hpsv2.1 "${HPS_CKPT[@]}" --prompts "${PROMPTS:-}"
  --eval-prompts "${EVAL_PROMPTS:-}" --iterations 1000)
# ... and its sd3_geneval (the same setting) and sd3_ocr (beta 0.1, the delayed old-policy schedule, 2 optimizer steps
# per iteration) configs
SD35_NFT_GENEVAL=("${SD35_NFT_BASE[@]}" "${GENEVAL_TASK[@]}" --iterations 1000)
SD35_NFT_OCR=("${SD35_NFT_BASE[@]}" "${OCR_TASK[@]}" --beta 0.1 --old-decay delayed --samples-per-update 72
  --iterations 1000)
# DiffusionNFT on FLUX.1-dev has no official recipe (the official code is SD3 only); Flow-Factory's
# (https://github.com/X-GenGroup/Flow-Factory, examples/nft/lora/flux1/default.yaml): 384 px, 8 ODE steps, embedded
# guidance 3.5 in sampling and training, 16 images per prompt, 48 prompts per iteration (96 images per GPU on 8), 2
# trained timesteps per image (Flow-Factory: in the noisiest 70%; here: 2 of the 8 grid points, as the official
# code draws them), NFT beta 1, no KL, old policy (0, 0.001, 0.5) = --old-decay linear, LoRA r64 alpha 128, lr 3e-4;
# FluxPipeline's own schedule (--shift pipeline: by resolution), as the official code samples on its pipeline's grid.
FLUX_NFT=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 384 "${GPU_COMMON[@]}" --shift pipeline
  --num-steps 8 --solver dpm2 --guidance-scale 3.5 --group-size 16 --samples-per-device 96 --rollout-batch-size 8
  --train-batch-size 8 --samples-per-update 96 --timestep-fraction 0.25 --beta 1 --kl-beta 0 --old-decay linear
  --lora --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --iterations 1000 --eval-every 20
  --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20 --offload-frozen)
# Qwen-Image (20.4B transformer, Qwen2.5-VL-7B text encoder), Flow-Factory's GRPO setting
# (https://github.com/X-GenGroup/Flow-Factory, examples/grpo/lora/qwen_image/default.yaml): 512 px, 10 steps, true CFG
# 4, 16 images per prompt, 48 prompts per iteration (96 images per GPU on 8), 2 optimizer steps per iteration, clip
# 1e-4, no KL, LoRA r64 alpha 128, lr 3e-4. Flow-Factory's one SDE step drawn from steps 1-3 is not dancegrpo.py's:
# the SDE is the FLUX recipes' (constant eta 0.3 on every step, shared initial noise, 60% of the steps trained).
# Every Qwen-Image recipe samples on QwenImagePipeline's own schedule (--shift pipeline: by resolution, last sigma 0.02).
QWEN=(--model-id "${MODEL_ID:-Qwen/Qwen-Image}" --resolution 512 "${GPU_COMMON[@]}" --guidance-scale 4 --shift pipeline
  --lora --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --offload-frozen --iterations 300 --eval-every 20
  --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
QWEN_DANCE=("${QWEN[@]}" --num-steps 10 --sde-type dance --noise-level 0.3 --group-size 16 --samples-per-device 96
  --rollout-batch-size 4 --samples-per-update 48 --same-noise --clip-range 1e-4 --kl-beta 0)
# BranchGRPO on it: the FLUX recipes' trees (20 steps, splits 0,3,6,9, K = 2: 16 leaves = Flow-Factory's 16 images per
# prompt, eta 0.3, depth pruning with a 4-step window); 6 trees per GPU = 48 prompts on 8, one tree per optimizer step
# as the FLUX recipes (3 trees per step, Flow-Factory's 2 steps per iteration, would decode 48 leaves at once: 92.5 GB)
QWEN_BRANCH=("${QWEN[@]}" --num-steps 20 --split-schedule dense --num-splits 4 --branch-factor 2 --sde-type dance
  --noise-level 0.3 --trees-per-device 6 --trees-per-update 1 --rollout-batch-size 8 --clip-range 1e-4 --kl-beta 0
  --pruning depth --window 4)
# V-GRPO on it: the FLUX recipe's DPM-Solver++ ODE, N_MC 4 and clip 6e-3, on Flow-Factory's 10 steps and batches
QWEN_VGRPO=("${QWEN[@]}" --num-steps 10 --solver dpm++2m --n-mc 4 --group-size 16 --samples-per-device 96
  --rollout-batch-size 4 --train-batch-size 1 --samples-per-update 48 --clip-range 6e-3 --kl-beta 0)
# DiffusionNFT on Qwen-Image, Flow-Factory's NFT setting (examples/nft/lora/qwen_image/rational_rewards_t2i.yaml, whose
# reward is a VLM judge; HPSv2.1 here): 512 px, 30 ODE steps without CFG, 16 images per prompt, 32 prompts per
# iteration (64 images per GPU on 8), one optimizer step per iteration, 10 trained timesteps per image (Flow-Factory:
# in the noisiest 50%; here: 10 of the 30 grid points), NFT beta 1, no KL, old policy (0, 0.001, 0.5) = --old-decay
# linear, LoRA r64 alpha 128, lr 2e-4, 40-step evaluation.
QWEN_NFT=(--model-id "${MODEL_ID:-Qwen/Qwen-Image}" --resolution 512 "${GPU_COMMON[@]}" --shift pipeline
  --num-steps 30 --solver dpm2
  --guidance-scale 1 --group-size 16 --samples-per-device 64 --rollout-batch-size 8 --train-batch-size 8
  --samples-per-update 64 --timestep-fraction 0.34 --beta 1 --kl-beta 0 --old-decay linear --lora --lora-rank 64
  --lora-alpha 128 --learning-rate 2e-4 --iterations 300 --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40
  --sample-every 10 --save-every 20 --offload-frozen)
# FLUX.2 [klein] base 4B (the base model: the distilled one takes no guidance), Flow-Factory's GRPO setting
# (examples/grpo/lora/flux2_klein_base/default.yaml): 384 px, 8 steps, CFG 4, 16 images per prompt, 48 prompts per
# iteration (96 images per GPU on 8), 2 optimizer steps per iteration, clip 1e-4, no KL, LoRA r64 alpha 128, lr 3e-4;
# the SDE is the FLUX recipes' (as for Qwen-Image above); Flux2KleinPipeline's own schedule (--shift pipeline: mu by
# resolution and step count).
FLUX2_DANCE=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.2-klein-base-4B}" --resolution 384 "${GPU_COMMON[@]}"
  --shift pipeline
  --num-steps 8 --sde-type dance --noise-level 0.3 --guidance-scale 4 --group-size 16 --samples-per-device 96
  --rollout-batch-size 4 --samples-per-update 48 --same-noise --clip-range 1e-4 --kl-beta 0 --lora --lora-rank 64
  --lora-alpha 128 --learning-rate 3e-4 --offload-frozen --iterations 300 --eval-every 20 --eval-samples-per-prompt 1
  --eval-steps 28 --sample-every 10 --save-every 20)

curriculum() {  # FLAGS...: DiffusionNFT's five-stage SD3.5-M curriculum (the paper's appendix C) on 8 GPUs
  need_env PICKAPIC_PROMPTS "the Pick-a-Pic training prompts, one per line"
  # human preference: the official multi-reward trio (1:1:1, beta 0.1, 25 steps); GenEval: its partial score (the
  # official sd3_geneval: beta 1, 10 steps); OCR: the OCR reward (the official sd3_ocr: beta 0.1, 2 optimizer steps per
  # iteration). The GenEval and OCR prompt sets: GENEVAL_TASK's and OCR_TASK's (prompts/flowgrpo_*)
  local pref=(--prompts "$PICKAPIC_PROMPTS" --eval-prompts "$PICKAPIC_PROMPTS" --reward pickscore,hpsv2.1,clip
    "${HPS_CKPT[@]}" --beta 0.1 --num-steps 25)
  local geneval=("${GENEVAL_TASK[@]}" --beta 1 --num-steps 10)
  local ocr=("${OCR_TASK[@]}" --beta 0.1 --num-steps 10 --samples-per-update 72)
  local k=0 end=0 stage
  for stage in 800:pref 300:geneval 200:pref 200:geneval 100:ocr; do  # iterations:prompts and reward
    k=$((k + 1)) end=$((end + ${stage%%:*}))
    [ "$k" -lt "${FROM_STAGE:-1}" ] && continue
    local -n flags=${stage#*:}
    local resume=()
    [ "$k" -gt 1 ] && resume=(--resume-from latest)  # the newest checkpoint of runs/diffusionnft-curriculum__*
    go "${DDP8[@]}" diffusionnft.py "${SD35_NFT_BASE[@]}" --exp-name diffusionnft-curriculum "${flags[@]}" \
      --iterations "$end" "${resume[@]}" "$@"
    unset -n flags
  done
}

# Wan2.1 text-to-video 1.3B (docs/video.md). BranchGRPO's paper (§4.6) trains it with VideoAlign's motion-quality
# reward and gives no other video setting; here: Wan's 480p (480 x 832, the pipeline's default size) and 33 frames
# (2 s at 16 fps; latents 16 x 9 x 60 x 104), 20 steps with Wan2.1's flow shift 3, CFG 5 as WanPipeline, constant
# eta 0.3 (the image recipes'), HPSv2.1 on 4 evenly spaced frames plus the temporal term at weight 0.5, clip 1e-3
# (Flow-GRPO's Wan setting), LoRA r128, 16 videos per prompt and per GPU.
WAN=(--model-id "${MODEL_ID:-Wan-AI/Wan2.1-T2V-1.3B-Diffusers}" --num-frames 33 "${GPU_MEMORY[@]}"
  --reward hpsv2.1,temporal:0.5 "${HPS_CKPT[@]}" "${GPU_PROMPTS[@]}" --reward-frames 4 --shift 3 --guidance-scale 5 --clip-range 1e-3 --kl-beta 0
  --lora --lora-rank 128 --lora-alpha 256 --learning-rate 3e-4 --offload-frozen --iterations 200
  --eval-every 20 --eval-max-prompts 16 --eval-samples-per-prompt 1 --eval-steps 30 --sample-every 10 --save-every 20)
WAN_DANCE=("${WAN[@]}" --num-steps 20 --sde-type dance --noise-level 0.3 --group-size 16 --samples-per-device 16
  --rollout-batch-size 4 --samples-per-update 4)
WAN_BRANCH=("${WAN[@]}" --num-steps 20 --split-schedule dense --num-splits 4 --branch-factor 2 --sde-type dance
  --noise-level 0.3 --trees-per-device 1 --trees-per-update 1 --rollout-batch-size 8 --pruning depth --window 4)
WAN_VGRPO=("${WAN[@]}" --num-steps 16 --solver dpm++2m --n-mc 4 --group-size 16 --samples-per-device 16
  --rollout-batch-size 4 --train-batch-size 1 --samples-per-update 16)
# Wan2.2-TI2V-5B text-to-video, verl-omni's DanceGRPO setting (https://github.com/verl-project/verl-omni,
# examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_v1.sh): the model's 704 x 1280 (no --resolution) and
# shift 5, 9 frames (num_frames 8, which WanPipeline rounds to 4k + 1), 10 steps, CFG 5, 8 videos per prompt, 64
# prompts per iteration (64 videos per GPU on 8), 4 optimizer steps per iteration, micro-batch 4, 120 iterations.
# Its reward is HPSv3 and it trains all weights at lr 1e-5 with a windowed SDE; here: the Wan recipes' reward, LoRA
# r128 at lr 3e-4, clip 1e-3 and dancegrpo.py's SDE (constant eta 0.3 on every step).
WAN22_DANCE=(--model-id "${MODEL_ID:-Wan-AI/Wan2.2-TI2V-5B-Diffusers}" --num-frames 9 "${GPU_MEMORY[@]}"
  --reward hpsv2.1,temporal:0.5 "${HPS_CKPT[@]}" "${GPU_PROMPTS[@]}" --reward-frames 4 --shift 5 --guidance-scale 5
  --num-steps 10 --sde-type dance --noise-level 0.3 --group-size 8 --samples-per-device 64 --rollout-batch-size 4
  --samples-per-update 16 --clip-range 1e-3 --kl-beta 0 --lora --lora-rank 128 --lora-alpha 256 --learning-rate 3e-4
  --offload-frozen --iterations 120 --eval-every 20 --eval-max-prompts 16 --eval-samples-per-prompt 1 --eval-steps 30
  --sample-every 10 --save-every 20)

# LTX-2.3 text-to-video (video only: the audio latents are denoised beside the video's, never decoded), the CPS
# setting of Flow-Factory (examples/grpo/lora/ltx2/t2av.yaml) and VeRL-Omni (examples/flowgrpo_trainer/ltx2,
# run_ltx2_3_t2av_lora.sh; its README names the diffusers folder dg845/LTX-2.3-Diffusers): 24 steps on
# LTX2Pipeline's own grid (--shift pipeline: its dynamic shift by the video tokens), the coefficient-preserving SDE at eta 0.8 on a window of 3 steps inside the first 10 (here MixGRPO's
# sliding window: it starts at step 0 and moves one step every 25 iterations, so over 200 iterations it covers steps 0
# to 9; theirs draws the steps at random), clip 1e-4, lr 3e-4, 81 frames. VeRL-Omni's 256 x 384 is 320 x 320 here
# (about its area; --resolution is one side), LTX2Pipeline's CFG 3; their reward scores the audio too (CLAP,
# ImageBind): here the video recipes' HPSv2.1 on 4 frames + temporal. LoRA r32 is ours: r64 would not fit 80 GB.
LTX2_DANCE=(--model-id "${MODEL_ID:-dg845/LTX-2.3-Diffusers}" --resolution 320 --num-frames 81 "${GPU_MEMORY[@]}"
  --reward hpsv2.1,temporal:0.5 "${HPS_CKPT[@]}" "${GPU_PROMPTS[@]}" --reward-frames 4 --shift pipeline
  --guidance-scale 3 --num-steps 24 --sde-type cps --noise-level 0.8 --sde-window 3 --window-shift-every 25
  --group-size 8 --samples-per-device 8 --rollout-batch-size 2 --samples-per-update 8 --clip-range 1e-4 --kl-beta 0
  --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --offload-frozen --iterations 200 --eval-every 20
  --eval-max-prompts 16 --eval-samples-per-prompt 1 --eval-steps 24 --sample-every 10 --save-every 20)

# HunyuanVideo-1.5 480p text-to-video, UniRL's DanceGRPO setting (examples/diffusion/
# hunyuan_video15_t2v_dancegrpo_trainside.yaml): Flow-SDE (Flow-GRPO's step, --sde-type flow) at eta 0.25, 16 steps of
# which 8 are SDE steps (here MixGRPO's window of 8, moving every 25 iterations), the scheduler's static shift 5
# (--shift pipeline), no CFG, 480 x 480 x 5 frames; its reward is video PickScore: here the video recipes' HPSv2.1 on
# 4 frames + temporal. LoRA r32 and the batch sizes are ours.
HY15_DANCE=(--model-id "${MODEL_ID:-hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v}" --resolution 480
  --num-frames 5 "${GPU_MEMORY[@]}" --reward hpsv2.1,temporal:0.5 "${HPS_CKPT[@]}" "${GPU_PROMPTS[@]}"
  --reward-frames 4 --shift pipeline --guidance-scale 1 --num-steps 16 --sde-type flow --noise-level 0.25
  --sde-window 8 --window-shift-every 25 --group-size 8 --samples-per-device 8 --rollout-batch-size 4
  --samples-per-update 8 --clip-range 1e-4 --kl-beta 0 --lora --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4
  --offload-frozen --iterations 200 --eval-every 20 --eval-max-prompts 16 --eval-samples-per-prompt 1
  --eval-steps 16 --sample-every 10 --save-every 20)

# Editing and image-to-video (docs/editing.md): the prompts are an edit file (EDITS); each source is cut to the run's
# square (--resolution; Wan I2V: its native 480 x 832 frame) and conditions every forward. The reward is HPSv2.1 on
# the edit with image_similarity (CLIP ViT-L/14 cosine of the edit and its source) as a weighted term, in place of
# the frameworks' instruction judges (GenEval counting metadata, PickScore, a VLM judge served elsewhere).
# FLUX.1-Kontext-dev, Flow-GRPO's Kontext setting (yifan123/flow_grpo @ 54809b5 : config/grpo.py, counting_flux_kontext;
# @ 74db691 : scripts/train_flux_kontext.py): 512 px, 6 steps, the Flow-GRPO SDE at a = 0.9 on every step but the
# last (--timestep-fraction 1.0, as FLOWGRPO_SD35), embedded guidance 2.5, 21 images per prompt, 3 per forward, 2
# optimizer steps per iteration, clip 1e-4, no KL, LoRA r64 alpha 128, lr 3e-4, weight decay 1e-4, 28-step evaluation;
# its reward image_similarity 0.5 + geneval 0.5 becomes image_similarity 0.5 + hpsv2.1 0.5. Here 2 prompts per GPU (16
# per iteration; theirs 48 on 28 GPUs), FluxKontextPipeline's own schedule (--shift pipeline), no EMA.
KONTEXT_DANCE=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-Kontext-dev}" --resolution 512 "${GPU_MEMORY[@]}"
  --reward hpsv2.1:0.5,image_similarity:0.5 "${HPS_CKPT[@]}" "${SIM_CKPT[@]}" "${EDIT_PROMPTS[@]}" --shift pipeline
  --num-steps 6 --sde-type flow --noise-level 0.9 --guidance-scale 2.5 --group-size 21 --samples-per-device 42
  --rollout-batch-size 3 --samples-per-update 21 --timestep-fraction 1.0 --clip-range 1e-4 --kl-beta 0 --lora
  --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --weight-decay 1e-4 --offload-frozen --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
# DiffusionNFT on FLUX.1-Kontext-dev, Flow-Factory's NFT setting (X-GenGroup/Flow-Factory @ a0b2bc5 :
# examples/nft/lora/flux1_kontext/rational_rewards_edit.yaml): 512 px, 20 ODE steps, embedded guidance 2.5, 16 images
# per prompt, 32 prompts per iteration (64 images per GPU on 8), one optimizer step per iteration, every step in its
# noisiest 90% trained (--timestep-fraction 0.9: 18 of 20), NFT beta 1, KL 1e-3 (v-based), old policy (0, 0.001, 0.5) =
# --old-decay linear, LoRA r64 alpha 128, lr 2e-4, weight decay 1e-4, 28-step evaluation; its reward (a VLM judge) is
# the Kontext recipe's above.
KONTEXT_NFT=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-Kontext-dev}" --resolution 512 "${GPU_MEMORY[@]}"
  --reward hpsv2.1:0.5,image_similarity:0.5 "${HPS_CKPT[@]}" "${SIM_CKPT[@]}" "${EDIT_PROMPTS[@]}" --shift pipeline
  --num-steps 20 --solver dpm2 --guidance-scale 2.5 --group-size 16 --samples-per-device 64 --rollout-batch-size 8
  --train-batch-size 8 --samples-per-update 64 --timestep-fraction 0.9 --beta 1 --kl-beta 1e-3 --old-decay linear
  --lora --lora-rank 64 --lora-alpha 128 --learning-rate 2e-4 --weight-decay 1e-4 --offload-frozen --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 28 --sample-every 10 --save-every 20)
# Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline), DanceGRPO's Qwen-Image-Edit setting (XueZeyue/DanceGRPO @ 15cc71d :
# scripts/finetune/finetune_qwenimage_edit_grpo.sh, fastvideo/train_grpo_qwenimage_edit.py): 512 px, 20 steps at the
# static shift 3, constant eta 0.3, no CFG (--cfg 0.0: one forward per step), 8 images per prompt sharing their
# initial noise, 60% of the steps trained, clip 1e-4, advantages clipped at 5, 2 prompts per GPU and 2 optimizer
# steps per iteration, weight decay 1e-4, 300 iterations, HPSv2.1. Theirs is Qwen-Image-Edit (the first release, the
# source at the pipeline's own ~1 MP) fully fine-tuned at lr 1e-5 under FSDP; here the Plus model (the qwen-edit kind)
# and Flow-Factory's LoRA (X-GenGroup/Flow-Factory @ a0b2bc5 : examples/grpo/lora/qwen_image_edit_plus/default.yaml:
# r64 alpha 128, lr 3e-4; its evaluation: 40 steps), with image_similarity at Flow-GRPO's Qwen-Image-Edit weight 0.2
# (yifan123/flow_grpo @ 54809b5 : config/grpo.py, counting_qwenimage_edit) beside HPSv2.1's 0.8.
QWEN_EDIT_DANCE=(--model-id "${MODEL_ID:-Qwen/Qwen-Image-Edit-2509}" --resolution 512 "${GPU_MEMORY[@]}"
  --reward hpsv2.1:0.8,image_similarity:0.2 "${HPS_CKPT[@]}" "${SIM_CKPT[@]}" "${EDIT_PROMPTS[@]}" --shift 3
  --num-steps 20 --sde-type dance --noise-level 0.3 --guidance-scale 1 --group-size 8 --samples-per-device 16
  --rollout-batch-size 4 --samples-per-update 8 --same-noise --timestep-fraction 0.6 --clip-range 1e-4
  --adv-clip-max 5 --kl-beta 0 --lora --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --weight-decay 1e-4
  --offload-frozen --iterations 300 --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10
  --save-every 20)
# DiffusionNFT on Qwen-Image-Edit-2509, Flow-Factory's NFT setting (X-GenGroup/Flow-Factory @ a0b2bc5 :
# examples/nft/lora/qwen_image_edit_plus/rational_rewards_edit.yaml): 512 px, 30 ODE steps without CFG, 16 images per
# prompt, 32 prompts per iteration (64 images per GPU on 8), 2 optimizer steps per iteration, 5 trained timesteps per
# image (Flow-Factory: in the noisiest 70%; here 5 of the 30 grid points: --timestep-fraction 0.17), NFT beta 1, KL 2e-4
# (v-based), old policy (0, 0.001, 0.5) = --old-decay linear, LoRA r64 alpha 128, lr 2e-4, weight decay 1e-4, 40-step
# evaluation; QwenImageEditPlusPipeline's own schedule (--shift pipeline), as the Qwen-Image recipes; its reward (a VLM
# judge) is the Qwen-Image-Edit recipe's above.
QWEN_EDIT_NFT=(--model-id "${MODEL_ID:-Qwen/Qwen-Image-Edit-2509}" --resolution 512 "${GPU_MEMORY[@]}"
  --reward hpsv2.1:0.8,image_similarity:0.2 "${HPS_CKPT[@]}" "${SIM_CKPT[@]}" "${EDIT_PROMPTS[@]}" --shift pipeline
  --num-steps 30 --solver dpm2 --guidance-scale 1 --group-size 16 --samples-per-device 64 --rollout-batch-size 8
  --train-batch-size 8 --samples-per-update 32 --timestep-fraction 0.17 --beta 1 --kl-beta 2e-4 --old-decay linear
  --lora --lora-rank 64 --lora-alpha 128 --learning-rate 2e-4 --weight-decay 1e-4 --offload-frozen --iterations 300
  --eval-every 20 --eval-samples-per-prompt 1 --eval-steps 40 --sample-every 10 --save-every 20)
# Wan2.1-I2V-14B-480P image-to-video (the edit file's image is the first frame), DanceGRPO's image-to-video setting
# (XueZeyue/DanceGRPO @ 15cc71d : scripts/finetune/finetune_skyreels_i2v.sh, fastvideo/train_grpo_skyreels_i2v.py,
# SkyReels-I2V there): 16 steps, constant eta 0.3, CFG 5 in sampling and training, 8 videos per prompt sharing their
# initial noise, 60% of the steps trained, clip 1e-4, advantages clipped at 5, one prompt per GPU and one optimizer step
# per iteration, weight decay 1e-4, 120 iterations (their 121). Its model side from Flow-Factory
# (X-GenGroup/Flow-Factory @ a0b2bc5 : examples/grpo/lora/wan21/i2v.yaml: Wan2.1-I2V-14B-480P, LoRA r64 alpha 128, lr
# 1e-4, CFG 5); Wan's own 480P frame (480 x 832, no --resolution) and shift 3 (Wan2.1's 480P image-to-video), 33 frames
# (the Wan recipes' 2 s; theirs: SkyReels 53 frames at 400 x 640, Flow-Factory 5 at 240 px); the video recipes' reward.
WAN_I2V_DANCE=(--model-id "${MODEL_ID:-Wan-AI/Wan2.1-I2V-14B-480P-Diffusers}" --num-frames 33 "${GPU_MEMORY[@]}"
  --reward hpsv2.1,temporal:0.5 "${HPS_CKPT[@]}" "${EDIT_PROMPTS[@]}" --reward-frames 4 --shift 3 --guidance-scale 5
  --num-steps 16 --sde-type dance --noise-level 0.3 --group-size 8 --samples-per-device 8 --rollout-batch-size 1
  --samples-per-update 8 --same-noise --timestep-fraction 0.6 --clip-range 1e-4 --adv-clip-max 5 --kl-beta 0 --lora
  --lora-rank 64 --lora-alpha 128 --learning-rate 1e-4 --weight-decay 1e-4 --offload-frozen --iterations 120
  --eval-every 20 --eval-max-prompts 16 --eval-samples-per-prompt 1 --eval-steps 30 --sample-every 10 --save-every 20)

# Scoring trained weights against the base (python -m common.evaluate, docs/evaluate.md): HPDv2's 3200 test prompts
# (from the hub cache), one sample each, the recipes' evaluation sampler; add --weights runs/<run> (repeatable).
EVAL_REWARDS=(--prompts hpdv2 --samples-per-prompt 1 --reward hpsv2.1,pickscore,imagereward "${HPS_CKPT[@]}")
EVAL_FLUX=(--model-id "${MODEL_ID:-black-forest-labs/FLUX.1-dev}" --resolution 720 --mixed-precision bf16
  "${EVAL_REWARDS[@]}" --num-steps 28 --guidance-scale 3.5)
EVAL_SD35=(--model-id "${MODEL_ID:-stabilityai/stable-diffusion-3.5-medium}" --resolution 512 --mixed-precision bf16
  "${EVAL_REWARDS[@]}" --num-steps 40 --guidance-scale 4.5)
# GenEval and OCR as Flow-GRPO evaluates SD3.5-Medium (config/grpo.py: 40 steps, CFG 4.5, 512 px): GenEval's 553
# prompts x 4 images (the 2212 images of its test set, and of GenEval's own protocol), its verdict per image and the
# partial score beside it; OCR on its 1018 test prompts, one image each. Add --guidance-scale 1 for DiffusionNFT's and
# V-GRPO's models, which sample without CFG.
GENEVAL_EVAL_CKPTS=()
[ -n "${GENEVAL_CKPT:-}" ] && GENEVAL_EVAL_CKPTS=(--reward-ckpt "geneval=$GENEVAL_CKPT" --reward-ckpt "geneval_accuracy=$GENEVAL_CKPT")
EVAL_GENEVAL=("${SD35[@]}" --mixed-precision bf16 --prompts "${GENEVAL_EVAL_PROMPTS:-prompts/geneval.jsonl}"
  --samples-per-prompt 4 --reward geneval_accuracy,geneval:0 "${GENEVAL_EVAL_CKPTS[@]}" --num-steps 40 --guidance-scale 4.5)
EVAL_OCR=("${SD35[@]}" --mixed-precision bf16 --prompts "${OCR_EVAL_PROMPTS:-prompts/flowgrpo_ocr_test.txt}"
  --samples-per-prompt 1 --reward ocr --num-steps 40 --guidance-scale 4.5)

multinode() {  # SCRIPT FLAGS...: DDP on NUM_MACHINES x 8 GPUs, launched once per machine
  for v in MAIN_IP MACHINE_RANK NUM_MACHINES; do need_env "$v" "multi-node recipes: MAIN_IP, MACHINE_RANK, NUM_MACHINES"; done
  local procs='$((8*NUM_MACHINES))'
  [[ "$NUM_MACHINES" =~ ^[0-9]+$ ]] && procs=$((8 * NUM_MACHINES))
  go "${LAUNCH[@]}" --config_file configs/ddp_8gpu.yaml --num_machines "$NUM_MACHINES" --machine_rank "$MACHINE_RANK" \
    --main_process_ip "$MAIN_IP" --main_process_port "${MAIN_PORT:-29500}" --num_processes "$procs" "$@"
}
DDP8=("${LAUNCH[@]}" --config_file configs/ddp_8gpu.yaml)
FSDP8=("${LAUNCH[@]}" --config_file configs/fsdp_flux_8gpu.yaml)
CPU2=(env ACCELERATE_USE_CPU=1 "${LAUNCH[@]}" --multi_gpu --num_processes 2)

case "$recipe" in
  dancegrpo-cpu) go "$PY" dancegrpo.py "$@" ;;
  dancegrpo-verifier-cpu) go "$PY" dancegrpo.py --exp-name dancegrpo-verifier --reward verifier "$@" ;;
  mixgrpo-cpu) go "$PY" dancegrpo.py --exp-name mixgrpo --sde-window 4 --kl-beta 0.2 "$@" ;;
  dancegrpo-cpu-2proc) go "${CPU2[@]}" dancegrpo.py --samples-per-device 32 "$@" ;;
  dancegrpo-flux-1gpu) go "${LAUNCH[@]}" --num_processes 1 dancegrpo.py "${FLUX_DANCE[@]}" "${FLUX_LORA[@]}" "$@" ;;
  dancegrpo-flux-8gpu) go "${DDP8[@]}" dancegrpo.py "${FLUX_DANCE[@]}" "${FLUX_LORA[@]}" "$@" ;;
  dancegrpo-flux-fsdp8) go "${FSDP8[@]}" dancegrpo.py "${FLUX_DANCE[@]}" "${FLUX_FULL[@]}" "$@" ;;
  dancegrpo-flux-multinode) multinode dancegrpo.py "${FLUX_DANCE[@]}" "${FLUX_LORA[@]}" "$@" ;;
  dancegrpo-sd35-8gpu) go "${DDP8[@]}" dancegrpo.py "${SD35_DANCE[@]}" "$@" ;;
  dancegrpo-sd35-geneval-8gpu) go "${DDP8[@]}" dancegrpo.py "${SD35_YARD[@]}" "${FLOWGRPO_SD35[@]}" "${GENEVAL_TASK[@]}" "$@" ;;
  dancegrpo-sd35-ocr-8gpu) go "${DDP8[@]}" dancegrpo.py "${SD35_YARD[@]}" "${FLOWGRPO_SD35[@]}" "${OCR_TASK[@]}" "$@" ;;
  grpoguard-sd35-8gpu) go "${DDP8[@]}" dancegrpo.py "${SD35_GUARD[@]}" "$@" ;;
  flowdppo-sd35-8gpu) go "${DDP8[@]}" dancegrpo.py "${SD35_DPPO[@]}" "$@" ;;
  mixgrpo-flash-flux-8gpu) go "${DDP8[@]}" dancegrpo.py "${FLUX_FLASH[@]}" "${FLUX_LORA[@]}" "$@" ;;
  branchgrpo-cpu) go "$PY" branchgrpo.py "$@" ;;
  branchgrpo-verifier-cpu) go "$PY" branchgrpo.py --exp-name branchgrpo-verifier --reward verifier "$@" ;;
  branchgrpo-cpu-2proc) go "${CPU2[@]}" branchgrpo.py --trees-per-device 2 "$@" ;;
  branchgrpo-flux-1gpu) go "${LAUNCH[@]}" --num_processes 1 branchgrpo.py "${FLUX_BRANCH[@]}" "${FLUX_LORA[@]}" "$@" ;;
  branchgrpo-flux-8gpu) go "${DDP8[@]}" branchgrpo.py "${FLUX_BRANCH[@]}" "${FLUX_LORA[@]}" "$@" ;;
  branchgrpo-flux-fsdp8) go "${FSDP8[@]}" branchgrpo.py "${FLUX_BRANCH[@]}" "${FLUX_FULL[@]}" "$@" ;;
  branchgrpo-flux-multinode) multinode branchgrpo.py "${FLUX_BRANCH[@]}" "${FLUX_LORA[@]}" "$@" ;;
  vgrpo-cpu) go "$PY" vgrpo.py "$@" ;;
  vgrpo-verifier-cpu) go "$PY" vgrpo.py --exp-name vgrpo-verifier --reward verifier "$@" ;;
  vgrpo-nokl-cpu) go "$PY" vgrpo.py --exp-name vgrpo-nokl --no-lora --learning-rate 3e-4 --weight-decay 0 --kl-beta 0 \
    --iterations 60 --eval-every 10 "$@" ;;
  vgrpo-naive-cpu) go "$PY" vgrpo.py --exp-name vgrpo-naive --no-stratified --no-shared-pairs --no-self-normalize "$@" ;;
  vgrpo-cpu-2proc) go "${CPU2[@]}" vgrpo.py --samples-per-device 32 --samples-per-update 16 "$@" ;;
  vgrpo-flux-1gpu) go "${LAUNCH[@]}" --num_processes 1 vgrpo.py "${FLUX_VGRPO[@]}" "${FLUX_LORA[@]}" "$@" ;;
  vgrpo-flux-8gpu) go "${DDP8[@]}" vgrpo.py "${FLUX_VGRPO[@]}" "${FLUX_LORA[@]}" "$@" ;;
  vgrpo-flux-fsdp8) go "${FSDP8[@]}" vgrpo.py "${FLUX_VGRPO[@]}" "${FLUX_FULL[@]}" "$@" ;;
  vgrpo-flux-multinode) multinode vgrpo.py "${FLUX_VGRPO[@]}" "${FLUX_LORA[@]}" "$@" ;;
  vgrpo-sd35-8gpu) go "${DDP8[@]}" vgrpo.py "${SD35_VGRPO[@]}" "$@" ;;
  vgrpo-sd35-geneval-8gpu) go "${DDP8[@]}" vgrpo.py "${SD35_YARD[@]}" "${VGRPO_SD35[@]}" "${GENEVAL_TASK[@]}" "$@" ;;
  vgrpo-sd35-ocr-8gpu) go "${DDP8[@]}" vgrpo.py "${SD35_YARD[@]}" "${VGRPO_SD35[@]}" "${OCR_TASK[@]}" "$@" ;;
  dancegrpo-wan-1gpu) go "${LAUNCH[@]}" --num_processes 1 dancegrpo.py "${WAN_DANCE[@]}" "$@" ;;
  dancegrpo-wan-8gpu) go "${DDP8[@]}" dancegrpo.py "${WAN_DANCE[@]}" "$@" ;;
  branchgrpo-wan-1gpu) go "${LAUNCH[@]}" --num_processes 1 branchgrpo.py "${WAN_BRANCH[@]}" "$@" ;;
  branchgrpo-wan-8gpu) go "${DDP8[@]}" branchgrpo.py "${WAN_BRANCH[@]}" "$@" ;;
  vgrpo-wan-8gpu) go "${DDP8[@]}" vgrpo.py "${WAN_VGRPO[@]}" "$@" ;;
  dancegrpo-qwen-8gpu) go "${DDP8[@]}" dancegrpo.py "${QWEN_DANCE[@]}" "$@" ;;
  branchgrpo-qwen-8gpu) go "${DDP8[@]}" branchgrpo.py "${QWEN_BRANCH[@]}" "$@" ;;
  vgrpo-qwen-8gpu) go "${DDP8[@]}" vgrpo.py "${QWEN_VGRPO[@]}" "$@" ;;
  diffusionnft-qwen-8gpu) go "${DDP8[@]}" diffusionnft.py "${QWEN_NFT[@]}" "$@" ;;
  dancegrpo-flux2-8gpu) go "${DDP8[@]}" dancegrpo.py "${FLUX2_DANCE[@]}" "$@" ;;
  dancegrpo-wan22-8gpu) go "${DDP8[@]}" dancegrpo.py "${WAN22_DANCE[@]}" "$@" ;;
  dancegrpo-ltx2-8gpu) go "${DDP8[@]}" dancegrpo.py "${LTX2_DANCE[@]}" "$@" ;;
  dancegrpo-hunyuan15-8gpu) go "${DDP8[@]}" dancegrpo.py "${HY15_DANCE[@]}" "$@" ;;
  dancegrpo-kontext-8gpu) go "${DDP8[@]}" dancegrpo.py "${KONTEXT_DANCE[@]}" "$@" ;;
  dancegrpo-qwen-edit-8gpu) go "${DDP8[@]}" dancegrpo.py "${QWEN_EDIT_DANCE[@]}" "$@" ;;
  dancegrpo-wan-i2v-8gpu) go "${DDP8[@]}" dancegrpo.py "${WAN_I2V_DANCE[@]}" "$@" ;;
  diffusionnft-cpu) go "$PY" diffusionnft.py "$@" ;;
  diffusionnft-cpu-2proc) go "${CPU2[@]}" diffusionnft.py --samples-per-device 32 --samples-per-update 16 "$@" ;;
  diffusionnft-sd35-8gpu) go "${DDP8[@]}" diffusionnft.py "${SD35_NFT[@]}" "$@" ;;
  diffusionnft-sd35-geneval-8gpu) go "${DDP8[@]}" diffusionnft.py "${SD35_NFT_GENEVAL[@]}" "$@" ;;
  diffusionnft-sd35-ocr-8gpu) go "${DDP8[@]}" diffusionnft.py "${SD35_NFT_OCR[@]}" "$@" ;;
  diffusionnft-sd35-curriculum-8gpu) curriculum "$@" ;;
  diffusionnft-flux-8gpu) go "${DDP8[@]}" diffusionnft.py "${FLUX_NFT[@]}" "$@" ;;
  diffusionnft-kontext-8gpu) go "${DDP8[@]}" diffusionnft.py "${KONTEXT_NFT[@]}" "$@" ;;
  diffusionnft-qwen-edit-8gpu) go "${DDP8[@]}" diffusionnft.py "${QWEN_EDIT_NFT[@]}" "$@" ;;
  dgpo-cpu) go "$PY" dgpo.py "$@" ;;
  dpo-cpu) go "$PY" dgpo.py --objective dpo "$@" ;;
  dgpo-cpu-2proc) go "${CPU2[@]}" dgpo.py --samples-per-device 32 --samples-per-update 32 "$@" ;;
  dgpo-sd35-geneval-8gpu) go "${DDP8[@]}" dgpo.py "${DGPO_GENEVAL[@]}" "$@" ;;
  dgpo-sd35-ocr-8gpu) go "${DDP8[@]}" dgpo.py "${DGPO_OCR[@]}" "$@" ;;
  dgpo-flux-8gpu) go "${DDP8[@]}" dgpo.py "${DGPO_FLUX[@]}" "$@" ;;
  rlr-cpu) go "$PY" rlr.py "$@" ;;
  rlr-v1-cpu) go "$PY" rlr.py --exp-name rlr-v1 --terms fo "$@" ;;
  rlr-v2-cpu) go "$PY" rlr.py --exp-name rlr-v2 --terms fo+ho --subchain-stage any "$@" ;;
  rlr-full-cpu) go "$PY" rlr.py --exp-name rlr-full --terms fo+ho+zo --subchain-stage any "$@" ;;
  rlr-cpu-2proc) go "${CPU2[@]}" rlr.py --samples-per-device 4 "$@" ;;
  rlr-sd15-1gpu) go "${LAUNCH[@]}" --num_processes 1 rlr.py "${SD15_RLR[@]}" "$@" ;;
  rlr-sd15-8gpu) go "${DDP8[@]}" rlr.py "${SD15_RLR[@]}" "$@" ;;
  rlr-sd15-multinode) multinode rlr.py "${SD15_RLR[@]}" "$@" ;;
  compare) go "$PY" benchmarks/claims/compare.py "$@" ;;
  evaluate-flux) go "${LAUNCH[@]}" -m common.evaluate "${EVAL_FLUX[@]}" "$@" ;;
  evaluate-sd35) go "${LAUNCH[@]}" -m common.evaluate "${EVAL_SD35[@]}" "$@" ;;
  evaluate-sd35-geneval) go "${LAUNCH[@]}" -m common.evaluate "${EVAL_GENEVAL[@]}" "$@" ;;
  evaluate-sd35-geneval-flowgrpo) need_env FLOWGRPO_GENEVAL_LORA "a local copy of Flow-GRPO's released GenEval LoRA, \
e.g. hf download jieliu/SD3.5M-FlowGRPO-GenEval --local-dir flowgrpo-geneval"
    go "${LAUNCH[@]}" -m common.evaluate "${EVAL_GENEVAL[@]}" --weights "flowgrpo=$FLOWGRPO_GENEVAL_LORA" "$@" ;;
  evaluate-sd35-ocr) go "${LAUNCH[@]}" -m common.evaluate "${EVAL_OCR[@]}" "$@" ;;
  *) echo "unknown recipe '$recipe'; bash run.sh --list names them (the top of run.sh says what each does)" >&2; exit 2 ;;
esac
