"""assemble(model, plan): the stages that turn a model and a precision plan into a training model,
in the only order that works:

    convert_fp8 -> tensor_parallel -> recompute -> compile -> fully_shard

Conversion swaps modules, so it must see plain ones: after tensor parallelism their weights are
DTensors sharded for nn.Linear, after recompute they sit inside checkpoint wrappers, after compile
the graphs were traced from the old modules, after fully_shard the weights are already grouped and
sharded where torchao's float8 weight wrapper cannot go. Each stage is a
helper that may be called alone (apply_fp8, apply_tp, apply_ac, apply_compile, apply_fsdp) and
stamps the model (`assembly_state(model)`), so a stage run late, or twice, raises OrderingError
instead of producing a model that trains in the wrong precision. Stages also look at the model
itself (DTensor parameters, compiled, checkpoint-wrapped or FSDP modules), so a model prepared by
hand is held to the same order.
"""

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                  PrepareFloat8ModuleInput)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from fp8stack.backends import BackendUnavailable, ConversionRecord, get_backend
from fp8stack.backends.te import fp8_weight_caches, mark_fp8_weights_stale
from fp8stack.plan import Plan
from fp8stack.plan.recipes import BF16
from fp8stack.runtime.recompute import (RECOMPUTE_MODULES, CheckpointWrapper, checkpoint_module, has_te_modules,
                                        recompute_regions, recomputes_itself)

__all__ = ["STAGES", "AssemblyState", "AssemblyWarning", "OrderingError", "apply_ac", "apply_compile", "apply_fp8",
           "apply_fsdp", "apply_tp", "assemble", "assembly_state", "post_optimizer_step_hook"]

log = logging.getLogger(__name__)

STAGES = ("convert_fp8", "tensor_parallel", "recompute", "compile", "fully_shard")
"""The stages, in the order they must run. Any may be skipped; none may run after a later one."""

_FIX = ("call assemble(model, plan, ...) on a freshly built model: it runs the stages in order "
        f"({' -> '.join(STAGES)})")


class OrderingError(RuntimeError):
    """Assembly stages run out of order, twice, or in a combination that would silently train wrong."""


class AssemblyWarning(UserWarning):
    """Something asked of the assembly will have no effect on this model."""


@dataclass
class AssemblyState:
    """What the assembly has done to a model; kept on it, read with assembly_state(model)."""

    stages: list[str] = field(default_factory=list)
    """Stages applied so far, in order."""
    conversions: list[ConversionRecord] = field(default_factory=list)
    """One record per backend from convert_fp8: fqn -> the class that now runs it."""
    precompute_fp8_scales: bool = False
    """post_optimizer_step_hook precomputes torchao's FP8 weight scales (requested and applicable)."""


_STATE_ATTR = "_fp8stack_assembly"


def assembly_state(model: nn.Module) -> AssemblyState:
    """The stamps on `model` (an empty state for a model no stage has touched)."""
    return model.__dict__.get(_STATE_ATTR) or AssemblyState()


def assemble(
    model: nn.Module,
    plan: Plan,
    *,
    tp_mesh: DeviceMesh | None = None,
    recompute: Sequence[int] | Literal["all"] | None = None,
    recompute_modules: Sequence[str] = ("block",),
    compile: bool = False,
    fsdp_mesh: DeviceMesh | None = None,
    fsdp_float8_all_gather: bool = False,
    precompute_fp8_scales: bool = False,
    fsdp_mp_policy: MixedPrecisionPolicy | None = None,
    backend_options: dict[str, dict] | None = None,
) -> nn.Module:
    """Apply `plan` and the parallelisms to `model`; returns the model to train (a new object only
    when the plan swapped the root module itself).

    tp_mesh: tensor-parallel mesh, or None. recompute: block indices of model.layers to checkpoint,
    or 'all'. recompute_modules: what to checkpoint in those blocks (RECOMPUTE_MODULES names; the
    whole block by default). compile: torch.compile each block. fsdp_mesh: FSDP2 mesh, or None.
    fsdp_float8_all_gather: all-gather torchao tensorwise weights in FP8 (needs fsdp_mesh).
    precompute_fp8_scales: let post_optimizer_step_hook compute those weights' scales in one
    all-reduce per step. fsdp_mp_policy: FSDP2 mixed precision (default BF16 params, FP32 reduce).
    backend_options: backend name -> constructor options.
    """
    _check_combination(plan, fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh, fsdp_float8_all_gather=fsdp_float8_all_gather,
                       backend_options=backend_options)
    if recompute is None and tuple(recompute_modules) != ("block",):
        raise ValueError(f"recompute_modules={list(recompute_modules)} has no effect without recompute: pass "
                         "recompute='all' (or block indices) too")
    model = apply_fp8(model, plan, fsdp_float8_all_gather=fsdp_float8_all_gather, backend_options=backend_options)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    if recompute is not None:
        apply_ac(model, recompute, recompute_modules)
    if compile:
        apply_compile(model)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, mp_policy=fsdp_mp_policy, precompute_fp8_scales=precompute_fp8_scales)
    elif precompute_fp8_scales:
        _record_precompute(model, requested=True)
    return model


