"""A plain-torch mixture of experts: router, token permutation, grouped experts, shared experts.

Tokens are sorted by expert so that all experts run as one grouped GEMM (torch._grouped_mm) over
contiguous row groups. `GroupedExperts` is the piece an FP8 backend swaps for a subclass: same
parameters (w13, w2), same forward(x_sorted, offsets), or forward(tokens, offsets, row_token) for a subclass that
permutes the tokens itself (permutes_tokens: grouped_fp8's FP8 dispatch).

Load balancing is DeepSeek-V3's auxiliary-loss-free one (arXiv 2412.19437, section 2.1.2): each MoE keeps a
per-expert bias, added to the router's scores to choose the top-k experts and left out of the weights that combine
their outputs. The forward counts the slots each expert received (no host sync); once per optimizer step
`update_expert_bias(model)` moves every bias by rate * sign(mean load - expert load) and clears the counts, as
torchtitan's optimizer hook does. A loop of one's own calls it after optimizer.step(), or registers it:

    register_expert_bias_update(optimizer, model)   # data parallel: group=<the replicas' process group>

`router_statistics` turns what an update saw into load imbalance, dropped slots and the bias range for a log.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from fp8stack.plan.description import ROUTER_SCORES

SIGMOID_BIAS_RATE = 1e-3
"""DeepSeek-V3's bias update speed (gamma) for its sigmoid router, per optimizer step."""
SIGMOID_SLOPE = 0.25
"""d sigmoid / d logit at logit 0: a sigmoid score moves by a quarter of its logit's move."""

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
    bias_update_rate: float | None = None
    """Auxiliary-loss-free load balancing: each optimizer step moves an expert's routing bias by this much towards
    the mean load (0 turns balancing off; the bias then stays 0). None: DeepSeek-V3's 1e-3 for sigmoid scores; for
    softmax scores 4e-3 / num_experts, the same step in logit units. A sigmoid score near logit 0 moves by a
    quarter of its logit's move, a softmax probability near the uniform 1 / E by 1 / E of it, so 1e-3 on sigmoid
    scores is a 4e-3 logit shift and on softmax scores 4e-3 / E is (5e-4 for E = 8): a softmax bias of 1e-3 would
    take a large-E router's near-tied experts past each other twice as fast as DeepSeek's at E = 8."""

    def __post_init__(self) -> None:
        if self.score_func not in ROUTER_SCORES:
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}: use one of {', '.join(ROUTER_SCORES)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.expert_ffn_dim <= 0 or self.shared_ffn_dim < 0:
            raise ValueError("MoEConfig: expert_ffn_dim must be positive and shared_ffn_dim non-negative")
        if self.bias_update_rate is not None and not self.bias_update_rate >= 0:
            raise ValueError(f"MoEConfig.bias_update_rate={self.bias_update_rate} must be at least 0 (0 turns load "
                             "balancing off) or None for the router's default")

    @property
    def expert_bias_rate(self) -> float:
        """bias_update_rate, or the default for the router's scores when it is None."""
        if self.bias_update_rate is not None:
            return self.bias_update_rate
        if self.score_func == "sigmoid":
            return SIGMOID_BIAS_RATE
        return SIGMOID_BIAS_RATE / SIGMOID_SLOPE / self.num_experts


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
    """Scores experts per token (BF16 GEMM, FP32 softmax/sigmoid) and keeps the top-k, chosen by the scores plus a
    per-expert bias when one is given; the weights are the unbiased scores of the chosen experts."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(dim, config.num_experts, bias=False)
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.route_norm = config.route_norm

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], bias FP32 [E] or None -> (weights [T, top_k] FP32, expert indices [T, top_k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        if bias is None:
            weights, experts = scores.topk(self.top_k, dim=-1)
        else:
            experts = (scores + bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
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
    wgrad_into_main_grad: bool = False
    """The weight-gradient GEMMs add into their weights' FP32 main_grad inside the backward, and autograd gets no
    weight gradient: no BF16 gradient kept until a hook adds it (set by a backend's hand_over_main_grads once
    master weights own those buffers, as Megatron's TEGroupedMLP accumulates into main_grad)."""
    permutes_tokens: bool = False
    """forward(tokens [T, D], offsets, row_token [R]) permutes the tokens itself: row r reads token row_token[r], T
    marking a padding row (zero). MoE then hands it the tokens, not the expert-sorted rows, so that a subclass can
    move the rows in another form (grouped_fp8's fp8_dispatch: quantized once, copied as FP8)."""

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
        padding: their output and their input gradient are unspecified, possibly NaN (torch._grouped_mm and
        grouped_fp8's kernels leave them uninitialised). MoE reads neither: it gathers its slots' rows, and the
        padding rows' gradient goes to a dropped row."""
        return self.grouped_mm(self.act(self.grouped_mm(x_sorted, self.w13, offsets)), self.w2, offsets)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row group g of x times weight[g]^T (weight in nn.Linear layout [E, N, K])."""
        main_grad = self.main_grad_of(weight)
        # _grouped_mm is not on autocast's op lists: cast as autocast does for a matmul.
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        if main_grad is not None:
            return GroupedMMIntoMainGrad.apply(x, weight, offsets, main_grad)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    def main_grad_of(self, weight: nn.Parameter) -> torch.Tensor | Callable[[], torch.Tensor] | None:
        """The FP32 buffer the weight's wgrad GEMM adds into, if it takes one (wgrad_into_main_grad); where master
        weights allocate it only when a backward needs it (MasterWeights' release_main_grads), the function giving it,
        which the backward calls."""
        if not (self.wgrad_into_main_grad and weight.requires_grad):
            return None
        return weight.get_main_grad if hasattr(weight, "get_main_grad") else weight.main_grad

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w13, std=0.02)
        nn.init.trunc_normal_(self.w2, std=init_std)


def main_grad_now(main_grad: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    """The FP32 buffer a wgrad GEMM adds into, in its backward: what GroupedExperts.main_grad_of gave, or what the
    function it gave returns now (allocated where released)."""
    return main_grad() if callable(main_grad) else main_grad


class GroupedMMIntoMainGrad(torch.autograd.Function):
    """torch._grouped_mm(x, weight^T) per row group, whose backward adds the weight gradient into `main_grad` (the
    weight's FP32 buffer, or a function the backward calls for it: GroupedExperts.main_grad_of) in place and returns
    none. torch._grouped_mm writes its input dtype only (no FP32 output for
    BF16 operands), so the BF16 product is added right away: one add, as the hook's, but the BF16 gradient is freed
    at once instead of passing through the parameter's .grad to a hook."""

    @staticmethod
    def forward(ctx, x, weight, offsets, main_grad):
        ctx.save_for_backward(x, weight, offsets)
        ctx.main_grad = main_grad
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, offsets = ctx.saved_tensors
        grad_x = torch._grouped_mm(grad_y, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        main_grad_now(ctx.main_grad).add_(torch._grouped_mm(grad_y.t(), x, offs=offsets))
        return grad_x, None, None, None


@dataclass(frozen=True)
class Permutation:
    """Where each (token, choice) slot goes in the expert-sorted, group-padded row buffer."""

    row_token: torch.Tensor
    """[R] token feeding each row; T (one past the last token) for padding rows."""
    slot_row: torch.Tensor
    """[T * top_k] row holding each slot's result (slot = token * top_k + choice)."""
    offsets: torch.Tensor
    """int32 [E] end row of each expert's (padded) group."""
    counts: torch.Tensor
    """int64 [E] slots placed in each expert's group (its load, padding left out)."""


def permute(experts: torch.Tensor, num_experts: int, alignment: int) -> Permutation:
    """Sort the slots of `experts` [T, top_k] by expert and pad each group to `alignment` rows.

    The buffer length is static (T * top_k + E * (alignment - 1), rounded up to a multiple of `alignment`) so the
    step needs no host sync; whole alignment tiles let a quantizer that cannot pad (TE's) read it as it is.
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
    buffer_rows = -(-(slots.numel() + num_experts * (alignment - 1)) // alignment) * alignment
    row_token = torch.full((buffer_rows,), num_tokens, dtype=torch.long, device=experts.device)
    row_token[rows] = slots // top_k
    slot_row = torch.empty_like(rows)
    slot_row[slots] = rows
    return Permutation(row_token=row_token, slot_row=slot_row, offsets=padded_ends.to(torch.int32), counts=counts)


class MoE(nn.Module):
    """Routed experts (top-k of E) plus optional shared experts, replacing a block's FeedForward.

    Buffers: expert_bias (FP32 [E], in the state dict: a checkpoint keeps it) steers the top-k choice;
    tokens_per_expert and routed_slots (FP32, not in the state dict: update_expert_bias clears them every step)
    count what the forwards that build a graph routed, each once: a forward recomputed in backward (activation
    checkpointing) is not counted again."""

    def __init__(self, dim: int, config: MoEConfig, fused_projections: bool = True):
        super().__init__()
        self.config = config
        self.top_k = config.top_k
        self.router = Router(dim, config)
        self.experts = GroupedExperts(dim, config.expert_ffn_dim, config.num_experts)
        self.shared_experts = (FeedForward(dim, config.shared_ffn_dim, fused=fused_projections)
                               if config.shared_ffn_dim else None)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("routed_slots", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x, self.expert_bias if self.config.expert_bias_rate > 0 else None)
        perm = permute(experts, self.config.num_experts, self.experts.group_alignment)
        self._count(perm.counts, experts.numel())
        rows_out = self._expert_rows(x, perm)
        slots_out = rows_out[perm.slot_row].view(*weights.shape, x.shape[-1])
        # Weighted sum over each token's top-k results in FP32, back to the activation dtype.
        out = (slots_out.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _expert_rows(self, x: torch.Tensor, perm: Permutation) -> torch.Tensor:
        """The experts' output for each row of the expert-sorted buffer, whose rows the MoE gathers unless the experts
        permute the tokens themselves (permutes_tokens; experts that are not GroupedExperts, TE's, take the rows)."""
        if getattr(self.experts, "permutes_tokens", False):
            return self.experts(x, perm.offsets, perm.row_token)
        # Padding rows read an appended zero row; its gradient is dropped.
        padded_x = torch.cat([x, x.new_zeros(1, x.shape[-1])])
        return self.experts(padded_x[perm.row_token], perm.offsets)

    @torch.compiler.disable
    def _count(self, counts: torch.Tensor, slots: int) -> None:
        """Add a forward's loads to the step's counts, unless it builds no graph (no_grad: evaluation) or recomputes
        a forward in backward. Eager even in a compiled block (one graph break per MoE layer): whether a forward is
        a recompute is the autograd engine's state at run time, which a compiled graph cannot read."""
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.tokens_per_expert.add_(counts)
            self.routed_slots.add_(slots)

    def init_weights(self, init_std: float) -> None:
        """The weights as new, the routing bias 0 and nothing counted (after to_empty() too)."""
        nn.init.trunc_normal_(self.router.gate.weight, std=init_std)
        for buffer in (self.expert_bias, self.tokens_per_expert, self.routed_slots):
            buffer.zero_()
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)


@dataclass(frozen=True)
class RouterLoad:
    """What one MoE layer routed over one optimizer step, as update_expert_bias saw it (device tensors)."""

    tokens_per_expert: torch.Tensor
    """FP32 [E] slots each expert received over the step's micro-batches (over all data-parallel ranks)."""
    routed_slots: torch.Tensor
    """FP32 scalar: the slots the router chose (tokens x top_k); those not in tokens_per_expert were dropped."""
    bias: torch.Tensor
    """FP32 [E] the routing bias after the update."""


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE modules by qualified name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, RouterLoad]:
    """Once per optimizer step, after its micro-batches' forwards: move each MoE's expert bias by
    rate * sign(mean load - expert load) (MoEConfig.expert_bias_rate; a rate of 0 leaves it) and clear the counts.
    group: the data-parallel replicas' process group, over which the loads are summed (one all-reduce) so that every
    replica moves its biases alike. Returns what each layer routed (RouterLoad, by name) without a host sync."""
    layers = moe_layers(model)
    if not layers:
        return {}
    counted = torch.stack([torch.cat([moe.tokens_per_expert, moe.routed_slots.view(1)]) for moe in layers.values()])
    if group is not None:
        dist.all_reduce(counted, group=group)
    loads = {}
    for (name, moe), row in zip(layers.items(), counted):
        tokens_per_expert, routed_slots = row[:-1], row[-1]
        rate = moe.config.expert_bias_rate
        if rate > 0:
            moe.expert_bias.add_(rate * torch.sign(tokens_per_expert.mean() - tokens_per_expert))
        moe.tokens_per_expert.zero_()
        moe.routed_slots.zero_()
        loads[name] = RouterLoad(tokens_per_expert=tokens_per_expert, routed_slots=routed_slots,
                                 bias=moe.expert_bias.clone())
    return loads


def register_expert_bias_update(optimizer: torch.optim.Optimizer, model: nn.Module,
                                group: dist.ProcessGroup | None = None) -> RemovableHandle:
    """Run update_expert_bias(model, group) after every optimizer.step() (its loads are then not returned)."""
    return optimizer.register_step_post_hook(lambda *_hook_args: update_expert_bias(model, group))


def clear_expert_load(model: nn.Module) -> None:
    """Forget the loads counted since the last update (forwards that were not training steps)."""
    for moe in moe_layers(model).values():
        moe.tokens_per_expert.zero_()
        moe.routed_slots.zero_()


ROUTER_STATISTICS = ("imbalance", "cv", "dropped", "bias_min", "bias_max")
"""Per layer: max expert load / mean load; the loads' coefficient of variation (population standard deviation /
mean); the share of routed slots no expert received; the smallest and largest routing bias."""


def router_statistics(loads: dict[str, RouterLoad]) -> dict[str, float]:
    """update_expert_bias's loads as numbers (one host sync): '<layer>/<statistic>' for each of ROUTER_STATISTICS,
    and over the layers 'imbalance' and 'cv' (means), 'imbalance_max', 'dropped' (of all slots), 'bias_min' and
    'bias_max'. A layer that received nothing has NaN imbalance and cv."""
    if not loads:
        return {}
    return router_statistics_from(loads, router_statistics_on_device(loads).tolist())


def router_statistics_on_device(loads: dict[str, RouterLoad]) -> torch.Tensor:
    """The numbers router_statistics reads, layer after layer in one 1-D tensor left on the device: a caller that
    reads other numbers too reads them all in one copy, then passes these to router_statistics_from."""
    per_layer = []
    for load in loads.values():
        counts = load.tokens_per_expert
        mean = counts.mean()
        per_layer.append(torch.stack([counts.max() / mean, counts.std(correction=0) / mean,
                                      (load.routed_slots - counts.sum()) / load.routed_slots.clamp(min=1),
                                      load.bias.min(), load.bias.max(), load.routed_slots - counts.sum(),
                                      load.routed_slots]))
    return torch.cat(per_layer)


def router_statistics_from(loads: dict[str, RouterLoad], numbers: list[float]) -> dict[str, float]:
    """router_statistics from router_statistics_on_device(loads) as read on the host ({} without loads)."""
    if not loads:
        return {}
    width = len(numbers) // len(loads)
    values = [numbers[start:start + width] for start in range(0, len(numbers), width)]
    stats = {f"{name}/{statistic}": row[index]
             for name, row in zip(loads, values) for index, statistic in enumerate(ROUTER_STATISTICS)}
    columns = list(zip(*values))
    stats.update(imbalance=math.fsum(columns[0]) / len(values), imbalance_max=max(columns[0]),
                 cv=math.fsum(columns[1]) / len(values), dropped=math.fsum(columns[5]) / max(math.fsum(columns[6]), 1),
                 bias_min=min(columns[3]), bias_max=max(columns[4]))
    return stats
