"""TE's blockwise FP8 linears with their GEMMs on DeepGEMM's dense kernels (`--blockwise-gemms deepgemm`).

TE 2.20's Float8BlockScaling modules quantize with TE's fused kernels and multiply through `general_gemm` (cuBLAS).
DeepGEMM's Hopper kernels take the same bytes and scales: TE's GEMM-ready 1x128 scales, transposed, are DeepGEMM's
MN-major TMA-aligned layout as they are, and its 128x128 scales sliced to their K blocks; the results are
bit-identical and faster at llama-1b-like's shapes (profiles/runs/2026-11-23-te-gemms-h200/).
`route_blockwise_gemms` gives the `general_gemm` that TE's Linear, LayerNormLinear and LayerNormMLP call a front
that sends the blockwise GEMMs DeepGEMM takes to it (fprop and dgrad on its 1D2D kernel, BF16 out; wgrad on its 1D1D
kernel, accumulating into an FP32 buffer in place, as fused wgrad accumulation does) and every other call to TE
unchanged. Megatron's TE linears subclass those modules, so the Megatron path routes through the same front.
"""

import importlib
from dataclasses import dataclass, field
from types import ModuleType

import torch

from fp8stack.backends.base import BackendUnavailable

ROUTED_NOTE = ("blockwise_gemms=deepgemm: the blockwise TE modules' fprop and dgrad GEMMs, and their wgrad GEMMs where "
               "they accumulate into FP32 main_grad (gradient_accumulation_fusion), run on DeepGEMM's dense kernels, "
               "bit-identical to TE's cuBLAS ones; quantization and every other GEMM "
               "stay TE's")
"""What the router changes, for the conversion record or the log of the path that installs it."""

LAYOUTS = {"fprop": "TN", "dgrad": "NN", "wgrad": "NT"}
"""TE general_gemm's layout per GEMM: D = op(B) @ op(A)^T with A the weight (fprop, dgrad) or the input (wgrad)."""

TE_CALLERS = ("transformer_engine.pytorch.module.linear", "transformer_engine.pytorch.module.layernorm_linear",
              "transformer_engine.pytorch.module.layernorm_mlp")
"""TE modules whose `general_gemm` (imported into their namespace) the router replaces."""

TAKEN = {"quantization_params": None, "gelu": False, "gelu_in": None, "alpha": 1.0, "beta": None, "bias": None,
         "ub": None, "ub_type": None, "extra_output": None, "bulk_overlap": False}
"""general_gemm keywords DeepGEMM's path takes only at these (default) values: no fused output quantization,
GELU, bias, scaling or userbuffers overlap."""


