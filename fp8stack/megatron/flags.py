"""plan_from_megatron_args: megatron's own FP8 flags as an fp8stack Plan, so a launch command keeps working.

--fp8-format e4m3|hybrid -> PolicyConfig.fp8_format (unset: no FP8, a bf16 plan), --fp8-recipe -> recipe,
--first-last-layers-bf16 / --num-layers-at-{start,end}-in-bf16 -> the same PolicyConfig fields,
--fp8-dot-product-attention -> fp8_attention (megatron's TE attention runs under its layer's recipe with fp8_dpa).
Backend
te (megatron runs FP8 through TransformerEngine) and no small-GEMM filter: megatron converts every TE
linear whatever its size. Experts run on megatron's TE experts (expert_backend te, whatever the measured table), and
their decisions say which.
"""

import dataclasses

from fp8stack.plan import Plan, PlanError, PolicyConfig, load_recipe_file, make_plan
from fp8stack.plan.from_megatron import describe_transformer_config
from fp8stack.plan.recipes import BF16, MEGATRON_RECIPES

_UNSET = object()


def plan_from_megatron_args(config, *, vocab_size: int, seq_len: int, fp8=_UNSET, fp8_recipe=_UNSET,
                            fp8_format=_UNSET, first_last_layers_bf16=_UNSET, num_layers_at_start_in_bf16=_UNSET,
                            num_layers_at_end_in_bf16=_UNSET, moe_grouped_gemm=_UNSET,
                            fp8_dot_product_attention=_UNSET, moe_only: bool = False, arch: int = 90,
                            name: str = "megatron") -> Plan:
    """The plan megatron's flags ask for; each flag not given is read off `config` (a TransformerConfig).

    fp8: --fp8-format ('e4m3' | 'hybrid' | None); fp8_format is the same flag under fp8stack's name (give one).
    moe_only: FP8 for the MoE FFN only (routed and shared experts); attention and dense MLPs stay BF16.
    """
    if fp8 is not _UNSET and fp8_format is not _UNSET and fp8 != fp8_format:
        raise PlanError(f"fp8={fp8!r} and fp8_format={fp8_format!r} name one flag (--fp8-format): give one")
    flags = {
        "fp8": fp8 if fp8 is not _UNSET else fp8_format if fp8_format is not _UNSET else getattr(config, "fp8", None),
        "fp8_recipe": _read(fp8_recipe, config, "fp8_recipe", "delayed"),
        "first_last_layers_bf16": _read(first_last_layers_bf16, config, "first_last_layers_bf16", False),
        "num_layers_at_start_in_bf16": _read(num_layers_at_start_in_bf16, config, "num_layers_at_start_in_bf16", 1),
        "num_layers_at_end_in_bf16": _read(num_layers_at_end_in_bf16, config, "num_layers_at_end_in_bf16", 1),
        "moe_grouped_gemm": _read(moe_grouped_gemm, config, "moe_grouped_gemm", False),
        "fp8_dot_product_attention": _read(fp8_dot_product_attention, config, "fp8_dot_product_attention", False),
    }
    recipe = str(getattr(flags["fp8_recipe"], "value", flags["fp8_recipe"]))  # Fp8Recipe enum or str
    if flags["fp8"] and recipe not in MEGATRON_RECIPES:
        raise PlanError(f"--fp8-recipe {recipe!r} is not one fp8stack plans: use one of {', '.join(MEGATRON_RECIPES)}")
    if flags["fp8"] not in (None, False, "e4m3", "hybrid"):
        raise PlanError(f"--fp8-format {flags['fp8']!r}: use e4m3 or hybrid (or leave it unset for BF16)")
    # The recipe file's `auto` would pick torchao for tensorwise; megatron's linears are TE.
    overrides = tuple(dataclasses.replace(o, backend="te" if o.backend == "auto" else o.backend)
                      for o in load_recipe_file("moe-only-fp8")[1]) if moe_only else ()
    policy = PolicyConfig(  # without FP8, backend auto: a bf16 plan, not fp8stack's bf16-on-te baseline
        recipe=recipe if flags["fp8"] else BF16, fp8_format=flags["fp8"] or "hybrid",
        backend="te" if flags["fp8"] else "auto", arch=arch,
        first_last_layers_bf16=bool(flags["first_last_layers_bf16"]),
        num_layers_at_start_in_bf16=flags["num_layers_at_start_in_bf16"],
        num_layers_at_end_in_bf16=flags["num_layers_at_end_in_bf16"], small_gemm_filter="off", overrides=overrides,
        expert_backend="te",  # megatron's experts are TE modules, whatever the recipe or the measured table
        head_on_te=False,  # megatron's output layer is its own ColumnParallelLinear
        fp8_attention=bool(flags["fp8_dot_product_attention"]))
    plan = make_plan(describe_transformer_config(config, vocab_size=vocab_size, seq_len=seq_len, name=name), policy)
    experts = "TE GroupedLinear (TEGroupedMLP, --moe-grouped-gemm)" if flags["moe_grouped_gemm"] else \
        "one TE linear per expert (SequentialMLP, no --moe-grouped-gemm)"
    decisions = tuple(dataclasses.replace(d, reason=f"{d.reason}; megatron runs the experts as {experts}")
                      if d.component.kind == "expert" and d.backend == "te" else d for d in plan.decisions)
    return dataclasses.replace(plan, decisions=decisions)


def _read(value, config, attr: str, default):
    return value if value is not _UNSET else getattr(config, attr, default)
