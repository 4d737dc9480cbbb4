"""Which kernel runs scaled_dot_product_attention on a GPU, for a whole training process.

Attention stays BF16 in every plan, so its time is the same in the BF16 and FP8 arms: the faster it
is, the larger the share of the step that FP8 GEMMs can speed up. On Hopper, torch's default choice
is FlashAttention-2; cuDNN's fused attention is a Hopper-specific kernel (wgmma, TMA). The choice
is process-wide (torch.backends.cuda flags) so that a checkpoint's recompute in the backward runs
the same kernel as the forward did.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["SDPA_BACKENDS", "check_sdpa_backend", "sdpa_backend", "set_sdpa_backend"]

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient")
"""auto leaves torch's own priority; the others run that kernel only (no silent fallback: an input it
cannot take raises 'No available kernel')."""

_FLAGS = {"cudnn": "cudnn_sdp", "flash": "flash_sdp", "efficient": "mem_efficient_sdp", "math": "math_sdp"}
"""Backend name -> the suffix of its torch.backends.cuda enable_* / *_enabled functions."""


def check_sdpa_backend(name: str, device: torch.device) -> None:
    """Raise ValueError, naming the fix, unless sdpa_backend(name, device) can run. A named kernel needs
    `device` to be CUDA: the flags are global and CPU attention reads some of them too (it would find no
    kernel)."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r}: use one of {', '.join(SDPA_BACKENDS)}")
    if name != "auto" and device.type != "cuda":
        raise ValueError(f"SDPA backend {name!r} is a CUDA kernel, but this run is on {device.type}: "
                         "use sdpa_backend 'auto' off the GPU")


@contextmanager
def sdpa_backend(name: str, device: torch.device) -> Iterator[None]:
    """Inside, SDPA runs only the `name` kernel ('auto': torch's choice, nothing changed); the previous
    flags are restored on exit. check_sdpa_backend says which names a device can take."""
    previous = set_sdpa_backend(name, device)
    try:
        yield
    finally:
        _set_flags(previous)


def set_sdpa_backend(name: str, device: torch.device) -> dict[str, bool]:
    """From now on SDPA runs only the `name` kernel in this process ('auto': torch's choice, nothing changed);
    returns the flags it replaced. check_sdpa_backend says which names a device can take."""
    check_sdpa_backend(name, device)
    cuda = torch.backends.cuda
    previous = {flag: getattr(cuda, f"{flag}_enabled")() for flag in _FLAGS.values()}
    if name != "auto":
        _set_flags({flag: backend == name for backend, flag in _FLAGS.items()})
    return previous


def _set_flags(enabled: dict[str, bool]) -> None:
    for flag, on in enabled.items():
        getattr(torch.backends.cuda, f"enable_{flag}")(on)
