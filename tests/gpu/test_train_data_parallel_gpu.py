"""The trainer's data-parallel wrappers on one GPU, each over a 1-rank NCCL group (parallelism.data_parallel_one_rank):
DDP keeps the one-GPU fast path (TE's fused wgrad on by default, BF16 or FP8 parameters with FP32 masters whose
main_grads it averages) and trains exactly as the unwrapped run, an average over one rank dividing by 1; FSDP2 takes
FP8 parameters with sharded FP32 masters (ShardedMasterWeights) and the fused wgrad off; checkpoints of both resume
bit-identically. Run with `pytest -m gpu tests/gpu/test_train_data_parallel_gpu.py`."""

import math

import pytest
from torch.distributed.fsdp import FSDPModule

from fp8stack.config import from_overrides
from fp8stack.precision import MasterWeights, ShardedMasterWeights
from fp8stack.train import checkpoint
from fp8stack.train.loop import session, train

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = {"model.name": "tiny", "precision.recipe": "delayed", "precision.backend": "te",
            "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 6,
            "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4, "training.seq_len": 128,
            "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False,
            "training.compile": False, "training.sdpa_backend": "auto"}
"""Every GEMM of the tiny model on TE delayed scaling, 2 micro-batches per step (the gradients reduced after the
second); 128-token sequences fit one attention tile, so a run repeats bit for bit. The wgrad fusion is left to
resolve."""
DDP = {"parallelism.data_parallel": "ddp", "parallelism.data_parallel_one_rank": True}
FSDP = {"parallelism.data_parallel": "fsdp", "parallelism.data_parallel_one_rank": True}
MIDDLE = 3
"""The checkpoint resumed from."""


def _train(settings: dict):
    result = train(from_overrides(settings))
    FP8GlobalStateManager.reset()  # each run starts as a new process would: no other model's FP8 buffers
    return result


@pytest.mark.parametrize("param_dtype", ["bf16", "fp8"])
def test_ddp_on_one_rank_trains_exactly_as_the_unwrapped_fast_path(param_dtype):
    settings = {**SETTINGS, "training.param_dtype": param_dtype}
    unwrapped, ddp = _train(settings), _train({**settings, **DDP})
    for run in (unwrapped, ddp):
        assert run.config["te"]["gradient_accumulation_fusion"] is True  # auto: on in one process and under DDP
    assert ddp.losses == unwrapped.losses and ddp.grad_norms == unwrapped.grad_norms


def test_fsdp_on_one_rank_trains_fp8_parameters_on_sharded_masters():
    settings = {**SETTINGS, **FSDP, "training.param_dtype": "fp8"}
    with session(from_overrides(settings)) as run:
        assert isinstance(run.model, FSDPModule) and isinstance(run.masters, ShardedMasterWeights)
        assert run.config.te.gradient_accumulation_fusion is False  # auto: TE cannot under fully_shard
    FP8GlobalStateManager.reset()
    result = _train(settings)
    assert all(map(math.isfinite, result.losses)) and result.losses[-1] < result.losses[0]


@pytest.mark.parametrize(("wrapper", "param_dtype", "masters"), [(DDP, "bf16", MasterWeights),
                                                                  (FSDP, "fp8", ShardedMasterWeights),
                                                                  (FSDP, "fp32", type(None)),
                                                                  (FSDP, "bf16", type(None))],
                         ids=["ddp-bf16", "fsdp-fp8", "fsdp-fp32", "fsdp-bf16"])
def test_resume_under_a_data_parallel_wrapper_is_bit_identical(wrapper, param_dtype, masters, tmp_path):
    """fsdp-fp32: the sharded FP32 parameters are the optimizer's (no masters), the layout under which
    test_resume_restores_bf16_moments_bit_for_bit[fsdp] parted at the second resumed step; here with FP32 moments.
    fsdp-fp32 and fsdp-bf16 gather high-precision weights, which TE casts again in backward, leaving their amaxes
    pending in the checkpoint (checkpoint.load calls fp8stack.after_checkpoint_load, whose TE backend registers them:
    te_modules._WeightCache.register_restored_scaling_state)."""
    settings = {**SETTINGS, **wrapper, "training.param_dtype": param_dtype, "checkpoint.dir": str(tmp_path)}
    with session(from_overrides(settings)) as run:
        assert isinstance(run.masters, masters)
    FP8GlobalStateManager.reset()
    full = _train({**settings, "checkpoint.interval": MIDDLE})
    resumed = _train({**settings, "checkpoint.resume": str(checkpoint.checkpoint_path(tmp_path, MIDDLE)),
                      "checkpoint.trust": True})
    assert resumed.first_step == MIDDLE
    assert resumed.losses == full.losses[MIDDLE:]  # exact equality, not approx
