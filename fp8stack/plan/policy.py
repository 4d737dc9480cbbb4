"""The policy: small rules, applied in order, that turn a ModelDescription into a Plan.

Each rule looks at one component and either decides (returns a Decision with its reason) or
passes (returns None). The first rule that decides wins; the last rule always decides.
"""

import difflib
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from fp8stack.plan.description import Component, ModelDescription, NormFeed, SwiGLUFeed
from fp8stack.plan.errors import PlanError, PlanWarning
from fp8stack.plan.plan import Decision, Fusion, Plan
from fp8stack.plan.expert_speeds import GROUPED_KERNELS, ExpertGemm, measured, runnable_kernels, shape_note
from fp8stack.plan.recipes import (BACKEND_LABELS, BACKEND_PREFERENCES, BF16, EXPERT_BACKENDS, FP8_FORMATS,
                                   GROUPED_ALIGNMENT, Recipe, dense_backend, expert_paths,
                                   fp8_attention_head_dim_problem, fp8_attention_recipes, get_recipe)

if TYPE_CHECKING:
    from torch import nn

SMALL_GEMM_FILTERS: dict[str, tuple[tuple[int, int], ...]] = {
    # (max_n, max_k): a GEMM with n <= max_n and k <= max_k is "small". torchao's auto-filters.
    "rowwise": ((2048, 1 << 62), (1 << 62, 1024), (4096, 2048)),
    "tensorwise": ((1024, 4096),),
    "off": (),
}
"""Size thresholds below which FP8 casts cost more than the faster GEMM saves (H100 measurements
behind torchao's _auto_filter_for_recipe). The policy's `auto` takes the recipe's own (Recipe.small_gemm_filter)."""
SMALL_GEMM_CHOICES = ("auto", *SMALL_GEMM_FILTERS)
"""What small_gemm_filter may be set to."""

HIGH_PRECISION_REASONS = {
    "embedding": "embedding lookup is not a GEMM; table and gradients stay BF16 (DeepSeek-V3)",
    "head": "output head feeds softmax/cross-entropy; BF16 keeps the logits exact enough (DeepSeek-V3)",
    "router": "router: top-k gating flips on small logit differences; BF16 GEMM, FP32 softmax",
    "norm": "norm: mean-of-squares reduction in FP32, BF16 in and out",
    "attn_core": "attention core (QK^T, softmax, PV) in BF16 flash/SDPA with FP32 softmax",
    "ssm_scan": "SSM scan: recurrent state accumulates over the sequence; FP8 scans measured net-negative",
}
"""Kinds that never run in FP8, whatever the recipe or overrides say."""

BF16_ON_TE_REASON = ("recipe bf16 with backend te: a TransformerEngine module without FP8 (BF16 GEMMs), so a BF16 "
                     "baseline gets TE's fused norm, MLP and weight-gradient accumulation too")
"""Why a linear or expert GEMM of a bf16 plan runs on TE (the policy's recipe bf16 and backend te)."""

FP8_ATTENTION_OPT_IN = ("FP8 attention (TE's FP8 dot-product attention) is opt-in, not default, until its "
                        "2000-step loss gate passes: --fp8-dot-product-attention")
"""Why an FP8 plan keeps its attention cores in BF16 without fp8_attention."""

FP8_ATTENTION_REASON = ("{recipe} FP8 attention: TE's FP8 dot-product attention (DotProductAttention with fp8_dpa, "
                        "the fused cuDNN kernel: Q, K, V and the probabilities in FP8, softmax in FP32); opt-in "
                        "(fp8_attention) pending its 2000-step loss gate")
"""Why an attention core runs in FP8 under fp8_attention."""

HEAD_ON_TE_REASON = ("on a TransformerEngine module without FP8 (head_on_te), so its weight gradient accumulates in "
                     "FP32 like the TE linears' and the final norm can fold into it")
"""Why the output head runs on TE under head_on_te."""

FUSED_NORM_LINEAR = "TE LayerNormLinear"
FUSED_NORM_MLP = "TE LayerNormMLP"


