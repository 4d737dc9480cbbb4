"""megatron-core integration: build or adapt a GPTModel so each layer runs in the precision a Plan says.

- block_spec(config, plan): layer specs for GPTModel(config, transformer_layer_spec=...).
- apply_plan_to_megatron(model, plan): the same on a model already built (before DDP/FSDP).
- plan_from_megatron_args(config, ...): megatron's --fp8* flags as a Plan.
"""

import importlib.util

if importlib.util.find_spec("megatron") is None:
    raise ModuleNotFoundError("fp8stack.megatron needs megatron-core, which is not installed: "
                              "pip install 'fp8stack[megatron]' (Python >= 3.12)", name="megatron")

from fp8stack.megatron.apply import apply_plan_to_megatron
from fp8stack.megatron.block_spec import LayerPrecision, block_spec, layer_precisions
from fp8stack.megatron.flags import plan_from_megatron_args
from fp8stack.megatron.precision import PlanPrecision, megatron_te_recipe, te_usable, with_precision

__all__ = ["LayerPrecision", "PlanPrecision", "apply_plan_to_megatron", "block_spec", "layer_precisions",
           "megatron_te_recipe", "plan_from_megatron_args", "te_usable", "with_precision"]
