"""The configuration tree: one dataclass per concern, one docstring per field, one validate() per section.

JobConfig is what a training run, an A/B arm and a profile are told. It loads from TOML or JSON, takes
`--section.field value` overrides (fp8stack.config.cli builds every command's parser from it) and is written
whole into each run's evidence. Fields left None are chosen where the run starts, from the model's size and
what the machine runs (fp8stack.train.resolve), and the evidence records what they became.
"""

from dataclasses import dataclass, field, fields, replace

import importlib.util
import os

from fp8stack.plan import PolicyConfig
from fp8stack.plan.recipes import (BLOCKWISE_GEMMS, EXPERT_QUANTIZERS, MEGATRON_RECIPES, PARAM_DTYPES, WGRAD_FLATTENS,
                                   get_recipe, is_fp8)

MODEL_IMPLS = ("torch", "megatron")
"""How the model is built: the plain-torch Llama through assemble, or a megatron-core GPTModel."""
ACTIVATION_DTYPES = ("auto", "bf16", "fp32")
"""auto: bf16 on CUDA, fp32 on a CPU."""
DATA_PARALLEL = ("fsdp", "ddp")
"""How the plain model's data-parallel ranks share it: FSDP2 shards it, DDP replicates it."""
OPTIMIZER_MOMENTS = ("fp32", "bf16")
"""How AdamW stores its moments (fp8stack.precision.adamw's moments, whose MOMENTS these are)."""
DEVICES = ("auto", "cuda", "cpu")
"""auto: cuda when available (under torchrun, cuda:LOCAL_RANK)."""
DATA_SOURCES = ("stdlib", "python")
"""stdlib: the standard library's .py files; python: those, then the .py files of its site-packages folders."""
DEFAULT_MAX_BYTES = 8 << 20
"""Source text read (both splits), in sorted file order: start-up stays well under a second."""
MAX_SEQ_LEN = 1 << 17
"""Longest sequence a run may ask for (Llama 3's 128k context): a longer one would only exhaust memory."""


class ConfigError(ValueError):
    """An option that cannot work; the message names the fix."""


@dataclass
class ModelConfig:
    """Which model is trained and how it is built."""

    name: str = "tiny"
    """A model description: a name in configs/models (tiny, tiny-moe, llama-1b-like, llama3-8b, ...) or a YAML path.
    Ignored (and recorded as the factory) with factory."""
    impl: str = "torch"
    """torch: the plain-torch model through assemble; megatron: a megatron-core GPTModel of the same shape through
    fp8stack's block factory (TE FP8, megatron's tensor parallelism and DDP)."""
    factory: str | None = None
    """'module:function' (or 'path/to/file.py:function') returning your own nn.Module, trained instead of a
    described model: token ids (batch, seq) in, logits (batch, seq, vocab) out (fp8stack.train.user_code)."""
    fused_projections: bool = True
    """Build wqkv and w13 as one GEMM each; False builds wq/wk/wv and w1/w3 (tensor parallelism needs that)."""
    expert_bias_rate: float | None = None
    """MoE models on the plain path: how far each optimizer step moves an expert's routing bias towards the mean load
    (auxiliary-loss-free load balancing, fp8stack.models.MoEConfig.bias_update_rate); 0 turns balancing off. None:
    1e-3 for sigmoid routers (DeepSeek-V3's), 4e-3 / experts for softmax ones."""

    def validate(self) -> None:
        _choose("model.impl", self.impl, MODEL_IMPLS)
        if self.expert_bias_rate is not None and not self.expert_bias_rate >= 0:
            raise ConfigError(f"model.expert_bias_rate={self.expert_bias_rate} must be at least 0 (0 turns MoE load "
                              "balancing off)")
        if self.factory is not None and ":" not in self.factory:
            raise ConfigError(f"model.factory {self.factory!r}: write it as module:function or path/to/file.py:function")
        if self.factory is not None and self.impl != "torch":
            raise ConfigError("model.factory builds your own nn.Module, which runs on the plain path: drop --model.impl "
                              "megatron")


