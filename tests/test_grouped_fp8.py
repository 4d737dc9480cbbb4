"""grouped_fp8 on CPU: block quantization, the FP32 reference, padding and the kernels' data layouts,
the autograd functions, and the converter.

The GPU kernels cannot run here. Their data contracts can: `ContractScaledMM`, `ContractScaledGroupedMM`
and `ContractDeepGemm` check the shapes and strides that torch's C++ checks and DeepGEMM's documented
layout demand, then compute what the contract says in FP32. Passing them to the shipped kernel classes
tests our layout code (scale padding, strides, m_indices, flattening) against the reference on CPU.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fp8stack.models import load_model_config
from fp8stack.backends import get_backend
from fp8stack.backends import BackendUnavailable
from fp8stack.backends.blockwise import (BLOCK, FP8, FP8_MAX, Fp8Tensor, cast_to_fp8, decode_scale, dequantize_1x128,
                                         dequantize_128x128, quantize_1x128, quantize_128x128,
                                         reference_grouped_dgrad, reference_grouped_gemm, reference_grouped_wgrad)
from fp8stack.backends import deepgemm
from fp8stack.backends.deepgemm import DeepGemmKernels, flatten_k_grouped, m_indices, mn_major_scales
from fp8stack.backends.grouped import (FLATTEN_KERNELS, INDUCTOR_QUANTIZER, AlignedTokenGroups, BlockwiseGroupedMM,
                                       DispatchedBlockwiseGroupedMM, Float8GroupedExperts, GroupedFP8Backend,
                                       RowwiseGroupedMM, TorchBlockwiseKernels, TorchRowwiseKernels, TokenGroupPadding,
                                       rhs_block_scale, token_groups)
from fp8stack.backends import fp8_quant
from fp8stack.backends.base import optimizer_steps
from fp8stack.backends.fp8_quant import quantize_rowwise, quantize_token_groups
from fp8stack.backends.te_quant import TEBlockQuantizer, deepgemm_operands
from fp8stack.models.llama import Llama
from fp8stack.models.moe import GroupedExperts
from fp8stack.plan import Component, Decision, Plan, PlanError, PolicyConfig, load_description, make_plan
from fp8stack.plan.recipes import WGRAD_FLATTENS

FP8_TOLERANCE = 6e-2
"""Relative (Frobenius) error of an FP8 GEMM vs FP32 on unquantized N(0,1) data. E4M3 keeps 3 mantissa bits:
rounding errors up to 2^-4 per element, ~2.7% RMS; two quantized operands give ~4% on the product."""
KERNEL_TOLERANCE = 1e-2
"""A kernel vs the dequantized FP32 reference: only accumulation order and the BF16 output rounding (2^-9)."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


# ---- data contracts of the GPU kernels, interpreted in FP32 -------------------------------------------

