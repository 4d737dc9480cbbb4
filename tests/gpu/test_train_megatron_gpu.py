"""The trainer's Megatron path on GPUs with TransformerEngine: megatron's TE linears cast their weights
to FP8 once per step and reuse the copy until told that a new step began (`set_is_first_microbatch`), so
the trainer must tell them after every optimizer step, or every later step runs the step-0 weights.
Megatron's DDP and distributed optimizer (--use-distributed-optimizer) on a one-rank NCCL group train as the
trainer's AdamW does, BF16 parameters train on megatron's mixed precision, and checkpoints in megatron's sharded
layout resume bit-identically, with DDP, the distributed optimizer, the fused wgrad, BF16 parameters and TE's
delayed-scaling state; on two GPUs at TP=2 and at DP=2 too.
Run with `pytest -m gpu tests/gpu/test_train_megatron_gpu.py`."""

import pytest
import torch
import torch.multiprocessing as mp

from gpu_ranks import as_rank, free_ports
from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.train import checkpoint, megatron_model  # noqa: E402
from fp8stack.config import JobConfig, from_overrides  # noqa: E402
from fp8stack.train.loop import _Distributed, session, train  # noqa: E402

RESUMABLE = {"training.steps": 6, "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4,
             "training.seq_len": 128, "data.max_bytes": 1 << 20, "precision.recipe": "delayed"}
"""Two micro-batches per step (DDP reduces after the second) on TE delayed scaling, whose amax histories and scales
the checkpoint keeps; 128-token sequences fit one attention tile, so the BF16 attention backward adds in a fixed
order and a run repeats bit for bit."""
MIDDLE = 3
"""The checkpoint resumed from (checkpoints every MIDDLE steps)."""


@pytest.fixture(autouse=True)
def no_megatron_state_left_by_other_modules():
    """The trainer sets up megatron's parallel state itself; other GPU test modules leave theirs behind. Each test's
    runs start as a new process would: no other model's FP8 buffers."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    yield
    FP8GlobalStateManager.reset()


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


def _train(cfg: JobConfig):
    result = train(cfg)
    FP8GlobalStateManager.reset()  # the next run starts as a new process would
    return result


def test_distributed_optimizer_on_one_rank_trains_as_the_trainers_adamw():
    """--use-distributed-optimizer: megatron's DDP (FP32 grad buffers) and DistributedOptimizer over a one-rank NCCL
    group, stepped by the trainer (its LR schedule, wd only on matrices, clipping at 1.0), against the trainer's
    FP32 AdamW on the same model over 10 steps of two micro-batches. Their first losses are the same forward; the
    first gradient norms the same gradients summed in another order; the losses then stay within 1e-2: TE's
    FusedAdam and torch's fused AdamW round the same update differently, and FP8 casts can flip on such last-bit
    differences."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    settings = {"training.steps": 10, "optimizer.lr": 1e-3, "optimizer.warmup": 2, "training.micro_batch": 2,
                "training.global_batch": 4}
    cfg = megatron_tensorwise({**settings, "optimizer.distributed": True})
    with session(cfg) as run:
        assert isinstance(run.model, DistributedDataParallel) and run.model.ddp_config.use_distributed_optimizer
        assert isinstance(run.optimizer.megatron, DistributedOptimizer)
        decays = {group["wd_mult"]: group["weight_decay"] for group in run.optimizer.param_groups}
        assert decays == {1.0: cfg.optimizer.weight_decay, 0.0: 0.0}  # matrices decay, norm weights do not
    FP8GlobalStateManager.reset()
    distributed, adamw = _train(cfg), _train(megatron_tensorwise(settings))
    assert distributed.lrs == adamw.lrs  # the trainer's schedule on both
    assert distributed.losses[0] == pytest.approx(adamw.losses[0], rel=1e-6)
    assert distributed.grad_norms[0] == pytest.approx(adamw.grad_norms[0], rel=1e-4)
    assert distributed.losses == pytest.approx(adamw.losses, rel=1e-2), (distributed.losses, adamw.losses)
    assert distributed.losses[-1] < distributed.losses[0]