@dataclass
class TEConfig:
    """TransformerEngine's options (the TE backend's constructor and the trainer's use of it)."""

    delayed_margin: int = 0
    """Delayed scaling only: each scale leaves 2^margin headroom below the FP8 maximum (Megatron's --fp8-margin),
    for tensors whose amax outgrows the previous steps'."""
    priming_passes: int = 2
    """Forward/backward passes of the first batch, gradients discarded, before the first step of a fresh run whose
    recipe scales from an amax history: its scales start at 1, so step 1's FP8 gradient casts would flush to zero
    (every FP8 weight gradient of llama-1b-like was zero in its step 1). Two passes: the casts of wqkv's and FC1's
    gradients receive zeros until wo's and FC2's scales are set. 0 turns priming off."""
    gradient_accumulation_fusion: bool | None = None
    """TE's weight-gradient GEMMs accumulate into FP32 main_grad buffers (TE fuse_wgrad_accumulation): no BF16
    weight gradient, cast or add per micro-batch; on the plain path the output head joins them on a TE module
    without FP8. None: on wherever the plan has TE layers and the run can keep the buffers (one process or DDP on
    the plain path, megatron's DDP); off under FSDP2, which reduces autograd's gradients where TE writes main_grad
    outside autograd, and under tensor parallelism. Measured faster on one H200."""
    cache_fp8_weights: bool = True
    """With more than one micro-batch per step, TE casts each weight to FP8 at a step's first micro-batch and reuses
    that copy (TE's is_first_microbatch). Off under FSDP2, which all-gathers the weights at every forward, unless
    --no-parallelism.fsdp-reshard-after-forward keeps them gathered over the step (TE then keeps its FP8 copies: 2
    bytes per weight element on every rank); turning it off elsewhere measures what the cache saves (the bound of
    FSDP2's step time, fp8stack.bench.data_parallel)."""
    blockwise_gemms: str = "te"
    """Where TE's blockwise modules run their GEMMs: te (cuBLAS) or deepgemm (DeepGEMM's dense kernels on TE's
    operands, bit-identical; launch/build_deepgemm.sh builds it)."""
    local_amax: bool | None = None
    """Delayed scaling: each process keeps its own amaxes and scales (Megatron's --tp-only-amax-red without tensor
    parallelism) instead of TE all-reducing every module's amaxes over the ranks at each forward and backward. None:
    local on the plain path, where each rank quantizes whole weights (DDP's replicas, FSDP2's gathered BF16 copies),
    except for FP8 weights under FSDP2 (param_dtype fp8), whose shards all-gather under one scale. llama-1b-like
    under DDP on 2 GPUs ran 192 such all-reduces a step, against 21 of BF16's."""
    one_autocast_per_forward: bool = False
    """Delayed scaling: one TE autocast region around each forward of the whole model instead of one per TE module,
    so TE reduces and updates the amaxes and scales once per forward and once per backward rather than once per
    module in each (a kernel and its host work per module; all-reduces too without local amaxes). The same losses as
    per-module regions at the default amax history (a GPU test); not with activation recompute. Off: no faster on
    one H200 beyond the noise (profiles/runs/2026-11-29-ab-llama-1b-like-one-autocast-auto-h200 and -auto-b-h200,
    each against te.one_autocast_per_forward=false)."""

    def validate(self) -> None:
        _at_least("te.delayed_margin", self.delayed_margin, 0)
        _at_least("te.priming_passes", self.priming_passes, 0)
        _choose("te.blockwise_gemms", self.blockwise_gemms, BLOCKWISE_GEMMS)


@dataclass
class DeepGemmConfig:
    """DeepGEMM, where installed (launch/build_deepgemm.sh): the blockwise expert GEMMs and te.blockwise_gemms."""

    jit_cache_dir: str | None = None
    """Folder for DeepGEMM's JIT-compiled kernels (its DG_JIT_CACHE_DIR, which fp8stack sets before DeepGEMM is
    imported; created if missing). A folder on a persistent disk spares each fresh machine their compilation. None
    leaves DeepGEMM's own choice (DG_JIT_CACHE_DIR if set, else ~/.deep_gemm)."""

    def validate(self) -> None:
        if self.jit_cache_dir is not None:
            _check_writable_dir("deepgemm.jit_cache_dir", self.jit_cache_dir)


@dataclass
class GroupedFP8Config:
    """fp8stack's grouped FP8 expert GEMMs (--expert-backend grouped_fp8) under the plain path's MoE."""

    fp8_dispatch: bool = False
    """Experts whose w13 GEMM runs blockwise quantize each token once, before the MoE permutes it to its top-k
    experts, and the permutation copies its FP8 rows with their 1x128 scales (DeepSeek-V3's FP8 dispatch, on one GPU)
    instead of BF16 rows quantized copy by copy: half the bytes copied, the same numerics (the weight gradient's
    operand is quantized in the backward from the tokens). Needs the plan's blockwise experts on grouped_fp8 (recipe
    blockwise, --expert-backend grouped_fp8). Off until a GPU measures it faster: python -m
    fp8stack.bench.experts_breakdown --moe."""
    quantizer: str = "auto"
    """What quantizes the blockwise expert GEMMs' activations and output gradients in 1x128 tiles, rows and columns:
    inductor (fp8stack's compiled quantizers), te (TE's Float8BlockQuantizer kernel, one pass for both forms, the same
    bytes; needs TransformerEngine, DeepGEMM's expert kernels and the plan's blockwise experts on grouped_fp8), or
    auto: te where it can run (measured the faster: python -m fp8stack.bench.experts_breakdown --quantizer te), else
    inductor, the conversion notes saying why."""
    cache_fp8_weights: bool = True
    """With more than one micro-batch per step, the blockwise expert weights are quantized to their 128x128 FP8 blocks
    at a step's first micro-batch, and the blocks (and their transpose, for the input gradient) reused by the others,
    the same bytes (grouped_fp8's twin of te.cache_fp8_weights). The copies stay allocated between steps (2 bytes per
    expert weight element); off under FSDP2. Measured faster on one H200, whole model and expert block
    (profiles/runs/2026-11-28-ab-deepseek-moe-medium-moe-cache-h200 against -moe-nocache-, and
    2026-11-28-experts-breakdown-deepgemm-h200-te-quantizer-cache)."""
    wgrad_flatten: str = "auto"
    """How the blockwise experts' weight-gradient GEMM on DeepGEMM gets its two operands in the K-grouped layout (each
    expert's [dim, tokens] block, tokens innermost, expert after expert): copies, one copy per expert launched from the
    host (2 x E per GEMM); compiled, one inductor-compiled gather per operand whose source positions are computed on
    the GPU from the group ends; or triton, one hand-written Triton kernel per operand copying whole 128-token tiles of
    one expert each; the same bytes. On one H200 the gaps between the copies were the largest source of GPU idle time
    in a host-bound MoE step (profiles/runs/2026-11-28-profile-deepseek-moe-small-loss-gate-mixed-h200), and the
    copies many kernels a step at a larger shape
    (profiles/runs/2026-11-28-profile-deepseek-moe-medium-mixed-copies-h200); one index_select over a built index ran
    slower (profiles/runs/2026-11-28-profile-deepseek-moe-medium-mixed-gather-h200), and the compiled gather moved
    fewer bytes a second than the copies
    (profiles/runs/2026-11-29-experts-breakdown-deepgemm-h200-te-quantizer-compiled-wgrad-flatten-busy). The Triton
    copy laid the operands out in half the copies' GPU time
    (profiles/runs/2026-11-29-experts-breakdown-deepgemm-h200-te-quantizer-triton-wgrad-flatten-triton; the whole
    model's step as fast as the copies', profiles/runs/2026-11-29-ab-deepseek-moe-medium-mixed-triton-h200), so
    auto, the default, runs it where Triton runs (CUDA, triton importable) and the copies elsewhere; python -m
    fp8stack.bench.experts_breakdown times all three. The others need the plan's blockwise experts on grouped_fp8
    (recipe blockwise, --expert-backend grouped_fp8), on DeepGEMM."""

    def validate(self) -> None:
        _choose("grouped_fp8.quantizer", self.quantizer, EXPERT_QUANTIZERS)
        _choose("grouped_fp8.wgrad_flatten", self.wgrad_flatten, WGRAD_FLATTENS)

    def without_blockwise_experts(self) -> "GroupedFP8Config":
        """These options for a plan without blockwise experts on grouped_fp8 (an A/B's BF16 arm, a profile's BF16 run):
        those that need such experts (which the plan would refuse) at their defaults, the others as they are."""
        defaults = GroupedFP8Config()
        return replace(self, fp8_dispatch=defaults.fp8_dispatch, quantizer=defaults.quantizer,
                       wgrad_flatten=defaults.wgrad_flatten)


