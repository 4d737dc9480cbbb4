"""fp8stack's default arms beside its peers at the same model, batch and sequence: Megatron-core + TransformerEngine as
pretrain_gpt runs it, and torchtitan's recipe with torchao. Every arm is a fresh child process of this one (with
--nproc N, a torchrun job of N processes, one per GPU), run one after another; one table of tokens/s, peak memory and
FP8/BF16 per stack, and fp8stack's fastest FP8 arm over the best peer's.

    python -m fp8stack.bench.peers                      # every arm at llama-1b-like, 20 steps each
    python -m fp8stack.bench.peers --arms megatron-delayed,torchtitan-tensorwise,fp8stack-delayed
    python -m fp8stack.bench.peers --nproc 2 --arms megatron-delayed-param-gather,torchtitan-tensorwise,fp8stack-delayed
    python -m fp8stack.bench.peers --model llama3-8b-16-layers --micro-batch 1 --global-batch 8 --recompute full
    python -m fp8stack.bench.peers --model llama3-8b --nproc 2 --micro-batch 1 --global-batch 8 --recompute full

Each peer is built as its users build it, with every speed feature its users get by default or its recipe names:
- megatron: examples/megatron/train.py --layer-spec megatron. A GPTModel from megatron's own
  get_gpt_layer_with_transformer_engine_spec (fused norm + QKV and norm + FC1 TE linears, TE's attention), untied
  head, Float16Module (BF16 parameters), megatron's DDP with an FP32 gradient buffer (grad_reduce_in_fp32),
  get_megatron_optimizer (Adam with FP32 master weights and moments), get_forward_backward_func (on one GPU
  forward_backward_no_pipelining over global / micro-batch micro-batches) and finalize_model_grads; the bias-SwiGLU,
  RoPE and bias-dropout-add fusions pretrain_gpt turns on by default; --fp8-format hybrid (E4M3 forward, E5M2
  gradients), megatron's default amax history (1, most recent). Init and norms as Megatron-LM's Llama-3 8B recipe
  sets them (MEGATRON_LLAMA3_INIT: --init-method-std 0.0134, --apply-layernorm-1p), the token embedding N(0, 1) as
  in the other stacks (MEGATRON_EMBEDDING_INIT: megatron's documented guard against loss spikes; with its default
  0.02 the arms' loss rose at the bench's short warm-up), fp8stack's Adam and warm-up step for step
  (megatron_optimizer; pretrain_gpt's defaults: beta2 0.999, a first step at lr 0). Without apex, as the comparison
  is defined: no gradient-accumulation fusion (megatron's output layer needs apex's fused_weight_gradient_mlp_cuda
  for it and refuses to build without it). pretrain_gpt's NaN check of the gradients is left off: it only adds work.
  fp8stack's patches are applied by the example; none touches the layers megatron's spec builds (the SwiGLU one is
  LayerNormMLP's, the wgrad one refuses --no-fp8-wgrad, not used here; the recompute one re-enters FP8 in megatron's
  tensor_parallel.checkpoint, which --recompute full runs in BF16 only, with no FP8 to re-enter: megatron's FP8 full
  recompute is TE's checkpoint). Arms: bf16, delayed, blockwise, and delayed with --fp8-param-gather and the
  distributed optimizer (FP8 weights cast from the FP32 shards). On N GPUs: megatron's
  DDP over the N ranks, each taking its slice of every global batch (global / (micro x N) micro-batches each), with
  the overlap Megatron-LM's Llama-3 recipes turn on: --overlap-grad-reduce, and with the distributed optimizer (its
  FP32 masters and moments sharded over the ranks) --overlap-param-gather. Where a replica's state leaves no room for
  a step (llama3-8b: 18 B per parameter, 134.6 GiB), every arm runs the distributed optimizer, as Megatron-LM's
  Llama-3 8B recipe does (megatron_data_parallel); delayed and delayed-param-gather then differ in FP8 weights alone.
- torchtitan: examples/own_model (torchtitan's Llama layout: wq/wk/wv, w1/w2/w3, SDPA, complex RoPE), each block
  compiled and the loss compiled (torchtitan's compile components model and loss), fused AdamW (torchtitan's default
  implementation), linear LR warm-up; the FP8 arm converts with torchao's Float8LinearConfig.from_recipe_name
  ("tensorwise") and convert_to_float8_training, the output head filtered out, as torchtitan's float8 converter with
  filter_fqns ["output"] does (its other filter, dims not multiples of 16, leaves every other linear of these models
  in FP8). On one GPU: FP32 parameters under BF16 autocast (torchtitan without FSDP). On N GPUs torchtitan's FSDP2
  recipe, apply_fsdp at its defaults (loop.parallelize): the embedding and each block fully_shard-ed and resharded
  after their forward, the final norm and head one unit kept gathered, then the root, all under
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): FP32 parameters sharded (AdamW's masters), gathered in
  BF16, no autocast, gradients reduce-scattered in FP32 after every micro-batch (torchtitan never skips the sync while
  accumulating) and averaged by FSDP (torchtitan sums the loss over the global batch's tokens with FSDP's division
  off: the same gradient, every batch here having as many tokens); each rank reads its rows of every global batch.
  The FP8 arm then casts the sharded weights to FP8 before their all-gather and computes every weight's scale in one
  all-reduce after each optimizer step: torchtitan's enable_fsdp_float8_all_gather and
  precompute_float8_dynamic_scale_for_fsdp, off in its configuration's defaults and the two options its float8
  guide's tensorwise FSDP command turns on. Arms: bf16, tensorwise.
- fp8stack: `python -m fp8stack.train` with the recipe and the batch only, every lever at the configuration's
  defaults (on N GPUs its default data-parallel wrapper, FSDP2). Arms: bf16, delayed, blockwise; with --nproc 2 or
  more also bf16-ddp and delayed-ddp, which add --parallelism.data-parallel ddp: the one-GPU fast path replicated.
  At llama3-8b the FSDP2 arms gather each block's weights once per step (GATHER_ONCE_MODELS), as the scaling bench
  measured fp8stack there.

MoE models (MOE_MODELS): megatron's arms add pretrain_gpt's MoE flags for the description's MoE layers, as
fp8stack's Megatron path maps them (megatron_moe_flags): its own MoE layer specs with TE, --moe-grouped-gemm (TE
GroupedLinear experts), the alltoall dispatcher with TE's fused permutation, FP8 padding of each expert's tokens, and
the expert bias moved by finalize_model_grads every step as pretrain_gpt moves it. fp8stack's FP8 arms add
--expert-backend te, the same TE GroupedLinear (FP8_EXPERT_BACKEND). The torchtitan arms are skipped with the reason
(examples/own_model has no MoE).

Every arm: the shape of fp8stack.models.load_model_config(--model) (vocabulary included: 32000 at llama-1b-like, of
which the byte tokens use ids 0..255), --micro-batch sequences per pass of each rank and --global-batch per optimizer
step over all ranks, FP32 master weights and FP32 Adam moments, fp8stack's default peak LR and warm-up for the model
and run length (fp8stack.models.training_defaults; megatron also decays to its min LR, the torchtitan loop holds the
peak), byte tokens of the standard library's sources (fp8stack's TextData for megatron and fp8stack,
examples/own_model's random windows of the same files for torchtitan), NVLink multicast off in its environment
(fp8stack.train.launch.NO_MULTICAST_ENV, as launch/env.sh). tokens/s: tokens per step over all ranks over the median
of the steady-state step times (fp8stack.train.timing.steady_state), each loop timing a step up to its host read of
the step's loss, and that over N per GPU; a loop whose tokens per step are not the global batch's fails the arm.
Activations: each stack's default, every one kept; --recompute full reruns every transformer block whole in the
backward in every arm alike, each through its own flags (FULL_RECOMPUTE), for a shape whose activations would not
fit: what each stack's users set then, and no stack recomputes less than another.
Peak memory: torch.cuda.max_memory_allocated, the largest of any rank's; resident memory: torch.cuda.memory_allocated
after the last step, likewise (what a rank holds between steps: parameters, masters, optimizer state, gradient
buffers, weight caches; the peak less this is the step's activations and workspaces); final loss: the mean of the
last 10% of steps, each step's loss averaged over the ranks.

Arms a machine cannot run are recorded as skipped with the reason, never run: megatron's need CUDA and
TransformerEngine, and so do fp8stack's delayed and blockwise (its default plan runs them on TE); on CPU processes
(gloo), torchtitan's tensorwise arm with --nproc 2 or more (gloo cannot move its FP8 all-gather). So are arms whose
training state per GPU (state_bytes) leaves no room for a step on an H200 (does_not_fit): at llama3-8b the -ddp arms,
and on one GPU every arm; named in --arms, such an arm is refused. Without CUDA the
torchtitan arms run uncompiled (compiling takes a CPU a minute per arm; fp8stack's default compiles on CUDA only):
such a run checks the plumbing and measures nothing. An arm past --timeout gets SIGTERM, which torchrun passes on to
its workers, and SIGKILL a minute later.

Targets, judged as checks: fp8stack's fastest FP8 arm at >= 1.20x the best peer FP8 arm's tokens/s (1.15x at the
70B-layer and Llama-3-8B shapes, none for MoE models: SPEED_TARGETS), and its peak
memory at most the lowest peer FP8 peak. The evidence (profiles/runs/<date>-peers-<model>[-<N>gpu]-<device>/: JSON
with --nproc and every arm's exact command, Markdown and, with matplotlib, a figure of tokens/s, memory and loss per
arm) is rewritten after every arm, so a run cut short keeps what it measured; `--plot-only <run folder>/<stem>.json`
draws the figure of a run measured before it existed, and `--resume` continues today's evidence of the same run
with the chosen arms it has not measured (a run longer than one sitting, as Llama-3-8B's on 2 GPUs). Exit status: 0
when every chosen arm ran or was skipped with its reason (a target not met is evidence, not a failure), 1 when an arm
failed, 2 on bad input (before any arm).
"""

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from fp8stack.ab import final_loss
from fp8stack.ab.plot import pyplot
from fp8stack.bench.plots import (FIGURE_WIDTH, add_plot_only_option, figure_height, loss_panel, note_unmeasured,
                                  plot_only, refuse_flags_beside_plot_only, write_plot)