class ContractScaledMM:
    """torch.nn.functional.scaled_mm with DeepSeek-style scales: the checks of torch's
    _scaled_block1x128_block128x128 / _scaled_block1x128_block1x128 (ScaledBlas.cpp) and sm90's
    row-major A x column-major B, then the product in FP32."""

    def __call__(self, a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16):
        (m, k), n = a.shape, b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == 1 and b.stride(0) == 1
        kb = -(-k // BLOCK)
        assert recipe_a == F.ScalingType.BlockWise1x128
        assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1 and (kb == 1 or scale_a.stride(1) == m)
        a_deq = a.float() * scale_a.repeat_interleave(BLOCK, 1)[:, :k]
        if recipe_b == F.ScalingType.BlockWise128x128:
            k4 = -(-kb // 4) * 4
            assert scale_b.shape == (k4, -(-n // BLOCK)) and scale_b.stride(0) == 1
            assert scale_b.shape[1] == 1 or scale_b.stride(1) == k4
            expanded = scale_b[:kb].repeat_interleave(BLOCK, 0)[:k].repeat_interleave(BLOCK, 1)[:, :n]
        else:
            assert recipe_b == F.ScalingType.BlockWise1x128
            assert scale_b.shape == (n, kb) and scale_b.stride(0) == 1 and (kb == 1 or scale_b.stride(1) == n)
            expanded = scale_b.t().repeat_interleave(BLOCK, 0)[:k]
        return (a_deq @ (b.float() * expanded)).to(output_dtype)


class ContractScaledGroupedMM:
    """torch._scaled_grouped_mm with rowwise scales: the checks of GroupedBlas.cpp (2d-3d and 2d-2d,
    A row-major, B column-major, E4M3 only, BF16 out), 16-row aligned token groups for 2d-2d. 2d-3d leaves the
    output's rows past the last group unwritten (an empty tensor there): NaN here, so that a reader shows."""

    def __call__(self, a, b, scale_a, scale_b, offs, out_dtype):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16 and offs.dtype == torch.int32
        assert a.stride(-1) == 1 and b.stride(-2) == 1 and a.shape[-1] % 16 == 0
        assert a.stride(-2) % 16 == 0 and b.stride(-1) % 16 == 0  # 16-byte aligned strides
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        assert all(x % 16 == 0 for x in ends)  # torch only uses (and tests) 16-row aligned groups
        if b.dim() == 3:
            assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
            out = torch.full((a.shape[0], b.shape[2]), float("nan"))
            for e, (s, t) in enumerate(zip(starts, ends)):
                out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e])
            return out.to(out_dtype)
        groups, m, n = len(ends), a.shape[0], b.shape[1]
        assert scale_a.shape == (groups * m,) and scale_b.shape == (groups * n,)
        out = torch.zeros(groups, m, n)
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[e] = (a[:, s:t].float() * scale_a[e * m:(e + 1) * m, None]) @ (b[s:t].float() * scale_b[e * n:(e + 1) * n])
        return out.to(out_dtype)


class ContractDeepGemm:
    """DeepGEMM's Hopper m-grouped contiguous and K-grouped (nt, flat K-major) FP8 GEMMs with FP32
    scales, per its tests/generators.py and csrc/apis/gemm.hpp, computed in FP32. The m-grouped GEMM skips the
    blocks of rows labelled -1 and writes nothing there: NaN here (d is uninitialised memory), so that a reader
    shows."""

    @staticmethod
    def get_mk_alignment_for_contiguous_layout() -> int:
        return 128

    @staticmethod
    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, disable_ue8m0_cast=False):
        assert recipe is None and disable_ue8m0_cast  # 1x128 / 128x128 inferred from FP32 scale shapes
        (a_data, a_scale), (b_data, b_scale) = a, b
        assert a_data.is_contiguous() and b_data.is_contiguous() and grouped_layout.dtype == torch.int32
        assert grouped_layout.shape == (a_data.shape[0],) and d.dtype == torch.bfloat16
        (m, k), (_, n, _) = a_data.shape, b_data.shape
        assert a_scale.shape == (m, k // 128) and b_scale.shape == (b_data.shape[0], n // 128, k // 128)
        # Each 128-row block belongs to one expert (or is padding, -1).
        assert all(len(set(block.tolist())) == 1 for block in grouped_layout.split(128))
        a_deq = dequantize_1x128(Fp8Tensor(a_data, a_scale))
        b_deq = dequantize_128x128(Fp8Tensor(b_data, b_scale))
        d.fill_(float("nan"))
        for row, expert in enumerate(grouped_layout.tolist()):
            if expert >= 0:
                d[row] = (a_deq[row] @ b_deq[expert].T).to(d.dtype)

    @staticmethod
    def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, ks_tensor, c, recipe):
        assert recipe == (1, 1, 128) and d.dtype == c.dtype == torch.float32
        if c is not d:  # DeepGEMM copies c into d first, then accumulates in d
            d.copy_(c)
        assert ks_tensor.tolist() == ks and all(k % 128 == 0 for k in ks)
        (a_flat, a_scale), (b_flat, b_scale) = a, b
        m, n = d.shape[1:]
        # DeepGEMM takes any layout, but transposes others with a kernel it compiles per tile count: ours come ready.
        assert all(scale.stride() == (1, -(-rows // 4) * 4) for scale, rows in ((a_scale, m), (b_scale, n)))
        assert a_flat.dim() == b_flat.dim() == 1 and a_scale.shape == (m, sum(ks) // 128)
        start = 0
        for e, k in enumerate(ks):
            tiles = slice(start // 128, (start + k) // 128)
            a_e = dequantize_1x128(Fp8Tensor(a_flat[start * m:(start + k) * m].view(m, k), a_scale[:, tiles]))
            b_e = dequantize_1x128(Fp8Tensor(b_flat[start * n:(start + k) * n].view(n, k), b_scale[:, tiles]))
            d[e] += a_e @ b_e.T
            start += k


BLOCKWISE_KERNELS = {
    "torch": lambda: TorchBlockwiseKernels(ContractScaledMM()),
    "deepgemm": lambda: DeepGemmKernels(ContractDeepGemm()),
}


# ---- quantization ---------------------------------------------------------------------------------------

def test_1x128_round_trip_error_bound_and_scale_shapes():
    torch.manual_seed(0)
    x = torch.randn(6, 300) * torch.logspace(-3, 3, 300)  # a partial last tile (300 = 2*128 + 44)
    q = quantize_1x128(x)
    assert q.data.shape == (6, 300) and q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (6, 3)
    assert q.scale.dtype == torch.float32
    scale = q.scale.repeat_interleave(BLOCK, 1)[:, :300]
    # Round to nearest with 3 mantissa bits: 2^-4 relative, or half the subnormal step 2^-9 in scaled units.
    assert ((dequantize_1x128(q) - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all()
    assert quantize_1x128(torch.randn(2, 3, 256)).scale.shape == (2, 3, 2)


def test_128x128_round_trip_error_bound_and_scale_shapes():
    torch.manual_seed(0)
    w = torch.randn(2, 256, 384)
    q = quantize_128x128(w)
    assert q.data.shape == w.shape and q.scale.shape == (2, 2, 3)
    scale = q.scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    assert ((dequantize_128x128(q) - w).abs() <= w.abs() * 2**-4 + scale * 2**-10).all()
    # Every block has its own scale: a block's amax sets it.
    assert torch.allclose(q.scale[1, 0, 2], w[1, :128, 256:].abs().max() / FP8_MAX)
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_128x128(torch.randn(100, 128))


def test_amax_maps_exactly_to_the_fp8_maximum():
    torch.manual_seed(0)
    x = torch.randn(4, 512)
    q = quantize_1x128(x)
    tiles = q.data.float().abs().unflatten(-1, (4, BLOCK)).amax(-1)
    assert (tiles == FP8_MAX).all()
    amax = x.abs().unflatten(-1, (4, BLOCK)).amax(-1)
    assert torch.allclose(q.scale * FP8_MAX, amax, rtol=1e-6, atol=0)
    w = quantize_128x128(torch.randn(256, 256))
    assert (w.data.float().abs().unflatten(1, (2, BLOCK)).unflatten(0, (2, BLOCK)).amax(dim=(1, 3)) == FP8_MAX).all()


def test_zero_and_tiny_blocks_stay_finite():
    x = torch.zeros(2, 256)
    x[1, 128:] = 1e-42  # bf16/fp32 subnormals: amax / 448 underflows
    q = quantize_1x128(x)
    assert q.scale[0].tolist() == [1.0, 1.0] and (q.data[0].float() == 0).all()
    assert torch.isfinite(q.scale).all() and torch.isfinite(dequantize_1x128(q)).all()
    assert (dequantize_1x128(q)[0] == 0).all()
    w = quantize_128x128(torch.zeros(128, 256))
    assert (w.scale == 1).all() and (dequantize_128x128(w) == 0).all()


# ---- the FP32 reference vs BF16 and FP32 ------------------------------------------------------------------

UNEVEN = [130, 0, 7, 300]
"""Rows per expert: unaligned, an empty expert, a tiny and a large group."""


def _problem(counts=UNEVEN, n=256, k=640, extra_rows=0, seed=0):
    torch.manual_seed(seed)
    rows = sum(counts) + extra_rows
    return torch.randn(rows, k), torch.randn(len(counts), n, k) * 0.05, offsets_of(counts)


def _exact(x, w, offsets):
    out = torch.zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[e].T
        start = end
    return out


def test_reference_matches_bf16_grouped_mm_within_fp8_tolerance():
    x, w, offsets = _problem()
    reference = reference_grouped_gemm(x, w, offsets)
    bf16 = torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offsets)
    assert rel_err(reference, _exact(x, w, offsets)) < FP8_TOLERANCE
    assert rel_err(reference, bf16) < FP8_TOLERANCE
    assert (reference[130:130] == 0).all() and reference.shape == (437, 256)


def test_reference_backward_within_fp8_tolerance():
    x, w, offsets = _problem()
    grad_y = torch.randn(x.shape[0], w.shape[1])
    ends = offsets.tolist()
    exact_dgrad = torch.cat([grad_y[s:e] @ w[i] for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    exact_wgrad = torch.stack([grad_y[s:e].T @ x[s:e] for s, e in zip([0, *ends[:-1]], ends)])
    assert rel_err(reference_grouped_dgrad(grad_y, w, offsets), exact_dgrad) < FP8_TOLERANCE
    wgrad = reference_grouped_wgrad(grad_y, x, offsets)
    assert rel_err(wgrad, exact_wgrad) < FP8_TOLERANCE and (wgrad[1] == 0).all()


# ---- padding and layouts ---------------------------------------------------------------------------------

def test_token_group_padding_without_host_sync():
    x = torch.arange(1.0, 12.0).unsqueeze(1)  # 11 rows: groups 3, 0, 5, then 3 rows past the groups
    padding = TokenGroupPadding.build(offsets_of([3, 0, 5]), num_tokens=11, alignment=4)
    assert padding.offsets.tolist() == [4, 4, 12] and padding.offsets.dtype == torch.int32
    padded = padding.pad(x)
    assert padded.shape == (20, 1)  # 11 + 3 * 3, rounded up to 4
    assert padded[:12].squeeze(1).tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    assert (padded[12:] == 0).all()
    assert padding.unpad(padded)[:8].squeeze(1).tolist() == list(range(1, 9))
    assert padding.counts == (4, 0, 8)  # read on the host once, on first use


def test_aligned_groups_are_read_where_they_are():
    """Groups already starting on the alignment (GroupedExperts' contract under MoE) move no row: the buffer is the
    tokens with zero rows appended up to the alignment, not T + E * (alignment - 1) rows gathered into place, and
    unpadding hands the GEMM's output on as it is (its first T rows where it has more): the rows past the last group
    keep what the GEMM left (zero through the gather)."""
    x = torch.arange(1.0, 15.0).unsqueeze(1)  # 14 rows: groups 4, 0, 8, then 2 rows past the groups
    general = TokenGroupPadding.build(offsets_of([4, 0, 8]), num_tokens=14, alignment=4)
    aligned = token_groups(offsets_of([4, 0, 8]), num_tokens=14, alignment=4, aligned=True)
    assert isinstance(aligned, AlignedTokenGroups) and not hasattr(aligned, "source")
    assert torch.equal(aligned.offsets, general.offsets) and aligned.counts == general.counts == (4, 0, 8)
    buffer = fp8_quant.pad_rows(x, 4)
    assert (general.rows, buffer.shape[0]) == (24, 16)  # 14 + 3 * 3 and 14, rounded up to 4
    assert torch.equal(buffer[:12], general.pad(x)[:12]) and (buffer[14:] == 0).all()
    unpadded = aligned.unpad(buffer)
    assert unpadded.shape == (14, 1) and not unpadded._is_view()
    assert torch.equal(unpadded[:12], general.unpad(general.pad(x))[:12])
    assert unpadded.squeeze(1).tolist() == [*range(1, 15)] and (general.unpad(general.pad(x))[12:] == 0).all()
    whole_tiles = token_groups(offsets_of([4, 0, 8]), num_tokens=16, alignment=4, aligned=True)
    assert whole_tiles.unpad(buffer) is buffer  # no copy
    assert torch.equal(fp8_quant.pad_rows(x[:12], 4), x[:12])  # whole tiles already: nothing appended


def _blockwise_paths(x, w, offsets, kernels, grad_y, main_grad=None):
    """(y, x.grad, w.grad or main_grad) of the gather path and of the aligned path, from fresh leaves of x and w
    (each requiring a gradient as x and w do)."""
    outs = []
    for aligned in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w)]
        into = None if main_grad is None else main_grad.clone()
        y = BlockwiseGroupedMM.apply(*leaves, offsets, BLOCKWISE_KERNELS[kernels](), aligned, into)
        y.backward(grad_y)
        outs.append((y.detach(), leaves[0].grad, leaves[1].grad if into is None else into))
    return outs


@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
@pytest.mark.parametrize("extra_rows", [3 * 127, 128], ids=["rows-unaligned", "rows-aligned"])
@pytest.mark.parametrize("trained", ["both", "x", "w", "main_grad"])
def test_blockwise_on_aligned_groups_equals_the_general_padding(kernels, extra_rows, trained):
    """The aligned path gives the gather path's outputs and gradients bit for bit on the groups' rows, an empty
    expert included, whatever x and grad_y hold past the last group; there the gather path gives zeros and the
    aligned path what the GEMM left (DeepGEMM's contract: NaN, unwritten; torch's per-expert GEMMs: zeros)."""
    counts = [128, 0, 256, 128]
    x, w, offsets = _problem(counts, extra_rows=extra_rows)  # MoE's static room, unused (T = 893 or 640)
    x.requires_grad_(trained != "w")
    w.requires_grad_(trained != "x")
    grad_y = torch.randn(x.shape[0], w.shape[1])  # nonzero past the groups too
    main_grad = torch.full(w.shape, 0.5) if trained == "main_grad" else None
    general, aligned = _blockwise_paths(x, w, offsets, kernels, grad_y, main_grad)
    rows = sum(counts)
    for before, after, per_token in zip(general, aligned, (True, True, False)):
        assert (before is None) == (after is None)
        if before is not None:
            assert torch.equal(before[:rows], after[:rows]) if per_token else torch.equal(before, after)
    for before, after in zip(general[:2], aligned[:2]):  # y, then x's gradient
        if after is not None:
            assert after.shape == before.shape and after[:rows].abs().sum() > 0 and (before[rows:] == 0).all()
            assert after[rows:].isnan().all() if kernels == "deepgemm" else (after[rows:] == 0).all()


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize("extra_rows", [3 * 127, 128], ids=["rows-unaligned", "rows-aligned"])
def test_the_aligned_paths_output_may_be_modified_in_place(recipe, extra_rows):
    """The aligned path hands on the GEMM's own output (a copy of its first rows where x's are not whole tiles), not
    a view of it, which autograd would forbid modifying in place, as the gather path's output may be."""
    x, w, offsets = _problem([128, 0, 256, 128], n=128, k=256, extra_rows=extra_rows)
    x = x.bfloat16().requires_grad_(True)  # the GEMMs' output dtype: no cast copies it
    if recipe == "blockwise":
        y = BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS["deepgemm"](), True)
    else:
        y = RowwiseGroupedMM.apply(x, w, offsets, TorchRowwiseKernels(ContractScaledGroupedMM()), False, True)
    y[:512].mul_(2)
    y[:512].sum().backward()
    assert torch.isfinite(x.grad[:512]).all() and x.grad[:512].abs().sum() > 0


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("trained", ["both", "x", "w"])
def test_rowwise_on_aligned_groups_equals_the_general_padding(recipe, trained):
    counts = [32, 0, 48, 64]  # 16-aligned, an empty expert
    x, w, offsets = _problem(counts, n=128, k=256, extra_rows=3 * 15 + 2)
    x.requires_grad_(trained != "w")
    w.requires_grad_(trained != "x")
    grad_y = torch.randn(x.shape[0], 128)
    outs = []
    for aligned in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w)]
        kernels = TorchRowwiseKernels(ContractScaledGroupedMM())
        y = RowwiseGroupedMM.apply(*leaves, offsets, kernels, recipe == "rowwise_gw_hp", aligned)
        y.backward(grad_y)
        outs.append((y.detach(), leaves[0].grad, leaves[1].grad))
    rows = sum(counts)
    for before, after, per_token in zip(*outs, (True, True, False)):
        assert (before is None) == (after is None)
        if before is not None:
            assert torch.equal(before[:rows], after[:rows]) if per_token else torch.equal(before, after)
    y, grad_x, _ = outs[1]  # past the groups: what torch's grouped GEMM left (NaN in its contract)
    assert y[rows:].isnan().all() and (grad_x is None or grad_x[rows:].isnan().all())


def _counting_gathers(monkeypatch) -> list[int]:
    """Count the row gathers of the padding path (every gathering quantizer and unpadding goes through it)."""
    calls = []
    real = fp8_quant.gather_rows
    monkeypatch.setattr(fp8_quant, "gather_rows", lambda x, source: calls.append(1) or real(x, source))
    return calls


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "rowwise_gw_hp"])
def test_aligned_groups_run_no_row_gather(recipe, monkeypatch):
    """Forward and backward on aligned groups gather no row; the same call on the padding path gathers (the count
    would show a gather the aligned path ran)."""
    gathers = _counting_gathers(monkeypatch)
    x, w, offsets = _problem([128, 0, 256, 128], n=128, k=256, extra_rows=5)
    for aligned in (True, False):
        leaves = (x.clone().requires_grad_(True), w.clone().requires_grad_(True))
        if recipe == "blockwise":
            y = BlockwiseGroupedMM.apply(*leaves, offsets, BLOCKWISE_KERNELS["deepgemm"](), aligned)
        else:
            y = RowwiseGroupedMM.apply(*leaves, offsets, TorchRowwiseKernels(ContractScaledGroupedMM()),
                                       recipe == "rowwise_gw_hp", aligned)
        y.backward(torch.randn_like(y))
        assert (len(gathers) == 0) == aligned, f"aligned={aligned}: {len(gathers)} gathers"


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_converted_experts_under_moe_hand_their_aligned_groups_to_the_fast_path(recipe, monkeypatch):
    """The MoE pads each expert's group to the converted experts' group_alignment, so their FP8 GEMMs take the
    aligned path: a training step's forward and backward gather no row."""
    model, plan = _tiny_moe_and_plan(recipe=recipe, fp8_format="e4m3")
    GroupedFP8Backend(kernels="torch").convert(model, [plan.decision("layers.1.moe.experts.w13"),
                                                       plan.decision("layers.1.moe.experts.w2")], plan)
    moe = model.layers[1].moe
    moe.experts.blockwise_kernels = BLOCKWISE_KERNELS["torch"]()  # the GPU kernels' contracts, in FP32 on CPU
    moe.experts.rowwise_kernels = TorchRowwiseKernels(ContractScaledGroupedMM())
    gathers = _counting_gathers(monkeypatch)
    moe(torch.randn(2, 16, 256)).square().mean().backward()
    assert gathers == [] and moe.experts.w13.grad.abs().sum() > 0


def test_rhs_block_scale_pads_k_blocks_to_a_multiple_of_four():
    scale = torch.rand(2, 5) + 1  # N/128 = 2, K/128 = 5 (K = 640)
    laid_out = rhs_block_scale(scale)
    assert laid_out.shape == (8, 2) and laid_out.stride() == (1, 8)
    assert torch.equal(laid_out[:5], scale.t()) and (laid_out[5:] == 1).all()
    assert rhs_block_scale(torch.rand(3, 4)).shape == (4, 3)


def _host_m_indices(counts: list[int], rows: int) -> list[int]:
    """The experts of a row buffer read the obvious way, on the host: expert e repeated counts[e] times, then -1."""
    labels = [e for e, count in enumerate(counts) for _ in range(count)]
    return labels + [-1] * (rows - len(labels))


@pytest.mark.parametrize("seed", range(5))
def test_deepgemm_m_indices_from_device_offsets_equal_the_host_labels(seed):
    generator = torch.Generator().manual_seed(seed)
    num_experts = int(torch.randint(1, 9, (), generator=generator))
    counts = (torch.randint(0, 4, (num_experts,), generator=generator) * 128).tolist()  # empty experts included
    counts[int(torch.randint(0, num_experts, (), generator=generator))] = 0
    rows = sum(counts) + num_experts * 127  # a static buffer larger than the groups
    labels = m_indices(torch.tensor(counts).cumsum(0).to(torch.int32), rows)
    assert labels.dtype == torch.int32 and labels.shape == (rows,)
    assert labels.tolist() == _host_m_indices(counts, rows)
    assert (labels[sum(counts):] == -1).all()


def test_deepgemm_m_indices_have_the_static_size_whatever_the_groups():
    """The row count is the caller's, never the groups' total: a CUDA graph replays it for any routing."""
    for counts in ([0, 0, 0], [256, 0, 128], [128, 128, 128]):
        labels = m_indices(offsets_of(counts), 512)
        assert labels.shape == (512,) and labels.tolist() == _host_m_indices(counts, 512)


def test_deepgemm_k_grouped_flattening():
    data = torch.arange(2 * 5).view(2, 5)  # [dim 2, tokens 5], experts own 2, 0, 3 tokens
    assert flatten_k_grouped(data, [2, 0, 3]).tolist() == [0, 1, 5, 6, 2, 3, 4, 7, 8, 9]
    # In 8-byte words (128-token groups) or bytes (odd counts), from a buffer that may run past the groups (a static
    # size) or be a strided view: the same layout.
    for counts, past in (([128, 0, 256, 1024], 256), ([128, 0, 256, 16], 0), ([130, 0, 7, 3], 5), ([0, 0], 128)):
        fp8 = torch.randn(3, sum(counts) + past).to(torch.float8_e4m3fn)
        blocks = fp8.view(torch.uint8)[:, :sum(counts)].split(counts, dim=1)
        expected = torch.cat([block.contiguous().view(-1) for block in blocks])
        for operand in (fp8, fp8.t().contiguous().t()):
            flat = flatten_k_grouped(operand, counts)
            assert flat.dtype == fp8.dtype and torch.equal(flat.view(torch.uint8), expected), (counts, past)


FLATTEN_CASES = [([128, 0, 256, 1024], 256), ([0, 384, 128, 0], 0), ([384], 128), ([256, 256, 128, 16], 0),
                 ([130, 0, 7, 3], 5), ([0, 0], 128)]
"""(tokens per expert, tokens past the groups) of wgrad operands: uneven experts, empty ones (first, middle, last,
all), one expert; whole 8-byte words (all but the last two), bytes (odd counts)."""


def _random_fp8(dim: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as E4M3: every code, NaNs included, so that a byte moved to the wrong place shows."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (dim, tokens), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "compiled"])
def test_the_compiled_wgrad_flattening_gives_the_copies_bytes(graph, monkeypatch):
    """flatten_k_grouped_compiled (one gather whose source positions come from the group ends) lays the operands out
    as the per-expert copies do, byte for byte: FLATTEN_CASES for a contiguous operand and a strided view (bytes);
    run eagerly (what a CPU runs) and as the Inductor graph (what runs on CUDA; Inductor's CPU backend here)."""
    if graph:
        monkeypatch.setattr(deepgemm, "_gather_k_grouped", deepgemm._gather_k_grouped.compiled)
    for counts, past in FLATTEN_CASES:
        fp8 = _random_fp8(3, sum(counts) + past)
        for operand in (fp8, fp8.t().contiguous().t()):
            expected = flatten_k_grouped(operand, counts)
            got = deepgemm.flatten_k_grouped_compiled(operand, counts)
            assert got.dtype == fp8.dtype and got.shape == (3 * sum(counts),), (counts, past)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (counts, past)


TRITON_FLATTEN_CHECK = """
import torch
from fp8stack.backends import deepgemm
from tests.test_grouped_fp8 import FLATTEN_CASES, _random_fp8
for counts, past in FLATTEN_CASES + [([128] * 9, 0)]:
    for dim in (3, 65):
        fp8 = _random_fp8(dim, sum(counts) + past)
        for operand in (fp8, fp8.t().contiguous().t()):
            expected = deepgemm.flatten_k_grouped(operand, counts)
            got = deepgemm.flatten_k_grouped_triton(operand, counts)
            assert got.dtype == fp8.dtype and got.shape == (dim * sum(counts),), (counts, past, dim)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (counts, past, dim)
print("same bytes")
"""


def test_the_triton_wgrad_flattening_gives_the_copies_bytes():
    """flatten_k_grouped_triton (one Triton kernel copying whole tiles of one expert) lays the operands out as the
    per-expert copies do, byte for byte: FLATTEN_CASES and nine experts (the kernel's expert search over a padded
    power of two), for a contiguous operand and a strided view, operands of fewer rows than a program's and of more.
    Run by Triton's interpreter on CPU, in a process of its own: the interpreter is chosen when the kernel is
    defined (tests/gpu runs it compiled)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    result = subprocess.run([sys.executable, "-c", TRITON_FLATTEN_CHECK], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0 and "same bytes" in result.stdout, result.stderr[-3000:]


def test_the_compiled_wgrad_flattening_compiles_once_for_any_groups_and_either_operand():
    """Token counts, group sizes and the operand's dim (a wgrad's two operands differ in it) are dynamic in the graph:
    after the first call, new routings and the other operand compile nothing. (From a fresh cache: dims that another
    test's calls made dynamic by recompiling would hide a graph compiled for fixed ones.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = deepgemm._gather_k_grouped.compiled
    calls = [(384, [128, 0, 256, 1024], 256), (256, [256, 128, 0, 512], 0), (640, [1024, 128, 128, 640], 128),
             (384, [0, 0, 128, 256], 384)]
    graphs = None
    for seed, (dim, counts, past) in enumerate(calls):
        source, per_word = deepgemm._in_words(_random_fp8(dim, sum(counts) + past, seed), counts)
        ends = torch.tensor(counts).cumsum(0) // per_word
        out = source.new_empty(dim * int(ends[-1]))
        expected = flatten_k_grouped(source.view(torch.float8_e4m3fn), counts)
        assert torch.equal(compiled(source, ends, out).view(torch.uint8), expected.view(torch.uint8)), counts
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs, "new group sizes or the other operand recompiled the gather"


def test_the_auto_wgrad_flattening_copies_per_expert_where_triton_cannot_run(monkeypatch):
    """auto on CPU operands (and wherever triton is not importable): the per-expert copies, never the Triton kernel,
    which compiles for CUDA only (tests/gpu checks it runs there)."""
    monkeypatch.setattr(deepgemm, "flatten_k_grouped_triton", lambda *_: pytest.fail("the Triton copy ran on CPU"))
    data = torch.arange(4 * 384, dtype=torch.uint8).view(4, 384)
    assert torch.equal(deepgemm.flatten_k_grouped_auto(data, [128, 256]), flatten_k_grouped(data, [128, 256]))


def test_deepgemm_kernels_take_the_wgrad_flattening_they_are_given():
    assert DeepGemmKernels(ContractDeepGemm()).flatten_k_grouped is deepgemm.flatten_k_grouped_auto
    kernels = DeepGemmKernels(ContractDeepGemm(), wgrad_flatten="compiled")
    assert (kernels.wgrad_flatten, kernels.flatten_k_grouped) == ("compiled", deepgemm.flatten_k_grouped_compiled)
    assert tuple(deepgemm.WGRAD_FLATTENERS) == WGRAD_FLATTENS  # the configuration's choices, each with its function
    assert set(FLATTEN_KERNELS) == set(WGRAD_FLATTENS) - {"auto", "copies"}  # and the conversion note of each
    with pytest.raises(ValueError, match="DeepGEMM wgrad_flatten='gather': use one of auto, copies, compiled, triton"):
        DeepGemmKernels(ContractDeepGemm(), wgrad_flatten="gather")


def test_deepgemm_scales_are_mn_major_and_tma_aligned_without_a_copy_where_te_wrote_them_so():
    """TE's columnwise 1x128 scales, [tiles, K padded to 4] transposed and sliced to the groups' tiles, go to
    DeepGEMM as they are; row-major ones are copied once into that layout, the same values."""
    for rows in (6, 8):
        storage = torch.randn(5, -(-rows // 4) * 4)
        te_like = storage.t()[:rows, :3]
        assert mn_major_scales(te_like) is te_like
        row_major = torch.randn(rows, 5)[:, :3]
        laid_out = mn_major_scales(row_major)
        assert laid_out.stride() == (1, -(-rows // 4) * 4) and torch.equal(laid_out, row_major)


# ---- the autograd functions on the kernels' contracts ---------------------------------------------------

@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
@pytest.mark.parametrize("counts", [UNEVEN, [128, 0, 256, 128]], ids=["uneven", "aligned"])
def test_blockwise_fwd_dgrad_wgrad_match_the_reference(kernels, counts):
    x, w, offsets = _problem(counts, extra_rows=5)  # K = 640: K/128 = 5 is not a multiple of 4
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS[kernels]())
    rows = sum(counts)
    assert rel_err(y[:rows], reference_grouped_gemm(x.detach(), w.detach(), offsets)[:rows]) < KERNEL_TOLERANCE
    assert (y[rows:] == 0).all()
    grad_y = torch.randn_like(y)
    grad_y[rows:] = 0
    y.backward(grad_y)
    assert rel_err(x.grad[:rows], reference_grouped_dgrad(grad_y, w.detach(), offsets)[:rows]) < KERNEL_TOLERANCE
    assert (x.grad[rows:] == 0).all()
    assert rel_err(w.grad, reference_grouped_wgrad(grad_y, x.detach(), offsets)) < KERNEL_TOLERANCE
    if 0 in counts:
        assert (w.grad[counts.index(0)] == 0).all()


@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
def test_blockwise_wgrad_adds_into_main_grad_across_micro_batches(kernels):
    """With the weight's FP32 main_grad passed, two micro-batches' wgrads land there, summed in FP32, and autograd
    gets no weight gradient (nothing for a hook to cast or add); an empty expert's buffer keeps what it held."""
    x, w, offsets = _problem(UNEVEN)
    w.requires_grad_(True)
    main_grad = torch.full(w.shape, 0.5)
    expected = main_grad.clone()
    for seed in (1, 2):
        grad_y = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(seed))
        BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS[kernels](), False, main_grad).backward(grad_y)
        expected += reference_grouped_wgrad(grad_y, x, offsets)
    assert w.grad is None
    assert rel_err(main_grad - 0.5, expected - 0.5) < KERNEL_TOLERANCE
    assert (main_grad[UNEVEN.index(0)] == 0.5).all()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("counts", [UNEVEN, [128, 0, 256, 384]], ids=["uneven", "aligned"])
def test_deepgemm_wgrad_is_the_same_whichever_flattening_lays_out_its_operands(counts, graph, monkeypatch):
    """BlockwiseGroupedMM on DeepGEMM's contract with wgrad_flatten compiled (its gather run eagerly, or as the
    Inductor graph) against the per-expert copies: output, input gradient, weight gradient and a main_grad
    accumulation bit for bit; the gather lays out both wgrad operands of each backward."""
    gathers = []
    gather = deepgemm._gather_k_grouped.compiled if graph else deepgemm._gather_k_grouped

    def counted(*args):
        gathers.append(args[0].shape)
        return gather(*args)

    monkeypatch.setattr(deepgemm, "_gather_k_grouped", counted)
    results = {}
    for flatten in ("copies", "compiled"):  # triton runs on CPU only interpreted: its bytes are tested above
        x, w, offsets = _problem(counts, extra_rows=5)
        x.requires_grad_(True)
        w.requires_grad_(True)
        kernels = DeepGemmKernels(ContractDeepGemm(), wgrad_flatten=flatten)
        y = BlockwiseGroupedMM.apply(x, w, offsets, kernels)
        grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        y.backward(grad_y)
        main_grad = torch.full(w.shape, 0.5)
        BlockwiseGroupedMM.apply(x.detach(), w, offsets, kernels, False, main_grad).backward(grad_y)
        results[flatten] = (y.detach(), x.grad, w.grad, main_grad)
    assert len(gathers) == 4 and {shape[0] for shape in gathers} == {256, 640}  # grad_y^T [N, T] and x^T [K, T]
    for name, copied, gathered in zip(("y", "x.grad", "w.grad", "main_grad"), *results.values(), strict=True):
        assert torch.equal(copied, gathered), name
    assert results["copies"][2].abs().sum() > 0


def test_a_k_grouped_gemm_refuses_a_buffer_it_cannot_add_into():
    x, w, offsets = _problem(UNEVEN)
    w.requires_grad_(True)
    y = BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS["deepgemm"](), False,
                                 torch.zeros(w.shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"contiguous FP32 \[4, 256, 640\] buffer, got torch.bfloat16"):
        y.sum().backward()


def test_master_weights_hand_the_blockwise_experts_their_main_grads():
    """After hand_over_main_grads (what MasterWeights calls), the converted experts' blockwise wgrads go into the
    weights' main_grad: the same gradient autograd gave them before, in FP32, and no .grad."""
    model, plan = _tiny_moe_and_plan()
    decisions = [plan.decision("layers.1.moe.experts.w13"), plan.decision("layers.1.moe.experts.w2")]
    backend = GroupedFP8Backend(kernels="torch")
    backend.convert(model, decisions, plan)
    moe = model.layers[1].moe
    moe.experts.blockwise_kernels = BLOCKWISE_KERNELS["torch"]()  # the GPU kernels' contract, in FP32 on CPU
    x = torch.randn(2, 16, 256)
    moe(x).square().mean().backward()
    autograd_grads = [moe.experts.w13.grad.clone(), moe.experts.w2.grad.clone()]
    weights = [moe.experts.w13, moe.experts.w2]
    for weight in weights:
        weight.grad = None
        weight.main_grad = torch.zeros(weight.shape)
    backend.hand_over_main_grads(model)
    assert moe.experts.wgrad_into_main_grad
    moe(x).square().mean().backward()
    for weight, expected in zip(weights, autograd_grads):
        assert weight.grad is None
        assert rel_err(weight.main_grad, expected) < 1e-6


def test_master_weights_take_the_main_grads_the_blockwise_experts_wrote():
    """Under MasterWeights the blockwise experts' wgrad GEMMs write the main_grads and hand autograd no gradient, for
    which autograd still runs the master weights' accumulation hook: it adds nothing and the step goes on."""
    from fp8stack.precision import MasterWeights

    model, plan = _tiny_moe_and_plan()
    backend = GroupedFP8Backend(kernels="torch")
    backend.convert(model, [plan.decision("layers.1.moe.experts.w13"), plan.decision("layers.1.moe.experts.w2")], plan)
    moe = model.layers[1].moe
    moe.experts.blockwise_kernels = BLOCKWISE_KERNELS["torch"]()  # the GPU kernels' contract, in FP32 on CPU
    MasterWeights(moe)
    backend.hand_over_main_grads(moe)  # what MasterWeights asks of an assembled model's backends
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(2, 16, 256)).float().square().mean().backward()
    for weight in (moe.experts.w13, moe.experts.w2, moe.router.gate.weight):
        assert weight.grad is None and weight.main_grad.abs().sum() > 0


def test_blockwise_keeps_dtypes_and_follows_autocast():
    x, w, offsets = _problem([128, 128], n=128, k=128)
    x = x.bfloat16().requires_grad_(True)
    w.requires_grad_(True)
    y = BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS["torch"]())
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert BlockwiseGroupedMM.apply(x.float(), w, offsets, BLOCKWISE_KERNELS["torch"]()).dtype == torch.bfloat16


@pytest.mark.parametrize("kernels, forward_reads", [("deepgemm", 0), ("torch", 1)])
def test_blockwise_reads_group_sizes_on_the_host_only_where_its_kernels_say(kernels, forward_reads, monkeypatch):
    """DeepGEMM's forward labels rows on the device (capturable); its backward reads the sizes once, for the
    K-grouped wgrad. The torch kernels read them once in the forward and the backward reuses them."""
    import fp8stack.backends.grouped as grouped

    reads = []
    real_group_counts = grouped.group_counts
    monkeypatch.setattr(grouped, "group_counts", lambda offsets: reads.append(1) or real_group_counts(offsets))
    x, w, offsets = _problem([128, 0, 256], n=128, k=256, extra_rows=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = BlockwiseGroupedMM.apply(x, w, offsets, BLOCKWISE_KERNELS[kernels]())
    assert len(reads) == forward_reads
    kernels_object = BLOCKWISE_KERNELS[kernels]()
    assert kernels_object.capturable == (forward_reads == 0) and not kernels_object.capturable_backward
    y.backward(torch.randn_like(y))
    assert len(reads) == 1


def test_expert_modules_say_which_passes_a_cuda_graph_can_capture():
    def experts(recipe, blockwise=None, rowwise=None):
        return Float8GroupedExperts.from_experts(GroupedExperts(256, 128, 4), {"w13": recipe, "w2": recipe},
                                                 blockwise, rowwise)

    on_deepgemm = experts("blockwise", blockwise=BLOCKWISE_KERNELS["deepgemm"]())
    assert on_deepgemm.cuda_graph_blocker(backward=False) == ""
    assert on_deepgemm.cuda_graph_blocker(backward=True).startswith(
        "grouped_fp8 blockwise experts on DeepGEMM: forward capturable in a CUDA graph; the backward reads")
    on_torch = experts("blockwise", blockwise=BLOCKWISE_KERNELS["torch"]())
    for backward in (False, True):
        blocker = on_torch.cuda_graph_blocker(backward)
        assert blocker.startswith("grouped_fp8 blockwise experts on torch scaled_mm per expert: not capturable")
        assert "build DeepGEMM" in blocker and "\n" not in blocker
    rowwise = experts("rowwise", rowwise=TorchRowwiseKernels(ContractScaledGroupedMM()))
    assert rowwise.cuda_graph_blocker(backward=True) == ""


@pytest.mark.parametrize("trained", ["x", "w"])
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "rowwise_gw_hp"])
def test_only_the_needed_gradient_is_computed(recipe, trained):
    """Frozen weights (or inputs) skip their operand's second quantization; the other gradient is unchanged."""
    x, w, offsets = _problem([128, 0, 256], n=128, k=256)
    if recipe == "blockwise":
        def apply(a, b):
            return BlockwiseGroupedMM.apply(a, b, offsets, BLOCKWISE_KERNELS["torch"]())
    else:
        def apply(a, b):
            kernels = TorchRowwiseKernels(ContractScaledGroupedMM())
            return RowwiseGroupedMM.apply(a, b, offsets, kernels, recipe == "rowwise_gw_hp")
    grad_y = torch.randn(x.shape[0], 128)
    both = (x.clone().requires_grad_(True), w.clone().requires_grad_(True))
    apply(*both).backward(grad_y)
    one = (x.clone().requires_grad_(trained == "x"), w.clone().requires_grad_(trained == "w"))
    apply(*one).backward(grad_y)
    index = 0 if trained == "x" else 1
    assert torch.equal(one[index].grad, both[index].grad) and one[1 - index].grad is None


def _rowwise_reference(x, w, offsets):
    xd = quantize_rowwise(x)
    wd = quantize_rowwise(w)
    return _exact(xd.data.float() * xd.scale[:, None], wd.data.float() * wd.scale[..., None], offsets)


@pytest.mark.parametrize("high_precision_wgrad", [False, True], ids=["rowwise", "rowwise_gw_hp"])
def test_rowwise_fwd_dgrad_wgrad(high_precision_wgrad):
    counts = [20, 0, 45, 64]  # token groups not multiples of 16: the wgrad pads them
    x, w, offsets = _problem(counts, n=128, k=256, extra_rows=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    kernels = TorchRowwiseKernels(ContractScaledGroupedMM())
    y = RowwiseGroupedMM.apply(x, w, offsets, kernels, high_precision_wgrad)
    rows = sum(counts)
    assert rel_err(y[:rows], _rowwise_reference(x.detach(), w.detach(), offsets)[:rows]) < KERNEL_TOLERANCE
    assert (y[rows:] == 0).all()
    exact = _exact(x.detach(), w.detach(), offsets)
    assert rel_err(y[:rows], exact[:rows]) < FP8_TOLERANCE
    grad_y = torch.randn_like(y)
    grad_y[rows:] = 0
    y.backward(grad_y)
    ends = offsets.tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    exact_dgrad = torch.cat([grad_y[s:e] @ w.detach()[i] for i, (s, e) in enumerate(spans)])
    exact_wgrad = torch.stack([grad_y[s:e].T @ x.detach()[s:e] for s, e in spans])
    assert rel_err(x.grad[:rows], exact_dgrad) < FP8_TOLERANCE and (x.grad[rows:] == 0).all()
    assert rel_err(w.grad, exact_wgrad) < (1e-2 if high_precision_wgrad else FP8_TOLERANCE)
    assert (w.grad[1] == 0).all()


# ---- the converter -----------------------------------------------------------------------------------------

def _tiny_moe_and_plan(recipe="blockwise", fp8_format="hybrid"):
    torch.manual_seed(0)
    model = Llama(load_model_config("tiny-moe"))
    plan = make_plan(load_description("tiny-moe"), PolicyConfig(recipe=recipe, fp8_format=fp8_format,
                                                                expert_backend="grouped_fp8"))
    return model, plan


def test_convert_swaps_exactly_the_planned_experts_with_the_same_parameters():
    model, plan = _tiny_moe_and_plan()
    decisions = [d for d in plan.for_backend("grouped_fp8") if d.component.layer != 3]
    before = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in before.items()}
    converted, record = GroupedFP8Backend(kernels="torch").convert(model, decisions, plan)
    assert converted is model
    assert type(model.layers[1].moe.experts) is Float8GroupedExperts
    assert type(model.layers[2].moe.experts) is Float8GroupedExperts
    assert type(model.layers[3].moe.experts) is GroupedExperts  # not in the decisions handed over
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(torch.equal(after[n], values[n]) for n in values)
    experts = model.layers[1].moe.experts
    assert experts.recipes == {"w13": "blockwise", "w2": "blockwise"} and experts.group_alignment == 128
    assert record.backend == "grouped_fp8" and record.recipe == "blockwise"
    assert record.converted == {d.fqn: "Float8GroupedExperts" for d in decisions}
    assert any("E4M3" in note for note in record.notes)  # the plan asked for hybrid
    assert "blockwise" in repr(experts)
    experts.blockwise_kernels = BLOCKWISE_KERNELS["deepgemm"]()
    assert type(copy.deepcopy(model).layers[1].moe.experts) is Float8GroupedExperts


def test_convert_runs_an_unplanned_gemm_of_the_same_module_in_bf16():
    model, plan = _tiny_moe_and_plan(recipe="rowwise", fp8_format="e4m3")
    decisions = [plan.decision("layers.1.moe.experts.w13")]
    _, record = GroupedFP8Backend().convert(model, decisions, plan)
    experts = model.layers[1].moe.experts
    assert experts.recipes == {"w13": "rowwise"} and experts.group_alignment == 16
    assert not any("E4M3" in note for note in record.notes)
    # w2 has no recipe: it runs GroupedExperts' BF16 torch._grouped_mm, on CPU too.
    x = torch.randn(32, 256)
    offsets = offsets_of([16, 0, 16, 0, 0, 0, 0, 0])
    expected = torch._grouped_mm(x, experts.w2.transpose(-2, -1), offs=offsets)
    assert torch.equal(experts.grouped_mm(x, experts.w2, offsets), expected)


def test_converted_moe_layer_trains_on_the_kernel_contracts():
    model, plan = _tiny_moe_and_plan()
    moe = model.layers[1].moe
    GroupedFP8Backend(kernels="torch").convert(model, [plan.decision("layers.1.moe.experts.w13"),
                                                       plan.decision("layers.1.moe.experts.w2")], plan)
    moe.experts.blockwise_kernels = BLOCKWISE_KERNELS["torch"]()  # the GPU kernels' contract, in FP32 on CPU
    reference = GroupedExperts(256, 256, 8)
    reference.load_state_dict(moe.experts.state_dict())
    x = torch.randn(2, 16, 256)
    y = moe(x)
    baseline_experts, moe.experts = moe.experts, reference
    baseline = moe(x)
    moe.experts = baseline_experts
    assert rel_err(y, baseline) < FP8_TOLERANCE
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.1, foreach=False)
    losses = []
    for _ in range(3):
        loss = moe(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert moe.experts.w13.grad is not None and torch.isfinite(moe.experts.w13.grad).all()


def _decision(fqn, recipe="blockwise", n=256, k=256):
    return Decision(Component(fqn=fqn, kind="expert", n=n, k=k), "grouped_fp8", recipe, "test")


def test_convert_refuses_decisions_it_cannot_honour():
    model, plan = _tiny_moe_and_plan()
    backend = GroupedFP8Backend(kernels="torch")
    with pytest.raises(PlanError, match="FeedForward, not a GroupedExperts"):
        backend.convert(model, [_decision("layers.0.feed_forward.w13")], plan)
    with pytest.raises(PlanError, match="Linear, not a GroupedExperts"):
        backend.convert(model, [_decision("layers.1.attention.wo")], plan)
    with pytest.raises(PlanError, match="no such module"):
        backend.convert(model, [_decision("layers.9.moe.experts.w13")], plan)
    with pytest.raises(PlanError, match="runs only blockwise, rowwise, rowwise_gw_hp"):
        backend.convert(model, [_decision("layers.1.moe.experts.w13", recipe="tensorwise")], plan)
    backend.convert(model, [_decision("layers.1.moe.experts.w13")], plan)
    with pytest.raises(PlanError, match="already a Float8GroupedExperts"):
        backend.convert(model, [_decision("layers.1.moe.experts.w2")], plan)


def test_convert_refuses_shapes_the_kernels_cannot_take():
    experts = GroupedExperts(dim=200, hidden_dim=128, num_experts=2)
    plan = Plan(model="odd", recipe="blockwise", fp8_format="e4m3", arch=90, decisions=())
    with pytest.raises(PlanError, match="divisible by 128"):
        GroupedFP8Backend(kernels="torch").convert(experts, [_decision("w13")], plan)
    root, record = GroupedFP8Backend(kernels="torch").convert(
        GroupedExperts(dim=256, hidden_dim=128, num_experts=2), [_decision("w2")], plan)
    assert type(root) is Float8GroupedExperts and record.converted == {"w2": "Float8GroupedExperts"}


def test_available_gives_a_reason_without_a_gpu():
    backend = get_backend("grouped_fp8")
    assert isinstance(backend, GroupedFP8Backend) and backend.name == "grouped_fp8"
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ok, reason = backend.available()
    assert not ok and "no CUDA GPU" in reason
    with pytest.raises(ValueError, match="kernels='cutlass'"):
        GroupedFP8Backend(kernels="cutlass")


# ---- the fused quantizers (fp8_quant) against the eager references --------------------------------------

def _bits(t):
    """Tensors (or nested tuples of them) as comparable bit patterns."""
    if isinstance(t, tuple):
        return [_bits(u) for u in t]
    values = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return t.dtype, tuple(t.shape), t.stride(), values.tolist()


def test_whole_buffer_quantization_equals_the_per_expert_reference():
    """1x128 tiles along the tokens of a 128-aligned buffer never cross an expert group: one call over the
    buffer is the per-expert quantization of the reference wgrad."""
    padding = TokenGroupPadding.build(offsets_of([130, 0, 7, 300]), num_tokens=437, alignment=BLOCK)
    source = torch.randn(437, 256)
    x = padding.pad(source)
    rows, cols = fp8_quant.quantize_both_1x128.eager(x)
    assert _bits(rows) == _bits(quantize_1x128(x))
    assert _bits(fp8_quant.gather_quantize_both_1x128.eager(source, padding.source)) == _bits((rows, cols))
    start = 0
    for count in padding.counts:
        tokens, tiles = slice(start, start + count), slice(start // BLOCK, (start + count) // BLOCK)
        if count:
            whole = Fp8Tensor(cols.data[:, tokens].contiguous(), cols.scale[:, tiles].contiguous())
            assert _bits(whole) == _bits(quantize_1x128(x[tokens].T))
        start += count


def test_aligned_token_group_quantization_equals_the_reference():
    padding = TokenGroupPadding.build(offsets_of([20, 0, 45, 64]), num_tokens=134, alignment=16)
    x = padding.pad(torch.randn(134, 96) * torch.logspace(-2, 2, 96))
    assert _bits(fp8_quant.quantize_token_groups_aligned(x, padding.offsets)) == \
        _bits(quantize_token_groups(x, padding.offsets))


def test_compiled_quantizers_equal_eager_bit_for_bit_without_recompiling(tmp_path, monkeypatch):
    """What runs on CUDA is the same Python compiled by inductor; here on CPU. Max and abs are exact and
    inductor keeps divisions and products correctly rounded (div_rn in Triton), so the FP8 bits match.
    A second row count reuses the compiled graph (the token dim is dynamic). No compiled graph is stored
    on disk for another process to reuse with kernels tuned for other sizes."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    w = torch.randn(2, 256, 384) * torch.logspace(-3, 3, 384)
    padding = TokenGroupPadding.build(offsets_of([20, 0, 45, 64]), num_tokens=134, alignment=16)
    for fn, weight_like in [(fp8_quant.quantize_blocks_128x128, True), (fp8_quant.quantize_rowwise_transposed, True),
                            (fp8_quant.quantize_both_1x128, False),
                            (fp8_quant.gather_quantize_rowwise_and_groups, False)]:
        graphs = counters["stats"]["unique_graphs"]
        for rows in (256, 384):
            x = (torch.randn(rows, 640) * torch.logspace(-3, 3, 640)).bfloat16()
            x[:128, :128] = 0  # an all-zero tile
            args = (w,) if weight_like else (x,) if fn is fp8_quant.quantize_both_1x128 else (
                x[:134], padding.source, padding.offsets)
            assert _bits(fn.compiled(*args)) == _bits(fn.eager(*args)), fn.__name__
        assert counters["stats"]["unique_graphs"] - graphs == 1, fn.__name__
    source = padding.unpad_source
    y = torch.randn(padding.rows, 32)
    assert torch.equal(fp8_quant.gather_rows_fused.compiled(y, source), padding.unpad(y))
    blocks = fp8_quant.quantize_blocks_128x128(w)
    transposed = fp8_quant.transpose_blocks(blocks)  # eager here; the compiled byte transpose must agree
    assert torch.equal(fp8_quant._transposed_bytes.compiled(blocks.data.view(torch.uint8)),
                       transposed.data.view(torch.uint8))
    direct = quantize_128x128(w.transpose(1, 2))
    assert transposed.data.is_contiguous() and torch.equal(transposed.scale, direct.scale)
    assert torch.equal(transposed.data.view(torch.uint8), direct.data.view(torch.uint8))
    assert not {"fxgraph", "aotautograd"} & {path.name for path in tmp_path.iterdir()}


def test_compiled_aligned_group_quantizers_equal_eager_whatever_the_row_count():
    """The aligned path appends its zero rows inside the compiled quantizer: bit for bit the eager result, from one
    graph for row counts that need rows appended and for those that need none."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    offsets = offsets_of([128, 0, 128])
    cases = [(fp8_quant.pad_quantize_both_1x128, lambda x: (x, BLOCK)),
             (fp8_quant.pad_quantize_rowwise_and_groups, lambda x: (x, offsets, 16))]
    for fn, args_of in cases:
        graphs = counters["stats"]["unique_graphs"]
        for rows in (384, 300):
            x = (torch.randn(rows, 256) * torch.logspace(-3, 3, 256)).bfloat16()
            assert _bits(fn.compiled(*args_of(x))) == _bits(fn.eager(*args_of(x))), (fn.__name__, rows)
        assert counters["stats"]["unique_graphs"] - graphs == 1, fn.__name__


# ---- FP8 dispatch: each token quantized once, its FP8 rows permuted ------------------------------------------

DISPATCH_TOKENS = 300
"""Tokens of the dispatch problems: fewer than their 437 rows, so tokens repeat (top-k copies)."""


def _dispatch_problem(counts=UNEVEN, seed=0):
    """(tokens x [T, 640], w [E, 256, 640], offsets, row_token) laid out as MoE's permute lays its buffer out: each
    group's rows padded to 128 (row_token T there), the static room of E * 127 rows after the groups. Rows read
    random tokens, repeated ones among them; the last 20 tokens are routed nowhere (dropped)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(DISPATCH_TOKENS, 640, generator=generator)
    w = torch.randn(len(counts), 256, 640, generator=generator) * 0.05
    padded = [-(-count // BLOCK) * BLOCK for count in counts]
    row_token = torch.full((sum(counts) + len(counts) * (BLOCK - 1),), DISPATCH_TOKENS)
    start = 0
    for count, room in zip(counts, padded):
        row_token[start:start + count] = torch.randint(0, DISPATCH_TOKENS - 20, (count,), generator=generator)
        start += room
    return x, w, offsets_of(padded), row_token


def _dispatched_and_gathered(trained, kernels, main_grad=None):
    """(y, x.grad, w's gradient) of DispatchedBlockwiseGroupedMM on the tokens and of BlockwiseGroupedMM on the
    BF16 rows x[row_token] (the BF16 dispatch), for the same upstream gradient."""
    x, w, offsets, row_token = _dispatch_problem()
    grad_y = torch.randn(row_token.numel(), w.shape[1], generator=torch.Generator().manual_seed(1))
    outs = []
    for dispatched in (True, False):
        leaves = [x.clone().requires_grad_(trained != "w"), w.clone().requires_grad_(trained != "x")]
        into = None if main_grad is None else main_grad.clone()
        if dispatched:
            y = DispatchedBlockwiseGroupedMM.apply(*leaves, offsets, row_token, BLOCKWISE_KERNELS[kernels](), into)
        else:
            rows = torch.cat([leaves[0], leaves[0].new_zeros(1, 640)])[row_token]
            y = BlockwiseGroupedMM.apply(rows, leaves[1], offsets, BLOCKWISE_KERNELS[kernels](), True, into)
        y.backward(grad_y)
        outs.append((y.detach(), leaves[0].grad, leaves[1].grad if into is None else into))
    return outs


@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
@pytest.mark.parametrize("trained", ["both", "x", "w", "main_grad"])
def test_fp8_dispatch_equals_blockwise_on_the_gathered_rows(kernels, trained):
    """Quantizing a token once and copying its FP8 row equals quantizing each BF16 copy (1x128 tiles never mix rows),
    and the wgrad operand quantized in the backward from the tokens through the index equals the one the BF16
    dispatch quantizes from its rows: output, token gradient and weight gradient (or main_grad) bit for bit, an
    empty expert, padding rows and dropped tokens included."""
    main_grad = torch.full((len(UNEVEN), 256, 640), 0.5) if trained == "main_grad" else None
    dispatched, gathered = _dispatched_and_gathered(trained, kernels, main_grad)
    rows = sum([256, 0, 128, 384])  # y past the groups: what the GEMM left, for no reader
    for fp8_rows, bf16_rows, per_row in zip(dispatched, gathered, (True, False, False)):
        assert (fp8_rows is None) == (bf16_rows is None)
        if fp8_rows is not None:
            assert torch.equal(fp8_rows[:rows], bf16_rows[:rows]) if per_row else torch.equal(fp8_rows, bf16_rows)
    y, grad_x, grad_w = dispatched
    assert y[:rows].abs().sum() > 0
    if grad_x is not None:
        assert (grad_x[-20:] == 0).all() and grad_x[:-20].abs().sum() > 0  # dropped tokens get no gradient
    if trained in ("both", "w"):
        assert (grad_w[UNEVEN.index(0)] == 0).all()


def test_gathered_fp8_rows_are_the_gathered_rows_quantized():
    """gather_fp8_rows moves 1x128-quantized rows (codes as bytes, scales alongside): what quantizing the gathered
    rows gives, bit for bit, zero rows (-1) included as code 0 with scale 1; compiled, the same bits, one graph
    for two token counts."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for tokens in (300, 200):
        x = (torch.randn(tokens, 640) * torch.logspace(-3, 3, 640)).bfloat16()
        row_token = torch.cat([torch.randint(0, tokens, (500,)), torch.full((100,), tokens)])
        source = fp8_quant.dispatch_source(row_token, tokens, BLOCK)
        assert source.shape == (640,) and (source[500:] == -1).all()  # padded up to whole 128-row tiles
        quantized = fp8_quant.quantize_rows_1x128(x)
        moved = fp8_quant.gather_fp8_rows(quantized, source)
        assert moved.data.dtype == torch.float8_e4m3fn and moved.scale.shape == (640, 5)
        assert _bits(moved) == _bits(quantize_1x128(fp8_quant.gather_rows(x, source)))
        assert (moved.scale[500:] == 1).all() and (moved.data[500:].view(torch.uint8) == 0).all()
        codes = quantized.data.view(torch.uint8)
        compiled = fp8_quant._gather_code_rows.compiled(codes, quantized.scale, source)
        assert _bits(compiled) == _bits(fp8_quant._gather_code_rows.eager(codes, quantized.scale, source))
        assert _bits(fp8_quant.quantize_rows_1x128.compiled(x)) == _bits(quantized)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the quantizer's graph and the gather's


def _moe_on_contracts(kernels: str, fp8_dispatch: bool, dim: int = 256):
    """A converted tiny-moe MoE layer (blockwise experts, the kernels' contracts in FP32 on CPU) whose expert 0 no
    token chooses (its routing bias pushes it out of every top-k): an empty group."""
    model, plan = _tiny_moe_and_plan()
    decisions = [plan.decision("layers.1.moe.experts.w13"), plan.decision("layers.1.moe.experts.w2")]
    GroupedFP8Backend(kernels="torch", fp8_dispatch=fp8_dispatch).convert(model, decisions, plan)
    moe = model.layers[1].moe
    moe.experts.blockwise_kernels = BLOCKWISE_KERNELS[kernels]()
    with torch.no_grad():
        moe.expert_bias[0] = -1e3
    return moe


@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_layer_with_the_fp8_dispatch_equals_the_bf16_dispatch_bit_for_bit(kernels, autocast):
    """The whole layer (router, permutation, both expert GEMMs, combine, shared expert) forward and backward: the
    FP8 dispatch changes where the rows are quantized, not one bit of the output or of any gradient."""
    runs = []
    for fp8_dispatch in (True, False):
        moe = _moe_on_contracts(kernels, fp8_dispatch)
        assert moe.experts.permutes_tokens == fp8_dispatch
        x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = moe(x)
        y.float().square().mean().backward()
        runs.append([y.detach(), x.grad, *(p.grad for p in moe.parameters())])
        assert moe.tokens_per_expert[0] == 0  # expert 0 got no token
    for fp8_rows, bf16_rows in zip(*runs):
        assert torch.equal(fp8_rows, bf16_rows)


class ZeroingRowsPastGroups:
    """Grouped GEMM kernels whose m-grouped output has its rows past the last group zeroed: what the aligned path
    handed on when it zeroed them (a pass over the whole output); `tails` records how many such rows each call had."""

    def __init__(self, kernels, zero: bool):
        self.kernels, self.zero, self.tails = kernels, zero, []

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def m_grouped(self, a, b, groups):
        out = self.kernels.m_grouped(a, b, groups)
        end = (groups if isinstance(groups, torch.Tensor) else groups.offsets)[-1]
        past = (torch.arange(out.shape[0]) >= end).unsqueeze(1)
        self.tails.append(int(past.sum()))
        assert self.zero or out[past.squeeze(1)].isnan().all()  # the contracts' unwritten rows
        return torch.where(past, 0, out) if self.zero else out


@pytest.mark.parametrize("experts", ["blockwise", "blockwise-fp8-dispatch", "rowwise"])
def test_no_reader_of_an_moe_layer_sees_the_rows_past_its_groups(experts):
    """The aligned path leaves the GEMM outputs' rows past the last group as the kernels left them: NaN in these
    contracts, as uninitialised memory may be on a GPU. A converted MoE layer reads none of them, forward or
    backward: its output and every gradient are bit for bit those of the same layer whose kernels zero those rows
    (the zeroing the aligned path did), and finite."""
    recipe = experts.split("-")[0]
    runs, tails = [], []
    for zero in (True, False):
        model, plan = _tiny_moe_and_plan(recipe=recipe, fp8_format="e4m3")
        backend = GroupedFP8Backend(kernels="torch", fp8_dispatch=experts.endswith("fp8-dispatch"))
        backend.convert(model, [plan.decision("layers.1.moe.experts.w13"),
                                plan.decision("layers.1.moe.experts.w2")], plan)
        moe = model.layers[1].moe
        kernels = ZeroingRowsPastGroups(BLOCKWISE_KERNELS["deepgemm"]() if recipe == "blockwise" else
                                        TorchRowwiseKernels(ContractScaledGroupedMM()), zero)
        moe.experts.blockwise_kernels = moe.experts.rowwise_kernels = kernels
        x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = moe(x)
        y.square().mean().backward()
        runs.append([y.detach(), x.grad, *(p.grad for p in moe.parameters())])
        tails.append(kernels.tails)
    assert tails[0] == tails[1] and len(tails[0]) == 4 and min(tails[0]) > 0  # fprop and dgrad of w13 and w2
    for zeroed, left in zip(*runs, strict=True):
        assert torch.isfinite(left).all() and torch.equal(zeroed, left)


def _gathers_and_quantized_shapes(moe, x, monkeypatch) -> tuple[list, list]:
    """The row gathers (aten.index) of a forward as (rows, columns, dtype), and the shape of every tensor the
    blockwise quantizers quantize (quantize_1x128's input)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gathers, quantized = [], []
    monkeypatch.setattr(fp8_quant, "quantize_1x128", lambda t: quantized.append(tuple(t.shape)) or quantize_1x128(t))

    class RecordGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index.Tensor and out.dim() == 2:
                gathers.append((*out.shape, out.dtype))
            return out

    with RecordGathers():
        moe(x)
    return gathers, quantized


def test_the_fp8_dispatch_moves_fp8_rows_and_quantizes_each_token_once(monkeypatch):
    """Counted by structure in one forward, D = 384 (neither F = 128 nor 2F): the FP8 dispatch's row buffer is
    gathered as bytes (its scales beside it, D / 128 columns), where the BF16 dispatch gathers floating-point rows;
    the first GEMM's operand is quantized from the T tokens once, where the BF16 dispatch quantizes its rows (R
    of them, ~ top-k x T) and their transpose."""
    from fp8stack.models.moe import MoE, MoEConfig

    torch.manual_seed(0)
    tokens, dim, top_k, experts = 64, 384, 2, 4
    rows = tokens * top_k + experts * (BLOCK - 1)
    seen = {}
    for fp8_dispatch in (True, False):
        moe = MoE(dim, MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_dim=128))
        moe.init_weights(0.02)
        moe.experts = Float8GroupedExperts.from_experts(moe.experts, {"w13": "blockwise", "w2": "blockwise"},
                                                        BLOCKWISE_KERNELS["deepgemm"](), None, fp8_dispatch)
        seen[fp8_dispatch] = _gathers_and_quantized_shapes(moe, torch.randn(tokens, dim), monkeypatch)
    buffer = -(-rows // BLOCK) * BLOCK
    (fp8_gathers, fp8_quantized), (bf16_gathers, bf16_quantized) = seen[True], seen[False]
    assert {g for g in fp8_gathers if g[0] >= rows} == {(buffer, dim, torch.uint8),
                                                        (buffer, dim // BLOCK, torch.float32)}
    assert [shape for shape in fp8_quantized if dim in shape] == [(tokens, dim)]
    assert {g for g in bf16_gathers if g[0] >= rows} == {(buffer, dim, torch.float32)}  # the MoE's whole tiles
    assert [shape for shape in bf16_quantized if dim in shape] == [(buffer, dim), (dim, buffer)]


@pytest.mark.parametrize("kernels, forward_reads", [("deepgemm", 0), ("torch", 1)])
def test_the_fp8_dispatch_reads_nothing_on_the_host(kernels, forward_reads, monkeypatch):
    """Routing to FP8 rows (permute, the row index, the quantizer, the gather) compiles into one graph
    (fullgraph=True: an .item(), .tolist() or any other host read would break it) and gives the eager bits; the
    layer's forward reads the group sizes only where its kernels do (torch's per-expert slices), as
    BlockwiseGroupedMM's."""
    import fp8stack.backends.grouped as grouped
    from fp8stack.models.moe import permute

    def route_to_fp8_rows(x: torch.Tensor, chosen: torch.Tensor) -> Fp8Tensor:
        perm = permute(chosen, 8, BLOCK)
        source = fp8_quant.dispatch_source(perm.row_token, x.shape[0], BLOCK)
        return fp8_quant.gather_fp8_rows(fp8_quant.quantize_rows_1x128(x), source)

    x, chosen = torch.randn(64, 256), torch.randint(0, 8, (64, 2))
    assert _bits(torch.compile(route_to_fp8_rows, fullgraph=True)(x, chosen)) == _bits(route_to_fp8_rows(x, chosen))
    reads = []
    real_group_counts = grouped.group_counts
    monkeypatch.setattr(grouped, "group_counts", lambda offsets: reads.append(1) or real_group_counts(offsets))
    moe = _moe_on_contracts(kernels, fp8_dispatch=True)
    moe.experts.recipes = {"w13": "blockwise"}  # w2 in BF16: the count is the dispatched GEMM's alone
    moe(torch.randn(2, 16, 256))
    assert len(reads) == forward_reads


def test_fp8_dispatch_is_a_grouped_fp8_option_the_conversion_notes_report():
    """Off by default; on, every experts module whose w13 runs blockwise takes the tokens (permutes_tokens) and the
    record says so, and names those that keep the BF16 dispatch; a plan without a blockwise w13 is refused."""
    model, plan = _tiny_moe_and_plan()
    _, record = GroupedFP8Backend(kernels="torch").convert(model, plan.for_backend("grouped_fp8"), plan)
    assert not model.layers[1].moe.experts.permutes_tokens and not any("fp8_dispatch" in n for n in record.notes)
    model, plan = _tiny_moe_and_plan()
    decisions = [d for d in plan.for_backend("grouped_fp8") if d.fqn != "layers.2.moe.experts.w13"]
    _, record = GroupedFP8Backend(kernels="torch", fp8_dispatch=True).convert(model, decisions, plan)
    assert [model.layers[i].moe.experts.permutes_tokens for i in (1, 2, 3)] == [True, False, True]
    assert "fp8_dispatch=True" in repr(model.layers[1].moe.experts)
    dispatch_notes = [n for n in record.notes if n.startswith("fp8_dispatch")]
    assert dispatch_notes[0].startswith("fp8_dispatch: 2 experts module(s) take their MoE's tokens")
    assert dispatch_notes[1] == ("fp8_dispatch: layers.2.moe.experts (w13 bf16) keep the BF16 dispatch: the FP8 "
                                 "rows feed a blockwise w13 only")
    model, plan = _tiny_moe_and_plan(recipe="rowwise", fp8_format="e4m3")
    with pytest.raises(PlanError, match="gives grouped_fp8 none: plan the experts blockwise"):
        GroupedFP8Backend(fp8_dispatch=True).convert(model, plan.for_backend("grouped_fp8"), plan)


def _job(*flags: str):
    from fp8stack.train.command import job_from_flags
    from fp8stack.train.loop import resolve_job

    return resolve_job(job_from_flags(["--model", "tiny-moe", "--device", "cpu", *flags]))


def test_fp8_dispatch_flows_from_the_command_line_to_the_experts():
    """--grouped-fp8.fp8-dispatch reaches grouped_fp8's constructor through the trainer's backend options, and the
    converted experts take the tokens; a plan whose experts are not blockwise on grouped_fp8 is refused before the
    assembly, with the flags that fix it."""
    from fp8stack.config import ConfigError, from_overrides
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    cfg = _job("--fp8-recipe", "blockwise", "--expert-backend", "grouped_fp8", "--grouped-fp8.fp8-dispatch")
    assert cfg.grouped_fp8.fp8_dispatch and not _job().grouped_fp8.fp8_dispatch
    model = build_model(cfg, torch.device("cpu"))
    plan = build_plan(cfg, model)
    options = _backend_options(cfg, plan, micro_batches=1)["grouped_fp8"]
    assert options == {"fp8_dispatch": True, "cache_fp8_weights": False}  # one micro-batch: nothing to reuse
    GroupedFP8Backend(kernels="torch", **options).convert(model, plan.for_backend("grouped_fp8"), plan)
    assert all(model.layers[i].moe.experts.permutes_tokens for i in (1, 2, 3))
    for flags, runs_on in [(("--fp8-recipe", "rowwise", "--expert-backend", "grouped_fp8"), "grouped_fp8/rowwise"),
                           (("--fp8-recipe", "blockwise", "--expert-backend", "te"), "te/blockwise")]:
        cfg = _job(*flags, "--grouped-fp8.fp8-dispatch")
        plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
        with pytest.raises(ConfigError, match=f"runs its experts on {runs_on}: pass --fp8-recipe blockwise "
                                              "--expert-backend grouped_fp8, or drop --grouped-fp8.fp8-dispatch"):
            _backend_options(cfg, plan, micro_batches=1)
    with pytest.raises(ConfigError, match=r"megatron does not take grouped_fp8.fp8_dispatch \(the plain MoE's FP8 "):
        from_overrides({"model.impl": "megatron", "precision.recipe": "blockwise", "grouped_fp8.fp8_dispatch": True})


def test_wgrad_flatten_flows_from_the_command_line_to_deepgemm_s_kernels(monkeypatch):
    """--grouped-fp8.wgrad-flatten compiled reaches grouped_fp8's constructor through the trainer's backend options,
    and the DeepGEMM kernels of the converted experts (DeepGEMM's contract standing in) lay out their wgrad operands
    by the compiled gather, the conversion notes saying so; a plan whose experts are not blockwise on grouped_fp8 is
    refused before the assembly, and the Megatron path refuses the option."""
    from fp8stack.config import ConfigError, from_overrides
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    monkeypatch.setattr(deepgemm, "load", lambda: (ContractDeepGemm(), ""))
    cfg = _job("--fp8-recipe", "blockwise", "--expert-backend", "grouped_fp8", "--grouped-fp8.wgrad-flatten",
               "compiled")
    assert cfg.grouped_fp8.wgrad_flatten == "compiled" and _job().grouped_fp8.wgrad_flatten == "auto"
    model = build_model(cfg, torch.device("cpu"))
    plan = build_plan(cfg, model)
    options = _backend_options(cfg, plan, micro_batches=1)["grouped_fp8"]
    assert options == {"wgrad_flatten": "compiled", "cache_fp8_weights": False}
    model, record = GroupedFP8Backend(**options).convert(model, plan.for_backend("grouped_fp8"), plan)
    kernels = [model.layers[i].moe.experts.blockwise_kernels for i in (1, 2, 3)]
    assert all(k.flatten_k_grouped is deepgemm.flatten_k_grouped_compiled for k in kernels)
    assert "wgrad_flatten compiled: DeepGEMM's K-grouped wgrad operands laid out by one compiled gather each, not a " \
           "copy per expert" in record.notes
    cfg = _job("--fp8-recipe", "rowwise", "--expert-backend", "grouped_fp8", "--grouped-fp8.wgrad-flatten", "compiled")
    plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
    with pytest.raises(ConfigError, match="runs its experts on grouped_fp8/rowwise: pass --fp8-recipe blockwise "
                                          "--expert-backend grouped_fp8, or drop --grouped-fp8.wgrad-flatten"):
        _backend_options(cfg, plan, micro_batches=1)
    with pytest.raises(ConfigError, match=r"megatron does not take grouped_fp8.wgrad_flatten \(grouped_fp8's DeepGEMM"):
        from_overrides({"model.impl": "megatron", "precision.recipe": "blockwise",
                        "grouped_fp8.wgrad_flatten": "compiled"})


def test_wgrad_flatten_compiled_is_refused_or_noted_where_deepgemm_does_not_run_the_experts(monkeypatch):
    """An unknown value and kernels torch are refused at construction; a plan without blockwise experts before any
    swap; where auto falls back to torch's kernels (no DeepGEMM) the option does nothing, and the notes say why."""
    with pytest.raises(ValueError, match="wgrad_flatten='gather': use one of auto, copies, compiled, triton"):
        GroupedFP8Backend(wgrad_flatten="gather")
    with pytest.raises(ValueError, match="kernels=torch runs torch's scaled_mm per expert: use kernels deepgemm"):
        GroupedFP8Backend(kernels="torch", wgrad_flatten="compiled")
    model, plan = _tiny_moe_and_plan(recipe="rowwise", fp8_format="e4m3")
    with pytest.raises(PlanError, match="gives grouped_fp8 none: plan the experts blockwise .* or leave "
                                        "wgrad_flatten at auto"):
        GroupedFP8Backend(wgrad_flatten="compiled").convert(model, plan.for_backend("grouped_fp8"), plan)
    assert type(model.layers[1].moe.experts) is GroupedExperts
    monkeypatch.setattr(deepgemm, "load", lambda: (None, "deep_gemm is not importable (test)"))
    model, plan = _tiny_moe_and_plan()
    _, record = GroupedFP8Backend(wgrad_flatten="compiled").convert(model, plan.for_backend("grouped_fp8"), plan)
    assert isinstance(model.layers[1].moe.experts.blockwise_kernels, TorchBlockwiseKernels)
    assert "wgrad_flatten compiled: no effect, the blockwise GEMMs run on torch scaled_mm per expert (deep_gemm is " \
           "not importable (test)), which slice each expert's operands themselves" in record.notes


def test_the_default_wgrad_flattening_is_noted_on_deepgemm_and_asks_nothing_elsewhere(monkeypatch):
    """wgrad_flatten auto, the default: on DeepGEMM (its contract standing in) the notes name the Triton copy; with
    kernels torch, without DeepGEMM or without blockwise experts it neither refuses nor notes anything."""
    monkeypatch.setattr(deepgemm, "load", lambda: (ContractDeepGemm(), ""))
    model, plan = _tiny_moe_and_plan()
    _, record = GroupedFP8Backend().convert(model, plan.for_backend("grouped_fp8"), plan)
    assert model.layers[1].moe.experts.blockwise_kernels.flatten_k_grouped is deepgemm.flatten_k_grouped_auto
    assert "wgrad_flatten auto: DeepGEMM's K-grouped wgrad operands laid out by one Triton tile copy each on CUDA, " \
           "not a copy per expert" in record.notes
    monkeypatch.setattr(deepgemm, "TRITON_IMPORTABLE", False)
    model, plan = _tiny_moe_and_plan()
    _, record = GroupedFP8Backend().convert(model, plan.for_backend("grouped_fp8"), plan)
    assert "wgrad_flatten auto: DeepGEMM's K-grouped wgrad operands laid out by a copy per expert, since triton is " \
           "not importable" in record.notes
    for backend, (recipe, fp8_format) in ((GroupedFP8Backend(kernels="torch"), ("blockwise", "e4m3")),
                                          (GroupedFP8Backend(), ("rowwise", "e4m3"))):
        model, plan = _tiny_moe_and_plan(recipe=recipe, fp8_format=fp8_format)
        _, record = backend.convert(model, plan.for_backend("grouped_fp8"), plan)
        assert not any("wgrad_flatten" in note for note in record.notes), record.notes


# ---- quantizer te: TE's Float8BlockQuantizer for the activations and gradients -----------------------------

def te_kernel_1x128(x: torch.Tensor) -> Fp8Tensor:
    """TE 2.20's 1x128 block quantization of x [R, K] (block_scaled_1d_cast_transpose_kernel, Step 2, in
    common/transpose/quantize_transpose_vector_blockwise.cu; compute_scale_from_amax in common/recipe/recipe_common.cuh;
    amax_epsilon 0, force_pow_2_scales off), each FP32 operation computed in FP64, where it is exact or rounds
    innocuously, and rounded to FP32 once, as IEEE FP32 arithmetic rounds it: scale = 448 / amax (1 for amax 0, inf or
    NaN; the input dtype's largest finite value where the quotient overflows), codes E4M3(x * scale), saturated
    (cvt.rn.satfinite), scale_inv = (float)(1.0 / (double)scale). NaN elements aside (the kernel's fmaxf skips them)."""
    rows, k = x.shape
    tiles = x.double().unflatten(-1, (k // BLOCK, BLOCK))
    amax = tiles.abs().amax(dim=-1)
    quotient = (torch.full_like(amax, FP8_MAX) / amax).float()
    scale = torch.where((amax > 0) & amax.isfinite(), quotient, torch.ones_like(quotient))
    scale = torch.where(scale.isinf(), torch.finfo(x.dtype).max, scale)
    product = (tiles * scale.double().unsqueeze(-1)).float()  # 8 or 24 bits times 24: exact in FP64
    codes = product.clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2).contiguous()
    return Fp8Tensor(codes, (torch.ones_like(amax) / scale.double()).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_1x128_quantization_is_te_kernel_arithmetic_bit_for_bit(dtype):
    """quantize_1x128, eager and compiled by inductor, writes TE's kernel's codes and scales bit for bit: on data
    spanning 6 decades, an all-zero tile (scale 1), a subnormal tile (for BF16 and FP32 inputs 448 / amax overflows
    FP32: the input dtype's largest value), an infinite element (scale 1, saturated codes)."""
    x = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 1024)).to(dtype)
    x[0, :128] = 0
    x[1, :128] = torch.finfo(dtype).tiny / 4
    x[2, 5] = float("inf")
    expected = te_kernel_1x128(x)
    assert expected.scale[0, 0] == 1 and expected.scale[2, 0] == 1
    if dtype != torch.float16:
        assert expected.scale[1, 0] == torch.tensor(1 / torch.finfo(dtype).max).float()
    for got in (quantize_1x128(x), fp8_quant.quantize_rows_1x128.compiled(x)):
        assert _bits(got) == _bits(expected)


def test_dividing_by_the_decode_scale_rounds_bf16_ties_the_other_way():
    """Why quantize_1x128 follows TE's arithmetic. x / (amax / 448), dividing by the decode scale, and TE's
    x * (448 / amax) each round x * 448 / amax once more in FP32 before the E4M3 cast: they part where that value is
    an exact tie between two E4M3 codes, each landing on a side of its own. BF16's 8-bit significands make such ties
    common (448 = 7 x 2^6): ~0.03% of the codes, 1 code apart, in a few % of the tiles, each tile's the same way.
    Enough for ~0.5% differences in an expert block whose second GEMM re-quantizes them (6.5e-3 between the two
    quantizers' MoE layers on an H200)."""
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    te = te_kernel_1x128(x)
    tiles = x.float().unflatten(-1, (8, BLOCK))
    divided = cast_to_fp8(tiles, decode_scale(tiles.abs().amax(dim=-1)).unsqueeze(-1)).flatten(-2)
    differ = te.data.view(torch.uint8) != divided.view(torch.uint8)
    assert 1e-4 < differ.float().mean() < 1e-3
    assert (te.data.view(torch.uint8)[differ].int() - divided.view(torch.uint8)[differ].int()).abs().max() == 1
    exact = x.double() * FP8_MAX / tiles.abs().amax(dim=-1).double().repeat_interleave(BLOCK, dim=-1)
    midpoints = (te.data[differ].double() + divided[differ].double()) / 2
    assert torch.equal(exact[differ], midpoints)  # ties, all of them
    away = (te.data.float().abs() - divided.float().abs()).unflatten(-1, (8, BLOCK))
    assert not ((away > 0).any(dim=-1) & (away < 0).any(dim=-1)).any()  # a tile's flips all go one way
    assert _bits(quantize_1x128(x)) == _bits(te)


def _te_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """1x128 scales [A, B] (A rows of B tiles) as TE stores them: [B, A rounded up to 4], A innermost, NaN padding."""
    stored = torch.full((scale.shape[1], -(-scale.shape[0] // 4) * 4), float("nan"))
    stored[:, :scale.shape[0]] = scale.t()
    return stored


class TEKernelInTELayout:
    """TE's 1x128 kernel's arithmetic (te_kernel_1x128) stored as TE 2.20 lays out Float8BlockQuantizer
    (block_scaling_dim=1)'s storage (its get_scale_shape): rowwise data [R, K] with scales [K/128, R padded to 4],
    columnwise data x^T [K, R] with scales [R/128, K padded to 4], data as uint8. What te_quant converts for DeepGEMM,
    so that the conversion and the plumbing run on CPU; TE's own kernel runs in tests/gpu/test_grouped_fp8_gpu.py."""

    internal = False

    def __init__(self, rowwise: bool, columnwise: bool):
        self.rowwise, self.columnwise = rowwise, columnwise

    def quantize(self, x: torch.Tensor) -> SimpleNamespace:
        stored = SimpleNamespace(_is_2D_scaled=False, _rowwise_data=None, _rowwise_scale_inv=None,
                                 _columnwise_data=None, _columnwise_scale_inv=None)
        if self.rowwise:
            rows = te_kernel_1x128(x)
            stored._rowwise_data, stored._rowwise_scale_inv = rows.data.view(torch.uint8), _te_scale_layout(rows.scale)
        if self.columnwise:
            cols = te_kernel_1x128(x.t())
            stored._columnwise_data = cols.data.view(torch.uint8)
            stored._columnwise_scale_inv = _te_scale_layout(cols.scale)
        return stored


def test_te_storage_converts_to_deepgemm_operands_equal_to_the_reference():
    """TE's layout, converted without a copy: the reference's data and scales, rows' scales MN-major (DeepGEMM's
    TMA-aligned layout as is), columns x^T [K, R] with scales [K, R/128]."""
    x = _problem(counts=[128, 0, 256], k=640)[0] * torch.logspace(-2, 2, 640)
    rows, cols = deepgemm_operands(TEKernelInTELayout(True, True).quantize(x))
    for got, expected in ((rows, quantize_1x128(x)), (cols, quantize_1x128(x.t()))):
        assert got.data.dtype == FP8 and torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(got.scale, expected.scale)
    assert rows.scale.stride() == (1, 384) and cols.data.shape == (640, 384) and cols.data.is_contiguous()
    assert deepgemm_operands(TEKernelInTELayout(False, True).quantize(x))[0] is None


@pytest.mark.parametrize("aligned", [False, True], ids=["gathered", "aligned"])
@pytest.mark.parametrize("extra_rows", [3 * 127, 128], ids=["rows-unaligned", "rows-aligned"])
@pytest.mark.parametrize("trained", ["both", "x", "w", "main_grad"])
def test_blockwise_on_te_layout_operands_equals_the_inductor_quantizer(aligned, extra_rows, trained):
    """TEBlockQuantizer's plumbing (the GEMMs' buffer, the conversion, forward, dgrad and wgrad) on DeepGEMM's
    contract: with TE's layout holding the reference's values, outputs and gradients are the default quantizer's bit
    for bit (the tokens' rows), on padded and aligned groups, an empty expert and rows that are not whole tiles
    included."""
    x, w, offsets = _problem(counts=[128, 0, 256, 128], extra_rows=extra_rows)
    x.requires_grad_(trained != "w")
    w.requires_grad_(trained != "x")
    grad_y = torch.randn(x.shape[0], w.shape[1])
    runs = []
    for quantizer in (INDUCTOR_QUANTIZER, TEBlockQuantizer(make=TEKernelInTELayout)):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w)]
        main_grad = torch.full(w.shape, 0.5) if trained == "main_grad" else None
        y = BlockwiseGroupedMM.apply(*leaves, offsets, BLOCKWISE_KERNELS["deepgemm"](), aligned, main_grad, quantizer)
        y.backward(grad_y)
        runs.append((y.detach(), leaves[0].grad, leaves[1].grad if main_grad is None else main_grad))
    rows = sum([128, 0, 256, 128])
    for inductor, te, per_token in zip(*runs, (True, True, False)):
        assert (inductor is None) == (te is None)
        if inductor is not None:
            assert torch.equal(inductor[:rows], te[:rows]) if per_token else torch.equal(inductor, te)


@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_moe_layer_on_te_layout_operands_equals_the_inductor_quantizer(fp8_dispatch):
    """The whole layer with the experts' quantizer te (TE's layout holding the reference's values): the MoE's buffer
    is whole tiles, so TE reads it as it is; output and every gradient bit for bit the default quantizer's. A copied
    model shares the quantizer (it has no state)."""
    runs = []
    for te in (False, True):
        moe = _moe_on_contracts("deepgemm", fp8_dispatch)
        if te:
            moe.experts.blockwise_quantizer = TEBlockQuantizer(make=TEKernelInTELayout)
            assert "quantizer=te" in repr(moe.experts)
            assert copy.deepcopy(moe).experts.blockwise_quantizer is moe.experts.blockwise_quantizer
        x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = moe(x)
        y.square().mean().backward()
        runs.append([y.detach(), x.grad, *(p.grad for p in moe.parameters())])
    for inductor, te in zip(*runs, strict=True):
        assert torch.equal(inductor, te)


def test_quantizer_te_is_refused_before_any_swap_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="quantizer='fast': use one of auto, inductor, te"):
        GroupedFP8Backend(quantizer="fast")
    with pytest.raises(ValueError, match="kernels=torch runs torch's scaled_mm: use kernels deepgemm"):
        GroupedFP8Backend(kernels="torch", quantizer="te")
    model, plan = _tiny_moe_and_plan(recipe="rowwise", fp8_format="e4m3")
    with pytest.raises(PlanError, match="gives grouped_fp8 none: plan the experts blockwise .* or use quantizer "
                                        "inductor"):
        GroupedFP8Backend(kernels="deepgemm", quantizer="te").convert(model, plan.for_backend("grouped_fp8"), plan)
    assert type(model.layers[1].moe.experts) is GroupedExperts
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # DeepGEMM not importable: auto falls back to torch's
    model, plan = _tiny_moe_and_plan()
    with pytest.raises(BackendUnavailable, match=r"blockwise GEMMs run on torch scaled_mm per expert \(deep_gemm is "
                                                 r"not importable.*install DeepGEMM, or use quantizer inductor"):
        GroupedFP8Backend(quantizer="te").convert(model, plan.for_backend("grouped_fp8"), plan)
    assert type(model.layers[1].moe.experts) is GroupedExperts
    for module in ("transformer_engine_torch", "transformer_engine.pytorch.tensor.float8_blockwise_tensor"):
        monkeypatch.setitem(sys.modules, module, None)  # TE not importable
    with pytest.raises(BackendUnavailable, match=r"TransformerEngine is not importable \(\w*Error.*pip install "
                                                 r"'fp8stack\[te\]' on a CUDA machine, or use grouped_fp8 quantizer "
                                                 "inductor"):
        GroupedFP8Backend(kernels="deepgemm", quantizer="te")._blockwise_quantizer(BLOCKWISE_KERNELS["deepgemm"](), "")


def test_quantizer_auto_takes_te_where_it_runs_and_says_why_not_elsewhere(monkeypatch):
    """The default quantizer: TE's where the blockwise experts run on DeepGEMM and TE imports, noted with its
    evidence; else the inductor quantizers, the note naming what is missing; nothing where no expert runs
    blockwise."""
    from fp8stack.backends import te_quant

    backend = GroupedFP8Backend()
    assert backend.quantizer == "auto"
    assert backend._blockwise_quantizer(None, "") == (INDUCTOR_QUANTIZER, [])
    torch_kernels = BLOCKWISE_KERNELS["torch"]()
    quantizer, notes = backend._blockwise_quantizer(torch_kernels, "deep_gemm is not importable (ImportError)")
    assert quantizer is INDUCTOR_QUANTIZER
    assert notes == [f"quantizer auto: inductor, since TE's operands are laid out for DeepGEMM, and the blockwise "
                     f"GEMMs run on {torch_kernels.name} (deep_gemm is not importable (ImportError))"]
    for module in ("transformer_engine_torch", "transformer_engine.pytorch.tensor.float8_blockwise_tensor"):
        monkeypatch.setitem(sys.modules, module, None)
    quantizer, [note] = backend._blockwise_quantizer(BLOCKWISE_KERNELS["deepgemm"](), "")
    assert quantizer is INDUCTOR_QUANTIZER
    assert note.startswith("quantizer auto: inductor, since TransformerEngine is not importable")
    monkeypatch.setattr(te_quant, "load", lambda: (TEKernelInTELayout, ""))
    quantizer, [note] = backend._blockwise_quantizer(BLOCKWISE_KERNELS["deepgemm"](), "")
    assert isinstance(quantizer, TEBlockQuantizer) and note.startswith("quantizer auto: the blockwise experts'")
    assert "profiles/runs/2026-11-28-backends-moe-medium-quantizers-h200" in note


def test_quantizer_flows_from_the_command_line_to_the_backend():
    """--grouped-fp8.quantizer te reaches grouped_fp8's constructor through the trainer's backend options; refused
    before the assembly where the plan has no blockwise experts on grouped_fp8, on the Megatron path, and for a
    name it does not know."""
    from fp8stack.config import ConfigError, from_overrides
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    cfg = _job("--fp8-recipe", "blockwise", "--expert-backend", "grouped_fp8", "--grouped-fp8.quantizer", "te")
    assert cfg.grouped_fp8.quantizer == "te" and _job().grouped_fp8.quantizer == "auto"
    plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
    options = _backend_options(cfg, plan, micro_batches=1)["grouped_fp8"]
    assert options == {"quantizer": "te", "cache_fp8_weights": False}
    cfg = _job("--fp8-recipe", "rowwise", "--expert-backend", "grouped_fp8", "--grouped-fp8.quantizer", "te")
    plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
    with pytest.raises(ConfigError, match="runs its experts on grouped_fp8/rowwise: pass --fp8-recipe blockwise "
                                          "--expert-backend grouped_fp8, or drop --grouped-fp8.quantizer"):
        _backend_options(cfg, plan, micro_batches=1)
    with pytest.raises(ConfigError, match=r"megatron does not take grouped_fp8.quantizer \(grouped_fp8's expert "):
        from_overrides({"model.impl": "megatron", "precision.recipe": "blockwise", "grouped_fp8.quantizer": "te"})
    with pytest.raises(ConfigError, match="unknown grouped_fp8.quantizer 'fast': use auto, inductor, te"):
        from_overrides({"grouped_fp8.quantizer": "fast"})


def test_the_breakdown_s_main_grad_steps_add_what_its_plain_steps_return():
    """fp8stack.bench.experts_breakdown's steps into main_grad (as training runs them) add into the FP32 buffer the
    weight gradient its plain steps hand autograd: BF16's GEMM, and the blockwise GEMMs' on the same operands; its
    step with the FP8 weight cached gives the uncached step's gradients bit for bit."""
    from fp8stack.bench import experts_breakdown

    torch.manual_seed(0)
    e, t, d, n = 2, 128, 256, 128
    x = torch.randn(e * t, d, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, d) * 0.02).to(torch.bfloat16).requires_grad_()
    offsets = torch.tensor([t, 2 * t], dtype=torch.int32)
    grad = torch.randn(e * t, n, dtype=torch.bfloat16)
    main_grad = torch.zeros(e, n, d)
    steps = experts_breakdown.w13_steps(x, w, offsets, grad, BLOCKWISE_KERNELS["deepgemm"](), INDUCTOR_QUANTIZER,
                                        main_grad)
    for plain, into in (("bf16 step", experts_breakdown.BF16_MAIN_GRAD_STEP),
                        ("fp8 step", experts_breakdown.FP8_MAIN_GRAD_STEP)):
        w.grad = None
        steps[plain]()
        returned = w.grad.float()
        main_grad.zero_()
        w.grad = x.grad = None
        steps[into]()
        x_grad_uncached = x.grad
        assert w.grad is None and torch.allclose(main_grad, returned, rtol=1e-2, atol=1e-3), plain
    uncached = main_grad.clone()  # the FP8 step's
    for call in range(2):  # the first makes the cached blocks, the second reuses them: both add the same bits
        main_grad.zero_()
        x.grad = None
        steps[experts_breakdown.FP8_CACHED_WEIGHT_STEP]()
        assert torch.equal(main_grad, uncached) and torch.equal(x.grad, x_grad_uncached), call


