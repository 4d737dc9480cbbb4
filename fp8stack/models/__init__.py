"""Small, readable plain-torch models: a Llama-style decoder and a grouped-experts MoE, built from a model
description (configs/models/*.yaml) or a LlamaConfig."""

from fp8stack.models.from_description import ModelBuildError, load_model_config, model_config_from_description
from fp8stack.models.llama import Attention, Llama, LlamaConfig, TransformerBlock
from fp8stack.models.moe import (FeedForward, GroupedExperts, MoE, MoEConfig, Router, RouterLoad,
                                 register_expert_bias_update, router_statistics, update_expert_bias)

__all__ = ["Attention", "FeedForward", "GroupedExperts", "Llama", "LlamaConfig", "MoE", "MoEConfig", "ModelBuildError",
           "Router", "RouterLoad", "TransformerBlock", "load_model_config", "model_config_from_description",
           "register_expert_bias_update", "router_statistics", "update_expert_bias"]
