"""`python -m fp8stack.train`: train with Megatron-style flags (launch/train.sh wraps it in torchrun).

Flags map onto TrainConfig fields; --config reads a JSON of TrainConfig fields first (how
`fp8stack ab` hands each arm its settings) and the flags given override it. Mistakes in the input
end with exit code 2 and one line 'python -m fp8stack.train: error: <problem and fix>', before any
model is built; a NaN or infinite loss or gradient norm with exit code 1 and one line naming the
first non-finite layer and the file pinning the step; SIGTERM or SIGINT with a final checkpoint,
one line and exit code 128 + the signal's number.
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from fp8stack import __version__
from fp8stack.plan import PlanError
from fp8stack.plan.policy import SMALL_GEMM_CHOICES
from fp8stack.plan.recipes import (BACKEND_PREFERENCES, BF16, BLOCKWISE_EXPERT_BACKENDS, BLOCKWISE_GEMMS, FP8_FORMATS,
                                   PARAM_DTYPES, RECIPES)

PROG = "python -m fp8stack.train"
USAGE_ERROR = 2

# (flag, TrainConfig field, argparse options). Megatron's names where Megatron has the option.
FLAGS: tuple[tuple[str, str, dict], ...] = (
    ("--model", "model", {"help": "tiny | tiny-moe | llama-1b-like"}),
    ("--model-impl", "model_impl", {"choices": ("torch", "megatron"),
                                    "help": "torch: the plain Llama through assemble; megatron: a megatron-core "
                                            "GPTModel through fp8stack's block factory (CUDA, TE)"}),
    ("--fused-projections", "fused_projections", {"action": argparse.BooleanOptionalAction,
                                                  "help": "fused wqkv / w13 GEMMs (default); --no-fused-projections "
                                                          "builds wq/wk/wv and w1/w3 for tensor parallelism"}),
    ("--fp8-recipe", "recipe", {"choices": (BF16, *RECIPES), "help": "FP8 recipe, or bf16 for none"}),
    ("--fp8-format", "fp8_format", {"choices": FP8_FORMATS, "help": "e4m3, or hybrid (E5M2 gradients)"}),
    ("--fp8-margin", "fp8_margin", {"type": int, "metavar": "N",
                                    "help": "delayed scaling: scales leave 2^N headroom below the FP8 maximum"}),
    ("--backend", "backend", {"choices": BACKEND_PREFERENCES,
                              "help": "backend for dense linears (te with --fp8-recipe bf16: TE modules without FP8)"}),
    ("--first-last-layers-bf16", "first_last_layers_bf16", {"action": argparse.BooleanOptionalAction,
                                                            "help": "keep the first and last layers BF16"}),
    ("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16", {"type": int, "metavar": "N"}),
    ("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16", {"type": int, "metavar": "N"}),
    ("--small-gemm-filter", "small_gemm_filter", {"choices": SMALL_GEMM_CHOICES}),
    ("--blockwise-experts", "blockwise_experts", {
        "choices": ("auto", *BLOCKWISE_EXPERT_BACKENDS),
        "help": "blockwise expert GEMMs on fp8stack's grouped kernels or TE GroupedLinear "
                "(auto: te where TE runs blockwise FP8, measured faster)"}),
    ("--blockwise-gemms", "blockwise_gemms", {
        "choices": BLOCKWISE_GEMMS,
        "help": "TE blockwise modules' GEMMs on cuBLAS (te) or DeepGEMM's dense kernels, bit-identical (deepgemm)"}),
    ("--train-iters", "steps", {"type": int, "metavar": "N", "help": "optimizer steps"}),
    ("--lr-warmup-iters", "warmup", {"type": int, "metavar": "N"}),
    ("--lr", "lr", {"type": float}),
    ("--min-lr", "min_lr", {"type": float}),
    ("--weight-decay", "weight_decay", {"type": float}),
    ("--clip-grad", "grad_clip", {"type": float, "help": "global gradient-norm clip; 0 disables"}),
    ("--micro-batch-size", "micro_batch", {"type": int, "metavar": "N"}),
    ("--global-batch-size", "global_batch", {"type": int, "metavar": "N",
                                             "help": "sequences per optimizer step over all ranks (gradient "
                                                     "accumulation); default: one micro-batch per rank"}),
    ("--seq-length", "seq_len", {"type": int, "metavar": "N", "help": "default: the model's"}),
    ("--seed", "seed", {"type": int}),
    ("--dtype", "dtype", {"choices": ("auto", "bf16", "fp32"), "help": "activation dtype (auto: bf16 on CUDA)"}),
    ("--param-dtype", "param_dtype", {"choices": PARAM_DTYPES,
                                      "help": "fp32: FP32 parameters, cast at every forward; bf16: BF16 parameters "
                                              "with FP32 masters in the optimizer (Megatron's --bf16); fp8: as bf16, "
                                              "the TE FP8 layers' weights in FP8 only (Megatron's "
                                              "--fp8-param-gather)"}),
    ("--device", "device", {"choices": ("auto", "cuda", "cpu")}),
    ("--compile", "compile", {"action": argparse.BooleanOptionalAction,
                              "help": "torch.compile each block and the loss"}),
    ("--sdpa-backend", "sdpa_backend", {"metavar": "NAME",
                                         "help": "attention kernel on a GPU: auto | cudnn | flash | efficient"}),
    ("--fuse-norm", "fuse_norm", {"action": argparse.BooleanOptionalAction,
                                  "help": "fold RMSNorms into TE LayerNormLinear (TE layers only)"}),
    ("--fuse-mlp", "fuse_mlp", {"action": argparse.BooleanOptionalAction,
                                "help": "run each dense block's ffn_norm + SwiGLU MLP as one TE LayerNormMLP"}),
    ("--compress-activations", "compress_activations", {
        "action": argparse.BooleanOptionalAction,
        "help": "store BF16 activations saved for backward in FP8 (measured on a 1B model: 0.86x memory, "
                "+12%% loss, slower; profiles/NOTES.md 7)"}),
    ("--recompute-layers", "recompute", {"metavar": "all|I,J", "help": "blocks to recompute in backward"}),
    ("--tensor-model-parallel-size", "tensor_parallel", {"type": int, "metavar": "N"}),
    ("--gradient-accumulation-fusion", "gradient_accumulation_fusion", {
        "action": argparse.BooleanOptionalAction,
        "help": "TE's wgrad GEMMs accumulate into FP32 main_grad buffers (megatron: DDP's; torch: one process)"}),
    ("--fsdp-one-rank", "fsdp_one_rank", {"action": argparse.BooleanOptionalAction,
                                          "help": "FSDP2 on one data-parallel rank too (a sharded run's numerics)"}),
    ("--fsdp-float8-all-gather", "fsdp_float8_all_gather", {"action": argparse.BooleanOptionalAction}),
    ("--precompute-fp8-scales", "precompute_fp8_scales", {"action": argparse.BooleanOptionalAction}),
    ("--profile-collectives", "profile_collectives", {"type": int, "metavar": "N",
                                                      "help": "count collectives and bytes over N steps"}),
    ("--data-source", "data_source", {"metavar": "stdlib|python",
                                      "help": "stdlib: the standard library's sources; python: those, then "
                                              "site-packages' (more text for long runs)"}),
    ("--max-data-bytes", "max_data_bytes", {"type": int, "metavar": "N", "help": "read at most N bytes of text"}),
    ("--eval-iters", "eval_batches", {"type": int, "metavar": "N", "help": "validation batches after training"}),
    ("--tensorboard-dir", "log_dir", {"metavar": "DIR", "help": "train.jsonl and TensorBoard scalars"}),
    ("--log-interval", "log_interval", {"type": int, "metavar": "N"}),
    ("--save", "checkpoint_dir", {"metavar": "DIR", "help": "checkpoint folder"}),
    ("--save-interval", "checkpoint_interval", {"type": int, "metavar": "N"}),
    ("--load", "resume", {"metavar": "PATH", "help": "resume: a step-* checkpoint, a folder of them (newest), "
                                                     "or 'latest' under --save"}),
    ("--trust-checkpoint", "trust_checkpoint", {
        "action": "store_true", "help": "let TransformerEngine unpickle the resumed checkpoint's delayed-scaling "
                                        "state (a pickle can run code): only for a checkpoint you wrote"}),
    ("--resume-despite-changes", "resume_despite_changes", {
        "action": "store_true", "help": "resume a checkpoint saved under another recipe, model, layout, batch, "
                                        "sequence length or plan (refused by default, naming the change)"}),
    ("--fp8-stats-interval", "fp8_stats_interval", {"type": int, "metavar": "N",
                                                    "help": "every N steps, FP8 amax/scale/saturation/underflow "
                                                            "per layer to TensorBoard (needs --tensorboard-dir)"}),
    ("--progress", "progress", {"action": argparse.BooleanOptionalAction, "help": "progress bar / log lines"}),
)

MEGATRON_SELECTIVE_DEFAULT = ("core_attn",)
"""What Megatron recomputes under --recompute-granularity selective without --recompute-modules."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"fp8stack {__version__}")
    for flag, field, options in FLAGS:
        parser.add_argument(flag, dest=field, **options)
    parser.add_argument("--steps", dest="steps", type=int, metavar="N", help="alias of --train-iters")
    parser.add_argument("--recompute-granularity", choices=("full", "selective"),
                        help="full: recompute whole blocks; selective: the --recompute-modules parts (default "
                             "core_attn); in every block unless --recompute-layers names some")
    parser.add_argument("--recompute-modules", nargs="+", metavar="MODULE",
                        help="core_attn attn mlp moe moe_act shared_experts layernorm (implies selective)")
    parser.add_argument("--config", metavar="JSON", help="TrainConfig fields as JSON; flags override them")
    parser.add_argument("--result-json", metavar="PATH", help="write the TrainResult here (rank 0)")
    return parser


