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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from fp8stack.backends import (Backend, BackendUnavailable, ConversionRecord, available_backends, check_plan_fits,
                                get_backend)
from fp8stack.plan import Plan, PlanError
from fp8stack.plan.parallel import SHARD_KINDS, ShardAs, TensorParallelPlan
from fp8stack.plan.recipes import BF16, get_recipe
from fp8stack.runtime.attention import set_sdpa_backend
from fp8stack.runtime.recompute import (RECOMPUTE_MODULES, CheckpointWrapper, checkpoint_module, is_te_module,
                                        recompute_regions, recomputes_itself)

__all__ = ["STAGES", "AssemblyState", "AssemblyWarning", "OrderingError", "ShardAs", "TensorParallelPlan", "apply_ac",
           "apply_compile", "apply_fp8", "apply_fsdp", "apply_tp", "assemble", "assembly_state", "describe_assembly",
           "after_checkpoint_load", "post_optimizer_step_hook"]

for _backend in available_backends():  # before any model runs: TE must load its cuDNN before torch loads its own
    _backend.prepare_process()

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
    backends: list[Backend] = field(default_factory=list)
    """The backends convert_fp8 ran, for the lifecycle of what they converted (after each optimizer step, master
    weights, tensor-parallel styles)."""
    precompute_fp8_scales: bool = False
    """post_optimizer_step_hook precomputes torchao's FP8 weight scales (requested and applicable)."""
    master_values: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> the FP32 values a weight held in low precision only (TE's fp8_weights) was quantized from,
    taken from the backends by fully_shard, whose sharded parameters do not carry them over; ShardedMasterWeights
    starts its masters from them (and removes them)."""


_STATE_ATTR = "_fp8stack_assembly"


def assembly_state(model: nn.Module) -> AssemblyState:
    """The stamps on `model` (an empty state for a model no stage has touched)."""
    return model.__dict__.get(_STATE_ATTR) or AssemblyState()


def assemble(
    model: nn.Module,
    plan: Plan,
    *,
    tp_mesh: DeviceMesh | None = None,
    tp_plan: TensorParallelPlan | None = None,
    recompute: Sequence[int] | Literal["all"] | None = None,
    recompute_modules: Sequence[str] = ("block",),
    compile: bool = False,
    fsdp_mesh: DeviceMesh | None = None,
    fsdp_float8_all_gather: bool = False,
    precompute_fp8_scales: bool = False,
    fsdp_mp_policy: MixedPrecisionPolicy | None = None,
    fsdp_reshard_after_forward: bool | None = None,
    backend_options: dict[str, dict] | None = None,
    sdpa_backend: str | None = None,
    allow_little_fp8: bool = False,
    verbose: bool = False,
) -> nn.Module:
    """Apply `plan` and the parallelisms to `model`; returns the model to train (a new object only
    when the plan swapped the root module itself).

    tp_mesh: tensor-parallel mesh, or None; tp_plan: how to shard the model over it (the model's own, e.g.
    fp8stack.models.llama.tensor_parallel_plan). recompute: block indices of model.layers to checkpoint,
    or 'all'. recompute_modules: what to checkpoint in those blocks (RECOMPUTE_MODULES names; the
    whole block by default). compile: torch.compile each block. fsdp_mesh: FSDP2 mesh, or None.
    fsdp_float8_all_gather: all-gather torchao tensorwise weights in FP8 (needs fsdp_mesh).
    precompute_fp8_scales: let post_optimizer_step_hook compute those weights' scales in one
    all-reduce per step. fsdp_mp_policy: FSDP2 mixed precision (default BF16 params, FP32 reduce).
    fsdp_reshard_after_forward: free each block's gathered parameters after its forward (True), keep them until its
    backward (False: one all-gather fewer per micro-batch, the gathered copy resident; TE keeps its FP8 weight cache
    and may fuse its weight-gradient accumulation: TEBackend.before_fully_shard), or torch's default (None).
    backend_options: backend name -> constructor options. sdpa_backend: the kernel SDPA runs in this process from
    now on ('cudnn', 'flash', 'efficient'; runtime.attention; None leaves torch's choice) for the attention the plan
    keeps in BF16 (all of it unless fp8_attention), and cuDNN's is the fastest measured on Hopper.
    allow_little_fp8: accept a plan whose FP8 recipe runs little FP8 (Plan.little_fp8), which is refused otherwise.
    verbose: print what each stage did.
    """
    if plan.little_fp8 and not allow_little_fp8:
        raise PlanError(f"{plan.little_fp8}: pass allow_little_fp8=True if that is intended, or change the policy")
    _check_combination(plan, fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh, tp_plan=tp_plan,
                       fsdp_float8_all_gather=fsdp_float8_all_gather, backend_options=backend_options,
                       keeps_gathered=fsdp_reshard_after_forward is False)
    if recompute is None and tuple(recompute_modules) != ("block",):
        raise ValueError(f"recompute_modules={list(recompute_modules)} has no effect without recompute: pass "
                         "recompute='all' (or block indices) too")
    if sdpa_backend is not None:
        set_sdpa_backend(sdpa_backend, next(model.parameters()).device)
    options = _with_parallel_options(plan, backend_options, distributed=fsdp_mesh is not None or tp_mesh is not None,
                                     fully_sharded=fsdp_mesh is not None, precompute_fp8_scales=precompute_fp8_scales)
    model = apply_fp8(model, plan, fsdp_float8_all_gather=fsdp_float8_all_gather, backend_options=options)
    mp_policy = fsdp_mp_policy or _DEFAULT_MP_POLICY
    if fsdp_mesh is not None and tp_mesh is None and (backend_options or {}).get("te", {}).get(
            "fuse_wgrad_accumulation") is None:
        _add_note(model, "te", "fuse_wgrad_accumulation (auto): off under fully_shard, whose reduce-scatter takes "
                               "autograd's gradients, not TE's main_grad; micro-batch gradients accumulate in "
                               f"{_dtype_name(mp_policy.reduce_dtype or mp_policy.param_dtype)} (FSDP2's reduce_dtype)")
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, tp_plan)
    if recompute is not None:
        apply_ac(model, recompute, recompute_modules)
    if compile:
        apply_compile(model)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, mp_policy=mp_policy, precompute_fp8_scales=precompute_fp8_scales,
                   reshard_after_forward=fsdp_reshard_after_forward)
    elif precompute_fp8_scales:
        _record_precompute(model, requested=True)
    if verbose:
        print(describe_assembly(model, sdpa_backend))
    return model


def describe_assembly(model: nn.Module, sdpa_backend: str | None = None) -> str:
    """What the assembly did to `model`, in lines: the stages, and per backend what it converted and its notes."""
    state = assembly_state(model)
    lines = [f"fp8stack assembled {type(model).__name__}: {' -> '.join(state.stages) or 'no stage'}"]
    for record in state.conversions:
        runs = ", ".join(f"{n} {cls}" for cls, n in Counter(record.converted.values()).most_common())
        lines.append(f"  {record.backend} ({record.recipe}): {len(record.converted)} component(s) on {runs or '-'}")
        lines += [f"    {note}" for note in record.notes]
    if sdpa_backend is not None:
        lines.append(f"  attention: SDPA runs {sdpa_backend} kernels in this process")
    if state.precompute_fp8_scales:
        lines.append("  after each optimizer step: torchao FP8 weight scales precomputed in one all-reduce")
    return "\n".join(lines)


def _with_parallel_options(plan: Plan, backend_options: dict[str, dict] | None, *, distributed: bool,
                           fully_sharded: bool, precompute_fp8_scales: bool) -> dict[str, dict] | None:
    """backend_options plus what the parallelisms decide, where left to auto: TE's fused wgrad accumulation off under
    FSDP or tensor parallelism (nothing reduces its main_grad); TE's delayed-scaling amaxes per process unless
    fully_shard gathers weights held in FP8 (every other rank quantizes whole weights, TEBackend.local_amax);
    torchao's scale precompute when asked for."""
    options = {name: dict(opts) for name, opts in (backend_options or {}).items()}
    used = {d.backend for d in plan.decisions}
    te = options.get("te", {})
    if distributed and "te" in used and te.get("fuse_wgrad_accumulation") is None:
        options.setdefault("te", {})["fuse_wgrad_accumulation"] = False
    if not fully_sharded and "te" in used and te.get("local_amax") is None:
        options.setdefault("te", {})["local_amax"] = True
    if precompute_fp8_scales and "torchao" in used:
        options.setdefault("torchao", {})["precompute_fp8_scales"] = True
    return options or None


def _check_combination(plan: Plan, *, fsdp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None,
                       tp_plan: TensorParallelPlan | None, fsdp_float8_all_gather: bool,
                       backend_options: dict[str, dict] | None, keeps_gathered: bool) -> None:
    """Refuse, before anything is touched, the combinations no stage order can make right."""
    if (tp_mesh is None) != (tp_plan is None):
        raise ValueError("tensor parallelism needs both tp_mesh and tp_plan (the model's own plan, e.g. "
                         "fp8stack.models.llama.tensor_parallel_plan): pass both or neither")
    for name, options in (backend_options or {}).items():
        reason = get_backend(name, **options).refuse_wrappers(tensor_parallel=tp_mesh is not None,
                                                              fully_shard=fsdp_mesh is not None,
                                                              keeps_gathered=keeps_gathered)
        if reason:
            raise OrderingError(reason)
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
    other = sorted({d.recipe for d in torchao if not get_recipe(d.recipe).gathers_in_fp8})
    if other:
        raise OrderingError(f"fsdp_float8_all_gather=True needs tensorwise weight scales, but the plan has torchao "
                            f"layers with {', '.join(other)}: use --fp8-recipe tensorwise, or turn "
                            "fsdp_float8_all_gather off (the weights are then all-gathered in BF16)")


# --- stage 1: FP8 conversion -------------------------------------------------------------------

def apply_fp8(model: nn.Module, plan: Plan, *, fsdp_float8_all_gather: bool = False,
              backend_options: dict[str, dict] | None = None) -> nn.Module:
    """Hand each backend its decisions; returns the model (new only if the root was swapped). A plan made for other
    shapes is refused before any module is touched; with fsdp_float8_all_gather the model refuses to run until
    fully_shard has wrapped it (the weights it prepares are meant for FSDP's FP8 all-gather)."""
    state = _begin(model, "convert_fp8")
    check_plan_fits(model, plan.decisions, plan.model)
    if fsdp_float8_all_gather:
        _check_fp8_all_gather_recipes(plan)
    options = {name: dict(opts) for name, opts in (backend_options or {}).items()}
    if fsdp_float8_all_gather:
        options.setdefault("torchao", {})["enable_fsdp_float8_all_gather"] = True
    # bf16 last, so that its record names what runs each high-precision component once the others have fused some
    names = sorted(dict.fromkeys(d.backend for d in plan.decisions), key=lambda name: name == BF16)
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
        state.backends.append(backend)
        log.info("convert_fp8: %s ran %d component(s) (%s)", record.backend, len(record.converted), record.recipe)
    _stamp(model, state, "convert_fp8")
    if fsdp_float8_all_gather:
        model.__dict__["_fp8stack_needs_fsdp"] = model.register_forward_pre_hook(_refuse_unsharded)
    return model


def _refuse_unsharded(model: nn.Module, *_args) -> None:
    """Before the first forward of a model apply_fp8 prepared for FSDP's FP8 all-gather: it must be fully sharded."""
    if not isinstance(model, FSDPModule):
        raise OrderingError("apply_fp8(..., fsdp_float8_all_gather=True) prepared the weights for FSDP's FP8 "
                            "all-gather, and the model runs without fully_shard: apply_fsdp (after compile) before "
                            "training, or convert without fsdp_float8_all_gather")
    model.__dict__.pop("_fp8stack_needs_fsdp").remove()


# --- stage 2: tensor parallelism ---------------------------------------------------------------

def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: TensorParallelPlan) -> None:
    """Shard `model` over `tp_mesh` as `tp_plan` says. Each converted module gets its backend's style for the kind
    (torchao's Float8 styles for tensorwise Float8Linear, whose all-gathers move FP8; a region whose linears all run
    there gathers its input in FP8 too); other modules get torch's styles and move BF16. A backend that cannot shard
    its modules (TE: it shards itself) refuses. Every style is chosen before the first module is sharded."""
    state = _begin(model, "tensor_parallel")
    blocks = dict(_blocks(model))
    runner = {fqn: backend for backend, record in zip(state.backends, state.conversions, strict=True)
              for fqn in record.converted}
    styles = {fqn: _style(model, fqn, shard, runner, tp_mesh) for fqn, shard in tp_plan.outside.items()}
    for index in blocks:
        prefix = f"layers.{index}."
        styles |= {prefix + name: _style(model, prefix + name, shard, runner, tp_mesh)
                   for name, shard in tp_plan.block.items()}
    parallelize_module(model, tp_mesh, styles)
    _stamp(model, state, "tensor_parallel")


_TORCH_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel,
                 "prepare_input": PrepareModuleInput}