@dataclass
class TorchaoConfig:
    """torchao's options under FSDP2."""

    fsdp_float8_all_gather: bool = False
    """All-gather FSDP2's sharded weights in FP8 (tensorwise scaling only), half the bytes of BF16."""
    precompute_fp8_scales: bool = False
    """With fsdp_float8_all_gather: compute every weight's scale in one op after each optimizer step."""

    def validate(self) -> None:
        if self.precompute_fp8_scales and not self.fsdp_float8_all_gather:
            raise ConfigError("torchao.precompute_fp8_scales precomputes the scales of FP8 all-gathers: add "
                              "--torchao.fsdp-float8-all-gather or drop it")


@dataclass
class TrainingConfig:
    """The steps, batches and numerics of the run."""

    steps: int = 40
    """Optimizer steps."""
    micro_batch: int | None = None
    """Sequences per forward/backward pass and data-parallel rank. None: the model's default (8 below 100M
    parameters, 2 above, as measured on one H200)."""
    global_batch: int | None = None
    """Sequences per optimizer step over all data-parallel ranks (Megatron's --global-batch-size): each rank
    accumulates global_batch / (micro_batch x ranks) micro-batches. None: the model's default (one micro-batch
    below 100M parameters, 16 sequences above)."""
    seq_len: int | None = None
    """Tokens per sequence; None takes the model's."""
    seed: int = 0
    """Seeds weights and data: the same seed gives the same run in every arm and process."""
    device: str = "auto"
    """cuda | cpu | auto (cuda when available; under torchrun, cuda:LOCAL_RANK)."""
    dtype: str = "auto"
    """Activation dtype: bf16 (torch.autocast) | fp32 | auto (bf16 on CUDA, fp32 on a CPU)."""
    param_dtype: str | None = None
    """fp32: the parameters are the FP32 master weights AdamW steps, cast at every forward; bf16: BF16 parameters
    with FP32 masters in the optimizer, copied once per step (Megatron's --bf16): no cast per micro-batch; fp8: as
    bf16, but TE's FP8 layers hold their weights in FP8 only (TE quantized_model_init, Megatron's
    --fp8-param-gather). Under FSDP2 the sharded FP32 parameters are the masters: bf16 gathers them in BF16 (its
    mixed-precision policy), fp32 in FP32, fp8 as TE's FP8 weights; under DDP each rank keeps masters of its replica.
    On the Megatron path bf16 is megatron's own (Float16Module, FP32 masters in megatron's optimizer) and fp8 is
    refused. None: bf16 where activations are BF16 on the plain path (measured faster on one H200), else fp32."""
    release_main_grads: bool = False
    """With BF16 or FP8 parameters on the plain path, unsharded (fp8stack.precision.MasterWeights): free the FP32
    main_grads (4 bytes per parameter) after each optimizer step, and allocate each bucket again, zeroed, when the
    next backward first needs it, as torchtitan sets its gradients to None after each step: less memory between
    steps, the same gradients. The peak falls only where a step runs one micro-batch: with more, a later
    micro-batch's forward holds them anyway (measured on one H200:
    profiles/runs/2026-11-28-ab-llama-1b-like-release-main-grads-h200 against -persistent-main-grads-), hence off."""
    compile: bool | None = None
    """torch.compile each block and the loss. None: on for CUDA (measured faster on one H200), off on a CPU."""
    sdpa_backend: str | None = None
    """Attention kernel: auto (torch's choice) | cudnn | flash | efficient. None: cudnn on a Hopper or newer
    GPU whose torch has cuDNN attention (measured fastest on one H200), else auto."""
    fp8_grad_check_steps: int = 3
    """First steps after which FP8 weights whose whole gradient is zero are recorded and warned about (one host
    sync per checked step); 0 turns the check off."""
    eval_batches: int = 4
    """Validation batches evaluated after the last step (0 skips validation)."""
    allow_little_fp8: bool = False
    """Train a plan whose FP8 recipe runs under a quarter of its GEMM FLOPs in FP8 (assemble's allow_little_fp8),
    e.g. FP8 only where a measurement says it pays. Refused by default, naming why the rest stays high precision:
    such a plan is usually a mistake (a model of small GEMMs, a filter or override catching most linears)."""

    def validate(self) -> None:
        _at_least("training.steps", self.steps, 1)
        _at_least("training.micro_batch", self.micro_batch, 1)
        _at_least("training.fp8_grad_check_steps", self.fp8_grad_check_steps, 0)
        _at_least("training.eval_batches", self.eval_batches, 0)
        _choose("training.device", self.device, DEVICES)
        _choose("training.dtype", self.dtype, ACTIVATION_DTYPES)
        if self.param_dtype is not None:
            _choose("training.param_dtype", self.param_dtype, PARAM_DTYPES)
        if self.sdpa_backend not in (None, "auto"):
            from fp8stack.runtime.attention import SDPA_BACKENDS  # torch: imported only when a kernel is pinned

            _choose("training.sdpa_backend", self.sdpa_backend, SDPA_BACKENDS)
        if self.seq_len is not None and not 2 <= self.seq_len <= MAX_SEQ_LEN:
            raise ConfigError(f"training.seq_len must be between 2 and {MAX_SEQ_LEN}, got {self.seq_len}")
        if self.global_batch is not None:
            _at_least("training.global_batch", self.global_batch, 1)
            if self.micro_batch is not None and self.global_batch % self.micro_batch:
                raise ConfigError(f"training.global_batch={self.global_batch} must be a multiple of "
                                  f"training.micro_batch={self.micro_batch} (times the data-parallel ranks)")
        if self.param_dtype in ("bf16", "fp8") and self.dtype == "fp32":
            raise ConfigError(f"training.param_dtype {self.param_dtype} keeps BF16 parameters for BF16 activations, "
                              "and this run's are FP32 (auto is on a CPU): pass --training.dtype bf16 or "
                              "--training.param-dtype fp32")


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule (linear warm-up, cosine decay)."""

    lr: float | None = None
    """Peak learning rate. None: the model's default for its width (fp8stack.models.training_defaults)."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay. None: lr / 10."""
    warmup: int | None = None
    """Steps of linear warm-up from 0 to lr. None: the model's default for the run's length."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (FP32) to this; 0 disables clipping."""
    distributed: bool = False
    """Megatron path only (Megatron's --use-distributed-optimizer): megatron-core's distributed optimizer
    (get_megatron_optimizer) instead of the trainer's AdamW, its FP32 master weights and Adam moments sharded over
    the data-parallel ranks, with the trainer's schedule, weight decay, betas, epsilon and clipping (without it,
    BF16 parameters take megatron's unsharded mixed-precision optimizer). The plain path shards optimizer state with
    FSDP2 (--data-parallel fsdp)."""
    moments: str = "fp32"
    """How AdamW stores its two moments (exp_avg, exp_avg_sq): fp32 (torch's AdamW: 8 bytes per parameter) or bf16
    (TransformerEngine's FusedAdam: 4 bytes, as DeepSeek-V3 trains; fp8stack.precision.adamw). The master weights stay
    FP32 and the update is computed in FP32; only the stored moments round to BF16. Opt-in, for BF16 and FP8 runs
    alike (--optimizer.moments bf16 reaches every arm of an A/B); needs TransformerEngine on a GPU. On the Megatron
    path, where megatron's optimizer runs, it is megatron's precision-aware optimizer (--use-precision-aware-optimizer
    --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16), which needs --use-distributed-optimizer. A checkpoint resumes only
    with the moments it was saved with."""

    def validate(self) -> None:
        _choose("optimizer.moments", self.moments, OPTIMIZER_MOMENTS)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if value is not None and not (value == value and abs(value) != float("inf")):
                raise ConfigError(f"optimizer.{name} must be a finite number, got {value}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be positive, got {self.lr}: the schedule scales it")
        _at_least("optimizer.warmup", self.warmup, 0)
        _at_least("optimizer.weight_decay", self.weight_decay, 0)
        _at_least("optimizer.grad_clip", self.grad_clip, 0)
        if self.min_lr is not None and (self.min_lr < 0 or (self.lr is not None and self.min_lr > self.lr)):
            raise ConfigError(f"optimizer.min_lr={self.min_lr} must be between 0 and optimizer.lr={self.lr}")


