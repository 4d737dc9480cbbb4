"""Batch defaults per model size, for the fields a JobConfig leaves None (the learning rate's are the model's:
fp8stack.models.training_defaults), and the Adam hyperparameters the trainer's optimizers share."""

from fp8stack.models import LlamaConfig

LARGE_MODEL_PARAMS = 100e6
"""Above this many parameters a model trains in micro-batches of 2 with 8 of them per step (16 sequences on one
GPU: measured fastest for llama-1b-like on one H200); below it in one micro-batch of 8 sequences."""
ACCUMULATED_MICRO_BATCHES = 8
"""Micro-batches per optimizer step and data-parallel rank of a large model."""
ADAM_BETAS = (0.9, 0.95)
"""Adam's moment decays, for the trainer's AdamW and megatron's distributed optimizer alike (Llama's)."""
ADAM_EPS = 1e-8
"""Adam's epsilon, for both optimizers."""


def batch_defaults(shape: LlamaConfig | None, dp_size: int) -> tuple[int, int | None]:
    """(micro_batch, global_batch) for a model of `shape` on `dp_size` data-parallel ranks (shape None: a user's own
    model, taken as small); global_batch None is one micro-batch per step."""
    if shape is None or parameter_count(shape) <= LARGE_MODEL_PARAMS:
        return 8, None
    return 2, 2 * ACCUMULATED_MICRO_BATCHES * dp_size


def parameter_count(shape: LlamaConfig) -> int:
    """Parameters of a Llama of this shape (embedding and untied head included; MoE layers count every expert)."""
    kv = shape.n_kv_heads * shape.head_dim
    attention = shape.dim * (2 * shape.dim + 2 * kv)
    dense_mlp = 3 * shape.dim * shape.ffn_dim
    per_layer = []
    for layer in range(shape.n_layers):
        if shape.is_moe_layer(layer):
            moe = shape.moe
            mlp = 3 * shape.dim * (moe.expert_ffn_dim * moe.num_experts + moe.shared_ffn_dim) + shape.dim * moe.num_experts
        else:
            mlp = dense_mlp
        per_layer.append(attention + mlp + 2 * shape.dim)
    return sum(per_layer) + 2 * shape.vocab_size * shape.dim + shape.dim
