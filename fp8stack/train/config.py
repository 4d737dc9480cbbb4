"""What one training run is told (TrainConfig, validated on construction) and what it measured (TrainResult)."""

import importlib.util
import math
import types
from dataclasses import dataclass, field, fields

import torch

from fp8stack.models import LlamaConfig
from fp8stack.plan.recipes import BLOCKWISE_EXPERT_BACKENDS, BLOCKWISE_GEMMS, PARAM_DTYPES
from fp8stack.runtime.attention import SDPA_BACKENDS
from fp8stack.runtime.recompute import RECOMPUTE_MODULES
from fp8stack.train.data import DATA_SOURCES, DEFAULT_MAX_BYTES

MODELS = {"tiny": LlamaConfig.tiny, "tiny-moe": LlamaConfig.tiny_moe, "llama-1b-like": LlamaConfig.llama_1b_like}
"""Model name -> its LlamaConfig."""
MODEL_IMPLS = ("torch", "megatron")
"""How the model is built: the plain-torch Llama, or a megatron-core GPTModel (TrainConfig.model_impl)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MAX_SEQ_LEN = 1 << 17
"""Longest sequence a run may ask for (Llama 3's 128k context): a longer one would only exhaust memory."""


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
    """Backend for dense linears: auto | te | torchao (te with recipe bf16: TE modules without FP8)."""
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
    blockwise_experts: str = "auto"
    """Where blockwise expert GEMMs run: grouped_fp8 (DeepGEMM, else torch scaled_mm per expert), te (TE
    GroupedLinear), or auto: te where TE runs blockwise FP8 (faster than grouped_fp8 on either kernels at issue 7's
    shape, profiles/backends-issue7-experts-deepgemm-h200.md), else grouped_fp8."""
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
    """torch.compile the blocks (assembly stage 4) and the loss."""
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
    """The TE linears' weight-gradient GEMMs accumulate into FP32 main_grad buffers (TE fuse_wgrad_accumulation),
    with no BF16 weight gradient, dtype conversion or per-micro-batch add; on the plain path the plan puts the
    output head on a TE module without FP8 to get the same (PolicyConfig.head_on_te). model_impl megatron: megatron's
    DistributedDataParallel keeps the buffers (one per parameter; DDP adds the others' gradients); torch: the TE
    backend's, which are the weights' .grad (one process; TE layers in the plan)."""
    param_dtype: str = "fp32"
    """fp32: the parameters are the FP32 master weights AdamW steps, cast by autocast (or to FP8) at every forward;
    bf16: BF16 parameters with FP32 masters in the optimizer, copied to them once per step (Megatron's --bf16;
    fp8stack.precision.MasterWeights): no cast per micro-batch. One process, plain path; 2 more bytes per parameter.
    fp8: as bf16, but the TE FP8 linears hold their weights in FP8 only (TE quantized_model_init, Megatron's
    --fp8-param-gather), quantized from the masters once per step: no BF16 copy beside the FP8 one."""
    blockwise_gemms: str = "te"
    """Where TE's blockwise modules run their GEMMs: te (cuBLAS) or deepgemm (DeepGEMM's dense kernels on TE's
    operands, bit-identical; needs DeepGEMM, launch/build_deepgemm.sh)."""
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
    trust_checkpoint: bool = False
    """Let TransformerEngine unpickle the FP8 scaling state of the resumed checkpoint (delayed scaling keeps it as a
    pickle, which can run code): only for a checkpoint this user wrote. Without it such a resume is refused."""
    resume_despite_changes: bool = False
    """Resume a checkpoint saved under other settings (recipe, model, layout, batch, sequence length, plan): by
    default such a resume is refused, naming what changed."""
    fp8_stats_interval: int = 0
    """Every this many steps, write each FP8 layer's amax, scale, saturated and flushed-to-zero counts (inputs and
    weights, runtime.numerics.fp8_stats) to TensorBoard under fp8/ (needs log_dir); 0 writes none."""
    progress: bool = True
    """Show a rich progress bar when stdout is a terminal."""

    def __post_init__(self) -> None:
        self._check_types()
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
        elif self.gradient_accumulation_fusion and (self.fsdp_one_rank or self.tensor_parallel > 1):
            raise TrainConfigError("gradient_accumulation_fusion on the plain model keeps FP32 main_grad buffers that "
                                   "neither FSDP nor tensor parallelism reduce: drop --fsdp-one-rank and "
                                   "--tensor-model-parallel-size, or use --model-impl megatron")
        if self.log_dir and importlib.util.find_spec("tensorboard") is None:
            raise TrainConfigError(f"log_dir {self.log_dir!r} (--tensorboard-dir) writes TensorBoard scalars and "
                                   "tensorboard is not installed: pip install 'fp8stack[tb]'")
        if self.param_dtype not in PARAM_DTYPES:
            raise TrainConfigError(f"unknown param_dtype {self.param_dtype!r}: use {' or '.join(PARAM_DTYPES)}")
        if self.param_dtype != "fp32" and (self.fsdp_one_rank or self.tensor_parallel > 1 or self.dtype == "fp32"):
            raise TrainConfigError(f"param_dtype {self.param_dtype} keeps FP32 masters of one process's "
                                   f"{self.param_dtype.upper()} parameters for bf16 "
                                   "activations: drop --fsdp-one-rank and --tensor-model-parallel-size (FSDP2's "
                                   "mixed-precision policy casts its own BF16 parameters) and --dtype fp32")
        if self.blockwise_experts not in ("auto", *BLOCKWISE_EXPERT_BACKENDS):
            raise TrainConfigError(f"unknown blockwise_experts {self.blockwise_experts!r}: use auto, "
                                   f"{' or '.join(BLOCKWISE_EXPERT_BACKENDS)}")
        if self.blockwise_gemms not in BLOCKWISE_GEMMS:
            raise TrainConfigError(f"unknown blockwise_gemms {self.blockwise_gemms!r}: use "
                                   f"{' or '.join(BLOCKWISE_GEMMS)}")
        if self.blockwise_gemms != "te" and self.recipe != "blockwise":
            raise TrainConfigError(f"blockwise_gemms={self.blockwise_gemms} moves the GEMMs of recipe blockwise, and "
                                   f"the recipe is {self.recipe}: use --fp8-recipe blockwise or drop --blockwise-gemms")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise TrainConfigError(f"unknown sdpa_backend {self.sdpa_backend!r}: use {', '.join(SDPA_BACKENDS)}")
        for name in ("steps", "micro_batch", "tensor_parallel", "log_interval"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "fp8_margin", "fp8_priming_passes", "fp8_grad_check_steps", "eval_batches",
                     "checkpoint_interval", "fp8_stats_interval"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.max_data_bytes < 1:
            raise TrainConfigError(f"max_data_bytes must be at least 1, got {self.max_data_bytes}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise TrainConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TrainConfigError(f"lr must be positive, got {self.lr}: the schedule scales it (warm-up, decay)")
        if self.weight_decay < 0:
            raise TrainConfigError(f"weight_decay must be non-negative (0: no decay), got {self.weight_decay}")
        if self.grad_clip < 0:
            raise TrainConfigError(f"grad_clip must be non-negative (0: no clipping), got {self.grad_clip}")
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
        if self.seq_len is not None and not 2 <= self.seq_len <= MAX_SEQ_LEN:
            raise TrainConfigError(f"seq_len must be between 2 and {MAX_SEQ_LEN}, got {self.seq_len}")
        if self.fp8_stats_interval and not self.log_dir:
            raise TrainConfigError("fp8_stats_interval writes FP8 statistics to TensorBoard: pass --tensorboard-dir, "
                                   "or drop --fp8-stats-interval")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise TrainConfigError("resume='latest' needs checkpoint_dir: pass --save DIR (or --load a checkpoint)")
        recompute_blocks(self.recompute)
        self.recompute_modules = tuple(self.recompute_modules)  # a JSON --config gives a list
        unknown = [name for name in self.recompute_modules if name not in RECOMPUTE_MODULES]
        if unknown:
            raise TrainConfigError(f"unknown recompute module(s) {', '.join(unknown)}: "
                                   f"use {', '.join(RECOMPUTE_MODULES)}")
        if self.recompute is None and self.recompute_modules != ("block",):
            raise TrainConfigError(f"recompute_modules {list(self.recompute_modules)} need recompute: pass "
                                   "--recompute-granularity selective (all blocks) or --recompute-layers I,J")

    def _check_types(self) -> None:
        """Each field holds its annotated type (a JSON --config can hold anything): bool is no int, an int is a
        float, a list is a tuple."""
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = f.type.__args__ if isinstance(f.type, types.UnionType) else (f.type,)
            if not any(_is_a(value, kind) for kind in kinds):
                names = " or ".join(_KIND_NAMES.get(kind, getattr(kind, "__name__", str(kind))) for kind in kinds)
                raise TrainConfigError(f"{f.name} must be {names}, got {value!r}")


_KIND_NAMES = {type(None): "null", tuple[str, ...]: "a list of names", bool: "true or false", int: "an integer",
               float: "a number", str: "a string"}


def _is_a(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if getattr(kind, "__origin__", None) is tuple:  # tuple[str, ...]
        return isinstance(value, (tuple, list)) and all(isinstance(item, str) for item in value)
    return isinstance(value, kind)


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


def recompute_blocks(spec: str | None) -> list[int] | str | None:
    """'all' | '0,2' | None -> what assemble(recompute=...) takes."""
    if spec is None or spec == "all":
        return spec
    try:
        return [int(part) for part in spec.split(",")]
    except ValueError:
        raise TrainConfigError(f"recompute={spec!r}: write 'all' or comma-separated block indices like '0,2'") from None