@dataclass
class ParallelismConfig:
    """How the processes split the model: tensor parallelism, the rest data-parallel (FSDP2 or DDP), an MoE model's
    experts split over data-parallel ranks on the Megatron path."""

    tensor_parallel: int = 1
    """Tensor-parallel degree; the remaining ranks are data-parallel, sharding parameters with FSDP2 (a 2-D mesh)."""
    expert_parallel: int = 1
    """Expert-parallel degree of an MoE model on the Megatron path (megatron-core's expert model parallelism): each
    group of this many data-parallel ranks splits the routed experts between them, and the alltoall dispatcher sends
    each token to the rank holding its expert and back (in the activations' dtype: BF16). Must divide the
    data-parallel ranks (processes / tensor_parallel) and the model's routed experts."""
    data_parallel: str = "fsdp"
    """The plain model's data-parallel wrapper. fsdp: FSDP2 shards parameters, gradients and optimizer state over the
    ranks, for models that do not fit one GPU; ddp: one replica per GPU whose FP32 gradient buffers are averaged once
    per step, for models that fit one GPU, as most users start. Megatron's model runs megatron's own DDP."""
    data_parallel_one_rank: bool = False
    """Apply the data-parallel wrapper even with one rank, so one GPU runs with a data-parallel run's numerics and
    costs (the reference a multi-rank run's loss is compared with)."""
    fsdp_reshard_after_forward: bool | None = None
    """FSDP2 frees each block's all-gathered parameters after its forward and gathers them again for its backward
    (true, torch's default: least memory), or keeps them from the forward to the backward and across a step's
    micro-batches, gathering once per step (false: the gathered BF16 copy stays resident, as with DDP's replicas).
    None: torch's default."""
    fsdp_reduce_each_micro_batch: bool = False
    """FSDP2 reduce-scatters each micro-batch's gradients into the sharded FP32 gradients (true, as torchtitan does:
    no unsharded gradient is held between a step's micro-batches, at one reduce-scatter per micro-batch), or
    accumulates the unsharded gradients in FP32 and reduce-scatters once per step (false: 4 bytes per parameter of
    the whole model stay resident on every rank through the step)."""

    def validate(self) -> None:
        _at_least("parallelism.tensor_parallel", self.tensor_parallel, 1)
        _at_least("parallelism.expert_parallel", self.expert_parallel, 1)
        _choose("parallelism.data_parallel", self.data_parallel, DATA_PARALLEL)
        fsdp_only = {"fsdp_reshard_after_forward": self.fsdp_reshard_after_forward is not None,
                     "fsdp_reduce_each_micro_batch": self.fsdp_reduce_each_micro_batch}
        for name, given in fsdp_only.items():
            if given and self.data_parallel != "fsdp":
                raise ConfigError(f"parallelism.{name} is FSDP2's, and data_parallel is {self.data_parallel}: drop "
                                  "it or use --parallelism.data-parallel fsdp")
        if self.tensor_parallel > 1 and self.data_parallel == "ddp":
            raise ConfigError("parallelism.data_parallel ddp replicates the whole model, and tensor parallelism shards "
                              "it (its data-parallel ranks run FSDP2 on a 2-D mesh): use --parallelism.data-parallel "
                              "fsdp or --tensor-model-parallel-size 1")


