"""TransformerEngine backend: each planned nn.Linear becomes a te.pytorch.Linear, each planned
GroupedExperts two te.pytorch.GroupedLinear, (with fuse_norm) an RMSNorm + Linear pair of an
fp8stack Llama block one te.pytorch.LayerNormLinear, and (with fuse_mlp) a block's ffn_norm + SwiGLU
FeedForward one te.pytorch.LayerNormMLP. Every converted module runs its forward under
its own te.pytorch.autocast (see te_modules.py), so the BF16 parts of the model never enter one;
a bf16 plan on te (recipe bf16, backend te) gets the same modules with that autocast off.

TransformerEngine and CUDA are looked up only when asked for: importing this module needs neither.
"""

import importlib.util
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from fp8stack.backends.base import BackendUnavailable, ConversionRecord, swap_module
from fp8stack.plan import Decision, Plan, PlanError
from fp8stack.plan.recipes import BF16, BLOCKWISE_GEMMS, FP8_FORMATS

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

FUSED_NORMS = {".attention.wqkv": ".attention_norm", ".feed_forward.w13": ".ffn_norm"}
"""fuse_norm: Linear fqn suffix -> the RMSNorm feeding only it in an fp8stack.models.llama block."""

MLP_SUFFIX = ".feed_forward"
"""fuse_mlp: a dense block's FeedForward (w13, SwiGLU, w2); the RMSNorm feeding it is FUSED_NORMS' for its w13."""


def te_recipe(recipe_name: str, fp8_format: str, delayed_margin: int = 0):
    """The TransformerEngine recipe object for an fp8stack recipe and format (needs TE installed); delayed scaling
    leaves 2^delayed_margin headroom (TE's margin; the other recipes have none). None for bf16: the module runs
    without FP8."""
    _check_recipe_name(recipe_name)
    if recipe_name == BF16:
        return None
    if fp8_format not in FP8_FORMATS:
        raise PlanError(f"FP8 format {fp8_format!r} is not one TransformerEngine trains with: use "
                        f"{' or '.join(FP8_FORMATS)} (pure E5M2 training is not supported)")
    reason = _import_problem()
    if reason:
        raise BackendUnavailable(f"recipe {recipe_name!r} needs TransformerEngine: {reason}")
    from transformer_engine.common import recipe as te_recipes

    # TE 2.20 accepts E4M3 and HYBRID for all four recipes (each __post_init__ rejects only E5M2).
    fmt = {"e4m3": te_recipes.Format.E4M3, "hybrid": te_recipes.Format.HYBRID}[fp8_format]
    if recipe_name == "delayed":
        return te_recipes.DelayedScaling(fp8_format=fmt, margin=delayed_margin,
                                         amax_history_len=DELAYED_AMAX_HISTORY_LEN,
                                         amax_compute_algo=DELAYED_AMAX_COMPUTE_ALGO)
    return getattr(te_recipes, TE_RECIPES[recipe_name])(fp8_format=fmt)


