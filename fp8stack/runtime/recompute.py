"""Activation recompute: a module's forward runs again in backward instead of keeping its activations.

`checkpoint_module` wraps any module, so the assembly can checkpoint whole blocks today and chosen
submodules (attention, MLP, ... as Megatron's --recompute-modules) later with the same function.
"""

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, CheckpointWrapper,
                                                                         checkpoint_wrapper)

__all__ = ["CheckpointWrapper", "checkpoint_module", "has_te_modules"]


def has_te_modules(module: nn.Module) -> bool:
    """Whether `module` holds TransformerEngine modules, fp8stack's subclasses of them included
    (judged by where each class in the MRO comes from, so TE is not imported)."""
    return any(cls.__module__.startswith("transformer_engine.")
               for m in module.modules() for cls in type(m).__mro__)


def checkpoint_module(module: nn.Module, *, fp8_active: bool) -> CheckpointWrapper:
    """`module` wrapped so its forward is recomputed in backward.

    A module with TE layers running FP8 goes through TE's checkpoint: the recompute must run under
    the same FP8 autocast and scales as the forward and must not update amax histories twice, which
    TE's checkpoint arranges (Megatron takes the same branch on --fp8). Everything else uses
    torch.utils.checkpoint, non-reentrant: BF16 TE layers recompute like any module, and torchao's
    dynamic scales are recomputed from the same inputs, so they come out identical.
    """
    if fp8_active and has_te_modules(module):
        from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint

        return checkpoint_wrapper(module, checkpoint_fn=te_checkpoint, use_reentrant=False)
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