def _style(model: nn.Module, fqn: str, shard: ShardAs, runner: dict[str, Backend], mesh: DeviceMesh):
    """The style for the module at `fqn`: its backend's, else torch's."""
    if shard.kind not in SHARD_KINDS:
        raise ValueError(f"tensor-parallel plan: {fqn} is to be sharded as {shard.kind!r}: use one of "
                         f"{', '.join(SHARD_KINDS)}")
    module = model.get_submodule(fqn)
    inside = {f"{fqn}.{name}" if name else fqn for name, _ in module.named_modules()}
    backends = {runner[name].name: runner[name] for name in inside if name in runner}
    style = None
    if len(backends) == 1 and (shard.kind == "prepare_input" or fqn in runner):
        style = next(iter(backends.values())).tensor_parallel_style(module, shard.kind, mesh, **shard.layouts)
    return style or _TORCH_STYLES[shard.kind](**shard.layouts)


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
    refused = [reason for backend in state.backends if (reason := backend.refuse_recompute())]
    if refused:
        raise OrderingError(refused[0])
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
    runners = {fqn: cls for r in state.conversions if r.backend != BF16 for fqn, cls in r.converted.items()}
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
            _check_runs_inside(fqn, parent.get_submodule(name), runners)
            region = checkpoint_module(parent.get_submodule(name), fp8_active=fp8_active)
            parent.register_module(name, region)
            wrapped.append(f"{fqn} (TE LayerNormMLP's own recompute: not FC2)" if recomputes_itself(region) else fqn)
    log.info("recompute: checkpointing %s", ", ".join(wrapped))
    _stamp(model, state, "recompute")