@dataclass
class TEBackend:
    """TransformerEngine modules for the components a plan assigns to `te`."""

    fuse_norm: bool = False
    """Fuse attention_norm + attention.wqkv and ffn_norm + feed_forward.w13 of fp8stack Llama blocks
    into te.pytorch.LayerNormLinear(normalization='RMSNorm'): one kernel normalizes and casts to FP8,
    saving a BF16 round trip of the activations. The norm is replaced by nn.Identity."""
    fuse_mlp: bool = False
    """Fuse ffn_norm + feed_forward (w13, SwiGLU, w2) of dense fp8stack Llama blocks into
    te.pytorch.LayerNormMLP(normalization='RMSNorm', activation='swiglu'): TE's SwiGLU kernel writes
    FC2's input (FP8 under delayed scaling) and the backward keeps FC1's output only, not torch's three
    SwiGLU tensors. Under delayed scaling the SwiGLU backward writes FC1's FP8 gradient in one kernel too
    (patches/te_swiglu_fp8_dgrad.py, applied at conversion). Blocks whose w13 and w2 do not share one TE recipe
    keep unfused modules (noted)."""
    delayed_margin: int = 0
    """Headroom of delayed-scaling scales below the FP8 maximum, as a power of 2 (Megatron's --fp8-margin)."""
    cache_fp8_weights: bool = False
    """Cast each weight to FP8 on the first micro-batch of a step and reuse that copy for the step's other
    micro-batches (TE's is_first_microbatch); call mark_fp8_weights_stale after each optimizer step (the
    assembly's post_optimizer_step_hook does). The copies stay allocated between steps."""
    fuse_wgrad_accumulation: bool = False
    """Each TE weight-gradient GEMM accumulates into the weight's FP32 main_grad, which is its .grad (TE's
    fuse_wgrad_accumulation, Megatron's --gradient-accumulation-fusion): no BF16 weight gradient, no BF16 -> FP32
    copy and no add per micro-batch. Needs FP32 weights on the GPU, one process (nothing reduces main_grad)."""
    blockwise_gemms: str = "te"
    """Where the blockwise (Float8BlockScaling) modules' GEMMs run: te (cuBLAS) or deepgemm (DeepGEMM's dense
    kernels on TE's operands, bit-identical; fp8stack.backends.te_deepgemm). Quantization stays TE's."""
    fp8_weights: bool = False
    """The FP8 modules hold their weights in FP8 only (TE quantized_model_init, Megatron's --fp8-param-gather): no
    high-precision copy, and no cast in forward. For a trainer whose optimizer steps FP32 masters (fp8_weight_masters
    gives their initial values) and copies them into these weights after each step, which quantizes them
    (TrainConfig.param_dtype fp8). Dense linears, LayerNormLinear and LayerNormMLP; not GroupedLinear experts."""

    name: ClassVar[str] = "te"

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
        """Swap each planned Linear / GroupedExperts for its TE module, weights copied bit-exactly.
        Everything is checked before the first swap, so a refused plan leaves the model untouched."""
        record = ConversionRecord(backend=self.name)
        if not decisions:
            return model, record
        linears, expert_pairs, recipes = _validated(decisions, plan)
        if self.fp8_weights and expert_pairs:
            raise PlanError(f"fp8_weights holds dense TE linears' weights in FP8, and the plan runs experts on TE "
                            f"({next(iter(expert_pairs))}): keep high-precision weights for MoE models (param_dtype "
                            "bf16) or plan the experts on another backend")
        if self.delayed_margin and "delayed" not in recipes:
            raise PlanError(f"delayed_margin={self.delayed_margin} applies to delayed scaling, and the plan's TE "
                            f"recipes are {', '.join(recipes)}: drop the margin or plan recipe delayed")
        mlps = _fusable_mlps(model, linears, record) if self.fuse_mlp else {}
        ok, reason = self.available(recipes)
        if not ok:
            raise BackendUnavailable(f"the plan for {plan.model} runs {len(decisions)} component(s) on "
                                     f"TransformerEngine, but {reason}")
        gemm_library = self._blockwise_gemm_library(recipes)
        from fp8stack.backends import te_modules

        te_recipes = {name: te_recipe(name, plan.fp8_format, self.delayed_margin) for name in recipes}
        options = {"cache_weights": self.cache_fp8_weights, "fuse_wgrad_accumulation": self.fuse_wgrad_accumulation,
                   **({"fp8_weights": True} if self.fp8_weights else {})}
        shared = _shared_parameters(model)
        swaps = []  # (fqn to swap, factory of its new module, plan fqns it then runs)
        for mlp_fqn, (norm_fqn, w13, w2) in mlps.items():
            norm = _checked(model.get_submodule(norm_fqn), norm_fqn, shared)
            mlp = _checked(model.get_submodule(mlp_fqn), mlp_fqn, shared)
            swaps.append((norm_fqn, nn.Identity, (norm_fqn,)))
            swaps.append((mlp_fqn, partial(te_modules.layernorm_mlp_from, norm, mlp, te_recipes[w13.recipe],
                                           name=mlp_fqn, **options), (w13.fqn, w2.fqn)))
        in_mlps = {d.fqn for _, w13, w2 in mlps.values() for d in (w13, w2)}
        for d in (d for d in linears if d.fqn not in in_mlps):
            linear = _checked(_linear_at(model, d), d.fqn, shared)
            norm_fqn = _fusable_norm(model, d.fqn) if self.fuse_norm else None
            if norm_fqn:
                norm = _checked(model.get_submodule(norm_fqn), norm_fqn, shared)
                # The norm's weight moves into the LayerNormLinear; the norm itself becomes a no-op.
                swaps.append((norm_fqn, nn.Identity, (norm_fqn,)))
                swaps.append((d.fqn, partial(te_modules.layernorm_linear_from, norm, linear, te_recipes[d.recipe],
                                             name=d.fqn, **options), (d.fqn,)))
            else:
                swaps.append((d.fqn, partial(te_modules.linear_from, linear, te_recipes[d.recipe], name=d.fqn,
                                              **options), (d.fqn,)))
        for module_fqn, (w13, w2) in expert_pairs.items():
            grouped = _checked(_grouped_experts_at(model, module_fqn, w13, w2), module_fqn, shared)
            swaps.append((module_fqn, partial(te_modules.grouped_experts_from, grouped, te_recipes[w13.recipe],
                                              name=module_fqn, **options),
                          (w13.fqn, w2.fqn)))
        # Build every module before swapping any: a module refused while built leaves the model as it was.
        built = [(fqn, factory(), runs) for fqn, factory, runs in swaps]
        for fqn, new, runs in built:
            model = swap_module(model, fqn, new)
            record.converted.update(dict.fromkeys(runs, type(new).__name__))
        record.recipe = ", ".join(recipes)
        if gemm_library is not None:
            from fp8stack.backends import te_deepgemm

            te_deepgemm.route_blockwise_gemms(gemm_library)
            record.notes.append(te_deepgemm.ROUTED_NOTE)
        if "delayed" in recipes:
            record.notes.append(f"delayed: TE DelayedScaling with amax history {DELAYED_AMAX_HISTORY_LEN} and "
                                f"'{DELAYED_AMAX_COMPUTE_ALGO}' (megatron-core defaults), margin "
                                f"{self.delayed_margin}, so one FP8 autocast per module updates each scale once per "
                                "step, as one model-wide autocast would")
        if self.cache_fp8_weights:
            record.notes.append("cache_fp8_weights: each weight is cast to FP8 on a step's first micro-batch and the "
                                "copy reused by its other micro-batches (TE is_first_microbatch)")
        if self.fp8_weights:
            count = len(fp8_weight_masters(model, take=False))
            record.notes.append(f"fp8_weights: {count} TE weight(s) held in FP8 only (quantized_model_init); the "
                                "optimizer's FP32 masters are quantized into them after each step")
        if self.fuse_wgrad_accumulation:
            count = sum(len(getattr(m, "main_grad_weights", ())) for _, m, _ in built)
            record.notes.append(f"fuse_wgrad_accumulation: the weight-gradient GEMMs of {count} TE weight(s) "
                                "accumulate into FP32 main_grad buffers, which are the weights' .grad")
        norm_linears = [fqn for fqn, cls in record.converted.items() if cls == "TELayerNormLinear"]
        if norm_linears:
            record.notes.append(f"fuse_norm: {len(norm_linears)} RMSNorm(s) folded into te LayerNormLinear (e.g. into "
                                f"{norm_linears[0]}); the norms' fqns now run nn.Identity")
        if mlps:
            record.notes.append(f"fuse_mlp: {len(mlps)} ffn_norm + SwiGLU FeedForward(s) fused into te LayerNormMLP "
                                f"(e.g. {next(iter(mlps))}); the norms' fqns now run nn.Identity")
        if any(w13.recipe == "delayed" for _, w13, _ in mlps.values()):
            from fp8stack import patches

            record.notes.append(f"fuse_mlp, delayed: {patches.apply_patch('fp8stack.patches.te_swiglu_fp8_dgrad')} "
                                "(patches/te_swiglu_fp8_dgrad.py)")
        return model, record

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


