"""Fused FP8 quantization for grouped_fp8: the eager quantizers of blockwise.py (and the rowwise ones
here), compiled by inductor into one or two kernels each on CUDA tensors.

Eager, each quantizer is ~7 full passes over its input (float(), pad, abs, amax, mul, clamp, to) plus a
strided copy for a transposed operand; compiled, it reads the input once or twice and writes only the
FP8 data and scales. A `fused` function runs the compiled graph on CUDA tensors (compiled lazily on the
first CUDA call, once per process and input shape family: the row dim is marked dynamic, so changing
expert group sizes never recompile) and the same Python eagerly on CPU; `.compiled` runs the compiled
graph on any device (the CPU tests compare it with the eager path bit for bit).
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8stack.backends.blockwise import Fp8Tensor, cast_to_fp8, decode_scale, quantize_1x128, quantize_128x128


# Inductor's on-disk graph and autotuning caches would hand a process the Triton kernels another process compiled
# and tuned for its first (dynamic-dim) sizes: after the GPU tests' small expert groups, the expert benchmark's
# quantizers ran 2.3x slower (profiles/runs/2026-11-23-experts-inductor-cache-h200/). Each process compiles for
# the sizes it sees first. Inductor's coalesce tiling analysis asserts on the dynamic row count of a padded operand
# (pytorch/pytorch#181563, fixed after torch 2.11; the aligned quantizers' GPU tests failed in
# profiles/runs/2026-11-28-gpu-tests-moe-h200/); it only chooses a tiling, so it is off for these graphs.
PER_PROCESS_COMPILE = {"fx_graph_cache": False, "autotune_local_cache": False,
                       "triton.coalesce_tiling_analysis": False}


def fused(dynamic_dims: tuple[int, ...] = (0,)) -> Callable:
    """Decorator: the function compiled (fullgraph) for CUDA inputs, eager for others. Tensor arguments'
    `dynamic_dims` (the token dim) are marked dynamic so new group sizes reuse the compiled kernels."""

    def wrap(fn: Callable) -> Callable:
        @functools.cache
        def compiled() -> Callable:
            return torch.compile(fn, fullgraph=True, options=PER_PROCESS_COMPILE)

        def run_compiled(*args):
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    for dim in dynamic_dims:
                        if dim < arg.dim():
                            torch._dynamo.maybe_mark_dynamic(arg, dim)
            return compiled()(*args)

        @functools.wraps(fn)
        def run(*args):
            # Inside an outer torch.compile the eager code is traced and fused there.
            if args[0].is_cuda and not torch.compiler.is_compiling():
                return run_compiled(*args)
            return fn(*args)

        run.compiled = run_compiled
        run.eager = fn
        return run

    return wrap


# ---- blockwise (DeepSeek-V3): 1x128 tiles along the reduction dim, 128x128 weight blocks -----------------

@fused()
def quantize_both_1x128(x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(quantize_1x128(x), quantize_1x128(x.t())) from one read of x [R, C]: the operand of a GEMM reducing
    over C and of one reducing over R (a weight gradient)."""
    return quantize_1x128(x), quantize_1x128(x.t())


@fused()
def gather_quantize_rows_1x128(x: torch.Tensor, source: torch.Tensor) -> Fp8Tensor:
    """quantize_1x128(gather_rows(x, source)): the padded operand of a GEMM reducing over the last dim,
    without materializing the padded copy."""
    return quantize_1x128(gather_rows(x, source))


@fused()
def gather_quantize_cols_1x128(x: torch.Tensor, source: torch.Tensor) -> Fp8Tensor:
    """quantize_1x128(gather_rows(x, source).t()): the padded operand of a GEMM reducing over the rows (tokens)."""
    return quantize_1x128(gather_rows(x, source).t())