@dataclass
class ActivationCheckpointConfig:
    """What the backward recomputes or stores compressed instead of keeping activations."""

    layers: str | None = None
    """Blocks whose activations are recomputed: 'all', comma-separated indices ('0,2'), or None for none."""
    modules: tuple[str, ...] = ("block",)
    """What is recomputed in those blocks: block (all of it) or Megatron's --recompute-modules names (core_attn,
    attn, mlp, moe, moe_act, shared_experts, layernorm)."""
    compress: bool = False
    """Store the BF16 activations autograd saves as FP8 E4M3 with a per-tensor scale (weights, FP32 and FP8 tensors
    kept). Measured on llama-1b-like: 0.86x memory, +12% loss at 300 steps and slower than BF16: off."""

    def validate(self) -> None:
        recompute_blocks(self.layers)
        self.modules = tuple(self.modules)
        if self.modules == ("block",):
            return
        if self.layers is None:
            raise ConfigError(f"activation_checkpoint.modules {list(self.modules)} need layers: pass "
                              "--activation-checkpoint.layers all (or --recompute-granularity selective)")
        from fp8stack.runtime.recompute import RECOMPUTE_MODULES  # torch: imported only when regions are named

        unknown = [name for name in self.modules if name not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"unknown activation_checkpoint.modules {', '.join(unknown)}: use "
                              f"{', '.join(RECOMPUTE_MODULES)}")


@dataclass
class DataConfig:
    """The text the model trains on."""

    source: str = "stdlib"
    """stdlib: the interpreter's standard-library sources; python: those, then site-packages' (several times the
    text, so long loss runs stay under one pass)."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Read at most this much source text (both splits)."""
    factory: str | None = None
    """'module:function' returning your own batches instead of source text (fp8stack.train.user_code)."""

    def validate(self) -> None:
        _choose("data.source", self.source, DATA_SOURCES)
        _at_least("data.max_bytes", self.max_bytes, 1)
        if self.factory is not None and ":" not in self.factory:
            raise ConfigError(f"data.factory {self.factory!r}: write it as module:function or path/to/file.py:function")


@dataclass
class CheckpointConfig:
    """Saving and resuming (torch.distributed.checkpoint, JSON metadata)."""

    dir: str | None = None
    """Folder for checkpoints (step-<N>); None saves none."""
    interval: int = 0
    """Save every this many steps (and after the last); 0 saves only after the last step."""
    save_last: bool = True
    """Save after the last step too. fp8stack ab's arms turn it off: they keep checkpoints only to resume a run that a
    stop cut, and a finished arm's would be removed at once."""
    keep_latest: int = 0
    """After each save, remove all but this many newest checkpoints in dir (torchtitan's keep_latest_k); 0 keeps
    every one. fp8stack ab's arms that save only when stopped keep 1: a run resumed and cut again needs only its
    newest, and each takes 12 bytes a parameter of disk."""
    resume: str | None = None
    """'latest' (newest under dir) or a checkpoint folder to continue from; None starts fresh."""
    trust: bool = False
    """Let TransformerEngine unpickle the resumed checkpoint's FP8 scaling state (delayed scaling keeps it as a
    pickle, which can run code): only for a checkpoint you wrote. Without it such a resume is refused."""
    resume_despite_changes: bool = False
    """Resume a checkpoint saved under other settings (recipe, model, layout, batch, sequence length, plan): refused
    by default, naming what changed."""

    def validate(self) -> None:
        _at_least("checkpoint.interval", self.interval, 0)
        _at_least("checkpoint.keep_latest", self.keep_latest, 0)
        if self.resume == "latest" and not self.dir:
            raise ConfigError("checkpoint.resume latest needs checkpoint.dir: pass --save DIR (or --load a checkpoint)")