# ---- cache_fp8_weights: the blockwise weights' FP8 blocks made once per optimizer step -------------------------

class SpyKernels:
    """Blockwise kernels on the contract, recording the weight operand (FP8 data tensor) each GEMM reads."""

    def __init__(self, kernels):
        self.kernels, self.weights_read = kernels, []
        self.name, self.row_alignment = kernels.name, kernels.row_alignment
        self.capturable, self.capturable_backward = kernels.capturable, kernels.capturable_backward

    def m_grouped(self, a, b, groups):
        self.weights_read.append(b.data)
        return self.kernels.m_grouped(a, b, groups)

    def k_grouped(self, a, b, groups, into=None):
        return self.kernels.k_grouped(a, b, groups, into=into)


def _moe_on_contract(cache: bool, kernels: str = "torch", fp8_dispatch: bool = False):
    """tiny-moe's layer-1 MoE converted to blockwise grouped_fp8 with or without the FP8 weight cache, its GEMMs on the
    kernels' contract (recorded by SpyKernels), and an input needing a gradient (both GEMMs then run their dgrad)."""
    model, plan = _tiny_moe_and_plan()
    decisions = [plan.decision("layers.1.moe.experts.w13"), plan.decision("layers.1.moe.experts.w2")]
    _, record = GroupedFP8Backend(kernels="torch", cache_fp8_weights=cache, fp8_dispatch=fp8_dispatch).convert(
        model, decisions, plan)
    moe = model.layers[1].moe
    moe.experts.blockwise_kernels = SpyKernels(BLOCKWISE_KERNELS[kernels]())
    return moe, record, torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _count_weight_work(monkeypatch) -> dict[str, int]:
    """Calls of the 128x128 weight quantizer and of the FP8 block transpose, counted from now on."""
    calls = {"quantize": 0, "transpose": 0}
    for name, fn, key in (("quantize_blocks_128x128", fp8_quant.quantize_blocks_128x128, "quantize"),
                          ("transpose_blocks", fp8_quant.transpose_blocks, "transpose")):
        def counted(*args, _fn=fn, _key=key):
            calls[_key] += 1
            return _fn(*args)
        monkeypatch.setattr(fp8_quant, name, counted)
    return calls


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, foreach=False),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),  # leaves _version alone
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_cached_weight_blocks_are_made_once_per_optimizer_step(optimizer, monkeypatch):
    """With the cache, a step's second micro-batch reads the FP8 weight blocks (the same tensors) its first made, and
    its backward the transpose the first made; any torch.optim step, fused AdamW's included (no version bump), or an
    in-place write to a weight makes the next forward quantize again."""
    moe, _, x = _moe_on_contract(cache=True)
    optim = OPTIMIZERS[optimizer](moe.parameters())
    calls = _count_weight_work(monkeypatch)
    kernels = moe.experts.blockwise_kernels
    for micro_batch in range(2):
        moe(x).square().mean().backward()
    assert calls == {"quantize": 2, "transpose": 2}, "w13 and w2, once each for both micro-batches"
    first, second = kernels.weights_read[:4], kernels.weights_read[4:]  # fprop w13, fprop w2, dgrad w2, dgrad w13
    assert all(a is b for a, b in zip(first, second)) and len(second) == 4
    optim.step()
    optim.zero_grad()
    moe(x).square().mean().backward()
    assert calls == {"quantize": 4, "transpose": 4}
    assert kernels.weights_read[-4] is not first[0]
    with torch.no_grad():
        moe.experts.w13.mul_(1.01)
    moe(x).square().mean().backward()
    assert calls == {"quantize": 5, "transpose": 5}, "w13 alone was written"