@fused()
def gather_quantize_both_1x128(x: torch.Tensor, source: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Both 1x128 forms of the padded x from one read: gather_quantize_rows_1x128 and gather_quantize_cols_1x128."""
    padded = gather_rows(x, source)
    return quantize_1x128(padded), quantize_1x128(padded.t())


def pad_rows(x: torch.Tensor, alignment: int) -> torch.Tensor:
    """x [T, C] with zero rows appended up to a multiple of `alignment`: the token buffer of groups that already
    start where the GEMMs need them, whose row count the GEMMs still need aligned. Inside a fused quantizer the
    zeros are a masked load of x, not a copy."""
    return F.pad(x, (0, 0, 0, -x.shape[0] % alignment))


@fused()
def pad_quantize_rows_1x128(x: torch.Tensor, alignment: int) -> Fp8Tensor:
    """quantize_1x128(pad_rows(x, alignment)): gather_quantize_rows_1x128 for groups that are aligned already."""
    return quantize_1x128(pad_rows(x, alignment))


@fused()
def pad_quantize_cols_1x128(x: torch.Tensor, alignment: int) -> Fp8Tensor:
    """quantize_1x128(pad_rows(x, alignment).t()): gather_quantize_cols_1x128 for groups that are aligned already."""
    return quantize_1x128(pad_rows(x, alignment).t())


@fused()
def pad_quantize_both_1x128(x: torch.Tensor, alignment: int) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Both 1x128 forms of pad_rows(x, alignment) from one read: gather_quantize_both_1x128 for aligned groups."""
    padded = pad_rows(x, alignment)
    return quantize_1x128(padded), quantize_1x128(padded.t())


@fused(dynamic_dims=())
def quantize_blocks_128x128(w: torch.Tensor) -> Fp8Tensor:
    """quantize_128x128(w) of the whole [E, N, K] weight."""
    return quantize_128x128(w)


@fused(dynamic_dims=())
def _transposed_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.transpose(-2, -1).contiguous()


def transpose_blocks(w: Fp8Tensor) -> Fp8Tensor:
    """quantize_blocks_128x128(w^T) from w's quantization: a 128x128 block of w^T is a block of w transposed.
    The data moves as bytes through one compiled transpose on CUDA (torch copies strided FP8 a byte per thread)."""
    data = _transposed_bytes(w.data.view(torch.uint8)).view(w.data.dtype)
    return Fp8Tensor(data, w.scale.transpose(-2, -1).contiguous())


# ---- FP8 dispatch: each token quantized once, its rows moved as FP8 ------------------------------------------

@fused()
def quantize_rows_1x128(x: torch.Tensor) -> Fp8Tensor:
    """quantize_1x128(x) as one kernel: the tokens of an FP8 dispatch, quantized once before their rows are copied."""
    return quantize_1x128(x)


def dispatch_source(row_token: torch.Tensor, num_tokens: int, alignment: int) -> torch.Tensor:
    """The token each row of an FP8 dispatch's buffer reads, -1 for a zero row: row_token [R] (num_tokens marks the
    padding rows of its groups) in gather_rows' convention, with -1 rows appended up to a multiple of `alignment`
    (the GEMMs need the buffer's row count aligned). Static size: no host read."""
    source = torch.where(row_token < num_tokens, row_token, -1)
    return F.pad(source, (0, -source.numel() % alignment), value=-1)


@fused()
def _gather_code_rows(codes: torch.Tensor, scale: torch.Tensor,
                      source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (source >= 0).unsqueeze(1)
    index = source.clamp_min(0)
    return torch.where(keep, codes[index], 0), torch.where(keep, scale[index], 1.0)


def gather_fp8_rows(t: Fp8Tensor, source: torch.Tensor) -> Fp8Tensor:
    """Rows of a 1x128-quantized [T, K] by source (-1: a zero row), data and scales together, 1 byte per element
    moved where a BF16 row copy moves 2. Bit for bit quantize_1x128(gather_rows(x, source)): 1x128 tiles along K
    never mix rows, and a zero row quantizes to code 0 with scale 1 (blockwise.encode_scale). The data moves as bytes
    (one kernel on CUDA with the scales)."""
    codes, scale = _gather_code_rows(t.data.view(torch.uint8), t.scale, source)
    return Fp8Tensor(codes.view(t.data.dtype), scale)


# ---- rowwise: one scale per row; per token group and column for the weight gradient ----------------------

def quantize_rowwise(x: torch.Tensor) -> Fp8Tensor:
    """One scale per row (over the last dim): data like x (contiguous), scale x.shape[:-1]."""
    scale = decode_scale(x.float().abs().amax(dim=-1))
    return Fp8Tensor(cast_to_fp8(x.float(), scale.unsqueeze(-1)).contiguous(), scale)


def quantize_token_groups(x: torch.Tensor, offsets: torch.Tensor) -> Fp8Tensor:
    """Scale each column of x [T, C] per token group: data x^T [C, T] (row-major), scale [E * C] group-major.
    The reference for any group sizes (an atomic max per element); the GEMMs use `quantize_token_groups_aligned`."""
    num_groups = offsets.numel()
    group = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype), right=True)
    magnitude = x.float().abs()
    # Rows past the last group land in an extra bucket that is dropped.
    amax = magnitude.new_zeros(num_groups + 1, x.shape[1]).scatter_reduce_(
        0, group.unsqueeze(1).expand_as(magnitude), magnitude, "amax")
    scale = decode_scale(amax)
    data = cast_to_fp8(x.float(), scale[group]).t().contiguous()
    return Fp8Tensor(data, scale[:num_groups].flatten())


