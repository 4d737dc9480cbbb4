"""torchao backend: the planned nn.Linear modules become torchao Float8Linear through
convert_to_float8_training, one call per recipe, and the result is checked to be exactly that."""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.config import ScalingGranularity, e4m3_dtype, e5m2_dtype
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                  PrepareFloat8ModuleInput)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from fp8stack.backends.base import Backend, ConversionRecord
from fp8stack.plan import Decision, Plan

TORCHAO_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
"""Plan recipe name -> torchao Float8LinearRecipeName value."""

GRAD_OUTPUT_DTYPES = {"e4m3": e4m3_dtype, "hybrid": e5m2_dtype}
"""Plan fp8_format -> dtype of grad_output casts (inputs and weights are always E4M3)."""


def float8_config(recipe: str, fp8_format: str, *, fsdp_float8_all_gather: bool = False) -> Float8LinearConfig:
    """torchao's config for `recipe`, with every grad_output cast in the dtype `fp8_format` asks for.

    torchao's own recipes differ here (tensorwise casts gradients to E5M2, the rowwise recipes to
    E4M3), so the plan's format is written into both grad_output cast configs and read back."""
    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"torchao has no {recipe!r} recipe (it runs {', '.join(TORCHAO_RECIPES)}): "
                         "plan these layers for another backend or recipe")
    if fp8_format not in GRAD_OUTPUT_DTYPES:
        raise ValueError(f"torchao cannot run FP8 format {fp8_format!r}: use {' or '.join(GRAD_OUTPUT_DTYPES)}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"FSDP float8 all-gather needs tensorwise weight scales, not {recipe}: "
                         "use recipe tensorwise or turn off fsdp_float8_all_gather")
    grad = GRAD_OUTPUT_DTYPES[fp8_format]
    base = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    # New CastConfigs, never edits: torchao shares its default CastConfig instances between configs.
    config = replace(
        base,
        cast_config_grad_output=replace(base.cast_config_grad_output, target_dtype=grad),
        cast_config_grad_output_for_grad_weight=replace(base.cast_config_grad_output_for_grad_weight,
                                                        target_dtype=grad),
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )
    casts = {"input": config.cast_config_input, "weight": config.cast_config_weight,
             "grad_output": config.cast_config_grad_output}
    wanted = {"input": e4m3_dtype, "weight": e4m3_dtype, "grad_output": grad}
    wrong = [f"{name} is {cast.target_dtype}" for name, cast in casts.items() if cast.target_dtype != wanted[name]]
    if wrong:
        raise ValueError(f"torchao recipe {recipe} cannot honour FP8 format {fp8_format} ({', '.join(wrong)}): "
                         "use the other --fp8-format")
    return config