from fp8stack.config import JobConfig
from fp8stack.evidence import (add_force_option, claim_or_exit, device_slug, markdown_table, run_folder,
                               write_evidence)
from fp8stack.models import LlamaConfig, load_model_config
from fp8stack.models.training_defaults import TrainingDefaults, training_defaults
from fp8stack.plan.recipes import BF16, is_fp8
from fp8stack.train.defaults import ADAM_BETAS, ADAM_EPS, parameter_count
from fp8stack.train.launch import NO_MULTICAST_ENV, launcher, stop
from fp8stack.train.timing import relative_spread, steady_state

PROG = "python -m fp8stack.bench.peers"
REPO = Path(__file__).resolve().parents[2]
MEGATRON_EXAMPLE = REPO / "examples" / "megatron" / "train.py"
OWN_MODEL_EXAMPLE = REPO / "examples" / "own_model"

STACKS = {
    "megatron": "Megatron-core + TE as pretrain_gpt runs it (no apex)",
    "torchtitan": "torchtitan's recipe with torchao (FSDP2 on several GPUs)",
    "fp8stack": "fp8stack train, default configuration (FSDP2 on several GPUs, gathering once per step at llama3-8b; "
                "the -ddp arms DDP)",
}
"""Stack -> how the table names it, in the table's order."""
PEERS = ("megatron", "torchtitan")
"""The stacks fp8stack is judged against."""
STACK_COLOURS = {"megatron": "tab:green", "torchtitan": "tab:orange", "fp8stack": "tab:blue"}
"""The figure's bars by stack."""
BF16_HATCH = "//"
"""The figure's BF16 bars are hatched, FP8 bars solid."""
PALE = 0.35
"""Opacity of the part of a peak-memory bar above the resident memory."""
DENSE_MODELS = ("tiny", "llama-1b-like", "llama-70b-layers", "llama3-8b-16-layers", "llama3-8b")
"""Models every stack builds: fp8stack's configs and examples/own_model's SIZES both name them."""
MOE_MODELS = ("tiny-moe", "deepseek-moe-small", "deepseek-moe-medium")
"""fp8stack's MoE models: megatron and fp8stack build them, torchtitan's arms are skipped (examples/own_model builds
dense Llamas only)."""
MODELS = DENSE_MODELS + MOE_MODELS
RECOMPUTE = ("none", "full")
"""--recompute: none keeps every activation (each stack's default); full reruns every transformer block whole in the
backward from its saved input, the one recompute the three stacks spell alike (their selective modes recompute
different regions: megatron's the attention core, torchtitan's the ops between the matmuls it saves)."""
FULL_RECOMPUTE = {
    "megatron": ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    "torchtitan": ("--activation-checkpoint", "full"),
    "fp8stack": ("--recompute-granularity", "full"),
}
"""Each stack's own flags for --recompute full: megatron's full recompute of every layer (units of one layer),
torchtitan's activation_checkpoint.mode full, fp8stack's Megatron-spelled full recompute (every block)."""
MEGATRON_FUSIONS = ("--bias-swiglu-fusion", "--rope-fusion", "--bias-dropout-fusion")
"""The fusions pretrain_gpt turns on unless told otherwise, by the example's flags."""
MEGATRON_FP8_FORMAT = "hybrid"
"""Megatron's usual --fp8-format: E4M3 forward, E5M2 gradients."""
DDP = ("--parallelism.data-parallel", "ddp")
"""fp8stack's DDP: the one-GPU fast path replicated (its default data-parallel wrapper is FSDP2)."""
SPEED_TARGET = 1.20
"""fp8stack's fastest FP8 arm over the best peer FP8 arm, tokens/s: the least ratio that meets the target (issue 36
sets it at llama-1b-like; SPEED_TARGETS where it sets another)."""
SPEED_TARGETS = {"llama-70b-layers": 1.15, "llama3-8b-16-layers": 1.15, "llama3-8b": 1.15,
                 **dict.fromkeys(MOE_MODELS)}
