"""Train the model_provider's GPTModel with megatron-core's own loop pieces on fp8stack's text data.

    python examples/megatron/train.py --fp8-format hybrid --fp8-recipe delayed --train-iters 50
    torchrun --nproc-per-node 2 examples/megatron/train.py --fp8-format hybrid --fp8-recipe delayed

What Megatron-LM's pretrain() would do, with megatron-core alone: parallel state and CUDA RNG, the GPTModel
from fp8stack_model_provider.build_gpt_model (fp8stack's plan from the --fp8* flags), Float16Module (BF16 parameters),
megatron's DistributedDataParallel (FP32 gradient buffers), get_megatron_optimizer (Adam with FP32 master
weights, gradient clipping), OptimizerParamScheduler (linear warm-up, cosine decay), and each step through
get_forward_backward_func() with finalize_model_grads. The flags are pretrain_gpt's names for the same
things. Tokens are bytes (ids 0..255) of the standard library's sources (fp8stack.train.data.TextData);
data-parallel ranks take their slices of one global batch. Under torchrun each step's loss is averaged over the
data-parallel ranks (as pretrain does for its log), the memory figures are the largest of any rank's, and rank 0
prints and writes the result. Needs CUDA and TransformerEngine.

--layer-spec megatron builds the decoder layers from megatron's own get_gpt_layer_with_transformer_engine_spec
instead of fp8stack's block_spec: the model Megatron-LM's gpt_builder makes, which fp8stack.bench.peers measures
beside fp8stack. pretrain_gpt turns on the bias-SwiGLU, RoPE and bias-dropout-add fusions unless told otherwise;
here each is a flag (off by default, as before). --recompute-granularity full with --recompute-method and
--recompute-num-layers is megatron's full activation recompute, as pretrain_gpt takes it.

MoE (pretrain_gpt's --num-experts and --moe-* flags, megatron's defaults where not given): megatron's own MoE
layers, its dense and MoE layers as --moe-layer-freq lays them out (megatron's syntax: "[0,1,1,1]" or
"([0]*1+[1]*3)" for layer 0 dense). --layer-spec megatron builds them as Megatron-LM's gpt_builder does for an MoE
model, get_gpt_decoder_block_spec with TE (TEGroupedMLP under --moe-grouped-gemm); --layer-spec fp8stack through
block_spec. The aux-loss-free expert bias (--moe-router-enable-expert-bias) moves as under pretrain_gpt: each step's
schedule ends in finalize_model_grads (config.finalize_model_grads_func), which updates it from the step's token
counts.

--out-dir writes the losses, the layers' precision classes and the plan as evidence
(fp8stack.evidence.write_evidence: the run's folder under <out-dir>/runs/, with the commit).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8stack_model_provider import build_gpt_model, plan_for  # noqa: E402  (this folder's)

from fp8stack.evidence import (EvidenceError, add_force_option, claim_evidence, device_slug,  # noqa: E402
                               markdown_table, write_evidence)
from fp8stack.config import ConfigError  # noqa: E402
from fp8stack.plan.recipes import MEGATRON_RECIPES  # noqa: E402
from fp8stack.train.data import TextData  # noqa: E402
from fp8stack.train.preflight import check_output_file  # noqa: E402

PROG = "examples/megatron/train.py"
VOCAB = 256
"""Byte tokens: TextData's ids are 0..255 (the default vocabulary and the least --vocab-size)."""
LAYER_SPECS = ("fp8stack", "megatron")
"""fp8stack: the model_provider's block_spec, from fp8stack's plan; megatron: megatron's own TE layer spec."""
LOSS_EVERY = 10
"""Steps between printed losses."""
TIMING_WARMUP = 5
"""Steps left out of tokens/s (kernel selection, FP8 scale histories filling, allocator growth)."""
ROUTER_SCORES = ("softmax", "sigmoid")
"""--moe-router-score-function's choices (megatron's)."""
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""--moe-router-load-balancing-type's choices (megatron's, less quantile_balancing, which has no flags here)."""
DISPATCHERS = ("allgather", "alltoall", "flex")
"""--moe-token-dispatcher-type's choices (megatron's)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    shape = parser.add_argument_group("model (pretrain_gpt's flags)")
    shape.add_argument("--num-layers", type=int, default=4)
    shape.add_argument("--hidden-size", type=int, default=256)
    shape.add_argument("--ffn-hidden-size", type=int, default=768)
    shape.add_argument("--num-attention-heads", type=int, default=4)
    shape.add_argument("--num-query-groups", type=int, default=2)
    shape.add_argument("--seq-length", type=int, default=256)
    shape.add_argument("--vocab-size", type=int, default=VOCAB, help=f"embedding rows and logits (at least {VOCAB}, "
                                                                    "the byte tokens' ids)")
    shape.add_argument("--rotary-base", type=int, default=10000, help="RoPE base frequency (Llama 3: 500000)")
    shape.add_argument("--init-method-std", type=float, default=0.02,
                       help="std of megatron's normal init of the weights; the attention and MLP output projections "
                            "take it over sqrt(2 x layers) (Megatron-LM's Llama-3 8B recipe: 0.0134)")
    shape.add_argument("--embedding-init-method-std", type=float, default=None,
                       help="std of the token embedding's init (default: --init-method-std; megatron's docs: around "
                            "1.0 may avoid loss spikes)")
    shape.add_argument("--apply-layernorm-1p", action="store_true",
                       help="norm weights zero-centred, applied as 1 + w (TE's norms; Megatron-LM's Llama-3 recipe)")
    shape.add_argument("--layer-spec", choices=LAYER_SPECS, default="fp8stack",
                       help="fp8stack: the model_provider's block_spec (fp8stack's plan from the --fp8* flags); "
                            "megatron: megatron's own get_gpt_layer_with_transformer_engine_spec")
    fusions = parser.add_argument_group("fusions (pretrain_gpt turns each on unless given its --no-... flag)")
    fusions.add_argument("--bias-swiglu-fusion", action="store_true", help="megatron's fused SwiGLU")
    fusions.add_argument("--rope-fusion", action="store_true", help="TE's fused RoPE")
    fusions.add_argument("--bias-dropout-fusion", action="store_true", help="megatron's fused bias-dropout-add")
    add_moe_arguments(parser)
    fp8 = parser.add_argument_group("FP8 (megatron's flags, read into fp8stack's plan)")
    fp8.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None, help="unset: BF16")
    fp8.add_argument("--fp8-recipe", choices=MEGATRON_RECIPES, default="delayed")
    fp8.add_argument("--first-last-layers-bf16", action="store_true")
    fp8.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    fp8.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)
    fp8.add_argument("--fp8-param-gather", action="store_true",
                     help="keep the FP8 layers' weights in FP8 (TE's fp8_model_init), cast from the distributed "
                          "optimizer's FP32 shards; needs --use-distributed-optimizer and --layer-spec megatron")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=8, help="sequences per rank and forward/backward pass")
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="sequences per optimizer step over all data-parallel ranks, each rank accumulating "
                            "global / (micro x ranks) micro-batches (default: one micro-batch per rank)")
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="megatron's distributed optimizer (FP32 masters and moments sharded over data-parallel "
                            "ranks)")
    train.add_argument("--overlap-grad-reduce", action="store_true",
                       help="reduce the gradients in buckets during the backward instead of after it (megatron's DDP)")
    train.add_argument("--overlap-param-gather", action="store_true",
                       help="all-gather the distributed optimizer's updated parameters during the next forward; needs "
                            "--use-distributed-optimizer and --overlap-grad-reduce")
    train.add_argument("--recompute-granularity", choices=("full",), default=None,
                       help="megatron's activation recompute: full reruns whole layers in the backward, in units of "
                            "--recompute-num-layers (selective is not wired here)")
    train.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                       help="megatron's: uniform recomputes every unit, block only the first --recompute-num-layers")
    train.add_argument("--recompute-num-layers", type=int, default=None, help="megatron's: layers per recompute unit")
    train.add_argument("--train-iters", type=int, default=50)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--min-lr", type=float, default=1e-4)
    train.add_argument("--lr-warmup-iters", type=int, default=10)
    train.add_argument("--lr-warmup-init", type=float, default=0.0,
                       help="the learning rate the warm-up starts from, at the first step (megatron's default 0)")
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.95,
                       help="Llama's and Megatron-LM's Llama-3 recipe's (pretrain_gpt's default: 0.999)")
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--tensor-model-parallel-size", type=int, default=1)
    train.add_argument("--seed", type=int, default=1234)
    out = parser.add_argument_group("evidence")
    out.add_argument("--out-dir", default=None, help="write the run's evidence under <out-dir>/runs/")
    out.add_argument("--label", default=None, help="added to the evidence's name")
    add_force_option(out)
    out.add_argument("--result-json", type=Path, default=None,
                     help="write the losses, step times (ms), tokens per step and peak memory here (rank 0)")
    args = parser.parse_args(argv)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "seq_length", "micro_batch_size", "train_iters", "tensor_model_parallel_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    if args.vocab_size < VOCAB:
        parser.error(f"--vocab-size {args.vocab_size}: the byte tokens need at least {VOCAB} rows")
    if args.global_batch_size is not None and (args.global_batch_size < 1
                                               or args.global_batch_size % args.micro_batch_size):
        parser.error(f"--global-batch-size {args.global_batch_size}: give a positive multiple of --micro-batch-size "
                     f"{args.micro_batch_size}")
    if args.fp8_param_gather:
        missing = [flag for flag, given in (("--fp8-format", args.fp8_format),
                                            ("--use-distributed-optimizer", args.use_distributed_optimizer),
                                            ("--layer-spec megatron", args.layer_spec == "megatron")) if not given]
        if missing:
            parser.error(f"--fp8-param-gather casts FP8 weights from the distributed optimizer's shards of megatron's "
                         f"own layers: add {' '.join(missing)}")
    if args.overlap_param_gather:
        missing = [flag for flag, given in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                            ("--overlap-grad-reduce", args.overlap_grad_reduce)) if not given]
        if missing:
            parser.error(f"--overlap-param-gather overlaps the distributed optimizer's all-gather as megatron does: "
                         f"add {' '.join(missing)}")
    check_recompute(parser, args)
    check_moe(parser, args)
    if args.clip_grad <= 0:
        parser.error(f"--clip-grad {args.clip_grad}: give a positive norm (the run reports the gradient norm the "
                     "clipping computes)")
    stds = [flag for flag, std in (("--init-method-std", args.init_method_std),
                                   ("--embedding-init-method-std", args.embedding_init_method_std))
            if std is not None and std <= 0]
    if stds:
        parser.error(f"{' '.join(stds)}: give a positive standard deviation")
    if not 0 <= args.lr_warmup_init <= args.lr:
        parser.error(f"--lr-warmup-init {args.lr_warmup_init}: give 0 to --lr {args.lr} (the warm-up rises from it)")
    if args.lr_warmup_iters >= args.train_iters:
        parser.error(f"--lr-warmup-iters {args.lr_warmup_iters} leaves no step after the warm-up of "
                     f"--train-iters {args.train_iters}: lower it")
    # The attributes Megatron-LM's gpt_builder reads, as its argument parser would set them.
    args.padded_vocab_size, args.max_position_embeddings = args.vocab_size, args.seq_length
    args.position_embedding_type, args.untie_embeddings_and_output_weights = "rope", True
    return args


