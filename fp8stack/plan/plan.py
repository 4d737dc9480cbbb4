"""The Plan: one Decision per component, plus what stays FP32. Pure data."""

from collections import Counter, defaultdict
from dataclasses import dataclass

from fp8stack.plan.description import GEMM_KINDS, Component, NormFeed, SwiGLUFeed
from fp8stack.plan.recipes import BF16, get_recipe

MIN_FP8_SHARE = 0.25
"""An FP8 plan running less than this share of its GEMM FLOPs in FP8 gains at most ~1.1x even at 2x faster FP8
GEMMs, while paying every cast: make_plan warns and assemble refuses it unless told it is intended."""


@dataclass(frozen=True)
class Decision:
    """One component's fate: which backend runs it, with which recipe, and why."""

    component: Component
    """What is decided on."""
    backend: str
    """te | torchao | grouped_fp8 | bf16."""
    recipe: str
    """FP8 recipe name, or 'bf16' when the component stays high precision."""
    reason: str
    """Why, in words a user can act on."""

    @property
    def fqn(self) -> str:
        return self.component.fqn

    @property
    def precision(self) -> str:
        """'fp8' or 'bf16' (the GEMM's input precision: its recipe's, whichever backend runs it)."""
        return BF16 if self.recipe == BF16 else "fp8"

    def as_dict(self) -> dict:
        c = self.component
        return {"fqn": c.fqn, "block": c.block, "kind": c.kind, "n": c.n, "k": c.k,
                "backend": self.backend, "recipe": self.recipe, "reason": self.reason}


@dataclass(frozen=True)
class Fusion:
    """Modules that run as one fused module: a norm with the linears reading its output (TE LayerNormLinear, several
    linears merged into one GEMM whose output is split back), or a norm with the SwiGLU MLP reading it (TE
    LayerNormMLP)."""

    feed: NormFeed | SwiGLUFeed
    """What the trace found: which norm feeds which linears or MLP."""
    backend: str
    """The backend whose fused module runs them."""
    recipe: str
    """The recipe all of them share."""

    @property
    def module(self) -> str:
        """Where the fused module goes: the MLP module, or the first linear."""
        return self.feed.module if isinstance(self.feed, SwiGLUFeed) else self.feed.linears[0]

    def as_dict(self) -> dict:
        kind = "layernorm_mlp" if isinstance(self.feed, SwiGLUFeed) else "layernorm_linear"
        return {"kind": kind, "norm": self.feed.norm, "module": self.module, "linears": list(self.feed.linears),
                "backend": self.backend, "recipe": self.recipe}


FP32_STATE: tuple[tuple[str, str], ...] = (
    ("master weights", "an Adam step of ~1e-7 on a weight of ~1 is below the BF16/FP8 grain and would be lost"),
    ("optimizer states (Adam m, v)", "v ~ g^2 ~ 1e-8 underflows FP8 and loses its digits in BF16"),
    ("loss (log-softmax + cross-entropy)", "computed in FP32: logits span a wide range"),
    ("gradient norm and clipping", "a sum of squares over all parameters, reduced in FP32"),
    ("softmax and norm reductions", "exp-sum and mean-of-squares accumulate in FP32 inside BF16 kernels"),
    ("FP8 scales and amax statistics", "scales are FP32 (TE fp8_meta, torchao, DeepSeek block scales)"),
    ("FP8 GEMM accumulation", "tensor-core FP8 products accumulate in FP32 before the BF16 output"),
)
"""State the plan keeps in FP32 whatever the recipe, with the reason."""


@dataclass(frozen=True)
class Plan:
    """Decisions for every component of one model under one policy."""

    model: str
    """Model description name."""
    recipe: str
    """Requested recipe ('bf16' for a plan without FP8)."""
    fp8_format: str
    """e4m3 or hybrid (resolved: the recipe's default when the user named none)."""
    arch: int
    """Target SM version (90 = Hopper)."""
    decisions: tuple[Decision, ...]
    """One per component, in model order."""
    fp32: tuple[tuple[str, str], ...] = FP32_STATE
    """(what, why) that stays FP32."""
    fusions: tuple[Fusion, ...] = ()
    """Norms run fused with what reads them, in model order."""
    not_fused: tuple[tuple[str, str], ...] = ()
    """(norm fqn or '' for the model, why it runs unfused) where the policy asked for fusion."""

    def __str__(self) -> str:
        from fp8stack.plan.render import render_table  # rich is needed only to print

        return render_table(self)

    @property
    def scales_from_history(self) -> bool:
        """Whether any FP8 GEMM takes its scales from earlier steps' amaxes, which a fresh run must prime."""
        return any(d.recipe != BF16 and get_recipe(d.recipe).scales_from_history for d in self.decisions)

    def for_backend(self, backend: str) -> list[Decision]:
        """Decisions assigned to `backend`."""
        return [d for d in self.decisions if d.backend == backend]

    def decision(self, fqn: str) -> Decision:
        """The decision for one fqn (KeyError if the plan has none)."""
        for d in self.decisions:
            if d.fqn == fqn:
                return d
        raise KeyError(f"plan for {self.model} has no component {fqn!r}")

    def summary(self) -> dict:
        """Share of forward GEMM FLOPs per backend and per precision, and counts."""
        gemms = [d for d in self.decisions if d.component.kind in GEMM_KINDS]
        total = sum(d.component.flops_per_token for d in gemms) or 1
        by_backend: dict[str, float] = defaultdict(float)
        by_precision: dict[str, float] = defaultdict(float)
        for d in gemms:
            by_backend[d.backend] += d.component.flops_per_token / total
            by_precision[d.precision] += d.component.flops_per_token / total
        return {
            "gemm_flops_per_token": sum(d.component.flops_per_token for d in gemms),
            "flops_share_by_backend": {k: round(v, 4) for k, v in sorted(by_backend.items())},
            "flops_share_by_precision": {k: round(v, 4) for k, v in sorted(by_precision.items())},
            "components": len(self.decisions),
            "fp8_gemms": sum(d.precision == "fp8" for d in gemms),
            "high_precision_gemms": sum(d.precision == BF16 for d in gemms),
            "fused_norms": len(self.fusions),
        }

    @property
    def little_fp8(self) -> str:
        """'' unless the plan asks for an FP8 recipe and runs under MIN_FP8_SHARE of its GEMM FLOPs in FP8; then
        what it runs and why the rest stays high precision."""
        if self.recipe == BF16:
            return ""
        share = self.summary()["flops_share_by_precision"].get("fp8", 0.0)
        if share >= MIN_FP8_SHARE:
            return ""
        kept = Counter(d.reason for d in self.decisions if d.component.kind in ("linear", "expert")
                       and d.precision == BF16)
        why = (f"; {sum(kept.values())} linear/expert GEMMs stay high precision, most because: "
               f"{kept.most_common(1)[0][0]}" if kept else "")
        return (f"recipe {self.recipe} asks for FP8, but the plan for {self.model} runs {share:.0%} of its GEMM FLOPs "
                f"in FP8 (under {MIN_FP8_SHARE:.0%}){why}")

    def as_dict(self) -> dict:
        """The JSON shape of `fp8stack plan --format json`."""
        return {
            "model": self.model, "recipe": self.recipe, "fp8_format": self.fp8_format,
            "arch": f"sm{self.arch}",
            "layers": [d.as_dict() for d in self.decisions],
            "fp32": [{"what": what, "reason": why} for what, why in self.fp32],
            "fusions": [f.as_dict() for f in self.fusions],
            "not_fused": [{"norm": norm, "reason": why} for norm, why in self.not_fused],
            "summary": self.summary(),
        }
