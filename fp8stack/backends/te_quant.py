"""TE's Float8BlockQuantizer as the 1x128 quantizer of grouped_fp8's blockwise experts on DeepGEMM
(GroupedFP8Backend quantizer="te"): the activations and output gradients, rows and columns, from one CUDA kernel.

inductor's compiled quantizers (fp8_quant.py) quantized a 32768x7168 BF16 operand both ways at ~300 GB/s on an H200
(profiles/runs/2026-11-26-experts-breakdown-deepgemm-regression-h200/); TE ships a kernel for exactly this operand.
With block_scaling_dim=1 and both usages it writes, for a buffer x [R, K] (TE 2.20's get_scale_shape):
- rowwise data [R, K], scales [K/128, R padded to 4] (GEMM-ready: row r's tile k at [k, r]);
- columnwise data x^T [K, R], scales [R/128, K padded to 4] (column k's tile t at [t, k]).
Transposed, the first is DeepGEMM's MN-major, TMA-aligned [R, K/128] as it is, the second its [K, R/128]
(te_deepgemm.operand, the conversion TE's blockwise linears on DeepGEMM use): no copy. The columnwise 1x128 tiles
run along the rows and never cross an expert group: the buffer's row count is a multiple of 128 and every group
starts on one (TokenGroups.buffer).
"""

import functools
from collections.abc import Callable

import torch

from fp8stack.backends.base import BackendUnavailable
from fp8stack.backends.blockwise import Fp8Tensor
from fp8stack.backends.te import INSTALL_HINT
from fp8stack.backends.te_deepgemm import operand


def load() -> tuple[Callable | None, str]:
    """(a factory of TE's 1x128 E4M3 block quantizers taking rowwise= and columnwise=, '') or (None, why not)."""
    try:
        # transformer_engine.pytorch loads the extension that transformer_engine_torch names
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        import transformer_engine_torch as tex
    except Exception as err:  # ImportError, or an OSError from its native libraries
        return None, (f"TransformerEngine is not importable ({type(err).__name__}: {err}): {INSTALL_HINT}, or use "
                      "grouped_fp8 quantizer inductor")
    # Exact scales (448 / amax, stored as FP32 1 / scale), not TE's Float8BlockScaling default of powers of 2:
    # blockwise.quantize_1x128, which the inductor quantizers compile, follows this kernel's arithmetic, so the
    # operands are the same bytes and swapping quantizers changes the speed, not the numerics. Hopper's kernel takes
    # either.
    return functools.partial(Float8BlockQuantizer, tex.DType.kFloat8E4M3, block_scaling_dim=1, amax_epsilon=0.0,
                             force_pow_2_scales=False), ""


def deepgemm_operands(stored) -> tuple[Fp8Tensor | None, Fp8Tensor | None]:
    """(rows, columns) of TE's 1x128 storage as DeepGEMM's operands, None where TE wrote no such usage: rows
    [R, K] with scales [R, K/128], columns x^T [K, R] with scales [K, R/128], both views of TE's buffers."""
    return tuple(None if pair is None else Fp8Tensor(*pair) for pair in (operand(stored, rowwise=True),
                                                                          operand(stored, rowwise=False)))


class TEBlockQuantizer:
    """grouped_fp8's 1x128 operands from TE's quantization kernel; the methods of grouped.InductorQuantizer. Each
    reads the GEMMs' buffer of x (groups.buffer: x itself when its groups are aligned and its rows whole tiles)."""

    name = "te"

    def __init__(self, make: Callable | None = None):
        """make: load()'s factory of TE quantizers (loaded here when None)."""
        if make is None:
            make, why = load()
            if make is None:
                raise BackendUnavailable(why)
        self._rows, self._cols, self._both = (make(rowwise=rows, columnwise=cols)
                                              for rows, cols in ((True, False), (False, True), (True, True)))
        for quantizer in (self._rows, self._cols, self._both):
            quantizer.internal = True  # TE's plain storage, not a tensor subclass: the GEMMs read its buffers

    def __deepcopy__(self, memo) -> "TEBlockQuantizer":
        return self  # no state beyond its settings: a copied model shares it

    def quantize_rows_1x128(self, groups, x: torch.Tensor) -> Fp8Tensor:
        return deepgemm_operands(self._rows.quantize(groups.buffer(x)))[0]

    def quantize_cols_1x128(self, groups, x: torch.Tensor) -> Fp8Tensor:
        return deepgemm_operands(self._cols.quantize(groups.buffer(x)))[1]

    def quantize_both_1x128(self, groups, x: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        return deepgemm_operands(self._both.quantize(groups.buffer(x)))
