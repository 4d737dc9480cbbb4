"""Backends, one module each, behind one protocol (base.Backend). Optional libraries (TE, DeepGEMM)
are imported inside their module only, so importing fp8stack never needs them."""

from importlib import import_module

from fp8stack.backends.base import Backend, BackendUnavailable, ConversionRecord

_REGISTRY = {
    "te": "fp8stack.backends.te:TEBackend",
    "torchao": "fp8stack.backends.torchao:TorchaoBackend",
    "grouped_fp8": "fp8stack.backends.grouped:GroupedFP8Backend",
    "bf16": "fp8stack.backends.bf16:BF16Backend",
}
"""Plan backend name -> 'module:class'."""


def get_backend(name: str, **options) -> Backend:
    """Instantiate the backend the plan calls `name`."""
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(_REGISTRY)}") from None
    return getattr(import_module(module), cls)(**options)


__all__ = ["Backend", "BackendUnavailable", "ConversionRecord", "get_backend"]