def check_recompute(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Megatron's rule: full recompute needs its method and layers per unit, and these apply to full only."""
    given = [flag for flag, value in (("--recompute-method", args.recompute_method),
                                      ("--recompute-num-layers", args.recompute_num_layers)) if value is not None]
    if args.recompute_granularity is None and given:
        parser.error(f"{' '.join(given)} set how full recompute runs: add --recompute-granularity full, or drop them")
    if args.recompute_granularity == "full" and len(given) < 2:
        parser.error("--recompute-granularity full needs --recompute-method and --recompute-num-layers, as megatron "
                     "does: add --recompute-method uniform --recompute-num-layers 1 (each layer recomputed)")
    if args.recompute_num_layers is not None and not 1 <= args.recompute_num_layers <= args.num_layers:
        parser.error(f"--recompute-num-layers {args.recompute_num_layers}: give 1 to --num-layers "
                     f"{args.num_layers}")


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """pretrain_gpt's MoE flags, at megatron's defaults (every --moe-* flag needs --num-experts)."""
    from megatron.training.arguments import moe_freq_type  # megatron's own --moe-layer-freq syntax

    moe = parser.add_argument_group("MoE (pretrain_gpt's flags; without --num-experts the model is dense)")
    moe.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is sent to")
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                     help="each routed expert's SwiGLU width (default: --ffn-hidden-size)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                     help="the always-on shared expert's SwiGLU width (default: no shared expert)")
    moe.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                     help='N: every Nth layer MoE; or a list pattern, 1 MoE and 0 dense: "([0]*1+[1]*3)"')
    moe.add_argument("--moe-router-score-function", choices=ROUTER_SCORES, default="softmax")
    moe.add_argument("--moe-router-pre-softmax", action="store_true",
                     help="softmax over all experts before the top k (softmax scores only)")
    moe.add_argument("--moe-router-enable-expert-bias", action="store_true",
                     help="DeepSeek-V3's aux-loss-free expert bias (sigmoid scores only)")
    moe.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                     help="how far each step moves the expert bias (needs --moe-router-enable-expert-bias)")
    moe.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING, default="aux_loss")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    moe.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                     help="the router's GEMM and weights in this dtype (default: the activations')")
    moe.add_argument("--moe-grouped-gemm", action="store_true", help="the experts as grouped GEMMs (TEGroupedMLP)")
    moe.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather")
    moe.add_argument("--moe-permute-fusion", action="store_true", help="TE's fused token permutation")
    moe.add_argument("--moe-router-padding-for-quantization", action="store_true",
                     help="pad each expert's tokens to the FP8 GEMM's multiple (needs --fp8-format and the alltoall "
                          "or flex dispatcher)")


