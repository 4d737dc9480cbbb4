"""TE's blockwise GEMMs on DeepGEMM without a GPU: the operand layouts handed over, the option's checks, and
te_gemms' per-block totals. The router itself runs in tests/gpu/test_te_deepgemm_gpu.py (TE needs CUDA)."""

import json
from types import SimpleNamespace

import pytest
import torch

from fp8stack.backends.te_deepgemm import operand
from fp8stack.bench import te_gemms
from fp8stack.evidence import write_evidence
from fp8stack.config import ConfigError, from_overrides


def test_te_scales_reach_deepgemm_in_its_layouts():
    # TE 2.20.2's storage as Float8BlockQuantizer writes it (its get_scale_shape): 1x128 scales [K/128, rows padded
    # to 4], 128x128 scales [rows/128, K/128 padded to 4], data as uint8. The layout arithmetic only; on a GPU the
    # router's test compares DeepGEMM's results with TE's own GEMMs on real TE tensors.
    rows_1d, k = 6, 256
    activation = SimpleNamespace(_is_2D_scaled=False, _rowwise_data=torch.arange(rows_1d * k).to(torch.uint8)
                                 .view(rows_1d, k), _rowwise_scale_inv=torch.rand(k // 128, 8))
    data, scale = operand(activation, rowwise=True)
    assert data.dtype == torch.float8_e4m3fn and data.view(torch.uint8).equal(activation._rowwise_data)
    # DeepGEMM's MN-major, TMA-aligned layout: [rows, K/128] with the rows contiguous, padded to 4 apart.
    assert scale.shape == (rows_1d, 2) and scale.stride() == (1, 8)
    assert scale.equal(activation._rowwise_scale_inv.t()[:rows_1d])

    weight_t = SimpleNamespace(_is_2D_scaled=True, _columnwise_data=torch.zeros(384, 256, dtype=torch.uint8),
                               _columnwise_scale_inv=torch.rand(3, 4))
    data, scale = operand(weight_t, rowwise=False)
    assert data.shape == (384, 256)
    assert scale.shape == (3, 2) and scale.is_contiguous() and scale.equal(weight_t._columnwise_scale_inv[:, :2])


def test_a_3d_activations_columnwise_data_keeps_k_as_its_rows():
    """A [batch, seq, K] activation's columnwise data is [K, batch, seq]: DeepGEMM's operand is [K, batch x seq]
    (flattened as rowwise data it came out [K x batch, seq], which the GPU test caught as a shape mismatch)."""
    k, batch, seq = 256, 2, 128
    columnwise = torch.arange(k * batch * seq).to(torch.uint8).view(k, batch, seq)
    x = SimpleNamespace(_is_2D_scaled=False, _columnwise_data=columnwise,
                        _columnwise_scale_inv=torch.rand(batch * seq // 128, k))
    data, scale = operand(x, rowwise=False)
    assert data.shape == (k, batch * seq) and data.view(torch.uint8).equal(columnwise.reshape(k, -1))
    assert scale.shape == (k, batch * seq // 128)
    assert operand(SimpleNamespace(_is_2D_scaled=False, _columnwise_data=None, _columnwise_scale_inv=None),
                   rowwise=False) is None


def test_blockwise_gemms_on_deepgemm_needs_the_blockwise_recipe():
    blockwise = from_overrides({"precision.recipe": "blockwise", "te.blockwise_gemms": "deepgemm"})
    assert blockwise.te.blockwise_gemms == "deepgemm"
    with pytest.raises(ConfigError, match="use --fp8-recipe blockwise or drop --te.blockwise-gemms"):
        from_overrides({"precision.recipe": "delayed", "te.blockwise_gemms": "deepgemm"})
    with pytest.raises(ConfigError, match="unknown te.blockwise_gemms 'cutlass': use te, deepgemm"):
        from_overrides({"precision.recipe": "blockwise", "te.blockwise_gemms": "cutlass"})
    # megatron's TE linears call the general_gemm the router replaces (megatron_model.build installs it)
    megatron = from_overrides({"precision.recipe": "blockwise", "te.blockwise_gemms": "deepgemm",
                               "model.impl": "megatron", "model.name": "llama-1b-like"})
    assert megatron.te.blockwise_gemms == "deepgemm"


def _shape(source, names, ms_by_variant):
    return {"source": source, "n": 128, "k": 128, "names": names,
            "gemms": {gemm: {variant: ({"median_ms": ms, "tflops": 1.0, "rel_error": 0.03} if ms is not None
                                       else {"error": "RuntimeError: no kernel"})
                             for variant, ms in ms_by_variant.items()} for gemm in te_gemms.GEMMS}}


def test_te_gemms_block_totals_weigh_each_linear_and_leave_out_the_head_and_failed_variants(tmp_path):
    payload = {"tokens": 8192, "iters": 30, "deepgemm": "installed", "shapes": [
        _shape("llama-1b-like", ["attention.wq", "attention.wo"], {"bf16": 1.0, "blockwise TE (cuBLAS)": 0.5,
                                                                   "blockwise DeepGEMM": None}),
        _shape("llama-1b-like", ["feed_forward.w13"], {"bf16": 2.0, "blockwise TE (cuBLAS)": 1.5,
                                                       "blockwise DeepGEMM": 1.0}),
        _shape(te_gemms.HEAD, ["output"], {"bf16": 100.0, "blockwise TE (cuBLAS)": 100.0, "blockwise DeepGEMM": 1.0})]}
    totals = te_gemms.block_totals(payload["shapes"])
    assert totals == {"bf16": {"fprop": 4.0, "dgrad": 4.0, "wgrad": 4.0, "total": 12.0},
                      "blockwise TE (cuBLAS)": {"fprop": 2.5, "dgrad": 2.5, "wgrad": 2.5, "total": 7.5}}
    # --render rewrites the table from the JSON and keeps the measuring run's header
    json_path, md_path = write_evidence("te-gemms-test", payload, "old table", tmp_path)
    header = md_path.read_text().split("old table")[0]
    assert te_gemms.main(["--render", str(json_path)]) == 0
    text = md_path.read_text()
    assert text.startswith(header) and "| blockwise TE (cuBLAS) | 2.5 | 2.5 | 2.5 | 7.5 | 1.6 |" in text
    assert json.loads(json_path.read_text())["shapes"] == payload["shapes"]
