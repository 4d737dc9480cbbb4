"""The model a run trains: the described Llama's shape, or a model.factory module, built from the run's seed."""

from dataclasses import replace

import torch

from fp8stack.config import ConfigError, JobConfig
from fp8stack.config.job import MEGATRON_MOE_MODELS
from fp8stack.models import Llama, LlamaConfig, load_model_config
from fp8stack.train import user_code


def model_config(cfg: JobConfig) -> LlamaConfig:
    """The model's shape: model.name with the configuration's projections, sequence length and MoE bias rate."""
    config = replace(load_model_config(cfg.model.name), fused_projections=cfg.model.fused_projections)
    if cfg.model.expert_bias_rate is not None:
        if config.moe is None:
            raise ConfigError(f"model.expert_bias_rate balances the experts of an MoE model, and {cfg.model.name} is "
                              "dense: drop --model.expert-bias-rate or pick an MoE model "
                              f"({', '.join(MEGATRON_MOE_MODELS)})")
        config = replace(config, moe=replace(config.moe, bias_update_rate=cfg.model.expert_bias_rate))
    return replace(config, seq_len=cfg.training.seq_len) if cfg.training.seq_len is not None else config


def model_shape(cfg: JobConfig) -> LlamaConfig | None:
    """model_config, or None for a model.factory model (its shape is the built module's)."""
    return None if cfg.model.factory else model_config(cfg)


def build_model(cfg: JobConfig, device: torch.device) -> torch.nn.Module:
    """The model initialised from training.seed directly on `device`: the described Llama, or the one
    model.factory returns."""
    if cfg.model.factory:
        factory = user_code.load_factory(cfg.model.factory, user_code.MODEL_FACTORY_FLAG)
        return user_code.build_model(factory, seed=cfg.training.seed, device=device)
    with torch.device(device):
        model = Llama(model_config(cfg))
    model.init_weights(seed=cfg.training.seed)
    return model