MOE_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
             "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
             "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_dtype",
             "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_permute_fusion",
             "moe_router_padding_for_quantization")
"""The --moe-* flags: the TransformerConfig fields of the same names, which shape MoE layers only."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_moe(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The MoE flags whole and consistent, megatron's rules checked before anything is built."""
    given = [_flag(name) for name in MOE_FLAGS if getattr(args, name) != parser.get_default(name)]
    if args.num_experts is None:
        if given:
            parser.error(f"{' '.join(given)} shape MoE layers: add --num-experts N, or drop them")
        return
    experts, layers, freq = args.num_experts, args.num_layers, args.moe_layer_freq
    if experts < 1:
        parser.error(f"--num-experts {experts}: give 1 or more (leave it out for a dense model)")
    if not 1 <= args.moe_router_topk <= experts:
        parser.error(f"--moe-router-topk {args.moe_router_topk}: give 1 to --num-experts {experts}")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"{_flag(name)} {getattr(args, name)}: give a positive width")
    if isinstance(freq, list) and (len(freq) != layers or set(freq) - {0, 1}):
        parser.error(f"--moe-layer-freq {freq}: give one 0 (dense) or 1 (MoE) per layer of --num-layers {layers}")
    if isinstance(freq, int) and not 1 <= freq <= layers:
        parser.error(f"--moe-layer-freq {freq}: give 1 to --num-layers {layers} (every Nth layer MoE)")
    sigmoid = args.moe_router_score_function == "sigmoid"
    if sigmoid and args.moe_router_pre_softmax:
        parser.error("--moe-router-pre-softmax orders softmax scores: drop it, or use --moe-router-score-function "
                     "softmax")
    if args.moe_router_enable_expert_bias and not sigmoid:
        parser.error("--moe-router-enable-expert-bias biases sigmoid scores (megatron refuses it on softmax): add "
                     "--moe-router-score-function sigmoid, or drop it")
    if "--moe-router-bias-update-rate" in given and not args.moe_router_enable_expert_bias:
        parser.error("--moe-router-bias-update-rate moves the expert bias: add --moe-router-enable-expert-bias, or "
                     "drop it")
    if args.moe_aux_loss_coeff and args.moe_router_load_balancing_type == "none":
        parser.error(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} weighs an auxiliary loss that "
                     "--moe-router-load-balancing-type none leaves out: give 0, or an aux_loss type")
    if args.moe_router_padding_for_quantization:
        missing = [flag for flag, present in (("--fp8-format", args.fp8_format),
                                              ("--moe-token-dispatcher-type alltoall",
                                               args.moe_token_dispatcher_type != "allgather")) if not present]
        if missing:
            parser.error(f"--moe-router-padding-for-quantization pads the experts' FP8 GEMMs after an alltoall or "
                         f"flex dispatch: add {' '.join(missing)}")


