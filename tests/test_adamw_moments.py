"""optimizer.moments on a CPU: the field and its refusals (BF16 moments need TransformerEngine's FusedAdam on a GPU;
megatron's precision-aware optimizer runs inside its distributed optimizer), fp32 is today's torch AdamW exactly
(fp8stack.precision.adamw and the trainer's optimizer), every A/B arm takes the field, and megatron's optimizer gets
its own options for it (every A/B arm takes the field: tests/test_ab.py). BF16 moments themselves run in tests/gpu/test_bf16_moments_gpu.py."""

import importlib.util

import pytest
import torch

from fp8stack.config import ConfigError, JobConfig, OptimizerConfig, from_overrides
from fp8stack.config.job import OPTIMIZER_MOMENTS
from fp8stack.precision import MOMENTS, adamw
from fp8stack.train.defaults import ADAM_BETAS, ADAM_EPS
from fp8stack.train.loop import session
from fp8stack.train.megatron_model import precision_aware

FIND_SPEC = importlib.util.find_spec


@pytest.fixture
def te_installed(monkeypatch):
    """importlib finds transformer_engine (the checks look for it; nothing imports it here)."""
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "transformer_engine" else FIND_SPEC(name, *args))


def test_the_field_defaults_to_fp32_and_takes_the_library_choices():
    assert OptimizerConfig().moments == "fp32" and JobConfig().optimizer.moments == "fp32"
    assert OPTIMIZER_MOMENTS == MOMENTS == ("fp32", "bf16")
    with pytest.raises(ConfigError, match="unknown optimizer.moments 'fp16': use fp32, bf16"):
        from_overrides({"optimizer.moments": "fp16"})


@pytest.mark.parametrize("device, message", [
    ("cpu", "optimizer.moments bf16 needs TransformerEngine's FusedAdam on a GPU, and this run is on a CPU: run on a "
            "GPU, or drop --optimizer.moments bf16"),
    ("cuda", "optimizer.moments bf16 needs TransformerEngine's FusedAdam on a GPU, and transformer_engine is not "
             "installed: pip install 'fp8stack[te]', or drop --optimizer.moments bf16")])
def test_bf16_moments_without_a_gpu_or_te_are_refused(device, message, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformer_engine" else FIND_SPEC(name, *args))
    with pytest.raises(ConfigError) as refused:
        from_overrides({"optimizer.moments": "bf16", "training.device": device})
    assert str(refused.value) == message


def test_bf16_moments_on_megatrons_mixed_precision_optimizer_need_the_distributed_one(te_installed):
    settings = {"optimizer.moments": "bf16", "model.impl": "megatron", "training.param_dtype": "bf16"}
    with pytest.raises(ConfigError, match="megatron runs inside its distributed optimizer only: add "
                                          "--use-distributed-optimizer, or use --param-dtype fp32"):
        from_overrides(settings)
    assert from_overrides({**settings, "optimizer.distributed": True}).optimizer.moments == "bf16"
    assert from_overrides({**settings, "training.param_dtype": "fp32"}).optimizer.moments == "bf16"  # trainer's AdamW


def test_bf16_moments_are_taken_under_fsdp2(te_installed):
    """TE's FusedAdam steps DTensor parameters (its states DTensors of the same placements)."""
    job = from_overrides({"optimizer.moments": "bf16", "parallelism.data_parallel": "fsdp",
                          "parallelism.data_parallel_one_rank": True})
    assert (job.optimizer.moments, job.parallelism.data_parallel) == ("bf16", "fsdp")


def test_megatrons_optimizer_maps_bf16_moments_onto_its_precision_aware_optimizer():
    assert precision_aware("fp32") == {}
    assert precision_aware("bf16") == {"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
                                       "exp_avg_sq_dtype": torch.bfloat16, "store_param_remainders": False}


def _groups(seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    matrix, norm = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    return [{"params": [matrix], "weight_decay": 0.1}, {"params": [norm], "weight_decay": 0.0}]


def _steps(optimizer: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for step in range(steps):
        torch.manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_fp32_moments_are_torchs_adamw_exactly():
    ours = adamw(_groups(), moments="fp32", lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS)
    torchs = torch.optim.AdamW(_groups(), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS, fused=False)  # the trainer's on a CPU
    assert type(ours) is torch.optim.AdamW and ours.defaults == torchs.defaults
    for mine, theirs in zip(_steps(ours), _steps(torchs), strict=True):
        assert torch.equal(mine, theirs)
    assert all(t.dtype == torch.float32 for state in ours.state.values() for t in state.values())


def test_the_trainer_steps_torchs_adamw_with_fp32_moments():
    settings = {"training.device": "cpu", "training.steps": 1, "training.micro_batch": 2, "training.seq_len": 64,
                "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False}
    with session(from_overrides(settings)) as run:
        assert type(run.optimizer) is torch.optim.AdamW
        assert run.optimizer.defaults["betas"] == ADAM_BETAS and run.optimizer.defaults["fused"] is False


def test_the_library_refuses_moments_it_cannot_keep():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="BF16 Adam moments need TransformerEngine's FusedAdam on a GPU, and some "
                                         "parameters are not on CUDA"):
        adamw(params, moments="bf16")
    with pytest.raises(ValueError, match="unknown moments 'fp8': use fp32, bf16"):
        adamw(params, moments="fp8")

