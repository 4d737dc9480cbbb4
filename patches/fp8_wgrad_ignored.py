"""megatron-core 0.19 + TransformerEngine 2.20: --no-fp8-wgrad (config.fp8_wgrad=False) is silently ignored.

Upstream: megatron-core 0.19.2's get_fp8_recipe (https://github.com/NVIDIA/Megatron-LM, megatron/core/fp8_utils.py)
passes override_linear_precision=(False, False, not config.fp8_wgrad) to TEDelayedScaling
(megatron/core/extensions/transformer_engine.py), but TE 2.20.2's DelayedScaling has no such field
(https://github.com/NVIDIA/TransformerEngine, transformer_engine/common/recipe/__init__.py). No upstream
issue found yet; both sources read at those versions.
TE's recipes are pydantic dataclasses, which drop unknown keyword arguments without a word (checked:
TEDelayedScaling((False, False, True)) builds and has no override_linear_precision). The other recipes
(tensorwise, blockwise, mxfp8) never read fp8_wgrad. So a run asking for BF16 weight gradients gets
FP8 ones. The patch makes get_fp8_recipe refuse fp8_wgrad=False with the fix, instead of training
differently from what was asked.
"""

from functools import wraps

APPLIES_TO = ("transformer-engine", ">=2.20,<3")

_MARK = "_fp8stack_original"


def apply() -> str:
    from transformer_engine.common.recipe import DelayedScaling
    from megatron.core import fp8_utils

    if "override_linear_precision" in getattr(DelayedScaling, "__dataclass_fields__", {}):
        return "not needed: this TransformerEngine's DelayedScaling still has override_linear_precision"
    if hasattr(fp8_utils.get_fp8_recipe, _MARK):
        return "already applied"
    original = fp8_utils.get_fp8_recipe

    @wraps(original)
    def get_fp8_recipe(config):
        if not getattr(config, "fp8_wgrad", True):
            raise ValueError(
                "config.fp8_wgrad=False (--no-fp8-wgrad) asks for BF16 weight-gradient GEMMs, but megatron-core "
                "0.19 passes it to TransformerEngine as override_linear_precision, which TE 2.20 drops silently "
                "(and the tensorwise/blockwise/mxfp8 recipes never read it): drop --no-fp8-wgrad, or keep the "
                "weight gradients high precision another way (an fp8stack plan keeping those GEMMs BF16)")
        return original(config)

    setattr(get_fp8_recipe, _MARK, original)
    fp8_utils.get_fp8_recipe = get_fp8_recipe
    return "applied: get_fp8_recipe refuses fp8_wgrad=False instead of ignoring it"


def revert() -> None:
    """Restore megatron's get_fp8_recipe (for tests)."""
    from megatron.core import fp8_utils

    original = getattr(fp8_utils.get_fp8_recipe, _MARK, None)
    if original is not None:
        fp8_utils.get_fp8_recipe = original