def moe_config(args: argparse.Namespace) -> dict:
    """The TransformerConfig's MoE fields from the --num-experts and --moe-* flags ({} for a dense model)."""
    if args.num_experts is None:
        return {}
    return {"num_moe_experts": args.num_experts, **{name: getattr(args, name) for name in MOE_FLAGS}}


def evidence_stem(args) -> str:
    precision = f"{args.fp8_recipe}-{args.fp8_format}" if args.fp8_format else "bf16"
    spec = "megatron-spec" if args.layer_spec == "megatron" else None
    return "-".join(filter(None, ["example-megatron", spec, precision, args.label, device_slug()]))


def transformer_config(args):
    """The TransformerConfig pretrain_gpt would make from the same flags (Llama-style: SwiGLU, RMSNorm, no biases)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = args.tensor_model_parallel_size
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, init_method_std=args.init_method_std,
        embedding_init_method_std=args.embedding_init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, first_last_layers_bf16=args.first_last_layers_bf16,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16, fp8_param=args.fp8_param_gather,
        bias_activation_fusion=args.bias_swiglu_fusion, apply_rope_fusion=args.rope_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        **moe_config(args))


def check_machine() -> None:
    """CUDA and TransformerEngine, before anything is built (one line and exit code 2 otherwise)."""
    from fp8stack.megatron import te_usable

    if not torch.cuda.is_available():
        _refuse("needs a CUDA GPU: megatron-core's GPTModel and its TransformerEngine layers run on CUDA; "
                "tests/test_megatron_example.py builds the model on a CPU")
    if not te_usable():
        _refuse("needs TransformerEngine: pip install 'fp8stack[te]'")


def _refuse(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def init_distributed(args) -> tuple[int, int]:
    """torch.distributed over torchrun's processes (or this one alone), megatron's parallel state and RNG;
    returns this rank's data-parallel (rank, size)."""
    from megatron.core import parallel_state, tensor_parallel

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if "RANK" not in os.environ:  # run without torchrun: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    if torch.distributed.get_world_size() % args.tensor_model_parallel_size:
        raise SystemExit(f"{PROG}: error: {torch.distributed.get_world_size()} processes are not a multiple of "
                         f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, te_rng_tracker=True)
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def microbatches_per_step(args, dp_size: int) -> int:
    """Micro-batches each rank accumulates per optimizer step: --global-batch-size over micro-batch x ranks."""
    if args.global_batch_size is None:
        return 1
    if args.global_batch_size % (args.micro_batch_size * dp_size):
        _refuse(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                f"{args.micro_batch_size} x {dp_size} data-parallel ranks")
    return args.global_batch_size // (args.micro_batch_size * dp_size)