def _check_combination(plan: Plan, *, fsdp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None,
                       fsdp_float8_all_gather: bool, backend_options: dict[str, dict] | None) -> None:
    """Refuse, before anything is touched, the combinations no stage order can make right."""
    if (backend_options or {}).get("te", {}).get("fuse_wgrad_accumulation") and (fsdp_mesh or tp_mesh):
        raise OrderingError("te fuse_wgrad_accumulation accumulates weight gradients into FP32 main_grad buffers, "
                            "which neither fully_shard nor tensor parallelism reduce or shard: train one process, "
                            "use model_impl megatron (its DDP reduces main_grad), or turn it off")
    if fsdp_float8_all_gather:
        _check_fp8_all_gather_recipes(plan)
        if fsdp_mesh is None:
            raise OrderingError("fsdp_float8_all_gather=True needs fully_shard: pass fsdp_mesh=..., "
                                "or turn fsdp_float8_all_gather off")


def _check_fp8_all_gather_recipes(plan: Plan) -> None:
    torchao = plan.for_backend("torchao")
    if not torchao:
        raise OrderingError("fsdp_float8_all_gather=True but the plan has no torchao Float8Linear layers to gather "
                            "in FP8: plan some layers for torchao tensorwise (--backend torchao "
                            "--fp8-recipe tensorwise), or turn fsdp_float8_all_gather off")
    other = sorted({d.recipe for d in torchao if d.recipe != "tensorwise"})
    if other:
        raise OrderingError(f"fsdp_float8_all_gather=True needs tensorwise weight scales, but the plan has torchao "
                            f"layers with {', '.join(other)}: use --fp8-recipe tensorwise, or turn "
                            "fsdp_float8_all_gather off (the weights are then all-gathered in BF16)")


# --- stage 1: FP8 conversion -------------------------------------------------------------------

def apply_fp8(model: nn.Module, plan: Plan, *, fsdp_float8_all_gather: bool = False,
              backend_options: dict[str, dict] | None = None) -> nn.Module:
    """Hand each backend its decisions; returns the model (new only if the root was swapped)."""
    state = _begin(model, "convert_fp8")
    if fsdp_float8_all_gather:
        _check_fp8_all_gather_recipes(plan)
    options = {name: dict(opts) for name, opts in (backend_options or {}).items()}
    if fsdp_float8_all_gather:
        options.setdefault("torchao", {})["enable_fsdp_float8_all_gather"] = True
    names = list(dict.fromkeys(d.backend for d in plan.decisions))
    unused = sorted(set(options) - set(names))
    if unused:
        raise ValueError(f"backend options for {', '.join(unused)}, which the plan does not use "
                         f"(it uses {', '.join(names)}): drop them or fix the plan")
    backends = [get_backend(name, **options.get(name, {})) for name in names]
    for backend in backends:  # all checked before any module is touched
        ok, why = backend.available(sorted({d.recipe for d in plan.for_backend(backend.name)}))
        if not ok:
            raise BackendUnavailable(
                f"the plan runs {len(plan.for_backend(backend.name))} component(s) on {backend.name}: {why}")
    for backend in backends:
        model, record = backend.convert(model, plan.for_backend(backend.name), plan)
        state.conversions.append(record)
        log.info("convert_fp8: %s ran %d component(s) (%s)", record.backend, len(record.converted), record.recipe)
    _stamp(model, state, "convert_fp8")
    return model


# --- stage 2: tensor parallelism ---------------------------------------------------------------

