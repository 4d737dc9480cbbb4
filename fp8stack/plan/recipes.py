"""FP8 recipe names and what each needs: which backends implement it, dim alignment, GPU arch."""

from dataclasses import dataclass

from fp8stack.plan.errors import PlanError

BF16 = "bf16"
"""The recipe name of a plan without FP8, and the backend that leaves modules as they are."""

FP8_FORMATS = ("e4m3", "hybrid")
"""e4m3 everywhere, or hybrid: E4M3 forward, E5M2 gradients (TE's Format.HYBRID)."""

BACKEND_PREFERENCES = ("auto", "te", "torchao")
"""What a user may ask for dense linears; `auto` takes each recipe's first backend."""

GROUPED_ALIGNMENT = 128
"""grouped_fp8 scales 128-element blocks of K and N, so both must be multiples of 128."""


@dataclass(frozen=True)
class Recipe:
    """One FP8 scaling recipe as the policy sees it."""

    name: str
    """Name used on the command line and in plans (Megatron's --fp8-recipe names where they exist)."""
    dense_backends: tuple[str, ...]
    """Backends that implement it for dense linears; the first is the `auto` choice."""
    expert_backend: str
    """The recipe's own path for MoE expert GEMMs: grouped_fp8 where fp8stack's grouped kernels run expert_recipe,
    te where only TE GroupedLinear runs it (expert_paths lists every path)."""
    expert_recipe: str
    """Recipe the grouped_fp8 expert GEMMs run with (grouped GEMMs exist only for some scalings)."""
    alignment: int
    """Both GEMM dims must be multiples of this."""
    min_arch: int
    """Lowest SM version (89 = Ada/Hopper FP8, 100 = Blackwell)."""
    summary: str
    """What the recipe does, for the reason column."""
    default_format: str
    """FP8 format when the user names none: the implementing library's own default for the recipe."""
    small_gemm_filter: str
    """The size thresholds (policy.SMALL_GEMM_FILTERS) that keep GEMMs too small to gain in BF16 under the policy's
    auto: torchao's own for its recipes; per-tensor scaling's for delayed, per-row scaling's for block scales."""
    scales_from_history: bool = False
    """Scales come from earlier steps' amaxes (TE DelayedScaling): a fresh run primes them before its first step, and
    a margin can leave headroom below the FP8 maximum."""
    gathers_in_fp8: bool = False
    """One scale per weight, so FSDP2 can all-gather torchao's FP8 weights (torchao's FP8 all-gather)."""
    weight_grad_in_high_precision: bool = False
    """The weight-gradient GEMM stays in BF16 (torchao's rowwise_with_gw_hp)."""
    block_scaled: bool = False
    """One scale per block of each tensor (blockwise's 1x128 / 128x128, MXFP8's 1x32), not per tensor or row."""
    gemms_on_deepgemm: bool = False
    """TE's modules for this recipe can run their GEMMs on DeepGEMM's dense kernels (TEConfig.blockwise_gemms)."""
    fp8_dispatch: bool = False
    """grouped_fp8 can permute an MoE's tokens to these expert GEMMs in FP8 (GroupedFP8Config.fp8_dispatch): they
    scale activations per 1x128 tile of a row, which a copy of the row keeps."""
    fp8_attention_arch: int | None = None
    """Lowest SM version on which TE trains its FP8 dot-product attention (the recipe's fp8_dpa) under this recipe:
    TE 2.20 runs it only in its fused cuDNN kernels, which take DelayedScaling from sm90 and Float8CurrentScaling and
    MXFP8BlockScaling from sm100; None: no FP8 attention (Float8BlockScaling refuses fp8_dpa; torchao has none)."""


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("delayed", ("te",), "te", "delayed", 16, 89,
               "per-tensor scales from an amax history (TE DelayedScaling)", "hybrid", "tensorwise",
               scales_from_history=True, fp8_attention_arch=90),
        Recipe("tensorwise", ("torchao", "te"), "grouped_fp8", "rowwise", 16, 89,
               "per-tensor dynamic scales", "hybrid", "tensorwise", gathers_in_fp8=True, fp8_attention_arch=100),
        Recipe("rowwise", ("torchao",), "grouped_fp8", "rowwise", 16, 89,
               "per-row dynamic scales (torchao rowwise)", "e4m3", "rowwise"),
        Recipe("rowwise_gw_hp", ("torchao",), "grouped_fp8", "rowwise_gw_hp", 16, 89,
               "per-row scales, weight gradient GEMM kept in BF16 (torchao rowwise_with_gw_hp)", "e4m3", "rowwise",
               weight_grad_in_high_precision=True),
        Recipe("blockwise", ("te",), "grouped_fp8", "blockwise", 128, 90,
               "DeepSeek-style 1x128 activation / 128x128 weight block scales", "e4m3", "rowwise",
               block_scaled=True, gemms_on_deepgemm=True, fp8_dispatch=True),
        Recipe("mxfp8", ("te",), "te", "mxfp8", 32, 100,
               "MXFP8: 1x32 blocks with E8M0 scales (Blackwell tensor cores)", "e4m3", "rowwise", block_scaled=True,
               fp8_attention_arch=100),
    )
}

RECIPE_ALIASES = {"rowwise_with_gw_hp": "rowwise_gw_hp"}
"""Other libraries' names for a recipe (torchao's) -> fp8stack's."""


def is_fp8(name: str) -> bool:
    """Whether a plan recipe name asks for FP8 at all (every name but bf16)."""
    return name != BF16


