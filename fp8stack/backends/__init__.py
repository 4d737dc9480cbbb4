"""Backends, one module each, behind one protocol (base.Backend). Optional libraries (TE, DeepGEMM)
are imported inside their module only, so importing fp8stack never needs them."""

from importlib import import_module

from fp8stack.backends.base import Backend, BackendUnavailable, ConversionRecord, check_plan_fits
from fp8stack.backends.fused import unfused_state_dict

_REGISTRY = {
    "te": "fp8stack.backends.te:TEBackend",
    "torchao": "fp8stack.backends.torchao:TorchaoBackend",
    "grouped_fp8": "fp8stack.backends.grouped:GroupedFP8Backend",
    "bf16": "fp8stack.backends.bf16:BF16Backend",
}
"""Plan backend name -> 'module:class'."""


def backend_class(name: str) -> type[Backend]:
    """The class of the backend the plan calls `name`."""
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(_REGISTRY)}") from None
    return getattr(import_module(module), cls)


def get_backend(name: str, **options) -> Backend:
    """Instantiate the backend the plan calls `name`."""
    return backend_class(name)(**options)


def available_backends() -> list[type[Backend]]:
    """Every backend class, in registry order."""
    return [backend_class(name) for name in _REGISTRY]


__all__ = ["Backend", "BackendUnavailable", "ConversionRecord", "available_backends", "backend_class",
           "check_plan_fits", "get_backend", "unfused_state_dict"]