_FUSED = {"attention.wqkv": "q, k and v", "feed_forward.w13": "gate and up"}
"""Fused projections: a colwise shard of the fused weight would hand one rank all of q (or gate)."""
_UNFUSE = ("build the model with separate projections: LlamaConfig(fused_projections=False), or "
           "--no-fused-projections for python -m fp8stack.train / launch/train.sh")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Llama TP plan with sequence parallelism: embeddings rowwise, output colwise,
    per block wq/wk/wv/w1/w3 colwise and wo/w2 rowwise. Tensorwise Float8Linear layers get torchao's
    Float8 styles, and an attention or MLP whose linears are all such layers gathers its input in FP8
    (PrepareFloat8ModuleInput); other layers get torch's styles and move BF16.

    The blocks must take their local head count from the projection outputs (view(..., -1, head_dim))
    and the sequence length must divide by the TP degree (sequence parallelism shards it).
    Fused wqkv / w13 are refused: sharding them colwise needs q/k/v (gate/up) split per rank first.
    TE modules shard themselves: use the Megatron path for those. Everything is checked before the
    first module is sharded."""
    state = _begin(model, "tensor_parallel")
    if has_te_modules(model):
        raise NotImplementedError("apply_tp cannot shard TransformerEngine modules: TE does tensor parallelism "
                                  "itself (tp_group, sequence_parallel). Build the model with the Megatron "
                                  "factory (fp8stack.megatron) and --tensor-model-parallel-size instead")
    blocks = dict(_blocks(model))
    degree = tp_mesh.size()
    for index, block in blocks.items():
        submodules = dict(block.named_modules())
        fused = [f"layers.{index}.{name} (fused {what})" for name, what in _FUSED.items() if name in submodules]
        if fused:
            raise NotImplementedError(
                f"apply_tp does not shard {', '.join(fused)}: a colwise shard of a fused projection would give one "
                f"rank all of q (or gate) and the other k and v (or up). Fix: {_UNFUSE}")
        if "moe" in submodules:
            raise NotImplementedError(f"apply_tp does not shard layers.{index}.moe: experts need expert "
                                      "parallelism, which fp8stack does not provide. Use a dense model "
                                      "(--model tiny or llama-1b-like) or no tensor parallelism")
        attention = submodules.get("attention")
        heads = {name: getattr(attention, name, None) for name in ("n_heads", "n_kv_heads")}
        uneven = [f"{name}={count}" for name, count in heads.items() if isinstance(count, int) and count % degree]
        if uneven:
            raise ValueError(f"apply_tp over {degree} ranks shards layers.{index}.attention by heads, but "
                             f"{', '.join(uneven)} does not divide by {degree}: pick a tensor-parallel degree that "
                             "divides both head counts")
    float8_styled = [fqn for fqn, m in model.named_modules() if _is_tensorwise_float8(m)]
    if float8_styled and degree > 1 and tp_mesh.device_type == "cpu":
        raise NotImplementedError(
            f"apply_tp would give {len(float8_styled)} torchao tensorwise Float8Linear layer(s) (e.g. "
            f"{float8_styled[0]!r}) torchao's Float8ColwiseParallel / Float8RowwiseParallel, which all-gather "
            "float8 tensors, and gloo (the CPU backend) cannot move float8 (RuntimeError: Invalid scalar type). "
            "Run tensorwise FP8 tensor parallelism on GPUs (NCCL), or on a CPU use --fp8-recipe rowwise or bf16 "
            "(those layers gather in high precision)")

    def colwise(module: nn.Module, **kw):
        return (Float8ColwiseParallel if _is_tensorwise_float8(module) else ColwiseParallel)(**kw)

    def rowwise(module: nn.Module, **kw):
        return (Float8RowwiseParallel if _is_tensorwise_float8(module) else RowwiseParallel)(**kw)

    def prepare_input(module: nn.Module, **kw):
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        return (PrepareFloat8ModuleInput if all(map(_is_tensorwise_float8, linears)) else PrepareModuleInput)(**kw)

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": colwise(model.output, input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in blocks.values():
        sub = block.get_submodule
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": prepare_input(sub("attention"), input_layouts=(Shard(1), None),
                                       desired_input_layouts=(Replicate(), None)),
            **{f"attention.{n}": colwise(sub(f"attention.{n}")) for n in ("wq", "wk", "wv")},
            "attention.wo": rowwise(sub("attention.wo"), output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare_input(sub("feed_forward"), input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            **{f"feed_forward.{n}": colwise(sub(f"feed_forward.{n}")) for n in ("w1", "w3")},
            "feed_forward.w2": rowwise(sub("feed_forward.w2"), output_layouts=Shard(1)),
        })
    _stamp(model, state, "tensor_parallel")


def _is_tensorwise_float8(module: nn.Module) -> bool:
    """torchao's Float8 TP styles cast with per-tensor scales, so they suit tensorwise layers only."""
    return (isinstance(module, Float8Linear)
            and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)


