"""The FP8 context a plan gives one megatron-core module: its layer, or one GEMM inside a layer.

`with_precision(cls, recipe, fp8_format)` is `cls` (a TransformerLayer, a TE linear, a TE grouped
linear) whose forward runs under TransformerEngine's autocast: enabled with the plan's recipe, or
disabled for BF16. A disabled autocast matters: with config.fp8 set, megatron's TransformerBlock
wraps every layer in its own FP8 context, and the innermost autocast is the one TE obeys. The
classes are made once per (class, recipe, format) and carry no state of their own besides the TE
recipe object, built on first use from the module's TransformerConfig as megatron builds it
(fp8_utils.get_fp8_recipe) and reduced over the same amax group.
"""

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from functools import cache

import torch

from fp8stack.plan import PlanError
from fp8stack.plan.recipes import FP8_FORMATS, MEGATRON_RECIPES


def te_usable() -> bool:
    """TransformerEngine is installed and CUDA is visible (what megatron's TE spec needs)."""
    if importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a native-library load failure surfaces as OSError, RuntimeError, ...
        return False
    return True


def megatron_te_recipe(config, recipe: str, fp8_format: str):
    """The TE recipe object megatron-core would build for `recipe` from `config`'s FP8 knobs
    (fp8_utils.get_fp8_recipe), without megatron's TEDelayedScaling (see patches/fp8_wgrad_ignored.py)."""
    from transformer_engine.common import recipe as te_recipes

    fmt = {"e4m3": te_recipes.Format.E4M3, "hybrid": te_recipes.Format.HYBRID}[fp8_format]
    dpa = bool(getattr(config, "fp8_dot_product_attention", False))
    if recipe == "delayed":
        return te_recipes.DelayedScaling(
            margin=config.fp8_margin, fp8_format=fmt, amax_compute_algo=config.fp8_amax_compute_algo,
            amax_history_len=config.fp8_amax_history_len, fp8_dpa=dpa,
            fp8_mha=bool(getattr(config, "fp8_multi_head_attention", False)))
    if recipe == "tensorwise":
        return te_recipes.Float8CurrentScaling(fp8_format=fmt, fp8_dpa=dpa)
    if recipe == "blockwise":
        return te_recipes.Float8BlockScaling(fp8_format=fmt)
    return te_recipes.MXFP8BlockScaling(fp8_format=fmt, fp8_dpa=dpa)


class PlanPrecision:
    """Mixin: forward runs under the FP8 autocast the plan gives this module (class attributes)."""

    plan_fp8_recipe: str | None = None
    """fp8stack recipe name, or None: this module runs in BF16 (FP8 autocast disabled)."""
    plan_fp8_format: str = "hybrid"
    """e4m3 or hybrid."""

    def plan_context(self) -> AbstractContextManager:
        """TE autocast, enabled with the plan's recipe or disabled; a no-op without TE (BF16 only)."""
        if not te_usable():
            if self.plan_fp8_recipe is not None:
                raise PlanError(f"{type(self).__name__} runs in FP8 ({self.plan_fp8_recipe}) but TransformerEngine "
                                "with CUDA is not available: run on a GPU machine or use a bf16 plan")
            return nullcontext()
        import transformer_engine.pytorch as te

        if self.plan_fp8_recipe is None:
            return te.autocast(enabled=False)
        recipe = self.__dict__.get("_plan_te_recipe")
        if recipe is None:  # built once: TE keys delayed-scaling state by the recipe
            recipe = megatron_te_recipe(self.config, self.plan_fp8_recipe, self.plan_fp8_format)
            self.__dict__["_plan_te_recipe"] = recipe
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=_amax_group(self.config))

    def forward(self, *args, **kwargs):
        with self.plan_context():
            return super().forward(*args, **kwargs)


@cache
def with_precision(cls: type, recipe: str | None, fp8_format: str) -> type:
    """`cls` whose forward runs under the plan's FP8 autocast (one class per argument triple)."""
    if recipe is not None and recipe not in MEGATRON_RECIPES:
        raise PlanError(f"recipe {recipe!r} has no megatron-core/TransformerEngine implementation: use one of "
                        f"{', '.join(MEGATRON_RECIPES)}")
    if fp8_format not in FP8_FORMATS:
        raise PlanError(f"unknown FP8 format {fp8_format!r}: use e4m3 or hybrid")
    if issubclass(cls, PlanPrecision):
        raise PlanError(f"{cls.__name__} already has a plan precision: apply a plan once")
    tag = f"FP8{recipe.capitalize()}" if recipe else "BF16"
    return type(f"{tag}{cls.__name__}", (PlanPrecision, cls),
                {"plan_fp8_recipe": recipe, "plan_fp8_format": fp8_format, "__module__": __name__,
                 "__doc__": f"{cls.__name__} run {'in ' + recipe + ' FP8' if recipe else 'in BF16'} by the plan."})


def _amax_group(config):
    """The group megatron reduces FP8 amaxes over (fp8_utils.get_fp8_context), when model parallel is set up."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_amax_reduction_group(with_context_parallel=True,
                                                   tp_only_amax_red=getattr(config, "tp_only_amax_red", False))