def layer_spec(args, config):
    """The decoder layers' spec --layer-spec names; None leaves it to the model_provider (block_spec)."""
    if args.layer_spec == "fp8stack":
        return None
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    if args.num_experts is not None:  # gpt_builder's call for an MoE model: a spec per layer, dense or MoE
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    return get_gpt_layer_with_transformer_engine_spec()  # gpt_builder's call for a dense model, its defaults


def build(args, config):
    """The model as pretrain() builds it: GPTModel (through build_gpt_model), Float16Module, DDP; its optimizer
    and LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(args.seed)
    gpt = build_gpt_model(args, config, use_te=True, spec=layer_spec(args, config)).cuda()
    layers = [type(layer).__name__ for layer in gpt.decoder.layers]
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer,
                                        fp8_param_gather=args.fp8_param_gather,
                                        overlap_grad_reduce=args.overlap_grad_reduce,
                                        overlap_param_gather=args.overlap_param_gather)
    model = DistributedDataParallel(config, ddp, module=Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    # What pretrain()'s setup gives the schedule: the gradient all-reduce and the loss scale.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, lr_scheduler(args, optimizer), layers


def optimizer_config(args):
    """get_megatron_optimizer's configuration from pretrain_gpt's flags: Adam with FP32 master weights and moments,
    decoupled weight decay (megatron's groups leave norms and biases undecayed), gradient clipping."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           clip_grad=args.clip_grad, bf16=True, params_dtype=torch.bfloat16,
                           use_distributed_optimizer=args.use_distributed_optimizer,
                           overlap_param_gather=args.overlap_param_gather)