# --- stage 3: activation recompute -------------------------------------------------------------

def apply_ac(model: nn.Module, blocks: Sequence[int] | Literal["all"] = "all",
             modules: Sequence[str] = ("block",)) -> None:
    """Checkpoint, in the given blocks of model.layers (indices, or 'all'), the regions `modules`
    names (RECOMPUTE_MODULES: 'block' is the whole block; 'mlp', 'attn', 'core_attn', 'moe',
    'moe_act', 'shared_experts', 'layernorm' its parts, as Megatron's --recompute-modules). A region
    runs its recompute through TE's checkpoint when convert_fp8 put TE FP8 layers in it, and a TE
    LayerNormMLP (fuse_mlp) through its own checkpoint option, which skips FC2 (see checkpoint_module).
    A name no chosen block has, or regions nested in one another, raise ValueError."""
    state = _begin(model, "recompute")
    children = dict(_blocks(model))
    chosen = list(children) if blocks == "all" else [str(i) for i in blocks]
    missing = [i for i in chosen if i not in children]
    if missing:
        raise ValueError(f"recompute names block(s) {', '.join(missing)} but model.layers has {', '.join(children)}: "
                         "pass indices of existing blocks or 'all'")
    regions = {index: recompute_regions(children[index], modules) for index in chosen}
    absent = [n for n in modules if not any(found[n] for found in regions.values())]
    if absent:
        raise ValueError(f"recompute_modules {', '.join(map(repr, absent))}: none of blocks {', '.join(chosen)} has "
                         f"{' or '.join(p for n in absent for p in RECOMPUTE_MODULES[n])} (e.g. 'moe' in a dense "
                         "block, 'moe_act' on TE experts, which fuse it): drop the name or pick other blocks")
    fp8_fqns = [fqn for r in state.conversions if r.backend != BF16 for fqn in r.converted]
    wrapped = []
    for index in chosen:
        paths = sorted(p for found in regions[index].values() for p in found)
        for outer, inner in zip(paths, paths[1:]):
            if outer == "" or inner.startswith(f"{outer}."):
                raise ValueError(f"recompute_modules would checkpoint layers.{index}.{inner} inside "
                                 f"layers.{index}{'.' + outer if outer else ''}: recomputing a region twice saves "
                                 "nothing; keep only the outer name")
        for path in paths:
            fqn = f"layers.{index}" + (f".{path}" if path else "")
            fp8_active = any(f.startswith(f"{fqn}.") for f in fp8_fqns)
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            region = checkpoint_module(parent.get_submodule(name), fp8_active=fp8_active)
            parent.register_module(name, region)
            wrapped.append(f"{fqn} (TE LayerNormMLP's own recompute: not FC2)" if recomputes_itself(region) else fqn)
    log.info("recompute: checkpointing %s", ", ".join(wrapped))
    _stamp(model, state, "recompute")


# --- stage 4: compile --------------------------------------------------------------------------

def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (Module.compile: names and state dict keys stay the same).
    Repeated blocks compile once and are reused. TE modules run eagerly inside them (te_modules), so
    DelayedScaling's amax and scale updates happen as without compile."""
    state = _begin(model, "compile")
    for _, block in _blocks(model):
        block.compile()
    log.info("compile: compiling each of %d blocks", len(model.layers))
    _stamp(model, state, "compile")


# --- stage 5: FSDP2 ----------------------------------------------------------------------------