def test_uncached_experts_quantize_at_every_forward(monkeypatch):
    moe, record, x = _moe_on_contract(cache=False)
    calls = _count_weight_work(monkeypatch)
    for micro_batch in range(2):
        moe(x).square().mean().backward()
    assert calls == {"quantize": 4, "transpose": 4}
    assert not moe.experts.caches_fp8_weights and "cache_fp8_weights" not in repr(moe.experts)
    assert not any(note.startswith("cache_fp8_weights") for note in record.notes)


@pytest.mark.parametrize("kernels", list(BLOCKWISE_KERNELS))
@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_cached_blocks_train_as_fresh_ones_bit_for_bit(kernels, fp8_dispatch):
    """Two steps of two micro-batches with fused AdamW: the cached run's losses, parameters and FP8 blocks equal the
    run quantizing at every forward bit for bit; a cache kept past the steps (taken for current after each step)
    trains on the first step's blocks, so the comparison can fail."""
    def train(variant: str):
        moe, _, x = _moe_on_contract(cache=variant != "uncached", kernels=kernels, fp8_dispatch=fp8_dispatch)
        optim = torch.optim.AdamW(moe.parameters(), lr=1e-2, fused=True)
        losses = []
        for step in range(2):
            for micro_batch in range(2):
                loss = moe(x[micro_batch:micro_batch + 1]).square().mean()
                loss.backward()
                losses.append(loss.item())
            optim.step()
            optim.zero_grad()
            if variant == "stale":
                for weight, blocks in ((moe.experts.w13, moe.experts.weight_blocks["w13"]),
                                       (moe.experts.w2, moe.experts.weight_blocks["w2"])):
                    blocks._made_at = (optimizer_steps(), weight._version)
        return losses, [p.detach().clone() for p in moe.parameters()], moe.experts

    cached, uncached, stale = train("cached"), train("uncached"), train("stale")
    assert cached[0] == uncached[0]
    assert all(torch.equal(a, b) for a, b in zip(cached[1], uncached[1]))
    assert stale[0][:2] == cached[0][:2] and stale[0][2:] != cached[0][2:]
    experts = cached[2]
    for gemm in ("w13", "w2"):  # the blocks of the weights as trained, made after the last step
        weight, cache = getattr(experts, gemm), experts.weight_blocks[gemm]
        blocks, fresh = cache.of(weight), fp8_quant.quantize_blocks_128x128(weight)
        assert cache.of(weight) is blocks
        assert torch.equal(blocks.data.view(torch.uint8), fresh.data.view(torch.uint8))
        assert torch.equal(blocks.scale, fresh.scale)


