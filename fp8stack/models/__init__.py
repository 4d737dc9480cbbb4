"""Small, readable plain-torch models: a Llama-style decoder and a grouped-experts MoE."""

from fp8stack.models.llama import Attention, Llama, LlamaConfig, TransformerBlock
from fp8stack.models.moe import FeedForward, GroupedExperts, MoE, MoEConfig, Router

__all__ = ["Attention", "FeedForward", "GroupedExperts", "Llama", "LlamaConfig", "MoE", "MoEConfig", "Router",
           "TransformerBlock"]