def operand(tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """TE Float8BlockwiseQTensor storage -> DeepGEMM's (E4M3 [rows, K], FP32 scales), or None without that usage.
    TE keeps 1x128 scales as [K/128, rows padded to 4] and 128x128 scales as [rows/128, K/128 padded to 4]: the
    first transposed is DeepGEMM's MN-major TMA-aligned layout as is, the second is sliced to its K blocks."""
    data = tensor._rowwise_data if rowwise else tensor._columnwise_data
    scale = tensor._rowwise_scale_inv if rowwise else tensor._columnwise_scale_inv
    if data is None or scale is None:
        return None
    # Rowwise data is [*tokens, K]; columnwise data is its transpose [K, *tokens] (a 3-D activation's too).
    data = (data.reshape(-1, data.shape[-1]) if rowwise else data.reshape(data.shape[0], -1)).view(torch.float8_e4m3fn)
    rows, k = data.shape
    scale = scale[:, : -(-k // 128)].contiguous() if tensor._is_2D_scaled else scale.t()[:rows]
    return data, scale


def operands(a_te, b_te, layout: str) -> tuple[tuple, tuple] | None:
    """DeepGEMM's (lhs, rhs) for TE's general_gemm(a_te, b_te, layout): lhs from B, rhs from A."""
    lhs, rhs = operand(b_te, rowwise=layout[1] == "N"), operand(a_te, rowwise=layout[0] == "T")
    return None if lhs is None or rhs is None else (lhs, rhs)


def gemm(library: ModuleType, pair: tuple[tuple, tuple], layout: str, out: torch.Tensor) -> torch.Tensor:
    """The GEMM TE's general_gemm computes with `layout`, on DeepGEMM's operands(...) `pair`, into `out` (wgrad:
    accumulated)."""
    lhs, rhs = pair
    if layout == LAYOUTS["wgrad"]:
        library.fp8_gemm_nt(lhs, rhs, out, c=out, recipe=(1, 1, 128))  # c is d: accumulates in place, no copy
    else:
        library.fp8_gemm_nt(lhs, rhs, out, disable_ue8m0_cast=True)
    return out


@dataclass
class Router:
    """The installed front of TE's general_gemm, with how many calls went where."""

    library: ModuleType
    te_general_gemm: object
    blockwise_storage: type
    """TE's Float8BlockwiseQTensorStorage: the operands DeepGEMM's path takes."""
    calls: dict[str, int] = field(default_factory=lambda: {"deepgemm": 0, "te": 0})
    """GEMM calls sent to each library since the router was installed."""

    def __call__(self, A, B, *args, **kwargs):
        out = self._on_deepgemm(A, B, kwargs) if not args else None
        if out is None:
            self.calls["te"] += 1
            return self.te_general_gemm(A, B, *args, **kwargs)
        self.calls["deepgemm"] += 1
        return out, None, None, None  # TE's (output, bias gradient, GELU input, extra output)

    def _on_deepgemm(self, a_te, b_te, kwargs: dict) -> torch.Tensor | None:
        """The GEMM's output computed on DeepGEMM, or None where it is not a blockwise GEMM DeepGEMM takes."""
        layout = kwargs.get("layout", "TN")
        if not (isinstance(a_te, self.blockwise_storage) and isinstance(b_te, self.blockwise_storage)
                and all(_is_default(kwargs.get(key, default), default) for key, default in TAKEN.items())):
            return None
        pair = operands(a_te, b_te, layout)
        if pair is None or any(dim % 128 for t in pair for dim in t[0].shape):
            return None
        (lhs, _), (rhs, _) = pair
        shape, out, accumulate = (lhs.shape[0], rhs.shape[0]), kwargs.get("out"), kwargs.get("accumulate", False)
        out_dtype = kwargs.get("out_dtype") or (out.dtype if out is not None else None)
        wanted = torch.float32 if layout == LAYOUTS["wgrad"] else torch.bfloat16
        if out_dtype != wanted or (out is not None and (out.dtype != wanted or tuple(out.shape) != shape
                                                        or not out.is_contiguous())):
            return None
        if layout != LAYOUTS["wgrad"]:
            if accumulate:
                return None
            out = out if out is not None else torch.empty(shape, dtype=wanted, device=lhs.device)
        elif out is None or not accumulate:
            out = torch.zeros(shape, dtype=wanted, device=lhs.device) if out is None else out.zero_()
        return gemm(self.library, pair, layout, out)


def _is_default(value, default) -> bool:
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def load_library() -> ModuleType:
    """deep_gemm, or BackendUnavailable naming how to get it."""
    from fp8stack.backends import deepgemm

    library, why = deepgemm.load()
    if library is None:
        raise BackendUnavailable(f"blockwise_gemms=deepgemm: {why} (launch/build_deepgemm.sh builds it)")
    return library


def route_blockwise_gemms(library: ModuleType) -> Router:
    """Install (once per process) the router in TE's Linear, LayerNormLinear and LayerNormMLP; returns it."""
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage)

    callers = [importlib.import_module(name) for name in TE_CALLERS]
    current = callers[0].general_gemm
    if isinstance(current, Router):
        return current
    router = Router(library, current, Float8BlockwiseQTensorStorage)
    for module in callers:
        module.general_gemm = router
    return router


def unroute() -> None:
    """Give TE's modules their own general_gemm back (tests compare the two)."""
    for module in (importlib.import_module(name) for name in TE_CALLERS):
        if isinstance(module.general_gemm, Router):
            module.general_gemm = module.general_gemm.te_general_gemm