def _check_runs_inside(fqn: str, module: nn.Module, runners: dict[str, str]) -> None:
    """A region the plan runs in FP8 by a module around it (an attention core, whose SDPA call its attention module
    sends to TE's FP8 attention) would be recomputed outside that module, so without FP8: refuse it."""
    if fqn in runners and not is_te_module(module) and runners[fqn] != type(module).__name__:
        raise ValueError(f"recompute_modules would checkpoint {fqn}, which runs in FP8 on {runners[fqn]} through the "
                         "module around it, so its recompute in backward would run without FP8: recompute 'attn' "
                         "(the whole attention) instead, or drop --fp8-dot-product-attention")


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

_DEFAULT_MP_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""FSDP2's mixed precision unless told otherwise: BF16 parameters for compute, gradients reduced (and micro-batch
gradients accumulated) in FP32."""


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               precompute_fp8_scales: bool = False, reshard_after_forward: bool | None = None) -> None:
    """fully_shard every block, then the root (embeddings, final norm and head go with the root).

    Before sharding, each backend readies what it converted (Backend.before_fully_shard: TE refuses fused wgrad
    accumulation and drops its FP8 weight cache, with a note, unless reshard_after_forward is False, which keeps
    both; after sharding, Backend.after_fully_shard), and the FP32 initial values of weights held in FP8 only are
    taken into the assembly state by parameter name (fully_shard's sharded parameters lose what TE keeps on the
    originals), for fp8stack.precision.ShardedMasterWeights. mp_policy defaults to BF16 parameters for compute
    and FP32 gradient reduction. precompute_fp8_scales: see post_optimizer_step_hook. reshard_after_forward: the
    blocks' (fully_shard's; None: torch's default, which reshards them)."""
    state = _begin(model, "fully_shard")
    mp_policy = mp_policy or _DEFAULT_MP_POLICY
    for backend, record in zip(state.backends, state.conversions, strict=True):
        try:
            record.notes += backend.before_fully_shard(model, mp_policy.param_dtype,
                                                       keeps_gathered=reshard_after_forward is False)
        except NotImplementedError as refused:
            raise OrderingError(str(refused)) from None
    by_id = {pid: value for backend in state.backends for pid, value in backend.take_master_values(model).items()}
    state.master_values |= {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}
    reshard = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    for _, block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, **reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, **reshard)
    for backend in state.backends:
        backend.after_fully_shard(model)
    log.info("fully_shard: %d blocks and the root over %d ranks", len(model.layers), mesh.size())
    _stamp(model, state, "fully_shard")
    _record_precompute(model, precompute_fp8_scales)