"""Models whose speed target is not SPEED_TARGET: at 70B-layer and Llama-3-8B shapes, where FP8's gain over BF16 is
judged on its own (>= 1.55x), fp8stack's FP8 over the best peer's is 1.15x; the MoE models have none over the peer
(None: issue 37 judges their FP8 over BF16 within a stack, >= 1.35x, with the peer measured beside it)."""


def speed_target(model: str) -> float | None:
    """The least tokens/s ratio of fp8stack's fastest FP8 arm over the best peer FP8 arm that meets the target; None
    where no target is set for the model (the ratio is reported, not judged)."""
    return SPEED_TARGETS.get(model, SPEED_TARGET)
MIN_STEPS = 5
"""steady_state leaves out at least 2 warm-up steps and needs 3 more to time."""


@dataclass(frozen=True)
class Arm:
    """One configuration of one stack, run in a fresh process."""

    name: str
    """Its --arms name: <stack>-<recipe>[-<variant>]."""
    stack: str
    """A key of STACKS."""
    recipe: str
    """bf16, or the FP8 recipe in the stack's own name for it."""
    flags: tuple[str, ...] = ()
    """Flags beyond the recipe, in the stack's own words (fp8stack's arms have none: its defaults)."""
    needs_te: bool = False
    """Runs only where CUDA and TransformerEngine are (skipped with the reason elsewhere)."""
    needs_ranks: bool = False
    """Runs only with --nproc 2 or more: on one process the data-parallel wrapper it names does not apply, and it would
    be its stack's arm without the flag."""

    @property
    def fp8(self) -> bool:
        return is_fp8(self.recipe)

    @property
    def ddp(self) -> bool:
        """It replicates the model over the ranks (fp8stack's DDP) where its stack would shard it."""
        return self.flags == DDP


ARMS = {arm.name: arm for arm in (
    Arm("megatron-delayed", "megatron", "delayed", needs_te=True),
    Arm("torchtitan-tensorwise", "torchtitan", "tensorwise"),
    Arm("fp8stack-delayed", "fp8stack", "delayed", needs_te=True),
    Arm("fp8stack-delayed-ddp", "fp8stack", "delayed", DDP, needs_te=True, needs_ranks=True),
    Arm("megatron-delayed-param-gather", "megatron", "delayed", ("--fp8-param-gather", "--use-distributed-optimizer"),
        needs_te=True),
    Arm("fp8stack-blockwise", "fp8stack", "blockwise", needs_te=True),
    Arm("megatron-blockwise", "megatron", "blockwise", needs_te=True),
    Arm("fp8stack-bf16", "fp8stack", BF16),
    Arm("fp8stack-bf16-ddp", "fp8stack", BF16, DDP, needs_ranks=True),
    Arm("megatron-bf16", "megatron", BF16, needs_te=True),
    Arm("torchtitan-bf16", "torchtitan", BF16),
)}
"""Every arm, in the order a run of all of them takes: the FP8 arms the targets compare first, so a run cut short has
judged them (--arms runs its own order)."""


@dataclass(frozen=True)
class Shape:
    """What every arm trains: the same model, batch, sequence and schedule."""

    model: str
    """A name of MODELS."""
    micro_batch: int
    """Sequences per forward/backward pass of one rank."""
    global_batch: int
    """Sequences per optimizer step over all ranks (each rank accumulates global / (micro x nproc) micro-batches)."""
    steps: int
    """Optimizer steps."""
    nproc: int = 1
    """Processes each arm runs on, one per GPU, under torchrun; 1: one plain process."""
    recompute: str = "none"
    """A RECOMPUTE name, given to every arm alike in its stack's own flags (FULL_RECOMPUTE)."""

    @property
    def accumulation(self) -> int:
        """Micro-batches each rank accumulates per optimizer step."""
        return self.global_batch // (self.micro_batch * self.nproc)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.global_batch * load_model_config(self.model).seq_len


GPU_GIB = 139.0
"""What one GPU holds for a rank on the largest GPUs the bench runs on, H200s (an H100 holds about 78)."""
STEP_GIB = 6.0
"""The least a training step adds to a rank's training state: 5.04 GiB at Llama-3-8B shapes with one sequence of
8192 per pass and every block recomputed, measured at llama3-8b-16-layers on one H200 (peak 81.22 less resident 76.18
GiB, profiles/runs/2026-11-28-scaling-llama3-8b-2gpu-h200), and llama3-8b's 16 more blocks' saved inputs (64 MiB
each). Larger passes and kept activations only add to it."""
REPLICA_BYTES = 18
"""Training state per parameter of a rank holding the whole model: BF16 weight 2, FP32 master 4, FP32 gradient 4
(fp8stack's main_grad, megatron's FP32 gradient buffer), Adam moments 8 (torchtitan on one process: FP32 parameters,
gradients and moments, and the BF16 copies autocast keeps through the forward); a delayed arm's FP8 weight cache adds
2 per weight of the blocks. llama3-8b's 8.03 B parameters: 134.6 GiB."""
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"


def state_bytes(arm: Arm, model: str, nproc: int) -> float:
    """Training state per parameter one rank holds: REPLICA_BYTES, less what the arm's wrapper shards over the
    ranks. megatron: BF16 weights and the FP32 gradient buffer whole, FP32 masters and moments (12) sharded by its
    distributed optimizer. FSDP2 (fp8stack's default wrapper, torchtitan's recipe): FP32 masters (torchtitan's FP32
    parameters), gradients and moments, 16, all sharded; BF16 weights only gathered for the step."""
    if arm.stack == "megatron":
        sharded = DISTRIBUTED_OPTIMIZER in megatron_data_parallel(arm, model, nproc)
        return 2 + 4 + 12 / (nproc if sharded else 1)
    return 16 / nproc if nproc > 1 and not arm.ddp else REPLICA_BYTES


@functools.cache
def model_parameters(model: str) -> int:
    return parameter_count(load_model_config(model))


def state_gib(bytes_per_parameter: float, model: str) -> float:
    return bytes_per_parameter * model_parameters(model) / 2**30


def leaves_no_room(bytes_per_parameter: float, model: str) -> bool:
    """A rank holding this much state per parameter of the model has no room for a step on an H200."""
    return state_gib(bytes_per_parameter, model) + STEP_GIB > GPU_GIB


