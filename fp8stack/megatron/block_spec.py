"""block_spec(config, plan): megatron-core layer specs whose modules run in the precision the plan says.

The specs are megatron's own (get_gpt_decoder_layer_specs: TE modules, or the local ones where TE
cannot run); the plan only chooses classes, ModuleSpec style: each layer's module becomes
with_precision(TransformerLayer, recipe, format), so the whole layer runs under one FP8 autocast
with its recipe (or a disabled one for a BF16 layer), and a GEMM whose decision differs from its
layer's (an attention linear kept BF16 in an FP8 MoE layer, say) gets a class with its own autocast.
Nothing inside a layer asks the plan at run time.
"""

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules, get_num_layers_to_build,
                                                         get_transformer_layer_offset)

from fp8stack.plan import Plan, PlanError
from fp8stack.plan.from_megatron import describe_transformer_config
from fp8stack.plan.recipes import MEGATRON_RECIPES, is_fp8
from fp8stack.megatron.precision import te_usable, with_precision

GEMM_KINDS = ("linear", "expert")
"""Component kinds that are TE modules in a megatron layer (router, norms and attention core are not GEMMs
the plan can put in FP8)."""


@dataclass(frozen=True)
class LayerPrecision:
    """What the plan asks of one decoder layer."""

    layer: int
    """Global layer index (0-based; megatron's layer_number - 1)."""
    recipe: str | None
    """Recipe of the layer's FP8 autocast, None for a BF16 layer (autocast disabled)."""
    exceptions: tuple[tuple[str, str | None], ...]
    """(component name inside the layer, its recipe or None) for GEMMs that differ from the layer."""


def layer_precisions(config, plan: Plan) -> list[LayerPrecision]:
    """One LayerPrecision per layer of `config`, checked against what megatron can run."""
    _check_plan_fits(config, plan)
    layers: dict[int, list] = {i: [] for i in range(config.num_layers)}
    for d in plan.decisions:
        if d.component.layer is not None and d.component.kind in GEMM_KINDS:
            layers[d.component.layer].append((d.component.name, _megatron_recipe(d)))
    result = []
    for i, gemms in layers.items():
        fp8 = Counter(recipe for _, recipe in gemms if recipe is not None)
        recipe = min(fp8, key=lambda r: (-fp8[r], r)) if fp8 else None  # the most common; ties by name
        result.append(LayerPrecision(i, recipe, tuple((name, r) for name, r in gemms if r != recipe)))
    return result