@dataclass
class LoggingConfig:
    """What the run writes while it trains."""

    dir: str | None = None
    """Folder for train.jsonl and TensorBoard scalars; None writes nothing to disk."""
    interval: int = 10
    """Steps between plain log lines when no progress bar is shown (not a terminal)."""
    progress: bool = True
    """A rich progress bar on a terminal, log lines otherwise; False prints neither."""
    fp8_stats_interval: int = 0
    """Every this many steps, each FP8 layer's amax, scale, saturated and flushed-to-zero counts to TensorBoard under
    fp8/ (needs dir); 0 writes none."""
    profile_collectives: int = 0
    """Count the collectives and their bytes over this many steps after the first; 0 counts none."""

    def validate(self) -> None:
        _at_least("logging.interval", self.interval, 1)
        _at_least("logging.fp8_stats_interval", self.fp8_stats_interval, 0)
        _at_least("logging.profile_collectives", self.profile_collectives, 0)
        if self.fp8_stats_interval and not self.dir:
            raise ConfigError("logging.fp8_stats_interval writes to TensorBoard: pass --tensorboard-dir DIR or drop it")


@dataclass
class JobConfig:
    """One training run: every section, validated on construction."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PolicyConfig = field(default_factory=lambda: PolicyConfig(recipe="bf16"))
    te: TEConfig = field(default_factory=TEConfig)
    deepgemm: DeepGemmConfig = field(default_factory=DeepGemmConfig)
    grouped_fp8: GroupedFP8Config = field(default_factory=GroupedFP8Config)
    torchao: TorchaoConfig = field(default_factory=TorchaoConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        for section in fields(self):
            value = getattr(self, section.name)
            if hasattr(value, "validate"):
                value.validate()
        self.validate()

    def validate(self) -> None:
        """Rules across sections; the recipe's properties come from the plan."""
        recipe = self.precision.recipe
        if self.te.delayed_margin and not (is_fp8(recipe) and get_recipe(recipe).scales_from_history):
            raise ConfigError(f"te.delayed_margin sets the headroom of scales taken from an amax history, and recipe "
                              f"{recipe} does not take them so: drop --fp8-margin or use --fp8-recipe delayed")
        if self.te.blockwise_gemms != "te" and not (is_fp8(recipe) and get_recipe(recipe).gemms_on_deepgemm):
            raise ConfigError(f"te.blockwise_gemms={self.te.blockwise_gemms} moves TE's block-scaled GEMMs, and recipe "
                              f"{recipe} has none: use --fp8-recipe blockwise or drop --te.blockwise-gemms")
        if self.model.impl == "torch":
            check_data_parallel_levers(self, sharded=True if self.parallelism.data_parallel_one_rank else None)
        if self.precision.fp8_attention and "core_attn" in self.activation_checkpoint.modules:
            raise ConfigError("--recompute-modules core_attn recomputes the attention core alone, outside the "
                              "attention module that sends it to TE's FP8 attention, so without FP8: recompute attn "
                              "instead, or drop --fp8-dot-product-attention")
        if self.torchao.fsdp_float8_all_gather and self.parallelism.data_parallel == "ddp":
            raise ConfigError("torchao.fsdp_float8_all_gather all-gathers FSDP2's sharded weights, and DDP shards "
                              "none: use --parallelism.data-parallel fsdp or drop it")
        if self.torchao.fsdp_float8_all_gather and not (is_fp8(recipe) and get_recipe(recipe).gathers_in_fp8):
            raise ConfigError(f"torchao.fsdp_float8_all_gather gathers tensorwise-scaled weights, and recipe {recipe} "
                              "is not: use --fp8-recipe tensorwise or drop it")
        check_optimizer_moments(self, None if self.training.device == "auto" else self.training.device)
        if self.model.impl == "megatron":
            _check_megatron(self)
        elif self.parallelism.expert_parallel > 1:
            raise ConfigError("parallelism.expert_parallel splits megatron-core's MoE layers over ranks; the plain "
                              "path's MoE has no expert parallelism: add --model.impl megatron (with an MoE model: "
                              f"{', '.join(MEGATRON_MOE_MODELS)}) or drop --expert-model-parallel-size")
        elif self.optimizer.distributed:
            raise ConfigError("optimizer.distributed is megatron-core's distributed optimizer, for --model-impl "
                              "megatron; the plain path shards optimizer state with FSDP2: drop "
                              "--use-distributed-optimizer or add --model-impl megatron")