def config_from_args(args: argparse.Namespace):
    """TrainConfig from --config (if any) overlaid with the flags that were given."""
    from fp8stack.train.config import TrainConfig, TrainConfigError

    given = vars(args)
    try:
        values = json.loads(Path(given["config"]).read_text()) if "config" in given else {}
    except (OSError, json.JSONDecodeError) as err:
        raise TrainConfigError(f"cannot read --config {given['config']}: {err}; pass a JSON file of TrainConfig "
                               "fields") from None
    if not isinstance(values, dict):
        raise TrainConfigError(f"--config {given['config']} holds a JSON {type(values).__name__}: pass a JSON object "
                               "of TrainConfig fields")
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(values) - known
    if unknown:
        raise TrainConfigError(f"--config {given['config']} has unknown field(s) {sorted(unknown)}; "
                               f"TrainConfig has {sorted(known)}")
    values.update({k: v for k, v in given.items() if k in known})
    counts = [flag for flag, field, _ in FLAGS if field.startswith("num_layers_at_") and field in given]
    if counts and not values.get("first_last_layers_bf16"):
        raise TrainConfigError(f"{' and '.join(counts)} only apply with --first-last-layers-bf16: add that flag")
    granularity = given.get("recompute_granularity", "selective" if "recompute_modules" in given else None)
    if granularity == "full" and "recompute_modules" in given:
        raise TrainConfigError("--recompute-modules applies to --recompute-granularity selective, not full: "
                               "drop one of them")
    if granularity is not None:
        values.setdefault("recompute", "all")
        values["recompute_modules"] = (("block",) if granularity == "full"
                                       else tuple(given.get("recompute_modules", MEGATRON_SELECTIVE_DEFAULT)))
    return TrainConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0
    from fp8stack.assembly import OrderingError
    from fp8stack.backends import BackendUnavailable
    from fp8stack.runtime.numerics import NonFiniteLossError
    from fp8stack.train.checkpoint import CheckpointError
    from fp8stack.train.config import TrainConfigError
    from fp8stack.train.loop import train
    from fp8stack.train.preflight import check_output_file
    from fp8stack.train.stop import TrainingStopped

    try:
        cfg = config_from_args(args)
        if "result_json" in vars(args):
            check_output_file(args.result_json, "--result-json")
        result = train(cfg)
    except (PlanError, TrainConfigError, CheckpointError, BackendUnavailable, OrderingError,
            NotImplementedError) as err:
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USAGE_ERROR
    except NonFiniteLossError as err:
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except TrainingStopped as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 128 + err.signal_number
    if "result_json" in vars(args) and _is_rank_zero():
        Path(args.result_json).write_text(json.dumps(asdict(result)) + "\n")
    return 0


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
