"""What a run checks before any model is built or any step taken, so a mistake costs no compute and
loses nothing: output folders writable, settings that fit the model's shape, enough text for the
sequence length, and a resume checkpoint saved under the same settings (checkpoint.check_run).
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from fp8stack.models import Llama, LlamaConfig
from fp8stack.plan import Plan
from fp8stack.plan.policy import check_layers_kept_bf16
from fp8stack.plan.recipes import fp8_attention_head_dim_problem
from fp8stack.runtime.recompute import recompute_regions
from fp8stack.train import checkpoint
from fp8stack.config import ConfigError, JobConfig, recompute_blocks
from fp8stack.train.data import load_split
from fp8stack.train.defaults import parameter_count

RUN_SETTINGS = ("model.name", "model.impl", "model.factory", "model.fused_projections", "precision.recipe",
                "precision.fp8_format", "precision.backend", "training.param_dtype", "parallelism.tensor_parallel",
                "parallelism.expert_parallel", "training.micro_batch", "training.global_batch", "training.seed",
                "data.source", "data.max_bytes", "data.factory")
"""Fields a resumed run must share with the run that saved the checkpoint (with the sequence length, the number of
processes and the plan)."""


def preflight(cfg: JobConfig, model: LlamaConfig | None) -> Path | None:
    """Check cfg against the outputs, the model's shape and the data; returns the checkpoint to resume from
    (its settings checked against cfg's, its files read), or None. Raises ConfigError or
    checkpoint.CheckpointError."""
    for path, option in ((cfg.logging.dir, "logging.dir (--tensorboard-dir)"), (cfg.checkpoint.dir, "checkpoint.dir (--save)")):
        if path:
            check_output_dir(path, option)
    if cfg.checkpoint.dir and model is not None:
        check_checkpoint_space(cfg.checkpoint.dir, "checkpoint.dir (--save)", cfg, model)
    if cfg.logging.dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"logging.dir {cfg.logging.dir!r} (--tensorboard-dir) writes TensorBoard scalars and "
                          "tensorboard is not installed: pip install 'fp8stack[tb]'")
    if model is not None:  # a factory model's shape is known once it is built
        _check_fits_model(cfg, model)
    if not cfg.data.factory:
        _check_data(cfg, cfg.training.seq_len or model.seq_len)
    if not cfg.checkpoint.resume:
        return None
    path = resume_path(cfg)
    checkpoint.check_run(path, run_settings(cfg, model, int(os.environ.get("WORLD_SIZE", "1"))),
                         cfg.checkpoint.resume_despite_changes)
    _check_moments(path, cfg.optimizer.moments)
    checkpoint.check_files(path)
    return path


def _check_moments(path: Path, moments: str) -> None:
    """A checkpoint resumes with the Adam moments it holds (optimizer.moments in its run.json's config; fp32 before
    the field existed), even with resume_despite_changes: torch's AdamW and TE's FusedAdam lay their states out
    differently (a step per parameter, or per group), so neither loads the other's."""
    saved = checkpoint.saved_run(path)
    config = saved.get("config") if saved else None
    optimizer = config.get("optimizer") if isinstance(config, dict) else None
    if not isinstance(optimizer, dict):  # no record of the run's configuration: the tensors' keys will tell
        return
    saved_moments = optimizer.get("moments", "fp32")
    if saved_moments != moments:
        raise checkpoint.CheckpointMismatchError(
            f"{path} holds {str(saved_moments).upper()} Adam moments and this run keeps {moments.upper()} ones "
            f"(optimizer.moments): resume with --optimizer.moments {saved_moments}; the two optimizers' states do not "
            "convert into each other")


def check_output_dir(path: str | Path, option: str) -> None:
    """Refuse (ConfigError) a folder that is a file, or cannot be created or written in; creates nothing."""
    target = Path(path)
    existing = _nearest_existing(target)
    if existing == target and not target.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a folder: pass a folder")
    if not existing.is_dir():
        raise ConfigError(f"{option} {path} cannot be created: {existing} is a file: pass a path under a folder")
    _probe_write(existing, option, path)


CHECKPOINT_BYTES_PER_PARAMETER = {"fp32": 12, "bf16": 8}
"""Bytes a checkpoint takes per parameter by optimizer.moments: FP32 weights (the masters where the model holds BF16
or FP8 copies, which are not saved) and Adam's two moments."""


def checkpoint_bytes(cfg: JobConfig, model: LlamaConfig) -> int:
    """About how many bytes one checkpoint of this run writes (all ranks together)."""
    return parameter_count(model) * CHECKPOINT_BYTES_PER_PARAMETER[cfg.optimizer.moments]


def check_checkpoint_space(path: str | Path, option: str, cfg: JobConfig, model: LlamaConfig, copies: int = 1) -> None:
    """Refuse (ConfigError) a checkpoint folder whose disk has no room for `copies` checkpoints written at once: the
    save would fail after the steps it was to keep."""
    need = copies * checkpoint_bytes(cfg, model)
    free = shutil.disk_usage(_nearest_existing(Path(path))).free
    if free < need:
        what = f"{copies} checkpoints at once" if copies > 1 else "a checkpoint"
        raise ConfigError(f"{option} {path}: {free / 2**30:.1f} GiB free on its disk, and {what} of "
                          f"{cfg.model.name} take about {need / 2**30:.1f} GiB (FP32 weights and Adam moments): "
                          "free space there or pass a folder on a larger disk")


def check_output_file(path: str | Path, option: str) -> None:
    """Refuse (ConfigError) a file path that is a folder, or whose folder cannot be created or written in."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path} is a folder: pass a file path")
    check_output_dir(target.parent, f"{option} {path}: its folder")


def run_settings(cfg: JobConfig, model: LlamaConfig | None, world_size: int) -> dict:
    """What a checkpoint's run.json records of cfg for a resume to match (without the plan)."""
    seq_len = cfg.training.seq_len or model.seq_len
    return {**{name: _field(cfg, name) for name in RUN_SETTINGS}, "seq_len": seq_len, "world_size": world_size}


def _field(cfg: JobConfig, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def plan_settings(plan: Plan) -> dict:
    """The plan's decisions as run.json records them: fqn -> 'backend recipe', and its FP8 format."""
    return {"plan": {d.fqn: f"{d.backend} {d.recipe}" for d in plan.decisions}, "plan_fp8_format": plan.fp8_format}


def resume_path(cfg: JobConfig) -> Path:
    """cfg.checkpoint.resume as a checkpoint folder: 'latest' under checkpoint_dir, the newest step-* inside a
    folder of checkpoints, or the folder itself."""
    folder = Path(cfg.checkpoint.dir if cfg.checkpoint.resume == "latest" else cfg.checkpoint.resume)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint {folder} does not exist: point --load at a step-* folder or a "
                          "folder of them")
    found = checkpoint.latest(folder)
    if found is None and cfg.checkpoint.resume == "latest":
        raise ConfigError(f"no step-* checkpoint under {folder} to resume from: drop the resume option")
    return found or folder


def _check_fits_model(cfg: JobConfig, model: LlamaConfig) -> None:
    """Settings that name layers, blocks or parts the model lacks, or a sequence tensor parallelism cannot split."""
    if model.seq_len % cfg.parallelism.tensor_parallel:
        raise ConfigError(f"seq_len={model.seq_len} is not divisible by tensor_parallel={cfg.parallelism.tensor_parallel} "
                          "(sequence parallelism splits it): pass a --seq-length that is a multiple of it")
    if cfg.precision.fp8_attention and (head_dim_problem := fp8_attention_head_dim_problem(model.head_dim,
                                                                                         cfg.precision.arch)):
        raise ConfigError(f"{head_dim_problem}: drop --fp8-dot-product-attention for {cfg.model.name}")
    if cfg.precision.first_last_layers_bf16:
        try:
            check_layers_kept_bf16(model.n_layers, cfg.precision.num_layers_at_start_in_bf16, cfg.precision.num_layers_at_end_in_bf16,
                                   cfg.precision.recipe)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    blocks = recompute_blocks(cfg.activation_checkpoint.layers)
    if blocks is None:
        return
    chosen = range(model.n_layers) if blocks == "all" else blocks
    outside = [i for i in chosen if not 0 <= i < model.n_layers]
    if outside:
        raise ConfigError(f"recompute names block(s) {', '.join(map(str, outside))}, and {cfg.model.name} has blocks "
                          f"0-{model.n_layers - 1}: pass indices of existing blocks or 'all'")
    with torch.device("meta"):  # the model's structure without memory or compute
        layers = Llama(model).layers
    found = [recompute_regions(layers[i], cfg.activation_checkpoint.modules) for i in chosen]
    absent = [name for name in cfg.activation_checkpoint.modules if not any(regions[name] for regions in found)]
    if absent:
        raise ConfigError(f"recompute_modules {', '.join(absent)}: none of the recomputed blocks of {cfg.model.name} "
                          "has that part (e.g. moe in a dense block): drop the name or pick other blocks")


def _check_data(cfg: JobConfig, seq_len: int) -> None:
    """Each split the run reads holds more than one sequence of text."""
    for split in ("train", "validation") if cfg.training.eval_batches else ("train",):
        try:
            size = load_split(split, cfg.data.max_bytes, source=cfg.data.source).numel()
        except RuntimeError as err:  # no text at all for the split
            raise ConfigError(str(err)) from None
        if size <= seq_len + 1:
            raise ConfigError(f"the {split} split of the first {cfg.data.max_bytes} bytes of text holds {size} "
                              f"bytes, too few for seq_len={seq_len}: raise --max-data-bytes or lower "
                              "--seq-length")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return candidate
        except OSError:  # unreadable on the way: probing the write below reports it
            return candidate
    return Path.cwd()


def _probe_write(folder: Path, option: str, path: str | Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot write in {folder} ({err.strerror or err}): pass a writable "
                          "folder") from None