def recipe_name(name: str) -> str:
    """A recipe name as a user may spell it (fp8stack's, or torchao's via RECIPE_ALIASES) -> fp8stack's name,
    or PlanError listing the valid names."""
    name = RECIPE_ALIASES.get(name, name)
    if name != BF16:
        get_recipe(name)
    return name


BACKEND_LABELS = {
    "te": "TransformerEngine",
    "torchao": "torchao Float8Linear",
    "grouped_fp8": "grouped block-scaled FP8 GEMM (DeepGEMM if installed, else torch scaled GEMMs)",
}


AB_RECIPES = {"te": (BF16, "delayed", "blockwise"), "torchao": (BF16, "tensorwise", "rowwise", "rowwise_gw_hp")}
"""An A/B's arms where TE runs (the recipes measured fastest per scaling family on one H200) and elsewhere (torchao's,
which also run on a CPU)."""

MEGATRON_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""fp8stack recipes megatron-core runs through TransformerEngine (its --fp8-recipe names)."""


def fp8_attention_recipes() -> str:
    """The recipes TE's FP8 dot-product attention trains under, with the SM version each needs ('delayed (sm90+),
    ...'), for refusals."""
    return ", ".join(f"{r.name} (sm{r.fp8_attention_arch}+)" for r in RECIPES.values() if r.fp8_attention_arch)


def fp8_attention_head_dim_problem(head_dim: int, arch: int) -> str:
    """'' when TE's fused FP8 attention trains heads of `head_dim` on sm`arch`, else why (cuDNN's FP8 attention in
    TE 2.20's nvte_get_fused_attn_backend: training on sm90 takes head dim 128 only, sm100+ multiples of 16 up to
    128)."""
    if arch < 100 and head_dim != 128:
        return f"on sm{arch} TE's fused FP8 attention trains head dim 128 only, and this model's is {head_dim}"
    if arch >= 100 and (head_dim % 16 or head_dim > 128):
        return (f"on sm{arch} TE's fused FP8 attention trains head dims that are multiples of 16 up to 128, not "
                f"{head_dim}")
    return ""


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`, or a PlanError listing the valid names."""
    try:
        return RECIPES[name]
    except KeyError:
        raise PlanError(
            f"unknown FP8 recipe {name!r}: use one of {', '.join([BF16, *RECIPES])}"
        ) from None


def dense_backend(recipe: Recipe, preference: str) -> str:
    """The backend that runs dense linears for `recipe` when the user prefers `preference`."""
    if preference == "auto":
        return recipe.dense_backends[0]
    if preference not in recipe.dense_backends:
        raise PlanError(
            f"recipe {recipe.name!r} has no {preference} implementation: "
            f"use --backend {' or '.join(recipe.dense_backends)} (or auto)"
        )
    return preference


EXPERT_BACKENDS = ("grouped_fp8", "te")
"""Where FP8 expert GEMMs may run: fp8stack's grouped kernels (blockwise on DeepGEMM when installed, else torch
scaled_mm per expert; rowwise on torch's scaled grouped GEMM) or TE GroupedLinear."""

BLOCKWISE_GEMMS = ("te", "deepgemm")
"""Where TE's blockwise (Float8BlockScaling) modules run their GEMMs: cuBLAS, or DeepGEMM's dense kernels."""
EXPERT_QUANTIZERS = ("auto", "inductor", "te")
"""What quantizes grouped_fp8's blockwise expert activations and gradients: fp8stack's inductor-compiled quantizers,
TE's Float8BlockQuantizer kernel (DeepGEMM's expert kernels only), or auto: TE's where it can run."""
WGRAD_FLATTENS = ("auto", "copies", "compiled", "triton")
"""What lays out the operands of grouped_fp8's blockwise wgrad GEMM on DeepGEMM (K-grouped, expert by expert): a copy
per expert, one compiled gather per operand, one hand-written Triton tile copy per operand, or auto: the Triton copy
where Triton runs (CUDA operands, Triton importable), the copies elsewhere."""
PARAM_DTYPES = ("fp32", "bf16", "fp8")
"""What a training run keeps its parameters in: FP32 (the master weights themselves), BF16 with FP32 masters in the
optimizer, or BF16 with the TE FP8 linears' weights in FP8 only, FP32 masters in the optimizer
(the training configuration's param_dtype)."""


def expert_paths(recipe: Recipe, dense: str) -> tuple[tuple[str, str], ...]:
    """(backend, recipe) of each way MoE expert GEMMs can run under `recipe` with the dense linears on `dense`: TE
    GroupedLinear runs the recipe itself beside TE linears (or where TE is the recipe's only expert path); grouped_fp8
    runs the grouped scaling the recipe maps to (rowwise for tensorwise). TE first: the path planned where none is
    measured."""
    paths = [("te", recipe.name)] if dense == "te" or recipe.expert_backend == "te" else []
    if recipe.expert_backend == "grouped_fp8":
        paths.append(("grouped_fp8", recipe.expert_recipe))
    return tuple(paths)


def parse_arch(text: str | int) -> int:
    """'sm90' / '90' / 90 / '9.0' -> 90."""
    raw = str(text).strip().lower().removeprefix("sm_").removeprefix("sm")
    try:
        value = int(float(raw) * 10) if "." in raw else int(raw)
    except (ValueError, OverflowError):  # '9.x'; '1.e999' is an infinite float
        raise PlanError(f"cannot read GPU arch {text!r}: write it like sm90 or sm100") from None
    if not 50 <= value <= 200:
        raise PlanError(f"GPU arch {text!r} is out of range: write it like sm90 or sm100")
    return value