@dataclass(frozen=True)
class Override:
    """A user rule from a recipe file: components matching `block` and `fqn` get `backend`/`recipe`."""

    block: str = "*"
    """Glob on the block type ('moe', 'dense', ...)."""
    fqn: str = "*"
    """Glob on the component fqn ('layers.*.attention.wo')."""
    backend: str | None = None
    """bf16 | te | torchao | auto; None keeps the policy's backend preference."""
    recipe: str | None = None
    """Recipe for matching components; None keeps the policy's recipe."""
    reason: str = ""
    """Why, shown in the plan."""
    source: str = "override"
    """Where the override came from (recipe file path)."""

    def matches(self, component: Component) -> bool:
        return fnmatchcase(component.block, self.block) and fnmatchcase(component.fqn, self.fqn)


@dataclass(frozen=True)
class PolicyConfig:
    """Everything the policy needs besides the model; validated on construction."""

    recipe: str
    """FP8 recipe for GEMMs the rules leave in FP8, or 'bf16' for no FP8 at all (with backend te: the linears and
    expert GEMMs as TE modules in BF16)."""
    fp8_format: str | None = None
    """e4m3, or hybrid (E4M3 forward, E5M2 gradients); None takes the recipe's library default
    (hybrid for delayed and tensorwise, e4m3 for rowwise, blockwise and mxfp8)."""
    backend: str = "auto"
    """Preferred backend for dense linears: auto | te | torchao."""
    arch: int = 90
    """Target SM version: 90 Hopper, 100 Blackwell."""
    first_last_layers_bf16: bool = False
    """Keep the first and last layers in BF16 (Megatron --first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """Layers kept BF16 at the start when first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers kept BF16 at the end when first_last_layers_bf16."""
    small_gemm_filter: str = "auto"
    """Which torchao size thresholds send small GEMMs to BF16: auto (the recipe's own, as torchao's
    auto-filter picks them) | rowwise | tensorwise | off. Projections the plan merges into one GEMM are judged by the
    merged GEMM's size."""
    expert_backend: str = "auto"
    """Where FP8 expert GEMMs run: auto (the fastest path measured on the target arch for the experts' recipe at the
    model's expert shape, else at the nearest measured one, from fp8stack/plan/expert_speeds.json; BF16 where every
    measured path is slower than BF16; TE's, else grouped_fp8's, where none is measured), te (TE GroupedLinear) or
    grouped_fp8 (fp8stack's grouped kernels: blockwise on DeepGEMM when installed, else torch's). A named backend is
    planned even where measured slower than BF16, with that measurement in the reason."""
    grouped_kernels: str = "auto"
    """What grouped_fp8's blockwise expert GEMMs run on where the model trains, so that expert_backend auto counts only
    measurements of kernels that run there: deepgemm (DeepGEMM, with TE's quantizer where TE imports), torch (torch's
    scaled GEMMs), or auto: deepgemm where this Python has deep_gemm installed, else torch. Name it to plan for
    another machine."""
    head_on_te: bool | None = None
    """The output head (BF16 by rule) runs as a TE module without FP8 beside the plan's TE linears, so TE's fused
    weight-gradient accumulation covers it too, as megatron's output layer accumulates into main_grad, and the final
    norm can fold into it. None: wherever the dense linears run on TE and the model's head may be replaced
    (ModelDescription.head_replaceable); the trainer turns it off where FSDP2 gathers FP32 weights for BF16
    activations, as TE under fully_shard keeps no weight for a non-FP8 module's backward
    (fp8stack.train.resolve.head_on_te)."""
    fuse_norm: bool = True
    """A norm whose output only linears read runs inside them as one TE LayerNormLinear (several linears merged into
    one GEMM, their output split back) when they share one TE recipe: one kernel normalizes and casts to FP8."""
    fuse_mlp: bool = True
    """A norm whose output only a SwiGLU MLP reads runs with it as one TE LayerNormMLP when its projections share one
    TE recipe: TE's SwiGLU writes FC2's input (FP8 under delayed scaling) and the backward keeps FC1's output only."""
    fp8_attention: bool = False
    """Run the attention cores (QK^T, softmax, PV) in FP8 as TE's FP8 dot-product attention (TE DotProductAttention
    under the recipe with fp8_dpa; Megatron's --fp8-dot-product-attention): delayed from sm90, tensorwise (backend te)
    and mxfp8 from sm100. Off by default: attention stays BF16 until FP8 attention passes its loss gate."""
    overrides: tuple[Override, ...] = field(default=())
    """Per-block / per-fqn rules; the last matching one wins."""

    def __post_init__(self) -> None:
        for name in ("recipe", "backend", "small_gemm_filter", "expert_backend"):
            _require_name(getattr(self, name), name)
        if self.expert_backend not in ("auto", *EXPERT_BACKENDS):
            raise PlanError(f"expert_backend={self.expert_backend!r}: use auto, {' or '.join(EXPERT_BACKENDS)}")
        if self.grouped_kernels not in GROUPED_KERNELS:
            raise PlanError(f"grouped_kernels={self.grouped_kernels!r}: use one of {', '.join(GROUPED_KERNELS)}")
        if self.fp8_format is not None:
            _require_name(self.fp8_format, "fp8_format")
        for name in ("first_last_layers_bf16", "fuse_norm", "fuse_mlp", "fp8_attention"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for o in self.overrides:
            for name in ("recipe", "backend"):
                if getattr(o, name) is not None:
                    _require_name(getattr(o, name), f"{o.source}: override {name}")
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise PlanError(f"unknown FP8 format {self.fp8_format!r}: use e4m3 or hybrid")
        if self.backend not in BACKEND_PREFERENCES:
            raise PlanError(f"unknown backend {self.backend!r}: use one of {', '.join(BACKEND_PREFERENCES)}")
        if self.head_on_te is not None and not isinstance(self.head_on_te, bool):
            raise PlanError(f"head_on_te must be true, false or unset (auto), got {self.head_on_te!r}")
        if self.small_gemm_filter not in SMALL_GEMM_CHOICES:
            raise PlanError(f"unknown small-GEMM filter {self.small_gemm_filter!r}: use one of {', '.join(SMALL_GEMM_CHOICES)}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"--{name.replace('_', '-')} must be a non-negative integer, got {value!r}")
        self._check_recipe(self.recipe, self.backend)
        if self.fp8_attention:
            self._check_fp8_attention()
        if self.head_on_te and not self.dense_linears_on_te:
            raise PlanError(f"head_on_te puts the output head beside the plan's TransformerEngine linears, and recipe "
                            f"{self.recipe} with backend {self.backend} has none: use backend te or drop head_on_te")
        for o in self.overrides:
            if o.backend not in (None, BF16, *BACKEND_PREFERENCES):
                raise PlanError(f"{o.source}: override backend {o.backend!r}: use bf16, auto, te or torchao")
            if o.backend == BF16:
                continue
            try:  # an override naming a backend must fit it now; one that inherits the backend may
                # target experts only, so its dense-backend fit is checked when it meets a linear
                self._check_recipe(o.recipe or self.recipe, o.backend)
            except PlanError as err:
                raise PlanError(f"{o.source}: override for block {o.block!r}, fqn {o.fqn!r}: {err}") from None

    @property
    def small_gemm_thresholds(self) -> tuple[tuple[int, int], ...]:
        """The (max_n, max_k) pairs of the filter in force: auto takes the recipe's own."""
        if self.small_gemm_filter != "auto":
            return SMALL_GEMM_FILTERS[self.small_gemm_filter]
        return SMALL_GEMM_FILTERS[self.small_gemm_filter_name]

    @property
    def small_gemm_filter_name(self) -> str:
        """The filter in force, auto resolved (off for a bf16 plan)."""
        if self.small_gemm_filter != "auto":
            return self.small_gemm_filter
        return "off" if self.recipe == BF16 else get_recipe(self.recipe).small_gemm_filter

    @property
    def dense_linears_on_te(self) -> bool:
        """Whether the policy runs dense linears on TransformerEngine (overrides aside)."""
        if self.recipe == BF16:
            return self.backend == "te"
        return dense_backend(get_recipe(self.recipe), self.backend) == "te"

    def _check_fp8_attention(self) -> None:
        """fp8_attention needs a recipe TE runs FP8 attention under on the target GPU, with the linears on TE."""
        allowed = fp8_attention_recipes()
        if self.recipe == BF16:
            raise PlanError(f"fp8_attention runs attention in FP8 under an FP8 recipe, and the recipe is bf16: pass "
                            f"--fp8-recipe with one of {allowed}, or drop --fp8-dot-product-attention")
        arch = get_recipe(self.recipe).fp8_attention_arch
        if arch is None:
            raise PlanError(f"recipe {self.recipe} has no FP8 attention (TE's FP8 dot-product attention runs under "
                            f"{allowed}): pick one of those or drop --fp8-dot-product-attention")
        if self.arch < arch:
            raise PlanError(f"TE's FP8 attention under recipe {self.recipe} needs sm{arch}+ (its fused cuDNN kernel) "
                            f"and the target is sm{self.arch}: it runs under {allowed}; pick one of those or drop "
                            "--fp8-dot-product-attention")
        if not self.dense_linears_on_te:
            raise PlanError(f"fp8_attention is TransformerEngine's FP8 dot-product attention (torchao has none), and "
                            f"recipe {self.recipe} with backend {self.backend} runs the linears on torchao: pass "
                            "--backend te or drop --fp8-dot-product-attention")

    def _check_recipe(self, name: str, backend: str | None) -> None:
        if name == BF16:
            return
        recipe = get_recipe(name)
        if self.arch < recipe.min_arch:
            raise PlanError(
                f"recipe {name!r} needs sm{recipe.min_arch}+ but the target is sm{self.arch}: "
                f"pick another recipe or pass --arch sm{recipe.min_arch}")
        if backend is not None:
            dense_backend(recipe, backend)


def _require_name(value: object, what: str) -> None:
    """YAML turns some words into other types (off -> False, 1.0 -> float): report that, not a TypeError."""
    if not isinstance(value, str):
        hint = " (YAML reads off/on/yes/no as booleans: quote the word)" if isinstance(value, bool) else ""
        raise PlanError(f"{what} must be a name, got {value!r}{hint}")


Rule = Callable[[Component, PolicyConfig, ModelDescription], Decision | None]


def high_precision_kinds(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """Embeddings, head, router, norms, attention core and SSM scans never run in FP8 (the head on a TE module
    without FP8 with head_on_te)."""
    head_on_te = cfg.head_on_te if cfg.head_on_te is not None else cfg.dense_linears_on_te and model.head_replaceable
    if c.kind == "head" and head_on_te:
        return Decision(c, "te", BF16, f"{HIGH_PRECISION_REASONS['head']}; {HEAD_ON_TE_REASON}")
    if c.kind == "attn_core" and cfg.fp8_attention:
        return None  # fp8_attention_core decides, after the layers kept BF16
    if c.kind == "attn_core" and cfg.recipe != BF16:
        return Decision(c, BF16, BF16, f"{HIGH_PRECISION_REASONS['attn_core']}; {FP8_ATTENTION_OPT_IN}")
    if c.kind in HIGH_PRECISION_REASONS:
        return Decision(c, BF16, BF16, HIGH_PRECISION_REASONS[c.kind])
    return None


def no_fp8_requested(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """A bf16 recipe (and no override asking for FP8) keeps everything BF16: as it is, or (the policy's recipe
    bf16 with backend te) on TransformerEngine modules."""
    backend, recipe, note = _target(c, cfg, model)
    if recipe != BF16:
        return None
    reason = note or (BF16_ON_TE_REASON if backend == "te" else "recipe bf16: no FP8 requested")
    return Decision(c, backend, BF16, reason)


def first_last_layers(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """Megatron's --first-last-layers-bf16: the outermost layers stay BF16 unless an override names them
    by fqn (a block-wide override such as {block: moe} does not lift it)."""
    override = _matching_override(c, cfg)
    if not cfg.first_last_layers_bf16 or c.layer is None or (override and override.fqn != "*"):
        return None
    start, end = cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16
    if c.layer < start:
        return Decision(c, BF16, BF16, f"first {start} layer(s) kept BF16 (--first-last-layers-bf16)")
    if c.layer >= model.num_layers - end:
        return Decision(c, BF16, BF16, f"last {end} layer(s) kept BF16 (--first-last-layers-bf16)")
    return None


def fp8_attention_core(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """Under fp8_attention, an attention core no earlier rule kept BF16 runs as TE's FP8 dot-product attention
    with its recipe; a head dim TE's fused FP8 kernel does not train, or an override moving the core off TE or
    onto a recipe without FP8 attention, is refused (the user asked for FP8 attention: it never quietly stays BF16)."""
    if c.kind != "attn_core":
        return None
    backend, recipe, note = _target(c, cfg, model)  # not bf16: no_fp8_requested decided those
    arch = get_recipe(recipe).fp8_attention_arch
    if backend != "te" or arch is None or cfg.arch < arch:
        raise PlanError(f"{note or 'policy'} on {c.fqn}: FP8 attention runs on TE under {fp8_attention_recipes()}, "
                        f"not {recipe} on {backend} at sm{cfg.arch}: fix the override or drop "
                        "--fp8-dot-product-attention")
    problem = fp8_attention_head_dim_problem(c.k, cfg.arch)
    if problem:
        raise PlanError(f"{c.fqn}: {problem}: drop --fp8-dot-product-attention for {model.name}")
    why = FP8_ATTENTION_REASON.format(recipe=recipe)
    return Decision(c, "te", recipe, f"{note}: {why}" if note else why)


def experts_measured_slower(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """Expert GEMMs stay BF16 where every FP8 path measured for them on the target arch is slower than BF16, unless
    the user named their backend (expert_backend)."""
    if c.kind != "expert" or _target(c, cfg, model)[1] == BF16:
        return None
    choice = _expert_choice(c, cfg, model)
    return Decision(c, BF16, BF16, choice.why) if choice.keep_bf16 else None


def alignment(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """FP8 GEMMs need both dims divisible by 16 (128 for block scales and grouped GEMMs)."""
    backend, recipe, _ = _target(c, cfg, model)
    need = GROUPED_ALIGNMENT if backend == "grouped_fp8" else get_recipe(recipe).alignment
    for dim, value in (("n", c.n), ("k", c.k)):
        if value % need:
            return Decision(c, BF16, BF16, f"{dim}={value} is not divisible by {need} ({recipe} on {backend} needs it)")
    return None


def small_gemm(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision | None:
    """Dense linears under the small-size thresholds stay BF16: the casts would eat the gain. Projections the plan
    merges into one GEMM (merged_linears) are judged by that GEMM. Expert GEMMs are exempt: the thresholds were
    measured on dense Float8Linear, and a grouped GEMM's size is its whole token buffer, not one expert's slice."""
    if c.kind != "linear":
        return None
    merged = merged_linears(c, cfg, model)
    n = sum(m.n for m in merged) if merged else c.n
    for max_n, max_k in cfg.small_gemm_thresholds:
        if n <= max_n and c.k <= max_k:
            bound = " and ".join(f"{d}={v} <= {m}" for d, v, m in (("n", n, max_n), ("k", c.k, max_k)) if m < 1 << 62)
            return Decision(c, BF16, BF16, f"small GEMM ({bound}, torchao {cfg.small_gemm_filter_name} auto-filter): "
                                            "FP8 casts cost more than the GEMM saves")
    return None


def merged_linears(c: Component, cfg: PolicyConfig, model: ModelDescription) -> tuple[Component, ...]:
    """The linears (c among them) that would run merged into one GEMM with c, fused with the norm they all read, when
    the policy fuses norms and they would run on TE; () when c runs alone."""
    if not cfg.fuse_norm or _target(c, cfg, model)[0] != "te":
        return ()
    for feed in model.feeds:
        if isinstance(feed, NormFeed) and c.fqn in feed.linears and len(feed.linears) > 1:
            components = {x.fqn: x for x in model.components}
            return tuple(components[fqn] for fqn in feed.linears)
    return ()


def fp8(c: Component, cfg: PolicyConfig, model: ModelDescription) -> Decision:
    """What is left runs in FP8 on its backend."""
    backend, recipe, override_reason = _target(c, cfg, model)
    why = f"{recipe} FP8 ({get_recipe(recipe).summary}) via {BACKEND_LABELS[backend]}"
    if c.kind == "expert" and recipe != cfg.recipe and not override_reason:
        why += f"; grouped expert GEMMs have no {cfg.recipe} kernel, so they use {recipe}"
    if c.kind == "expert":
        why += f"{' GroupedLinear' if backend == 'te' else ''}; {_expert_choice(c, cfg, model).why}"
    return Decision(c, backend, recipe, f"{override_reason}: {why}" if override_reason else why)


RULES: tuple[Rule, ...] = (high_precision_kinds, no_fp8_requested, first_last_layers, fp8_attention_core,
                          experts_measured_slower, alignment, small_gemm, fp8)
"""In order; the first rule that returns a Decision decides."""


def make_plan(model: "ModelDescription | nn.Module", cfg: PolicyConfig, *, seq_len: int | None = None) -> Plan:
    """Apply RULES to every component of `model`, then fuse each norm with what reads it where the policy asks for
    it and the backend can (fusions). Warns (PlanWarning) when an FP8 recipe ends up with little FP8. A built
    nn.Module is described first (describe_module, traced at `seq_len` for its attention cores' shape)."""
    if not isinstance(model, ModelDescription):
        from fp8stack.plan.from_module import describe_module  # imports torch: only for a module

        if seq_len is None:
            raise PlanError("make_plan(module, ...) needs seq_len=, the training sequence length (it sets the "
                            "attention cores' share of the GEMM FLOPs)")
        model = describe_module(model, seq_len=seq_len, name=type(model).__name__)
    if cfg.first_last_layers_bf16:
        check_layers_kept_bf16(model.num_layers, cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16,
                               cfg.recipe)
    for override in cfg.overrides:
        _check_override_matches(override, model)
    decisions = []
    for c in model.components:
        for rule in RULES:
            decision = rule(c, cfg, model)
            if decision is not None:
                decisions.append(decision)
                break
    fused, not_fused = fusions(model, decisions, cfg)
    fp8_format = cfg.fp8_format or (get_recipe(cfg.recipe).default_format if cfg.recipe != BF16 else "e4m3")
    plan = Plan(model=model.name, recipe=cfg.recipe, fp8_format=fp8_format, arch=cfg.arch,
                decisions=_with_fusions(tuple(decisions), fused, model), fusions=fused, not_fused=not_fused)
    if plan.little_fp8:
        warnings.warn(f"{plan.little_fp8}: assemble() refuses this plan unless allow_little_fp8=True", PlanWarning,
                      stacklevel=2)
    untraced = [why for norm, why in not_fused if not norm]
    if untraced:
        warnings.warn(f"no norm of {model.name} is fused with what it feeds: {untraced[0]}", PlanWarning, stacklevel=2)
    return plan


def fusions(model: ModelDescription, decisions: list[Decision],
            cfg: PolicyConfig) -> tuple[tuple[Fusion, ...], tuple[tuple[str, str], ...]]:
    """(fusions, (norm, why not) for each norm the policy wanted fused and could not). A norm feeding a SwiGLU MLP
    runs with the whole MLP (fuse_mlp), else with the linears reading it (fuse_norm), when they share one backend
    and recipe on a backend with fused norm modules (TE)."""
    by_fqn = {d.fqn: d for d in decisions}
    mlps = {f.norm: f for f in model.feeds if isinstance(f, SwiGLUFeed)}
    fused, not_fused = [], []
    for feed in (f for f in model.feeds if isinstance(f, NormFeed)):
        choices = [(mlps[feed.norm], FUSED_NORM_MLP)] if cfg.fuse_mlp and feed.norm in mlps else []
        choices += [(feed, FUSED_NORM_LINEAR)] if cfg.fuse_norm else []
        problems = []
        for candidate, module in choices:
            runs = {(by_fqn[fqn].backend, by_fqn[fqn].recipe) for fqn in candidate.linears}
            backend, recipe = next(iter(runs))
            if len(runs) == 1 and backend == "te":
                fused.append(Fusion(candidate, backend, recipe))
                break
            problems.append(f"not one {module}: its " + (f"linears run on {', '.join(sorted(f'{b}/{r}' for b, r in runs))}"
                                                         if len(runs) > 1 else f"linears run on {backend}, not te"))
        else:
            if problems and any(by_fqn[fqn].backend == "te" for fqn in feed.linears):
                not_fused.append((feed.norm, "; ".join(problems)))
    if (cfg.fuse_norm or cfg.fuse_mlp) and any(d.backend == "te" for d in decisions):
        not_fused += [(u.norm, u.why) for u in model.unfusable]
    return tuple(fused), tuple(not_fused)


def _with_fusions(decisions: tuple[Decision, ...], fused: tuple[Fusion, ...],
                  model: ModelDescription) -> tuple[Decision, ...]:
    """Each fused decision's reason, with what it runs fused with (names inside the layer, so that identical layers
    still read alike)."""
    names = {c.fqn: c.name for c in model.components}
    notes = {}
    for fusion in fused:
        feed = fusion.feed
        layer_prefix = feed.norm.removesuffix(names.get(feed.norm, feed.norm))  # 'layers.3.', or '' outside layers
        norm, linears = names.get(feed.norm, feed.norm), [names.get(fqn, fqn) for fqn in feed.linears]
        if isinstance(feed, SwiGLUFeed):
            note = f"fused with {norm} and the SwiGLU into one {FUSED_NORM_MLP} ({feed.module.removeprefix(layer_prefix)})"
        elif len(linears) > 1:
            note = f"fused with {norm} into one {FUSED_NORM_LINEAR}, {', '.join(linears)} merged into one GEMM"
        else:
            note = f"fused with {norm} into one {FUSED_NORM_LINEAR}"
        notes.update(dict.fromkeys(feed.linears, note))
    return tuple(replace(d, reason=f"{d.reason}; {notes[d.fqn]}") if d.fqn in notes else d for d in decisions)


def check_layers_kept_bf16(num_layers: int, start: int, end: int, recipe: str) -> None:
    """--first-last-layers-bf16's counts must leave the model something to do: more layers than it has, or (under
    an FP8 recipe) all of them, would silently train it all in BF16."""
    for flag, count in (("--num-layers-at-start-in-bf16", start), ("--num-layers-at-end-in-bf16", end)):
        if count > num_layers:
            raise PlanError(f"{flag} {count} is more than the model's {num_layers} layers: pass at most {num_layers}")
    if recipe != BF16 and num_layers and start + end >= num_layers:
        raise PlanError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} keep all "
                        f"{num_layers} layers BF16, so recipe {recipe} would train none in FP8: keep fewer layers "
                        "BF16 or use --fp8-recipe bf16")


def _check_override_matches(override: Override, model: ModelDescription) -> None:
    """An override that matches no component would silently do nothing: refuse it, naming the closest names."""
    if any(override.matches(c) for c in model.components):
        return
    blocks = sorted({c.block for c in model.components})
    if not any(fnmatchcase(block, override.block) for block in blocks):
        what, closest = f"block {override.block!r}", difflib.get_close_matches(override.block, blocks, n=3, cutoff=0)
    else:
        # as globs over the layers ('layers.*.attention.wo'): one suggestion per name, written as a pattern
        fqns = sorted({re.sub(r"(?<=\.)\d+(?=\.)", "*", c.fqn) for c in model.components
                       if fnmatchcase(c.block, override.block)})
        what, closest = f"fqn {override.fqn!r}", difflib.get_close_matches(override.fqn, fqns, n=3, cutoff=0)
    raise PlanError(f"{override.source}: the override for block {override.block!r}, fqn {override.fqn!r} matches no "
                    f"component of {model.name} ({what} matches nothing; closest: {', '.join(closest)}): fix the "
                    "pattern or drop the override")


def _matching_override(c: Component, cfg: PolicyConfig) -> Override | None:
    matches = [o for o in cfg.overrides if o.matches(c)]
    return matches[-1] if matches else None


def _target(c: Component, cfg: PolicyConfig, model: ModelDescription) -> tuple[str, str, str]:
    """(backend, recipe, override reason) this component would get if no safety rule intervenes."""
    override = _matching_override(c, cfg)
    recipe_name = (override.recipe if override and override.recipe else cfg.recipe)
    preference = override.backend if override and override.backend else cfg.backend
    note = f"{override.source}: {override.reason or 'override'}" if override else ""
    if recipe_name == BF16 and cfg.recipe == BF16 and preference == "te":
        return "te", BF16, note  # a whole-model BF16 baseline on TE modules; a bf16 override stays as it is
    if preference == BF16 or recipe_name == BF16:
        return BF16, BF16, note
    recipe = get_recipe(recipe_name)
    if c.kind == "expert":  # experts never run on the dense backend: the measured table or expert_backend picks
        choice = _expert_choice(c, cfg, model)
        return choice.backend, choice.recipe, note
    try:
        return dense_backend(recipe, preference), recipe.name, note
    except PlanError as err:
        raise PlanError(f"{note or 'policy'} on {c.fqn}: {err}") from None


@dataclass(frozen=True)
class ExpertChoice:
    """Where one expert GEMM's FP8 runs, and why."""

    backend: str
    """te or grouped_fp8."""
    recipe: str
    """The recipe it runs with there."""
    why: str
    """The measurement (or its absence) behind the choice, for the reason column."""
    keep_bf16: bool = False
    """Every FP8 path measured slower than BF16 and none was asked for: the experts stay BF16."""


def _expert_choice(c: Component, cfg: PolicyConfig, model: ModelDescription) -> ExpertChoice:
    """The expert path for `c` under its recipe (an override's, else the policy's): the one expert_backend names,
    else the fastest measured on the target arch at the GEMM's shape (else the nearest measured), else (none
    measured) the first of expert_paths."""
    override = _matching_override(c, cfg)
    recipe = get_recipe(override.recipe if override and override.recipe else cfg.recipe)
    preference = override.backend if override and override.backend else cfg.backend
    dense = preference if preference in recipe.dense_backends else recipe.dense_backends[0]
    gemm = _expert_gemm(c, model)
    kernels = runnable_kernels(cfg.grouped_kernels)
    timed = [(backend, expert_recipe, measured(cfg.arch, expert_recipe, backend, gemm, kernels=kernels))
             for backend, expert_recipe in expert_paths(recipe, dense)]
    if cfg.expert_backend != "auto":
        return _asked_expert_path(cfg, recipe, dense, timed, gemm)
    faster = [t for t in timed if t[2] is not None and t[2].speedup > 1]
    if faster:
        backend, expert_recipe, best = max(faster, key=lambda t: t[2].speedup)
        others = "".join(f"; {b}: {m.speedup}x" + (f" at {m.shape.describe()}" if m.shape != best.shape else "")
                         for b, _, m in timed if m is not None and b != backend)
        return ExpertChoice(backend, expert_recipe, f"expert_backend=auto: the fastest {expert_recipe} expert path "
                                                    f"on sm{cfg.arch}, {best.describe()}{others}"
                                                    f"{shape_note(best, gemm)}")
    unmeasured = [t for t in timed if t[2] is None]
    if unmeasured:
        backend, expert_recipe, _ = unmeasured[0]
        return ExpertChoice(backend, expert_recipe, f"expert_backend=auto: {backend}/{expert_recipe} experts are "
                                                    f"unmeasured on sm{cfg.arch}, so planned untimed (measure them: "
                                                    "fp8stack.bench.backends, then fp8stack.bench.expert_table)")
    backend, expert_recipe, best = max(timed, key=lambda t: t[2].speedup)
    slower = ", ".join(f"{b}/{r} {m.describe()}" for b, r, m in timed)
    return ExpertChoice(backend, expert_recipe, f"every FP8 expert path of recipe {recipe.name} is slower than BF16 "
                                                f"on sm{cfg.arch} ({slower}), so the experts stay BF16: pass "
                                                f"expert_backend={backend} to run them in FP8 anyway"
                                                f"{shape_note(best, gemm)}", keep_bf16=True)


def _expert_gemm(c: Component, model: ModelDescription) -> ExpertGemm:
    """An expert component as the measured table is read for it: its tokens per expert are one sequence's, its role
    in the SwiGLU block the one its layer's other expert GEMM gives."""
    return ExpertGemm(c.experts, c.n, c.k, max(1, round(model.seq_len * c.active / c.experts)),
                      role=_expert_role(c, model))


def _expert_role(c: Component, model: ModelDescription) -> str:
    """'w13' or 'w2' for an expert GEMM whose layer holds its partner over the same experts (w13 [2F, D] and w2 [D,
    F]), '' for one without. Read alone, a square w2 ([D, D] where F = D) would also fit a w13 of another block (F =
    D / 2), and the two GEMMs of one block, measured as one, could be planned from two blocks' measurements."""
    for other in model.components:
        if other.kind != "expert" or other.layer != c.layer or other.fqn == c.fqn or other.experts != c.experts:
            continue
        if c.k == other.n and c.n == 2 * other.k:
            return "w13"
        if c.n == other.k and other.n == 2 * c.k:
            return "w2"
    return ""


def _asked_expert_path(cfg: PolicyConfig, recipe: Recipe, dense: str, timed: list, gemm: ExpertGemm) -> ExpertChoice:
    """The path expert_backend names, with what it was measured at; a recipe without that path is refused."""
    for backend, expert_recipe, speed in timed:
        if backend == cfg.expert_backend:
            worth = speed.describe() + shape_note(speed, gemm) if speed else f"unmeasured on sm{cfg.arch}"
            return ExpertChoice(backend, expert_recipe, f"expert_backend={backend}, as asked: {worth}")
    raise PlanError(f"expert_backend={cfg.expert_backend}: recipe {recipe.name} with its linears on {dense} has no "
                    f"{cfg.expert_backend} expert path: use expert_backend auto or "
                    f"{' or '.join(b for b, _, _ in timed)}")