def does_not_fit(arm: Arm, model: str, nproc: int) -> str | None:
    """Why the arm cannot train the model on `nproc` GPUs (its training state leaves no room for a step on an H200),
    naming the fix; None where it fits."""
    held = state_bytes(arm, model, nproc)
    if not leaves_no_room(held, model):
        return None
    if arm.ddp:
        fix = f"its FSDP2 arm {arm.name.removesuffix('-ddp')} shards it"
    else:
        fix = "--nproc 2 or more shards it" if nproc == 1 else "a larger --nproc shards it further"
    return (f"{held:g} B of training state per parameter on each GPU, {state_gib(held, model):.1f} GiB at {model}: "
            f"with a step's {STEP_GIB:g} GiB at least, over an H200's {GPU_GIB:g} GiB; {fix}")


def command(arm: Arm, shape: Shape, result: Path, cuda: bool) -> list[str]:
    """The arm's command line, under torchrun with several processes; its loop writes losses, step_ms,
    tokens_per_step and peak_mem_gib to `result`."""
    build = {"megatron": megatron_command, "torchtitan": torchtitan_command, "fp8stack": fp8stack_command}[arm.stack]
    recompute = FULL_RECOMPUTE[arm.stack] if shape.recompute == "full" else ()
    return [*launcher(shape.nproc), *(str(part) for part in build(arm, shape, cuda)), *recompute,
            "--result-json", str(result)]


def megatron_command(arm: Arm, shape: Shape, cuda: bool) -> list:
    config = load_model_config(shape.model)
    schedule = training_defaults(config, shape.steps)
    fp8 = ["--fp8-format", MEGATRON_FP8_FORMAT, "--fp8-recipe", arm.recipe] if arm.fp8 else []
    return [MEGATRON_EXAMPLE, *megatron_moe_flags(config, arm.fp8), "--layer-spec", "megatron",
            "--num-layers", config.n_layers,
            "--hidden-size", config.dim, "--ffn-hidden-size", config.ffn_dim,
            "--num-attention-heads", config.n_heads, "--num-query-groups", config.n_kv_heads,
            "--seq-length", config.seq_len, "--vocab-size", config.vocab_size,
            "--rotary-base", int(config.rope_theta), "--micro-batch-size", shape.micro_batch,
            "--global-batch-size", shape.global_batch, "--train-iters", shape.steps,
            *megatron_optimizer(schedule), *MEGATRON_LLAMA3_INIT, *MEGATRON_EMBEDDING_INIT, *MEGATRON_FUSIONS, *fp8,
            *megatron_data_parallel(arm, shape.model, shape.nproc)]


MEGATRON_LLAMA3_INIT = ("--init-method-std", "0.0134", "--apply-layernorm-1p")
"""Megatron-LM's Llama-3 8B recipe's init and norms (examples/llama/train_llama3_8b_h100_fp8.sh) in place of
megatron's defaults (0.02, norm weights stored as is): every weight N(0, 0.0134), the blocks' attention and MLP
output projections 0.0134 / sqrt(2 x layers) (megatron's scaled init), the output head too (logits of std 0.86 at
width 4096, where fp8stack's head gives 1); norm weights stored zero-centred, w for 1 + w, finer in BF16."""
MEGATRON_EMBEDDING_INIT = ("--embedding-init-method-std", "1.0")
"""The token embedding N(0, 1), as fp8stack and torchtitan draw it, where the recipe leaves it at 0.0134, which makes
the residual stream entering the first block 75x smaller than theirs: an RMSNorm's gradient scales by 1 / its
input's RMS, so the same Adam step moves the normalised activations much further (Takase et al., Spike No More,
arXiv 2312.16903; megatron-core's TransformerConfig.embedding_init_method_std: "around 1.0 may avoid loss spikes").
The recipe warms up over 30,518 steps, the bench over fp8stack's few (5 of a 10-step run), where the megatron arms'
loss rose with megatron's default 0.02 embedding (12.3 to 14.9 at llama3-8b on 2 H200s,
profiles/runs/2026-11-28-peers-llama3-8b-recompute-full-2gpu-h200)."""


def megatron_optimizer(schedule: TrainingDefaults) -> list:
    """fp8stack's optimizer and schedule (the trainer's AdamW defaults) in pretrain_gpt's flags: its betas and
    epsilon (megatron's default beta2 is 0.999), weight decay and clipping, its peak and min LR, and its warm-up step
    for step (fp8stack.train.loop.lr_at: step s at lr x (s + 1) / warmup). megatron's warm-up runs step s at
    init + (lr - init) x s / iters, from init 0 by default: a first step at lr 0. Starting at lr / warmup over
    warmup - 1 steps gives fp8stack's rates; the cosine decay then starts one step before fp8stack's."""
    optimizer = JobConfig().optimizer
    return ["--lr", schedule.lr, "--min-lr", schedule.min_lr, "--lr-warmup-init", schedule.lr / schedule.warmup,
            "--lr-warmup-iters", schedule.warmup - 1, "--adam-beta1", ADAM_BETAS[0], "--adam-beta2", ADAM_BETAS[1],
            "--adam-eps", ADAM_EPS, "--weight-decay", optimizer.weight_decay, "--clip-grad", optimizer.grad_clip]


def megatron_moe_flags(config: LlamaConfig, fp8: bool) -> list:
    """pretrain_gpt's MoE flags for the model's MoE layers ([] for a dense model): the TransformerConfig fields
    fp8stack's Megatron path maps the description onto (megatron_model.moe_fields: experts, top k, widths, layer 0
    dense, the router's scores and expert bias, grouped GEMMs, the alltoall dispatcher, FP8 padding), each under its
    flag (the expert bias's rate only where the bias is on)."""
    from fp8stack.train.megatron_model import moe_fields

    fields = moe_fields(config, fp8)
    if not fields.get("moe_router_enable_expert_bias"):
        fields.pop("moe_router_bias_update_rate", None)  # the example refuses a rate for a bias that is off
    flags = []
    for name, value in fields.items():
        flag = "--num-experts" if name == "num_moe_experts" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, list):  # megatron's pattern syntax: one 0 (dense) or 1 (MoE) per layer
            flags += [flag, "[" + ",".join(map(str, value)) + "]"]
        elif value is not None:
            flags += [flag, value]
    return flags


def megatron_data_parallel(arm: Arm, model: str, nproc: int) -> list[str]:
    """The arm's flags; with several ranks, megatron's distributed optimizer where a replica's state leaves no room
    for a step (every arm at llama3-8b, as Megatron-LM's Llama-3 8B recipe, examples/llama/train_llama3_8b_h100_fp8.sh,
    runs it), and the overlap that recipe turns on: the gradient reduction with the backward and, with the distributed
    optimizer, the parameter all-gather with the next forward. One rank has nothing to shard or overlap."""
    flags = list(arm.flags)
    if nproc == 1:
        return flags
    if DISTRIBUTED_OPTIMIZER not in flags and leaves_no_room(REPLICA_BYTES, model):
        flags.append(DISTRIBUTED_OPTIMIZER)
    gather = ["--overlap-param-gather"] if DISTRIBUTED_OPTIMIZER in flags else []
    return [*flags, "--overlap-grad-reduce", *gather]


