"""grouped_fp8: MoE expert GEMMs (GroupedExperts.w13 / w2) in FP8, forward, dgrad and wgrad.

Recipes the plan may give an expert GEMM:
- blockwise (DeepSeek-V3): activations and gradients in 1x128 tiles along the reduction dim, weights
  in 128x128 blocks, FP32 scales and accumulation; each expert's rows padded to 128. Kernels: DeepGEMM
  when importable, else torch.nn.functional.scaled_mm per expert (cuBLASLt, sm90 only).
- rowwise: one scale per row (tokens) / output channel (weights), torch._scaled_grouped_mm (sm90, sm100)
  for all three GEMMs; wgrad scales per expert and channel over the expert's tokens.
- rowwise_gw_hp: rowwise, with the weight-gradient GEMM in BF16 (torch._grouped_mm).
Every operand is E4M3 whatever the plan's fp8_format: these kernels take no E5M2 (DeepSeek-V3 runs
gradients in E4M3 too; the fine-grained scales keep their range). The conversion record says so.

Memory traffic per GEMM (x [T, K], w [E, N, K], grad [T, N], all BF16; bytes read + written; quantizers
fused by inductor on CUDA (fp8_quant.py), which may read the input twice (amax kernel, cast kernel); an
eager quantizer costs ~7 FP32 passes of its input instead):
- forward: w -> FP8 + scales once (2ENK + ENK), saved for dgrad; x -> 1x128 along K and, when w needs a
  gradient, along T transposed, from one read (2TK + 2TK), the transposed copy saved for wgrad instead of
  x (TK bytes of FP8, not 2TK of BF16). Groups the caller aligned (GroupedExperts under MoE) are read where they
  are; others are gathered into aligned groups inside the same kernel (an index load per row, far slower).
- backward: grad -> along N and along T transposed from one read (2TN + 2TN); blockwise dgrad transposes
  the saved FP8 weight (2ENK); rowwise re-quantizes w per K column (2ENK + ENK).
- blockwise with cache_fp8_weights (WeightBlocks): w's quantization and its transpose once per optimizer step, the
  step's later micro-batches reading the kept copies (2ENK bytes held between steps).
- GEMMs: FP8 operands (1 byte/element) and BF16 outputs; blockwise per-expert slices copy the output
  once (2 x 2TN) and wgrad operands once (T(N + K)). Aligned groups hand y and grad_x back as the GEMMs wrote them
  (rows past the last group unspecified, GroupedExperts' contract; copied where x's rows are not whole tiles, never
  under MoE); padded groups unpad them by a gather (2 x 2TN, 2 x 2TK).
- FP8 dispatch (fp8_dispatch; blockwise w13 under MoE, R ~ T * top_k rows, group padding aside): tokens [T, K] -> FP8
  once (2TK + TK) and their FP8 rows gathered (RK + RK), the wgrad operand quantized in the backward from the
  tokens through the index (2RK + RK); the BF16 dispatch instead gathers BF16 rows in the MoE (2RK + 2RK) and
  quantizes them both ways (2RK + 2RK), and holds x^T in FP8 (RK bytes) from forward to backward.
- host syncs: none in the rowwise recipes. Blockwise pads groups (if any) on the GPU and DeepGEMM's forward labels
  rows with their experts on the GPU (a capturable forward); its K-grouped wgrad takes the group sizes as a Python
  list, read once in the backward from a copy the forward started (TokenGroups.prefetch_counts). The torch blockwise
  kernels slice per expert on the host, so they read the group sizes once per forward (reused by the backward):
  torch's grouped FP8 GEMM takes rowwise and MX scales only, never 1x128 / 128x128 blocks. Each kernels object says so
  (capturable, capturable_backward, capture_note), and Float8GroupedExperts.cuda_graph_blocker tells the CUDA-graph
  guard. The FP8 dispatch builds its row index on the GPU with a static size: it reads nothing on the host itself.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from fp8stack.backends import deepgemm, fp8_quant
from fp8stack.backends.base import (Backend, BackendUnavailable, ConversionRecord, count_optimizer_steps,
                                   optimizer_steps, swap_module)
from fp8stack.backends.blockwise import BLOCK, Fp8Tensor, group_counts, new_or_into
from fp8stack.backends.fp8_quant import TOKEN_CHUNK
from fp8stack.models.moe import GroupedExperts, main_grad_now
from fp8stack.plan import Decision, Plan, PlanError
from fp8stack.plan.recipes import BF16, EXPERT_QUANTIZERS, WGRAD_FLATTENS

RECIPE_ALIGNMENT = {"blockwise": BLOCK, "rowwise": TOKEN_CHUNK, "rowwise_gw_hp": TOKEN_CHUNK}
"""Expert recipes this backend runs, and what both weight dims (and expert row groups) must be multiples of:
128-blocks for blockwise; 16 bytes of FP8 for the rowwise kernels' TMA loads (token groups included, as
the wgrad GEMM reduces over them)."""
KERNEL_CHOICES = ("auto", "torch", "deepgemm")
FLATTEN_KERNELS = {"compiled": "one compiled gather", "triton": "one Triton tile copy"}
"""What each wgrad_flatten other than copies runs per operand, for the conversion notes."""


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    """What the BF16 GEMM would return: the autocast dtype if autocast is on, else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """[M, K/128] scales with strides (1, M): cuBLASLt's layout for 1x128 (VEC128) scales."""
    return scale.t().contiguous().t()


def rhs_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """128x128 scales [N/128, K/128] of a weight w [N, K], for scaled_mm(a, w.t()): shape
    [round_up(K/128, 4), N/128], strides (1, round_up(K/128, 4)). cuBLASLt reads the K-block dim
    padded to a multiple of 4 (pytorch#166752: unpadded scales gave wrong results when K/128 % 4 != 0)."""
    k_blocks = scale.shape[1]
    return F.pad(scale, (0, -k_blocks % 4), value=1.0).t()


