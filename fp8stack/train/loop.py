"""The training loop: plain-torch model -> plan -> assemble -> AdamW steps on stdlib text.

Precision, as the plan's FP32 list says: parameters (master weights) and AdamW moments are FP32;
activations run in `dtype` (bf16 through torch.autocast, or fp32); FP8 modules cast their own
inputs; loss, gradient norm and clipping are FP32.
"""

import functools
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.tensorboard import SummaryWriter

from fp8stack.backends.te import import_before_cudnn
from fp8stack.models import Llama, LlamaConfig
from fp8stack.plan import Plan, PolicyConfig, make_plan
from fp8stack.plan.from_module import describe_module
from fp8stack.runtime.attention import SDPA_BACKENDS, check_sdpa_backend, sdpa_backend
from fp8stack.runtime.compress import ActivationCompressor, compress_saved_activations
from fp8stack.runtime.numerics import zero_fp8_weight_grads
from fp8stack.runtime.recompute import RECOMPUTE_MODULES
from fp8stack.train import checkpoint, comm_stats, fault
from fp8stack.train.data import DATA_SOURCES, DEFAULT_MAX_BYTES, TextData
from fp8stack.train.timing import steady_state

MODELS = {"tiny": LlamaConfig.tiny, "tiny-moe": LlamaConfig.tiny_moe, "llama-1b-like": LlamaConfig.llama_1b_like}
"""Model name -> its LlamaConfig."""
MODEL_IMPLS = ("torch", "megatron")
"""How the model is built: the plain-torch Llama, or a megatron-core GPTModel (TrainConfig.model_impl)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CPU_ARCH = 90
"""On a CPU the plan targets Hopper: torch's CPU scaled GEMMs emulate its FP8 recipes."""


class TrainConfigError(ValueError):
    """A training option that cannot work; the message names the fix."""


