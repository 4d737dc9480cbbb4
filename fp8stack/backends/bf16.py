"""bf16 backend: the components the plan keeps in high precision stay as they are. It still checks
that each planned fqn is in the model, so a plan written for another model cannot pass unnoticed."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn
from torchao.float8.float8_linear import Float8Linear

from fp8stack.backends.base import Backend, ConversionRecord
from fp8stack.models.moe import GroupedExperts
from fp8stack.plan import Decision, Plan
from fp8stack.plan.recipes import BF16


@dataclass
class BF16Backend(Backend):
    """Leaves modules unchanged; records what runs each planned component."""

    name: ClassVar[str] = BF16
    """The plan's backend name."""

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        """Runs anywhere."""
        return True, ""

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        """Check every planned fqn exists and is not FP8 already; change nothing."""
        modules = dict(model.named_modules())
        runs = {d.fqn: _runner(model, modules, d) for d in decisions}
        return model, ConversionRecord(self.name, runs, BF16)

    def hand_over_main_grads(self, model: nn.Module) -> None:
        """Master weights give every weight an FP32 main_grad: grouped experts' BF16 weight-gradient GEMMs add into
        it inside their backward from now on (GroupedExperts.wgrad_into_main_grad), as Megatron's TEGroupedMLP and
        grouped_fp8's blockwise GEMMs do, so that a BF16 baseline pays no hook per expert weight and micro-batch."""
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module.wgrad_into_main_grad = True


def _runner(model: nn.Module, modules: dict[str, nn.Module], d: Decision) -> str:
    """Class name of what computes `d`'s component: its module, the module owning its parameter
    (grouped expert weights), or for an attention core the attention module around it."""
    owner, _, leaf = d.fqn.rpartition(".")
    if d.fqn in modules:
        module = modules[d.fqn]
        if isinstance(module, Float8Linear):
            raise ValueError(f"the plan keeps {d.fqn!r} in BF16 ({d.reason}) but the model already runs it as "
                             "torchao Float8Linear: build the model fresh, or change the plan")
        return type(module).__name__
    if owner in modules and d.component.kind == "attn_core":
        return type(modules[owner]).__name__
    if owner in modules and isinstance(getattr(modules[owner], leaf, None), nn.Parameter):
        return f"{type(modules[owner]).__name__}.{leaf}"
    raise ValueError(f"the plan names {d.fqn!r} but {type(model).__name__} has no such module or parameter: "
                     "make the model description's names match the model")
