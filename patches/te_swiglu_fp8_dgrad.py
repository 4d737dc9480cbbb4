"""TransformerEngine 2.20: LayerNormMLP's SwiGLU backward under delayed scaling writes its gradient in BF16, then
casts it to FP8 in a second pass that also reduces a bias gradient a bias-free MLP throws away.

Upstream: https://github.com/NVIDIA/TransformerEngine, transformer_engine/pytorch/module/layernorm_mlp.py (read at
2.20.2): _get_act_func_supported_list gives 'swiglu' no fused dbias + dact + quantize entry for DelayedScaling, so
_LayerNormMLP.backward runs tex.dswiglu into BF16 (dgated_act_kernel) and then tex.bgrad_quantize
(cast_transpose_fusion_kernel with a dbias reduction). No upstream issue found. tex.dswiglu takes the FC1 gradient's
quantizer itself (TE's own ops.SwiGLU passes it) and writes the FP8 data, its transpose and the amax in one call: the
BF16 gradient is never stored, and the gradient is rounded once (FP32 -> FP8) instead of twice (FP32 -> BF16 -> FP8),
as TE's fused entries for GELU and ReLU do: about 1.5% of the FP8 values move by one step, the gradient ends at least
as close to the FP32 one and its amax is the FP32 one's (GPU test; profiles/runs/2026-11-25-probe-dswiglu-fp8-h100/).

The patch: _LayerNormMLP's forward notes on its autograd context whether FC1 has a bias; its backward, for an MLP
without one, lets _act_func offer that fused entry for swiglu under delayed scaling (TE checks its debug mode first,
which keeps its own path). The entry's bias gradient is None, which TE returns for a missing bias anyway. Every other
LayerNormMLP runs TE's code unchanged.
"""

from contextvars import ContextVar

APPLIES_TO = ("transformer-engine", ">=2.20,<2.21")

_MARK = "_fp8stack_original"
_BIAS_FREE = "fp8stack_fc1_bias_free"
"""Set on _LayerNormMLP's autograd context by the patched forward: True when FC1 has no bias."""
_FUSED = ContextVar("fp8stack_swiglu_fp8_dgrad", default=False)
"""True while a patched backward that may fuse runs: _act_func then offers the fused swiglu entry."""
WHAT = "LayerNormMLP's bias-free SwiGLU backward under delayed scaling writes its FP8 gradient in one TE call"


def apply() -> str:
    from transformer_engine.pytorch.module import layernorm_mlp

    function = layernorm_mlp._LayerNormMLP
    if hasattr(function, _MARK):
        return f"already applied: {WHAT}"
    forward, backward, act_func = function.forward, function.backward, layernorm_mlp._act_func

    def patched_forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_weight_workspace, fc1_bias, *rest):
        if ctx is not None:  # TE calls forward(None, ...) itself when grad is disabled
            setattr(ctx, _BIAS_FREE, fc1_bias is None)
        return forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_weight_workspace, fc1_bias, *rest)

    def patched_backward(ctx, *grad_outputs):
        if not getattr(ctx, _BIAS_FREE, False):
            return backward(ctx, *grad_outputs)
        # The recipe is checked in _act_func: with checkpoint=True, TE sets ctx.fp8 and ctx.fp8_recipe only
        # when backward recomputes the forward.
        token = _FUSED.set(True)
        try:
            return backward(ctx, *grad_outputs)
        finally:
            _FUSED.reset(token)

    def patched_act_func(activation, recipe=None):
        funcs = act_func(activation, recipe)
        if _FUSED.get() and activation == "swiglu" and recipe is not None and recipe.delayed():
            return (*funcs[:2], _dswiglu_quantize)
        return funcs

    setattr(function, _MARK, (forward, backward, act_func))
    function.forward = staticmethod(patched_forward)
    function.backward = staticmethod(patched_backward)
    layernorm_mlp._act_func = patched_act_func
    return f"applied: {WHAT}"


def revert() -> None:
    """Restore TE's _LayerNormMLP.forward, .backward and _act_func (for tests)."""
    from transformer_engine.pytorch.module import layernorm_mlp

    function = layernorm_mlp._LayerNormMLP
    if hasattr(function, _MARK):
        forward, backward, act_func = getattr(function, _MARK)
        function.forward, function.backward = staticmethod(forward), staticmethod(backward)
        layernorm_mlp._act_func = act_func
        delattr(function, _MARK)


def _dswiglu_quantize(grad, fc1_out, quantizer, **activation_params):
    """(bias gradient, FP8 gradient of FC1's output): what TE's fused dbias + dact + quantize entries return; the
    patched backward calls it only for an FC1 without bias, so the bias gradient is None."""
    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension, transformer_engine_torch)
    import transformer_engine_torch as tex

    return None, tex.dswiglu(grad, fc1_out, quantizer, **activation_params)