def lr_scheduler(args, optimizer):
    """megatron's OptimizerParamScheduler, stepped once per optimizer step: step s of the warm-up at
    --lr-warmup-init + (--lr - --lr-warmup-init) x s / --lr-warmup-iters, then cosine decay to --min-lr at
    --train-iters; constant weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters, lr_decay_style="cosine",
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant")


def forward_step(data_iterator, model):
    """pretrain_gpt's forward_step shape: one micro-batch through the model, and the loss function for its output."""
    tokens, labels = (t.cuda(non_blocking=True) for t in next(data_iterator))
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return model(tokens, positions, None, labels=labels), loss_func


def loss_func(output_tensor):
    """Mean next-token cross-entropy (megatron's per-token losses) and what the schedule reports of it."""
    loss = output_tensor.float().mean()
    # A copy: the schedule divides the returned loss in place by the micro-batches per step.
    return loss, {"lm loss": loss.detach().clone()}


def train(args, model, optimizer, scheduler, data, microbatches: int = 1) -> dict:
    """args.train_iters steps of megatron's schedule, `microbatches` micro-batches each; losses (the mean over a step's
    micro-batches and the data-parallel ranks), gradient norms, step times (each ends on the host reading the step's
    loss), tokens/s, and the largest peak and resident memory of any rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    ranks = parallel_state.get_data_parallel_group()
    printing = torch.distributed.get_rank() == 0
    losses, grad_norms, step_ms, began = [], [], [], None
    for step in range(args.train_iters):
        if step == TIMING_WARMUP:
            torch.cuda.synchronize()
            began = time.perf_counter()
        step_began = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                    num_microbatches=microbatches, seq_length=args.seq_length,
                                    micro_batch_size=args.micro_batch_size, forward_only=False)
        updated, grad_norm, _ = optimizer.step()
        if not updated:
            raise RuntimeError(f"step {step}: megatron's optimizer skipped the update (non-finite gradients)")
        scheduler.step(increment=1)
        step_loss = torch.stack([r["lm loss"] for r in reported]).mean()
        torch.distributed.all_reduce(step_loss, group=ranks)
        losses.append(step_loss.item() / torch.distributed.get_world_size(ranks))
        step_ms.append((time.perf_counter() - step_began) * 1000)
        grad_norms.append(float(grad_norm))
        if printing and (step % LOSS_EVERY == 0 or step == args.train_iters - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  grad norm {grad_norms[-1]:.3f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
    torch.cuda.synchronize()
    timed = args.train_iters - TIMING_WARMUP
    tokens_per_step = microbatches * args.micro_batch_size * args.seq_length * torch.distributed.get_world_size() \
        // args.tensor_model_parallel_size
    return {"losses": losses, "grad_norms": grad_norms, "step_ms": step_ms, "tokens_per_step": tokens_per_step,
            "tokens_per_s": timed * tokens_per_step / (time.perf_counter() - began) if timed > 0 else None,
            "peak_mem_gib": largest_over_ranks(torch.cuda.max_memory_allocated() / 2 ** 30),
            # what stays allocated between steps: parameters, optimizer state, gradient buffers, weight caches
            "resident_mem_gib": largest_over_ranks(torch.cuda.memory_allocated() / 2 ** 30)}


def largest_over_ranks(value: float) -> float:
    """The largest of a number over all ranks (a rank's memory: the ranks need not hold the same)."""
    largest = torch.tensor(value, dtype=torch.float64, device="cuda")
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return largest.item()


def report(args, plan, layers: list[str], result: dict, patch_report) -> tuple[dict, str]:
    """The evidence's payload and Markdown."""
    window = max(1, args.train_iters // 5)
    first, final = result["losses"][0], sum(result["losses"][-window:]) / window
    payload = {"model": {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                        "num_attention_heads", "num_query_groups", "seq_length")},
               "moe": moe_config(args) or None,
               "vocab_size": args.vocab_size, "layer_spec": args.layer_spec, "fp8_format": args.fp8_format,
               "recipe": args.fp8_recipe if args.fp8_format else "bf16", "steps": args.train_iters,
               "micro_batch": args.micro_batch_size, "global_batch": args.global_batch_size,
               "tensor_parallel": args.tensor_model_parallel_size, "world_size": torch.distributed.get_world_size(),
               "lr": args.lr, "recompute": args.recompute_granularity, "layers": layers,
               "plan": plan.summary() if plan else None, "patches": patch_report,
               "loss_first": first, "loss_final_mean": final, "final_window": window, **result}
    rows = [[step, f"{loss:.4f}"] for step, loss in enumerate(result["losses"])
            if step % LOSS_EVERY == 0 or step == args.train_iters - 1]
    tokens_per_s = f"{result['tokens_per_s']:,.0f}" if result["tokens_per_s"] else "-"
    source = ("megatron's own TE layer spec" if args.layer_spec == "megatron"
              else "examples/megatron/fp8stack_model_provider.py")
    markdown = (f"GPTModel from {source} ({args.num_layers} layers, hidden "
                f"{args.hidden_size}, seq {args.seq_length}), trained by megatron-core's schedule, DDP and optimizer "
                f"for {args.train_iters} steps: {payload['recipe']} "
                f"({args.fp8_format or 'no FP8'}).\n\n"
                f"Layers: {', '.join(layers)}.\n\n"
                + markdown_table(["first loss", f"mean loss of the last {window} steps", "tokens/s", "peak GiB"],
                                 [[f"{first:.4f}", f"{final:.4f}", tokens_per_s, f"{result['peak_mem_gib']:.2f}"]])
                + "\n" + markdown_table(["step", "loss"], rows))
    return payload, markdown


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out_dir is not None:
        try:
            claim_evidence(evidence_stem(args), args.out_dir, args.force)
        except EvidenceError as err:
            _refuse(str(err))
    if args.result_json is not None:
        try:
            check_output_file(args.result_json, "--result-json")
        except ConfigError as err:
            _refuse(str(err))
    check_machine()
    from fp8stack import patches

    patch_report = patches.apply_all()
    dp_rank, dp_size = init_distributed(args)
    try:
        microbatches = microbatches_per_step(args, dp_size)
        config = transformer_config(args)
        plan = plan_for(args, config) if args.layer_spec == "fp8stack" else None
        model, optimizer, scheduler, layers = build(args, config)
        data = TextData(args.seq_length, args.micro_batch_size, args.seed, rank=dp_rank, ranks=dp_size)
        result = train(args, model, optimizer, scheduler, data, microbatches)
        if args.result_json is not None and torch.distributed.get_rank() == 0:
            args.result_json.write_text(json.dumps({"layers": layers, **result}) + "\n")
        if args.out_dir is not None and torch.distributed.get_rank() == 0:
            payload, markdown = report(args, plan, layers, result, patch_report)
            for path in write_evidence(evidence_stem(args), payload, markdown, args.out_dir, replace=True):
                print(f"wrote {path}")
        if not all(math.isfinite(loss) for loss in result["losses"]):
            print(f"{PROG}: the loss went non-finite", file=sys.stderr)
            return 1
        return 0
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