def fp8_weight_caches(model: nn.Module) -> list[nn.Module]:
    """The TE modules of `model` that cache their FP8 weights across micro-batches (cache_fp8_weights)."""
    return [m for m in model.modules() if getattr(m, "is_first_microbatch", None) is not None]


def fp8_weight_masters(model: nn.Module, take: bool = True) -> dict[int, torch.Tensor]:
    """id(weight) -> the FP32 values each weight held in FP8 only (fp8_weights) was quantized from, on the CPU: the
    initial values of its optimizer master. TE keeps them from the module's construction (preserve_high_precision_
    init_val); take: hand them over and let TE free its copy."""
    values = {}
    for param in model.parameters():
        value = param.get_high_precision_init_val() if hasattr(param, "get_high_precision_init_val") else None
        if value is not None:
            values[id(param)] = value
            if take:
                param.clear_high_precision_init_val()
    return values


def mark_fp8_weights_stale(modules: list[nn.Module]) -> None:
    """The weights changed (an optimizer step): the next forward of each module casts them to FP8 again."""
    for module in modules:
        module.is_first_microbatch = True


def _validated(decisions: list[Decision], plan: Plan) -> tuple[list[Decision], dict, list[str]]:
    """(linear decisions, GroupedExperts fqn -> (w13, w2) decisions, recipe names), or PlanError."""
    strays = [d.fqn for d in decisions if d.backend != "te"]
    if strays:
        raise ValueError(f"TEBackend.convert got decisions planned for other backends: {strays[:3]}")
    others = [d for d in decisions if d.component.kind not in ("linear", "expert")
              and not (d.component.kind == "head" and d.recipe == BF16)]
    if others:
        raise PlanError(f"{others[0].fqn}: the te backend converts linear and expert components (and the output head "
                        f"without FP8), not kind {others[0].component.kind!r} in {others[0].recipe}: run it in bf16")
    recipes = sorted({d.recipe for d in decisions})
    for recipe in recipes:
        _check_recipe_name(recipe)
    linears = [d for d in decisions if d.component.kind in ("linear", "head")]
    return linears, _expert_pairs([d for d in decisions if d.component.kind == "expert"], plan), recipes


