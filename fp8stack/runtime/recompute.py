"""Activation recompute: a module's forward runs again in backward instead of keeping its activations.

One entry point for every region (`checkpoint_module`): a TE LayerNormMLP recomputes itself (TE's
own selective recompute, which skips FC2), other regions are wrapped: TE's checkpoint when the region
runs TE FP8 modules, torch.utils.checkpoint otherwise. Which regions of a block are recomputed is chosen by name,
as Megatron's --recompute-modules, through RECOMPUTE_MODULES. `PrecisionProbe` checks the rule that
matters most: the recompute runs in the same FP8 recipe and context as the forward (Megatron-LM
PR 7538 recomputed outside fp8_autocast).
"""

import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, CheckpointWrapper,
                                                                         checkpoint_wrapper)
from torchao.float8.float8_linear import Float8Linear

__all__ = ["RECOMPUTE_MODULES", "CheckpointWrapper", "PrecisionProbe", "checkpoint_module", "has_te_modules",
           "is_te_module", "precision_context", "recompute_regions", "recomputes_itself"]

RECOMPUTE_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("attention.core",),
    "attn": ("attention",),
    "mlp": ("feed_forward",),
    "moe": ("moe",),
    "moe_act": ("moe.experts.act",),
    "shared_experts": ("moe.shared_experts",),
    "layernorm": ("attention_norm", "ffn_norm"),
    "block": ("",),
}
"""--recompute-modules name -> the submodules of an fp8stack.models.llama block it checkpoints
('' is the block itself). core_attn: SDPA only (its output is saved, its inputs q, k, v kept);
moe_act: the experts' SwiGLU between the two grouped GEMMs (fp8stack GroupedExperts, not TE's)."""


def is_te_module(module: nn.Module) -> bool:
    """Whether `module` is a TransformerEngine module or a subclass of one (judged by where each
    class in the MRO comes from, so TE is not imported)."""
    return any(cls.__module__.startswith("transformer_engine.") for cls in type(module).__mro__)


def has_te_modules(module: nn.Module) -> bool:
    """Whether `module` holds TransformerEngine modules, fp8stack's subclasses of them included."""
    return any(map(is_te_module, module.modules()))


def _is_te_layernorm_mlp(module: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformer_engine.") and cls.__name__ == "LayerNormMLP"
               for cls in type(module).__mro__)


def recomputes_itself(module: nn.Module) -> bool:
    """Whether `module` is a TE LayerNormMLP that checkpoint_module set to recompute in backward."""
    return _is_te_layernorm_mlp(module) and getattr(module, "checkpoint", False) is True


def checkpoint_module(module: nn.Module, *, fp8_active: bool) -> nn.Module:
    """`module`, set or wrapped so its forward is recomputed in backward.

    A TE LayerNormMLP is not wrapped: its `checkpoint` option is set (TE's selective recompute). It
    then saves only its input and recomputes norm, FC1 and SwiGLU in backward, but not FC2, whose
    output backward does not need (a wrapper would recompute that GEMM too), and it replays
    delayed-scaling scales itself.

    Other regions are wrapped. A region with TE layers running FP8 goes through TE's checkpoint: the
    recompute must run under the same FP8 autocast and scales as the forward and must not update amax
    histories twice, which TE's checkpoint arranges (it re-enters the autocast found at the forward and
    replays delayed-scaling scales; Megatron takes the same branch on --fp8). Everything else uses
    torch.utils.checkpoint, non-reentrant, which restores torch autocast and the RNG state (dropout
    masks repeat): BF16 TE layers recompute like any module, and torchao's dynamic scales are
    recomputed from the same inputs with the module's own config, so they come out identical.
    This is a correctness rule, not a knob.
    """
    if _is_te_layernorm_mlp(module):
        module.checkpoint = True
        return module
    if fp8_active and has_te_modules(module):
        from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint

        return checkpoint_wrapper(module, checkpoint_fn=te_checkpoint, use_reentrant=False)
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def recompute_regions(block: nn.Module, names: Iterable[str]) -> dict[str, list[str]]:
    """name -> the paths (relative to `block`) of RECOMPUTE_MODULES[name] that `block` has.
    Raises ValueError for a name not in the table."""
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute_modules: unknown name(s) {', '.join(map(repr, unknown))}: use "
                         f"{', '.join(RECOMPUTE_MODULES)}")
    present = {fqn for fqn, _ in block.named_modules()}
    return {n: [path for path in RECOMPUTE_MODULES[n] if path in present] for n in names}


def precision_context() -> dict[str, object]:
    """The precision the code running now is under: torch autocast per device type, and TE's global
    FP8 state (enabled, recipe) when TransformerEngine is already imported (it is never imported here)."""
    state: dict[str, object] = {}
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        state[f"autocast_{device}"] = str(torch.get_autocast_dtype(device)) if enabled else None
    if "transformer_engine.pytorch" in sys.modules:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        enabled = FP8GlobalStateManager.is_fp8_enabled()
        state["te_fp8"] = enabled
        state["te_recipe"] = repr(FP8GlobalStateManager.get_fp8_recipe()) if enabled else None
    return state


def _module_precision(module: nn.Module) -> dict[str, object]:
    """What an FP8 module ran with in its last forward (read in a forward post-hook)."""
    if isinstance(module, Float8Linear):
        return {"float8_config": repr(module.config)}
    fp8 = bool(getattr(module, "fp8", False))
    meta = getattr(module, "fp8_meta", {})
    return {"te_module_fp8": fp8, "te_module_recipe": repr(meta.get("recipe")) if fp8 else None}


class PrecisionProbe:
    """Records, at every forward of each FP8 module (torchao Float8Linear, TE modules) in `model`, the
    precision it ran with: the context entering it (precision_context) and what the module itself used
    (the Float8Linear config; the TE module's fp8 flag and recipe). Enter it (a context manager)
    before the forward and run backward inside `probe.recomputing()`; `mismatches()` then lists
    every module whose recompute ran differently from its forward. The hooks go on exit."""

    def __init__(self, model: nn.Module):
        self.phase = "forward"
        self.records: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        """phase -> fqn -> one record per call."""
        self._entering: dict[int, dict] = {}
        self._handles = []
        for fqn, module in model.named_modules():
            if isinstance(module, Float8Linear) or is_te_module(module):
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post(fqn)))

    def _pre(self, module: nn.Module, _args) -> None:
        self._entering[id(module)] = precision_context()

    def _post(self, fqn: str):
        def hook(module: nn.Module, _args, _out) -> None:
            self.records[self.phase][fqn].append({**self._entering.pop(id(module)), **_module_precision(module)})
        return hook

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Calls inside (the backward) are recorded as the recompute."""
        self.phase = "recompute"
        try:
            yield
        finally:
            self.phase = "forward"

    def mismatches(self) -> list[str]:
        """'fqn: forward {...} vs recompute {...}' for each recomputed call that differs from the
        forward call of the same module. Empty when nothing was recomputed: check records too."""
        found = []
        for fqn, recomputed in self.records["recompute"].items():
            forward = self.records["forward"].get(fqn, [])
            for i, again in enumerate(recomputed):
                first = forward[i] if i < len(forward) else None
                if again != first:
                    found.append(f"{fqn}: forward {first} vs recompute {again}")
        return found

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "PrecisionProbe":
        # torch's non-reentrant checkpoint stops a recompute, inside the last module's forward, once it
        # has every saved tensor back (decided at the forward): off, so every recompute is seen whole.
        self._no_early_stop = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        self._no_early_stop.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._no_early_stop.__exit__(*exc)
        self.remove()
