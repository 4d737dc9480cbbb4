"""A small plain-torch Llama (torchtitan's layout): RMSNorm, RoPE, GQA attention, SwiGLU, optional MoE.

Module names are the ones configs/models/*.yaml use (fused wqkv and w13), so the plan derived from
a built model equals the plan read from its YAML file. With fused_projections=False the blocks have
separate wq/wk/wv and w1/w3 instead (torchtitan's names), which tensor parallelism can shard.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from fp8stack.plan.parallel import ShardAs, TensorParallelPlan
from fp8stack.models.moe import FeedForward, MoE, MoEConfig, trunc_normal_as_fused_


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder."""

    dim: int
    """Hidden size."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (GQA groups); equal to n_heads for plain multi-head attention."""
    ffn_dim: int
    """Hidden width of the dense SwiGLU."""
    vocab_size: int
    """Embedding rows and output logits."""
    seq_len: int
    """Training sequence length."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency (Llama 3)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts shape; None for an all-dense model."""
    first_moe_layer: int = 0
    """With moe set: layers before this index keep a dense FeedForward (DeepSeek-V3 keeps 3)."""
    fused_projections: bool = True
    """One GEMM for q/k/v (wqkv) and one for gate/up (w13); False: wq/wk/wv and w1/w3, which TP can shard."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")
        if self.moe is not None and not 0 <= self.first_moe_layer < self.n_layers:
            raise ValueError(f"LlamaConfig: first_moe_layer={self.first_moe_layer} must be in [0, n_layers={self.n_layers})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.first_moe_layer


def rope_table(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Complex FP32 rotations [seq_len, head_dim / 2]. Built per forward, not kept as a buffer: it costs microseconds,
    and a buffer would be cast (imaginary part dropped) by .to(bfloat16). Complex, not (cos, sin) pairs, because FSDP's
    mixed precision casts floating-point block inputs to BF16 and leaves complex ones alone."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [B, S, H, head_dim] by rope [S, head_dim / 2], in FP32. Compiled, in real
    arithmetic (Inductor has no complex kernels and fuses it into one kernel each way); eager, as one complex
    product, fewer kernels than the real form (measured: profiles/runs/2026-11-24-probe-rope-glue-h200/)."""
    if torch.compiler.is_compiling():
        even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = torch.view_as_real(rope)[:, None].unbind(-1)
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rope[:, None, :]).flatten(-2).type_as(x)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its FP32 weight cast to the input's dtype: BF16 activations then take torch's fused kernel,
    which reduces in FP32 and writes BF16 (with mismatched dtypes torch falls back to a chain of unfused kernels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class AttentionCore(nn.Module):
    """softmax(QK^T)V, causal, by SDPA (flash on GPU). A module of its own, without weights, so that
    it can be recomputed alone (Megatron's core_attn) and found by name (the plan's attention.core)."""

    def __init__(self, gqa: bool):
        super().__init__()
        self.gqa = gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, head_dim], k and v [B, H_kv, S, head_dim] -> [B, H, S, head_dim]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


class Attention(nn.Module):
    """Causal grouped-query attention: fused wqkv (or wq, wk, wv), RoPE, the core (SDPA), wo.

    Head counts are read from the projection outputs, so a rank holding a tensor-parallel shard of
    wq/wk/wv (and wo) computes its own heads."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.fused = config.fused_projections
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.fused:
            self.wqkv = nn.Linear(config.dim, q_size + 2 * kv_size, bias=False)
        else:
            self.wq = nn.Linear(config.dim, q_size, bias=False)
            self.wk = nn.Linear(config.dim, kv_size, bias=False)
            self.wv = nn.Linear(config.dim, kv_size, bias=False)
        self.core = AttentionCore(gqa=self.n_kv_heads != self.n_heads)
        self.wo = nn.Linear(q_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        if self.fused:
            # q and k rotated as one tensor of heads: rotated apart, Inductor's backward wrote their gradients into
            # wqkv's at a third of memory speed (profiles/runs/2026-11-24-probe-rope-glue-h200/).
            qk, v = self.wqkv(x).split([(self.n_heads + self.n_kv_heads) * self.head_dim,
                                        self.n_kv_heads * self.head_dim], dim=-1)
            q, k = apply_rope(qk.view(heads), rope).split([self.n_heads, self.n_kv_heads], dim=2)
        else:
            q, k, v = apply_rope(self.wq(x).view(heads), rope), apply_rope(self.wk(x).view(heads), rope), self.wv(x)
        v = v.view(heads)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, init_std: float) -> None:
        trunc_normal_as_fused_([self.wqkv] if self.fused else [self.wq, self.wk, self.wv], std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward or moe (norm(x))."""

    def __init__(self, layer_id: int, config: LlamaConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        if config.is_moe_layer(layer_id):
            self.moe = MoE(config.dim, config.moe, fused_projections=config.fused_projections)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim, fused=config.fused_projections)
        # Output projections of deeper layers start smaller so the residual stream stays O(1).
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    @property
    def mlp(self) -> nn.Module:
        """The feed-forward part: `moe` or `feed_forward`."""
        return self.moe if hasattr(self, "moe") else self.feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.mlp(self.ffn_norm(x))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.mlp.init_weights(self.init_std)


