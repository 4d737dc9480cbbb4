"""The K-grouped layout of DeepGEMM's wgrad operands from one hand-written Triton kernel (grouped_fp8's
wgrad_flatten "triton"): the bytes of deepgemm.flatten_k_grouped, which it is tested against.

Why a kernel of our own: the layout is a pure copy, [dim, tokens] -> expert by expert [dim, expert_tokens], so it
can run at memory bandwidth, and neither choice did on an H200: the copy per expert moved ~1.8 TB/s and the compiled
gather ~1.3 TB/s, computing each element's expert from the group ends
(profiles/runs/2026-11-29-experts-breakdown-deepgemm-h200-te-quantizer-compiled-wgrad-flatten-busy). Here each
program copies one tile of whole token blocks that lie in one expert (DeepGEMM's groups are multiples of 128 tokens),
so the expert is found once per tile and the tile's rows are copied contiguously, in 8-byte words.

Imported only when that choice runs (triton is not a dependency of the CPU install)."""

import torch
import triton
import triton.language as tl

ROWS = 64
"""Operand rows (the GEMM's M or N) per program."""
MAX_TILE = 16
"""Units (8-byte words, or elements) per tile row: 128 FP8 tokens, one DeepGEMM token block."""


@triton.jit
def _k_grouped_tiles(source, out, ends, row_stride, col_stride, dim, experts,
                     EXPERTS: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
    first = tl.program_id(0) * TILE  # the tile's first column (unit) of the tokens
    # Its expert: the groups ending at or before it (an empty group ends where the previous one does).
    expert_ends = tl.load(ends + tl.arange(0, EXPERTS), mask=tl.arange(0, EXPERTS) < experts, other=0)
    expert = tl.sum(((expert_ends <= first) & (tl.arange(0, EXPERTS) < experts)).to(tl.int32), axis=0)
    start = tl.load(ends + expert - 1, mask=expert > 0, other=0)
    count = tl.load(ends + expert) - start
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, TILE)[None, :]
    inside = rows < dim
    tile = tl.load(source + rows * row_stride + (first + cols) * col_stride, mask=inside)
    # Expert e's block fills out[dim * start_e:dim * end_e], row by row, its tokens innermost.
    tl.store(out + dim * start + rows * count + (first - start) + cols, tile, mask=inside)


def flatten_k_grouped_tiles(source: torch.Tensor, units: list[int], ends: torch.Tensor) -> torch.Tensor:
    """source [dim, >= sum(units)] (8-byte words or elements) -> 1-D: expert by expert, its [dim, units_e] block,
    the units innermost; ends: the groups' cumulative ends (int64 [E]) on source's device. The tile is the largest
    power of two up to MAX_TILE that divides every group."""
    dim, total = source.shape[0], sum(units)
    out = source.new_empty(dim * total)
    if not out.numel():
        return out
    tile = MAX_TILE
    while any(count % tile for count in units):
        tile //= 2
    grid = (total // tile, triton.cdiv(dim, ROWS))
    _k_grouped_tiles[grid](source, out, ends, source.stride(0), source.stride(1), dim, len(units),
                           EXPERTS=triton.next_power_of_2(len(units)), TILE=tile, ROWS=ROWS)
    return out