def test_the_cache_is_a_grouped_fp8_option_noted_and_dropped_before_fully_shard():
    """On by default (measured faster); noted in the conversion record and the module's repr, for blockwise
    weights only; before_fully_shard switches it off and lets go of the blocks, with a note; nothing to say where
    nothing caches."""
    assert GroupedFP8Backend().cache_fp8_weights
    moe, record, x = _moe_on_contract(cache=True)
    note = [n for n in record.notes if n.startswith("cache_fp8_weights")]
    assert note == ["cache_fp8_weights: 2 blockwise expert weight(s) quantized to FP8 blocks once per optimizer step "
                    "and reused, with their transpose, by the step's other micro-batches"]
    assert "cache_fp8_weights=True" in repr(moe.experts)
    moe(x).sum().backward()
    backend = GroupedFP8Backend(kernels="torch")
    assert backend.before_fully_shard(moe, torch.bfloat16) == [
        "cache_fp8_weights: off for 1 experts module(s) under fully_shard: the cache would keep a full-size FP8 copy "
        "of each sharded expert weight on every rank between steps"]
    assert not moe.experts.caches_fp8_weights
    assert all(blocks._blocks is None for blocks in moe.experts.weight_blocks.values())
    assert backend.before_fully_shard(moe, torch.bfloat16) == []
    model, plan = _tiny_moe_and_plan(recipe="rowwise", fp8_format="e4m3")
    _, record = GroupedFP8Backend(cache_fp8_weights=True).convert(model, plan.for_backend("grouped_fp8"), plan)
    assert not model.layers[1].moe.experts.caches_fp8_weights  # rowwise quantizes at every forward
    assert not any(n.startswith("cache_fp8_weights") for n in record.notes)


