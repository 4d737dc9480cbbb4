"""DeepSeek-V3-style block scaling in plain torch: quantize/dequantize, expert group sizes, and
the FP32 reference the grouped FP8 kernels are tested against.

Activations (and gradients) are scaled per 1x128 tile along the reduction dim, weights per 128x128
block; scales are FP32 decode factors (x ~= q * s), data is E4M3. Everything here runs on CPU.

The 1x128 tiles are quantized with TE's block quantizer's arithmetic (`encode_scale`, codes E4M3(x * (448 / amax))),
so that grouped_fp8's TE quantizer and its inductor ones write the same bytes: dividing by the decode scale instead
rounds exact ties of x * 448 / amax the other way (common on BF16 inputs, whose significands have 8 bits), and an FP8
GEMM re-quantizing a downstream activation amplifies such differences.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 128
"""Tile length along the reduction dim and side of a weight block."""
FP8 = torch.float8_e4m3fn
"""Data type of every operand: torch's DeepSeek-style scaled_mm, its rowwise grouped GEMM and
DeepGEMM all take E4M3 only (DeepSeek-V3 uses E4M3 for gradients too; the fine scales keep their range)."""
FP8_MAX = torch.finfo(FP8).max


class Fp8Tensor(NamedTuple):
    """Quantized data and its FP32 decode scales."""

    data: torch.Tensor
    scale: torch.Tensor


def decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """Decode scale mapping amax to FP8_MAX; 1 for all-zero tiles, never 0 (0/0 would be NaN)."""
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return scale.clamp_min(torch.finfo(torch.float32).tiny)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to the E4M3 range."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def encode_scale(amax: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """FP8_MAX / amax in FP32, as TE's block quantizers compute it (compute_scale_from_amax with no epsilon and exact
    scales): 1 where amax is 0, inf or NaN; input_dtype's largest finite value where the quotient overflows."""
    # A true division, in FP64: `FP8_MAX / amax` would be reciprocal(amax) * FP8_MAX in torch, rounded twice, and
    # Triton divides FP32 approximately (div.full, 2 ulps); FP64's correctly rounded quotient rounds to FP32's.
    quotient = (torch.full_like(amax, FP8_MAX, dtype=torch.float64) / amax.double()).to(amax.dtype)
    scale = torch.where((amax > 0) & torch.isfinite(amax), quotient, 1.0)
    return torch.where(torch.isinf(scale), torch.finfo(input_dtype).max, scale)


def quantize_1x128(x: torch.Tensor) -> Fp8Tensor:
    """Scale each row in 1x128 tiles along the last dim: data like x, scale [..., ceil(K/128)].
    A partial last tile is padded with zeros, which leaves its amax unchanged. TE's 1x128 kernel's arithmetic, bit for
    bit: codes E4M3(x * encode), saturated; the decode scale 1 / encode in FP64, rounded to FP32."""
    k = x.shape[-1]
    tiles = -(-k // BLOCK)
    padded = F.pad(x.float(), (0, tiles * BLOCK - k)).unflatten(-1, (tiles, BLOCK))
    encode = encode_scale(padded.abs().amax(dim=-1), x.dtype)
    data = (padded * encode.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)[..., :k]
    return Fp8Tensor(data.contiguous(), torch.reciprocal(encode.double()).float())


def dequantize_1x128(t: Fp8Tensor) -> torch.Tensor:
    k = t.data.shape[-1]
    return t.data.float() * t.scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def quantize_128x128(w: torch.Tensor) -> Fp8Tensor:
    """Scale [..., N, K] in 128x128 blocks: scale [..., N/128, K/128]. N and K must be multiples of 128."""
    n, k = w.shape[-2:]
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"128x128 block scaling needs both weight dims divisible by {BLOCK}, got {n}x{k}")
    blocks = w.float().unflatten(-1, (k // BLOCK, BLOCK)).unflatten(-3, (n // BLOCK, BLOCK))  # [.., nb, 128, kb, 128]
    scale = decode_scale(blocks.abs().amax(dim=(-3, -1)))
    data = cast_to_fp8(blocks, scale[..., :, None, :, None]).flatten(-4, -3).flatten(-2)
    return Fp8Tensor(data, scale)


def dequantize_128x128(t: Fp8Tensor) -> torch.Tensor:
    expanded = t.scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return t.data.float() * expanded


def new_or_into(into: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The FP32 buffer a K-grouped GEMM adds into: `into` (checked: FP32, contiguous, of this shape), else zeros."""
    if into is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if into.dtype != torch.float32 or tuple(into.shape) != shape or not into.is_contiguous():
        raise ValueError(f"a grouped weight gradient accumulates into a contiguous FP32 {list(shape)} buffer, got "
                         f"{into.dtype} {list(into.shape)}{'' if into.is_contiguous() else ' (strided)'}")
    return into


def group_counts(offsets: torch.Tensor) -> list[int]:
    """Rows per expert from cumulative end offsets (a host sync: never inside a CUDA-graph capture)."""
    return torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()


def _segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def reference_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Forward y = x @ w[e]^T per expert row group: x quantized 1x128, w 128x128, dequantized, FP32 matmul."""
    xd, wd = dequantize_1x128(quantize_1x128(x)), dequantize_128x128(quantize_128x128(weight))
    out = x.new_zeros(x.shape[0], weight.shape[1], dtype=torch.float32)
    for e, (start, end) in enumerate(_segments(offsets)):
        out[start:end] = xd[start:end] @ wd[e].T
    return out


def reference_grouped_dgrad(grad_y: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad_x = grad_y @ w[e] per group: grad_y 1x128 along N, w 128x128 (a block of w^T is a block of w)."""
    gd, wd = dequantize_1x128(quantize_1x128(grad_y)), dequantize_128x128(quantize_128x128(weight))
    out = grad_y.new_zeros(grad_y.shape[0], weight.shape[2], dtype=torch.float32)
    for e, (start, end) in enumerate(_segments(offsets)):
        out[start:end] = gd[start:end] @ wd[e]
    return out


def reference_grouped_wgrad(grad_y: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad_w[e] = grad_y_e^T @ x_e: both quantized in 1x128 tiles along the tokens of each group."""
    out = x.new_zeros(offsets.numel(), grad_y.shape[1], x.shape[1], dtype=torch.float32)
    for e, (start, end) in enumerate(_segments(offsets)):
        gd = dequantize_1x128(quantize_1x128(grad_y[start:end].T))
        xd = dequantize_1x128(quantize_1x128(x[start:end].T))
        out[e] = gd @ xd.T
    return out