@dataclass
class TorchaoBackend(Backend):
    """torchao Float8Linear for dense linears (tensorwise, rowwise, rowwise_gw_hp)."""

    enable_fsdp_float8_all_gather: bool = False
    """Keep weights as torchao's float8-castable subclass so FSDP2 all-gathers them in FP8 (tensorwise only)."""
    precompute_fp8_scales: bool = False
    """After each optimizer step, compute the scales of all weights all-gathered in FP8 in one all-reduce
    (after_optimizer_step), instead of one per weight in the next all-gathers."""
    name: ClassVar[str] = "torchao"
    """The plan's backend name."""

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        """FP8 GEMMs need SM89+ on CUDA; without a GPU torch's CPU scaled GEMMs run them (tests)."""
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            return False, (f"torchao Float8Linear needs an SM89+ GPU (Ada, Hopper or newer), this one is "
                           f"sm{major}{minor}: run on such a GPU or plan with --fp8-recipe bf16")
        return True, ""

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        """Swap exactly the planned nn.Linear modules for Float8Linear, weights kept (the same Parameter)."""
        before = dict(model.named_modules())
        by_recipe: dict[str, set[str]] = defaultdict(set)
        for d in decisions:
            module = before.get(d.fqn)
            if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
                found = "nothing" if module is None else type(module).__name__
                raise ValueError(f"torchao can only convert an nn.Linear, but the plan's {d.fqn!r} is {found} in "
                                 f"{type(model).__name__}: fix the model description so its fqns name the model's "
                                 "linears, or plan this component for another backend")
            by_recipe[d.recipe].add(d.fqn)

        for recipe, fqns in sorted(by_recipe.items()):
            config = float8_config(recipe, plan.fp8_format, fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather)
            # A root nn.Linear is swapped only in the returned module, hence the reassignment.
            model = convert_to_float8_training(model, config=config,
                                               module_filter_fn=lambda _module, fqn, fqns=fqns: fqn in fqns)

        planned = {d.fqn for d in decisions}
        _check_swapped_exactly(before, dict(model.named_modules()), planned)
        recipe = ", ".join(sorted(by_recipe))
        return model, ConversionRecord(self.name, {fqn: "Float8Linear" for fqn in sorted(planned)}, recipe)

    def after_optimizer_step(self, model: nn.Module):
        """With precompute_fp8_scales and tensorwise weights all-gathered in FP8 under FSDP: all their scales in one
        all-reduce per step (torchao's precompute_float8_dynamic_scale_for_fsdp); else None."""
        if not (self.precompute_fp8_scales and any(gathers_in_fp8(m) for m in model.modules())):
            return None
        return lambda: precompute_float8_dynamic_scale_for_fsdp(model)

    def tensor_parallel_style(self, module: nn.Module, kind: str, mesh: DeviceMesh, **layouts):
        """torchao's Float8 styles for tensorwise Float8Linear (their all-gathers move FP8); the module input of a
        region whose linears are all such layers is gathered in FP8 too. Rowwise layers move BF16 (torch's styles).
        Refused on a CPU mesh of several ranks: gloo cannot move float8 tensors."""
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if not (linears and all(map(is_tensorwise, linears))) or kind not in ("colwise", "rowwise", "prepare_input"):
            return None
        if mesh.device_type == "cpu" and mesh.size() > 1:
            raise NotImplementedError(
                "tensor parallelism would give torchao tensorwise Float8Linear layers torchao's Float8ColwiseParallel / "
                "Float8RowwiseParallel, which all-gather float8 tensors, and gloo (the CPU backend) cannot move float8 "
                "(RuntimeError: Invalid scalar type). Run tensorwise FP8 tensor parallelism on GPUs (NCCL), or on a "
                "CPU use --fp8-recipe rowwise or bf16 (those layers gather in high precision)")
        styles = {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel,
                  "prepare_input": PrepareFloat8ModuleInput}
        return styles[kind](**layouts)


def is_tensorwise(module: nn.Module) -> bool:
    """A torchao Float8Linear casting its input with per-tensor scales (what torchao's Float8 TP styles handle)."""
    return (isinstance(module, Float8Linear)
            and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)


def gathers_in_fp8(module: nn.Module) -> bool:
    """A torchao Float8Linear whose FSDP-sharded weight is all-gathered in FP8 (fsdp_float8_all_gather)."""
    return (isinstance(module, Float8Linear) and isinstance(module.weight, DTensor)
            and isinstance(module.weight.to_local(), WeightWithDynamicFloat8CastTensor))


def _check_swapped_exactly(before: dict[str, nn.Module], after: dict[str, nn.Module], planned: set[str]) -> None:
    """Every planned fqn is now a Float8Linear holding the old weight; every other module is untouched."""
    problems = []
    if before.keys() != after.keys():
        problems.append(f"module names changed: {sorted(before.keys() ^ after.keys())}")
    for fqn, old in before.items():
        new = after.get(fqn)
        if fqn in planned:
            if not isinstance(new, Float8Linear):
                problems.append(f"{fqn!r} is still {type(new).__name__}")
            elif new.bias is not old.bias or not torch.equal(new.weight, old.weight):
                problems.append(f"{fqn!r} lost its weight or bias in the swap")
        elif new is not old:
            problems.append(f"{fqn!r} was not planned for torchao but changed to {type(new).__name__}")
    if problems:
        raise RuntimeError("torchao conversion did not do what the plan says: " + "; ".join(problems) +
                           ". This is a bug in fp8stack or an incompatible torchao version: please report it")