def _support_checks(recipes: Sequence[str]) -> dict[str, str]:
    """FP8 recipe of `recipes` -> the transformer_engine.pytorch function that says whether this GPU runs it;
    bf16 needs none (TE's modules without FP8). PlanError for a recipe TE does not have."""
    for recipe in recipes:
        _check_recipe_name(recipe)
    return {recipe: _SUPPORT_CHECKS[recipe] for recipe in recipes if recipe != BF16}


def import_before_cudnn() -> None:
    """Import TE now, when installed and CUDA is visible, in a process that may use it later. TE
    prefers the system cuDNN and fails to load it (undefined cuDNN symbols, seen on an H200) once torch
    has loaded its own copy for a BF16 SDPA call. A failure is reported later by available()."""
    _import_problem()


def _import_problem() -> str:
    """'' when transformer_engine.pytorch imports and CUDA is visible, else the reason and the fix."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"TransformerEngine is not installed: {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "TransformerEngine needs CUDA, and torch.cuda.is_available() is False: run on a GPU machine"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a native-library load failure surfaces as OSError, RuntimeError, ...
        return (f"TransformerEngine is installed but fails to import ({type(err).__name__}: {err}): "
                f"reinstall it for torch {torch.__version__} with {INSTALL_HINT}")
    return ""


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
    c = d.component
    if (module.out_features, module.in_features) != (c.n, c.k):
        raise PlanError(f"{d.fqn}: the plan says n x k = {c.n} x {c.k} but the module is "
                        f"{module.out_features} x {module.in_features}: derive the plan from this model")
    _check_device(module.weight, d.fqn)
    return module


def _grouped_experts_at(model: nn.Module, fqn: str, w13: Decision, w2: Decision) -> nn.Module:
    from fp8stack.models.moe import GroupedExperts

    module = _module_at(model, fqn)
    if not isinstance(module, GroupedExperts):
        raise PlanError(f"{fqn} is a {type(module).__name__}; the te backend converts "
                        "fp8stack.models.moe.GroupedExperts (w13 [E, 2F, D], w2 [E, D, F]) only")
    experts, two_hidden, dim = module.w13.shape
    want = {"w13": (w13.component.experts, w13.component.n, w13.component.k),
            "w2": (w2.component.experts, w2.component.n, w2.component.k)}
    have = {"w13": (experts, two_hidden, dim), "w2": tuple(module.w2.shape)}
    for name in ("w13", "w2"):
        if want[name] != have[name]:
            raise PlanError(f"{fqn}.{name}: the plan says experts x n x k = {want[name]} but the parameter is "
                            f"{have[name]}: derive the plan from this model")
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


def _fusable_norm(model: nn.Module, fqn: str) -> str | None:
    """The fqn of the RMSNorm that fuse_norm folds into the Linear at `fqn`, if it is one of FUSED_NORMS."""
    for suffix, norm_suffix in FUSED_NORMS.items():
        if fqn.endswith(suffix):
            norm_fqn = fqn.removesuffix(suffix) + norm_suffix
            try:
                model.get_submodule(norm_fqn)
            except AttributeError:
                raise PlanError(f"fuse_norm folds {norm_fqn} into {fqn} (fp8stack.models.llama blocks), but this "
                                f"{type(model).__name__} has no {norm_fqn}: turn fuse_norm off") from None
            return norm_fqn
    return None


def _fusable_mlps(model: nn.Module, linears: list[Decision], record: ConversionRecord) -> dict:
    """fuse_mlp: FeedForward fqn -> (fqn of the RMSNorm feeding it, w13 decision, w2 decision) for each dense
    block whose w13 and w2 both run on te with one recipe; a block whose halves differ stays unfused, with a
    note saying why."""
    from fp8stack.models.moe import FeedForward

    by_fqn = {d.fqn: d for d in linears}
    mlps, kept = {}, []
    for d in linears:
        if d.fqn.endswith(f"{MLP_SUFFIX}.w1"):
            raise PlanError(f"fuse_mlp folds a fused gate/up projection (w13) into te LayerNormMLP, but {d.fqn} "
                            "is a separate gate projection: build the model with fused projections or turn "
                            "fuse_mlp off")
        if not d.fqn.endswith(f"{MLP_SUFFIX}.w13"):
            continue
        mlp_fqn = d.fqn.removesuffix(".w13")
        w2 = by_fqn.get(f"{mlp_fqn}.w2")
        if w2 is None or w2.recipe != d.recipe:
            kept.append(f"{mlp_fqn} (w2 is {'not on te' if w2 is None else 'on recipe ' + w2.recipe})")
            continue
        mlp = _module_at(model, mlp_fqn)
        if type(mlp) is not FeedForward:
            raise PlanError(f"fuse_mlp replaces {mlp_fqn} by te LayerNormMLP, which computes fp8stack's SwiGLU "
                            f"FeedForward, but it is a {type(mlp).__name__}: turn fuse_mlp off")
        norm_fqn = mlp_fqn.removesuffix(MLP_SUFFIX) + FUSED_NORMS[f"{MLP_SUFFIX}.w13"]
        _module_at(model, norm_fqn)  # the norm it folds must exist
        mlps[mlp_fqn] = (norm_fqn, d, w2)
    if not mlps:
        raise PlanError("fuse_mlp found no dense SwiGLU FeedForward whose w13 and w2 both run on te with one recipe "
                        f"({'; '.join(kept) or 'no feed_forward.w13 on te'}): turn fuse_mlp off")
    if kept:
        record.notes.append(f"fuse_mlp: kept unfused, their w13 and w2 differ: {'; '.join(kept)}")
    return mlps


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