class Llama(nn.Module):
    """Token embeddings, n_layers TransformerBlocks, final RMSNorm, output head. forward: tokens -> logits."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, config) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, vocab] in the activation dtype."""
        cfg = self.config
        rope = rope_table(cfg.head_dim, tokens.shape[1], cfg.rope_theta, device=tokens.device)
        x = self.tok_embeddings(tokens)
        if torch.is_autocast_enabled(x.device.type):
            # The residual stream runs in the activation dtype, as the plan says (embedding and norms BF16 in and
            # out) and as Megatron and DeepSeek-V3 run it; autocast leaves the FP32 table's lookup in FP32.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self.layers:
            x = layer(x, rope)
        return self.output(self.norm(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, computed in FP32 (logits span a wide range)."""
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter; the same seed gives the same weights on the same device. Call after `to_empty()` when the model was built on the meta device."""
        device = self.output.weight.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(seed)
            nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers:
                layer.init_weights()
            self.norm.reset_parameters()
            std = self.config.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)


UNFUSE = ("build the model with separate projections: LlamaConfig(fused_projections=False), or "
          "--no-fused-projections for python -m fp8stack.train / launch/train.sh")


def tensor_parallel_plan(model: Llama, degree: int) -> TensorParallelPlan:
    """torchtitan's Llama TP plan with sequence parallelism over `degree` ranks: embeddings rowwise, output colwise,
    per block wq/wk/wv/w1/w3 colwise and wo/w2 rowwise, the norms' outputs sharded along the sequence. The blocks
    take their local head count from the projection outputs (view(..., -1, head_dim)); the sequence length must
    divide by the degree. Fused wqkv / w13 and MoE blocks are refused, and head counts that do not divide."""
    config = model.config
    if config.fused_projections:
        raise NotImplementedError(
            "tensor parallelism does not shard layers.0.attention.wqkv (fused q, k and v) or layers.0.feed_forward.w13 "
            "(fused gate and up): a colwise shard of a fused projection would give one rank all of q (or gate) and "
            f"the other k and v (or up). Fix: {UNFUSE}")
    if config.moe is not None:
        raise NotImplementedError(f"tensor parallelism does not shard layers.{config.first_moe_layer}.moe: experts "
                                  "need expert parallelism, which fp8stack does not provide. Use a dense model "
                                  "(--model tiny or llama-1b-like) or no tensor parallelism")
    uneven = [f"{name}={count}" for name, count in (("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads))
              if count % degree]
    if uneven:
        raise ValueError(f"tensor parallelism over {degree} ranks shards the attention by heads, but "
                         f"{', '.join(uneven)} does not divide by {degree}: pick a tensor-parallel degree that "
                         "divides both head counts")
    rowwise_out = ShardAs("rowwise", {"output_layouts": Shard(1)})
    return TensorParallelPlan(
        outside={"tok_embeddings": ShardAs("rowwise", {"input_layouts": Replicate(), "output_layouts": Shard(1)}),
                 "norm": ShardAs("sequence"),
                 "output": ShardAs("colwise", {"input_layouts": Shard(1), "output_layouts": Replicate()})},
        block={"attention_norm": ShardAs("sequence"),
               "attention": ShardAs("prepare_input", {"input_layouts": (Shard(1), None),
                                                      "desired_input_layouts": (Replicate(), None)}),
               **{f"attention.{n}": ShardAs("colwise") for n in ("wq", "wk", "wv")},
               "attention.wo": rowwise_out,
               "ffn_norm": ShardAs("sequence"),
               "feed_forward": ShardAs("prepare_input", {"input_layouts": (Shard(1),),
                                                         "desired_input_layouts": (Replicate(),)}),
               **{f"feed_forward.{n}": ShardAs("colwise") for n in ("w1", "w3")},
               "feed_forward.w2": rowwise_out})
