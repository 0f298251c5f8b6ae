"""Score base and trained weights side by side, paired by noise, as the papers' tables do.

    python -m common.evaluate --weights runs/dancegrpo__0__<time>                  # ShapesBench: base vs a run
    bash run.sh evaluate-flux --weights runs/<run>      # FLUX.1-dev on HPDv2's test prompts (run.sh --print shows it)
    accelerate launch -m common.evaluate ...            # batches sharded over processes

Every model (the base, then each --weights) draws the same initial noise for the same (prompt, sample), keyed on
(--seed, 'eval', index) as the training scripts' held-out evaluation, through the same Euler ODE sampler
(common/sampling.py): with the run's evaluation settings (--num-steps = its --eval-steps, --batch-size = its rollout
batch) this command reproduces a run's last held-out evaluation of its final/ weights exactly. Each reward's mean per
model; each trained model's difference from the base with its paired standard error over prompts (and per HPDv2
style); on ShapesBench the verifier's accuracies and diversity too. Every --weights is checked against the model
before anything is sampled; models are loaded one at a time; every batch's scores are cached under --out (each file
checked on reload: a truncated or foreign one is computed again), so an interrupted evaluation resumes where it
stopped. Outputs in --out: results.md (the table), results.json (every figure), scores.jsonl (per prompt and model),
grid.png (the first sample of --grid-prompts prompts, a row per model). docs/evaluate.md has the papers' settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import torch
import tyro
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import gather_object
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from common import InputError, RunError, in_the_way, shapesbench, write_atomically
from common.attention import set_attention_backend
from common.edits import EditPrompt, check_edit_prompts
from common.flags import (
    Ge,
    Gt,
    Le,
    Lt,
    ModeDefault,
    check_flags,
    check_guidance_scale_2,
    check_shift,
    default_shift,
    need,
)
from common.models import LOW_NOISE_LORA, check_model_id, has_two_experts, is_video, registered
from common.prompts import HPDV2_STYLES, evenly_spaced, hpdv2_prompts, is_jsonl, load_prompts
from common.remote import RESUME, STOPS
from common.rewards import build_reward, check_reward_prompts, check_rewards, check_shapesbench_prompts, parse_rewards
from common.sampling import fixed_noise, ode_sampler, sample_prompts, schedule
from common.shapesbench.edit import edit_learned_reward, edit_metrics, source_images
from common.viz import save_grid


@dataclass
class EvalArgs:
    model_id: str = "shapesbench"
    """the base model (hub id or local diffusers folder), as --model-id of the training scripts"""
    weights: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """trained weights to compare with the base (repeat the flag): a run folder (its final/), a final/ folder, a
    checkpoint (checkpoints/iter_N), a LoRA folder or a full transformer folder; NAME=PATH names its row. Each is
    checked against the model before anything is sampled"""
    prompts: str = "shapes-eval"
    """shapes-eval, shapes-train, hpdv2 (HPDv2's 3200 test prompts with their styles, from the hub cache), hpdv2=FOLDER
    (its benchmark/*.json), a GenEval metadata file (.jsonl, its task as the style; `python -m common.prompts geneval
    prompts/geneval.jsonl`), or a text file with one prompt per line"""
    max_prompts: Annotated[int, Ge(0)] = 0
    """at most this many prompts, evenly spaced through the list (0 = all): the training scripts' --eval-max-prompts"""
    reward: str = "shapes,verifier"
    """rewards to report (name:weight,...; the weights only form the total): any registered reward, local or served"""
    reward_ckpt: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=PATH per reward model, as the training scripts'"""
    reward_url: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=URL per reward scored by another process, as the training scripts'"""
    samples_per_prompt: Annotated[int, Ge(1), Le(10000)] = 4
    num_steps: Annotated[int, Ge(1), Le(10000)] = 20
    """Euler ODE steps on the shifted schedule"""
    shift: Annotated[
        Optional[Union[float, Literal["pipeline"]]], ModeDefault("'pipeline'; 3 on ShapesBench"), Gt(0), Le(100)
    ] = None
    """the sigma grid, as the training scripts' flag: a number k is the SD3 shift of linspace(1, 0, T + 1), 'pipeline'
    the grid of the model's own diffusers pipeline at this size and step count (docs/models.md)"""
    guidance_scale: Annotated[float, Ge(0), Le(100)] = 1.0
    guidance_scale_2: Annotated[Optional[float], Ge(0), Le(100)] = None
    """Wan2.2-T2V-A14B only: the low-noise expert's CFG scale, as the training scripts' flag (None: --guidance-scale)"""
    resolution: Annotated[Optional[int], Ge(8), Le(8192)] = None
    num_frames: Annotated[Optional[int], Ge(1), Le(1025)] = None
    """video models only"""
    seed: Annotated[int, Ge(0), Lt(2**63)] = 0
    batch_size: Annotated[int, Ge(1), Le(4096)] = 16
    """images per sampler call (a batch is also the unit of the cache)"""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    attention_backend: Literal["auto", "flash", "efficient", "math", "cudnn"] = "auto"
    """attention kernels (common/attention.py), as the training scripts' flag: the run's choice reproduces its
    evaluation exactly"""
    grid_prompts: Annotated[int, Ge(1), Le(1024)] = 8
    out: str = "eval_out"
    """folder for the table, the figures, the per-prompt scores, the grid and the cache"""


# ---------------------------------------------------------------------------------------------------
# Inputs: prompts (with their HPDv2 style) and the weights to load
# ---------------------------------------------------------------------------------------------------
def load_prompt_set(source: str, max_prompts: int, edits: bool = False) -> tuple[list[str], list[str]]:
    """(prompts, style of each: HPDv2's or '' elsewhere), the evenly spaced subset of max_prompts when > 0; `edits`:
    the ShapesBench splits are ShapesBench-Edit's (common.prompts.load_prompts)."""
    if source == "hpdv2" or source.startswith("hpdv2="):
        try:
            prompts = hpdv2_prompts(source.partition("=")[2] or None)
        except Exception as e:  # offline without the files, or a folder without benchmark/*.json
            raise InputError(f"--prompts {source}: {type(e).__name__}: {str(e)[:200]}; give hpdv2=FOLDER") from None
        per = len(prompts) // len(HPDV2_STYLES)
        styles = [HPDV2_STYLES[min(i // per, len(HPDV2_STYLES) - 1)] for i in range(len(prompts))]
    elif is_jsonl(source) and not isinstance((prompts := load_prompts(source))[0], EditPrompt):
        from common.geneval import geneval_metadata  # GenEval metadata (common.prompts checks each row)

        styles = [geneval_metadata(p)["tag"] for p in prompts]  # the style is the task
    else:  # a text file, an edit file (common.edits) or a ShapesBench split
        prompts = prompts if is_jsonl(source) else load_prompts(source, edits=edits)
        styles = [""] * len(prompts)
    if max_prompts > 0:
        keep = evenly_spaced(list(range(len(prompts))), max_prompts)
        prompts, styles = [prompts[i] for i in keep], [styles[i] for i in keep]
    return prompts, styles


LORA_FILE, PEFT_FILE = "pytorch_lora_weights.safetensors", "adapter_model.safetensors"
EXPECTED = (
    "expected a run folder (its final/), a final/ folder, a checkpoint (checkpoints/iter_N), a LoRA adapter folder "
    f"({LORA_FILE}, or peft's {PEFT_FILE} with adapter_config.json, as Flow-GRPO releases its LoRAs) or a "
    "transformer folder of this --model-id's transformer (config.json and its safetensors)"
)


def weights_kind(folder: Path) -> str | None:
    """What a --weights folder (a run folder's final/ already taken) holds: 'checkpoint' (model.safetensors, an
    accelerate checkpoint's trained tensors), 'lora' (diffusers' LoRA file), 'transformer' (transformer/ or a
    config.json), 'peft' (a peft adapter: adapter_model.safetensors, e.g. Flow-GRPO's released LoRAs), or None."""
    if (folder / "model.safetensors").is_file():
        return "checkpoint"
    if (folder / PEFT_FILE).is_file():
        return "peft"
    if (folder / LORA_FILE).is_file():
        return "lora"
    if (folder / "transformer").is_dir() or (folder / "config.json").is_file():
        return "transformer"
    return None


def weights_folder(spec: str) -> tuple[str, Path]:
    """--weights [NAME=]PATH -> (row name, the folder that holds the weights): a run folder gives its final/. Reads
    the file system only; check_weights compares the folder's contents with the model."""
    name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    given = Path(path).expanduser()
    need(given.is_dir(), f"--weights {spec}: {'not a folder' if given.exists() else 'no such folder'}; {EXPECTED}")
    folder = given / "final" if (given / "final").is_dir() else given
    kind = weights_kind(folder)
    if kind is None:
        unfinished = " (a run folder without a complete final/: give one of its checkpoints/iter_N)"
        raise InputError(
            f"--weights {spec}: {folder} holds no weights that this command reads"
            + (unfinished if (given / "checkpoints").is_dir() else "")
            + f"; {EXPECTED}"
        )
    if kind == "checkpoint":
        return name or f"{folder.parent.parent.name}/{folder.name}", folder
    return name or (folder.parent.name if folder.name == "final" else folder.name), folder


def _header(spec: str, path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file, from its header alone (which safetensors checks covers the file)."""
    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # missing, truncated, not safetensors
        raise InputError(f"--weights {spec}: {path} unreadable ({type(e).__name__}: {str(e)[:120]})") from None


def _read_json(spec: str, path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except Exception as e:
        raise InputError(f"--weights {spec}: {path} unreadable ({type(e).__name__}); {EXPECTED}") from None
    need(isinstance(data, dict), f"--weights {spec}: {path} is not a JSON object; {EXPECTED}")
    return data


def _differences(state: dict, own: dict, every) -> str:
    """'' when the tensors `state` ({name: shape}) are tensors of `own` with their shapes and include every name in
    `every`; else a short account of the first differences."""
    missing = sorted(set(every) - set(state))
    foreign = sorted(set(state) - set(own))
    shaped = sorted(k for k in set(state) & set(own) if tuple(state[k]) != tuple(own[k]))
    parts = []
    for names, what in ((missing, "missing"), (foreign, "unknown"), (shaped, "of other shapes")):
        if names:
            k = names[0]
            parts.append(f"{len(names)} {what}, e.g. {k}" + (f" {state[k]}, not {own[k]}" if names is shaped else ""))
    return "; ".join(parts)


def check_weights(model, spec: str, folder: Path) -> None:
    """Check that `folder` (weights_folder's) loads into model.transformer before anything is sampled: its configs
    and the headers of its safetensors files (names and shapes), never its tensors; model is left as it was. An
    InputError naming --weights and the folder otherwise."""
    from common.models.wan import WanExperts  # heavy (WanPipeline): imported once a model is loaded

    transformer = model.transformer
    cls = type(transformer).__name__
    own = {k: tuple(v.shape) for k, v in transformer.state_dict().items()}
    kind = weights_kind(folder)
    need(
        kind != "transformer" or not isinstance(transformer, WanExperts),
        f"--weights {spec}: full fine-tunes of Wan2.2-T2V-A14B's two experts are not read here (LoRA adapters are)",
    )
    if kind == "checkpoint":
        path = folder / "model.safetensors"
        state = {k.removeprefix("module."): s for k, s in _header(spec, path).items()}  # DDP's prefix
        if any(".lora_" in k for k in state):
            need(
                (folder / "adapter_config.json").is_file(),
                f"--weights {spec}: a LoRA checkpoint without adapter_config.json (written since 2026-12); give final/",
            )
            own = _with_adapter(spec, transformer, folder / "adapter_config.json")
            every = [k for k in own if ".lora_" in k]  # the adapter whole; the base comes from --model-id
        else:
            every = own  # a full fine-tune: every weight
        wrong = _differences(state, own, every)
        need(not wrong, f"--weights {spec}: {path} holds tensors that are not {cls}'s ({wrong}); another --model-id?")
    elif kind == "peft":
        need(
            (folder / "adapter_config.json").is_file() and not isinstance(transformer, WanExperts),
            f"--weights {spec}: a peft adapter needs its adapter_config.json beside {PEFT_FILE} (one adapter: not "
            "for Wan2.2-T2V-A14B's two experts)",
        )
        own = _with_adapter(spec, transformer, folder / "adapter_config.json")
        state = {peft_name(k): s for k, s in _header(spec, folder / PEFT_FILE).items()}
        wrong = _differences(state, own, [k for k in own if ".lora_" in k])
        need(not wrong, f"--weights {spec}: {folder / PEFT_FILE} is not a LoRA adapter of {cls} ({wrong})")
    elif kind == "lora":
        files = [(folder / LORA_FILE, transformer)]
        if isinstance(transformer, WanExperts):  # Wan2.2-T2V-A14B: one adapter file per expert
            files = [(folder / LORA_FILE, transformer.high), (folder / LOW_NOISE_LORA, transformer.low)]
        for path, module in files:
            wrong = _lora_differences(_header(spec, path), module)
            need(not wrong, f"--weights {spec}: {path} is not a LoRA adapter of {cls} ({wrong}); another --model-id?")
    else:
        source = folder / "transformer" if (folder / "transformer").is_dir() else folder
        need((source / "config.json").is_file(), f"--weights {spec}: {source} has no config.json; {EXPECTED}")
        config = _read_json(spec, source / "config.json")
        theirs = config.get("_class_name")
        need(
            theirs == cls,
            f"--weights {spec}: {source / 'config.json'} is "
            + (f"the config of {theirs}" if theirs else "no diffusers model's config")
            + f", not of {cls} (this --model-id's transformer); {EXPECTED}",
        )
        differ = [k for k, v in transformer.config.items() if not k.startswith("_") and k in config
                  and json.dumps(config[k], sort_keys=True, default=list) != json.dumps(v, sort_keys=True, default=list)]  # fmt: skip
        need(
            not differ,
            f"--weights {spec}: {source / 'config.json'} is another {cls} than this --model-id's ("
            + ", ".join(f"{k} {config[k]}, not {transformer.config[k]}" for k in differ[:3])
            + ")",
        )
        index = source / "diffusion_pytorch_model.safetensors.index.json"
        if (source / "diffusion_pytorch_model.safetensors").is_file():
            files = [source / "diffusion_pytorch_model.safetensors"]
        elif index.is_file():
            weight_map = _read_json(spec, index).get("weight_map")
            need(isinstance(weight_map, dict), f"--weights {spec}: {index} has no weight_map")
            files = [source / f for f in sorted(set(weight_map.values()))]
        else:
            raise InputError(f"--weights {spec}: {source} has no diffusion_pytorch_model.safetensors; {EXPECTED}")
        state = {k: s for f in files for k, s in _header(spec, f).items()}
        wrong = _differences(state, own, own)
        need(not wrong, f"--weights {spec}: {source}'s weights are not {cls}'s ({wrong})")


def _with_adapter(spec: str, transformer, config_path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of `transformer`'s state dict with the LoRA adapter of `config_path` added, computed on an empty
    (meta) copy, so that the model itself is not touched."""

    try:
        config = lora_config(_read_json(spec, config_path))
        with init_empty_weights():
            empty = type(transformer).from_config(transformer.config)
        empty.add_adapter(config)
    except InputError:
        raise
    except Exception as e:  # keys of another peft, targets the transformer lacks
        raise InputError(f"--weights {spec}: {config_path} does not fit {type(transformer).__name__} "
                         f"({type(e).__name__}: {str(e)[:160]})") from None  # fmt: skip
    return {k: tuple(v.shape) for k, v in empty.state_dict().items()}


def lora_config(data: dict):
    """peft's LoraConfig from an adapter_config.json: the fields this peft knows (one written by another peft
    version, as a released adapter's, may carry more, which change nothing here)."""
    import dataclasses

    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    return LoraConfig(**{k: v for k, v in data.items() if k in known and k not in ("peft_type", "task_type")})


def peft_name(key: str) -> str:
    """A peft adapter file's tensor name -> the transformer's, with the adapter added as diffusers adds it:
    base_model.model.X.lora_A.weight -> X.lora_A.default.weight."""
    key = key.removeprefix("base_model.model.")
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        key = key.replace(f".{part}.weight", f".{part}.default.weight").replace(
            f".{part}.bias", f".{part}.default.bias"
        )
    return key


def _lora_differences(state: dict, transformer) -> str:
    """'' when the tensors of a diffusers LoRA file ({name: shape}) all belong to modules of `transformer`
    ('transformer.<module>.lora_A.weight' ...) with their in / out sizes; else a short account of the first one."""
    modules = dict(transformer.named_modules())
    ranks, halves = {}, {}
    for key, shape in sorted(state.items()):
        inner = key.removeprefix("transformer.")
        module, sep, part = inner.rpartition(".lora_")  # the last: a module's own name may hold ".lora_"
        if inner == key or not sep or module not in modules:
            return f"{key} is no module of it"
        weight = getattr(modules[module], "weight", None)
        if part in ("A.weight", "B.weight"):
            side = 1 if part == "A.weight" else 0  # A: (rank, in, ...); B: (out, rank, ...)
            bad = weight is None or weight.ndim < 2 or len(shape) != weight.ndim  # as many dims as the module's weight
            if bad or shape[side] != weight.shape[side]:
                return f"{key}: {shape}, not for a {tuple(weight.shape) if weight is not None else 'weightless'} module"
            if ranks.setdefault(module, shape[1 - side]) != shape[1 - side]:
                return f"{module}: lora_A and lora_B of other ranks"
            halves.setdefault(module, set()).add(part[0])
    if lone := next((m for m, h in halves.items() if h != {"A", "B"}), None):  # a product needs both of its factors
        return f"{lone}: lora_{next(iter(halves[lone]))} without lora_{'B' if 'A' in halves[lone] else 'A'}"
    return "" if any(k.endswith(".lora_A.weight") for k in state) else "no lora_A tensors"


def load_weights(model, folder: Path) -> None:
    """Put the weights of `folder` (weights_folder's, passed by check_weights) into model.transformer: a LoRA adapter
    as diffusers' loader reads it, a peft adapter (its tensors renamed by peft_name, its config's scale lora_alpha / r
    kept), a checkpoint's trained tensors (LoRA: with its adapter_config.json; full
    fine-tuning: every weight), or a full transformer's state dict (into the loaded module, which keeps the model's
    processors)."""
    kind = weights_kind(folder)
    if kind in ("checkpoint", "peft"):
        if kind == "checkpoint":
            state = {k.removeprefix("module."): v for k, v in load_file(folder / "model.safetensors").items()}  # DDP
        else:
            state = {peft_name(k): v for k, v in load_file(folder / PEFT_FILE).items()}
        if any(".lora_" in k for k in state):
            model.transformer.add_adapter(lora_config(json.loads((folder / "adapter_config.json").read_text())))
        own = model.transformer.state_dict()
        model.transformer.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
    elif kind == "lora":
        model.transformer.load_lora_adapter(str(folder), prefix="transformer", use_safetensors=True)
    else:
        source = folder / "transformer" if (folder / "transformer").is_dir() else folder
        full = type(model.transformer).from_pretrained(source, torch_dtype=model.transformer.dtype)
        model.transformer.load_state_dict(full.state_dict())


# ---------------------------------------------------------------------------------------------------
# Scoring: batches sharded over processes, each cached
# ---------------------------------------------------------------------------------------------------
BATCH_FILE = "batch_{:05d}.pt"  # batch b of a model's cache: samples [b B, (b + 1) B)


def weights_files(folder: Path) -> list[Path]:
    """The files of a --weights folder (weights_folder's) that load_weights reads, in a fixed order."""
    kind = weights_kind(folder)
    if kind == "checkpoint":
        names = ["model.safetensors", "adapter_config.json"]
    elif kind == "peft":
        names = [PEFT_FILE, "adapter_config.json"]
    elif kind == "lora":
        names = [LORA_FILE, LOW_NOISE_LORA]
    else:
        source = folder / "transformer" if (folder / "transformer").is_dir() else folder
        index = source / "diffusion_pytorch_model.safetensors.index.json"
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
        except Exception:  # a malformed index: check_weights refuses it, naming it
            shards = []
        prefix = source.relative_to(folder)
        names = [str(prefix / n) for n in ("config.json", "diffusion_pytorch_model.safetensors", index.name, *shards)]
    return [folder / n for n in dict.fromkeys(names) if (folder / n).is_file()]


def weights_digest(spec: str, folder: Path) -> str:
    """SHA-256 of the contents of the files load_weights reads (names and bytes): weights replaced under the same
    path get another digest, so their old batches are never used. Read in 1 MB blocks (a 12B-parameter full
    fine-tune, 24 GB, takes about 20 s)."""
    digest = hashlib.sha256()
    for path in weights_files(folder):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        try:
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
        except OSError as e:
            raise InputError(f"--weights {spec}: {path} unreadable ({type(e).__name__}: {e})") from None
    return digest.hexdigest()


def cache_key(setting: dict, name: str, source: str | None) -> str:
    """The key of a model's cached batches: the settings that change a score (those of cache/settings.json, the
    prompts' digest among them), the row's name and its weights' digest (weights_digest)."""
    blob = json.dumps({"settings": setting, "model": name, "weights": source}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def record_digest(record: dict) -> str:
    """SHA-256 of a batch record without its "checksum": every value, a tensor's dtype, shape and bytes included.
    TypeError for what no batch record holds."""
    digest = hashlib.sha256()

    def feed(x) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().view(-1)
            digest.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            digest.update(f"D{len(x)}".encode())
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            digest.update(f"L{len(x)}".encode())
            for v in x:
                feed(v)
        elif x is None or isinstance(x, (str, int, float)):
            digest.update(f"S{json.dumps(x)}".encode())
        else:
            raise TypeError(f"a {type(x).__name__}")

    feed({k: v for k, v in record.items() if k != "checksum"})
    return digest.hexdigest()


def batch_problem(record, expect: dict) -> str:
    """'' when a loaded batch file's `record` is the batch `expect` describes ({batch, start, key, prompts, grid: how
    many grid samples, images: whether all images are kept}); else why it is not."""
    n = len(expect["prompts"])
    if not isinstance(record, dict):
        return f"holds a {type(record).__name__}, not a batch record"
    try:
        intact = record.get("checksum") == record_digest(record)
    except (TypeError, ValueError, RuntimeError) as e:  # what torch.load gives back but no batch record holds
        return f"holds what no batch record does ({type(e).__name__}: {str(e)[:80]})"
    if not intact:
        return "does not match its checksum (changed since it was written)"
    if record.get("key") != expect["key"]:
        return "is another evaluation's or another model's (its key differs)"
    if (record.get("batch"), record.get("start")) != (expect["batch"], expect["start"]):
        return f"holds batch {record.get('batch')}, not batch {expect['batch']}"
    if record.get("prompts") != expect["prompts"]:
        return "holds other prompts"
    scores, grid, images = record.get("scores"), record.get("grid"), record.get("images")

    def tensor(x, *shape):
        return isinstance(x, torch.Tensor) and x.is_floating_point() and tuple(x.shape[: len(shape)]) == shape

    if not (
        isinstance(scores, dict) and "total" in scores and all(tensor(v, n) and v.ndim == 1 for v in scores.values())
    ):
        return f"its scores are not {n} numbers per reward"
    if not all(bool(torch.isfinite(v).all()) for v in scores.values()):
        return "holds a score that is not a finite number"
    if not (tensor(grid, expect["grid"]) and grid.ndim in (4, 5)):
        return f"its grid images are not {expect['grid']} images"
    if expect["images"] and not (tensor(images, n) and images.shape[1:] == grid.shape[1:]):
        return f"its images are not {n} images"
    if not expect["images"] and not (isinstance(images, torch.Tensor) and images.numel() == 0):
        return "holds images it should not"
    return ""


def load_batch(path: Path, expect: dict) -> tuple[dict | None, str]:
    """(the record of a batch file, '') or (None, why it may not be used). Tensors and plain types only."""
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, empty, not a torch file, pickled objects
        return None, f"unreadable ({type(e).__name__})"
    problem = batch_problem(record, expect)
    return (None, problem) if problem else (record, "")


def save_atomically(obj, path: Path, within: Path | None = None, writer: str = "the cache") -> None:
    """torch.save (dict: JSON) through the project's atomic writer (common.write_atomically): a crash never leaves a
    partial file under `path`, a failed write (a full disk: torch.save's RuntimeError too) is one RunError line and
    leaves no temporary file, and what is in the way (a folder, a symbolic link at `path` or below `within`, a file
    where a folder goes) is an InputError naming --out."""
    if path.suffix == ".json":
        data = json.dumps(obj, indent=1)
    else:
        data = lambda tmp: torch.save(obj, tmp)  # noqa: E731
    write_atomically(path, data, "--out", writer, within)


def check_row_name(name: str, spec: str) -> None:
    """A row's name names its cache folder (cache/NAME, a checkpoint's RUN/iter_N): relative parts that are each a
    name, so that the cache stays inside --out."""
    parts = name.split("/")
    ok = all(p not in ("", ".", "..") and "\\" not in p and "\0" not in p for p in parts)
    need(ok, f"--weights {spec}: the row name {json.dumps(name)} is not a name (no empty part, no . or .., no \\); "
         "give NAME=PATH")  # fmt: skip


def score_model(args, model, reward_fn, prompts, accelerator, cache: Path, grid: list[int], keep_images: bool,
                key: str) -> list:  # fmt: skip
    """Per batch of this process (batch b of [b B, (b + 1) B), process b mod world): {batch, start, key, prompts,
    scores: name -> (n,), images of the grid's samples, all images on ShapesBench}. A batch file in `cache` is used
    only if it loads and is this batch (load_batch); else the batch is computed again, and a line says so."""
    n, B = len(prompts), args.batch_size
    noise = fixed_noise(args.seed, "eval", model.latent_shape(), 0, n)  # sample j's noise, as the Evaluator's
    model.guidance_scale_2 = args.guidance_scale_2  # A14B's low-noise expert (refused at start-up on other models)
    sampler = ode_sampler(
        model, model.transformer, schedule(model, args.num_steps, args.shift), args.guidance_scale, accelerator.autocast
    )
    mine = list(range(0, n, B))[accelerator.process_index :: accelerator.num_processes]
    out = []
    for start in tqdm(mine, desc=cache.name, disable=not accelerator.is_local_main_process):
        sl = slice(start, min(start + B, n))
        shown = [j - start for j in range(sl.start, sl.stop) if j in grid]
        path = cache / BATCH_FILE.format(start // B)
        expect = dict(batch=start // B, start=start, key=key, prompts=prompts[sl], grid=len(shown), images=keep_images)
        if path.exists() or path.is_symlink():
            need(path.is_file(), f"--out: {path} is not a file, where the cache keeps a batch; remove it, or give "
                 "another --out")  # fmt: skip
            record, problem = load_batch(path, expect)
            if record is not None:
                out.append(record)
                continue
            tqdm.write(f"cache: {path} {problem}, computed again")
        with torch.no_grad():
            images = sample_prompts(sampler, model, prompts[sl], noise[sl], B).float()
            total, parts = reward_fn(images, prompts[sl])
        record = {
            "batch": start // B,
            "start": start,
            "key": key,
            "prompts": prompts[sl],
            "scores": {"total": total.cpu(), **{k: v.float().cpu() for k, v in parts.items()}},
            "grid": images[shown].cpu(),
            "images": images.cpu() if keep_images else torch.zeros(0),
        }
        record["checksum"] = record_digest(record)  # checked before the record is used again (batch_problem)
        save_atomically(record, path, within=cache.parent.parent)
        out.append(record)
    return out


def geneval_table(per_prompt: dict, styles: list[str]) -> tuple[dict, list[str]]:
    """GenEval's summary (its `summary_scores.py`) from each model's per-prompt geneval_accuracy: per task the share
    of correct images, the overall score (the plain mean of the tasks', GenEval's), and the share of correct images
    over all (the mean Flow-GRPO reports, tasks weighted by their number of prompts). Trained rows add the paired
    difference from the base and its standard error (overall: the tasks' errors combined, sqrt(sum se_t^2) / T).
    -> (figures per model, the table's lines)."""
    from common.geneval import TAGS

    tags = [t for t in TAGS if t in styles]
    rows = {t: torch.tensor([s == t for s in styles]) for t in tags}
    figures, lines = {}, ["", "GenEval: correct images per task (the official evaluator's rule), overall = the tasks' "
                          "mean; trained - base +- paired standard error:", "",
                          "| model | " + " | ".join(tags) + " | overall | all images |", "|---" * (len(tags) + 3) + "|"]  # fmt: skip
    for m, figs in per_prompt.items():
        acc = figs["geneval_accuracy"]
        task = {t: acc[rows[t]].mean().item() for t in tags}
        figures[m] = {**task, "overall": sum(task.values()) / len(tags), "all_images": acc.mean().item()}
        cells = [f"{figures[m][k]:.4f}" for k in [*tags, "overall", "all_images"]]
        if m != "base":
            diff = acc - per_prompt["base"]["geneval_accuracy"]
            deltas = {t: paired(diff[rows[t]]) for t in tags}
            deltas["overall"] = (
                sum(d for d, _ in deltas.values()) / len(tags),
                math.sqrt(sum(se**2 for _, se in deltas.values())) / len(tags),
            )
            deltas["all_images"] = paired(diff)
            figures[m]["deltas"] = deltas
            cells = [
                f"{c} ({deltas[k][0]:+.4f} +- {deltas[k][1]:.4f})"
                for c, k in zip(cells, [*tags, "overall", "all_images"])
            ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return figures, lines


def paired(diff: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error of per-prompt differences (P,)."""
    se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    return diff.mean().item(), se


AGAIN = "the evaluation stops here, the batches scored so far cached under --out: the same command, run again, goes on"


@contextlib.contextmanager
def stops_as_an_evaluation():
    """A RunError of the rewards (a served reward that fails, a non-finite score) told as this command's: it takes no
    --resume-from, and its cache keeps every batch already scored."""
    try:
        yield
    except RunError as e:
        raise RunError(str(e).replace(RESUME, AGAIN).replace(STOPS, AGAIN)) from None


def main(args: EvalArgs) -> None:
    from common.models import load_model  # here, not at the top: tests patch common.models.load_model

    # ---------------------------------------------------------------- inputs, checked before anything loads
    check_flags(args, [])  # every number finite and within the range declared beside it (EvalArgs)
    kind = check_model_id(args.model_id)
    need(kind != "sd1", f"--model-id {args.model_id}: SD1.x (DDIM) is not evaluated here; flow models only")
    args.shift = default_shift(kind) if args.shift is None else args.shift
    check_shift(args.shift, kind)
    check_guidance_scale_2(args, is_video(kind) and has_two_experts(args.model_id))
    reward_spec = parse_rewards(args.reward, args.reward_ckpt, args.reward_url)  # parsed once
    shapes_only = [c.name for c in reward_spec.components if c.kind.shapesbench]
    shapes_only += ["--prompts " + args.prompts] if args.prompts.startswith("shapes-") else []
    need(
        kind in ("shapes", "shapes-edit") or not shapes_only,
        f"--model-id {args.model_id}: {', '.join(shapes_only)} belong to ShapesBench; give --reward (e.g. "
        "hpsv2.1,pickscore,imagereward) and --prompts (hpdv2 or a file)",
    )
    prompt_list, styles = load_prompt_set(args.prompts, args.max_prompts, edits=kind == "shapes-edit")
    check_edit_prompts(prompt_list, registered(kind).images, "--prompts", args.model_id)
    check_reward_prompts(reward_spec, prompt_list, "--prompts")
    if kind in ("shapes", "shapes-edit"):  # the report's verifier figures and the grid's badges read every prompt
        check_shapesbench_prompts(prompt_list, "--prompts")
    models = [("base", None)] + [weights_folder(w) for w in args.weights]
    for spec, (name, _) in zip(args.weights, models[1:]):
        check_row_name(name, spec)
    need(len({m for m, _ in models}) == len(models), "--weights: two rows with one name; give NAME=PATH")
    with stops_as_an_evaluation():
        check_rewards(reward_spec, video=is_video(kind))
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    accelerator.print(set_attention_backend(args.attention_backend, accelerator.device))
    device, out = accelerator.device, Path(args.out)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        args.mixed_precision, torch.float32
    )  # as training's base
    S = args.samples_per_prompt
    prompts = [p for p in prompt_list for _ in range(S)]  # sample j: prompt j // S, noise keyed on j
    grid = [i * S for i in evenly_spaced(list(range(len(prompt_list))), args.grid_prompts)]  # their first samples
    setting = dict(model_id=args.model_id, prompts=args.prompts, n_prompts=len(prompt_list), samples_per_prompt=S,
                   num_steps=args.num_steps, shift=args.shift, guidance_scale=args.guidance_scale,
                   resolution=args.resolution, num_frames=args.num_frames, mixed_precision=args.mixed_precision,
                   seed=args.seed, batch_size=args.batch_size, reward=args.reward,
                   reward_checkpoints={c.name: c.url or c.path for c in reward_spec.components if c.url or c.path},
                   grid_prompts=args.grid_prompts,
                   prompts_digest=hashlib.sha256(json.dumps([prompt_list, styles]).encode()).hexdigest())  # fmt: skip
    setting |= {} if args.guidance_scale_2 is None else {"guidance_scale_2": args.guidance_scale_2}  # (older caches)
    # the cache holds the batches of one setting, each model's under its row name: a name may not change its weights
    # (their contents: weights replaced under the same path are other weights)
    sources = {"base": None} | {n: weights_digest(w, f) for w, (n, f) in zip(args.weights, models[1:])}
    saved = out / "cache" / "settings.json"
    cached = {"settings": setting, "weights": sources}
    if saved.is_file():
        try:
            cached = json.loads(saved.read_text())
            ok = isinstance(cached, dict) and isinstance(cached.get("weights"), dict)
            why = "" if ok else "not a settings record"
        except Exception as e:  # written whole (save_atomically), so changed by hand
            why = f"unreadable ({type(e).__name__})"
        need(not why, f"--out {out}: {saved} {why}; give another --out, or delete the file (each cached batch is "
             "checked on its own)")  # fmt: skip
    moved = [m for m, src in sources.items() if cached["weights"].get(m, src) != src]
    theirs = cached.get("settings") if isinstance(cached.get("settings"), dict) else {}
    differ = [k for k in sorted(setting.keys() | theirs.keys()) if theirs.get(k, "?") != setting.get(k, "?")]
    need(
        not differ and not moved,
        f"--out {out}: its cache holds another evaluation's batches (another {', '.join(differ + moved)}: "
        + ("the prompts' contents differ, " if "prompts_digest" in differ else "")
        + ("the weights' contents differ, " if moved else "")
        + "so none is used); give another --out",
    )

    # ---------------------------------------------------------------- every --weights checked before any sampling
    base = load_model(args.model_id, device, dtype, args.resolution, args.num_frames)
    for spec, (_, folder) in zip(args.weights, models[1:]):
        check_weights(base, spec, folder)
    accelerator.wait_for_everyone()  # every process has read settings.json before the main one writes it
    if accelerator.is_main_process:
        save_atomically({"settings": setting, "weights": cached["weights"] | sources}, saved, within=out)

    # ---------------------------------------------------------------- each model in turn, sharded over processes
    records = {}
    with stops_as_an_evaluation():  # a served reward's failure
        reward_fn = build_reward(reward_spec, device)
        for name, folder in models:
            model = (
                base if folder is None else load_model(args.model_id, device, dtype, args.resolution, args.num_frames)
            )
            base = None  # loaded once, for the first row
            if folder is not None:
                load_weights(model, folder)
            model.transformer.eval()
            key = cache_key(setting, name, sources[name])
            mine = score_model(args, model, reward_fn, prompts, accelerator, out / "cache" / name, grid,
                               model.kind in ("shapes", "shapes-edit"), key)  # fmt: skip
            records[name] = sorted(gather_object(mine), key=lambda r: r["start"])  # every process's batches
            del model
    if accelerator.is_main_process:
        report(args, setting, records, prompt_list, styles, prompts, grid, out, reward_spec.path("shapes"))
    accelerator.wait_for_everyone()


def report(args, setting, records, prompt_list, styles, prompts, grid, out: Path, shapes_ckpt=None) -> None:
    """results.md, results.json, scores.jsonl and grid.png from every model's batch records; `shapes_ckpt`: the
    learned ShapesBench reward of the verifier's figures (None: the shipped one)."""
    S, names = args.samples_per_prompt, list(records)
    scores = {m: {k: torch.cat([r["scores"][k] for r in rs]) for k in rs[0]["scores"]} for m, rs in records.items()}
    rewards = [k for k in scores["base"] if not k.endswith("_unparsed")]
    rewards = rewards[1:] if len(rewards) == 2 else rewards  # one reward: its total is itself
    per_prompt = {m: {k: v.view(-1, S).mean(1) for k, v in s.items()} for m, s in scores.items()}  # (P,) each
    # the training scripts' evaluation names, without eval/: reward (the weighted total), reward_<name>, ...
    figures = {
        m: {("reward" if k == "total" else f"reward_{k}"): v.mean().item() for k, v in s.items()}
        for m, s in scores.items()
    }
    if records["base"][0]["images"].numel():  # ShapesBench: the verifier's accuracies and diversity, as at training
        shapes_reward = shapesbench.load_reward_model(shapes_ckpt)
        edits = isinstance(prompts[0], EditPrompt)  # ShapesBench-Edit: the edit verifier's, and the targets' reward
        sources, texts = (source_images(prompts), [p.text for p in prompts]) if edits else (None, None)
        for m, rs in records.items():
            images = torch.cat([r["images"] for r in rs])
            if edits:
                found = edit_metrics(images, sources, texts)
                figures[m].update({k: v for k, v in found.items() if isinstance(v, float)})
                figures[m]["reward_mean"] = edit_learned_reward(shapes_reward, images, sources, texts).mean().item()
            else:
                figures[m].update(shapesbench.evaluate(images, prompts, shapes_reward))
    deltas = {}
    for m in names[1:]:
        deltas[m] = {k: paired(per_prompt[m][k] - per_prompt["base"][k]) for k in rewards}
        for style in sorted(set(styles) - {""}):
            rows = torch.tensor([s == style for s in styles])
            deltas[m].update(
                {f"{k}/{style}": paired((per_prompt[m][k] - per_prompt["base"][k])[rows]) for k in rewards}
            )
    geneval_lines = []
    if "geneval_accuracy" in rewards and any(styles):  # a GenEval set: its summary table
        geneval, geneval_lines = geneval_table(per_prompt, styles)
        for m in names:
            figures[m]["geneval"] = geneval[m]
    # every report file is checked before any is written: a folder or a link in the way of the last one must not
    # leave the first ones of this evaluation beside the others' of an earlier one
    for name in ("results.json", "scores.jsonl", "results.md", "grid.png"):
        if why := in_the_way(out / name, out):
            raise InputError(f"--out: {why}, where the report writes {name}; remove it, or give another --out")
    report_file = lambda name, data: write_atomically(out / name, data, "--out", "the report", out)  # noqa: E731
    report_file("results.json", json.dumps({"settings": setting, "models": {m: str(f) for m, f in zip(names, [None, *args.weights])},
                                            "figures": figures, "deltas": deltas}, indent=1))  # fmt: skip
    rows = []
    for i, p in enumerate(prompt_list):
        row = {"prompt": p, "style": styles[i]}
        row |= {m: {k: round(v[i].item(), 6) for k, v in per_prompt[m].items()} for m in names}
        rows.append(json.dumps(row) + "\n")
    report_file("scores.jsonl", "".join(rows))
    lines = [f"{len(prompt_list)} prompts x {S} samples, {args.num_steps}-step Euler ODE (shift {args.shift}), "
             f"guidance {args.guidance_scale}, seed {args.seed}; mean per model, trained - base +- paired standard "
             "error over prompts", "", "| model | " + " | ".join(rewards) + " |", "|---" * (len(rewards) + 1) + "|"]  # fmt: skip
    for m in names:
        cells = [f"{figures[m]['reward' if k == 'total' else f'reward_{k}']:.4f}" + ("" if m == "base" else f" ({deltas[m][k][0]:+.4f} +- {deltas[m][k][1]:.4f})")
                 for k in rewards]  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    shapes_keys = [
        k for k in ("shape_acc", "all_acc", "clean_acc", "diversity", "diversity_kept") if k in figures["base"]
    ]
    if shapes_keys:
        lines += ["", "| model | " + " | ".join(shapes_keys) + " |", "|---" * (len(shapes_keys) + 1) + "|"]
        lines += [f"| {m} | " + " | ".join(f"{figures[m][k]:.3f}" for k in shapes_keys) + " |" for m in names]
    lines += geneval_lines
    styled = sorted(set(styles) - {""})
    if styled and len(names) > 1:
        lines += ["", "per style, trained - base +- paired standard error:", "",
                  "| model | reward | " + " | ".join(styled) + " |", "|---" * (len(styled) + 2) + "|"]  # fmt: skip
        lines += [f"| {m} | {k} | " + " | ".join(f"{deltas[m][f'{k}/{s}'][0]:+.4f} +- {deltas[m][f'{k}/{s}'][1]:.4f}" for s in styled) + " |"
                  for m in names[1:] for k in rewards]  # fmt: skip
    report_file("results.md", "\n".join(lines) + "\n")
    images = torch.cat([torch.cat([r["grid"] for r in records[m]]) for m in names])  # a row per model
    images = images[:, images.shape[1] // 2] if images.ndim == 5 else images  # videos: the middle frame
    captions = [f"{m}\n{prompts[j]}" for m in names for j in grid]
    title = "first sample of evenly spaced prompts, the same noise in a column; a row per model"
    ok = None
    shown = [prompts[j] for _ in names for j in grid]
    if records["base"][0]["images"].numel() and isinstance(prompts[0], EditPrompt):  # the edit verifier's verdict
        ok = edit_metrics(images, source_images(shown), [p.text for p in shown])["edit"].tolist()
        title += "; badge: the edit verifier's verdict (the change asked, the rest kept)"
    elif records["base"][0]["images"].numel():  # ShapesBench: the verifier's verdict under each image
        ok = shapesbench.verify(images, shown)["all"].tolist()
        title += "; badge: the verifier's verdict"
    save_grid(out / "grid.png", images, captions, ok, ncol=len(grid), title=title, flag="--out", within=out)
    print("\n".join(lines))
    print(f"written: {out / 'results.md'}, results.json, scores.jsonl, grid.png")


if __name__ == "__main__":
    from common.flags import cli

    cli(main, EvalArgs)
