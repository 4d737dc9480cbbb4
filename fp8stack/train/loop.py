"""The training loop: plain-torch model -> plan -> assemble -> AdamW steps on stdlib text.

Precision, as the plan's FP32 list says: parameters (master weights) and AdamW moments are FP32 (the moments BF16
with optimizer.moments bf16); activations run in `dtype` (bf16 through torch.autocast, or fp32); FP8 modules cast
their own inputs; loss, gradient norm and clipping are FP32.
"""

import functools
import json
import math
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import NoReturn
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp8stack.models import Llama
from fp8stack.models.llama import tensor_parallel_plan
from fp8stack.models.moe import (clear_expert_load, router_statistics_from, router_statistics_on_device,
                                 update_expert_bias)
from fp8stack.config import ConfigError, JobConfig, ParallelismConfig, recompute_blocks, to_dict
from fp8stack.plan import Plan, PlanWarning, make_plan
from fp8stack.plan.from_module import describe_module
from fp8stack.plan.recipes import get_recipe, is_fp8
from fp8stack.precision import DataParallelGradients, MasterWeights, ShardedMasterWeights, adamw
from fp8stack.runtime.attention import check_sdpa_backend, sdpa_backend
from fp8stack.runtime.compress import ActivationCompressor, compress_saved_activations
from fp8stack.runtime.numerics import (NonFiniteLossError, clear_fp8_stats, fp8_stats, pin_step, rng_states,
                                       set_rng_states, track_fp8_stats, watch_layers, zero_fp8_weight_grads)
from fp8stack.models.training_defaults import training_defaults
from fp8stack.train import checkpoint, comm_stats, fault, user_code
from fp8stack.train.result import TrainResult
from fp8stack.train.data import TextData
from fp8stack.train.defaults import ADAM_BETAS, ADAM_EPS
from fp8stack.train.model import build_model, model_shape
from fp8stack.train.preflight import plan_settings, preflight, run_settings
from fp8stack.train.resolve import data_parallel_wrapped, resolve, wgrad_fusion
from fp8stack.train.stop import StopSignals, TrainingStopped
from fp8stack.train.timing import tokens_per_s

def lr_at(step: int, cfg: JobConfig) -> float:
    """Linear warm-up to optimizer.lr over optimizer.warmup steps, then cosine decay to optimizer.min_lr at the
    last step."""
    opt = cfg.optimizer
    if step < opt.warmup:
        return opt.lr * (step + 1) / opt.warmup
    progress = min(1.0, (step - opt.warmup) / max(1, cfg.training.steps - opt.warmup))
    return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def build_plan(cfg: JobConfig, model: torch.nn.Module) -> Plan:
    """The plan for this model as built (its seq_len), under the resolved configuration's precision policy;
    ConfigError for a plan with little FP8 (Plan.little_fp8) unless training.allow_little_fp8 accepts it, and then
    a warning saying what runs."""
    description = describe_module(model, seq_len=cfg.training.seq_len, name=cfg.model.factory or cfg.model.name)
    with warnings.catch_warnings():  # make_plan's warning names assemble's argument, not the trainer's option
        warnings.simplefilter("ignore", PlanWarning)
        plan = make_plan(description, cfg.precision)
    if plan.little_fp8 and not cfg.training.allow_little_fp8:
        raise ConfigError(f"{plan.little_fp8}: pass --training.allow-little-fp8 if that is intended, or change the "
                          "recipe or its overrides")
    if plan.little_fp8:
        warnings.warn(f"{plan.little_fp8} (accepted by --training.allow-little-fp8)", PlanWarning, stacklevel=2)
    return plan


def batches(cfg: JobConfig, split: str, batch_size: int, env: "_Distributed", vocab_size: int | None = None):
    """One split's batches for this data-parallel rank: source text, or data.factory's."""
    if cfg.data.factory:
        factory = user_code.load_factory(cfg.data.factory, user_code.DATA_FLAG)
        return user_code.FactoryBatches(factory, split=split, seq_len=cfg.training.seq_len, batch_size=batch_size,
                                        seed=cfg.training.seed, rank=env.dp_rank, ranks=env.dp_size,
                                        vocab_size=vocab_size)
    return TextData(cfg.training.seq_len, batch_size, cfg.training.seed, split, rank=env.dp_rank, ranks=env.dp_size,
                    max_bytes=cfg.data.max_bytes, source=cfg.data.source)


