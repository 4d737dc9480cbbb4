"""apply_plan_to_megatron(model, plan): the plan's precision on a megatron-core GPTModel already built.

The same classes block_spec would have built (with_precision of each layer and of each GEMM whose
decision differs from its layer) are put on the existing modules by changing their class, which
keeps every parameter, buffer and hook where it is. Like fp8stack.assembly's convert_fp8 stage it
must run on the bare model: before DDP / FSDP wrapping and before parameters become DTensors.
"""

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fp8stack.assembly import OrderingError
from fp8stack.megatron.block_spec import check_config, layer_precisions
from fp8stack.megatron.precision import PlanPrecision, with_precision
from fp8stack.plan import Plan, PlanError

TE_MODULE_PREFIX = "megatron.core.extensions.transformer_engine"
"""Where megatron's TE module classes live (TELayerNormColumnParallelLinear, TEGroupedLinear, ...)."""


def apply_plan_to_megatron(model: nn.Module, plan: Plan) -> nn.Module:
    """Give each decoder layer of `model` (a GPTModel, or the Float16Module around one) the plan's FP8
    context; returns `model`. Everything is checked before the first class changes."""
    _check_order(model)
    gpt = _unwrap(model)
    decoder = getattr(gpt, "decoder", None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise PlanError(f"{type(gpt).__name__} has no decoder.layers: apply_plan_to_megatron takes a megatron-core "
                        "GPTModel (or the Float16Module wrapping one)")
    precisions = layer_precisions(gpt.config, plan)
    te = any(type(m).__module__.startswith(TE_MODULE_PREFIX) for m in decoder.modules())
    check_config(gpt.config, plan, precisions, te, "the model was built with megatron's local (non-TE) modules")
    swaps = []  # (module, new class)
    for layer in decoder.layers:
        p = precisions[layer.layer_number - 1]
        for name, recipe in p.exceptions:
            swaps += [(m, with_precision(type(m), recipe, plan.fp8_format)) for m in _modules_named(layer, name)]
        swaps.append((layer, with_precision(type(layer), p.recipe, plan.fp8_format)))
    for module, cls in swaps:
        module.__class__ = cls
    return model


def _modules_named(layer: nn.Module, name: str) -> list[nn.Module]:
    """The module(s) running component `name`: SequentialMLP holds one per expert under local_experts."""
    try:
        return [layer.get_submodule(name)]
    except AttributeError:
        pass
    parent, _, gemm = name.rpartition(".")
    experts = getattr(_get(layer, parent), "local_experts", None) if parent.endswith("experts") else None
    if experts is None:
        raise PlanError(f"the plan names {name!r}, which layer {layer.layer_number - 1} does not have: "
                        "derive the plan from this model's config")
    return [expert.get_submodule(gemm) for expert in experts]


def _get(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside megatron's Float16Module (which runs it in BF16/FP16)."""
    from megatron.core.transformer.module import Float16Module

    return model.module if isinstance(model, Float16Module) else model


def _check_order(model: nn.Module) -> None:
    """Refuse models already wrapped for data parallelism, sharded, or given a plan."""
    from megatron.core.distributed import (DistributedDataParallel, FullyShardedDataParallel,
                                           TorchFullyShardedDataParallel)

    wrappers = (nn.parallel.DistributedDataParallel, DistributedDataParallel, FullyShardedDataParallel,
                TorchFullyShardedDataParallel, FSDPModule)
    fix = "call apply_plan_to_megatron on the bare GPTModel (or its Float16Module), before DDP/FSDP wrapping"
    for fqn, module in model.named_modules():
        if isinstance(module, wrappers):
            raise OrderingError(f"{fqn or '<root>'!r} is a {type(module).__name__}: the model is already wrapped; {fix}")
        if isinstance(module, PlanPrecision):
            raise OrderingError(f"{fqn or '<root>'!r} already runs a plan ({type(module).__name__}): apply a plan once")
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise OrderingError(f"parameter {fqn!r} is a DTensor (sharded by FSDP or tensor parallel); {fix}")
