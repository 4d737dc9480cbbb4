"""FP8 compression of saved activations, for regions TE's checkpoint does not cover.

`compress_saved_activations()` is a torch.autograd.graph.saved_tensors_hooks context: every tensor
autograd saves for backward inside it is stored as FP8 E4M3 with an FP32 scale (per tensor or per
row) when it is a BF16/FP16 activation worth compressing, and restored to its dtype in backward.
Weights, tensors already in FP8, FP32, small and non-floating tensors are kept as they are (TE 2.20's
linears save their FP8 inputs as raw uint8 data with an FP32 scale: kept as 'not floating').
FP32 is kept because in a BF16 run the FP32 tensors autograd saves are the ones the precision plan keeps
in FP32 on purpose: log-softmax outputs of the loss, attention log-sum-exps, norm statistics. Their
rounding errors come back exponentiated; compressing them made a 1B model's FP8 arms diverge to NaN.
The backward then sees activations rounded to E4M3 (3 mantissa bits): gradients move by about the
error of an FP8 GEMM input, which FP8 training already accepts.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

__all__ = ["ActivationCompressor", "compress_saved_activations", "is_quantized_tensor"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
COMPRESSIBLE = (torch.bfloat16, torch.float16)
"""Dtypes stored as FP8 (2 bytes -> 1); see the module docstring for why FP32 is not."""

_QUANTIZED_CLASSES = ("QuantizedTensor", "Float8Tensor", "Float8TensorStorage", "QuantizedTensorStorage",
                      "Float8TrainingTensor", "MXFP8Tensor", "Float8BlockwiseQTensor")
"""Class names (anywhere in the MRO) of the FP8 tensor types of TE and torchao."""


def is_quantized_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is FP8 already: an FP8 dtype, or a TE / torchao quantized tensor class (judged
    by class names in the MRO, so neither library is imported)."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        return True
    return any(cls.__name__ in _QUANTIZED_CLASSES for cls in type(tensor).__mro__)


@dataclass(frozen=True)
class _Packed:
    """A saved tensor as FP8 data and its FP32 scale."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    stride: tuple[int, ...]
    """The saved tensor's strides: a compiled backward checks them (a view of a fused projection's output keeps
    the strides of the whole)."""


@dataclass
class ActivationCompressor:
    """The hooks and their counters. Enter it (or compress_saved_activations()) around the forward."""

    min_numel: int = 4096
    """Tensors with fewer elements are kept as they are (the scale and the kernels cost more than they save)."""
    granularity: Literal["tensor", "row"] = "tensor"
    """One scale per tensor, or one per row (last dimension): rows of very different size lose less."""
    weights: frozenset[int] = frozenset()
    """Storage addresses of weights that are never compressed (besides anything that is an nn.Parameter)."""
    bytes_seen: int = 0
    """Bytes of every tensor saved for backward inside the context."""
    bytes_before: int = 0
    """Bytes of the tensors that were compressed, before."""
    bytes_after: int = 0
    """The same tensors' bytes as FP8 data plus scales."""
    compressed: int = 0
    """Tensors stored as FP8."""
    skipped: Counter = field(default_factory=Counter)
    """Reason -> tensors kept as they are."""

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def _skip_reason(self, tensor: torch.Tensor) -> str | None:
        if _is_weight(tensor) or (tensor._base is not None and _is_weight(tensor._base)):
            return "weight"
        if is_quantized_tensor(tensor):
            return "already fp8"
        if tensor.dtype not in COMPRESSIBLE:
            floating = f"dtype {str(tensor.dtype).removeprefix('torch.')}"
            return floating if tensor.is_floating_point() else "not floating"
        if tensor.layout is not torch.strided or type(tensor) is not torch.Tensor:
            return "tensor subclass"
        if tensor.numel() < self.min_numel:
            return "small"
        if tensor.untyped_storage().data_ptr() in self.weights:
            return "weight"
        return None

    def pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        self.bytes_seen += size
        reason = self._skip_reason(tensor)
        if reason:
            self.skipped[reason] += 1
            return tensor
        with torch.no_grad():
            wide = tensor.detach().float()
            rowwise = self.granularity == "row" and wide.dim() > 0
            amax = wide.abs().amax(dim=-1, keepdim=True) if rowwise else wide.abs().amax()
            # An all-zero tensor (or row) keeps scale 1; the clamp is branchless (no host sync).
            scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
            data = (wide / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        self.compressed += 1
        self.bytes_before += size
        self.bytes_after += data.numel() + scale.numel() * scale.element_size()
        return _Packed(data, scale, tensor.dtype, tensor.stride())

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _Packed):
            return packed
        values = (packed.data.float() * packed.scale).to(packed.dtype)
        if values.stride() == packed.stride:
            return values
        return torch.empty_strided(values.shape, packed.stride, dtype=values.dtype, device=values.device).copy_(values)

    def __enter__(self) -> "ActivationCompressor":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, a leaf that trains, or autocast's cast copy of one (a ToCopy of a leaf)."""
    if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    fn = tensor.grad_fn
    return (fn is not None and type(fn).__name__ == "ToCopyBackward0"
            and any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None))


def compress_saved_activations(module: nn.Module | None = None, *, min_numel: int = 4096,
                               granularity: Literal["tensor", "row"] = "tensor") -> ActivationCompressor:
    """A context storing the activations saved for backward in FP8 E4M3 (see ActivationCompressor).
    `module`: its parameters' storages are never compressed, even when seen through a view or cast
    in place; Parameters and their views are recognised without it."""
    params = module.parameters() if module is not None else ()
    weights = frozenset(p.untyped_storage().data_ptr() for p in params)
    return ActivationCompressor(min_numel=min_numel, granularity=granularity, weights=weights)
