"""A ModelDescription from a megatron-core TransformerConfig (or MLATransformerConfig) for a GPTModel.

Reads the config by attribute only, so this module imports without megatron; unset sizes take the
defaults TransformerConfig.__post_init__ gives them. Names are GPTModel's module paths under the local
spec (get_gpt_layer_local_spec), except that routed experts are one component per GEMM,
`mlp.experts.linear_fc1` / `linear_fc2`, as TE's grouped experts name them (the local SequentialMLP
holds `mlp.experts.local_experts.{j}.linear_fc1`). Under the TE spec the norms before linear_qkv and
linear_fc1 of dense layers (and the MLA q/kv norms) are fused into those linears; they stay listed
here as norms.
"""

from dataclasses import replace
from itertools import groupby

from fp8stack.plan.description import ModelDescription, description_from_dict
from fp8stack.plan.errors import PlanError

UNSUPPORTED = {
    "mtp_num_layers": "multi-token-prediction layers",
    "experimental_attention_variant": "experimental attention variants (gated_delta_net, dsa)",
    "mla_down_proj_fusion": "the fused MLA q/kv down-projection",
}
"""Config attributes that add or replace modules this description does not know how to name."""


def describe_transformer_config(config: object, *, vocab_size: int, seq_len: int,
                                name: str = "megatron") -> ModelDescription:
    """Components of the GPTModel megatron-core would build from `config`, layer by layer."""
    source = f"TransformerConfig {name!r}"
    for attr, what in UNSUPPORTED.items():
        if getattr(config, attr, None):
            raise PlanError(f"{source}: {attr}={getattr(config, attr)!r} ({what}) is not described; "
                            f"unset it or write a YAML description (configs/models/)")
    hidden = _size(config, "hidden_size", source)
    heads = _size(config, "num_attention_heads", source)
    num_layers = _size(config, "num_layers", source)
    ffn = getattr(config, "ffn_hidden_size", None) or 4 * hidden
    glu = 2 if getattr(config, "gated_linear_unit", False) else 1

    if getattr(config, "multi_latent_attention", False):
        attention = _mla(config, hidden, heads, seq_len, source)
    else:
        attention = _self_attention(config, hidden, heads, seq_len)
    layer_start = [_norm("input_layernorm", hidden), *attention, _norm("pre_mlp_layernorm", hidden)]
    blocks = {
        "dense": [*layer_start, _linear("mlp.linear_fc1", glu * ffn, hidden), _linear("mlp.linear_fc2", hidden, ffn)],
        "moe": [*layer_start, *_moe(config, hidden, ffn, glu)] if getattr(config, "num_moe_experts", None) else [],
    }
    pattern = _block_pattern(config, num_layers, source)
    data = {
        "name": name, "seq_len": seq_len, "layer_prefix": "decoder.layers",
        "before_layers": [{"name": "embedding.word_embeddings", "kind": "embedding", "n": hidden, "k": vocab_size}],
        "blocks": {block: blocks[block] for block in dict.fromkeys(pattern)},
        "layers": [{"block": block, "repeat": len(list(run))} for block, run in groupby(pattern)],
        "after_layers": [_norm("decoder.final_layernorm", hidden),
                         {"name": "output_layer", "kind": "head", "n": vocab_size, "k": hidden}],
    }
    # GPTModel's output layer is its own ColumnParallelLinear, which the plan does not move to a TE module.
    return replace(description_from_dict(data, source=source), head_replaceable=False)


def _self_attention(config: object, hidden: int, heads: int, seq_len: int) -> list[dict]:
    """SelfAttention: fused q/k/v for grouped-query heads, optional per-head q/k norms."""
    head_dim = getattr(config, "kv_channels", None) or hidden // heads
    groups = getattr(config, "num_query_groups", None) or heads
    components = [_linear("self_attention.linear_qkv", (heads + 2 * groups) * head_dim, hidden)]
    if getattr(config, "qk_layernorm", False):
        components += [_norm("self_attention.q_layernorm", head_dim), _norm("self_attention.k_layernorm", head_dim)]
    return components + [
        {"name": "self_attention.core_attention", "kind": "attn_core", "n": seq_len, "k": head_dim, "active": 2 * heads},
        _linear("self_attention.linear_proj", hidden, heads * head_dim),
    ]


def _mla(config: object, hidden: int, heads: int, seq_len: int, source: str) -> list[dict]:
    """MLASelfAttention: low-rank q (optional) and kv projections, the rope part carried beside kv."""
    nope, rope, v_dim, kv_rank = (_size(config, attr, source) for attr in
                                  ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "kv_lora_rank"))
    q_rank = getattr(config, "q_lora_rank", None)
    qk_norm = getattr(config, "qk_layernorm", False)
    if q_rank is None:
        query = [_linear("self_attention.linear_q_proj", heads * (nope + rope), hidden)]
    else:
        query = [_linear("self_attention.linear_q_down_proj", q_rank, hidden),
                 *([_norm("self_attention.q_layernorm", q_rank)] if qk_norm else []),
                 _linear("self_attention.linear_q_up_proj", heads * (nope + rope), q_rank)]
    return [
        *query,
        _linear("self_attention.linear_kv_down_proj", kv_rank + rope, hidden),
        *([_norm("self_attention.kv_layernorm", kv_rank)] if qk_norm else []),
        _linear("self_attention.linear_kv_up_proj", heads * (nope + v_dim), kv_rank),
        {"name": "self_attention.core_attention", "kind": "attn_core", "n": seq_len, "k": nope + rope, "active": 2 * heads},
        _linear("self_attention.linear_proj", hidden, heads * v_dim),
    ]


def _moe(config: object, hidden: int, ffn: int, glu: int) -> list[dict]:
    """MoELayer: router, routed experts (grouped), optional shared experts."""
    experts = config.num_moe_experts
    top_k = getattr(config, "moe_router_topk", 2)
    expert_ffn = getattr(config, "moe_ffn_hidden_size", None) or ffn
    shared_ffn = getattr(config, "moe_shared_expert_intermediate_size", None)
    grouped = {"kind": "expert", "experts": experts, "active": top_k}
    components = [
        {"name": "mlp.router", "kind": "router", "n": experts, "k": hidden},
        {"name": "mlp.experts.linear_fc1", "n": glu * expert_ffn, "k": hidden, **grouped},
        {"name": "mlp.experts.linear_fc2", "n": hidden, "k": expert_ffn, **grouped},
    ]
    if shared_ffn:
        components += [_linear("mlp.shared_experts.linear_fc1", glu * shared_ffn, hidden),
                       _linear("mlp.shared_experts.linear_fc2", hidden, shared_ffn)]
    return components


def _block_pattern(config: object, num_layers: int, source: str) -> list[str]:
    """'dense' or 'moe' per layer, read from moe_layer_freq as get_gpt_decoder_layer_specs reads it."""
    if not getattr(config, "num_moe_experts", None):
        return ["dense"] * num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return ["moe" if i % freq == 0 else "dense" for i in range(num_layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        return ["moe" if f else "dense" for f in freq]
    raise PlanError(f"{source}: moe_layer_freq={freq!r} must be a positive integer N (MoE every N layers) "
                    f"or a list of {num_layers} zeros (dense) and ones (MoE)")


def _size(config: object, attr: str, source: str) -> int:
    value = getattr(config, attr, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{source}: {attr} must be a positive integer, got {value!r}")
    return value


def _linear(name: str, n: int, k: int) -> dict:
    return {"name": name, "kind": "linear", "n": n, "k": k}


def _norm(name: str, width: int) -> dict:
    return {"name": name, "kind": "norm", "n": width, "k": width}
