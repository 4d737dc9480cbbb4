"""The fields a JobConfig leaves None (or auto), chosen for this machine and this model before anything is built:
the measured best where the hardware and stack support it. A run records the resolved configuration, so its
evidence says what ran, and resolving a resolved configuration changes nothing.
"""

from dataclasses import replace

import torch

from fp8stack.backends import deepgemm
from fp8stack.config import (ConfigError, JobConfig, TrainingConfig, check_data_parallel_levers,
                             check_expert_parallel, check_optimizer_moments, check_release_main_grads)
from fp8stack.models import LlamaConfig
from fp8stack.models.training_defaults import training_defaults
from fp8stack.plan.recipes import BF16
from fp8stack.train.defaults import batch_defaults

CPU_ARCH = 90
"""On a CPU the plan targets Hopper: torch's CPU scaled GEMMs emulate its FP8 recipes."""
CUDNN_ATTENTION_MIN_ARCH = 90
"""cuDNN's fused attention is a Hopper kernel (wgmma, TMA); measured fastest on one H200."""


def resolve(job: JobConfig, shape: LlamaConfig | None, world_size: int) -> JobConfig:
    """`job` with device, dtypes, batch, optimizer, kernels and levers chosen: `shape` is the model's (None for
    a model from model.factory, whose size is unknown until built). Points DeepGEMM's JIT cache at
    deepgemm.jit_cache_dir first, before anything imports DeepGEMM."""
    if job.deepgemm.jit_cache_dir is not None:
        try:
            deepgemm.use_jit_cache_dir(job.deepgemm.jit_cache_dir)
        except OSError as err:
            raise ConfigError(f"deepgemm.jit_cache_dir {job.deepgemm.jit_cache_dir!r} cannot be created "
                              f"({err.strerror}): pass a folder this user can write in") from None
    device = _device(job.training.device)
    check_optimizer_moments(job, device)
    on_gpu = device == "cuda"
    arch = _arch() if on_gpu else CPU_ARCH
    training, precision = job.training, job.precision
    dtype = training.dtype if training.dtype != "auto" else ("bf16" if on_gpu else "fp32")
    plain = job.model.impl == "torch"
    if plain:  # now that the process count is known
        check_data_parallel_levers(job, sharded=data_parallel_wrapped(job, world_size))
    if job.parallelism.expert_parallel > 1:  # an MoE model on the Megatron path (JobConfig.validate)
        check_expert_parallel(job, shape.moe.num_experts, world_size)
    default_micro_batch, default_global_batch = batch_defaults(shape, world_size // job.parallelism.tensor_parallel)
    micro_batch = training.micro_batch or default_micro_batch
    global_batch = training.global_batch
    if job.model.factory and training.seq_len is None:
        raise ConfigError("model.factory builds a model whose sequence length fp8stack cannot read: pass "
                          "--seq-length N")
    if global_batch is None and training.micro_batch is None:
        global_batch = default_global_batch
    training = replace(
        training, device=device, dtype=dtype, micro_batch=micro_batch, global_batch=global_batch,
        seq_len=training.seq_len or (shape.seq_len if shape else None),
        param_dtype=training.param_dtype or ("bf16" if dtype == "bf16" and plain
                                             and _bf16_parameters_serve(job, world_size) else "fp32"),
        compile=training.compile if training.compile is not None else on_gpu and job.model.impl == "torch",
        sdpa_backend=training.sdpa_backend or _sdpa_backend(on_gpu, arch, job.model.impl))
    if plain:  # param_dtype resolved
        check_release_main_grads(training, fsdp_wrapped(job, world_size))
    optimizer = job.optimizer
    if shape is not None:  # a factory model's schedule is chosen once it is built (its width)
        defaults = training_defaults(shape, training.steps)
        lr = optimizer.lr or defaults.lr
        optimizer = replace(optimizer, lr=lr, warmup=optimizer.warmup if optimizer.warmup is not None
                            else defaults.warmup, min_lr=optimizer.min_lr if optimizer.min_lr is not None else lr / 10)
    precision = replace(precision, arch=arch,
                        small_gemm_filter="off" if not on_gpu and precision.small_gemm_filter == "auto"
                        else precision.small_gemm_filter,
                        head_on_te=head_on_te(job, training, world_size))
    return replace(job, training=training, optimizer=optimizer, precision=precision)


def head_on_te(job: JobConfig, training: TrainingConfig, world_size: int) -> bool | None:
    """precision.head_on_te for this run: as asked (None: the plan's auto), or off where FSDP2 gathers FP32 weights
    (training.param_dtype fp32) for BF16 activations. There a TE module without FP8 casts its weight to BF16 at each
    forward, and TE (2.20) under fully_shard saves no weight copy for the backward, rebuilding it there with the
    module's FP8 quantizer, which a module without FP8 lacks: its dgrad GEMM gets no weight ("GEMM requested the
    columnwise representation, but it is unavailable"). A whole BF16 model on TE modules (recipe bf16 with backend
    te), or the head asked onto TE, is refused there."""
    fp32_gathered = (job.model.impl == "torch" and fsdp_wrapped(job, world_size) and training.param_dtype == "fp32"
                     and training.dtype == "bf16")
    precision = job.precision
    if not fp32_gathered:
        return precision.head_on_te
    if precision.head_on_te:
        unsaved, fix = "precision.head_on_te puts the output head on a TE module", "drop --head-on-te"
    elif precision.recipe == BF16 and precision.backend == "te":
        unsaved, fix = "precision.recipe bf16 with backend te puts every linear on a TE module", "use --backend auto"
    else:
        return False
    raise ConfigError(f"{unsaved} without FP8, and FSDP2 here all-gathers FP32 weights (training.param_dtype fp32) "
                      "for BF16 activations: TE under fully_shard keeps no BF16 copy of such a weight for the "
                      f"backward, whose GEMM then fails. Use --param-dtype bf16 (FSDP2 then gathers BF16) or {fix}")


def wgrad_fusion(job: JobConfig, plan_has_te_layers: bool, world_size: int) -> bool:
    """te.gradient_accumulation_fusion for this run: as asked, or (None) wherever the plan has TE layers and the run
    can keep FP32 main_grad buffers: megatron's DDP keeps its own; on the plain path one process or DDP (which
    averages them), not FSDP2 (TE writes main_grad outside the autograd gradients it reduce-scatters) nor tensor
    parallelism."""
    if job.te.gradient_accumulation_fusion is not None:
        return job.te.gradient_accumulation_fusion
    if job.model.impl == "megatron":
        return True
    return plan_has_te_layers and job.parallelism.tensor_parallel == 1 and not fsdp_wrapped(job, world_size)


def data_parallel_wrapped(job: JobConfig, world_size: int) -> bool:
    """Whether the plain model runs under its data-parallel wrapper (parallelism.data_parallel): with more than one
    data-parallel rank, or data_parallel_one_rank. Megatron's model runs megatron's own DDP instead."""
    plain = job.model.impl == "torch"
    return plain and (world_size // job.parallelism.tensor_parallel > 1 or job.parallelism.data_parallel_one_rank)


def fsdp_wrapped(job: JobConfig, world_size: int) -> bool:
    """Whether the plain model's data-parallel wrapper is FSDP2 and applies (data_parallel_wrapped)."""
    return data_parallel_wrapped(job, world_size) and job.parallelism.data_parallel == "fsdp"


def _bf16_parameters_serve(job: JobConfig, world_size: int) -> bool:
    """BF16 parameters with FP32 masters serve this layout: without tensor parallelism (one process, DDP's masters
    or FSDP2's mixed precision), or under it where FSDP2's mixed precision keeps them."""
    return job.parallelism.tensor_parallel == 1 or fsdp_wrapped(job, world_size)


def _device(asked: str) -> str:
    if asked == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device cuda requested but torch sees no CUDA GPU: pass --device cpu")
    return asked if asked != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _arch() -> int:
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def _sdpa_backend(on_gpu: bool, arch: int, impl: str) -> str:
    cudnn = on_gpu and impl == "torch" and arch >= CUDNN_ATTENTION_MIN_ARCH and torch.backends.cudnn.is_available()
    return "cudnn" if cudnn else "auto"