def post_optimizer_step_hook(model: nn.Module) -> Callable[..., None]:
    """The function to run after every optimizer step for what the backends converted (with torchao tensorwise
    weights all-gathered in FP8 under FSDP and precompute_fp8_scales: all their scales in one all-reduce); a function
    doing nothing when nothing needs it. Register it with optimizer.register_step_post_hook(hook), or call hook()
    after optimizer.step()."""
    hooks = [hook for backend in assembly_state(model).backends
             if (hook := backend.after_optimizer_step(model)) is not None]
    if not hooks:
        return _do_nothing

    def after_optimizer_step(*_optimizer_hook_args) -> None:
        for hook in hooks:
            hook()

    return after_optimizer_step


def _do_nothing(*_optimizer_hook_args) -> None:
    """The post-step hook of a model with nothing that changed weights invalidate."""


def after_checkpoint_load(model: nn.Module) -> None:
    """Call once a checkpoint's state is loaded into the assembled `model` (torch.distributed.checkpoint or
    load_state_dict in your own loop; fp8stack's trainer calls it), before its next forward: each backend rebuilds what
    its modules keep outside the model from the restored state (TE delayed scaling's amax registry, without which a
    resumed FSDP2 run parts from the uninterrupted one at its second step). Nothing to do for a model fp8stack did
    not assemble."""
    for backend in assembly_state(model).backends:
        backend.after_checkpoint_load(model)


def _add_note(model: nn.Module, backend: str, note: str) -> None:
    """Add `note` to the conversion record of `backend`, if it converted anything."""
    for record in assembly_state(model).conversions:
        if record.backend == backend:
            record.notes.append(note)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.float32: "FP32", torch.bfloat16: "BF16", None: "the parameters' dtype"}.get(dtype, str(dtype))


def _record_precompute(model: nn.Module, requested: bool) -> None:
    """Record whether the precompute runs; say so loudly when it was asked in vain."""
    state = assembly_state(model)
    applies = requested and any(b.after_optimizer_step(model) is not None for b in state.backends)
    if requested and not applies:
        message = ("precompute_fp8_scales=True has no effect: no weight is a torchao tensorwise Float8Linear weight "
                   "all-gathered in FP8 by FSDP. It needs fsdp_mesh, fsdp_float8_all_gather=True and torchao "
                   "tensorwise layers in the plan; otherwise drop precompute_fp8_scales")
        log.warning(message)
        warnings.warn(message, AssemblyWarning, stacklevel=3)
    state.precompute_fp8_scales = applies
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