def torchtitan_command(arm: Arm, shape: Shape, cuda: bool) -> list:
    config = load_model_config(shape.model)
    schedule = training_defaults(config, shape.steps)
    script, recipe = ("train_torchao.py", ["--recipe", arm.recipe]) if arm.fp8 else ("train_bf16.py", [])
    return [OWN_MODEL_EXAMPLE / script, "--model", shape.model, *recipe,
            "--micro-batch", shape.micro_batch, "--accumulation", shape.accumulation, "--seq-len", config.seq_len,
            "--steps", shape.steps, "--lr", schedule.lr, "--warmup", schedule.warmup,
            "--compile" if cuda else "--no-compile", *arm.flags]


def fp8stack_command(arm: Arm, shape: Shape, cuda: bool) -> list:
    return ["-m", "fp8stack.train", "--model", shape.model, "--fp8-recipe", arm.recipe,
            "--micro-batch-size", shape.micro_batch, "--global-batch-size", shape.global_batch,
            "--train-iters", shape.steps, "--eval-iters", 0, "--no-progress",
            *fp8stack_expert_backend(arm, load_model_config(shape.model)), *arm.flags,
            *(FSDP_GATHER_ONCE if shape.nproc > 1 and not arm.ddp and shape.model in GATHER_ONCE_MODELS else ())]


FSDP_GATHER_ONCE = ("--no-parallelism.fsdp-reshard-after-forward",)
"""fp8stack's FSDP2 keeping each block's gathered weights from its forward to its backward and over the step's
micro-batches: one all-gather per step instead of two per micro-batch."""
GATHER_ONCE_MODELS = ("llama3-8b",)
"""Models whose fp8stack FSDP2 arms gather once per step (FSDP_GATHER_ONCE): llama3-8b, where the scaling bench
measured that setting on 2 H200s (65.94 GiB peak per GPU, profiles/runs/2026-11-28-scaling-llama3-8b-2gpu-h200):
the gathered BF16 weights (15 GiB) fit beside the sharded state, and each block's two all-gathers per micro-batch
become one per step."""


FP8_EXPERT_BACKEND = ("--expert-backend", "te")
"""fp8stack's FP8 arms of an MoE model run their experts on TE GroupedLinear, the grouped GEMM megatron's
--moe-grouped-gemm runs: under --expert-backend auto a shape not measured yet (deepseek-moe-medium's) keeps its
experts BF16, which would compare BF16 experts against megatron's FP8 ones."""


def fp8stack_expert_backend(arm: Arm, config: LlamaConfig) -> tuple[str, ...]:
    """FP8_EXPERT_BACKEND for an FP8 arm of an MoE model; nothing otherwise (BF16 experts have no FP8 backend)."""
    return FP8_EXPERT_BACKEND if arm.fp8 and config.moe is not None else ()


TORCHTITAN_NO_MOE = ("examples/own_model builds torchtitan's dense Llama only: torchtitan's MoE models are not wired "
                     "into it, so there is no torchtitan arm at an MoE model")
"""Why the torchtitan arms of an MoE model are skipped."""


def skip_reason(arm: Arm, shape: Shape, cuda: bool, te_installed: bool) -> str | None:
    """Why this machine cannot run the arm, or the model on this many GPUs (its training state leaves no room for a
    step), or at all (torchtitan at an MoE model); None where it runs."""
    if arm.stack == "torchtitan" and load_model_config(shape.model).moe is not None:
        return TORCHTITAN_NO_MOE
    nproc = shape.nproc
    too_large = does_not_fit(arm, shape.model, nproc)
    if too_large:
        return too_large
    if arm.needs_te and not (cuda and te_installed):
        what = "megatron-core's TE layers" if arm.stack == "megatron" else f"fp8stack's default plan runs {arm.recipe} on TE"
        return f"needs a CUDA GPU with TransformerEngine ({what})"
    if arm.stack == "torchtitan" and arm.fp8 and nproc > 1 and not cuda:
        return ("needs CUDA GPUs: FSDP2 all-gathers torchao's tensorwise weights in FP8, and gloo (the CPU backend) "
                "cannot move float8 tensors")
    return None


ERROR_CHARS = 3000
"""The end of a failed arm's output kept in the evidence."""
TORCHRUN_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
"""What torchrun's own traceback ends with when a worker failed."""


def run_arm(arm: Arm, shape: Shape, timeout: float, cuda: bool, te_installed: bool) -> dict:
    """The arm in a fresh child process (a torchrun job with several): its tokens/s, step spread, peak memory and
    losses; or why it was skipped or failed."""
    record = {"arm": arm.name, "stack": arm.stack, "recipe": arm.recipe}
    reason = skip_reason(arm, shape, cuda, te_installed)
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        argv = command(arm, shape, result, cuda)
        record["command"] = argv
        began = time.perf_counter()
        done = run_child(argv, timeout)
        if done is None:
            return {**record, "status": "failed", "error": f"timed out after {timeout:.0f} s: raise --timeout"}
        record["wall_s"] = round(time.perf_counter() - began, 1)
        if done.returncode or not result.is_file():
            return {**record, "status": "failed", "error": failure_text(done.stderr or done.stdout)}
        measured = json.loads(result.read_text())
    if measured["tokens_per_step"] != shape.tokens_per_step:
        return {**record, "status": "failed", "error": f"the loop counted {measured['tokens_per_step']} tokens per "
                f"step, not the global batch's {shape.tokens_per_step}: it splits or counts the batch wrongly"}
    return {**record, "status": "ok", **measurements(measured, shape.nproc)}


def run_child(argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """Run argv from the repository root with NVLink multicast off; None when it ran past `timeout`. A timed-out
    child gets SIGTERM first: torchrun's workers run in sessions of their own, so killing torchrun alone would leave
    them holding the GPUs."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, **NO_MULTICAST_ENV}) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(child)
            return None
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def failure_text(output: str) -> str:
    """The end of a failed arm's output. Under torchrun: what the ranks said before torchrun's own traceback, then the
    failed ranks and exit codes of its summary (the error itself is in the former)."""
    summary = output.find(TORCHRUN_FAILURE)
    if summary < 0:
        return output[-ERROR_CHARS:]
    ranks_said = output[:max(output.rfind("Traceback (most recent call last)", 0, summary), 0)]
    failed = [" ".join(line.split()) for line in output[summary:].splitlines()
              if line.strip().startswith(("rank ", "exitcode "))]
    return (ranks_said[-ERROR_CHARS:] + "\ntorchrun: " + "; ".join(failed)).strip()


def measurements(measured: dict, nproc: int) -> dict:
    """What the table reads from a loop's result: tokens/s (the whole job's, and per GPU) from the median
    steady-state step, spread, peak, loss."""
    steady = steady_state(measured["step_ms"])
    tokens_per_s = measured["tokens_per_step"] / statistics.median(steady) * 1000
    return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / nproc,
            "spread": relative_spread(steady), "peak_mem_gib": measured.get("peak_mem_gib"),
            "resident_mem_gib": measured.get("resident_mem_gib"),
            "final_loss": final_loss(measured["losses"]), "losses": measured["losses"],
            "step_ms": measured["step_ms"]}


def fastest(arms: Sequence[dict], stacks: Sequence[str], fp8: bool) -> dict | None:
    """The measured arm with the most tokens/s among `stacks`' BF16 (fp8 False) or FP8 arms, or None."""
    candidates = [a for a in arms if a["status"] == "ok" and a["stack"] in stacks and is_fp8(a["recipe"]) == fp8]
    return max(candidates, key=lambda a: a["tokens_per_s"], default=None)