def check_data_parallel_levers(job: JobConfig, sharded: bool | None) -> None:
    """The plain path's levers under its parallelism. sharded: whether the run applies its data-parallel wrapper
    (more than one data-parallel rank, or data_parallel_one_rank); None while the process count is unknown, which
    checks only what no process count changes (fp8stack.train.resolve checks again knowing it)."""
    parallel, param_dtype = job.parallelism, job.training.param_dtype
    fsdp = None if sharded is None else sharded and parallel.data_parallel == "fsdp"
    if job.te.gradient_accumulation_fusion and parallel.tensor_parallel > 1:
        raise ConfigError("te.gradient_accumulation_fusion writes weight gradients into FP32 main_grad buffers that "
                          "tensor parallelism's sharded gradients do not include: drop --gradient-accumulation-fusion "
                          "or --tensor-model-parallel-size, or use --model.impl megatron")
    if job.te.local_amax and fsdp and param_dtype == "fp8":
        raise ConfigError("te.local_amax keeps each rank's delayed-scaling scales its own, and FSDP2 all-gathers each "
                          "FP8 weight's shards under one scale: drop --te.local-amax or --param-dtype fp8")
    if job.te.gradient_accumulation_fusion and fsdp and parallel.fsdp_reshard_after_forward is not False:
        raise ConfigError("te.gradient_accumulation_fusion: TE writes weight gradients into main_grad outside "
                          "autograd, and FSDP2 reduce-scatters autograd's gradients; fp8stack hands those buffers to "
                          "FSDP2 only where it keeps the gathered weights: add "
                          "--no-parallelism.fsdp-reshard-after-forward, or pass --parallelism.data-parallel ddp (or "
                          "--no-gradient-accumulation-fusion)")
    check_release_main_grads(job.training, fsdp)
    if parallel.tensor_parallel > 1 and (param_dtype == "fp8" or (param_dtype == "bf16" and fsdp is False)):
        raise ConfigError(f"training.param_dtype {param_dtype} keeps FP32 masters of whole parameters, which tensor "
                          "parallelism shards; under it only FSDP2's mixed precision keeps BF16 parameters "
                          "(param_dtype bf16 with more ranks than --tensor-model-parallel-size): use "
                          "--training.param-dtype fp32, or add data-parallel ranks")


def check_release_main_grads(training: TrainingConfig, fsdp: bool | None) -> None:
    """training.release_main_grads needs the main_grads of MasterWeights: BF16 or FP8 parameters without FSDP2 (fsdp
    None while the process count is unknown; param_dtype None until resolved)."""
    if training.release_main_grads and (training.param_dtype == "fp32" or fsdp):
        kept = ("FP32 parameters take autograd's gradients" if training.param_dtype == "fp32"
                else "FSDP2 reduces its own")
        raise ConfigError(f"training.release_main_grads frees the FP32 main_grads MasterWeights keeps for BF16 or "
                          f"FP8 parameters, and this run keeps none ({kept}): drop --training.release-main-grads, "
                          "or pass --training.param-dtype bf16 without FSDP2")


def check_optimizer_moments(job: JobConfig, device: str | None) -> None:
    """BF16 moments run on TransformerEngine's FusedAdam on a GPU (device None: not chosen yet, checked again by
    fp8stack.train.resolve once it is)."""
    if job.optimizer.moments == "fp32":
        return
    need = "optimizer.moments bf16 needs TransformerEngine's FusedAdam on a GPU"
    if device == "cpu":
        raise ConfigError(f"{need}, and this run is on a CPU: run on a GPU, or drop --optimizer.moments bf16")
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(f"{need}, and transformer_engine is not installed: pip install 'fp8stack[te]', or drop "
                          "--optimizer.moments bf16")
    if job.model.impl == "megatron" and job.training.param_dtype == "bf16" and not job.optimizer.distributed:
        raise ConfigError("optimizer.moments bf16 on --model.impl megatron with BF16 parameters is megatron's "
                          "precision-aware optimizer, which megatron runs inside its distributed optimizer only: add "
                          "--use-distributed-optimizer, or use --param-dtype fp32 (the trainer's AdamW)")


MEGATRON_MOE_MODELS = ("tiny-moe", "deepseek-moe-small", "deepseek-moe-medium")
"""MoE models the Megatron path builds: megatron's MoE layers (routed experts as grouped GEMMs, a shared expert)."""
MEGATRON_MODELS = ("tiny", "llama-1b-like", "llama-70b-layers", "llama3-8b-16-layers", *MEGATRON_MOE_MODELS)
"""Models the Megatron path builds."""