@dataclass
class Session:
    """What the steps of one run need, built from a resolved JobConfig the same way for train() and `fp8stack
    profile`."""

    env: "_Distributed"
    """Processes, ranks, device and meshes."""
    model: torch.nn.Module
    """The assembled model."""
    plan: Plan
    """The plan it was assembled under."""
    optimizer: torch.optim.Optimizer
    """AdamW over the FP32 master weights (torch's, or TE's FusedAdam with BF16 moments: optimizer.moments), or on
    the Megatron path megatron's distributed optimizer
    (megatron_model.ReadyGradsOptimizer: clip_fn prepares and clips its gradients, step() applies them)."""
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
    """Stores each forward's saved activations in FP8 (activation_checkpoint.compress); counts the bytes."""
    masters: MasterWeights | ShardedMasterWeights | None = None
    """The FP32 masters the optimizer steps when the model's parameters are BF16 or FP8 (training.param_dtype):
    sharded under FSDP2, whose own masters are its FP32 shards except of weights held in FP8."""
    no_sync: Callable[[], AbstractContextManager] = nullcontext
    """A context whose backward passes leave the gradients unreduced across data-parallel ranks: a step's
    micro-batches but the last run in it, so the gradients are reduced once per step."""
    config: JobConfig | None = None
    """The configuration the session was built from, with the levers the plan decides (TE weight-gradient fusion)
    as they ran."""
    checkpoint_layout: checkpoint.TensorLayout | None = None
    """How checkpoints lay out the model's and optimizer's tensors when not as torch's get_state_dict does (the
    Megatron path's sharded state dicts)."""
    router_statistics: dict[str, float] = field(default_factory=dict)
    """fp8stack.models.moe.router_statistics of what each MoE layer routed in the last step (update_expert_bias, run
    before its optimizer step), read in the step's host sync; empty for a model without fp8stack MoE layers."""

    def autocast(self):
        """The activation-dtype context for a forward pass."""
        return torch.autocast(self.env.device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()

    def prime_fp8_scales(self, passes: int) -> None:
        """Forward and backward `passes` times on the first micro-batch of the next step, discarding the gradients
        and leaving the weights, optimizer and data where they were; what stays is the FP8 scaling state those
        passes recorded (see TEConfig.priming_passes)."""
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
        clear_expert_load(self.model)  # the first step's routing bias moves by the first step's loads only

    def step(self, grad_clip: float, on_gradients: Callable[[], None] | None = None) -> tuple[float, float, float]:
        """One optimizer step on the next batch, accumulating the gradients of its micro-batches: its loss (the mean
        over micro-batches and ranks), gradient norm and learning rate. One host sync, before the optimizer step and
        none after it, so that the host queues the optimizer and the next step's batch while the GPU runs the step:
        a NaN or infinite loss or gradient norm raises NonFiniteLossError, the step not taken.
        on_gradients: called once the step's gradients are complete, before clipping."""
        tokens, targets = (self.env.upload(t) for t in next(self.data))
        losses = []
        for index, (micro_tokens, micro_targets) in enumerate(zip(tokens.chunk(self.micro_batches),
                                                                  targets.chunk(self.micro_batches), strict=True)):
            last = index == self.micro_batches - 1
            with nullcontext() if last else self.no_sync():
                with self.autocast(), self.compressor or nullcontext():
                    loss = self.loss_fn(micro_tokens, micro_targets)
                (loss / self.micro_batches).backward()  # equal-sized micro-batches: the step's mean loss
            losses.append(loss.detach())
        if on_gradients is not None:
            on_gradients()
        grad_norm = self.clip_fn(grad_clip)
        # The routing bias moves by the step's loads whether or not its optimizer step is taken; the loads and the
        # moved bias are read in the step's one sync with the loss and norm.
        loads = update_expert_bias(self.model, self.env.data_parallel_group)
        mean_loss = self.env.mean_on_device(torch.stack(losses).mean())
        routing = [router_statistics_on_device(loads)] if loads else []
        loss_value, norm_value, *routed = torch.cat([mean_loss.float().view(1), grad_norm.float().view(1),
                                                     *routing]).tolist()
        self.router_statistics = router_statistics_from(loads, routed)
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"loss {loss_value}, gradient norm {norm_value}: the optimizer step was not "
                                     "taken")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_optimizer_step()
        return loss_value, norm_value, lr