def test_bf16_parameters_train_on_megatrons_mixed_precision():
    """--param-dtype bf16: the GPTModel's parameters are BF16 in Float16Module, megatron's
    Float16OptimizerWithFloat16Params steps FP32 masters of them; it starts from the FP32 run's loss (autocast
    rounds the FP32 run's GEMM weights to BF16 too; norm weights and embeddings differ by that rounding) and
    learns."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.transformer.module import Float16Module

    settings = {"training.steps": 30, "optimizer.lr": 1e-3, "optimizer.warmup": 3}
    cfg = megatron_tensorwise({**settings, "training.param_dtype": "bf16"})
    with session(cfg) as run:
        assert isinstance(run.model.module, Float16Module)
        assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
        assert isinstance(run.optimizer.megatron, Float16OptimizerWithFloat16Params)
        masters = [p for group in run.optimizer.param_groups for p in group["params"]]
        assert masters and all(p.dtype == torch.float32 for p in masters)
    FP8GlobalStateManager.reset()
    bf16, fp32 = _train(cfg), _train(megatron_tensorwise(settings))
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], rel=1e-2)
    head, tail = sum(bf16.losses[:3]) / 3, sum(bf16.losses[-3:]) / 3
    assert all(x == x for x in bf16.losses) and tail < 0.8 * head, bf16.losses


def full_and_resumed(settings: dict, folder) -> tuple:
    """A run checkpointing every MIDDLE steps, and the run resumed from its MIDDLE checkpoint (trusted: TE unpickles
    its own delayed-scaling state)."""
    cfg = megatron_tensorwise({**RESUMABLE, **settings, "checkpoint.dir": str(folder), "checkpoint.interval": MIDDLE})
    full = _train(cfg)
    resumed = _train(from_overrides({"checkpoint.resume": str(checkpoint.checkpoint_path(folder, MIDDLE)),
                                     "checkpoint.trust": True}, cfg))
    return full, resumed


@pytest.mark.parametrize("settings", [
    {"optimizer.distributed": True},
    {"optimizer.distributed": True, "te.gradient_accumulation_fusion": True},
    {"te.gradient_accumulation_fusion": True},
    {"training.param_dtype": "bf16"},
    {"training.param_dtype": "bf16", "optimizer.distributed": True},
], ids=["distributed-optimizer", "distributed-optimizer-fused-wgrad", "adamw-fused-wgrad", "bf16-params",
        "bf16-params-distributed-optimizer"])
def test_megatron_checkpoints_resume_bit_identically(settings, tmp_path):
    """A run resumed from its middle checkpoint (megatron's sharded state dicts: model, the distributed optimizer's
    FP32 shards or AdamW's moments; the rank files: step, data position, scheduler, RNG, TE's FP8 scaling state)
    repeats the uninterrupted run's losses and gradient norms exactly: same state, same kernels, one rank."""
    full, resumed = full_and_resumed(settings, tmp_path)
    assert resumed.first_step == MIDDLE
    assert resumed.losses == full.losses[MIDDLE:]  # exact equality, not approx
    assert resumed.grad_norms == full.grad_norms[MIDDLE:]
    assert resumed.lrs == full.lrs[MIDDLE:]


def _two_gpu_rank(rank: int, ports: list[int], settings: dict, folder: str, out: str) -> None:
    """Rank `rank` of 2, as torchrun would start it: the full run, then the resumed one (each its own rendezvous)."""
    as_rank(rank, 2, ports[0])
    cfg = megatron_tensorwise({**RESUMABLE, **settings, "checkpoint.dir": folder, "checkpoint.interval": MIDDLE})
    full = _train(cfg)
    as_rank(rank, 2, ports[1])
    resumed = _train(from_overrides({"checkpoint.resume": str(checkpoint.checkpoint_path(folder, MIDDLE)),
                                     "checkpoint.trust": True}, cfg))
    torch.save({"full": (full.losses, full.grad_norms), "resumed": (resumed.losses, resumed.grad_norms),
                "first_step": resumed.first_step}, f"{out}{rank}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("settings", [
    {"parallelism.tensor_parallel": 2},
    {"parallelism.tensor_parallel": 2, "optimizer.distributed": True},
    {"optimizer.distributed": True},
], ids=["tp2-adamw", "tp2-distributed-optimizer", "dp2-distributed-optimizer"])
def test_two_gpu_megatron_checkpoints_resume_bit_identically(settings, tmp_path):
    """Two NCCL ranks at TP=2 (sequence parallel; the trainer's AdamW or the distributed optimizer) or DP=2 (the
    distributed optimizer's shards really split): each rank saves its shards at their global offsets, and the run resumed from the middle
    checkpoint repeats the uninterrupted losses exactly (NCCL reduces in a fixed order between the same two GPUs)."""
    folder = tmp_path / "ckpt"
    mp.spawn(_two_gpu_rank, args=(free_ports(2), settings, str(folder), str(tmp_path / "rank")), nprocs=2,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}", weights_only=False) for rank in (0, 1)]
    for found in ranks:
        (full_losses, full_norms), (losses, norms) = found["full"], found["resumed"]
        assert found["first_step"] == MIDDLE
        assert losses == full_losses[MIDDLE:] and norms == full_norms[MIDDLE:]
    assert ranks[0]["full"] == ranks[1]["full"]  # the losses and norms are the ranks' means: the same on both
    assert sorted(p.name for p in (folder / f"step-{MIDDLE:08d}").glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