def stack_summary(arms: Sequence[dict]) -> list[dict]:
    """Per stack: its BF16 arm, its fastest FP8 arm and their tokens/s ratio (None where either is missing)."""
    rows = []
    for stack in STACKS:
        bf16, fp8 = fastest(arms, [stack], False), fastest(arms, [stack], True)
        rows.append({"stack": stack, "bf16": bf16 and bf16["arm"], "fp8": fp8 and fp8["arm"],
                     "fp8_over_bf16": fp8["tokens_per_s"] / bf16["tokens_per_s"] if bf16 and fp8 else None})
    return rows


def judge(arms: Sequence[dict], model: str) -> list[dict]:
    """The two targets: fp8stack's fastest FP8 arm against the best peer FP8 arm's tokens/s (>= the model's
    speed_target) and
    against the lowest peer FP8 peak memory (at most it). met is None where an arm or a peak was not measured."""
    ours, best_peer = fastest(arms, ["fp8stack"], True), fastest(arms, PEERS, True)
    target = speed_target(model)
    ratio = ours["tokens_per_s"] / best_peer["tokens_per_s"] if ours and best_peer else None
    speed = {"check": "speed", "what": "fp8stack's fastest FP8 arm over the best peer FP8 arm, tokens/s",
             "arm": ours and ours["arm"], "against": best_peer and best_peer["arm"], "value": ratio,
             "target": f">= {target:.2f}x" if target else "none set for this model",
             "met": None if ratio is None or target is None else ratio >= target}
    leanest = leanest_peer(arms)
    peak = ours.get("peak_mem_gib") if ours else None
    judged = peak is not None and leanest is not None
    memory = {"check": "memory", "what": "peak GiB of fp8stack's fastest FP8 arm against the lowest peer FP8 peak",
              "arm": ours and ours["arm"], "against": leanest and leanest["arm"], "value": peak,
              "target": f"<= {leanest['peak_mem_gib']:.2f} GiB" if leanest else "<= the lowest peer FP8 peak",
              "met": peak <= leanest["peak_mem_gib"] if judged else None}
    return [speed, memory]


def leanest_peer(arms: Sequence[dict]) -> dict | None:
    """The measured peer FP8 arm with the lowest peak memory, or None (none measured, or no peak without CUDA)."""
    peaks = [a for a in arms if a["status"] == "ok" and a["stack"] in PEERS and is_fp8(a["recipe"])
             and a.get("peak_mem_gib") is not None]
    return min(peaks, key=lambda a: a["peak_mem_gib"], default=None)


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


MET = {True: "yes", False: "NO", None: "not measured"}


def render(record: dict) -> str:
    """The evidence's Markdown: the arms, the per-stack summary and the checks."""
    arms = table_order(record["arms"])
    bf16_speed = {s: a["tokens_per_s"] for s in STACKS if (a := fastest(arms, [s], False))}
    rows = []
    for a in arms:
        within = (a["tokens_per_s"] / bf16_speed[a["stack"]] if a["status"] == "ok" and is_fp8(a["recipe"])
                  and a["stack"] in bf16_speed else None)
        rows.append([a["stack"], a["arm"], _number(a.get("tokens_per_s"), ",.0f"),
                     _number(a.get("tokens_per_s_per_gpu"), ",.0f"), _number(a.get("spread"), ".1%"),
                     _number(a.get("peak_mem_gib"), ".2f"), _number(a.get("resident_mem_gib"), ".2f"),
                     _number(within, ".3f"), _number(a.get("final_loss"), ".4f"), _status(a)])
    shape = record["shape"]
    nproc = shape.get("nproc", 1)
    ranks = (f", each arm one torchrun job of {nproc} processes, one per GPU (peak and resident memory: the largest of "
             "any rank's)" if nproc > 1 else ", each arm a fresh process")
    head = (f"{shape['model']}, micro-batch {shape['micro_batch']} per rank, global batch {shape['global_batch']}, "
            f"{shape['steps']} steps per arm{ranks}{recompute_note(shape)}; tokens/s from the median of the "
            "steady-state step times. "
            "Stacks: " + "; ".join(f"{key}: {what}" for key, what in STACKS.items()) + ".\n\n")
    table = markdown_table(["stack", "arm", "tokens/s", "tokens/s per GPU", "step spread (IQR)", "peak GiB",
                            "resident GiB", "FP8/BF16 in its stack", "final loss", "status"], rows)
    summary = markdown_table(["stack", "BF16 arm", "fastest FP8 arm", "FP8/BF16"],
                             [[s["stack"], s["bf16"] or "-", s["fp8"] or "-", _number(s["fp8_over_bf16"], ".3f")]
                              for s in record["stacks"]])
    checks = markdown_table(["check", "arm", "against", "value", "target", "met"],
                            [[c["what"], c["arm"] or "-", c["against"] or "-",
                              _number(c["value"], ".3f") + ("x" if c["check"] == "speed" and c["value"] else ""),
                              c["target"], MET[c["met"]]] for c in record["checks"]])
    pending = record.get("pending") or []
    tail = f"\nNot run yet: {', '.join(pending)}.\n" if pending else ""
    return head + table + "\n" + summary + "\n" + checks + tail


def recompute_note(shape: dict) -> str:
    """What the table and figure say of --recompute full; nothing without it (nor for records from before it)."""
    return ", every block recomputed in the backward in every arm" if shape.get("recompute") == "full" else ""


def table_order(arms: Sequence[dict]) -> list[dict]:
    """The arms by stack (STACKS' order), BF16 before FP8 within a stack, in run order otherwise."""
    return sorted(arms, key=lambda a: (list(STACKS).index(a["stack"]), is_fp8(a["recipe"])))


def _status(arm: dict) -> str:
    if arm["status"] == "ok":
        return "ok"
    detail = arm.get("reason") or arm.get("error", "")
    return f"{arm['status']}: {' '.join(detail.split())[-200:]}"