def _check_megatron(job: JobConfig) -> None:
    """The options the Megatron path (fp8stack.train.megatron_model) honours; each refusal names the fix."""
    if importlib.util.find_spec("megatron") is None:
        raise ConfigError("--model.impl megatron needs megatron-core, which is not installed: "
                          "pip install 'fp8stack[megatron]' (Python >= 3.12)")
    plain_only = {"training.compile": (job.training.compile, "torch.compile of the blocks"),
                  "activation_checkpoint.layers": (job.activation_checkpoint.layers, "fp8stack's recompute"),
                  "parallelism.fsdp_reshard_after_forward": (job.parallelism.fsdp_reshard_after_forward is not None,
                                                             "FSDP2"),
                  "parallelism.fsdp_reduce_each_micro_batch": (job.parallelism.fsdp_reduce_each_micro_batch, "FSDP2"),
                  "parallelism.data_parallel_one_rank": (job.parallelism.data_parallel_one_rank,
                                                         "fp8stack's data-parallel wrappers"),
                  "torchao.fsdp_float8_all_gather": (job.torchao.fsdp_float8_all_gather, "FSDP2's FP8 all-gather"),
                  "grouped_fp8.fp8_dispatch": (job.grouped_fp8.fp8_dispatch, "the plain MoE's FP8 dispatch (megatron's "
                                                                             "experts are TE GroupedLinear)"),
                  "grouped_fp8.quantizer": (job.grouped_fp8.quantizer != "auto",
                                            "grouped_fp8's expert quantizer (megatron's experts are TE "
                                            "GroupedLinear, quantized by TE already)"),
                  "grouped_fp8.wgrad_flatten": (job.grouped_fp8.wgrad_flatten != "auto",
                                                "grouped_fp8's DeepGEMM wgrad operands (megatron's experts are TE "
                                                "GroupedLinear)"),
                  "te.local_amax": (job.te.local_amax is not None, "the plain path's TE scaling state (megatron "
                                                                     "reduces amaxes over its own groups)"),
                  "te.cache_fp8_weights false": (not job.te.cache_fp8_weights,
                                                 "the plain path's FP8 weight cache (megatron passes its own "
                                                 "is_first_microbatch)"),
                  "grouped_fp8.cache_fp8_weights false": (not job.grouped_fp8.cache_fp8_weights,
                                                          "grouped_fp8's FP8 weight cache (megatron's experts are TE "
                                                          "GroupedLinear, which megatron's is_first_microbatch "
                                                          "drives)"),
                  "training.param_dtype fp8": (job.training.param_dtype == "fp8",
                                               "TE weights held in FP8 (megatron's --fp8-param-gather is not wired "
                                               "here; bf16 is megatron's own BF16 parameters)"),
                  "training.release_main_grads": (job.training.release_main_grads,
                                                  "fp8stack's MasterWeights (megatron's DDP keeps its own FP32 "
                                                  "gradient buffers)"),
                  "training.sdpa_backend": (job.training.sdpa_backend not in (None, "auto"),
                                            "torch SDPA kernels (megatron's attention is TE's DotProductAttention)"),
                  "--recipe-file's overrides": (bool(job.precision.overrides),
                                                "per-block / per-fqn overrides (megatron's plan comes from its own "
                                                "flags)")}
    given = [f"{name} ({what})" for name, (value, what) in plain_only.items() if value]
    if given:
        raise ConfigError(f"--model.impl megatron does not take {', '.join(given)}: drop those options or use "
                          "--model.impl torch")
    if not job.model.fused_projections:
        raise ConfigError("model.fused_projections false shapes the plain Llama; megatron's GPTModel always fuses "
                          "q/k/v and gate/up and shards them itself: drop it with --model.impl megatron")
    if job.model.name not in MEGATRON_MODELS:
        raise ConfigError(f"--model.impl megatron builds {', '.join(MEGATRON_MODELS)}, not {job.model.name!r}: pick "
                          "one of those or use --model.impl torch")
    if job.model.name in MEGATRON_MOE_MODELS:
        _check_megatron_moe(job)
    elif job.parallelism.expert_parallel > 1:
        raise ConfigError(f"parallelism.expert_parallel={job.parallelism.expert_parallel} splits routed experts over "
                          f"ranks, and {job.model.name} is dense: drop --expert-model-parallel-size or pick an MoE "
                          f"model ({', '.join(MEGATRON_MOE_MODELS)})")
    recipe = job.precision.recipe
    if is_fp8(recipe) and recipe not in MEGATRON_RECIPES:
        raise ConfigError(f"recipe {recipe!r} is a torchao recipe; megatron-core runs FP8 through TransformerEngine: "
                          f"use one of {', '.join(MEGATRON_RECIPES)} or --model.impl torch")
    if job.precision.backend == "torchao":
        raise ConfigError("--backend torchao: megatron-core's linears are TransformerEngine modules; use --backend te "
                          "(or auto) with --model.impl megatron")
    if job.precision.small_gemm_filter not in ("auto", "off"):
        raise ConfigError(f"precision.small_gemm_filter={job.precision.small_gemm_filter!r}: megatron converts every "
                          "TE linear whatever its size; leave it at auto (or off)")


def _check_megatron_moe(job: JobConfig) -> None:
    """What the Megatron path does not do for an MoE model yet; each refusal names the fix."""
    name = job.model.name
    if job.parallelism.tensor_parallel > 1:
        raise ConfigError(f"--model.impl megatron does not split {name}'s layers by tensor parallelism (tensor "
                          "parallelism of MoE layers is not wired): drop --tensor-model-parallel-size and split the "
                          "experts with --expert-model-parallel-size, or use --model.impl torch")
    if job.optimizer.distributed or job.training.param_dtype == "bf16":
        raise ConfigError(f"megatron's optimizer (--use-distributed-optimizer, or --param-dtype bf16) keeps {name}'s "
                          "experts in a second optimizer that the trainer's learning-rate schedule does not drive: "
                          "drop those options (FP32 parameters, the trainer's AdamW), or use --model.impl torch")


def check_expert_parallel(job: JobConfig, routed_experts: int, world_size: int) -> None:
    """parallelism.expert_parallel divides the run's data-parallel ranks (megatron groups them into expert-parallel
    groups) and the model's routed experts (each rank holds the same number), now that both are known."""
    ep, tp = job.parallelism.expert_parallel, job.parallelism.tensor_parallel
    if (world_size // tp) % ep:
        raise ConfigError(f"parallelism.expert_parallel={ep} must divide the {world_size // tp} data-parallel rank(s) "
                          f"({world_size} processes / tensor_parallel {tp}): launch a multiple of {ep * tp} processes "
                          "or change --expert-model-parallel-size")
    if routed_experts % ep:
        raise ConfigError(f"parallelism.expert_parallel={ep} must divide {job.model.name}'s {routed_experts} routed "
                          f"experts (each rank holds as many): pick a divisor of {routed_experts} for "
                          "--expert-model-parallel-size")


def recompute_blocks(spec: str | None) -> list[int] | str | None:
    """'all' | '0,2' | None -> what assemble(recompute=...) takes."""
    if spec is None or spec == "all":
        return spec
    try:
        return [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"activation_checkpoint.layers={spec!r}: write 'all' or block indices like '0,2'") from None


def _check_writable_dir(name: str, path: str) -> None:
    """`path` is, or can be made, a folder this process writes into."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{name} must be a folder path, got {path!r}: pass a folder, or leave it unset")
    target = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{name} {path!r} is a file, not a folder: pass a folder path")
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path!r}: {existing} is not a folder this user can write in: pass a writable folder")


def _choose(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}: use {', '.join(map(str, allowed))}")


def _at_least(name: str, value, low) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{name} must be at least {low}, got {value}")