@dataclass
class TrainConfig:
    """One training run. Defaults suit the tiny model on a CPU."""

    model: str = "tiny"
    """Model name: tiny | tiny-moe | llama-1b-like."""
    model_impl: str = "torch"
    """torch: the plain-torch model through assemble; megatron: a megatron-core GPTModel of the same shape
    through fp8stack's block factory, TE FP8, tensor parallel over megatron's parallel_state (megatron_model.py)."""
    fused_projections: bool = True
    """Fused wqkv / w13 GEMMs; False builds wq/wk/wv and w1/w3, which tensor_parallel > 1 needs."""
    recipe: str = "bf16"
    """FP8 recipe (delayed, tensorwise, rowwise, rowwise_gw_hp, blockwise, mxfp8) or bf16 for none."""
    backend: str = "auto"
    """Backend for dense linears: auto | te | torchao."""
    fp8_format: str | None = None
    """e4m3, or hybrid (E4M3 forward, E5M2 gradients); None takes the recipe's library default."""
    fp8_margin: int = 0
    """Megatron's --fp8-margin, recipe delayed only: each scale leaves 2^margin headroom below the FP8 maximum
    (TE DelayedScaling.margin), for tensors whose amax outgrows the previous step's."""
    first_last_layers_bf16: bool = False
    """Keep the first and last layers in BF16 (Megatron's --first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """Layers kept BF16 at the start with first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers kept BF16 at the end with first_last_layers_bf16."""
    small_gemm_filter: str = "auto"
    """rowwise | tensorwise | off; auto is off on a CPU (the filter's thresholds are H100 timings and
    the CPU run exists to exercise FP8 numerics) and the policy's default on a GPU."""
    steps: int = 40
    """Optimizer steps."""
    warmup: int = 4
    """Steps of linear LR warm-up from 0 to lr."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; None: lr / 10 (a fixed floor would leave a lower peak
    LR barely decayed: 2e-4 under a 3e-4 peak kept the 1B runs' late losses as noisy as their early ones)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (computed in FP32) to this; 0 disables clipping."""
    fp8_priming_passes: int = 2
    """Forward/backward passes of the first batch, gradients discarded, before the first step of a run (not a
    resumed one) whose plan uses TE delayed scaling: its scales start at 1 and take their first values from the
    amaxes of the pass before, so step 1's FP8 gradient casts would flush (every FP8 weight gradient of
    llama-1b-like was zero in its step 1, profiles/NOTES.md section 12). Two passes: the FP8 casts of wqkv's and
    FC1's gradients receive zeros until wo's and FC2's scales are set; 0 turns priming off."""
    fp8_grad_check_steps: int = 3
    """First steps after which the FP8 weights whose whole gradient is zero are recorded and warned about
    (runtime.numerics.zero_fp8_weight_grads; one host sync per checked step); 0 turns the check off."""
    micro_batch: int = 8
    """Sequences per forward/backward pass and data-parallel rank."""
    global_batch: int | None = None
    """Sequences per optimizer step over all data-parallel ranks (Megatron's --global-batch-size): each rank
    accumulates the gradients of global_batch / (micro_batch x ranks) micro-batches; None: one micro-batch."""
    seq_len: int | None = None
    """Tokens per sequence; None takes the model's seq_len."""
    seed: int = 0
    """Seeds weights and data: the same seed gives the same run in every arm and process."""
    dtype: str = "auto"
    """Activation dtype: bf16 (torch.autocast) | fp32; auto is bf16 on CUDA, fp32 on a CPU."""
    device: str = "auto"
    """cuda | cpu | auto (cuda when available; under torchrun, cuda:LOCAL_RANK)."""
    compile: bool = False
    """torch.compile the blocks (assembly stage 4)."""
    sdpa_backend: str = "auto"
    """Attention kernel on a GPU: auto (torch's choice) | cudnn | flash | efficient (fp8stack.runtime.attention)."""
    fuse_norm: bool = False
    """Fold each block's RMSNorms into the TE LayerNormLinear they feed (needs TE layers in the plan)."""
    fuse_mlp: bool = False
    """Run each dense block's ffn_norm + SwiGLU FeedForward as one TE LayerNormMLP (needs its w13 and w2 on TE)."""
    compress_activations: bool = False
    """Store the BF16 activations autograd saves for backward as FP8 E4M3 with a per-tensor scale
    (fp8stack.runtime.compress); weights, FP32 and FP8 tensors are kept. Rolled back on llama-1b-like (profiles/NOTES.md
    section 7: 0.86x memory but +12% loss at 300 steps and slower than BF16)."""
    recompute: str | None = None
    """Blocks whose activations are recomputed in the backward: 'all', comma-separated indices ('0,2'), or None."""
    recompute_modules: tuple[str, ...] = ("block",)
    """What is recomputed in those blocks: 'block' (all of it) or Megatron's --recompute-modules names
    (core_attn, attn, mlp, moe, moe_act, shared_experts, layernorm)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree; the remaining ranks shard data and parameters with FSDP2."""
    gradient_accumulation_fusion: bool = False
    """model_impl megatron: megatron's DistributedDataParallel keeps an FP32 main_grad buffer per parameter and
    the TE linears' weight-gradient GEMMs write into it (TE fuse_wgrad_accumulation), with no BF16 weight
    gradient, dtype conversion or per-micro-batch add; the other parameters' gradients are added by DDP."""
    fsdp_one_rank: bool = False
    """Shard with FSDP2 even when there is one data-parallel rank (a 1-rank mesh), so a 1-GPU run takes a sharded
    run's numerics (BF16 parameters by FSDP's mixed-precision policy, FP8 all-gather casts) instead of autocast
    over FP32 parameters: the reference a sharded run's loss is compared with."""
    fsdp_float8_all_gather: bool = False
    """All-gather FSDP2 weights in FP8 (torchao tensorwise only)."""
    precompute_fp8_scales: bool = False
    """With fsdp_float8_all_gather: compute all weight scales in one op after each optimizer step."""
    profile_collectives: int = 0
    """Count the collectives and their bytes over this many steps after the first (comm_stats, torch.profiler);
    0 counts none. Reported per step in TrainResult.collectives."""
    eval_batches: int = 4
    """Validation batches evaluated after the last step (0 skips validation)."""
    max_data_bytes: int = DEFAULT_MAX_BYTES
    """Read at most this much source text (both splits)."""
    data_source: str = "stdlib"
    """stdlib: the interpreter's standard-library sources; python: those, then its site-packages' sources (several
    times the text: long loss runs stay under one pass over it). train.data.DATA_SOURCES."""
    log_dir: str | None = None
    """Folder for train.jsonl and TensorBoard scalars; None logs nothing to disk."""
    log_interval: int = 10
    """Steps between plain log lines when no progress bar is shown (not a TTY)."""
    checkpoint_dir: str | None = None
    """Folder for checkpoints (step-<N>); None saves none."""
    checkpoint_interval: int = 0
    """Save every this many steps (and after the last); 0 saves only after the last step."""
    resume: str | None = None
    """'latest' (newest under checkpoint_dir) or a checkpoint folder to continue from; None starts fresh."""
    progress: bool = True
    """Show a rich progress bar when stdout is a terminal."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise TrainConfigError(f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.dtype not in ("auto", *DTYPES):
            raise TrainConfigError(f"unknown dtype {self.dtype!r}: use auto, {' or '.join(DTYPES)}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise TrainConfigError(f"unknown device {self.device!r}: use auto, cuda or cpu")
        if self.model_impl not in MODEL_IMPLS:
            raise TrainConfigError(f"unknown model_impl {self.model_impl!r}: use {' or '.join(MODEL_IMPLS)}")
        if self.model_impl == "megatron":
            from fp8stack.train.megatron_model import check_config  # megatron-core is imported only when built

            check_config(self)
        elif self.gradient_accumulation_fusion:
            raise TrainConfigError("gradient_accumulation_fusion writes weight gradients into megatron DDP's main_grad "
                                   "buffers: use it with --model-impl megatron")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise TrainConfigError(f"unknown sdpa_backend {self.sdpa_backend!r}: use {', '.join(SDPA_BACKENDS)}")
        for name in ("steps", "micro_batch", "tensor_parallel", "log_interval"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "fp8_margin", "fp8_priming_passes", "fp8_grad_check_steps"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.global_batch is not None and (self.global_batch < 1 or self.global_batch % self.micro_batch):
            raise TrainConfigError(f"global_batch={self.global_batch} must be a positive multiple of "
                                   f"micro_batch={self.micro_batch} (times the data-parallel ranks)")
        if self.fp8_margin and self.recipe != "delayed":
            raise TrainConfigError(f"fp8_margin sets delayed scaling's headroom, and recipe {self.recipe!r} is not "
                                   "delayed scaling: drop --fp8-margin or use --fp8-recipe delayed")
        if self.data_source not in DATA_SOURCES:
            raise TrainConfigError(f"unknown data_source {self.data_source!r}: use {' or '.join(DATA_SOURCES)}")
        if self.profile_collectives < 0:
            raise TrainConfigError(f"profile_collectives must be non-negative, got {self.profile_collectives}")
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if not 0 <= self.min_lr <= self.lr:
            raise TrainConfigError(f"min_lr={self.min_lr} must be between 0 and lr={self.lr}")
        if self.seq_len is not None and self.seq_len < 2:
            raise TrainConfigError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise TrainConfigError("resume='latest' needs checkpoint_dir: pass --save DIR (or --load a checkpoint)")
        _recompute_blocks(self.recompute)
        self.recompute_modules = tuple(self.recompute_modules)  # a JSON --config gives a list
        unknown = [name for name in self.recompute_modules if name not in RECOMPUTE_MODULES]
        if unknown:
            raise TrainConfigError(f"unknown recompute module(s) {', '.join(unknown)}: "
                                   f"use {', '.join(RECOMPUTE_MODULES)}")
        if self.recompute is None and self.recompute_modules != ("block",):
            raise TrainConfigError(f"recompute_modules {list(self.recompute_modules)} need recompute: pass "
                                   "--recompute-granularity selective (all blocks) or --recompute-layers I,J")


@dataclass
class TrainResult:
    """What one run measured (rank 0's view; losses are averaged over data-parallel ranks)."""

    config: dict
    """The TrainConfig, as a dict."""
    device: str
    """Device name ('cpu' or the GPU's name)."""
    dtype: str
    """Activation dtype used."""
    world_size: int
    """Processes in the run."""
    tokens_per_step: int
    """Tokens in one optimizer step over all data-parallel ranks."""
    plan_summary: dict
    """Plan.summary(): FLOPs per token and FP8 share."""
    first_step: int
    """Index of the first step this run took (non-zero after a resume)."""
    losses: list[float] = field(default_factory=list)
    """Training loss per step."""
    step_ms: list[float] = field(default_factory=list)
    """Wall time per step in milliseconds."""
    lrs: list[float] = field(default_factory=list)
    """Learning rate used per step."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm per step, before clipping."""
    tokens_per_s: float = 0.0
    """Throughput over the steady-state steps (see steady_state)."""
    val_loss: float | None = None
    """Mean validation loss after the last step."""
    peak_mem_gib: float | None = None
    """CUDA peak allocated memory (None on a CPU)."""
    max_rss_gib: float = 0.0
    """Peak resident memory of the process."""
    collectives: dict | None = None
    """Collectives per step (comm_stats.Collectives as a dict) when profile_collectives > 0."""
    activation_bytes_saved_per_step: float | None = None
    """With compress_activations: bytes the FP8 storage of saved activations saved per step (this rank)."""
    zero_fp8_weight_grads: list[list[str]] = field(default_factory=list)
    """Per checked step (the first fp8_grad_check_steps): FP8 weights whose whole gradient was zero (this rank)."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then cosine decay to cfg.min_lr at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def model_config(cfg: TrainConfig) -> LlamaConfig:
    """The model's shape: cfg.model with cfg's projections and sequence length."""
    config = replace(MODELS[cfg.model](), fused_projections=cfg.fused_projections)
    return replace(config, seq_len=cfg.seq_len) if cfg.seq_len is not None else config


def build_model(cfg: TrainConfig, device: torch.device) -> Llama:
    """The plain-torch model, initialised from cfg.seed directly on `device`."""
    with torch.device(device):
        model = Llama(model_config(cfg))
    model.init_weights(seed=cfg.seed)
    return model


def build_plan(cfg: TrainConfig, model: Llama, device: torch.device) -> Plan:
    """The plan for this model as built (its seq_len), under the config's recipe and policy options."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        major, minor = torch.cuda.get_device_capability(device)
        arch = 10 * major + minor
    else:
        arch = CPU_ARCH
    options = {"small_gemm_filter": ("off" if not on_gpu else None) if cfg.small_gemm_filter == "auto"
               else cfg.small_gemm_filter}
    policy = PolicyConfig(recipe=cfg.recipe, fp8_format=cfg.fp8_format, backend=cfg.backend, arch=arch,
                          first_last_layers_bf16=cfg.first_last_layers_bf16,
                          num_layers_at_start_in_bf16=cfg.num_layers_at_start_in_bf16,
                          num_layers_at_end_in_bf16=cfg.num_layers_at_end_in_bf16,
                          **{k: v for k, v in options.items() if v is not None})
    description = describe_module(model, seq_len=model.config.seq_len, name=cfg.model)
    return make_plan(description, policy)


@dataclass
class Session:
    """What the steps of one run need, built from a TrainConfig the same way for train() and `fp8stack profile`."""

    env: "_Distributed"
    """Processes, ranks, device and meshes."""
    model: torch.nn.Module
    """The assembled model."""
    plan: Plan
    """The plan it was assembled under."""
    optimizer: torch.optim.AdamW
    """AdamW over the FP32 master weights."""
    scheduler: torch.optim.lr_scheduler.LambdaLR
    """Warm-up then cosine decay (lr_at)."""
    data: TextData
    """Training batches of this data-parallel rank: one item holds all micro-batches of a step."""
    micro_batches: int
    """Micro-batches per optimizer step whose gradients are accumulated."""
    seq_len: int
    """Tokens per sequence."""
    dtype: torch.dtype
    """Activation dtype."""
    after_optimizer_step: Callable[[], None]
    """The assembly's hook to run after each optimizer step."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(tokens, targets) -> the batch's mean loss, FP32 (forward included; call under autocast())."""
    clip_fn: Callable[[float], torch.Tensor]
    """After backward: the global FP32 gradient norm, gradients clipped to the given max norm if > 0."""
    compressor: ActivationCompressor | None = None
    """Stores each forward's saved activations in FP8 (TrainConfig.compress_activations); counts the bytes."""

    def autocast(self):
        """The activation-dtype context for a forward pass."""
        return torch.autocast(self.env.device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()

    def prime_fp8_scales(self, passes: int) -> None:
        """Forward and backward `passes` times on the first micro-batch of the next step, discarding the gradients
        and leaving the weights, optimizer and data where they were; what stays is the FP8 scaling state those
        passes recorded (see TrainConfig.fp8_priming_passes)."""
        tokens, targets = (t.chunk(self.micro_batches)[0].to(self.env.device)
                           for t in self.data.batch(self.data.position))
        for _ in range(passes):
            with self.autocast():
                loss = self.loss_fn(tokens, targets)
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
            # As after an optimizer step: cached FP8 weights were cast with the unprimed scales, and megatron's
            # gradient buffers must start the first step at zero.
            self.after_optimizer_step()

    def step(self, grad_clip: float, on_gradients: Callable[[], None] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step on the next batch, accumulating the gradients of its micro-batches: (mean
        loss, gradient norm) as device tensors (no host sync) and the learning rate it used.
        on_gradients: called once the step's gradients are complete, before clipping."""
        losses = []
        for tokens, targets in zip(*(t.chunk(self.micro_batches) for t in next(self.data)), strict=True):
            tokens, targets = (t.to(self.env.device, non_blocking=True) for t in (tokens, targets))
            with self.autocast(), self.compressor or nullcontext():
                loss = self.loss_fn(tokens, targets)
            (loss / self.micro_batches).backward()  # equal-sized micro-batches: the step's mean loss
            losses.append(loss.detach())
        loss = torch.stack(losses).mean()
        if on_gradients is not None:
            on_gradients()
        grad_norm = self.clip_fn(grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_optimizer_step()
        return loss, grad_norm, lr


@contextmanager
def session(cfg: TrainConfig) -> Iterator[Session]:
    """Set up the processes, then build model, plan, assembly, optimizer and data; ends the processes on exit."""
    from fp8stack.assembly import assemble, post_optimizer_step_hook  # the assembly pulls in every backend

    with _Distributed(cfg) as env, _sdpa_backend(cfg, env.device), ExitStack() as stack:
        device, dtype = env.device, _activation_dtype(cfg, env.device)
        micro_batches = _micro_batches(cfg, env.dp_size)
        if cfg.compress_activations and dtype == torch.float32:
            raise TrainConfigError("compress_activations stores BF16 activations as FP8 and keeps FP32 tensors (the "
                                   "loss's log-softmax, attention log-sum-exps, norm statistics), so this FP32 run "
                                   "would compress nothing: pass --dtype bf16 (the default on a GPU)")
        if device.type == "cuda":
            import_before_cudnn()  # a later session in this process (fp8stack profile) may run TE
        if cfg.model_impl == "megatron":
            from fp8stack.train import megatron_model

            built = stack.enter_context(megatron_model.build(cfg, env))
            model, plan, seq_len = built.model, built.plan, built.seq_len
            loss_fn, clip_fn, after_step = built.loss, built.clip, built.after_optimizer_step
        else:
            model = build_model(cfg, device)
            seq_len = model.config.seq_len
            plan = build_plan(cfg, model, device)
            _check_cpu_support(cfg, plan, device, dtype)
            model = assemble(model, plan, tp_mesh=env.tp_mesh, recompute=_recompute_blocks(cfg.recompute),
                             recompute_modules=cfg.recompute_modules, compile=cfg.compile, fsdp_mesh=env.fsdp_mesh,
                             fsdp_float8_all_gather=cfg.fsdp_float8_all_gather,
                             precompute_fp8_scales=cfg.precompute_fp8_scales,
                             fsdp_mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
                             backend_options=_backend_options(cfg, plan, micro_batches))
            loss_fn, clip_fn = functools.partial(_llama_loss, model), functools.partial(_clip, model)
            after_step = post_optimizer_step_hook(model)
        optimizer = _adamw(model, cfg, device)
        yield Session(env=env, model=model, plan=plan, optimizer=optimizer,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr),
                      data=TextData(seq_len, cfg.micro_batch * micro_batches, cfg.seed, "train", rank=env.dp_rank,
                                    ranks=env.dp_size, max_bytes=cfg.max_data_bytes, source=cfg.data_source),
                      micro_batches=micro_batches,
                      seq_len=seq_len, dtype=dtype, after_optimizer_step=after_step, loss_fn=loss_fn, clip_fn=clip_fn,
                      compressor=compress_saved_activations(model) if cfg.compress_activations else None)


def train(cfg: TrainConfig) -> TrainResult:
    """Run cfg.steps optimizer steps (from the resumed step, if any) and return what was measured."""
    with session(cfg) as run:
        env, device, dtype, seq_len = run.env, run.env.device, run.dtype, run.seq_len
        model, optimizer, scheduler, data = run.model, run.optimizer, run.scheduler, run.data

        start = 0
        if cfg.resume:
            resumed = checkpoint.load(_resume_path(cfg), model, optimizer, scheduler)
            start, data.position = resumed.step, resumed.data_position
        if start >= cfg.steps and env.rank == 0:
            print(f"the checkpoint is at step {start} and steps={cfg.steps}: nothing left to train "
                  "(raise --train-iters to continue)", file=sys.stderr)
        result = TrainResult(config=asdict(cfg), device=_device_name(device), dtype=str(dtype).removeprefix("torch."),
                             world_size=env.world_size,
                             tokens_per_step=cfg.micro_batch * run.micro_batches * seq_len * env.dp_size,
                             plan_summary=run.plan.summary(), first_step=start)
        if start == 0 and any(d.recipe == "delayed" for d in run.plan.decisions):
            run.prime_fp8_scales(cfg.fp8_priming_passes)  # a resumed run restored its scales with the weights
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        with _Logger(cfg, env.rank == 0, start) as log, comm_stats.CollectiveCounter(cfg.profile_collectives) as comms:
            for step in range(start, cfg.steps):
                fault.kill_if_due(env.rank, step)  # FP8STACK_KILL_AT: restart tests
                began = time.perf_counter()
                check = step - start < cfg.fp8_grad_check_steps
                loss, grad_norm, lr = run.step(cfg.grad_clip, on_gradients=(
                    lambda: result.zero_fp8_weight_grads.append(zero_fp8_weight_grads(model))) if check else None)
                # The only host sync of an unchecked step:
                loss_value, grad_norm = env.mean(loss.detach()), float(grad_norm)
                elapsed_ms = (time.perf_counter() - began) * 1000

                result.losses.append(loss_value)
                result.step_ms.append(elapsed_ms)
                result.lrs.append(lr)
                result.grad_norms.append(grad_norm)
                if check and result.zero_fp8_weight_grads[-1] and env.rank == 0:
                    zero = result.zero_fp8_weight_grads[-1]
                    print(f"step {step}: the gradients of {len(zero)} FP8 weight(s) are all zero (e.g. {zero[0]}): "
                          "their FP8 gradient casts flushed every value; TE delayed scaling does so until each scale "
                          "has seen its tensor's amax (its scales start at 1): raise fp8_priming_passes",
                          file=sys.stderr)
                log.step(step, {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_ms": elapsed_ms,
                                "tokens_per_s": result.tokens_per_step / elapsed_ms * 1000})
                if cfg.checkpoint_dir and _checkpoint_due(step + 1, cfg):
                    checkpoint.save(cfg.checkpoint_dir, step + 1, model, optimizer, scheduler, data.position)
                comms.step_done()
        result.collectives = asdict(comms.result) if comms.result else None
        if run.compressor and result.losses:
            result.activation_bytes_saved_per_step = run.compressor.bytes_saved / len(result.losses)

        if result.step_ms:
            result.tokens_per_s = result.tokens_per_step / statistics.median(steady_state(result.step_ms)) * 1000
        if cfg.eval_batches:
            result.val_loss = _validate(run.loss_fn, cfg, seq_len, env, run.autocast)
        if device.type == "cuda":
            result.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
        result.max_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB
        return result


def _sdpa_backend(cfg: TrainConfig, device: torch.device):
    """The attention-kernel context for the whole run; what the runtime refuses is a config error here."""
    try:
        check_sdpa_backend(cfg.sdpa_backend, device)
    except ValueError as err:
        raise TrainConfigError(str(err)) from None
    return sdpa_backend(cfg.sdpa_backend, device)


def _micro_batches(cfg: TrainConfig, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank."""
    if cfg.global_batch is None:
        return 1
    per_pass = cfg.micro_batch * dp_size
    if cfg.global_batch % per_pass:
        raise TrainConfigError(f"global_batch={cfg.global_batch} is not a multiple of micro_batch={cfg.micro_batch} x "
                               f"{dp_size} data-parallel rank(s) = {per_pass}: pick a multiple of {per_pass}")
    return cfg.global_batch // per_pass


def _backend_options(cfg: TrainConfig, plan: Plan, micro_batches: int) -> dict[str, dict] | None:
    """Constructor options for the plan's TE backend: fuse_norm and fuse_mlp (which need TE layers in the
    plan) and, with more than one micro-batch per step, FP8 weights cast once per step and cached (TE's
    is_first_microbatch; with one micro-batch the cache would only hold memory)."""
    for option, module in (("fuse_norm", "LayerNormLinear"), ("fuse_mlp", "LayerNormMLP")):
        if getattr(cfg, option) and not plan.for_backend("te"):
            raise TrainConfigError(f"{option} folds RMSNorms into TransformerEngine {module} modules, but the plan "
                                   f"for recipe {cfg.recipe!r} has no TE layers: use --backend te with an FP8 recipe, "
                                   f"or drop --{option.replace('_', '-')}")
    options = {"fuse_norm": cfg.fuse_norm, "fuse_mlp": cfg.fuse_mlp, "cache_fp8_weights": micro_batches > 1,
               "delayed_margin": cfg.fp8_margin}
    return {"te": options} if plan.for_backend("te") and any(options.values()) else None


def _recompute_blocks(spec: str | None) -> list[int] | str | None:
    """'all' | '0,2' | None -> what assemble(recompute=...) takes."""
    if spec is None or spec == "all":
        return spec
    try:
        return [int(part) for part in spec.split(",")]
    except ValueError:
        raise TrainConfigError(f"recompute={spec!r}: write 'all' or comma-separated block indices like '0,2'") from None


def _activation_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


def _check_cpu_support(cfg: TrainConfig, plan: Plan, device: torch.device, dtype: torch.dtype) -> None:
    """torchao's Float8Linear applies only CUDA autocast to its inputs, so under CPU bf16 autocast the
    high-precision weight-gradient GEMM of rowwise_gw_hp meets FP32 and BF16 operands and fails."""
    if device.type == "cpu" and dtype == torch.bfloat16 and any(d.recipe == "rowwise_gw_hp" for d in plan.decisions):
        raise TrainConfigError("recipe rowwise_gw_hp cannot run under bf16 autocast on a CPU (torchao casts inputs "
                               "for CUDA autocast only): use --dtype fp32 on a CPU")


def _adamw(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the FP32 parameters, so its moments are FP32 too; no decay on norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    wrong = {p.dtype for p in params} - {torch.float32}
    if wrong:
        raise RuntimeError(f"parameters must stay FP32 master weights, found {sorted(map(str, wrong))}: "
                           "keep the model FP32 and let autocast / FP8 modules cast activations")
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def _llama_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return Llama.loss(model(tokens), targets)


def _clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm in FP32 (reduced over ranks under FSDP/TP), clipping to max_norm if > 0.
    Returned as a device tensor: reading it on the host here would stall the step."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _checkpoint_due(done: int, cfg: TrainConfig) -> bool:
    return done == cfg.steps or (cfg.checkpoint_interval > 0 and done % cfg.checkpoint_interval == 0)


def _resume_path(cfg: TrainConfig) -> Path:
    """cfg.resume as a checkpoint folder: 'latest' under checkpoint_dir, the newest step-* inside a
    folder of checkpoints, or the folder itself."""
    folder = Path(cfg.checkpoint_dir if cfg.resume == "latest" else cfg.resume)
    if not folder.is_dir():
        raise TrainConfigError(f"checkpoint {folder} does not exist: point --load at a step-* folder or a "
                               "folder of them")
    found = checkpoint.latest(folder)
    if found is None and cfg.resume == "latest":
        raise TrainConfigError(f"no step-* checkpoint under {folder} to resume from: drop the resume option")
    return found or folder


@torch.no_grad()
def _validate(loss_fn: Callable, cfg: TrainConfig, seq_len: int, env: "_Distributed", autocast) -> float:
    data = TextData(seq_len, cfg.micro_batch, cfg.seed, "validation", rank=env.dp_rank, ranks=env.dp_size,
                    max_bytes=cfg.max_data_bytes, source=cfg.data_source)
    losses = []
    for index in range(cfg.eval_batches):
        tokens, targets = (t.to(env.device) for t in data.batch(index))
        with autocast():
            losses.append(env.mean(loss_fn(tokens, targets)))
    return statistics.fmean(losses)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class _Distributed:
    """Single process, or torchrun's WORLD_SIZE processes on a (dp, tp) mesh: NCCL on GPUs, gloo on CPUs.
    Sets up the process group on entry (if torchrun started us and nobody did yet) and ends it on exit."""

    def __init__(self, cfg: TrainConfig):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        wants_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        if wants_cuda and not torch.cuda.is_available():
            raise TrainConfigError("device cuda requested but torch sees no CUDA GPU: pass --device cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local_rank) if wants_cuda else torch.device("cpu")
        if self.world_size % cfg.tensor_parallel:
            raise TrainConfigError(f"tensor_parallel={cfg.tensor_parallel} must divide the {self.world_size} processes")
        self.tp_size = cfg.tensor_parallel
        self.dp_size = self.world_size // self.tp_size
        self.dp_rank = self.rank // self.tp_size
        self.fsdp_one_rank = cfg.fsdp_one_rank
        self.tp_mesh = self.fsdp_mesh = None
        self._owns_group = False

    def __enter__(self) -> "_Distributed":
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1 or self.fsdp_one_rank:
            from torch.distributed.device_mesh import init_device_mesh

            if not dist.is_initialized():
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous
                    dist.init_process_group(backend)
                else:  # one process without torchrun (fsdp_one_rank): an in-process store suffices
                    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                self._owns_group = True
            mesh = init_device_mesh(self.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
            self.tp_mesh = mesh["tp"] if self.tp_size > 1 else None
            self.fsdp_mesh = mesh["dp"] if self.dp_size > 1 or self.fsdp_one_rank else None
        return self

    def __exit__(self, *exc) -> None:
        if self._owns_group:
            dist.destroy_process_group()

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all ranks (gloo has no AVG, hence SUM / world)."""
        if self.world_size > 1:
            value = value.detach().float().clone()
            dist.all_reduce(value)
            value /= self.world_size
        return float(value)


class _Logger:
    """Per-step metrics to a rich progress bar (TTY) or plain lines, train.jsonl and TensorBoard."""

    def __init__(self, cfg: TrainConfig, active: bool, start: int):
        self.cfg, self.active, self.start = cfg, active, start
        self.stack = ExitStack()
        self.jsonl = self.tensorboard = self.progress = None

    def __enter__(self) -> "_Logger":
        if not self.active:
            return self
        cfg = self.cfg
        if cfg.log_dir:
            folder = Path(cfg.log_dir)
            folder.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the file; a fresh one starts it anew.
            self.jsonl = self.stack.enter_context(open(folder / "train.jsonl", "a" if self.start else "w"))
            self.tensorboard = SummaryWriter(log_dir=str(folder))
            self.stack.callback(self.tensorboard.close)
        console = Console()
        if cfg.progress and console.is_terminal:
            self.progress = self.stack.enter_context(Progress(
                TextColumn(f"{cfg.model} {cfg.recipe}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn(),
                console=console))
            self.task = self.progress.add_task("train", total=cfg.steps, completed=self.start, loss=float("nan"),
                                               tps=0.0)
        return self

    def step(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(f"train/{name}", value, step)
        if self.progress is not None:
            self.progress.update(self.task, advance=1, loss=metrics["loss"], tps=metrics["tokens_per_s"])
        elif self.cfg.progress and ((step + 1) % self.cfg.log_interval == 0 or step + 1 == self.cfg.steps):
            print(f"step {step + 1}/{self.cfg.steps}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                  f"{metrics['step_ms']:.0f} ms  {metrics['tokens_per_s']:,.0f} tok/s", flush=True)

    def __exit__(self, *exc) -> None:
        self.stack.close()
