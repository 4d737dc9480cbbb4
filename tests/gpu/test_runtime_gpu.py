"""The runtime on a GPU: a training step captured as a CUDA graph with each backend (bf16 must capture;
the others capture or say exactly why not), and TE-checkpoint recompute under FP8: the same gradients
as without recompute, the recompute in the forward's FP8 recipe, and the Megatron-LM PR 7538 bug
(torch's checkpoint recomputing outside a model-wide te.autocast) caught by the same probe; a fused
LayerNormMLP recomputing itself (TE's checkpoint option): same gradients, FC1's output not kept.
Run with `pytest -m gpu tests/gpu/test_runtime_gpu.py`."""

import copy

import pytest
import torch
from torch import nn

from fp8stack.models import load_model_config
from fp8stack.backends.te import te_recipe
from fp8stack.bench.runtime import CAPTURE_VARIANTS, build, capture, token_loss
from fp8stack.plan import PolicyConfig
from fp8stack.runtime import PrecisionProbe, checkpoint_module
from fp8stack.runtime.recompute import CheckpointWrapper, recomputes_itself

from gpu_skips import require_cuda, te_runs

pytestmark = pytest.mark.gpu

require_cuda()
_TE_OK, _TE_WHY = te_runs(["tensorwise", "delayed"])  # the FP8 recipes these tests run
needs_te = pytest.mark.skipif(not _TE_OK, reason=_TE_WHY)

RECOMPUTE_REL_ERR = 0.01
"""TE's checkpoint replays the forward with the same inputs and scales: the gradients agree up to the
order of atomic adds in the weight-gradient GEMMs, far inside one FP8 step (~6%)."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    if _TE_OK:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()


@pytest.mark.parametrize("name", list(CAPTURE_VARIANTS))
def test_a_training_step_captures_or_says_why(name):
    if name.startswith("te") and not _TE_OK:
        pytest.skip(_TE_WHY)
    result = capture(name)
    print(f"{name}: {result['summary']}")
    if name == "bf16":
        assert result["captured"], result["summary"]
    else:
        assert result["captured"] or (result["reason"] and result["phase"]), result


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("modules", [("block",), ("mlp",), ("attn",)])
def test_te_checkpoint_recompute_matches_and_runs_in_the_forward_recipe(recipe, modules):
    # unfused: a fused LayerNormMLP recomputes itself (the next test), it is not wrapped
    policy = PolicyConfig(recipe=recipe, backend="te", small_gemm_filter="off", fuse_norm=False, fuse_mlp=False)
    torch.manual_seed(0)
    plain = build("tiny", policy)
    torch.manual_seed(0)
    recomputed = build("tiny", policy, recompute="all", recompute_modules=modules)
    assert any(isinstance(m, CheckpointWrapper) for m in recomputed.modules())
    checkpoint_fns = [m.checkpoint_fn.func for m in recomputed.modules() if isinstance(m, CheckpointWrapper)]
    assert all(fn.__module__ == "transformer_engine.pytorch.distributed" for fn in checkpoint_fns), \
        "the TE FP8 regions must recompute through TE's checkpoint"
    tokens = torch.randint(0, 256, (2, 129), device="cuda")
    token_loss(plain, tokens).backward()
    with PrecisionProbe(recomputed) as probe:
        loss = token_loss(recomputed, tokens)
        with probe.recomputing():
            loss.backward()
    recomputed_calls = [r for calls in probe.records["recompute"].values() for r in calls]
    assert recomputed_calls and all(r["te_module_fp8"] for r in recomputed_calls), probe.records["recompute"]
    assert probe.mismatches() == []
    expected = dict(plain.named_parameters())
    for name, p in recomputed.named_parameters():
        ref = expected[name.replace("._checkpoint_wrapped_module", "")]
        assert rel_err(p.grad, ref.grad) < RECOMPUTE_REL_ERR, name


@needs_te
def test_the_probe_catches_a_recompute_outside_a_model_wide_autocast():
    """Megatron-LM PR 7538: plain te.Linear layers under one model-wide te.autocast. TE's checkpoint
    re-enters the autocast for the recompute; torch's (the bug) recomputes without FP8."""
    import transformer_engine.pytorch as te
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    recipe = te_recipe("tensorwise", "hybrid")
    with torch.device("cuda"):
        region = nn.Sequential(te.Linear(256, 512, params_dtype=torch.bfloat16), nn.GELU(),
                               te.Linear(512, 256, params_dtype=torch.bfloat16))
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run(wrapped: nn.Module) -> PrecisionProbe:
        with PrecisionProbe(wrapped) as probe:
            with te.autocast(enabled=True, recipe=recipe):
                out = wrapped(x)
            with probe.recomputing():
                try:
                    out.float().square().sum().backward()
                except Exception:  # BF16 saved tensors in an FP8 graph may fail the backward: the probe has seen it
                    pass
        return probe

    good = run(checkpoint_module(copy.deepcopy(region), fp8_active=True))
    assert good.records["recompute"] and good.mismatches() == []
    bad = run(checkpoint_wrapper(copy.deepcopy(region), checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                 determinism_check="none"))
    problems = bad.mismatches()
    assert problems and all("'te_module_fp8': False" in p for p in problems), problems


@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_fused_mlp_recomputes_itself_keeps_less_and_matches(recipe):
    """recompute_modules mlp on fuse_mlp's LayerNormMLP sets TE's own checkpoint option instead of wrapping it:
    the forward keeps no FC1 output (BF16, 2 x ffn_dim per token) and the gradients match the run without
    recompute, also in a second round, after delayed scaling has updated its scales once (the recompute
    replays the forward's scales and does not update them twice)."""
    policy = PolicyConfig(recipe=recipe, backend="te", small_gemm_filter="off", fuse_norm=False)  # fuse_mlp's default
    cast_each_pass = {"te": {"cache_fp8_weights": False}}  # no optimizer step between the rounds
    torch.manual_seed(0)
    plain = build("tiny", policy, backend_options=cast_each_pass)
    torch.manual_seed(0)
    recomputed = build("tiny", policy, backend_options=cast_each_pass, recompute="all", recompute_modules=("mlp",))
    config = load_model_config("tiny")
    assert sum(map(recomputes_itself, recomputed.modules())) == config.n_layers
    assert not any(isinstance(m, CheckpointWrapper) for m in recomputed.modules()), "a LayerNormMLP is not wrapped"
    tokens = torch.randint(0, 256, (8, 1025), device="cuda")
    fc1_output_bytes = config.n_layers * tokens[:, 1:].numel() * 2 * config.ffn_dim * 2
    for round_ in range(2):
        held = {}
        for name, model in (("plain", plain), ("recomputed", recomputed)):
            model.zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated()
            loss = token_loss(model, tokens)
            held[name] = torch.cuda.memory_allocated() - before
            loss.backward()
            del loss
        assert held["plain"] - held["recomputed"] > 0.9 * fc1_output_bytes, (held, fc1_output_bytes)
        expected = dict(plain.named_parameters())
        for name, p in recomputed.named_parameters():
            assert rel_err(p.grad, expected[name].grad) < RECOMPUTE_REL_ERR, (round_, name)