def test_the_cache_flows_from_the_command_line_with_several_micro_batches_only():
    """grouped_fp8.cache_fp8_weights (on by default, measured faster) reaches the backend on when a step has
    micro-batches to reuse the blocks, off with one (the cache would only hold memory) or with
    --no-grouped-fp8.cache-fp8-weights; the Megatron path, whose experts are TE's, refuses turning it off (a no-op
    there)."""
    from fp8stack.config import ConfigError, from_overrides
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    def cached(micro_batches: int, *flags: str) -> bool:
        cfg = _job("--fp8-recipe", "blockwise", "--expert-backend", "grouped_fp8", *flags)
        plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
        return _backend_options(cfg, plan, micro_batches)["grouped_fp8"]["cache_fp8_weights"]

    assert _job().grouped_fp8.cache_fp8_weights
    assert cached(2) and not cached(1)
    assert not cached(2, "--no-grouped-fp8.cache-fp8-weights")
    cfg = _job("--fp8-recipe", "blockwise", "--expert-backend", "te")
    plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
    assert "grouped_fp8" not in (_backend_options(cfg, plan, 2) or {})  # no grouped_fp8 experts: no options for it
    with pytest.raises(ConfigError, match=r"megatron does not take grouped_fp8.cache_fp8_weights false \("):
        from_overrides({"model.impl": "megatron", "precision.recipe": "blockwise",
                        "grouped_fp8.cache_fp8_weights": False})
    from_overrides({"model.impl": "megatron", "precision.recipe": "blockwise"})