class TorchBlockwiseKernels:
    """The blockwise recipe's grouped GEMMs as one torch scaled_mm per expert (cuBLASLt, sm90 only)."""

    name = "torch scaled_mm per expert"
    row_alignment = BLOCK
    """Rows per expert are padded to whole 128-token tiles (the wgrad GEMM reduces over them)."""
    capturable = capturable_backward = False
    """Each expert's rows are sliced on the host: torch's grouped FP8 GEMM (_scaled_grouped_mm, scaled_grouped_mm)
    dispatches rowwise, MXFP8, MXFP4 and NVFP4 scales only, so block scales run one scaled_mm per expert."""
    capture_note = ("not capturable in a CUDA graph: torch's grouped FP8 GEMM takes no 1x128 / 128x128 block "
                    "scales, so each forward reads the expert group sizes on the host to run one scaled_mm per "
                    "expert; build DeepGEMM (launch/build_deepgemm.sh) for a capturable forward, or use recipe "
                    "rowwise")

    def __init__(self, scaled_mm=F.scaled_mm):
        self.scaled_mm = scaled_mm

    def m_grouped(self, a: Fp8Tensor, b: Fp8Tensor, groups: "TokenGroups") -> torch.Tensor:
        """Row group e of a [R, K] (1x128 scales) times b[e]^T, b [E, N, K] (128x128 scales) -> [R, N] BF16."""
        out = a.data.new_zeros(a.data.shape[0], b.data.shape[1], dtype=torch.bfloat16)
        start = 0
        for e, count in enumerate(groups.counts):
            if count:
                rows = slice(start, start + count)
                out[rows] = self.scaled_mm(
                    a.data[rows], b.data[e].t(),
                    outer_dim_major(a.scale[rows]), F.ScalingType.BlockWise1x128,
                    rhs_block_scale(b.scale[e]), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            start += count
        return out

    def k_grouped(self, a: Fp8Tensor, b: Fp8Tensor, groups: "TokenGroups",
                  into: torch.Tensor | None = None) -> torch.Tensor:
        """out[e] = a_e @ b_e^T over expert e's tokens: a [M, T], b [N, T], 1x128 scales along T -> [E, M, N] FP32;
        into: an FP32 [E, M, N] the products are added to (and returned) instead of a new zeroed one."""
        out = new_or_into(into, (len(groups.counts), a.data.shape[0], b.data.shape[0]), a.data.device)
        start = 0
        for e, count in enumerate(groups.counts):
            if count:
                tokens, tiles = slice(start, start + count), slice(start // BLOCK, (start + count) // BLOCK)
                out[e] += self.scaled_mm(
                    a.data[:, tokens].contiguous(), b.data[:, tokens].contiguous().t(),
                    outer_dim_major(a.scale[:, tiles]), F.ScalingType.BlockWise1x128,
                    outer_dim_major(b.scale[:, tiles]), F.ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)
            start += count
        return out


class TorchRowwiseKernels:
    """The rowwise recipes' grouped GEMMs on torch._scaled_grouped_mm (sm90, sm100)."""

    name = "torch _scaled_grouped_mm"
    capturable = capturable_backward = True
    """All three GEMMs take the group ends on the GPU (offs)."""
    capture_note = ""

    def __init__(self, scaled_grouped_mm=torch._scaled_grouped_mm):
        self.scaled_grouped_mm = scaled_grouped_mm

    def m_grouped(self, a: Fp8Tensor, b: Fp8Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row group e of a [R, K] (scale [R]) times b[e]^T, b [E, N, K] (scale [E, N]) -> [R, N] BF16."""
        return self.scaled_grouped_mm(a.data, b.data.transpose(-2, -1), a.scale, b.scale, offs=offsets,
                                      out_dtype=torch.bfloat16)

    def k_grouped(self, a: Fp8Tensor, b: Fp8Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """out[e] = a_e @ b_e^T over token group e: a [M, T], b [N, T], scales [E * M], [E * N] -> [E, M, N] BF16."""
        return self.scaled_grouped_mm(a.data, b.data.t(), a.scale, b.scale, offs=offsets, out_dtype=torch.bfloat16)


@dataclass(frozen=True)
class TokenGroups:
    """Expert-sorted token groups as the GEMMs read them: what TokenGroupPadding and AlignedTokenGroups share."""

    offsets: torch.Tensor
    """int32 [E] end row of each group in the buffer the GEMMs read."""

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        """Rows per group, read on the host on first use (a device sync, unless prefetch_counts copied them ahead)
        and kept for the backward."""
        prefetched = self.__dict__.get("_host_offsets")
        if prefetched is None:
            return tuple(group_counts(self.offsets))
        host_offsets, copied = prefetched
        copied.synchronize()
        return tuple(group_counts(host_offsets))

    @torch.compiler.disable
    def prefetch_counts(self) -> None:
        """Copy the group ends to pinned host memory behind the forward's kernels, for a backward that reads counts
        (DeepGEMM's K-grouped wgrad plans on the CPU): read only then, they stop the host until the GPU has drained
        its queue, and the GPU idles while the host refills it (profile-deepseek-moe-medium). Nothing on the CPU or
        while a CUDA graph is captured (a replay would not refresh the copy)."""
        if not self.offsets.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        host_offsets = torch.empty(self.offsets.shape, dtype=self.offsets.dtype, pin_memory=True)
        host_offsets.copy_(self.offsets, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.__dict__["_host_offsets"] = (host_offsets, copied)  # frozen: set as cached_property sets its value


@dataclass(frozen=True)
class TokenGroupPadding(TokenGroups):
    """Token groups moved to start on multiples of an alignment, without a host sync: the padded
    buffer has the static size T + E * (alignment - 1) rows, rounded up to the alignment; padding rows are zero.
    Both directions are row gathers (`gather_rows`), fused into the quantizer or cast that consumes them.
    Each operand method returns x's buffer in the form a GEMM reads; AlignedTokenGroups offers the same methods."""

    source: torch.Tensor
    """[rows] token of each buffer row; -1 for padding rows."""
    unpad_source: torch.Tensor
    """[T] buffer row of each token; -1 for tokens past the last group (their output is zero)."""
    rows: int
    """Buffer rows."""

    @classmethod
    def build(cls, offsets: torch.Tensor, num_tokens: int, alignment: int) -> "TokenGroupPadding":
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        padded_counts = (counts + alignment - 1) // alignment * alignment
        padded_ends = padded_counts.cumsum(0)
        tokens = torch.arange(num_tokens, device=offsets.device)
        group = torch.searchsorted(offsets, tokens.to(offsets.dtype), right=True)
        inside = group < offsets.numel()
        shift = ((padded_ends - padded_counts) - (offsets - counts))[group.clamp(max=offsets.numel() - 1)]
        # The GEMMs also need the buffer's row count (a stride when transposed) aligned.
        rows = -(-(num_tokens + offsets.numel() * (alignment - 1)) // alignment) * alignment
        dest = torch.where(inside, tokens + shift, rows)  # tokens past the groups go to a scratch row
        source = torch.full((rows + 1,), -1, dtype=torch.long, device=offsets.device).index_copy_(0, dest, tokens)
        return cls(padded_ends.to(offsets.dtype), source[:rows], torch.where(inside, dest, -1), rows)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, C] -> [rows, C]: the buffer in BF16 (or x's dtype), for a GEMM that reads it unquantized."""
        return fp8_quant.gather_rows_fused(x, self.source)

    def buffer(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMMs' [rows, C] buffer in x's dtype, rows a multiple of the alignment (for a quantizer that gathers
        nothing itself: TE's)."""
        return self.pad(x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[rows, C] -> [T, C]; tokens past the last group get zero rows (the gather's -1 rows, at no cost)."""
        return fp8_quant.gather_rows_fused(y, self.unpad_source)

    def quantize_rows_1x128(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.gather_quantize_rows_1x128(x, self.source)

    def quantize_cols_1x128(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.gather_quantize_cols_1x128(x, self.source)

    def quantize_both_1x128(self, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return fp8_quant.gather_quantize_both_1x128(x, self.source)

    def quantize_rowwise(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.gather_quantize_rowwise(x, self.source)

    def quantize_rowwise_and_groups(self, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return fp8_quant.gather_quantize_rowwise_and_groups(x, self.source, self.offsets)

    def quantize_token_groups(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.gather_quantize_token_groups(x, self.source, self.offsets)


@dataclass(frozen=True)
class AlignedTokenGroups(TokenGroups):
    """Token groups that already start on multiples of the kernels' row alignment (GroupedExperts' contract when its
    group_alignment is a multiple of it): no row moves. The buffer is x itself, with zero rows appended up to a
    multiple of the alignment inside the quantizer that reads it (a masked load, no copy). No GEMM reads the rows
    past the last group, nor writes them (DeepGEMM skips their blocks): outputs and input gradients keep there what
    the kernel left, as GroupedExperts' contract allows (torch._grouped_mm leaves them too), and nothing pays a pass
    over the output to zero them. Whatever they hold (NaN included) stays in them through the next GEMM: the 1x128
    tiles along the tokens never mix them with a group's rows (every group ends on a whole tile), and the wgrad GEMMs
    reduce over the groups' tokens only.
    TokenGroupPadding's index gathers, which this skips, ran at ~450 GB/s on an H200. Same operand methods as
    TokenGroupPadding."""

    num_tokens: int
    """T, the rows of x."""
    alignment: int
    """What the buffer's row count is rounded up to (the GEMMs need it aligned: a stride when transposed)."""

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x, contiguous: a GEMM reading it unquantized takes the groups where they are, whatever the row count."""
        return x.contiguous()

    def buffer(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMMs' buffer in x's dtype, rows a multiple of the alignment (for a quantizer that pads nothing itself:
        TE's): x itself where its rows are whole tiles (the MoE's expert buffer), else a copy with zero rows added."""
        return x.contiguous() if x.shape[0] % self.alignment == 0 else fp8_quant.pad_rows(x, self.alignment)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[rows, C] -> [T, C]: y itself where x's rows are whole tiles (the MoE's buffer), else a copy of its first T
        rows (an autograd Function's output may not be a view: callers may modify it in place). The rows past the last
        group hold whatever the GEMM left there."""
        return y if y.shape[0] == self.num_tokens else y[:self.num_tokens].clone()

    def quantize_rows_1x128(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.pad_quantize_rows_1x128(x, self.alignment)

    def quantize_cols_1x128(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.pad_quantize_cols_1x128(x, self.alignment)

    def quantize_both_1x128(self, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return fp8_quant.pad_quantize_both_1x128(x, self.alignment)

    def quantize_rowwise(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.pad_quantize_rowwise(x, self.alignment)

    def quantize_rowwise_and_groups(self, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return fp8_quant.pad_quantize_rowwise_and_groups(x, self.offsets, self.alignment)

    def quantize_token_groups(self, x: torch.Tensor) -> Fp8Tensor:
        return fp8_quant.pad_quantize_token_groups(x, self.offsets, self.alignment)


class InductorQuantizer:
    """The blockwise GEMMs' 1x128 operands from fp8_quant's inductor-compiled quantizers, with the groups' padding
    or gather fused in (grouped_fp8's default quantizer; te_quant.TEBlockQuantizer has the same methods)."""

    name = "inductor"

    def quantize_rows_1x128(self, groups: TokenGroups, x: torch.Tensor) -> Fp8Tensor:
        return groups.quantize_rows_1x128(x)

    def quantize_cols_1x128(self, groups: TokenGroups, x: torch.Tensor) -> Fp8Tensor:
        return groups.quantize_cols_1x128(x)

    def quantize_both_1x128(self, groups: TokenGroups, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return groups.quantize_both_1x128(x)


INDUCTOR_QUANTIZER = InductorQuantizer()


def token_groups(offsets: torch.Tensor, num_tokens: int, alignment: int,
                 aligned: bool) -> TokenGroups:
    """The GEMMs' view of x's token groups: as they are when the caller aligned them (`aligned`), else padded."""
    if aligned:
        return AlignedTokenGroups(offsets, num_tokens, alignment)
    return TokenGroupPadding.build(offsets, num_tokens, alignment)


def _prefetch_counts_for_wgrad(ctx, groups: TokenGroups, kernels) -> None:
    """Where the forward reads nothing on the host and the weight gradient's kernel will (DeepGEMM's), the group
    sizes start their way to the host now (TokenGroups.prefetch_counts)."""
    if ctx.needs_input_grad[1] and kernels.capturable and not kernels.capturable_backward:
        groups.prefetch_counts()


def _zero_empty_experts(grad_w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """An expert without tokens gets a zero weight gradient, whatever the kernel leaves there."""
    empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
    return torch.where(empty[:, None, None], 0, grad_w)


class WeightBlocks:
    """One blockwise expert weight's FP8 operands: the weight in 128x128 blocks (the forward GEMM's) and those blocks
    transposed (the dgrad GEMM's). Uncached, every forward quantizes the weight and every backward transposes the
    blocks. Cached (GroupedFP8Backend.cache_fp8_weights), the blocks are made at the first forward after an optimizer
    step (any torch.optim optimizer's: base.optimizer_steps, as fused AdamW leaves the weight's version alone) or an
    in-place write to the weight (its _version), their transpose at the first backward that needs it, and a step's
    other micro-batches reuse both; they stay allocated between steps. While a CUDA graph is captured the cache is
    bypassed: the captured forward quantizes the weight at every replay, and no tensor of the graph's pool is kept."""

    def __init__(self, cached: bool = False):
        self.cached = cached
        self._blocks: Fp8Tensor | None = None
        self._transposed: Fp8Tensor | None = None
        self._made_at: tuple[int, int] | None = None
        """(optimizer steps, the weight's version) when the blocks were made."""
        self._weight: weakref.ref | None = None
        """The weight they were made from (weakly): another weight may take its version numbers."""

    @torch.compiler.disable  # host state: traced, each optimizer step would recompile the graph
    def of(self, weight: torch.Tensor) -> Fp8Tensor:
        """weight [E, N, K] in 128x128 FP8 blocks: the cached blocks while they are current."""
        if not self.cached or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return fp8_quant.quantize_blocks_128x128(weight)
        now = (optimizer_steps(), weight._version)
        if self._blocks is None or now != self._made_at or self._weight() is not weight:
            self._blocks, self._transposed = fp8_quant.quantize_blocks_128x128(weight), None
            self._made_at, self._weight = now, weakref.ref(weight)
        return self._blocks

    @torch.compiler.disable
    def transposed(self, blocks: Fp8Tensor) -> Fp8Tensor:
        """`blocks` (what of() gave a forward) transposed into w^T's blocks, made once while they are the cached
        blocks; afresh for others (uncached, or made before the cache moved on)."""
        if self._blocks is None or blocks.data is not self._blocks.data:
            return fp8_quant.transpose_blocks(blocks)
        if self._transposed is None:
            self._transposed = fp8_quant.transpose_blocks(blocks)
        return self._transposed

    def stop_caching(self) -> None:
        """From now on quantize at every forward, and let go of the cached blocks."""
        self.cached, self._blocks, self._transposed, self._made_at, self._weight = False, None, None, None, None


UNCACHED = WeightBlocks()
"""The blockwise GEMMs' default: the weight quantized at every forward (keeps no state)."""


class BlockwiseGroupedMM(torch.autograd.Function):
    """y = x @ w[e]^T per expert row group, with forward, dgrad and wgrad block-scaled FP8 GEMMs.
    aligned: the caller's groups start on multiples of the kernels' row alignment, so the GEMMs read x and the
    gradient where they are (AlignedTokenGroups), and the rows of y and of x's gradient past the last group are
    unspecified (GroupedExperts' contract); otherwise the groups are padded on the GPU (a static row count), the
    padding gathered inside each quantizer (TokenGroupPadding), and those rows are zero. Each operand is quantized
    once, whole (1x128 tiles never cross an aligned group). Whether the group sizes are read on the host is the
    kernels' affair (their capturable flags).
    main_grad: the weight's FP32 gradient buffer, which the wgrad GEMM adds into in place (no weight gradient is
    returned then: no FP32 -> BF16 cast and no add by a hook per micro-batch), or a function the backward calls for it
    (GroupedExperts.main_grad_of).
    quantizer: what quantizes x and the output gradient in 1x128 tiles (InductorQuantizer, or TE's).
    weight_blocks: where the weight's FP8 blocks and their transpose come from (WeightBlocks, cached or not)."""

    @staticmethod
    def forward(ctx, x, weight, offsets, kernels, aligned=False, main_grad=None, quantizer=INDUCTOR_QUANTIZER,
                weight_blocks=UNCACHED):
        groups = token_groups(offsets, x.shape[0], kernels.row_alignment, aligned)
        _prefetch_counts_for_wgrad(ctx, groups, kernels)
        weight_fp8 = weight_blocks.of(weight)
        if ctx.needs_input_grad[1]:
            # The wgrad operand x^T (1x128 tiles along the tokens) comes from the same read of x.
            x_fp8, x_t = quantizer.quantize_both_1x128(groups, x)
            ctx.save_for_backward(weight_fp8.data, weight_fp8.scale, x_t.data, x_t.scale)
        else:
            x_fp8 = quantizer.quantize_rows_1x128(groups, x)
            ctx.save_for_backward(weight_fp8.data, weight_fp8.scale)
        y = kernels.m_grouped(x_fp8, weight_fp8, groups)
        ctx.groups, ctx.kernels, ctx.main_grad, ctx.quantizer = groups, kernels, main_grad, quantizer
        ctx.x_dtype, ctx.weight_dtype, ctx.weight_blocks = x.dtype, weight.dtype, weight_blocks
        return groups.unpad(y).to(_activation_dtype(x))

    @staticmethod
    def backward(ctx, grad_y):
        weight_data, weight_scale, *x_t = ctx.saved_tensors
        grad_x, grad_w = _blockwise_grads(ctx, grad_y, Fp8Tensor(weight_data, weight_scale),
                                          Fp8Tensor(*x_t) if x_t else None)
        return grad_x, grad_w, None, None, None, None, None, None


class DispatchedBlockwiseGroupedMM(torch.autograd.Function):
    """BlockwiseGroupedMM of the expert-sorted rows x[row_token], permuted in FP8 (DeepSeek-V3's FP8 dispatch, on one
    GPU): the tokens x [T, K] are quantized once in 1x128 tiles along K, and the fprop operand is their FP8 rows and
    scales gathered by row_token [R] (T for a group's padding rows): 1 byte per element moved where the BF16 dispatch
    copies 2 and quantizes each of a token's top-k copies. The tiles never mix rows, so a copied FP8 row is the copy
    quantized: output and dgrad are BlockwiseGroupedMM's on x[row_token] bit for bit, and the rows' dgrad is summed
    into their tokens as the BF16 gather's backward sums it (a scatter-add).

    The wgrad operand, x^T in 1x128 tiles along each expert's tokens, is quantized in the backward from x through the
    saved row index: exactly BlockwiseGroupedMM's, and nothing of the k-times permuted rows is held between forward
    and backward. x, the MoE's input, is saved by its router's GEMM anyway (the same tensor, unless autocast casts
    FP32 activations for that GEMM): the index (8 bytes a row) replaces BlockwiseGroupedMM's saved FP8 x^T (K bytes a
    row). DeepSeek-V3 rebuilds x^T from the FP8 rows instead (dequantize, transpose, quantize along the tokens: a
    second rounding it accepts) because under expert parallelism an expert's GPU receives only those rows; here the
    tokens are at hand. The price: the backward gathers 2 bytes an element of x where the FP8 rows would be 1.

    No host read of its own (the index has a static size); the kernels' as in BlockwiseGroupedMM. Groups start on
    multiples of kernels.row_alignment (the MoE pads them to the experts' group_alignment). quantizer quantizes the
    output gradient; the tokens and the wgrad operand stay fp8_quant's (a quantizer fused with the row gather).
    weight_blocks: as BlockwiseGroupedMM's."""

    @staticmethod
    def forward(ctx, x, weight, offsets, row_token, kernels, main_grad=None, quantizer=INDUCTOR_QUANTIZER,
                weight_blocks=UNCACHED):
        groups = AlignedTokenGroups(offsets, row_token.numel(), kernels.row_alignment)
        _prefetch_counts_for_wgrad(ctx, groups, kernels)
        source = fp8_quant.dispatch_source(row_token, x.shape[0], kernels.row_alignment)
        rows_fp8 = fp8_quant.gather_fp8_rows(fp8_quant.quantize_rows_1x128(x), source)
        weight_fp8 = weight_blocks.of(weight)
        y = kernels.m_grouped(rows_fp8, weight_fp8, groups)
        ctx.save_for_backward(weight_fp8.data, weight_fp8.scale, row_token, source,
                              x if ctx.needs_input_grad[1] else None)
        ctx.groups, ctx.kernels, ctx.main_grad, ctx.quantizer = groups, kernels, main_grad, quantizer
        ctx.x_dtype, ctx.weight_dtype, ctx.num_tokens = x.dtype, weight.dtype, x.shape[0]
        ctx.weight_blocks = weight_blocks
        return groups.unpad(y).to(_activation_dtype(x))

    @staticmethod
    def backward(ctx, grad_y):
        weight_data, weight_scale, row_token, source, x = ctx.saved_tensors
        x_t = fp8_quant.gather_quantize_cols_1x128(x, source) if x is not None else None
        grad_rows, grad_w = _blockwise_grads(ctx, grad_y, Fp8Tensor(weight_data, weight_scale), x_t)
        grad_x = None
        if grad_rows is not None:
            # The BF16 gather's backward: each token's rows summed into it, padding rows (those past the last group
            # included, whatever the GEMM left in them) into a dropped row.
            grad_x = grad_rows.new_zeros(ctx.num_tokens + 1, grad_rows.shape[1]).index_put_(
                (row_token,), grad_rows, accumulate=True)[:ctx.num_tokens]
        return grad_x, grad_w, None, None, None, None, None, None


def _blockwise_grads(ctx, grad_y: torch.Tensor, weight_fp8: Fp8Tensor,
                     x_t: Fp8Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gradient of the GEMM's rows, of the weight) for a blockwise forward whose ctx holds its token groups, kernels,
    main_grad, quantizer, weight blocks and dtypes; weight_fp8: the forward's; x_t: the wgrad operand, x^T in 1x128
    tiles along the tokens, where the weight needs a gradient. The weight's is None when the wgrad GEMM added it into
    main_grad."""
    groups, kernels, quantizer = ctx.groups, ctx.kernels, ctx.quantizer
    need_x, need_w = ctx.needs_input_grad[:2]
    if need_x and need_w:
        grad_fp8, grad_t = quantizer.quantize_both_1x128(groups, grad_y)
    elif need_x:
        grad_fp8 = quantizer.quantize_rows_1x128(groups, grad_y)
    elif need_w:
        grad_t = quantizer.quantize_cols_1x128(groups, grad_y)
    grad_x = grad_w = None
    if need_x:
        weight_t = ctx.weight_blocks.transposed(weight_fp8)  # the forward's, transposed
        grad_x = groups.unpad(kernels.m_grouped(grad_fp8, weight_t, groups)).to(ctx.x_dtype)
    if need_w and ctx.main_grad is not None:
        kernels.k_grouped(grad_t, x_t, groups, into=main_grad_now(ctx.main_grad))
    elif need_w:
        grad_w = kernels.k_grouped(grad_t, x_t, groups).to(ctx.weight_dtype)
    return grad_x, grad_w


class RowwiseGroupedMM(torch.autograd.Function):
    """y = x @ w[e]^T per expert row group with rowwise-scaled FP8 grouped GEMMs; wgrad optionally in BF16.
    Token groups start on multiples of 16 rows for every GEMM, as torch's FP8 grouped GEMM is used and tested:
    where they are when the caller aligned them (`aligned`; rows of y and of x's gradient past the last group then
    unspecified, as BlockwiseGroupedMM's), else padded by a row gather fused into each quantizer; nothing syncs with
    the host."""

    @staticmethod
    def forward(ctx, x, weight, offsets, kernels, high_precision_wgrad, aligned=False):
        groups = token_groups(offsets, x.shape[0], RECIPE_ALIGNMENT["rowwise"], aligned)
        if ctx.needs_input_grad[1] and not high_precision_wgrad:
            # The wgrad operand (x^T scaled per token group and column) from the same read of x, saved
            # in FP8 instead of x.
            x_fp8, x_groups = groups.quantize_rowwise_and_groups(x)
            saved = (x_groups.data, x_groups.scale)
        else:
            x_fp8 = groups.quantize_rowwise(x)
            saved = (x,) if ctx.needs_input_grad[1] else ()
        y = kernels.m_grouped(x_fp8, fp8_quant.quantize_rowwise_weight(weight), groups.offsets)
        ctx.save_for_backward(weight, offsets, *saved)
        ctx.groups, ctx.kernels, ctx.x_dtype = groups, kernels, x.dtype
        ctx.high_precision_wgrad = high_precision_wgrad
        return groups.unpad(y).to(_activation_dtype(x))

    @staticmethod
    def backward(ctx, grad_y):
        weight, offsets, *saved = ctx.saved_tensors
        groups, kernels, high_precision = ctx.groups, ctx.kernels, ctx.high_precision_wgrad
        need_x, need_w = ctx.needs_input_grad[:2]
        fp8_wgrad = need_w and not high_precision
        if need_x and fp8_wgrad:
            grad_fp8, grad_groups = groups.quantize_rowwise_and_groups(grad_y)
        elif need_x:
            grad_fp8 = groups.quantize_rowwise(grad_y)
        elif fp8_wgrad:
            grad_groups = groups.quantize_token_groups(grad_y)
        grad_x = grad_w = None
        if need_x:
            # dgrad reduces over N: w^T [E, K, N] scaled per row.
            grad_x = kernels.m_grouped(grad_fp8, fp8_quant.quantize_rowwise_transposed(weight), groups.offsets)
            grad_x = groups.unpad(grad_x).to(ctx.x_dtype)
        if need_w:
            if high_precision:
                grad_padded = groups.pad(grad_y.to(torch.bfloat16))
                x_padded = groups.pad(saved[0].to(torch.bfloat16))
                grad_w = torch._grouped_mm(grad_padded.t(), x_padded, offs=groups.offsets)
            else:
                grad_w = kernels.k_grouped(grad_groups, Fp8Tensor(*saved), groups.offsets)
            grad_w = _zero_empty_experts(grad_w, offsets).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


class Float8GroupedExperts(GroupedExperts):
    """GroupedExperts whose planned GEMMs run in FP8; the same Parameter objects as the module it replaces.
    A GEMM with no recipe (the plan keeps it BF16) runs GroupedExperts' torch._grouped_mm. With
    wgrad_into_main_grad (GroupedFP8Backend.hand_over_main_grads) the blockwise and BF16 wgrad GEMMs add into their
    weights' FP32 main_grad; the rowwise recipes' still return their weight gradients. With permutes_tokens (the
    backend's fp8_dispatch, for a blockwise w13) the MoE hands it the tokens, and w13 reads their rows in FP8
    (DispatchedBlockwiseGroupedMM). blockwise_quantizer quantizes the blockwise GEMMs' activations and gradients.
    weight_blocks: each blockwise GEMM's WeightBlocks ('w13', 'w2'), cached with the backend's cache_fp8_weights."""

    blockwise_quantizer = INDUCTOR_QUANTIZER
    weight_blocks: dict[str, WeightBlocks] = {}

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, row_token: torch.Tensor | None = None) -> torch.Tensor:
        """GroupedExperts.forward; with row_token (permutes_tokens), x is the tokens [T, D] and row_token [R] the token
        of each expert-sorted row (T for padding rows), gathered as FP8 rows by the w13 GEMM."""
        if row_token is None:
            return super().forward(x, offsets)
        return self.grouped_mm(self.act(self._dispatched_w13(x, offsets, row_token)), self.w2, offsets)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gemm = "w13" if weight is self.w13 else "w2"
        recipe = self.recipes.get(gemm)
        if recipe is None:
            return super().grouped_mm(x, weight, offsets)
        if recipe == "blockwise":
            aligned = self.group_alignment % self.blockwise_kernels.row_alignment == 0
            return BlockwiseGroupedMM.apply(x, weight, offsets, self.blockwise_kernels, aligned,
                                            self.main_grad_of(weight), self.blockwise_quantizer,
                                            self.weight_blocks.get(gemm, UNCACHED))
        aligned = self.group_alignment % RECIPE_ALIGNMENT[recipe] == 0
        return RowwiseGroupedMM.apply(x, weight, offsets, self.rowwise_kernels, recipe == "rowwise_gw_hp", aligned)

    def _dispatched_w13(self, tokens: torch.Tensor, offsets: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
        kernels = self.blockwise_kernels
        if self.group_alignment % kernels.row_alignment:
            raise ValueError(f"group_alignment={self.group_alignment}: the FP8 dispatch reads expert groups where they "
                             f"start, so they must start on multiples of {kernels.row_alignment} ({kernels.name}'s "
                             "rows): set group_alignment to a multiple of it")
        return DispatchedBlockwiseGroupedMM.apply(tokens, self.w13, offsets, row_token, kernels,
                                                  self.main_grad_of(self.w13), self.blockwise_quantizer,
                                                  self.weight_blocks.get("w13", UNCACHED))

    @classmethod
    def from_experts(cls, experts: GroupedExperts, recipes: dict[str, str], blockwise_kernels,
                     rowwise_kernels, fp8_dispatch: bool = False, blockwise_quantizer=INDUCTOR_QUANTIZER,
                     cache_fp8_weights: bool = False) -> "Float8GroupedExperts":
        """Wrap `experts`' parameters; `recipes` maps 'w13' / 'w2' to an expert recipe. fp8_dispatch: permute the
        tokens in FP8 into a blockwise w13 (permutes_tokens; no effect on another w13). blockwise_quantizer: what
        quantizes the blockwise GEMMs' activations and gradients (InductorQuantizer, or te_quant's).
        cache_fp8_weights: the blockwise weights' FP8 blocks made once per optimizer step (WeightBlocks)."""
        with torch.device("meta"):
            new = cls(experts.w13.shape[2], experts.w2.shape[2], experts.num_experts)
        new.w13, new.w2 = experts.w13, experts.w2
        new.recipes = dict(recipes)
        new.blockwise_kernels, new.rowwise_kernels = blockwise_kernels, rowwise_kernels
        new.group_alignment = max([experts.group_alignment, *(
            blockwise_kernels.row_alignment if r == "blockwise" else RECIPE_ALIGNMENT[r] for r in recipes.values())])
        new.permutes_tokens = fp8_dispatch and recipes.get("w13") == "blockwise"
        new.blockwise_quantizer = blockwise_quantizer
        new.weight_blocks = {gemm: WeightBlocks(cache_fp8_weights) for gemm, recipe in recipes.items()
                             if recipe == "blockwise"}
        if cache_fp8_weights:
            count_optimizer_steps()
        new.train(experts.training)
        return new

    def kernels_of(self, recipe: str):
        """The kernels object running `recipe`'s GEMMs."""
        return self.blockwise_kernels if recipe == "blockwise" else self.rowwise_kernels

    def cuda_graph_blocker(self, backward: bool) -> str:
        """'' when the forward (and the backward, with backward=True) reads nothing on the host and can be
        captured in a CUDA graph; otherwise why not and what to do instead, one line."""
        for recipe in sorted(set(self.recipes.values())):
            kernels = self.kernels_of(recipe)
            if not kernels.capturable or (backward and not kernels.capturable_backward):
                return f"grouped_fp8 {recipe} experts on {kernels.name}: {kernels.capture_note}"
        return ""

    def extra_repr(self) -> str:
        kernels = {r: self.kernels_of(r).name for r in self.recipes.values()}
        dispatch = ", fp8_dispatch=True" if self.permutes_tokens else ""
        quantizer = self.blockwise_quantizer.name
        quantizer = "" if quantizer == INDUCTOR_QUANTIZER.name else f", quantizer={quantizer}"
        cache = ", cache_fp8_weights=True" if self.caches_fp8_weights else ""
        return (f"recipes={self.recipes}, kernels={kernels}, group_alignment={self.group_alignment}{dispatch}"
                f"{quantizer}{cache}")

    @property
    def caches_fp8_weights(self) -> bool:
        """Whether a blockwise weight's FP8 blocks are kept across a step's micro-batches (WeightBlocks)."""
        return any(blocks.cached for blocks in self.weight_blocks.values())


@dataclass
class GroupedFP8Backend(Backend):
    """Swaps the GroupedExperts a plan assigns to grouped_fp8 for Float8GroupedExperts."""

    kernels: str = "auto"
    """Blockwise GEMM kernels: auto (DeepGEMM when importable, else torch), torch, or deepgemm."""
    fp8_dispatch: bool = False
    """Experts whose w13 runs blockwise take their MoE's tokens, quantize each once and gather its FP8 rows for the
    top-k experts (DeepSeek-V3's FP8 dispatch, on one GPU; DispatchedBlockwiseGroupedMM), where the BF16 dispatch
    copies BF16 rows and quantizes every copy. Off until a GPU measures it faster
    (fp8stack.bench.experts_breakdown --moe)."""
    quantizer: str = "auto"
    """What quantizes the blockwise experts' activations and output gradients in 1x128 tiles, rows and columns:
    inductor (fp8_quant's compiled quantizers), te (TE's Float8BlockQuantizer kernel; DeepGEMM's kernels only,
    te_quant), or auto: te where TE imports and the blockwise GEMMs run on DeepGEMM, else inductor, with the reason
    in the conversion notes. te is the faster (TE_QUANTIZER_EVIDENCE) and writes the same bytes."""
    cache_fp8_weights: bool = True
    """Quantize each blockwise expert weight to its 128x128 FP8 blocks at the first forward after an optimizer step
    (any torch.optim optimizer's) or a write to the weight, transpose them at the first backward, and reuse both for
    the step's other micro-batches (WeightBlocks; TE's is_first_microbatch for its modules): one quantization and one
    transpose per step instead of one per micro-batch, the same bytes. The copies stay allocated between steps (2
    bytes per weight element); fp8stack's trainer turns it on with more than one micro-batch per step only. Bypassed
    while a CUDA graph is captured, off under fully_shard (before_fully_shard says why); the rowwise recipes quantize
    their weights at every forward. Measured faster on one H200 (the runs: GroupedFP8Config.cache_fp8_weights in
    fp8stack.config)."""
    wgrad_flatten: str = "auto"
    """What lays out the blockwise wgrad GEMM's operands on DeepGEMM (K-grouped, expert by expert): copies (one per
    expert, launched from the host), compiled (one compiled gather per operand, deepgemm.flatten_k_grouped_compiled)
    or triton (one Triton tile copy per operand, deepgemm.flatten_k_grouped_triton); the same bytes. auto: triton
    where Triton runs, measured the fastest (GroupedFP8Config.wgrad_flatten in fp8stack.config names the runs), the
    copies elsewhere; it is no ask, so nothing refuses it where no DeepGEMM wgrad runs."""

    name = "grouped_fp8"

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"grouped_fp8 kernels={self.kernels!r}: use one of {', '.join(KERNEL_CHOICES)}")
        if self.quantizer not in EXPERT_QUANTIZERS:
            raise ValueError(f"grouped_fp8 quantizer={self.quantizer!r}: use one of {', '.join(EXPERT_QUANTIZERS)}")
        if self.wgrad_flatten not in WGRAD_FLATTENS:
            raise ValueError(f"grouped_fp8 wgrad_flatten={self.wgrad_flatten!r}: use one of "
                             f"{', '.join(WGRAD_FLATTENS)}")
        if self.wgrad_flatten not in ("auto", "copies") and self.kernels == "torch":
            raise ValueError(f"grouped_fp8 wgrad_flatten={self.wgrad_flatten} lays out DeepGEMM's wgrad operands, and "
                             "kernels=torch runs torch's scaled_mm per expert: use kernels deepgemm (or auto with "
                             "DeepGEMM installed), or wgrad_flatten auto")
        if self.quantizer == "te" and self.kernels == "torch":
            raise ValueError("grouped_fp8 quantizer=te lays TE's operands out for DeepGEMM, and kernels=torch runs "
                             "torch's scaled_mm: use kernels deepgemm (or auto with DeepGEMM installed), or quantizer "
                             "inductor")

    def hand_over_main_grads(self, model: nn.Module) -> None:
        """Master weights give every weight an FP32 main_grad: the blockwise experts' wgrad GEMMs add into it
        themselves from now on (DeepGEMM's K-grouped kernel accumulates in place; torch's adds per expert), and so do
        the BF16 GEMMs of a converted module."""
        for module in model.modules():
            if isinstance(module, Float8GroupedExperts):
                module.wgrad_into_main_grad = True

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, ("no CUDA GPU: grouped_fp8 runs torch's FP8 grouped GEMMs (sm90/sm100) and block-scaled "
                           "GEMMs (sm90); run on a Hopper GPU, or plan the experts in BF16 (--recipe bf16)")
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) not in ((9, 0), (10, 0)):
            return False, (f"GPU is sm{major}{minor}: torch's FP8 grouped GEMMs run on sm90 and sm100 only; "
                           "plan the experts in BF16 on this GPU")
        if self.kernels == "deepgemm":
            library, why = deepgemm.load()
            if library is None:
                return False, why
        if self.quantizer == "te":
            from fp8stack.backends import te_quant

            make, why = te_quant.load()
            if make is None:
                return False, why
        return True, ""

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        recipes: dict[str, dict[str, str]] = {}
        for d in decisions:
            module_fqn, gemms = _expert_gemms(model, d)
            for gemm in gemms:
                recipes.setdefault(module_fqn, {})[gemm] = d.recipe
        for module_fqn, gemm_recipes in recipes.items():  # all checks before the first swap
            _check_shapes(module_fqn, model.get_submodule(module_fqn), gemm_recipes)
        used = {r for per_module in recipes.values() for r in per_module.values()}
        blockwise_kernels, without_deepgemm = self._blockwise_kernels() if "blockwise" in used else (None, "")
        rowwise_kernels = TorchRowwiseKernels() if used - {"blockwise"} else None
        quantizer, quantizer_notes = self._blockwise_quantizer(blockwise_kernels, without_deepgemm)
        dispatch_notes = self._dispatch_notes(recipes)
        flatten_notes = self._wgrad_flatten_notes(blockwise_kernels, without_deepgemm)
        for module_fqn, gemm_recipes in recipes.items():
            new = Float8GroupedExperts.from_experts(model.get_submodule(module_fqn), gemm_recipes,
                                                    blockwise_kernels, rowwise_kernels, self.fp8_dispatch, quantizer,
                                                    self.cache_fp8_weights)
            model = swap_module(model, module_fqn, new)
        cached = sum(recipe == "blockwise" for gemm_recipes in recipes.values() for recipe in gemm_recipes.values())
        cache_notes = [f"cache_fp8_weights: {cached} blockwise expert weight(s) quantized to FP8 blocks once per "
                       "optimizer step and reused, with their transpose, by the step's other micro-batches"
                       ] if self.cache_fp8_weights and cached else []
        record = ConversionRecord(backend=self.name, recipe=",".join(sorted(used)),
                                  converted={d.fqn: Float8GroupedExperts.__name__ for d in decisions},
                                  notes=_notes(plan, blockwise_kernels, rowwise_kernels, without_deepgemm)
                                  + dispatch_notes + quantizer_notes + flatten_notes + cache_notes if used else [])
        return model, record

    def before_fully_shard(self, model: nn.Module, gathered_dtype: torch.dtype | None, *,
                           keeps_gathered: bool = False) -> list[str]:
        """Switch the FP8 weight cache off: fully_shard frees each gathered weight after its use, and the cache would
        keep a full-size FP8 copy of every sharded expert weight, and its transpose, on every rank between steps
        (with keeps_gathered too: not measured for experts)."""
        cached = [module for module in model.modules()
                  if isinstance(module, Float8GroupedExperts) and module.caches_fp8_weights]
        for module in cached:
            for blocks in module.weight_blocks.values():
                blocks.stop_caching()
        if not cached:
            return []
        return [f"cache_fp8_weights: off for {len(cached)} experts module(s) under fully_shard: the cache would keep "
                "a full-size FP8 copy of each sharded expert weight on every rank between steps"]

    def _blockwise_quantizer(self, blockwise_kernels, without_deepgemm: str) -> tuple[object, list[str]]:
        """(the blockwise experts' 1x128 quantizer, its conversion notes): INDUCTOR_QUANTIZER, or TE's. Quantizer te
        is refused (before any swap) unless the plan runs blockwise experts on DeepGEMM and TE imports; auto takes
        te where it can run and says why not where it cannot."""
        if self.quantizer == "inductor" or (self.quantizer == "auto" and blockwise_kernels is None):
            return INDUCTOR_QUANTIZER, []
        if blockwise_kernels is None:
            raise PlanError("grouped_fp8 quantizer=te quantizes blockwise expert GEMMs' operands, and this plan gives "
                            "grouped_fp8 none: plan the experts blockwise (--fp8-recipe blockwise --expert-backend "
                            "grouped_fp8), or use quantizer inductor")
        from fp8stack.backends import te_quant

        if not isinstance(blockwise_kernels, deepgemm.DeepGemmKernels):
            why = (f"TE's operands are laid out for DeepGEMM, and the blockwise GEMMs run on {blockwise_kernels.name} "
                   f"({without_deepgemm or 'kernels torch'})")
            if self.quantizer == "auto":
                return INDUCTOR_QUANTIZER, [f"quantizer auto: inductor, since {why}"]
            raise BackendUnavailable(f"grouped_fp8 quantizer=te: {why}: install DeepGEMM, or use quantizer inductor")
        make, why = te_quant.load()
        if make is None:
            if self.quantizer == "auto":
                return INDUCTOR_QUANTIZER, [f"quantizer auto: inductor, since {why}"]
            raise BackendUnavailable(why)
        return te_quant.TEBlockQuantizer(make), [f"quantizer {self.quantizer}: {TE_QUANTIZER_NOTE}"]

    def _dispatch_notes(self, recipes: dict[str, dict[str, str]]) -> list[str]:
        """What fp8_dispatch does to the experts of `recipes` (module -> GEMM -> recipe); a PlanError when it can
        do nothing: no w13 runs blockwise."""
        if not self.fp8_dispatch:
            return []
        dispatched = [fqn for fqn, gemms in recipes.items() if gemms.get("w13") == "blockwise"]
        if not dispatched:
            raise PlanError("grouped_fp8 fp8_dispatch feeds FP8 rows to blockwise w13 expert GEMMs, and this plan "
                            "gives grouped_fp8 none: plan the experts blockwise (--fp8-recipe blockwise "
                            "--expert-backend grouped_fp8), or drop fp8_dispatch")
        notes = [f"fp8_dispatch: {len(dispatched)} experts module(s) take their MoE's tokens, quantized once in 1x128 "
                 "tiles, and gather the FP8 rows into their blockwise w13 GEMM (the MoE must pass its tokens, as "
                 "fp8stack's MoE does for experts with permutes_tokens)"]
        rest = {fqn: gemms.get("w13", BF16) for fqn, gemms in recipes.items() if fqn not in dispatched}
        if rest:
            notes.append("fp8_dispatch: " + ", ".join(f"{fqn} (w13 {recipe})" for fqn, recipe in rest.items())
                         + " keep the BF16 dispatch: the FP8 rows feed a blockwise w13 only")
        return notes

    def _wgrad_flatten_notes(self, blockwise_kernels, without_deepgemm: str) -> list[str]:
        """What wgrad_flatten does to the plan's blockwise experts (auto: only where DeepGEMM runs them); a PlanError
        when compiled or triton is asked for and the plan has none."""
        on_deepgemm = isinstance(blockwise_kernels, deepgemm.DeepGemmKernels)
        if self.wgrad_flatten == "copies" or (self.wgrad_flatten == "auto" and not on_deepgemm):
            return []
        if self.wgrad_flatten == "auto":
            how = ("one Triton tile copy each on CUDA, not a copy per expert" if deepgemm.TRITON_IMPORTABLE else
                   "a copy per expert, since triton is not importable")
            return [f"wgrad_flatten auto: DeepGEMM's K-grouped wgrad operands laid out by {how}"]
        if blockwise_kernels is None:
            raise PlanError(f"grouped_fp8 wgrad_flatten={self.wgrad_flatten} lays out blockwise expert GEMMs' wgrad "
                            "operands, and this plan gives grouped_fp8 none: plan the experts blockwise "
                            "(--fp8-recipe blockwise --expert-backend grouped_fp8), or leave wgrad_flatten at auto")
        if not isinstance(blockwise_kernels, deepgemm.DeepGemmKernels):
            return [f"wgrad_flatten {self.wgrad_flatten}: no effect, the blockwise GEMMs run on "
                    f"{blockwise_kernels.name} ({without_deepgemm}), which slice each expert's operands themselves"]
        return [f"wgrad_flatten {self.wgrad_flatten}: DeepGEMM's K-grouped wgrad operands laid out by "
                f"{FLATTEN_KERNELS[self.wgrad_flatten]} each, not a copy per expert"]

    def _blockwise_kernels(self) -> tuple:
        """(the blockwise kernels, why DeepGEMM is not among them when auto fell back to torch's, else '')."""
        if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
            raise BackendUnavailable("the blockwise recipe's grouped GEMMs (torch's DeepSeek-style scaled_mm and "
                                     "DeepGEMM with FP32 scales) run on sm90 only; use recipe mxfp8 on sm100")
        if self.kernels == "torch":
            return TorchBlockwiseKernels(), ""
        library, why = deepgemm.load()
        if library is None and self.kernels == "auto":
            return TorchBlockwiseKernels(), why
        # kernels deepgemm without it: BackendUnavailable naming why
        return deepgemm.DeepGemmKernels(library, self.wgrad_flatten), ""


TE_QUANTIZER_EVIDENCE = "profiles/runs/2026-11-28-backends-moe-medium-quantizers-h200"
"""The expert block timed on both quantizers in one run, at two shapes (fp8stack.bench.backends)."""
TE_QUANTIZER_NOTE = ("the blockwise experts' activations and output gradients are quantized by TE's "
                     "Float8BlockQuantizer (1x128, exact scales, the inductor quantizers' bytes), rows and columns in "
                     f"one kernel: the faster quantizer ({TE_QUANTIZER_EVIDENCE})")


def _expert_gemms(model: nn.Module, d: Decision) -> tuple[str, tuple[str, ...]]:
    """(fqn of the GroupedExperts, which of its GEMMs) a grouped_fp8 decision names."""
    if d.recipe not in RECIPE_ALIGNMENT:
        raise PlanError(f"plan gives {d.fqn} recipe {d.recipe!r} on grouped_fp8, which runs only "
                        f"{', '.join(RECIPE_ALIGNMENT)}: regenerate the plan")
    parent, _, leaf = d.fqn.rpartition(".")
    candidates = [(parent, (leaf,))] if leaf in ("w13", "w2") else []
    for module_fqn, gemms in [*candidates, (d.fqn, ("w13", "w2"))]:
        try:
            module = model.get_submodule(module_fqn)
        except AttributeError:
            continue
        if isinstance(module, Float8GroupedExperts):
            raise PlanError(f"{module_fqn} is already a Float8GroupedExperts: convert each model once")
        if isinstance(module, GroupedExperts):
            return module_fqn, gemms
        raise PlanError(f"plan assigns {d.fqn} to grouped_fp8, but the model's {module_fqn or 'root'} is a "
                        f"{type(module).__name__}, not a GroupedExperts: grouped_fp8 runs only grouped expert "
                        "GEMMs, so give this component another backend (or fix the model description)")
    raise PlanError(f"plan assigns {d.fqn} to grouped_fp8, but the model has no such module or parameter: "
                    "the model description does not match the model")


def _check_shapes(module_fqn: str, experts: GroupedExperts, recipes: dict[str, str]) -> None:
    for gemm, recipe in recipes.items():
        n, k = getattr(experts, gemm).shape[1:]
        need = RECIPE_ALIGNMENT[recipe]
        if n % need or k % need:
            raise PlanError(f"{module_fqn}.{gemm} is {n}x{k}; {recipe} grouped FP8 GEMMs need both dims divisible "
                            f"by {need}: keep it BF16 in the plan")




def _notes(plan: Plan, blockwise_kernels, rowwise_kernels, without_deepgemm: str = "") -> list[str]:
    notes = []
    for recipe, kernels in (("blockwise", blockwise_kernels), ("rowwise", rowwise_kernels)):
        if kernels is not None:
            graphs = f"; {kernels.capture_note}" if kernels.capture_note else "; capturable in a CUDA graph"
            notes.append(f"{recipe} expert GEMMs run on {kernels.name}{graphs}")
    if without_deepgemm:
        notes.append(f"not on DeepGEMM: {without_deepgemm}")
    if plan.fp8_format != "e4m3":
        notes.append(f"plan asks fp8_format {plan.fp8_format}, but grouped_fp8 runs gradients in E4M3 too: "
                     "its kernels take no E5M2 operands (as in DeepSeek-V3, fine-grained scales keep the range)")
    return notes
