"""megatron-core's tensor_parallel.checkpoint recomputes outside the forward's FP8 autocast.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/7538 (open). CheckpointFunction.backward re-runs
the checkpointed function from autograd's backward, outside the te.autocast the forward ran under,
restoring only the RNG state: TE modules inside recompute in BF16 while the forward ran in FP8
(or fail with FP8 parameters). megatron-core 0.19 calls it directly for --recompute-modules core_attn
and gdn, and for every selective-recompute site (mlp, moe, shared experts) when config.fp8 is unset
while FP8 autocasts are opened inside layers, as fp8stack's plan-driven layers do.

The fix, as the upstream PR: the forward records whether FP8 is on and with which recipe and group,
and runs under TE's activation_recompute_forward(recompute_phase=False); the recompute re-enters
te.autocast with them and activation_recompute_forward(recompute_phase=True), as TE's own
checkpoint and megatron's CheckpointWithoutOutput do.
"""

from contextlib import ExitStack

APPLIES_TO = ("megatron-core", ">=0.19,<0.20")

_MARK = "_fp8stack_original"


def apply() -> str:
    from megatron.core.tensor_parallel.random import CheckpointFunction

    if hasattr(CheckpointFunction, _MARK):
        return "already applied"
    original = CheckpointFunction.forward

    def forward(ctx, run_function, distribute_saved_activations, *args):
        state = _fp8_state()
        if state is None:
            return original(ctx, run_function, distribute_saved_activations, *args)
        from transformer_engine.pytorch.distributed import activation_recompute_forward

        with activation_recompute_forward(activation_recompute=True, recompute_phase=False):
            outputs = original(ctx, run_function, distribute_saved_activations, *args)
        ctx.run_function = _under(state, run_function)  # what backward calls to recompute
        return outputs

    setattr(CheckpointFunction, _MARK, original)
    CheckpointFunction.forward = staticmethod(forward)
    return "applied: tensor_parallel.checkpoint recomputes under the forward's FP8 autocast"


def revert() -> None:
    """Restore megatron's CheckpointFunction.forward (for tests)."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    if hasattr(CheckpointFunction, _MARK):
        CheckpointFunction.forward = staticmethod(getattr(CheckpointFunction, _MARK))
        delattr(CheckpointFunction, _MARK)


def _fp8_state():
    """(recipe, amax group) of the FP8 autocast active now, or None (FP8 off, or no TE)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        return None
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    return FP8GlobalStateManager.get_fp8_recipe(), FP8GlobalStateManager.get_fp8_group()


def _under(state, run_function):
    recipe, group = state

    def recompute(*args):
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.distributed import activation_recompute_forward

        with ExitStack() as stack:
            stack.enter_context(te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group))
            stack.enter_context(activation_recompute_forward(activation_recompute=True, recompute_phase=True))
            return run_function(*args)

    return recompute