def figure(record: dict):
    """The evidence's figure: per arm, grouped by stack, tokens/s (speed_panel) and memory (memory_panel), and every
    arm's loss curve (BF16 dashed); the title names the shape, the device and the two checks."""
    plt = pyplot()
    arms = table_order(record["arms"])
    rows = bar_rows(arms)
    fig, (speed, memory, losses) = plt.subplots(1, 3, figsize=(FIGURE_WIDTH, figure_height(len(rows) + 2)),
                                                width_ratios=(1.3, 1, 1), layout="constrained")
    speed_panel(speed, arms, rows, speed_target(record["shape"]["model"]))
    memory_panel(memory, arms, rows)
    loss_panel(losses, [(a["arm"], a["losses"], {"linestyle": "-" if is_fp8(a["recipe"]) else "--"})
                        for a in arms if a["status"] == "ok" and a.get("losses")])
    fig.suptitle(figure_title(record))
    return fig


def figure_title(record: dict) -> str:
    """The shape and device measured, each check's value against its target, and the arms not run yet."""
    shape, device = record["shape"], (record.get("environment") or {}).get("device", "an unrecorded device")
    nproc = shape.get("nproc", 1)
    gpus = f"{nproc} x {device}" if nproc > 1 else device
    lines = [f"peers at {shape['model']} on {gpus}: micro-batch {shape['micro_batch']} per rank, global batch "
             f"{shape['global_batch']}, {shape['steps']} steps per arm{recompute_note(shape)}"]
    for check in record.get("checks", []):
        value = "-" if check["value"] is None else (f"{check['value']:.3f}x" if check["check"] == "speed"
                                                    else f"{check['value']:.2f} GiB")
        lines.append(f"{check['check']}: {check['arm'] or '-'} {value} vs "
                     f"{check['against'] or '-'} (target {check['target']}: {MET[check['met']]})")
    if record.get("pending"):
        lines.append(f"not run yet: {', '.join(record['pending'])}")
    return "\n".join(lines)


def bar_rows(arms: Sequence[dict]) -> list[float]:
    """A bar position per arm, top to bottom in table_order, with half a bar's gap between stacks."""
    rows, position = [], 0.0
    for index, arm in enumerate(arms):
        if index and arm["stack"] != arms[index - 1]["stack"]:
            position += 0.5
        rows.append(position)
        position += 1
    return rows


def _bar_style(arms: Sequence[dict]) -> dict:
    """Bars coloured by stack, BF16 hatched."""
    return {"color": [STACK_COLOURS[a["stack"]] for a in arms], "edgecolor": "white",
            "hatch": [None if is_fp8(a["recipe"]) else BF16_HATCH for a in arms]}


def _legend_below(axes, handles: list) -> None:
    """The panel's legend under its x axis, off the bars."""
    axes.legend(handles=handles, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=2,
                frameon=False)


def speed_panel(axes, arms: Sequence[dict], rows: list[float], target: float | None) -> None:
    """Tokens/s per arm as horizontal bars, the arms' names at the left; the best peer FP8 arm's tokens/s (dashed)
    and `target` times it where set (what fp8stack's fastest FP8 arm is judged against, dotted)."""
    from matplotlib.patches import Patch

    measured = [a.get("tokens_per_s") if a["status"] == "ok" else None for a in arms]
    bars = axes.barh(rows, [value or 0 for value in measured], **_bar_style(arms))
    axes.bar_label(bars, [_number(value, ",.0f") if value else "" for value in measured], padding=3,
                   fontsize="small")
    note_unmeasured(axes, rows, [None if value else a["status"] for a, value in zip(arms, measured)])
    axes.set_yticks(rows, [a["arm"] for a in arms])
    axes.invert_yaxis()
    handles = [Patch(color=colour, label=stack) for stack, colour in STACK_COLOURS.items()
               if any(a["stack"] == stack for a in arms)]
    handles += [Patch(facecolor="tab:gray", label="FP8"), Patch(facecolor="tab:gray", hatch=BF16_HATCH, label="BF16")]
    best = fastest(arms, PEERS, True)
    if best:
        handles.append(axes.axvline(best["tokens_per_s"], color="black", linewidth=1, linestyle="--",
                                    label=f"best peer FP8 ({best['arm']})"))
    if best and target:
        handles.append(axes.axvline(target * best["tokens_per_s"], color="tab:red", linewidth=1.2,
                                    linestyle=":", label=f"target: {target:.2f}x the best peer FP8"))
    axes.margins(x=0.12)
    axes.set(xlabel="tokens/s", title="throughput (median steady-state step)")
    _legend_below(axes, handles)


def memory_panel(axes, arms: Sequence[dict], rows: list[float]) -> None:
    """Peak GiB per arm; where the record has the resident GiB held between steps, it is drawn solid over a pale
    peak, so that the pale rest is a step's activations and workspaces. The lowest peer FP8 peak dashed. Rows as
    speed_panel's, the names left to it."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    peaks = [a.get("peak_mem_gib") if a["status"] == "ok" else None for a in arms]
    resident = [a.get("resident_mem_gib") if a["status"] == "ok" else None for a in arms]
    style = _bar_style(arms)
    pale = [to_rgba(colour, PALE if gib is not None else 1.0) for colour, gib in zip(style["color"], resident)]
    bars = axes.barh(rows, [peak or 0 for peak in peaks], **{**style, "color": pale})
    axes.barh(rows, [gib or 0 for gib in resident], **style)
    axes.bar_label(bars, [_memory_label(peak, gib) for peak, gib in zip(peaks, resident)], padding=3,
                   fontsize="small")
    note_unmeasured(axes, rows, [None if peak else a["status"] if a["status"] != "ok" else "no peak measured"
                                 for a, peak in zip(arms, peaks)])
    axes.set_yticks(rows, [""] * len(rows))
    axes.invert_yaxis()
    handles = [Patch(facecolor="tab:gray", label="peak")]
    if any(gib is not None for gib in resident):
        handles = [Patch(facecolor="tab:gray", label="resident: held between steps"),
                   Patch(facecolor="tab:gray", alpha=PALE, label="peak (its pale part: a step's activations)")]
    leanest = leanest_peer(arms)
    if leanest:
        handles.append(axes.axvline(leanest["peak_mem_gib"], color="black", linewidth=1, linestyle="--",
                                    label=f"lowest peer FP8 peak ({leanest['arm']})"))
    axes.margins(x=0.25)
    axes.set(xlabel="GiB", title="memory: peak, and resident where measured")
    _legend_below(axes, handles)


def _memory_label(peak: float | None, resident: float | None) -> str:
    if peak is None:
        return ""
    return f"{peak:.1f}" + (f" (resident {resident:.1f})" if resident is not None else "")


def is_peers_record(record: dict) -> bool:
    """The JSON is this bench's evidence: its shape and a list of arms, each naming its stack and status."""
    return isinstance(record.get("shape"), dict) and isinstance(record.get("arms"), list) and all(
        isinstance(a, dict) and a.get("stack") in STACKS and "status" in a for a in record["arms"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="llama-1b-like")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per arm")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward pass of one rank")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step over all ranks")
    parser.add_argument("--nproc", type=int, default=1,
                        help="GPUs each arm runs on, one torchrun process per GPU (1: one plain process)")
    parser.add_argument("--arms", default=None, help=f"comma list of {', '.join(ARMS)} (default: all; the -ddp arms "
                                                     "with --nproc 2 or more)")
    parser.add_argument("--recompute", choices=RECOMPUTE, default="none",
                        help="activation recompute in every arm alike: full reruns each transformer block in the "
                             "backward (megatron --recompute-granularity full --recompute-method uniform "
                             "--recompute-num-layers 1, torchtitan activation_checkpoint.mode full, fp8stack "
                             "--recompute-granularity full), for a shape whose activations do not fit otherwise")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one arm may take")
    parser.add_argument("--out-dir", type=Path, default=REPO / "profiles",
                        help="evidence folder; the run goes in its runs/<date>-<name>/ (default: profiles)")
    parser.add_argument("--label", default="", help="added to the evidence's name (a second run of the same day)")
    add_force_option(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue today's evidence of the same run (same name, --model, batch, --steps, --nproc, "
                             "--recompute): its measured arms are kept, the chosen arms it has not measured run (a "
                             "long run split over several calls)")
    add_plot_only_option(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        refuse_flags_beside_plot_only(parser, args)
        return args
    if args.resume and args.force:
        parser.error("--resume keeps the evidence's measured arms and --force replaces it: give one of them")
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: give 1 or more GPUs")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    if gpus is not None and args.nproc > gpus:
        parser.error(f"--nproc {args.nproc}: this machine has {gpus} GPU(s): give at most {gpus}")
    args.arms = chosen_arms(parser, args.arms, args.model, args.nproc)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps {args.steps}: give at least {MIN_STEPS} (the first 2 warm up and 3 are timed)")
    per_pass = args.micro_batch * args.nproc
    if args.micro_batch < 1 or args.global_batch < 1 or args.global_batch % per_pass:
        parser.error(f"--global-batch {args.global_batch} --micro-batch {args.micro_batch} --nproc {args.nproc}: give "
                     f"positive numbers, the global batch a multiple of micro-batch x nproc ({per_pass})")
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout}: give a positive number of seconds")
    return args


