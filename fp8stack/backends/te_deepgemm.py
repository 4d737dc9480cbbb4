"""TE's FP8 linears with GEMMs on DeepGEMM's dense kernels: every GEMM of the blockwise ones (`--blockwise-gemms
deepgemm`), and the forward GEMM of the per-tensor ones (`--fprop-gemms deepgemm`).

TE 2.20's modules quantize with TE's fused kernels and multiply through `general_gemm` (cuBLAS). DeepGEMM's Hopper
kernels take the same bytes and scales:
- blockwise (Float8BlockScaling): TE's GEMM-ready 1x128 scales, transposed, are DeepGEMM's MN-major TMA-aligned
  layout as they are, and its 128x128 scales sliced to their K blocks; the results are bit-identical and faster at
  llama-1b-like's shapes (profiles/te-gemms-h200.md);
- per-tensor (DelayedScaling, Float8CurrentScaling) with E4M3 operands, which a forward GEMM has in both of TE's
  formats: each tensor's one scale spread over DeepGEMM's 1x128 and 128x128 grids. DeepGEMM promotes every 128-deep
  partial product to FP32 (TE's split accumulator) where TE's forward GEMM accumulates fast: not bit-identical, at
  least as close to the FP32 product (GPU test). The backward GEMMs stay on cuBLAS: their E5M2 gradients under the
  hybrid format are no operand DeepGEMM's Hopper kernels take, and its wgrad kernel is slower than cuBLAS's.
`route_gemms` gives the `general_gemm` that TE's Linear, LayerNormLinear and LayerNormMLP call a front that sends the
GEMMs DeepGEMM takes to it (fprop and dgrad on its 1D2D kernel, BF16 out; blockwise wgrad on its 1D1D kernel,
accumulating into an FP32 buffer in place, as fused wgrad accumulation does) and every other call to TE unchanged.
Megatron's TE linears subclass those modules, so the Megatron path routes through the same front.
"""

import importlib
from dataclasses import dataclass, field
from types import ModuleType

import torch

from fp8stack.backends.base import BackendUnavailable

ROUTED_NOTE = ("blockwise_gemms=deepgemm: the blockwise TE modules' fprop and dgrad GEMMs, and their wgrad GEMMs where "
               "they accumulate into FP32 main_grad (gradient_accumulation_fusion), run on DeepGEMM's dense kernels, "
               "bit-identical to TE's cuBLAS ones (profiles/te-gemms-h200.md); quantization and every other GEMM "
               "stay TE's")
"""What the blockwise route changes, for the conversion record or the log of the path that installs it."""
FPROP_NOTE = ("fprop_gemms=deepgemm: the per-tensor (delayed, tensorwise) TE modules' forward GEMMs run on DeepGEMM's "
              "1D2D kernel, each operand's one scale spread over its scale grids (FP32 promotion every 128 deep, as "
              "TE's split accumulator; TE's forward GEMM accumulates fast); their backward GEMMs and quantization "
              "stay TE's")
"""What the per-tensor forward route changes."""
KINDS = ("blockwise", "per_tensor_fprop")
"""What the router can send to DeepGEMM: every blockwise GEMM; per-tensor E4M3 forward GEMMs."""

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


def per_tensor_fprop_operands(a_te, b_te, e4m3) -> tuple[tuple, tuple] | None:
    """DeepGEMM's (lhs, rhs) for TE's forward general_gemm(weight a_te, input b_te, 'TN') on per-tensor storages
    (Float8TensorStorage): rowwise data as it is, each tensor's one scale_inv spread over DeepGEMM's grids, the
    input's per 1x128 in its MN-major TMA-aligned layout ([rows, K/128], rows contiguous and padded to 4), the
    weight's per 128x128 ([rows/128, K/128]). None where either has no rowwise data or is not `e4m3` (TE's
    DType.kFloat8E4M3)."""
    pair = []
    for tensor, per_row in ((b_te, True), (a_te, False)):
        if tensor._data is None or tensor._fp8_dtype != e4m3:
            return None
        data = tensor._data.reshape(-1, tensor._data.shape[-1]).view(torch.float8_e4m3fn)
        rows, blocks = data.shape[0], -(-data.shape[1] // 128)
        if per_row:
            scale = tensor._scale_inv.expand(blocks, -(-rows // 4) * 4).contiguous()[:, :rows].t()
        else:
            scale = tensor._scale_inv.expand(-(-rows // 128), blocks).contiguous()
        pair.append((data, scale))
    return pair[0], pair[1]


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
    """TE's Float8BlockwiseQTensorStorage: the operands of the blockwise route."""
    per_tensor_storage: type
    """TE's Float8TensorStorage: the operands of the per-tensor forward route."""
    e4m3: object
    """TE's DType.kFloat8E4M3: the only FP8 type DeepGEMM's Hopper kernels take."""
    kinds: set[str] = field(default_factory=set)
    """Which of KINDS go to DeepGEMM."""
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
        """The GEMM's output computed on DeepGEMM, or None where it is not a GEMM of a route this router takes."""
        layout = kwargs.get("layout", "TN")
        if not all(_is_default(kwargs.get(key, default), default) for key, default in TAKEN.items()):
            return None
        if isinstance(a_te, self.blockwise_storage) and isinstance(b_te, self.blockwise_storage):
            pair = operands(a_te, b_te, layout) if "blockwise" in self.kinds else None
        elif isinstance(a_te, self.per_tensor_storage) and isinstance(b_te, self.per_tensor_storage):
            pair = (per_tensor_fprop_operands(a_te, b_te, self.e4m3)
                    if "per_tensor_fprop" in self.kinds and layout == LAYOUTS["fprop"] else None)
        else:
            return None
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


def load_library(option: str) -> ModuleType:
    """deep_gemm, or BackendUnavailable naming the `option` that asked for it and how to get it."""
    from fp8stack.backends import deepgemm

    library, why = deepgemm.load()
    if library is None:
        raise BackendUnavailable(f"{option}=deepgemm: {why} (launch/build_deepgemm.sh builds it)")
    return library


def route_gemms(library: ModuleType, kind: str) -> Router:
    """Install (once per process) the router in TE's Linear, LayerNormLinear and LayerNormMLP and send it `kind`'s
    GEMMs (one of KINDS; a later call adds its kind); returns it."""
    if kind not in KINDS:
        raise ValueError(f"route_gemms: unknown kind {kind!r}: use one of {', '.join(KINDS)}")
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage)
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
    import transformer_engine_torch as tex  # TE's extension, loaded by the imports above

    callers = [importlib.import_module(name) for name in TE_CALLERS]
    router = callers[0].general_gemm
    if not isinstance(router, Router):
        router = Router(library, router, Float8BlockwiseQTensorStorage, Float8TensorStorage, tex.DType.kFloat8E4M3)
        for module in callers:
            module.general_gemm = router
    router.kinds.add(kind)
    return router


def unroute() -> None:
    """Give TE's modules their own general_gemm back (tests compare the two)."""
    for module in (importlib.import_module(name) for name in TE_CALLERS):
        if isinstance(module.general_gemm, Router):
            module.general_gemm = module.general_gemm.te_general_gemm