def block_spec(config, plan: Plan, *, use_te: bool | None = None, vp_stage: int | None = None,
               pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """TransformerBlockSubmodules for GPTModel(config, transformer_layer_spec=...), following `plan`.

    use_te: True takes megatron's TransformerEngine specs, False its local (non-TE) specs, None TE when
    it imports and CUDA is visible. The local specs run BF16 only: a plan with FP8 decisions raises.
    """
    te = te_usable() if use_te is None else use_te
    precisions = layer_precisions(config, plan)
    check_config(config, plan, precisions, te, "TransformerEngine with CUDA is not available here" if use_te is None
                 else "use_te=False asks for megatron's local modules")
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise PlanError("pipeline_model_parallel_layout is not supported by fp8stack.megatron.block_spec: "
                        "use pipeline_model_parallel_size with the default layer split")
    base = get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization=config.normalization)
    specs = [_layer_spec(spec, p, plan.fp8_format) for spec, p in zip(base, precisions)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    local = specs[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=_final_norm(te))


def check_config(config, plan: Plan, precisions: list[LayerPrecision], te: bool, why_not_te: str) -> None:
    """The config and the modules can run the plan: FP8 needs TE modules and config.fp8 set to the plan's format."""
    fp8_layers = [p.layer for p in precisions if p.recipe or any(r for _, r in p.exceptions)]
    if fp8_layers and not te:
        raise PlanError(f"the plan runs layers {fp8_layers} in FP8, but {why_not_te}; megatron-core runs FP8 only "
                        "through TransformerEngine: build on a GPU machine with TE, or pass a bf16 plan")
    if fp8_layers and not getattr(config, "fp8", None):
        raise PlanError(f"the plan runs layers {fp8_layers} in FP8 but config.fp8 is unset: set "
                        f"config.fp8={plan.fp8_format!r} (plan_from_megatron_args does) so megatron pads MoE tokens "
                        "for FP8 and recomputes through TE's checkpoint; the plan still decides every layer")
    if fp8_layers and config.fp8 != plan.fp8_format:
        raise PlanError(f"config.fp8={config.fp8!r} but the plan was made for {plan.fp8_format!r}: make them agree")
    heads_on_te = [d.fqn for d in plan.decisions if d.component.kind == "head" and d.backend == "te"]
    if heads_on_te:
        raise PlanError(f"the plan puts {heads_on_te[0]} on a TE module (head_on_te), which fp8stack's plain path "
                        "builds; megatron's output layer stays its own ColumnParallelLinear (its --gradient-"
                        "accumulation-fusion covers it): drop head_on_te for a megatron model")
    fp8_cores = sorted({d.recipe for d in plan.decisions if d.component.kind == "attn_core" and is_fp8(d.recipe)})
    if bool(fp8_cores) != bool(getattr(config, "fp8_dot_product_attention", False)):
        raise PlanError(f"the plan runs attention in {'FP8 (' + ', '.join(fp8_cores) + ')' if fp8_cores else 'BF16'} "
                        f"but config.fp8_dot_product_attention is {getattr(config, 'fp8_dot_product_attention', False)}"
                        ": make them agree (plan_from_megatron_args reads it from the config)")
    cores = {d.component.layer: d for d in plan.decisions if d.component.kind == "attn_core"}
    mismatched = [p.layer for p in precisions if fp8_cores and p.layer in cores
                  and (p.recipe is not None) != is_fp8(cores[p.layer].recipe)]
    if mismatched:
        raise PlanError(f"megatron runs each layer's attention under the layer's autocast (FP8 attention where it is "
                        f"FP8), and the plan gives layers {mismatched} an attention core in another precision than "
                        "their GEMMs: plan their attention core like their GEMMs, or drop fp8_dot_product_attention")
    if getattr(config, "cuda_graph_impl", "none") != "none":
        raise PlanError(f"cuda_graph_impl={config.cuda_graph_impl!r}: CUDA-graphed layers bypass the layer forward "
                        "that enters the plan's FP8 context; set cuda_graph_impl='none'")


def _layer_spec(spec: ModuleSpec, precision: LayerPrecision, fp8_format: str) -> ModuleSpec:
    """`spec` with the layer and each exceptional GEMM swapped for its with_precision class."""
    for name, recipe in precision.exceptions:
        spec = _replace_leaf(spec, name.split("."), lambda cls, r=recipe: with_precision(cls, r, fp8_format), name)
    return dataclasses.replace(spec, module=with_precision(spec.module, precision.recipe, fp8_format))


def _replace_leaf(node, path: list[str], swap, name: str):
    """A copy of the spec tree `node` with the class at `path` replaced by swap(class); shared parts untouched."""
    if not path:
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, module=swap(node.module))
        if isinstance(node, type):
            return swap(node)
        raise PlanError(f"the plan names {name!r}, but megatron's spec builds it with {node!r}, not a module class")
    if isinstance(node, ModuleSpec):
        subs = node.submodules
    elif isinstance(node, functools.partial) and "submodules" in node.keywords:
        subs = node.keywords["submodules"]
    else:
        raise PlanError(f"the plan names {name!r}, which megatron's spec does not build as a submodule ({node!r})")
    head = path[0]
    if not dataclasses.is_dataclass(subs) or not hasattr(subs, head):
        raise PlanError(f"the plan names {name!r}, but {type(subs).__name__} has no {head!r}: "
                        "derive the plan from this config (describe_transformer_config)")
    new_subs = dataclasses.replace(subs, **{head: _replace_leaf(getattr(subs, head), path[1:], swap, name)})
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, submodules=new_subs)
    return functools.partial(node.func, *node.args, **{**node.keywords, "submodules": new_subs})


def _megatron_recipe(d) -> str | None:
    """The recipe megatron runs a decision with (None: BF16), or PlanError for backends it does not have."""
    if not is_fp8(d.recipe):  # on bf16 or te (a bf16 plan on te): what megatron's TE spec builds without FP8
        return None
    if d.backend == "te" or (d.backend == "grouped_fp8" and d.component.kind == "expert"):
        if d.recipe not in MEGATRON_RECIPES:
            raise PlanError(f"{d.fqn}: recipe {d.recipe!r} on {d.backend} has no TransformerEngine kernel in megatron; "
                            f"use one of {', '.join(MEGATRON_RECIPES)} (--backend te)")
        return d.recipe  # megatron's experts are TE GroupedLinear (or TE linears): grouped_fp8 runs there
    raise PlanError(f"{d.fqn} is planned on {d.backend}, but megatron-core runs FP8 through TransformerEngine only: "
                    "make the plan with backend='te' (plan_from_megatron_args does)")


def _check_plan_fits(config, plan: Plan) -> None:
    """The plan's layer components are the ones megatron builds from `config` (names, kinds, shapes)."""
    def layer_gemms(components):
        return [(c.layer, c.name, c.kind, c.n, c.k, c.experts) for c in components
                if c.layer is not None and c.kind in GEMM_KINDS]
    want = layer_gemms(describe_transformer_config(config, vocab_size=1, seq_len=1).components)
    have = layer_gemms(d.component for d in plan.decisions)
    if want != have:
        diff = next((w, h) for w, h in zip(want + [None] * len(have), have + [None] * len(want)) if w != h)
        raise PlanError(f"the plan for {plan.model!r} does not describe this TransformerConfig (first difference: "
                        f"config builds {diff[0]}, plan has {diff[1]}): make it with describe_transformer_config(config)")


def _final_norm(te: bool):
    """The final layer norm get_gpt_decoder_block_spec uses."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.TENorm if te else gpt_layer_specs.LNImpl