TOKEN_CHUNK = 16
"""Rows per chunk in `quantize_token_groups_aligned`: the rowwise recipe's group alignment."""


def quantize_token_groups_aligned(x: torch.Tensor, offsets: torch.Tensor) -> Fp8Tensor:
    """quantize_token_groups for x [T, C] with T and every group end a multiple of TOKEN_CHUNK (a padded
    buffer): a dense amax over 16-row chunks first, then a max over the chunks of each group (16x fewer
    atomics); max is exact, so the result equals the reference bit for bit."""
    num_groups, rows, columns = offsets.numel(), x.shape[0], x.shape[1]
    chunk_starts = torch.arange(0, rows, TOKEN_CHUNK, device=x.device, dtype=offsets.dtype)
    chunk_group = torch.searchsorted(offsets, chunk_starts, right=True)
    chunk_amax = x.float().abs().unflatten(0, (rows // TOKEN_CHUNK, TOKEN_CHUNK)).amax(dim=1)
    amax = chunk_amax.new_zeros(num_groups + 1, columns).scatter_reduce_(
        0, chunk_group.unsqueeze(1).expand_as(chunk_amax), chunk_amax, "amax")
    scale = decode_scale(amax)
    row_scale = scale[chunk_group].repeat_interleave(TOKEN_CHUNK, dim=0)
    data = cast_to_fp8(x.float(), row_scale).t().contiguous()
    return Fp8Tensor(data, scale[:num_groups].flatten())


def gather_rows(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """out[r] = x[source[r]], zero where source[r] < 0: a padding or unpadding that fuses into its consumer."""
    return torch.where(source.unsqueeze(1) >= 0, x[source.clamp_min(0)], 0)


@fused()
def gather_quantize_rowwise(x: torch.Tensor, source: torch.Tensor) -> Fp8Tensor:
    """quantize_rowwise(gather_rows(x, source)): the padded activation quantized without materializing it."""
    return quantize_rowwise(gather_rows(x, source))


@fused()
def gather_quantize_rowwise_and_groups(x: torch.Tensor, source: torch.Tensor,
                                       offsets: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Both FP8 forms of the padded x: rowwise (forward / dgrad GEMM) and per token group (wgrad GEMM)."""
    padded = gather_rows(x, source)
    return quantize_rowwise(padded), quantize_token_groups_aligned(padded, offsets)


@fused()
def gather_quantize_token_groups(x: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor) -> Fp8Tensor:
    return quantize_token_groups_aligned(gather_rows(x, source), offsets)


@fused()
def pad_quantize_rowwise(x: torch.Tensor, alignment: int) -> Fp8Tensor:
    """quantize_rowwise(pad_rows(x, alignment)): gather_quantize_rowwise for groups that are aligned already."""
    return quantize_rowwise(pad_rows(x, alignment))


@fused()
def pad_quantize_rowwise_and_groups(x: torch.Tensor, offsets: torch.Tensor,
                                    alignment: int) -> tuple[Fp8Tensor, Fp8Tensor]:
    """gather_quantize_rowwise_and_groups for groups that are aligned already: x padded by pad_rows, not gathered.
    The rows past offsets[-1] land in quantize_token_groups_aligned's dropped bucket."""
    padded = pad_rows(x, alignment)
    return quantize_rowwise(padded), quantize_token_groups_aligned(padded, offsets)


@fused()
def pad_quantize_token_groups(x: torch.Tensor, offsets: torch.Tensor, alignment: int) -> Fp8Tensor:
    return quantize_token_groups_aligned(pad_rows(x, alignment), offsets)


@fused()
def gather_rows_fused(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """gather_rows as one kernel (the unpadding of a GEMM's output)."""
    return gather_rows(x, source)


@fused(dynamic_dims=())
def quantize_rowwise_transposed(w: torch.Tensor) -> Fp8Tensor:
    """quantize_rowwise(w.transpose(-2, -1)) of the [E, N, K] weight: the dgrad operand, scaled per K column."""
    return quantize_rowwise(w.transpose(-2, -1))


@fused(dynamic_dims=())
def quantize_rowwise_weight(w: torch.Tensor) -> Fp8Tensor:
    return quantize_rowwise(w)
