"""TransformerEngine backend: each planned nn.Linear becomes a te.pytorch.Linear, each planned
GroupedExperts two te.pytorch.GroupedLinear, and each of the plan's fusions one fused module: a norm with
the linears reading it one te.pytorch.LayerNormLinear (several linears merged into one GEMM whose output
is split back, fused.ProjectionSlice), a norm with the SwiGLU MLP reading it one te.pytorch.LayerNormMLP;
the norm's place is taken by fused.FoldedNorm, and the model's load_state_dict still takes its unfused keys
(fused.StateKeys). Every converted module runs its forward under its own te.pytorch.autocast (see
te_modules.py), so the BF16 parts of the model never enter one; a bf16 plan on te (recipe bf16, backend
te) gets the same modules with that autocast off. An attention core the plan puts in FP8 (fp8_attention) runs as
TE's FP8 dot-product attention: its attention module's SDPA calls go to a te.pytorch.DotProductAttention under the
recipe with fp8_dpa set (te_attention.py).

TransformerEngine and CUDA are looked up only when asked for: importing this module needs neither.
"""

import importlib.util
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from fp8stack.backends import fsdp_main_grads
from fp8stack.backends.base import Backend, BackendUnavailable, ConversionRecord, check_plan_fits, swap_module
from fp8stack.backends.fused import FoldedNorm, Part, StateKeys, merged_projections
from fp8stack.plan import Decision, Fusion, Plan, PlanError
from fp8stack.plan.description import NormFeed, SwiGLUFeed
from fp8stack.plan.recipes import BF16, BLOCKWISE_GEMMS, FP8_FORMATS, fp8_attention_recipes, get_recipe

INSTALL_HINT = "pip install 'fp8stack[te]' on a CUDA machine"
"""The fix for a machine without TransformerEngine."""

TE_RECIPES = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
"""fp8stack recipe name -> transformer_engine.common.recipe class."""

_SUPPORT_CHECKS = {
    "delayed": "is_fp8_available",
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}
"""fp8stack recipe name -> the transformer_engine.pytorch function that says whether this GPU runs it."""

DELAYED_AMAX_HISTORY_LEN = 1
DELAYED_AMAX_COMPUTE_ALGO = "most_recent"
"""megatron-core's defaults (TransformerConfig.fp8_amax_history_len / fp8_amax_compute_algo), not
TE's (1024, 'max'). They also keep per-module autocast exact: TE updates the amax history and scale
of every delayed-scaling module at each autocast exit, so with N modules a longer history would
receive N entries per step (N - 1 of them zero) and 'max' would see only len / N steps. With one
entry and 'most_recent', a module that did not run since its last update has amax 0, which TE
treats as "keep the scale", so each scale moves once per step, as under one model-wide autocast."""

FUSED_WGRAD_UNDER_FULLY_SHARD = (
    "te fuse_wgrad_accumulation writes weight gradients into FP32 main_grad buffers outside autograd, and fully_shard "
    "(FSDP2) reduce-scatters autograd's gradients; fp8stack hands those buffers to FSDP2 only where it keeps the "
    "gathered weights after forward (a full-size FP32 buffer per weight on every rank): pass "
    "fsdp_reshard_after_forward=False (--no-parallelism.fsdp-reshard-after-forward), use DDP "
    "(fp8stack.precision.MasterWeights(model, data_parallel=...)) or model_impl megatron, or turn "
    "fuse_wgrad_accumulation off (FSDP2 then accumulates micro-batch gradients in its reduce_dtype)")
"""Why TE's fused weight-gradient accumulation cannot run under a resharding fully_shard, and the fixes."""


def te_recipe(recipe_name: str, fp8_format: str, delayed_margin: int = 0, fp8_dpa: bool = False,
              reduce_amax: bool = True):
    """The TransformerEngine recipe object for an fp8stack recipe and format (needs TE installed); delayed scaling
    leaves 2^delayed_margin headroom (TE's margin; the other recipes have none) and, with reduce_amax False, keeps
    each process's amaxes its own (TEBackend.local_amax). fp8_dpa: TE's DotProductAttention under this recipe runs in
    FP8 (the plan's FP8 attention cores; TE's linears ignore it). None for bf16: the module runs without FP8."""
    _check_recipe_name(recipe_name)
    if recipe_name == BF16:
        return None
    if fp8_format not in FP8_FORMATS:
        raise PlanError(f"FP8 format {fp8_format!r} is not one TransformerEngine trains with: use "
                        f"{' or '.join(FP8_FORMATS)} (pure E5M2 training is not supported)")
    if fp8_dpa and get_recipe(recipe_name).fp8_attention_arch is None:
        raise PlanError(f"recipe {recipe_name!r} has no FP8 attention in TransformerEngine (Float8BlockScaling "
                        f"refuses fp8_dpa): use one of {fp8_attention_recipes()}")
    reason = _import_problem()
    if reason:
        raise BackendUnavailable(f"recipe {recipe_name!r} needs TransformerEngine: {reason}")
    from transformer_engine.common import recipe as te_recipes

    # TE 2.20 accepts E4M3 and HYBRID for all four recipes (each __post_init__ rejects only E5M2).
    fmt = {"e4m3": te_recipes.Format.E4M3, "hybrid": te_recipes.Format.HYBRID}[fp8_format]
    dpa = {"fp8_dpa": True} if fp8_dpa else {}
    if recipe_name == "delayed":
        return te_recipes.DelayedScaling(fp8_format=fmt, margin=delayed_margin,
                                         amax_history_len=DELAYED_AMAX_HISTORY_LEN,
                                         amax_compute_algo=DELAYED_AMAX_COMPUTE_ALGO, reduce_amax=reduce_amax, **dpa)
    return getattr(te_recipes, TE_RECIPES[recipe_name])(fp8_format=fmt, **dpa)