def chosen_arms(parser: argparse.ArgumentParser, names: str | None, model: str, nproc: int) -> list[str]:
    """--arms as a list (None: every arm this --nproc runs, those whose state does not fit the model recorded as
    skipped with the reason); an unknown name, an arm that needs more ranks or one that does not fit exits 2."""
    if names is None:
        return [name for name, arm in ARMS.items() if nproc > 1 or not arm.needs_ranks]
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in ARMS]
    if unknown or not chosen:
        parser.error(f"--arms {','.join(unknown) or '(none)'}: choose from {', '.join(ARMS)}")
    one_rank = [name for name in chosen if ARMS[name].needs_ranks and nproc == 1]
    if one_rank:
        parser.error(f"--arms {','.join(one_rank)}: a data-parallel wrapper over one process is the arm without it: "
                     "add --nproc 2 or more, or drop it")
    too_large = [(name, reason) for name in chosen if (reason := does_not_fit(ARMS[name], model, nproc))]
    if too_large:
        name, reason = too_large[0]
        parser.error(f"--arms {name}: {reason}: drop it, or choose a smaller --model")
    return chosen


def evidence_stem(args: argparse.Namespace) -> str:
    """peers-<model>[-recompute-full][-<label>][-<N>gpu]-<device>: a run on several GPUs, or with recompute, never takes
    the name of a run without."""
    ranks = f"{args.nproc}{'gpu' if torch.cuda.is_available() else 'proc'}" if args.nproc > 1 else None
    recompute = f"recompute-{args.recompute}" if args.recompute != "none" else None
    return "-".join(filter(None, ("peers", args.model, recompute, args.label, ranks, device_slug())))


def record_of(shape: Shape, arms: list[dict], pending: list[str]) -> dict:
    return {"shape": {"model": shape.model, "micro_batch": shape.micro_batch, "global_batch": shape.global_batch,
                      "steps": shape.steps, "nproc": shape.nproc, "recompute": shape.recompute},
            "child_env": NO_MULTICAST_ENV,
            "stacks_described": STACKS, "arms": arms, "stacks": stack_summary(arms), "checks": judge(arms, shape.model),
            "pending": pending}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(PROG, args.plot_only, is_peers_record, figure)
    stem = evidence_stem(args)
    shape = Shape(args.model, args.micro_batch, args.global_batch, args.steps, args.nproc, args.recompute)
    if args.resume:
        arms = measured_arms(stem, args.out_dir, shape)
    else:
        claim_or_exit(PROG, stem, args.out_dir, args.force)
        arms = []
    to_run = [name for name in args.arms if name not in {a["arm"] for a in arms}]
    cuda, te_installed = torch.cuda.is_available(), importlib.util.find_spec("transformer_engine") is not None
    record = record_of(shape, arms, to_run)
    for index, name in enumerate(to_run):
        print(f"[{index + 1}/{len(to_run)}] {name} ...", flush=True)
        arms.append(run_arm(ARMS[name], shape, args.timeout, cuda, te_installed))
        print(f"    {progress_line(arms[-1])}", flush=True)
        record = record_of(shape, arms, to_run[index + 1:])
        json_path, _ = write_evidence(stem, record, render(record), out_dir=args.out_dir, replace=True)
        write_plot(json_path, figure)
    print(render(record))
    return 1 if any(a["status"] == "failed" for a in arms) else 0


def measured_arms(stem: str, out_dir: Path, shape: Shape) -> list[dict]:
    """--resume: the arms today's evidence of this run measured (those it skipped or that failed run again); exits 2,
    before any arm, where there is no such evidence or it trained another shape."""
    path = run_folder(stem, out_dir) / f"{stem}.json"
    if not path.is_file():
        refuse(f"--resume: {path} does not exist: run without --resume first, or give the first run's --out-dir and "
               "--label")
    try:
        record = json.loads(path.read_text())
    except ValueError as err:
        refuse(f"--resume: {path} is not JSON ({err}): replace it with --force instead of --resume")
    if not is_peers_record(record):
        refuse(f"--resume: {path} is not the evidence of {PROG}: replace it with --force instead of --resume")
    ours = record_of(shape, [], [])["shape"]
    if record["shape"] != ours:
        refuse(f"--resume: {path} trained {record['shape']}, not {ours}: give its flags, or run without --resume")
    return [arm for arm in record["arms"] if arm["status"] == "ok"]


def refuse(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def progress_line(arm: dict) -> str:
    if arm["status"] != "ok":
        return _status(arm)
    return (f"{arm['tokens_per_s']:,.0f} tokens/s ({arm['tokens_per_s_per_gpu']:,.0f} per GPU), peak "
            f"{_number(arm['peak_mem_gib'], '.2f')} GiB, final loss "
            f"{arm['final_loss']:.4f}, {arm['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