def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               precompute_fp8_scales: bool = False) -> None:
    """fully_shard every block, then the root (embeddings, final norm and head go with the root).

    mp_policy defaults to BF16 parameters for compute and FP32 gradient reduction.
    precompute_fp8_scales: see post_optimizer_step_hook."""
    state = _begin(model, "fully_shard")
    mp_policy = mp_policy or MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    log.info("fully_shard: %d blocks and the root over %d ranks", len(model.layers), mesh.size())
    _stamp(model, state, "fully_shard")
    _record_precompute(model, precompute_fp8_scales)


def post_optimizer_step_hook(model: nn.Module) -> Callable[..., None]:
    """The function to run after every optimizer step, for what changed weights invalidate: with torchao
    tensorwise layers all-gathered in FP8 under FSDP and precompute_fp8_scales requested, all their weight
    scales in one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp); with TE layers that cache
    FP8 weights across micro-batches (cache_fp8_weights), a fresh cast at the next forward. Otherwise it
    does nothing. Register it with optimizer.register_step_post_hook(hook), or call hook() after optimizer.step()."""
    precompute = assembly_state(model).precompute_fp8_scales
    caches = fp8_weight_caches(model)
    if not (precompute or caches):
        return _do_nothing

    def after_optimizer_step(*_optimizer_hook_args) -> None:
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        mark_fp8_weights_stale(caches)

    return after_optimizer_step


def _do_nothing(*_optimizer_hook_args) -> None:
    """The post-step hook of a model with nothing that changed weights invalidate."""


def _record_precompute(model: nn.Module, requested: bool) -> None:
    """Turn the precompute on when some weight uses it; say so loudly when it was asked in vain."""
    applies = any(isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
                  and isinstance(m.weight.to_local(), WeightWithDynamicFloat8CastTensor) for m in model.modules())
    if requested and not applies:
        message = ("precompute_fp8_scales=True has no effect: no weight is a torchao tensorwise Float8Linear weight "
                   "all-gathered in FP8 by FSDP. It needs fsdp_mesh, fsdp_float8_all_gather=True and torchao "
                   "tensorwise layers in the plan; otherwise drop precompute_fp8_scales")
        log.warning(message)
        warnings.warn(message, AssemblyWarning, stacklevel=3)
    state = assembly_state(model)
    state.precompute_fp8_scales = requested and applies
    model.__dict__[_STATE_ATTR] = state


# --- stamps and traces -------------------------------------------------------------------------

def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList/ModuleDict of blocks, which the "
                        "per-block stages (tensor_parallel, recompute, compile, fully_shard) work on")
    return list(layers.named_children())


def _traces(model: nn.Module) -> dict[str, str]:
    """Stage -> evidence that it was applied, read from the model itself (not from the stamps)."""
    found: dict[str, str] = {}
    for fqn, module in model.named_modules():
        name = repr(fqn or "<root>")
        if isinstance(module, FSDPModule):
            found.setdefault("fully_shard", f"{name} is wrapped by fully_shard (FSDPModule)")
        if isinstance(module, OptimizedModule) or module._compiled_call_impl is not None:
            found.setdefault("compile", f"{name} is compiled")
        if isinstance(module, CheckpointWrapper):
            found.setdefault("recompute", f"{name} is wrapped for activation checkpointing")
        if recomputes_itself(module):
            found.setdefault("recompute", f"{name} is a TE LayerNormMLP set to recompute (checkpoint=True)")
    if "fully_shard" not in found:
        for fqn, param in model.named_parameters():
            if isinstance(param, DTensor):
                found["tensor_parallel"] = f"parameter {fqn!r} is already a DTensor"
                break
    return found


def _begin(model: nn.Module, stage: str) -> AssemblyState:
    """Check `stage` may run now; return the state to stamp when it is done."""
    state = assembly_state(model)
    traces = _traces(model)
    if stage in state.stages or stage in traces:
        evidence = f" ({traces[stage]})" if stage in traces else ""
        raise OrderingError(f"{stage} has already been applied to this model{evidence}: each stage runs once; "
                            f"{_FIX}")
    applied = {s: "stamped by fp8stack" for s in state.stages} | traces
    later = [s for s in STAGES[STAGES.index(stage) + 1:] if s in applied]
    if later:
        raise OrderingError(f"{stage} must run before {later[0]}, but {later[0]} has already been applied "
                            f"({applied[later[0]]}): {_FIX}")
    return state


def _stamp(model: nn.Module, state: AssemblyState, stage: str) -> None:
    state.stages.append(stage)
    model.__dict__[_STATE_ATTR] = state