@dataclass
class TEBackend(Backend):
    """TransformerEngine modules for the components a plan assigns to `te`, and the plan's fusions on te."""

    delayed_margin: int = 0
    """Headroom of delayed-scaling scales below the FP8 maximum, as a power of 2 (Megatron's --fp8-margin)."""
    cache_fp8_weights: bool = True
    """Cast each weight to FP8 at the first forward after an optimizer step (any torch.optim optimizer's) or a write to
    the weight, and reuse that copy for the step's other micro-batches (TE's is_first_microbatch, as megatron drives
    it): one cast per step instead of one per micro-batch. The copies stay allocated between steps; off for weights
    held in FP8 (nothing to cast) and under fully_shard unless it keeps the gathered weights after forward
    (before_fully_shard says why)."""
    fuse_wgrad_accumulation: bool | None = None
    """Each TE weight-gradient GEMM accumulates into the weight's FP32 main_grad, which is its .grad (TE's
    fuse_wgrad_accumulation, Megatron's --gradient-accumulation-fusion): no BF16 weight gradient, no BF16 -> FP32
    copy and no add per micro-batch. Needs FP32 weights on the GPU, and one process or fp8stack.precision's DDP
    (MasterWeights / DataParallelGradients with data_parallel average the main_grads); not under fully_shard.
    None: on where it can be (FP32 weights on the GPU, no process group of several ranks), with a note."""
    blockwise_gemms: str = "te"
    """Where the blockwise (Float8BlockScaling) modules' GEMMs run: te (cuBLAS) or deepgemm (DeepGEMM's dense
    kernels on TE's operands, bit-identical; fp8stack.backends.te_deepgemm). Quantization stays TE's."""
    fp8_weights: bool = False
    """The FP8 modules hold their weights in FP8 only (TE quantized_model_init, Megatron's --fp8-param-gather): no
    high-precision copy, and no cast in forward. For a trainer whose optimizer steps FP32 masters (take_master_values
    gives their initial values) and copies them into these weights after each step, which quantizes them
    (fp8stack.precision.MasterWeights). Dense linears, LayerNormLinear and LayerNormMLP; not GroupedLinear experts."""
    one_autocast_per_forward: bool = False
    """Delayed scaling: one TE autocast region around each forward of the model (te_modules.ModelAutocast, hooked on
    the root) instead of one per module, so TE reduces and updates amaxes and scales once per forward and once per
    backward instead of once per module in each. Modules of other recipes (and without FP8) still open their own.
    Refuses activation recompute (refuse_recompute). Off: measured no faster (TEConfig in fp8stack.config names the
    runs)."""
    local_amax: bool | None = None
    """Delayed scaling: each process keeps its own amaxes and scales (TE DelayedScaling reduce_amax=False, what
    Megatron's --tp-only-amax-red does without tensor parallelism). Otherwise TE all-reduces the amaxes over all
    processes at the end of every module's forward and backward: a collective per module and pass, which holds the
    ranks in step. Replicas (DDP) and BF16 weights gathered by fully_shard quantize whole weights and need no common
    scale; weights held in FP8 and sharded by fully_shard do (each all-gathered weight carries one scale), so
    before_fully_shard refuses the two together. None: local unless fp8_weights (keeps_amax_local)."""

    _kept_caches: list[tuple[nn.Module, tuple[str, ...]]] = field(default_factory=list, init=False, repr=False)
    """Between before_fully_shard and after_fully_shard: each module whose cache stays on with the gathered weights
    kept, and its cached weights' names, for re-keying the cache to the sharded parameters."""

    _main_grad_writers: list[tuple[nn.Module, str]] = field(default_factory=list, init=False, repr=False)
    """Between before_fully_shard and after_fully_shard: (module, parameter name) of each weight whose TE module
    accumulates its weight gradient into main_grad under fully_shard."""

    name: ClassVar[str] = "te"

    @property
    def keeps_amax_local(self) -> bool:
        """local_amax as resolved: None keeps amaxes per process unless the weights are held in FP8, whose shards may
        be all-gathered under one scale (the backend cannot know whether fully_shard will follow; assemble, which
        does, keeps them local when it will not)."""
        return self.local_amax if self.local_amax is not None else not self.fp8_weights

    @classmethod
    def prepare_process(cls) -> None:
        """Import TE now, when installed and CUDA is visible: TE loads the system cuDNN, which fails (undefined cuDNN
        symbols, seen on an H200) once torch has loaded its own copy for a cuDNN or attention kernel."""
        _import_problem()

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        """(True, '') when TE imports with CUDA here and this GPU runs every FP8 recipe in `recipes`; else why.
        Only FP8 recipes ask for FP8 support: a bf16 plan on te runs on a GPU without it."""
        reason = _import_problem()
        if reason:
            return False, reason
        import transformer_engine.pytorch as te

        for recipe, check in _support_checks(recipes).items():
            ok, why = getattr(te, check)(return_reason=True)
            if not ok:
                return False, f"TransformerEngine cannot run recipe {recipe!r} on this GPU: {why}"
        return True, ""

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        """Swap each planned Linear / GroupedExperts for its TE module and run the plan's te fusions, weights copied
        bit-exactly. Everything is checked and built before the first swap, so a refused plan leaves the model
        untouched."""
        record = ConversionRecord(backend=self.name)
        if not decisions:
            return model, record
        linears, expert_pairs, cores, recipes = _validated(decisions, plan)
        check_plan_fits(model, decisions, plan.model)
        fusions = [f for f in plan.fusions if f.backend == self.name]
        if self.fp8_weights and expert_pairs:
            raise PlanError(f"fp8_weights holds dense TE linears' weights in FP8, and the plan runs experts on TE "
                            f"({next(iter(expert_pairs))}): keep high-precision weights for MoE models (param_dtype "
                            "bf16) or plan the experts on another backend")
        if self.delayed_margin and "delayed" not in recipes:
            raise PlanError(f"delayed_margin={self.delayed_margin} applies to delayed scaling, and the plan's TE "
                            f"recipes are {', '.join(recipes)}: drop the margin or plan recipe delayed")
        ok, reason = self.available(recipes)
        if not ok:
            raise BackendUnavailable(f"the plan for {plan.model} runs {len(decisions)} component(s) on "
                                     f"TransformerEngine, but {reason}")
        gemm_library = self._blockwise_gemm_library(recipes)
        from fp8stack.backends import te_attention, te_modules

        # One recipe object per name, fp8_dpa set where attention runs under it: TE updates delayed-scaling amaxes by
        # recipe, and the FP8 attention's own autocast holds no linear, so its backward scales move at the backward
        # of the linears sharing its recipe (wqkv's, right after it).
        attention_recipes = {d.recipe for d in cores}
        te_recipes = {name: te_recipe(name, plan.fp8_format, self.delayed_margin, fp8_dpa=name in attention_recipes,
                                      reduce_amax=not self.keeps_amax_local) for name in recipes}
        wgrad_fusion, wgrad_note = self._wgrad_fusion(model, decisions)
        options = {"cache_weights": self.cache_fp8_weights and not self.fp8_weights,
                   "fuse_wgrad_accumulation": wgrad_fusion, **({"fp8_weights": True} if self.fp8_weights else {})}
        shared = _shared_parameters(model)
        swaps = []  # (fqn to swap, factory of its new module, plan fqns it then runs)
        keys = []  # (fused state-dict key, the user's parts it holds)
        for fusion in fusions:
            fused_swaps, fused_keys = _fusion_swaps(model, fusion, te_recipes[fusion.recipe], options, shared, linears)
            swaps += fused_swaps
            keys += fused_keys
        in_fusions = {fqn for f in fusions for fqn in f.feed.linears}
        for d in (d for d in linears if d.fqn not in in_fusions):
            linear = _checked(_linear_at(model, d), d.fqn, shared)
            swaps.append((d.fqn, partial(te_modules.linear_from, linear, te_recipes[d.recipe], name=d.fqn,
                                          **options), (d.fqn,)))
        for module_fqn, (w13, w2) in expert_pairs.items():
            grouped = _checked(_grouped_experts_at(model, module_fqn), module_fqn, shared)
            swaps.append((module_fqn, partial(te_modules.grouped_experts_from, grouped, te_recipes[w13.recipe],
                                              name=module_fqn, cache_weights=options["cache_weights"],
                                              fuse_wgrad_accumulation=wgrad_fusion),
                          (w13.fqn, w2.fqn)))
        # Build every module before swapping any: a module refused while built leaves the model as it was.
        built = [(fqn, factory(), runs) for fqn, factory, runs in swaps]
        attentions = _fp8_attentions(model, cores, te_recipes)
        for fqn, new, runs in built:
            model = swap_module(model, fqn, new)
            if not isinstance(new, FoldedNorm):
                record.converted.update(dict.fromkeys(runs, _runner_name(new)))
        for core, (owner, attention) in attentions.items():
            te_attention.install_fp8_attention(owner, attention)
            record.converted[core] = type(attention).__name__
        state_keys = StateKeys.of(model) if keys else None
        for fused_key, parts in keys:
            state_keys.add(fused_key, parts)
        record.recipe = ", ".join(recipes)
        record.notes += self._notes(model, fusions, built, gemm_library, wgrad_note, recipes)
        if self.one_autocast_per_forward:
            record.notes.append(self._one_autocast(model, te_recipes.get("delayed")))
        if attentions:
            record.notes.append(f"fp8_attention: {len(attentions)} attention module(s) send their "
                                "F.scaled_dot_product_attention calls to TE's FP8 dot-product attention "
                                f"(DotProductAttention, bshd, fp8_dpa under {', '.join(sorted(attention_recipes))})")
        return model, record

    @staticmethod
    def _one_autocast(model: nn.Module, delayed) -> str:
        """Hook one delayed-scaling autocast region around the model's forward (one_autocast_per_forward); the note."""
        if delayed is None:
            return ("one_autocast_per_forward: no delayed-scaling module, whose amax updates it would batch: each "
                    "module keeps its own autocast")
        from fp8stack.backends import te_modules

        te_modules.ModelAutocast(delayed).install(model)
        return ("one_autocast_per_forward: the delayed-scaling modules run in one TE autocast region per forward of "
                f"{type(model).__name__}: one amax and scale update per forward and one per backward")

    def refuse_recompute(self) -> str | None:
        if self.one_autocast_per_forward:
            return ("te one_autocast_per_forward runs the delayed-scaling modules in one autocast region per forward, "
                    "and a recompute in backward would run them outside it: drop activation recompute or "
                    "one_autocast_per_forward")
        return None

    def _notes(self, model: nn.Module, fusions: list[Fusion], built: list, gemm_library, wgrad_note: str,
               recipes: list[str]) -> list[str]:
        notes = []
        if gemm_library is not None:
            notes.append(_routed_to(gemm_library))
        if "delayed" in recipes:
            notes.append(f"delayed: TE DelayedScaling with amax history {DELAYED_AMAX_HISTORY_LEN} and "
                         f"'{DELAYED_AMAX_COMPUTE_ALGO}' (megatron-core defaults), margin {self.delayed_margin}, so "
                         "one FP8 autocast per module updates each scale once per step, as one model-wide autocast "
                         "would" + ("; amaxes kept per process (local_amax: no all-reduce per module and pass)"
                                    if self.keeps_amax_local else ""))
        cached = sum(1 for _, m, _ in built if getattr(m, "cached_weights", ()))
        if cached:
            notes.append(f"cache_fp8_weights: {cached} module(s) cast their weights to FP8 once per optimizer step and "
                         "reuse the copy for the step's other micro-batches (TE is_first_microbatch)")
        if self.fp8_weights:
            count = sum(1 for p in model.parameters() if hasattr(p, "get_high_precision_init_val"))
            notes.append(f"fp8_weights: {count} TE weight(s) held in FP8 only (quantized_model_init); the "
                         "optimizer's FP32 masters are quantized into them after each step")
        if wgrad_note:
            count = sum(len(getattr(m, "main_grad_weights", ())) for m in model.modules())
            notes.append(wgrad_note.format(count=count))
        layernorm_linears = [f for f in fusions if isinstance(f.feed, NormFeed)]
        if layernorm_linears:
            merged = sum(len(f.feed.linears) > 1 for f in layernorm_linears)
            notes.append(f"fused norms: {len(layernorm_linears)} norm(s) folded into TE LayerNormLinear (e.g. "
                         f"{layernorm_linears[0].feed.norm} into {layernorm_linears[0].module}), {merged} of them "
                         "over projections merged into one GEMM; the norms' places run fused.FoldedNorm")
        mlps = [f for f in fusions if isinstance(f.feed, SwiGLUFeed)]
        if mlps:
            notes.append(f"fused MLPs: {len(mlps)} norm + SwiGLU MLP(s) run as TE LayerNormMLP (e.g. {mlps[0].module})")
        if any(f.recipe == "delayed" for f in mlps):
            from fp8stack import patches

            notes.append(f"fused MLPs, delayed: {patches.apply_patch('fp8stack.patches.te_swiglu_fp8_dgrad')} "
                         "(patches/te_swiglu_fp8_dgrad.py)")
        return notes

    def _wgrad_fusion(self, model: nn.Module, decisions: list[Decision]) -> tuple[bool, str]:
        """(fuse_wgrad_accumulation in force, the note saying so): as set, or where it can be when None."""
        if self.fuse_wgrad_accumulation is False:
            return False, ""
        if self.fuse_wgrad_accumulation:
            return True, ("fuse_wgrad_accumulation: the weight-gradient GEMMs of {count} TE weight(s) accumulate into "
                          "FP32 main_grad buffers, which are the weights' .grad")
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        params = [p for d in decisions if d.component.kind != "attn_core" for p in _parameters_at(model, d.fqn)]
        dtypes, devices = {p.dtype for p in params}, {p.device.type for p in params}
        if ranks > 1 or dtypes != {torch.float32} or devices != {"cuda"}:
            why = (f"this process group has {ranks} ranks, and a data-parallel wrapper may reduce .grad without "
                   "main_grad: pass fuse_wgrad_accumulation=True where fp8stack.precision's DDP (MasterWeights or "
                   "DataParallelGradients with data_parallel) averages the main_grads" if ranks > 1
                   else f"the weights are {', '.join(sorted(map(str, dtypes)))} on {', '.join(sorted(devices))}, "
                        "and main_grad needs FP32 weights on the GPU")
            return False, f"fuse_wgrad_accumulation (auto): off, {why}"
        return True, ("fuse_wgrad_accumulation (auto): on; the weight-gradient GEMMs of {count} TE weight(s) accumulate "
                      "into FP32 main_grad buffers, which are the weights' .grad")

    def after_checkpoint_load(self, model: nn.Module) -> None:
        """Its delayed-scaling modules in `model` join TE's amax registry with their restored state now, as in the
        uninterrupted process, not at their first forward (te_modules._WeightCache.register_restored_scaling_state
        says why)."""
        from fp8stack.backends import te_modules

        te_modules.register_restored_scaling_states(model)

    def take_master_values(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """The FP32 values each weight held in FP8 only (fp8_weights) was quantized from, on the CPU: TE keeps them
        from the module's construction (preserve_high_precision_init_val) and frees its copy here."""
        values = {}
        for param in model.parameters():
            value = param.get_high_precision_init_val() if hasattr(param, "get_high_precision_init_val") else None
            if value is not None:
                values[id(param)] = value
                param.clear_high_precision_init_val()
        return values

    def refuse_wrappers(self, *, tensor_parallel: bool, fully_shard: bool, keeps_gathered: bool = False) -> str | None:
        """fuse_wgrad_accumulation's FP32 main_grad buffers are neither sharded nor reduced by tensor parallelism, and
        are reduced by fully_shard only where it keeps the gathered weights (before_fully_shard)."""
        if self.fuse_wgrad_accumulation and tensor_parallel:
            return ("te fuse_wgrad_accumulation accumulates weight gradients into FP32 main_grad buffers, which tensor "
                    "parallelism does not shard or reduce: train one process, use model_impl megatron (its DDP reduces "
                    "main_grad), or turn it off")
        if self.fuse_wgrad_accumulation and fully_shard and not keeps_gathered:
            return FUSED_WGRAD_UNDER_FULLY_SHARD
        return None

    def before_fully_shard(self, model: nn.Module, gathered_dtype: torch.dtype | None, *,
                           keeps_gathered: bool = False) -> list[str]:
        """Refuse modules accumulating weight gradients into main_grad unless keeps_gathered
        (FUSED_WGRAD_UNDER_FULLY_SHARD; _keep_main_grads) and modules without FP8 whose weights would be gathered in
        FP32 (_unsaved_under_fully_shard), and switch the FP8 weight cache off unless keeps_gathered (_keep_caches).
        Under FSDP2, TE skips its own FP8 weight workspace (a module in an FSDP2 tree casts the all-gathered weight at
        every forward and again in backward, so that no full-size FP8 copy stays resident): is_first_microbatch would
        save no cast, and the cache's key would keep each module's pre-shard, full-size weights alive after
        fully_shard replaced them."""
        fused = [module for module in model.modules() if getattr(module, "main_grad_weights", ())]
        if fused and not keeps_gathered:
            raise NotImplementedError(FUSED_WGRAD_UNDER_FULLY_SHARD)
        unsaved = _unsaved_under_fully_shard(model, gathered_dtype)
        if unsaved:
            raise NotImplementedError(
                f"{unsaved} runs on a TE module without FP8 whose weight fully_shard would all-gather in FP32: TE "
                "under fully_shard keeps no copy of such a weight cast for BF16 compute and rebuilds it in the "
                "backward with an FP8 quantizer this module lacks, so its input-gradient GEMM fails. Gather in BF16 "
                "(MixedPrecisionPolicy(param_dtype=torch.bfloat16), the default) or keep it off TE "
                "(PolicyConfig(head_on_te=False) for the head)")
        if self.keeps_amax_local and self.fp8_weights:
            raise NotImplementedError("te local_amax keeps each process's delayed-scaling scales its own, and "
                                      "fully_shard all-gathers each FP8 weight's shards under one scale: drop "
                                      "local_amax (TE then reduces the amaxes over the ranks) or fp8_weights")
        notes = self._keep_main_grads(fused) if fused else []
        cached = [module for module in model.modules() if getattr(module, "cached_weights", ())]
        if cached and keeps_gathered:
            return notes + self._keep_caches(cached)
        for module in cached:
            module.cached_weights = ()
        if not cached:
            return notes
        return notes + [f"cache_fp8_weights: off for {len(cached)} module(s) under fully_shard: TE casts each "
                        "all-gathered weight at every forward and in backward there (it keeps no full-size FP8 copy), "
                        "so the cache would save no cast and would keep the pre-shard weights alive"]

    def _keep_caches(self, cached: list[nn.Module]) -> list[str]:
        """With the gathered weights kept over the step's micro-batches, a full-size copy of every weight is resident
        anyway: the cached modules' TE modules are told they are not under FSDP2 (TE's cached is_fsdp2, which its
        Linear, LayerNormLinear and LayerNormMLP read), so that TE keeps its FP8 weight workspace as without
        fully_shard: cast at a step's first forward, reused by the other micro-batches and by backward, instead of a
        cast at every forward and another in every backward. The cache's key lets go of the pre-shard weights until
        after_fully_shard re-keys it to the sharded ones."""
        for module in cached:
            names = {id(weight): name for name, weight in module.named_parameters()}
            self._kept_caches.append((module, tuple(names[id(weight)] for weight in module.cached_weights)))
            module.cached_weights = ()
            for te_module in module.modules():
                if isinstance(getattr(type(te_module), "is_fsdp2", None), property):
                    te_module._is_fsdp2 = False
        return [f"cache_fp8_weights: on for {len(cached)} module(s) under fully_shard with the gathered weights kept "
                "after forward (reshard_after_forward=False): TE keeps an FP8 copy of each gathered weight and its "
                "transpose (2 bytes per weight element on every rank, beside the gathered BF16 weights), cast once a "
                "step instead of at every micro-batch's forward and backward"]

    def _keep_main_grads(self, fused: list[nn.Module]) -> list[str]:
        """With the gathered weights kept over the step: the fused modules' weights keep TE's fused weight-gradient
        accumulation, into FP32 buffers that after_fully_shard hands to FSDP2 (fp8stack.backends.fsdp_main_grads);
        their pre-shard main_grads are let go of."""
        fsdp_main_grads.check_fsdp2()
        for module in fused:
            owners = {id(weight): (owner, name) for owner in module.modules()
                      for name, weight in owner.named_parameters(recurse=False)}
            for weight in module.main_grad_weights:
                self._main_grad_writers.append(owners[id(weight)])
                del weight.main_grad
            module.main_grad_weights = ()
        return [f"fuse_wgrad_accumulation: on for {len(self._main_grad_writers)} weight(s) under fully_shard with the "
                "gathered weights kept after forward: TE's weight-gradient GEMMs accumulate into FP32 buffers that "
                "FSDP2 reduce-scatters, as its own accumulators (4 bytes per parameter of those blocks, unsharded, on "
                "every rank)"]

    def after_fully_shard(self, model: nn.Module) -> None:
        """Re-key the caches _keep_caches kept to the sharded weights, which an optimizer step or a checkpoint load
        writes, and hand the _keep_main_grads weights' FP32 accumulators to FSDP2."""
        for module, names in self._kept_caches:
            weights = dict(module.named_parameters())
            module.cached_weights = tuple(weights[name] for name in names)
            module._cast_at = None
        self._kept_caches.clear()
        if self._main_grad_writers:
            fsdp_main_grads.install(model, self._main_grad_writers)
            self._main_grad_writers.clear()

    def hand_over_main_grads(self, model: nn.Module) -> None:
        """TE modules with fuse_wgrad_accumulation point their weights' .grad at main_grad at a step's first forward,
        which a BF16 parameter cannot take: from now on the master weights own those buffers."""
        for module in model.modules():
            if getattr(module, "main_grad_weights", ()):
                module.main_grad_weights = ()

    def tensor_parallel_style(self, module: nn.Module, kind: str, mesh, **layouts):
        raise NotImplementedError("fp8stack's tensor parallelism cannot shard TransformerEngine modules: TE does tensor "
                                  "parallelism itself (tp_group, sequence_parallel). Build the model with the Megatron "
                                  "factory (fp8stack.megatron) and --tensor-model-parallel-size instead")

    def route_blockwise_gemms(self) -> str:
        """With blockwise_gemms deepgemm: every TE blockwise GEMM of this process (megatron's TE modules' too) runs on
        DeepGEMM from now on; returns the note saying so (nothing to do for te)."""
        library = self._blockwise_gemm_library(["blockwise"])
        return _routed_to(library) if library is not None else ""

    def _blockwise_gemm_library(self, recipes: list[str]):
        """deep_gemm when blockwise_gemms is deepgemm (None for te); refuses a plan without blockwise or no DeepGEMM."""
        if self.blockwise_gemms not in BLOCKWISE_GEMMS:
            raise PlanError(f"blockwise_gemms={self.blockwise_gemms!r}: use {' or '.join(BLOCKWISE_GEMMS)}")
        if self.blockwise_gemms == "te":
            return None
        if "blockwise" not in recipes:
            raise PlanError(f"blockwise_gemms=deepgemm moves the blockwise modules' GEMMs, and the plan's TE recipes "
                            f"are {', '.join(recipes)}: plan recipe blockwise or drop --blockwise-gemms")
        from fp8stack.backends import te_deepgemm

        return te_deepgemm.load_library()


def _fusion_swaps(model: nn.Module, fusion: Fusion, recipe, options: dict, shared: set[int],
                  linears: list[Decision]) -> tuple[list, list]:
    """(swaps, state keys) running `fusion` as one TE module: its norm's place becomes a FoldedNorm; a LayerNormMLP
    takes the MLP module's place, a LayerNormLinear a lone linear's, ProjectionSlices several merged linears'."""
    from fp8stack.backends import te_modules

    feed = fusion.feed
    planned = {d.fqn: d for d in linears}
    modules = {fqn: _checked(_linear_at(model, planned[fqn]), fqn, shared) for fqn in feed.linears}
    norm_module = _checked(_module_at(model, feed.norm), feed.norm, shared)
    norm = te_modules.Norm(feed.normalization, feed.eps, norm_module)
    norm_parts = [(name, [Part(f"{feed.norm}.{name}", 0, p.shape[0])])
                  for name, p in (("weight", norm_module.weight), ("bias", getattr(norm_module, "bias", None)))
                  if isinstance(p, torch.Tensor)]
    swaps = [(feed.norm, partial(FoldedNorm, fusion.module), (feed.norm,))]
    if isinstance(feed, SwiGLUFeed):
        gate, up = (modules[r.fqn].weight[r.start:r.stop] for r in (feed.gate, feed.up))
        down = modules[feed.down]
        if any(modules[fqn].bias is not None for fqn in feed.linears):
            raise PlanError(f"{feed.module}: TE LayerNormMLP runs bias-free SwiGLU projections and these have biases: "
                            "pass fuse_mlp=False to the policy")
        _checked(_module_at(model, feed.module), feed.module, shared)
        swaps.append((feed.module, partial(te_modules.layernorm_mlp_from, norm, gate, up, down, recipe, name=feed.module,
                                           **options), feed.linears))
        keys = [(f"{feed.module}.fc1_weight", [Part(f"{r.fqn}.weight", r.start, r.stop) for r in (feed.gate, feed.up)]),
                (f"{feed.module}.fc2_weight", [Part(f"{feed.down}.weight", 0, down.out_features)])]
        norm_prefix = f"{feed.module}.layer_norm_"
        return swaps, keys + [(norm_prefix + name, parts) for name, parts in norm_parts]
    group = [modules[fqn] for fqn in feed.linears]
    build = partial(te_modules.layernorm_linear_from, norm, group, recipe, name=fusion.module, **options)
    if len(group) == 1:
        swaps.append((fusion.module, build, feed.linears))
        owner = fusion.module
        keys = []
    else:  # built now, so that the slices can share it; the model is not touched before every module is built
        slices = merged_projections(build(), group)
        swaps += [(fqn, lambda piece=piece: piece, (fqn,)) for fqn, piece in zip(feed.linears, slices)]
        owner = f"{fusion.module}.fused"
        keys = [(f"{owner}.{name}", [Part(f"{fqn}.{name}", 0, m.out_features) for fqn, m in modules.items()])
                for name in ("weight", "bias") if getattr(group[0], name) is not None]
    return swaps, keys + [(f"{owner}.layer_norm_{name}", parts) for name, parts in norm_parts]


def _unsaved_under_fully_shard(model: nn.Module, gathered_dtype: torch.dtype | None) -> str | None:
    """The first TE module without FP8 (autocast_recipe None: a bf16 decision on te, e.g. the head with head_on_te)
    whose weights fully_shard would all-gather in FP32, by name; None when there is none. TE 2.20 under fully_shard
    saves no weight for the backward and re-casts it there with the module's FP8 quantizer, which exists only with
    FP8; a BF16-gathered weight needs no cast and is saved as it is."""
    for name, module in model.named_modules():
        if getattr(module, "autocast_recipe", True) is None and any(
                (gathered_dtype or p.dtype) == torch.float32 for p in module.parameters(recurse=False)):
            return name
    return None


def _routed_to(library) -> str:
    from fp8stack.backends import te_deepgemm

    te_deepgemm.route_blockwise_gemms(library)
    return te_deepgemm.ROUTED_NOTE


def _runner_name(module: nn.Module) -> str:
    """The class that runs a converted component: the fused module's for a slice of a merged GEMM."""
    shared = getattr(module, "_shared", None)
    return type(shared.fused).__name__ if shared is not None else type(module).__name__


def _parameters_at(model: nn.Module, fqn: str) -> list[nn.Parameter]:
    owner, _, leaf = fqn.rpartition(".")
    try:
        module = model.get_submodule(fqn)
    except AttributeError:  # an expert half (<experts>.w13): the parameter of its module
        return [getattr(model.get_submodule(owner), leaf)]
    return list(module.parameters())


def _validated(decisions: list[Decision], plan: Plan) -> tuple[list[Decision], dict, list[Decision], list[str]]:
    """(linear decisions, GroupedExperts fqn -> (w13, w2) decisions, FP8 attention cores, recipe names), or
    PlanError."""
    strays = [d.fqn for d in decisions if d.backend != "te"]
    if strays:
        raise ValueError(f"TEBackend.convert got decisions planned for other backends: {strays[:3]}")
    cores = [d for d in decisions if d.component.kind == "attn_core" and d.recipe != BF16]
    others = [d for d in decisions if d.component.kind not in ("linear", "expert") and d not in cores
              and not (d.component.kind == "head" and d.recipe == BF16)]
    if others:
        raise PlanError(f"{others[0].fqn}: the te backend converts linear and expert components, the output head "
                        f"without FP8 and attention cores in FP8, not kind {others[0].component.kind!r} in "
                        f"{others[0].recipe}: run it in bf16")
    recipes = sorted({d.recipe for d in decisions})
    for recipe in recipes:
        _check_recipe_name(recipe)
    gemm_recipes = {d.recipe for d in decisions if d.component.kind in ("linear", "expert")}
    for recipe in sorted({d.recipe for d in cores} - gemm_recipes):
        if get_recipe(recipe).scales_from_history:
            raise PlanError(f"the plan runs attention in {recipe} FP8 with no {recipe} linear on TE, and TE updates "
                            "delayed-scaling backward scales at a linear's backward only, so the attention's gradient "
                            f"scales would stay 1: plan some linears {recipe} too, or keep attention BF16")
    linears = [d for d in decisions if d.component.kind in ("linear", "head")]
    return linears, _expert_pairs([d for d in decisions if d.component.kind == "expert"], plan), cores, recipes


def _fp8_attentions(model: nn.Module, cores: list[Decision], te_recipes: dict) -> dict:
    """Core fqn -> (its attention module, the TE FP8 attention built for it): the module that holds the core, the
    plan's `<attention module>.core`, found by the plan's fqn as describe_module named it."""
    from fp8stack.backends import te_attention

    attentions = {}
    for d in cores:
        owner_fqn = d.fqn.rpartition(".")[0]
        owner = _module_at(model, owner_fqn)
        if not (hasattr(owner, "n_heads") and hasattr(owner, "head_dim")):
            raise PlanError(f"the plan runs {d.fqn} as FP8 attention, but {owner_fqn} ({type(owner).__name__}) has no "
                            "n_heads and head_dim, which mark an attention module: derive the plan from this model")
        if owner.head_dim != d.component.k:
            raise PlanError(f"the plan sizes {d.fqn} with head dim {d.component.k}, but {owner_fqn}'s is "
                            f"{owner.head_dim}: make the plan from this model (describe_module)")
        attentions[d.fqn] = (owner, te_attention.fp8_attention_for(owner, te_recipes[d.recipe], owner_fqn))
    return attentions


def _support_checks(recipes: Sequence[str]) -> dict[str, str]:
    """FP8 recipe of `recipes` -> the transformer_engine.pytorch function that says whether this GPU runs it;
    bf16 needs none (TE's modules without FP8). PlanError for a recipe TE does not have."""
    for recipe in recipes:
        _check_recipe_name(recipe)
    return {recipe: _SUPPORT_CHECKS[recipe] for recipe in recipes if recipe != BF16}


def _import_problem() -> str:
    """'' when transformer_engine.pytorch imports and CUDA is visible, else the reason and the fix."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"TransformerEngine is not installed: {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "TransformerEngine needs CUDA, and torch.cuda.is_available() is False: run on a GPU machine"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a native-library load failure surfaces as OSError, RuntimeError, ...
        if "cudnn" in str(err).lower() and _loaded_libraries("libcudnn"):
            return (f"TransformerEngine failed to load cuDNN ({type(err).__name__}: {err}) because this process had "
                    "already loaded PyTorch's cuDNN, for a cuDNN or attention kernel that ran before TE was imported: "
                    "import transformer_engine.pytorch or fp8stack.assembly before running any model (import fp8stack "
                    "does it only when torch was imported before it)")
        return (f"TransformerEngine is installed but fails to import ({type(err).__name__}: {err}): "
                f"reinstall it for torch {torch.__version__} with {INSTALL_HINT}")
    return ""


def _loaded_libraries(prefix: str) -> list[str]:
    """Shared libraries of this process whose file name starts with `prefix` (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({Path(path).name for path in re.findall(r"\s(/\S+)$", maps, re.MULTILINE)
                   if Path(path).name.startswith(prefix)})


def _check_recipe_name(recipe_name: str) -> None:
    if recipe_name != BF16 and recipe_name not in TE_RECIPES:
        raise PlanError(f"recipe {recipe_name!r} has no TransformerEngine implementation: use one of "
                        f"{', '.join(TE_RECIPES)}, or run it with --backend torchao")


def _module_at(model: nn.Module, fqn: str) -> nn.Module:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise PlanError(f"the plan names {fqn!r}, which is not a module of this {type(model).__name__}: "
                        "derive the plan from this model (or fix the model description)") from None


def _linear_at(model: nn.Module, d: Decision) -> nn.Linear:
    module = _module_at(model, d.fqn)
    if type(module) is not nn.Linear:
        raise PlanError(f"{d.fqn} is a {type(module).__name__}, and the te backend converts plain nn.Linear "
                        "only (a subclass may change what forward does): run it in bf16 or make it nn.Linear")
    _check_device(module.weight, d.fqn)
    return module


def _grouped_experts_at(model: nn.Module, fqn: str) -> nn.Module:
    """The GroupedExperts at `fqn` (check_plan_fits has compared its parameters with the plan)."""
    from fp8stack.models.moe import GroupedExperts

    module = _module_at(model, fqn)
    if not isinstance(module, GroupedExperts):
        raise PlanError(f"{fqn} is a {type(module).__name__}; the te backend converts "
                        "fp8stack.models.moe.GroupedExperts (w13 [E, 2F, D], w2 [E, D, F]) only")
    _check_device(module.w13, fqn)
    return module


def _expert_pairs(experts: list[Decision], plan: Plan) -> dict[str, tuple[Decision, Decision]]:
    """GroupedExperts fqn -> (w13, w2) decisions; both halves must be te with one recipe."""
    halves: dict[str, dict[str, Decision]] = defaultdict(dict)
    for d in experts:
        module_fqn, _, half = d.fqn.rpartition(".")
        if half not in ("w13", "w2"):
            raise PlanError(f"{d.fqn}: expert components are named <experts module>.w13 / .w2")
        halves[module_fqn][half] = d
    pairs = {}
    for module_fqn, found in halves.items():
        ends = {half: found.get(half) or plan.decision(f"{module_fqn}.{half}") for half in ("w13", "w2")}
        w13, w2 = ends["w13"], ends["w2"]
        if (w13.backend, w13.recipe) != (w2.backend, w2.recipe):
            raise PlanError(f"{module_fqn}: w13 runs on {w13.backend}/{w13.recipe} but w2 on {w2.backend}/{w2.recipe}; "
                            f"the experts convert as one module: give both one backend and recipe "
                            f"(an override with fqn '{module_fqn}.*')")
        pairs[module_fqn] = (w13, w2)
    return pairs


def _check_device(weight: torch.Tensor, fqn: str) -> None:
    if weight.device.type not in ("cuda", "meta"):
        raise BackendUnavailable(f"{fqn} has its weights on {weight.device}; TransformerEngine modules live on "
                                 "CUDA: move the model to the GPU (or build it on 'meta') before converting")


def _shared_parameters(model: nn.Module) -> set[int]:
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {pid for pid, n in counts.items() if n > 1}


def _checked(module: nn.Module, fqn: str, shared: set[int]) -> nn.Module:
    """`module`, unless one of its parameters is also another module's (tied weights)."""
    if any(id(p) in shared for p in module.parameters()):
        raise PlanError(f"{fqn} shares a parameter with another module (tied weights); converting it would "
                        "untie them: keep it in bf16 with an override")
    return module
