"""A plain-torch mixture of experts: router, token permutation, grouped experts, shared experts.

Tokens are sorted by expert so that all experts run as one grouped GEMM (torch._grouped_mm) over
contiguous row groups. `GroupedExperts` is the piece an FP8 backend swaps for a subclass: same
parameters (w13, w2), same forward(x_sorted, offsets).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8stack.plan.description import ROUTER_SCORES



@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer."""

    num_experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts each token is sent to."""
    expert_ffn_dim: int
    """Hidden width of each routed expert's SwiGLU."""
    shared_ffn_dim: int = 0
    """Hidden width of the always-on shared expert SwiGLU; 0 for none."""
    score_func: str = "softmax"
    """Router scores: softmax over experts (Mixtral) or per-expert sigmoid (DeepSeek-V3)."""
    route_norm: bool = False
    """Rescale each token's top-k weights to sum to 1."""

    def __post_init__(self) -> None:
        if self.score_func not in ROUTER_SCORES:
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}: use one of {', '.join(ROUTER_SCORES)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.expert_ffn_dim <= 0 or self.shared_ffn_dim < 0:
            raise ValueError("MoEConfig: expert_ffn_dim must be positive and shared_ffn_dim non-negative")


class FeedForward(nn.Module):
    """SwiGLU MLP: gate and up projections fused into one GEMM (w13), or separate w1 (gate) and w3
    (up), torchtitan's layout, which tensor parallelism can shard colwise."""

    def __init__(self, dim: int, hidden_dim: int, fused: bool = True):
        super().__init__()
        self.fused = fused
        if fused:
            self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden_dim, bias=False)
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1) if self.fused else (self.w1(x), self.w3(x))
        return self.w2(F.silu(gate) * up)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_as_fused_([self.w13] if self.fused else [self.w1, self.w3], std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=init_std)


@torch.no_grad()
def trunc_normal_as_fused_(linears: list[nn.Linear], std: float) -> None:
    """Initialise the weights of `linears` as one weight stacked along the outputs would be, so that
    the same seed gives fused and unfused projections the same function."""
    weights = [linear.weight for linear in linears]
    fused = nn.init.trunc_normal_(torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1],
                                              device=weights[0].device, dtype=weights[0].dtype), std=std)
    for weight, part in zip(weights, fused.split([w.shape[0] for w in weights])):
        weight.copy_(part)


class Router(nn.Module):
    """Scores experts per token (BF16 GEMM, FP32 softmax/sigmoid) and keeps the top-k."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(dim, config.num_experts, bias=False)
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.route_norm = config.route_norm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, top_k] FP32, expert indices [T, top_k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class SwiGLU(nn.Module):
    """silu(gate) * up of a fused [..., 2F] projection. A module, without weights, so that the
    experts' activation can be recomputed alone (Megatron's moe_act)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLUs as two grouped GEMMs over expert-sorted tokens.

    Override `grouped_mm` (or `forward`) to run the GEMMs another way; keep the parameters.
    """

    group_alignment: int = 8
    """Rows per expert group are padded to a multiple of this. The weight-gradient GEMM groups
    along the token dim, so group starts must be 16-byte aligned: 8 BF16 rows (as torchtitan pads).
    FP8 subclasses raise it (16 for FP8 rows, 128 for block-scaled kernels)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        """Fused gate and up projections, [E, 2F, D] (nn.Linear layout per expert)."""
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        """Down projections, [E, D, F]."""
        self.act = SwiGLU()

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x_sorted [R, D]: rows grouped by expert; offsets int32 [E]: end row of each group
        (cumulative counts, each a multiple of group_alignment). Rows past offsets[-1] are
        padding: their output is unspecified (torch._grouped_mm leaves them uninitialised)."""
        return self.grouped_mm(self.act(self.grouped_mm(x_sorted, self.w13, offsets)), self.w2, offsets)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row group g of x times weight[g]^T (weight in nn.Linear layout [E, N, K])."""
        # _grouped_mm is not on autocast's op lists: cast as autocast does for a matmul.
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w13, std=0.02)
        nn.init.trunc_normal_(self.w2, std=init_std)


@dataclass(frozen=True)
class Permutation:
    """Where each (token, choice) slot goes in the expert-sorted, group-padded row buffer."""

    row_token: torch.Tensor
    """[R] token feeding each row; T (one past the last token) for padding rows."""
    slot_row: torch.Tensor
    """[T * top_k] row holding each slot's result (slot = token * top_k + choice)."""
    offsets: torch.Tensor
    """int32 [E] end row of each expert's (padded) group."""


def permute(experts: torch.Tensor, num_experts: int, alignment: int) -> Permutation:
    """Sort the slots of `experts` [T, top_k] by expert and pad each group to `alignment` rows.

    The buffer length is static (T * top_k + E * (alignment - 1)) so the step needs no host sync.
    """
    num_tokens, top_k = experts.shape
    sorted_experts, slots = experts.flatten().sort(stable=True)
    ids = torch.arange(num_experts, device=experts.device)
    starts = torch.searchsorted(sorted_experts, ids)
    counts = torch.searchsorted(sorted_experts, ids, right=True) - starts
    padded_counts = (counts + alignment - 1) // alignment * alignment
    padded_ends = padded_counts.cumsum(0)
    # A sorted slot's row: its rank inside its expert's group plus where the padded group starts.
    rows = (torch.arange(slots.numel(), device=experts.device) - starts[sorted_experts]
            + (padded_ends - padded_counts)[sorted_experts])
    buffer_rows = slots.numel() + num_experts * (alignment - 1)
    row_token = torch.full((buffer_rows,), num_tokens, dtype=torch.long, device=experts.device)
    row_token[rows] = slots // top_k
    slot_row = torch.empty_like(rows)
    slot_row[slots] = rows
    return Permutation(row_token=row_token, slot_row=slot_row, offsets=padded_ends.to(torch.int32))


class MoE(nn.Module):
    """Routed experts (top-k of E) plus optional shared experts, replacing a block's FeedForward."""

    def __init__(self, dim: int, config: MoEConfig, fused_projections: bool = True):
        super().__init__()
        self.config = config
        self.top_k = config.top_k
        self.router = Router(dim, config)
        self.experts = GroupedExperts(dim, config.expert_ffn_dim, config.num_experts)
        self.shared_experts = (FeedForward(dim, config.shared_ffn_dim, fused=fused_projections)
                               if config.shared_ffn_dim else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x)
        perm = permute(experts, self.config.num_experts, self.experts.group_alignment)
        # Padding rows read an appended zero row; its gradient is dropped.
        padded_x = torch.cat([x, x.new_zeros(1, x.shape[-1])])
        rows_out = self.experts(padded_x[perm.row_token], perm.offsets)
        slots_out = rows_out[perm.slot_row].view(*weights.shape, x.shape[-1])
        # Weighted sum over each token's top-k results in FP32, back to the activation dtype.
        out = (slots_out.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, std=init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