@contextmanager
def session(cfg: JobConfig) -> Iterator[Session]:
    """Set up the processes, then build model, plan, assembly, optimizer and data from a resolved configuration
    (resolve_job); ends the processes on exit."""
    from fp8stack.assembly import assemble, post_optimizer_step_hook  # the assembly pulls in every backend

    cfg = resolve_job(cfg)
    with _Distributed(cfg) as env, _sdpa_backend(cfg, env.device), cpu_fp8_gemms(env.device), ExitStack() as stack:
        device, dtype = env.device, _activation_dtype(cfg)
        micro_batches = _micro_batches(cfg, env.dp_size)
        if cfg.activation_checkpoint.compress and dtype == torch.float32:
            raise ConfigError("activation_checkpoint.compress stores BF16 activations as FP8 and keeps FP32 tensors "
                              "(the loss's log-softmax, attention log-sum-exps, norm statistics), so this FP32 run "
                              "would compress nothing: pass --dtype bf16 (the default on a GPU)")
        if cfg.model.impl == "megatron":
            from fp8stack.train import megatron_model

            cfg = _with_wgrad_fusion(cfg, plan_has_te_layers=True, world_size=env.world_size)
            built = stack.enter_context(megatron_model.build(cfg, env))
            vocab_size = None
            model, plan, seq_len = built.model, built.plan, built.seq_len
            loss_fn, clip_fn, after_step, no_sync = built.loss, built.clip, built.after_optimizer_step, built.no_sync
        else:
            model = build_model(cfg, device)
            seq_len = cfg.training.seq_len
            vocab_size = _vocab_size(cfg, model, env)
            plan = build_plan(cfg, model)
            cfg = _with_optimizer_defaults(cfg, model)
            _check_cpu_support(plan, device, dtype)
            cfg = _with_wgrad_fusion(cfg, bool(plan.for_backend("te")), env.world_size)
            model = assemble(model, plan, tp_mesh=env.tp_mesh,
                             tp_plan=tensor_parallel_plan(model, env.tp_size) if env.tp_mesh else None,
                             recompute=recompute_blocks(cfg.activation_checkpoint.layers),
                             recompute_modules=cfg.activation_checkpoint.modules, compile=cfg.training.compile,
                             fsdp_mesh=env.fsdp_mesh,
                             fsdp_float8_all_gather=cfg.torchao.fsdp_float8_all_gather,
                             precompute_fp8_scales=cfg.torchao.precompute_fp8_scales,
                             fsdp_mp_policy=_fsdp_mixed_precision(cfg),
                             fsdp_reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                             backend_options=_backend_options(cfg, plan, micro_batches),
                             allow_little_fp8=cfg.training.allow_little_fp8)
            # As torchtitan compiles its loss: Inductor fuses the FP32 log-softmax into reductions over the BF16
            # logits, where eager cross_entropy keeps FP32 copies of them (3 x 4 bytes per logit at the peak).
            loss = torch.compile(Llama.loss) if cfg.training.compile else Llama.loss
            loss_fn = functools.partial(_llama_loss, model, loss)
            clip_fn = functools.partial(_clip, [p for p in model.parameters() if p.requires_grad])
            after_step = post_optimizer_step_hook(model)
        stack.enter_context(_cpu_gemms_for(plan, device))
        masters = grads = None
        if cfg.model.impl == "torch":
            masters, grads = _optimizer_side(cfg, model, env)
            no_sync = _no_sync(model, env, masters or grads, cfg.parallelism)
        if masters is not None:
            clip_fn = functools.partial(_clip, list(masters.parameters()))
            after_step = _then(masters.after_step, after_step)
        if cfg.model.impl == "megatron" and built.optimizer is not None:
            optimizer, scheduled = built.optimizer, built.optimizer.torch_optimizer
        else:
            optimizer = scheduled = _adamw(masters.module if masters else model, cfg)
        layout = built.checkpoint_layout(optimizer) if cfg.model.impl == "megatron" else None
        yield Session(env=env, model=model, plan=plan, optimizer=optimizer,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(scheduled,
                                                                  lambda step: lr_at(step, cfg) / cfg.optimizer.lr),
                      data=batches(cfg, "train", cfg.training.micro_batch * micro_batches, env, vocab_size),
                      micro_batches=micro_batches,
                      seq_len=seq_len, dtype=dtype, after_optimizer_step=after_step, loss_fn=loss_fn, clip_fn=clip_fn,
                      compressor=compress_saved_activations(model) if cfg.activation_checkpoint.compress else None,
                      masters=masters, no_sync=no_sync, config=cfg, checkpoint_layout=layout)


