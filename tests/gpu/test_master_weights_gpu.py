"""BF16 parameters with FP32 masters on TE modules (TrainConfig.param_dtype = "bf16", the A/B's --param-dtypes):
TE's fused weight-gradient GEMMs write the FP32 main_grads the masters step from, the BF16 parameters need no cast
(FP8 runs cast them once per step), and a run trains as the FP32-parameter run does, to rounding.
Run with `pytest -m gpu tests/gpu/test_master_weights_gpu.py`."""

import pytest
import torch

from fp8stack.train.config import TrainConfig
from fp8stack.train.loop import session, train

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = dict(model="tiny", backend="te", small_gemm_filter="off", device="cuda", steps=3, warmup=1, micro_batch=2,
                seq_len=128, global_batch=4, eval_batches=0, max_data_bytes=1 << 20, progress=False, fuse_norm=True,
                fuse_mlp=True, gradient_accumulation_fusion=True)
"""The A/B's fastest configuration on the tiny model: TE modules with fused norms and MLPs, two micro-batches per
step, weight gradients accumulated in FP32 by TE's GEMMs."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise"])
def test_bf16_parameters_on_te_train_as_fp32_ones(recipe, compile):
    settings = {**SETTINGS, "recipe": recipe, "compile": compile}
    with session(TrainConfig(**settings, param_dtype="bf16")) as run:
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
    FP8GlobalStateManager.reset()
    bf16 = train(TrainConfig(**settings, param_dtype="bf16"))
    FP8GlobalStateManager.reset()
    fp32 = train(TrainConfig(**settings))
    assert bf16.losses == pytest.approx(fp32.losses, rel=1e-2), (bf16.losses, fp32.losses)
    assert bf16.grad_norms == pytest.approx(fp32.grad_norms, rel=0.05), (bf16.grad_norms, fp32.grad_norms)
    assert not any(bf16.zero_fp8_weight_grads), bf16.zero_fp8_weight_grads
