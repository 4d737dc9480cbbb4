"""The trainer's Megatron path on one GPU with TransformerEngine: megatron's TE linears cast their weights
to FP8 once per step and reuse the copy until told that a new step began (`set_is_first_microbatch`), so
the trainer must tell them after every optimizer step, or every later step runs the step-0 weights.
Run with `pytest -m gpu tests/gpu/test_train_megatron_gpu.py`."""


import pytest
import torch

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te()

import transformer_engine.pytorch as te  # noqa: E402

from fp8stack.train import megatron_model  # noqa: E402
from fp8stack.config import JobConfig, from_overrides  # noqa: E402
from fp8stack.train.loop import _Distributed, train  # noqa: E402


@pytest.fixture(autouse=True)
def no_megatron_state_left_by_other_modules():
    """The trainer sets up megatron's parallel state itself; other GPU test modules leave theirs behind."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def megatron_tensorwise(overrides: dict) -> JobConfig:
    return from_overrides({"model.name": "tiny", "model.impl": "megatron", "precision.recipe": "tensorwise",
                           "precision.backend": "te", "training.device": "cuda", "training.eval_batches": 0,
                           "te.gradient_accumulation_fusion": False, "logging.progress": False, **overrides})


def test_each_optimizer_step_marks_a_new_step_for_the_fp8_weight_cache():
    cfg = megatron_tensorwise({"training.steps": 1})
    with _Distributed(cfg) as env, megatron_model.build(cfg, env) as built:
        fp8_linears = [m for m in built.model.decoder.modules()
                       if isinstance(m, (te.Linear, te.LayerNormLinear)) and hasattr(m, "is_first_microbatch")]
        assert fp8_linears, "the plan puts the tiny model's layers in FP8: TE linears expected"
        tokens = torch.randint(0, 256, (2, built.seq_len), device=env.device)
        built.loss(tokens, tokens.roll(-1, 1)).backward()
        assert not any(m.is_first_microbatch for m in fp8_linears), "after a forward TE reuses its FP8 weights"
        built.after_optimizer_step()
        assert all(m.is_first_microbatch for m in fp8_linears), "the next step must cast the updated weights"


def test_megatron_fp8_training_learns():
    result = train(megatron_tensorwise({"training.steps": 30, "optimizer.lr": 1e-3, "optimizer.warmup": 3}))
    head, tail = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert all(x == x for x in result.losses) and tail < 0.8 * head, result.losses


def test_fused_wgrad_accumulation_writes_te_weight_gradients_into_main_grad():
    """--gradient-accumulation-fusion: megatron's DDP holds FP32 main_grad buffers and the TE linears' wgrad
    GEMMs write into them (no autograd .grad for those weights); two micro-batches per step then train as
    autograd's gradients do: the same first loss (no update yet) and losses within BF16 wgrad rounding."""
    from megatron.core.distributed import DistributedDataParallel

    cfg = megatron_tensorwise({"training.steps": 1, "te.gradient_accumulation_fusion": True})
    with _Distributed(cfg) as env, megatron_model.build(cfg, env) as built:
        assert isinstance(built.model, DistributedDataParallel) and built.main_grads
        te_weights = [m.weight for m in built.model.module.decoder.modules()
                      if isinstance(m, (te.Linear, te.LayerNormLinear)) and m.fuse_wgrad_accumulation]
        assert te_weights, "the TE linears must be switched to fused wgrad accumulation"
        tokens = torch.randint(0, 256, (2, built.seq_len), device=env.device)
        built.loss(tokens, tokens.roll(-1, 1)).backward()
        assert all(w.grad_added_to_main_grad and w.main_grad.dtype == torch.float32 for w in te_weights)
        assert all(w.main_grad.abs().sum() > 0 for w in te_weights), "the wgrad GEMMs wrote no gradient"

    settings = {"training.steps": 5, "optimizer.lr": 1e-3, "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4}
    fused = train(megatron_tensorwise({**settings, "te.gradient_accumulation_fusion": True}))
    plain = train(megatron_tensorwise(settings))
    assert fused.losses[0] == pytest.approx(plain.losses[0], rel=1e-5)
    assert fused.grad_norms[0] == pytest.approx(plain.grad_norms[0], rel=1e-2)
    assert fused.losses == pytest.approx(plain.losses, rel=2e-2), (fused.losses, plain.losses)


@pytest.mark.parametrize("fusion", [False, True], ids=["autograd", "main-grad"])
def test_delayed_scaling_is_primed_on_the_megatron_path(fusion):
    """The trainer primes megatron's delayed-scaling TE linears as the plain path's (fp8_priming_passes): with
    E4M3 gradients, where an unprimed first step flushes them, no FP8 weight gradient of the first steps is zero,
    with autograd gradients and with DDP's main_grad buffers (zeroed again after the priming passes)."""
    cfg = megatron_tensorwise({"training.steps": 3, "training.micro_batch": 2, "training.global_batch": 4,
                               "te.gradient_accumulation_fusion": fusion, "precision.recipe": "delayed",
                               "precision.fp8_format": "e4m3"})
    result = train(cfg)
    assert result.zero_fp8_weight_grads == [[], [], []], result.zero_fp8_weight_grads