def resolve_job(cfg: JobConfig) -> JobConfig:
    """The configuration with what it leaves open chosen for this machine, model and process count (train.resolve)."""
    shape = model_shape(cfg)
    return resolve(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")))


def train(cfg: JobConfig) -> TrainResult:
    """Run training.steps optimizer steps (from the resumed step, if any) and return what was measured, the resolved
    configuration included. Stops with NonFiniteLossError on a NaN or infinite loss or gradient norm, and with
    TrainingStopped on SIGTERM or SIGINT."""
    cfg = resolve_job(cfg)
    resume_from = preflight(cfg, model_shape(cfg))  # before any model is built
    with session(cfg) as run:
        cfg = run.config
        env, device, dtype, seq_len = run.env, run.env.device, run.dtype, run.seq_len
        model, optimizer, scheduler, data = run.model, run.optimizer, run.scheduler, run.data
        master_module = run.masters.module if run.masters else None
        settings = {**run_settings(cfg, model_shape(cfg), env.world_size), **plan_settings(run.plan)}

        def save(done: int) -> Path:  # run.json: the settings a resume must share, and the whole config for the record
            saved = checkpoint.save(cfg.checkpoint.dir, done, model, optimizer, scheduler, data.position,
                                    masters=master_module, run={**settings, "config": to_dict(cfg)},
                                    layout=run.checkpoint_layout)
            if cfg.checkpoint.keep_latest:
                checkpoint.keep_latest(cfg.checkpoint.dir, cfg.checkpoint.keep_latest)
            return saved

        start = 0
        if resume_from:
            resumed = checkpoint.load(resume_from, model, optimizer, scheduler, masters=master_module,
                                      trusted=cfg.checkpoint.trust, run=settings,
                                      allow_run_changes=cfg.checkpoint.resume_despite_changes,
                                      layout=run.checkpoint_layout)
            start, data.position = resumed.step, resumed.data_position
            if run.masters:
                run.masters.after_step()  # the BF16 (and FP8) parameters from the loaded masters
        if start >= cfg.training.steps and env.rank == 0:
            print(f"the checkpoint is at step {start} and steps={cfg.training.steps}: nothing left to train "
                  "(raise --train-iters to continue)", file=sys.stderr)
        result = TrainResult(config=to_dict(cfg), device=_device_name(device), dtype=str(dtype).removeprefix("torch."),
                             world_size=env.world_size,
                             tokens_per_step=cfg.training.micro_batch * run.micro_batches * seq_len * env.dp_size,
                             plan_summary=run.plan.summary(), first_step=start)
        if start == 0 and run.plan.scales_from_history:
            run.prime_fp8_scales(cfg.te.priming_passes)  # a resumed run restored its scales with the weights
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        with (_Logger(cfg, env.rank == 0, start) as log,
              comm_stats.CollectiveCounter(cfg.logging.profile_collectives) as comms, StopSignals() as stop):
            for step in range(start, cfg.training.steps):
                fault.kill_if_due(env.rank, step)  # FP8STACK_KILL_AT: restart tests
                began = time.perf_counter()
                check = step - start < cfg.training.fp8_grad_check_steps
                position, rng = data.position, rng_states()
                stats_hooks = track_fp8_stats(model) if log.fp8_stats_due(step) else []
                try:
                    loss_value, grad_norm, lr = run.step(cfg.optimizer.grad_clip, on_gradients=(
                        lambda: result.zero_fp8_weight_grads.append(zero_fp8_weight_grads(model))) if check else None)
                except NonFiniteLossError as err:
                    _stop_on_nonfinite(run, cfg, step, position, rng, err)
                if stats_hooks:
                    log.fp8_stats(step, fp8_stats(model))
                    for hook in stats_hooks:
                        hook.remove()
                    clear_fp8_stats(model)
                elapsed_ms = (time.perf_counter() - began) * 1000

                result.losses.append(loss_value)
                result.step_ms.append(elapsed_ms)
                result.lrs.append(lr)
                result.grad_norms.append(grad_norm)
                if check and result.zero_fp8_weight_grads[-1] and env.rank == 0:
                    zero = result.zero_fp8_weight_grads[-1]
                    print(f"step {step}: the gradients of {len(zero)} FP8 weight(s) are all zero (e.g. {zero[0]}): "
                          "their FP8 gradient casts flushed every value; TE delayed scaling does so until each scale "
                          "has seen its tensor's amax (its scales start at 1): raise --te.priming-passes",
                          file=sys.stderr)
                router = run.router_statistics
                if router:
                    result.router.append(router)
                log.step(step, {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_ms": elapsed_ms,
                                "tokens_per_s": result.tokens_per_step / elapsed_ms * 1000,
                                **{f"router/{name}": value for name, value in router.items()}})
                saved = save(step + 1) if cfg.checkpoint.dir and _checkpoint_due(step + 1, cfg) else None
                comms.step_done()
                signal_number = stop.agreed(device, env.world_size)
                if signal_number:
                    if cfg.checkpoint.dir and saved is None:
                        saved = save(step + 1)
                    kept = (f"checkpoint {saved} saved: rerun with --load latest to continue" if saved
                            else "nothing saved (no checkpoint_dir, --save)")
                    result.stopped_after = step + 1
                    _measure_resident_memory(result, env, device)
                    _measure_speed_and_peaks(result, env, device)
                    raise TrainingStopped(f"stopped by {signal.Signals(signal_number).name} after step {step + 1} of "
                                          f"{cfg.training.steps}: {kept}", signal_number, result)
        result.collectives = asdict(comms.result) if comms.result else None
        _measure_resident_memory(result, env, device)
        if run.compressor and result.losses:
            result.activation_bytes_saved_per_step = run.compressor.bytes_saved / len(result.losses)
        if cfg.training.eval_batches:
            result.val_loss = _validate(run.loss_fn, cfg, seq_len, env, run.autocast)
        _measure_speed_and_peaks(result, env, device)
        return result


def _measure_resident_memory(result: TrainResult, env: "_Distributed", device: torch.device) -> None:
    """result.resident_mem_gib: the CUDA memory still allocated after the last step, the largest over the ranks (a
    collective on a GPU)."""
    if device.type == "cuda":
        result.resident_mem_gib = env.max(torch.cuda.memory_allocated(device) / 2**30)


def _measure_speed_and_peaks(result: TrainResult, env: "_Distributed", device: torch.device) -> None:
    """result's throughput over its steady-state steps, its CUDA peak over the ranks (a collective on a GPU) and its
    peak resident memory, after the last step (and validation)."""
    result.tokens_per_s = tokens_per_s(result.tokens_per_step, result.step_ms)
    if device.type == "cuda":
        result.peak_mem_gib = env.max(torch.cuda.max_memory_allocated(device) / 2**30)
    result.max_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def cpu_fp8_gemms(device: torch.device):
    """On a CPU, FP8 GEMMs by torch's own emulation, not oneDNN's: oneDNN 3.12's FP8 matmul is its reference
    implementation on CPUs without AMX-FP8 (1.5 s for one 512x256x768 GEMM), while without oneDNN torch's _scaled_mm
    runs FP32 GEMMs on the upcast operands, bit-identical and hundreds of times faster (tests/test_train.py)."""
    return torch.backends.mkldnn.flags(enabled=False) if device.type == "cpu" else nullcontext()


def _cpu_gemms_for(plan: Plan, device: torch.device):
    """oneDNN back on for a CPU run whose plan has no FP8 GEMM to keep from it (cpu_fp8_gemms): without oneDNN a BF16
    GEMM takes torch's fallback loop (45 ms against 0.56 ms for 128x256x1536 on one core), FP32 GEMMs are MKL's and
    the same bits either way."""
    if device.type != "cpu" or any(is_fp8(decision.recipe) for decision in plan.decisions):
        return nullcontext()
    return torch.backends.mkldnn.flags(enabled=True)


def _sdpa_backend(cfg: JobConfig, device: torch.device):
    """The attention-kernel context for the whole run; what the runtime refuses is a config error here."""
    try:
        check_sdpa_backend(cfg.training.sdpa_backend, device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return sdpa_backend(cfg.training.sdpa_backend, device)


def _micro_batches(cfg: JobConfig, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank."""
    if cfg.training.global_batch is None:
        return 1
    per_pass = cfg.training.micro_batch * dp_size
    if cfg.training.global_batch % per_pass:
        raise ConfigError(f"training.global_batch={cfg.training.global_batch} is not a multiple of "
                          f"training.micro_batch={cfg.training.micro_batch} x {dp_size} data-parallel rank(s) = "
                          f"{per_pass}: pick a multiple of {per_pass}")
    return cfg.training.global_batch // per_pass


def _backend_options(cfg: JobConfig, plan: Plan, micro_batches: int) -> dict[str, dict] | None:
    """Constructor options for the plan's TE backend: fuse_wgrad_accumulation (te.gradient_accumulation_fusion, as
    resolved), fp8_weights (param_dtype fp8, which needs every FP8 layer on TE), local_amax (te.local_amax; None: as
    assemble resolves it) and, with te.cache_fp8_weights and more than one micro-batch per step, FP8
    weights cast once per step and cached (TE's is_first_microbatch; with one micro-batch the cache would only hold
    memory; weights held in FP8 need no cast); and grouped_fp8's (_grouped_fp8_options)."""
    if cfg.te.gradient_accumulation_fusion and not plan.for_backend("te"):
        raise ConfigError(f"te.gradient_accumulation_fusion accumulates the TE linears' weight gradients in FP32, but "
                          f"the plan for recipe {cfg.precision.recipe!r} has no TE layers: use --backend te, or drop "
                          "--gradient-accumulation-fusion")
    fp8_weights = cfg.training.param_dtype == "fp8"
    if fp8_weights:
        fp8 = [d for d in plan.decisions if is_fp8(d.recipe)]
        elsewhere = [d for d in fp8 if d.backend != "te"]
        if not fp8 or elsewhere:
            raise ConfigError(f"param_dtype fp8 holds the weights of TE's FP8 layers in FP8, and the plan for "
                              f"recipe {cfg.precision.recipe!r} has "
                              + (f"{elsewhere[0].fqn} in FP8 on {elsewhere[0].backend}" if elsewhere else
                                 "no FP8 layer") + ": use --backend te with an FP8 recipe, or --param-dtype bf16")
    cache = cfg.te.cache_fp8_weights and micro_batches > 1 and not fp8_weights
    options = {"fp8_weights": fp8_weights, "cache_fp8_weights": cache,
               "delayed_margin": cfg.te.delayed_margin, "fuse_wgrad_accumulation": cfg.te.gradient_accumulation_fusion,
               "local_amax": cfg.te.local_amax,
               **({"one_autocast_per_forward": True} if cfg.te.one_autocast_per_forward else {}),
               **({"blockwise_gemms": cfg.te.blockwise_gemms} if cfg.te.blockwise_gemms != "te" else {})}
    grouped_fp8 = _grouped_fp8_options(cfg, plan, micro_batches)
    return {**({"te": options} if plan.for_backend("te") else {}),
            **({"grouped_fp8": grouped_fp8} if grouped_fp8 else {})} or None


def _grouped_fp8_options(cfg: JobConfig, plan: Plan, micro_batches: int) -> dict:
    """fp8_dispatch, quantizer and wgrad_flatten where grouped_fp8's fields ask for them off their defaults, refused
    before the assembly when the plan runs no blockwise expert GEMM on grouped_fp8 (the experts the plan put on TE or
    kept BF16 take no FP8 rows, no quantizer and no wgrad operands of grouped_fp8's); and, where the plan has experts
    on grouped_fp8, cache_fp8_weights: on with grouped_fp8.cache_fp8_weights and more than one micro-batch per step,
    as TE's."""
    grouped = cfg.grouped_fp8
    options = {**({"fp8_dispatch": True} if grouped.fp8_dispatch else {}),
               **({"quantizer": grouped.quantizer} if grouped.quantizer != "auto" else {}),
               **({"wgrad_flatten": grouped.wgrad_flatten} if grouped.wgrad_flatten != "auto" else {})}
    if options and not any(get_recipe(d.recipe).fp8_dispatch for d in plan.for_backend("grouped_fp8")):
        expert_paths = sorted({f"{d.backend}/{d.recipe}" for d in plan.decisions if d.component.kind == "expert"})
        flags = " and ".join(f"--grouped-fp8.{name.replace('_', '-')}" for name in options)
        raise ConfigError(f"{flags}: options of blockwise expert GEMMs on grouped_fp8, and the plan for recipe "
                          f"{cfg.precision.recipe!r} runs its experts on "
                          f"{', '.join(expert_paths) or 'nothing (no MoE)'}: pass --fp8-recipe blockwise "
                          f"--expert-backend grouped_fp8, or drop {flags}")
    if plan.for_backend("grouped_fp8"):
        options["cache_fp8_weights"] = grouped.cache_fp8_weights and micro_batches > 1
    return options


def _vocab_size(cfg: JobConfig, model: torch.nn.Module, env: "_Distributed") -> int | None:
    """A factory model's vocabulary, from one forward on a batch of the data (None for the described Llama)."""
    if not cfg.model.factory:
        return None
    probe = batches(cfg, "train", 1, env)
    return user_code.vocab_size_of(model, probe.batch(0)[0])


def _with_optimizer_defaults(cfg: JobConfig, model: torch.nn.Module) -> JobConfig:
    """A factory model's learning-rate schedule where the configuration leaves it open, by its embedding's width."""
    if cfg.optimizer.lr is not None and cfg.optimizer.warmup is not None:
        return cfg
    defaults = training_defaults(describe_module(model, seq_len=cfg.training.seq_len, name=cfg.model.factory,
                                                 trace=False),
                                 cfg.training.steps)
    lr = cfg.optimizer.lr or defaults.lr
    return replace(cfg, optimizer=replace(cfg.optimizer, lr=lr, min_lr=cfg.optimizer.min_lr or lr / 10,
                                          warmup=defaults.warmup if cfg.optimizer.warmup is None
                                          else cfg.optimizer.warmup))


def _with_wgrad_fusion(cfg: JobConfig, plan_has_te_layers: bool, world_size: int) -> JobConfig:
    """cfg with te.gradient_accumulation_fusion decided for this plan (resolve.wgrad_fusion)."""
    return replace(cfg, te=replace(cfg.te, gradient_accumulation_fusion=wgrad_fusion(cfg, plan_has_te_layers,
                                                                                     world_size)))


def _optimizer_side(cfg: JobConfig, model: torch.nn.Module, env: "_Distributed"
                    ) -> tuple[MasterWeights | ShardedMasterWeights | None, DataParallelGradients | None]:
    """What keeps the plain model's FP32 masters and averages its gradients, as training.param_dtype and the
    data-parallel wrapper ask: (masters, gradients averaged over DDP's ranks without masters). FSDP2 reduces its
    own gradients and its sharded FP32 parameters are the masters; weights held in FP8 get sharded FP32 ones."""
    param_dtype = cfg.training.param_dtype  # BF16 or FP8 ones with BF16 activations only (TrainingConfig.validate)
    release = cfg.training.release_main_grads  # only where MasterWeights runs (config.check_release_main_grads)
    if env.fsdp_mesh is not None:
        return (ShardedMasterWeights(model) if param_dtype == "fp8" else None), None
    if env.ddp_mesh is not None:
        if param_dtype == "fp32":
            return None, DataParallelGradients(model, env.ddp_mesh)
        return MasterWeights(model, data_parallel=env.ddp_mesh, release_main_grads=release), None
    return (MasterWeights(model, release_main_grads=release) if param_dtype != "fp32" else None), None


def _fsdp_mixed_precision(cfg: JobConfig) -> MixedPrecisionPolicy:
    """FSDP2's policy: its sharded FP32 parameters are gathered in BF16 (param_dtype bf16 or fp8, whose FP8 weights
    travel as FP8) or FP32 (param_dtype fp32, autocast casting them at every forward); gradients reduced in FP32."""
    gathered = torch.float32 if cfg.training.param_dtype == "fp32" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)


def _no_sync(model: torch.nn.Module, env: "_Distributed",
             averaging: MasterWeights | ShardedMasterWeights | DataParallelGradients | None,
             parallelism: ParallelismConfig) -> Callable[[], AbstractContextManager]:
    """The context of a step's micro-batches but the last (Session.no_sync): under FSDP2 their gradients stay
    unreduced (unless parallelism.fsdp_reduce_each_micro_batch) and, gathering once per step, their gathered
    parameters stay for the next micro-batch; under DDP the averaging's no_sync(); else nothing to hold back."""
    if env.fsdp_mesh is not None:
        return functools.partial(_fsdp_between_micro_batches, model,
                                 keep_gathered=parallelism.fsdp_reshard_after_forward is False,
                                 reduce=parallelism.fsdp_reduce_each_micro_batch)
    if env.ddp_mesh is not None:
        return averaging.no_sync
    return nullcontext


@contextmanager
def _fsdp_between_micro_batches(model: torch.nn.Module, keep_gathered: bool, reduce: bool) -> Iterator[None]:
    """Without `reduce`, FSDP2 accumulates the unsharded gradients (in its FP32 reduce dtype) without
    reduce-scattering them; with keep_gathered the gathered parameters also stay for the next micro-batch's forward
    (no all-gather there)."""
    model.set_requires_gradient_sync(reduce)
    model.set_reshard_after_backward(not keep_gathered)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def _activation_dtype(cfg: JobConfig) -> torch.dtype:
    """training.dtype, as resolved (bf16 or fp32)."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.training.dtype]


def _check_cpu_support(plan: Plan, device: torch.device, dtype: torch.dtype) -> None:
    """torchao's Float8Linear applies only CUDA autocast to its inputs, so under CPU bf16 autocast a recipe's
    high-precision weight-gradient GEMM meets FP32 and BF16 operands and fails."""
    high = [d.recipe for d in plan.decisions if is_fp8(d.recipe) and get_recipe(d.recipe).weight_grad_in_high_precision]
    if device.type == "cpu" and dtype == torch.bfloat16 and high:
        raise ConfigError(f"recipe {high[0]} cannot run under bf16 autocast on a CPU (torchao casts inputs for CUDA "
                          "autocast only): use --dtype fp32 on a CPU")


def _adamw(model: torch.nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW over the FP32 parameters of `model` (the model, or MasterWeights.module), its moments FP32 or BF16
    (optimizer.moments, fp8stack.precision.adamw); no decay on norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    wrong = {p.dtype for p in params} - {torch.float32}
    if wrong:
        raise RuntimeError(f"parameters must stay FP32 master weights, found {sorted(map(str, wrong))}: "
                           "keep the model FP32 and let autocast / FP8 modules cast activations, or keep FP32 "
                           "masters of BF16 or FP8 parameters (param_dtype bf16 or fp8)")
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optimizer.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    try:
        return adamw(groups, moments=cfg.optimizer.moments, lr=cfg.optimizer.lr, betas=ADAM_BETAS, eps=ADAM_EPS)
    except ImportError as err:  # TE found but not importable here: as the config check's refusal
        raise ConfigError(str(err)) from None


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """One call running first, then second."""
    def both() -> None:
        first()
        second()
    return both


def _llama_loss(model: torch.nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss(model(tokens), targets)


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm of `params` (the model's FP32 parameters or the masters) in FP32 (reduced over ranks
    under FSDP/TP; DDP's gradients are averaged already), clipping to max_norm if > 0. Returned as a device tensor:
    reading it on the host here would stall the step."""
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _checkpoint_due(done: int, cfg: JobConfig) -> bool:
    last = done == cfg.training.steps
    return (last and cfg.checkpoint.save_last) or (cfg.checkpoint.interval > 0 and done % cfg.checkpoint.interval == 0)


def _stop_on_nonfinite(run: Session, cfg: JobConfig, step: int, position: int, rng: dict,
                       err: NonFiniteLossError) -> NoReturn:
    """Pin the step's batch and RNG states, rerun its forward under watch_layers to name the first layer whose
    output was not finite, and raise NonFiniteLossError saying both."""
    tokens, targets = run.data.batch(position)
    folder = cfg.logging.dir or cfg.checkpoint.dir or tempfile.mkdtemp(prefix="fp8stack-nonfinite-")
    pin = pin_step(Path(folder) / f"rank{run.env.rank}" if run.env.world_size > 1 else folder, step,
                   {"tokens": tokens, "targets": targets}, rng)
    set_rng_states(rng)
    layer = None
    with torch.no_grad(), watch_layers(run.model) as watch, run.autocast():
        for micro_tokens, micro_targets in zip(tokens.chunk(run.micro_batches), targets.chunk(run.micro_batches)):
            run.loss_fn(micro_tokens.to(run.env.device), micro_targets.to(run.env.device))
            layer = layer or watch.first_nonfinite()
    where = (f"the first layer with a non-finite output is {layer}" if layer else
             "every layer's forward output was finite (the backward made it non-finite)")
    raise NonFiniteLossError(f"step {step}: {err}; {where}; the step's batch and RNG states are pinned in {pin} "
                             "(fp8stack.runtime.numerics.load_pin)") from None


@torch.no_grad()
def _validate(loss_fn: Callable, cfg: JobConfig, seq_len: int, env: "_Distributed", autocast) -> float:
    data = batches(cfg, "validation", cfg.training.micro_batch, env)
    losses = []
    for index in range(cfg.training.eval_batches):
        tokens, targets = (t.to(env.device) for t in data.batch(index))
        with autocast():
            losses.append(env.mean(loss_fn(tokens, targets)))
    return statistics.fmean(losses)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class _Distributed:
    """Single process, or torchrun's WORLD_SIZE processes on a (dp, tp) mesh: NCCL on GPUs, gloo on CPUs; its dp
    dimension is fsdp_mesh or ddp_mesh (parallelism.data_parallel) where the data-parallel wrapper applies. Sets up
    the process group on entry (if torchrun started us and nobody did yet) and ends it on exit."""

    def __init__(self, cfg: JobConfig):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local_rank) if cfg.training.device == "cuda" else torch.device("cpu")
        if self.world_size % cfg.parallelism.tensor_parallel:
            raise ConfigError(f"parallelism.tensor_parallel={cfg.parallelism.tensor_parallel} must divide the "
                              f"{self.world_size} processes (the rest are data-parallel ranks): launch a multiple of "
                              f"{cfg.parallelism.tensor_parallel} processes or change --tensor-model-parallel-size")
        self.tp_size = cfg.parallelism.tensor_parallel
        self.dp_size = self.world_size // self.tp_size
        self.dp_rank = self.rank // self.tp_size
        self.data_parallel = cfg.parallelism.data_parallel
        self.wrapped = data_parallel_wrapped(cfg, self.world_size)
        """The data-parallel wrapper applies: several data-parallel ranks, or data_parallel_one_rank."""
        self.tp_mesh = self.fsdp_mesh = self.ddp_mesh = None
        self._owns_group = False

    def __enter__(self) -> "_Distributed":
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1 or self.wrapped:
            from torch.distributed.device_mesh import init_device_mesh

            if not dist.is_initialized():
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous
                    dist.init_process_group(backend)
                else:  # one process without torchrun (data_parallel_one_rank): an in-process store suffices
                    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                self._owns_group = True
            mesh = init_device_mesh(self.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
            self.tp_mesh = mesh["tp"] if self.tp_size > 1 else None
            if self.wrapped:
                if self.data_parallel == "fsdp":
                    self.fsdp_mesh = mesh["dp"]
                else:
                    self.ddp_mesh = mesh["dp"]
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._owns_group:
            if exc_type is None and self.world_size > 1:
                # Ranks end the group together: a rank closing its gloo connections while another still holds the
                # group is the suspected cause of a SIGABRT seen once in CI at the end of a two-process run.
                dist.barrier()
            dist.destroy_process_group()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The data-parallel replicas' process group when several hold the model, else None."""
        mesh = self.fsdp_mesh if self.fsdp_mesh is not None else self.ddp_mesh
        return mesh.get_group() if mesh is not None and self.dp_size > 1 else None

    def max(self, value: float) -> float:
        """The largest of a number over all ranks: a run's memory is its fullest GPU's."""
        if self.world_size > 1:
            largest = torch.tensor(value, dtype=torch.float64, device=self.device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            value = float(largest)
        return value

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all ranks."""
        return float(self.mean_on_device(value))

    def mean_on_device(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over all ranks, left on its device (gloo has no AVG, hence SUM / world)."""
        if self.world_size > 1:
            value = value.detach().float().clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value

    def upload(self, batch: torch.Tensor) -> torch.Tensor:
        """A CPU batch on this process's device, copied without a host sync: from contiguous pinned memory, as a
        pageable source (a strided one is first made contiguous in pageable memory) may make the copy wait for the
        GPU's queue."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        pinned = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
        return pinned.copy_(batch).to(self.device, non_blocking=True)


class _Logger:
    """Per-step metrics to a rich progress bar (TTY) or plain lines, train.jsonl and TensorBoard."""

    def __init__(self, cfg: JobConfig, active: bool, start: int):
        self.cfg, self.active, self.start = cfg, active, start
        self.stack = ExitStack()
        self.jsonl = self.tensorboard = self.progress = None

    def __enter__(self) -> "_Logger":
        if not self.active:
            return self
        cfg = self.cfg
        if cfg.logging.dir:
            folder = Path(cfg.logging.dir)
            folder.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the file from its checkpoint's step, dropping what the interrupted run logged
            # after it (it repeats those steps), as purge_step hides TensorBoard's events from that step on.
            _keep_steps_before(folder / "train.jsonl", self.start)
            self.jsonl = self.stack.enter_context(open(folder / "train.jsonl", "a"))
            from torch.utils.tensorboard import SummaryWriter  # the [tb] extra, which preflight checked for

            self.tensorboard = SummaryWriter(log_dir=str(folder), purge_step=self.start or None)
            self.stack.callback(self.tensorboard.close)
        console = Console()
        if cfg.logging.progress and console.is_terminal:
            self.progress = self.stack.enter_context(Progress(
                TextColumn(f"{cfg.model.name} {cfg.precision.recipe}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn(),
                console=console))
            self.task = self.progress.add_task("train", total=cfg.training.steps, completed=self.start,
                                               loss=float("nan"), tps=0.0)
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
        elif self.cfg.logging.progress and ((step + 1) % self.cfg.logging.interval == 0
                                            or step + 1 == self.cfg.training.steps):
            router = (f"  experts max/mean {metrics['router/imbalance']:.2f} (cv {metrics['router/cv']:.2f}, dropped "
                      f"{metrics['router/dropped']:.1%}, bias {metrics['router/bias_min']:+.3f} to "
                      f"{metrics['router/bias_max']:+.3f})" if "router/imbalance" in metrics else "")
            print(f"step {step + 1}/{self.cfg.training.steps}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                  f"{metrics['step_ms']:.0f} ms  {metrics['tokens_per_s']:,.0f} tok/s{router}", flush=True)

    def fp8_stats_due(self, step: int) -> bool:
        """Whether this step's FP8 statistics go to TensorBoard (logging.fp8_stats_interval)."""
        interval = self.cfg.logging.fp8_stats_interval
        return self.tensorboard is not None and interval > 0 and (step + 1) % interval == 0

    def fp8_stats(self, step: int, stats: dict[str, dict]) -> None:
        """numerics.fp8_stats as scalars fp8/<fqn>/<statistic>/<input|weight>, TE's scales and amaxes by index."""
        for fqn, entry in stats.items():
            for name, values in entry.items():
                if isinstance(values, dict):  # per role: input, weight
                    named = values.items()
                elif isinstance(values, list):  # TE's, per tensor
                    named = enumerate(values)
                else:  # a module whose statistics were not tracked says so in words
                    continue
                for role, value in named:
                    self.tensorboard.add_scalar(f"fp8/{fqn}/{name}/{role}", value, step)

    def __exit__(self, *exc) -> None:
        self.stack.close()


def _keep_steps_before(path: Path, start: int) -> None:
    """Rewrite train.jsonl with the records of steps before `start` only (none for a fresh run)."""
    kept = []
    if start and path.exists():
        for line in path.read_text().splitlines(keepends=True):
            try:
                if json.loads(line)["step"] < start:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line cut short by the kill: the step is run again
                continue
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
