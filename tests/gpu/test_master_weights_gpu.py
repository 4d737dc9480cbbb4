"""BF16 parameters with FP32 masters on TE modules (training.param_dtype = "bf16", the A/B's --param-dtypes):
TE's fused weight-gradient GEMMs write the FP32 main_grads the masters step from, the BF16 parameters need no cast
(FP8 runs cast them once per step), and a run trains as the FP32-parameter run does, to rounding. With param_dtype
"fp8" the TE FP8 layers hold their weights in FP8 only, quantized from the masters, and train as FP32 ones do.
Run with `pytest -m gpu tests/gpu/test_master_weights_gpu.py`."""

import pytest
import torch

from fp8stack.config import JobConfig, from_overrides
from fp8stack.train.loop import session, train

from gpu_skips import require_te, te_mark

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch import QuantizedTensor  # noqa: E402
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = {"model.name": "tiny", "precision.backend": "te", "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 3, "optimizer.warmup": 1, "training.micro_batch": 2, "training.seq_len": 128, "training.global_batch": 4, "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False, "precision.fuse_norm": True, "precision.fuse_mlp": True, "te.gradient_accumulation_fusion": True,
            "training.compile": False, "training.sdpa_backend": "auto"}
"""The A/B's fastest configuration on the tiny model: TE modules with fused norms and MLPs, two micro-batches per
step, weight gradients accumulated in FP32 by TE's GEMMs."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise"])
def test_bf16_parameters_on_te_train_as_fp32_ones(recipe, compile):
    settings = {**SETTINGS, "precision.recipe": recipe, "training.compile": compile}
    with session(from_overrides({**settings, "training.param_dtype": "bf16"})) as run:
        te_weights = [p for m in run.model.modules() if isinstance(m, TransformerEngineBaseModule)
                      for p in m.parameters(recurse=False) if p.ndim == 2]
        assert te_weights and {p.dtype for p in te_weights} == {torch.bfloat16}
        assert {p.main_grad.dtype for p in te_weights} == {torch.float32}
        tokens, targets = (t.chunk(2)[0].cuda() for t in next(iter(run.data)))
        with run.autocast():
            run.loss_fn(tokens, targets).backward()
        for param in te_weights:  # TE's wgrad GEMM wrote the FP32 main_grad; no BF16 gradient exists
            assert param.grad is None and param.main_grad.abs().sum() > 0
        run.masters.after_step()
    assert_trains_as_fp32_parameters(settings, "bf16")


def assert_trains_as_fp32_parameters(settings: dict, param_dtype: str) -> None:
    """A run with `param_dtype` and one with FP32 parameters, from one seed: losses to 1%, gradient norms to 5%, and
    no FP8 weight with an all-zero gradient."""
    FP8GlobalStateManager.reset()
    other = train(from_overrides({**settings, "training.param_dtype": param_dtype}))
    FP8GlobalStateManager.reset()
    fp32 = train(from_overrides({**settings}))
    assert other.losses == pytest.approx(fp32.losses, rel=1e-2), (other.losses, fp32.losses)
    assert other.grad_norms == pytest.approx(fp32.grad_norms, rel=0.05), (other.grad_norms, fp32.grad_norms)
    assert not any(other.zero_fp8_weight_grads), other.zero_fp8_weight_grads


@pytest.mark.parametrize("fusion", [True, False], ids=["wgrad-fusion", "autograd-grads"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise",
                                    pytest.param("blockwise", marks=te_mark(["blockwise"]))])
def test_fp8_parameters_hold_no_high_precision_copy_and_train_as_fp32_ones(recipe, compile, fusion):
    settings = {**SETTINGS, "precision.recipe": recipe, "training.compile": compile, "te.gradient_accumulation_fusion": fusion}
    with session(from_overrides({**settings})) as reference:
        initial = {name: p.detach().clone() for name, p in reference.model.named_parameters()}
    FP8GlobalStateManager.reset()
    with session(from_overrides({**settings, "training.param_dtype": "fp8"})) as run:
        fp8_modules = [m for m in run.model.modules()
                       if isinstance(m, TransformerEngineBaseModule) and m.autocast_recipe is not None]
        fp8_weights = {id(p) for m in fp8_modules for p in m.parameters(recurse=False) if p.ndim == 2}
        named = dict(run.model.named_parameters())
        assert fp8_weights and all(isinstance(named[n], QuantizedTensor) for n in named if id(named[n]) in fp8_weights)
        assert {p.dtype for p in named.values() if id(p) not in fp8_weights} == {torch.bfloat16}
        masters = dict(run.masters.module.named_parameters())
        for name, param in named.items():  # the masters start from the FP32 weights, not from their FP8 values
            assert torch.equal(masters[name], initial[name]), name
            assert getattr(param, "get_high_precision_init_val", lambda: None)() is None, "TE's CPU copy was freed"
        tokens, targets = (t.chunk(2)[0].cuda() for t in next(iter(run.data)))
        with run.autocast():
            run.loss_fn(tokens, targets).backward()
        for name, param in named.items():
            if id(param) in fp8_weights:
                assert param.main_grad.abs().sum() > 0, name
                assert param.grad is None, f"{name}: the FP32 main_grad holds the gradient, nothing else"
        with torch.no_grad():
            for master in masters.values():
                master.mul_(0.9)  # as an optimizer step would move them (not up: past a delayed scale's range)
        run.masters.after_step()
        for name, param in named.items():  # copying the masters in quantized them again
            if id(param) in fp8_weights:
                torch.testing.assert_close(param.dequantize(dtype=torch.float32), masters[name], rtol=0.07,
                                           atol=1e-3 * masters[name].abs().max().item())
    assert_trains_as_fp32_parameters(settings, "fp8")
