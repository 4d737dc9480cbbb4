"""The backend protocol: every FP8 (or BF16) implementation offers the same three things."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from fp8stack.plan import Decision, Plan


def swap_module(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Put `new` at `fqn`; returns the model (`new` itself when fqn is the root)."""
    if not fqn:
        return new
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
    return model


class BackendUnavailable(RuntimeError):
    """A plan assigns modules to a backend this machine cannot run; the message says why and what to do."""


@dataclass
class ConversionRecord:
    """What one backend did to a model: kept on the model by the assembly's stamp."""

    backend: str
    """Backend name."""
    converted: dict[str, str] = field(default_factory=dict)
    """fqn -> class name of the module that now runs it."""
    recipe: str = ""
    """Recipe the converted modules run with."""
    notes: list[str] = field(default_factory=list)
    """What a user should know about how the plan was honoured (kernels chosen, formats a kernel imposes)."""


class Backend(Protocol):
    """One FP8 implementation (te, torchao, grouped_fp8) or bf16."""

    name: str
    """The plan's backend name."""

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        """(True, '') when it can run here, the plan's `recipes` for it included, else (False, why and how to fix)."""
        ...

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        """Swap exactly the modules named by `decisions` (copying weights bit-exactly); return the model
        (a new object only when the root itself was swapped) and what was done. Raises if any decision
        cannot be honoured: a backend never picks something else quietly."""
        ...
