"""`fp8stack ab`: train the same model with the same seed and data under several recipes, each in a
fresh process, and say per FP8 arm whether to ship it or roll back, with the numbers behind it.

This module is the command: its options, the arms as fresh `python -m fp8stack.train` processes (in waves
over --gpus), and the evidence: profiles/ab-<model>-<device>.json and .md after every arm ("complete": false
and the pending arms until the last one has run, so a killed run keeps what it measured, and --continue-from
runs the pending arms later), and a .png at the end (with matplotlib installed). Evidence of the same name is
replaced only with --force (or when --continue-from continues it), checked before any arm runs; a run in
which no arm measured anything writes none. How arms are judged: fp8stack.ab.verdicts.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from fp8stack.ab.plot import plot
from fp8stack.ab.verdicts import (BF16_ON_TE_ARM, BF16_PARAMS_SUFFIX, CPU_LOSS_TOLERANCE, FP8_PARAMS_SUFFIX,
                                  GPU_LOSS_TOLERANCE, LAST_FRACTION, MAX_PASSES, NOISE_METHOD, NOISE_METHOD_SINGLE,
                                  Arm, is_bf16_arm, judge, peak_tflops, reference_arm, repeat_arms, repeat_note)
from fp8stack.plan import PlanError
from fp8stack.plan.recipes import (BACKEND_PREFERENCES, BF16, BLOCKWISE_GEMMS, FP8_FORMATS, PARAM_DTYPES, RECIPES,
                                   dense_backend, get_recipe)

CPU_RECIPES = (BF16, "tensorwise", "rowwise", "rowwise_gw_hp")
"""The default arms: torchao recipes, which also run on a CPU."""
DEFAULT_STEPS = 40
"""Sized so the four default arms on the tiny model finish in under 3 minutes on 2 CPU cores."""
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every arm (as launch/env.sh does): on a shared multi-GPU host a
program using it can take the host's GPUs out of service for everyone."""


def comma_separated(text: str) -> tuple[str, ...]:
    """An option's 'a, b,c' -> ('a', 'b', 'c'): items stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def comma_list_of(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma list of one or more of `allowed`, repeats dropped."""
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(comma_separated(text)))
        if not items or any(item not in allowed for item in items):
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma list of {', '.join(allowed)}")
        return items
    return parse


def blockwise_arm(library: str) -> str:
    """The A/B arm of recipe blockwise with its GEMMs on `library`: 'blockwise' on TE's own (cuBLAS)."""
    return "blockwise" if library == "te" else f"blockwise on {library}"


def arm_configs(args: argparse.Namespace, recipes: list[str], overrides: dict) -> dict:
    """Arm name -> TrainConfig: bf16 (and bf16 on te with --fastest-bf16), then each FP8 recipe; blockwise once per
    --blockwise-gemms library; each of them once per --param-dtypes dtype (BF16_PARAMS_SUFFIX after bf16's,
    FP8_PARAMS_SUFFIX after fp8's, which the BF16 arms, having no FP8 weights, skip)."""
    from fp8stack.train.config import TrainConfig, TrainConfigError  # torch is imported only once the options are read

    if args.blockwise_gemms != ("te",) and "blockwise" not in recipes:
        raise TrainConfigError(f"--blockwise-gemms {','.join(args.blockwise_gemms)} sets the blockwise runs' GEMMs, "
                               "and --recipes has no blockwise: add blockwise to --recipes or drop --blockwise-gemms")
    arms = [(BF16, BF16, {}), *([(BF16_ON_TE_ARM, BF16, {})] if args.fastest_bf16 else [])]
    for recipe in recipes[1:]:
        libraries = args.blockwise_gemms if recipe == "blockwise" else ("te",)
        arms += [(blockwise_arm(library) if recipe == "blockwise" else recipe, recipe,
                  {"blockwise_gemms": library} if library != "te" else {}) for library in libraries]
    suffixes = {"fp32": "", "bf16": BF16_PARAMS_SUFFIX, "fp8": FP8_PARAMS_SUFFIX}
    return {name + suffixes[param_dtype]: TrainConfig(
                **overrides, recipe=recipe, **extra, param_dtype=param_dtype,
                **speed_levers(args, recipe, bf16_on_te=True if name == BF16_ON_TE_ARM else None),
                log_interval=max(1, args.steps // 4))
            for name, recipe, extra in arms for param_dtype in args.param_dtypes
            if not (param_dtype == "fp8" and recipe == BF16)}


def add_ab_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `ab` subcommand to an argparse subparsers object; it runs run_ab(args)."""
    parser = subparsers.add_parser(
        "ab", help="A/B FP8 recipes against bf16: throughput, loss, ship or rollback",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    _add_arguments(parser)
    parser.set_defaults(run=run_ab)
    return parser


def add_speed_levers(parser: argparse.ArgumentParser) -> None:
    """The trainer's speed options (and delayed scaling's margin) that `fp8stack ab` and `fp8stack profile` pass
    to every run."""
    parser.add_argument("--sdpa-backend", default="auto",
                        help="attention kernel on a GPU in every run: auto | cudnn | flash | efficient (default: auto)")
    parser.add_argument("--fuse-norm", action="store_true",
                        help="FP8 runs fold RMSNorms into TE LayerNormLinear (needs their layers on te)")
    parser.add_argument("--fuse-mlp", action="store_true",
                        help="FP8 runs compute each dense block's ffn_norm + SwiGLU MLP as one TE LayerNormMLP")
    parser.add_argument("--compress-activations", action="store_true",
                        help="FP8 runs store the BF16 activations saved for backward in FP8 (a memory "
                             "lever; rolled back on llama-1b-like: +12%% loss, slower, profiles/NOTES.md 7)")
    parser.add_argument("--fp8-recompute", type=comma_separated,
                        metavar="MODULE[,MODULE]",
                        help="FP8 runs recompute these regions of every block in backward (--recompute-modules names; "
                             "mlp on a --fuse-mlp LayerNormMLP recomputes norm, FC1 and SwiGLU, not FC2): a memory "
                             "lever paid for in speed")
    parser.add_argument("--fp8-margin", type=int, default=0, metavar="N",
                        help="delayed runs: scales leave 2^N headroom below the FP8 maximum (Megatron's --fp8-margin)")
    parser.add_argument("--global-batch-size", dest="global_batch", type=int, metavar="N",
                        help="sequences per optimizer step in every run, accumulated over micro-batches (default: "
                             "one micro-batch per step); TE FP8 runs then cast their weights once per step")
    parser.add_argument("--gradient-accumulation-fusion", action="store_true",
                        help="TE's wgrad GEMMs accumulate into FP32 main_grad buffers: --model-impl megatron, every "
                             "run (megatron DDP's buffers; the BF16 run's TE linears too); torch: the FP8 runs' TE "
                             "layers (the BF16 run has none)")
    parser.add_argument("--blockwise-gemms", type=comma_list_of(BLOCKWISE_GEMMS), default=("te",), metavar="te,deepgemm",
                        help="one blockwise run per library: TE's GEMMs on cuBLAS (te, the run 'blockwise'; default) "
                             "and/or on DeepGEMM's dense kernels, bit-identical (deepgemm, the run "
                             f"'{blockwise_arm('deepgemm')}')")
    parser.add_argument("--param-dtypes", type=comma_list_of(PARAM_DTYPES), default=("fp32",), metavar="fp32,bf16,fp8",
                        help="one run of every arm per parameter dtype: fp32 (FP32 parameters, cast at every forward; "
                             f"default) and/or bf16 (BF16 parameters with FP32 masters in the optimizer, Megatron's "
                             f"--bf16; the arm's name ends in '{BF16_PARAMS_SUFFIX}') and/or fp8 (the FP8 arms' TE "
                             "layers hold their weights in FP8 only, FP32 masters in the optimizer, Megatron's "
                             f"--fp8-param-gather; '{FP8_PARAMS_SUFFIX}')")
    parser.add_argument("--bf16-on-te", action="store_true",
                        help="the bf16 run's linears are TE modules without FP8 (recipe bf16, --backend te), with the "
                             "TE levers asked of the FP8 runs (--fuse-norm, --fuse-mlp, "
                             "--gradient-accumulation-fusion): a BF16 baseline on TE's kernels (plain path)")
    parser.add_argument("--model-impl", choices=("torch", "megatron"), default="torch",
                        help="torch: the plain Llama; megatron: megatron-core's GPTModel through fp8stack's block "
                             "factory, TE linears (default: torch)")


def speed_levers(args: argparse.Namespace, recipe: str, bf16_on_te: bool | None = None) -> dict:
    """TrainConfig fields of add_speed_levers' options and --backend for a run of `recipe`: the bf16 run is the
    plain model (TE modules without FP8 with --bf16-on-te, or where `bf16_on_te` says so), TE levers go to the runs
    with TE layers, FP8-only levers to the FP8 runs, the delayed-scaling margin to delayed runs."""
    bf16_on_te = args.bf16_on_te if bf16_on_te is None else bf16_on_te
    if bf16_on_te and args.model_impl == "megatron":
        from fp8stack.train.config import TrainConfigError  # torch is imported only once the options are read

        raise TrainConfigError("--bf16-on-te and --fastest-bf16 put the plain model's BF16 linears on TE; megatron's "
                               "BF16 run is on TE already: drop them")
    on_te = recipe != BF16 or bf16_on_te
    return {"backend": args.backend if recipe != BF16 else ("te" if bf16_on_te else "auto"),
            "sdpa_backend": args.sdpa_backend, "fuse_norm": args.fuse_norm and on_te,
            "fp8_margin": args.fp8_margin if recipe == "delayed" else 0,
            "fuse_mlp": args.fuse_mlp and on_te,
            "compress_activations": args.compress_activations and recipe != BF16, "model_impl": args.model_impl,
            **({"recompute": "all", "recompute_modules": args.fp8_recompute}
               if args.fp8_recompute and recipe != BF16 else {}),
            "global_batch": args.global_batch,
            "gradient_accumulation_fusion": args.gradient_accumulation_fusion and (
                args.model_impl == "megatron" or on_te)}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | tiny-moe | llama-1b-like (default: tiny)")
    parser.add_argument("--recipes", default=",".join(CPU_RECIPES),
                        help=f"comma-separated arms; bf16 is added first if missing (default: {','.join(CPU_RECIPES)})")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per arm (default: {DEFAULT_STEPS})")
    parser.add_argument("--backend", choices=BACKEND_PREFERENCES, default="auto",
                        help="backend for dense linears in FP8 arms (default: auto, the recipe's first)")
    parser.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                        help="e4m3 or hybrid (default: each recipe's library default)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward pass (default: TrainConfig's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--max-data-bytes", type=int, metavar="N",
                        help="source bytes read, both splits (default: TrainConfig's 8 MiB; a whole stdlib is ~10 MB "
                             "on the GPU machine, ~30 MB here): more text keeps long loss runs under one pass")
    parser.add_argument("--data-source", metavar="stdlib|python",
                        help="stdlib: the standard library's sources (default); python: those, then site-packages' "
                             "(with --max-data-bytes: long loss runs stay under one pass)")
    parser.add_argument("--seed", type=int, default=0, help="same weights and batches in every arm (default: 0)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="activation dtype (auto: bf16 on CUDA, fp32 on a CPU)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks and the loss in every arm")
    add_speed_levers(parser)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: TrainConfig's)")
    parser.add_argument("--warmup", type=int, help="LR warm-up steps (default: TrainConfig's)")
    parser.add_argument("--loss-tolerance", type=float,
                        help=f"largest relative final-loss gap that ships (default: {GPU_LOSS_TOLERANCE} on a GPU, "
                             f"{CPU_LOSS_TOLERANCE} on a CPU)")
    parser.add_argument("--fastest-bf16", action="store_true",
                        help="run two BF16 configurations, the plain model and the --bf16-on-te one (arm 'bf16 on "
                             "te'), and judge the FP8 arms against the faster, which the bf16 repeats rerun: the "
                             "fastest BF16 baseline in one A/B (plain path)")
    parser.add_argument("--baseline-runs", type=int, default=2, metavar="N",
                        help="bf16 runs: the first, and N-1 repeats after the FP8 arms; a loss gap is judged only "
                             "while their final losses span at most the tolerance (default: 2)")
    parser.add_argument("--no-repeat-baseline", dest="baseline_runs", action="store_const", const=1,
                        help="--baseline-runs 1: faster, but the noise is then only step-time spread and the loss "
                             "spread between runs unmeasured")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes (GPUs) per arm; above 1 each arm runs under torchrun --standalone with FSDP2")
    parser.add_argument("--gpus", type=comma_separated, metavar="0,1",
                        help="run the arms side by side, one per listed GPU (CUDA_VISIBLE_DEVICES), in waves, the bf16 "
                             "repeat included: for long loss runs; each arm's step time is then taken while the "
                             "others run")
    parser.add_argument("--continue-from", type=Path, metavar="JSON",
                        help="a partial evidence file of this same A/B (one stopped by a time limit): keep the runs it "
                             "holds, run the pending ones, write the merged evidence")
    parser.add_argument("--out-dir", default="profiles", help="where the evidence goes (default: profiles)")
    parser.add_argument("--label", help="added to the evidence's name, ab-<model>[-megatron]-<label>-<gpu>, so a "
                                        "variant run does not replace the main evidence")
    parser.add_argument("--force", action="store_true", help="replace evidence of the same name (.json, .md, .png)")


def run_ab(args: argparse.Namespace) -> int:
    """Run every arm, judge them, write and print the evidence. 0 when a bf16 arm ran, else 1."""
    import torch  # after argument parsing: --help stays fast

    from fp8stack.bench.evidence import claim_evidence, device_slug, environment, markdown_table, write_evidence
    from fp8stack.train.data import load_split
    from fp8stack.train.config import TrainConfigError
    from fp8stack.train.loop import model_config
    from fp8stack.train.preflight import preflight

    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    tolerance = args.loss_tolerance if args.loss_tolerance is not None else (
        GPU_LOSS_TOLERANCE if on_gpu else CPU_LOSS_TOLERANCE)
    env = environment()
    peaks = peak_tflops(env["device"]) if on_gpu else None
    overrides = {"model": args.model, "steps": args.steps, "fp8_format": args.fp8_format,
                 "seed": args.seed, "device": args.device, "dtype": args.dtype, "compile": args.compile,
                 **{k: getattr(args, k) for k in ("lr", "warmup", "micro_batch", "seq_len", "max_data_bytes",
                                                  "data_source") if getattr(args, k) is not None}}
    impl = "megatron" if args.model_impl == "megatron" else None  # the plain path's evidence keeps its name
    stem = "-".join(filter(None, ("ab", args.model, impl, args.label, device_slug(env["device"]))))
    try:
        if args.baseline_runs < 1:
            raise TrainConfigError(f"--baseline-runs {args.baseline_runs}: the bf16 arm runs at least once")
        if args.nproc < 1:
            raise TrainConfigError(f"--nproc {args.nproc}: each arm runs in at least one process")
        if not 0 <= tolerance < float("inf"):
            raise TrainConfigError(f"--loss-tolerance {tolerance}: pass a relative gap >= 0, e.g. 0.0025")
        if args.gpus and args.nproc > 1:
            raise TrainConfigError("--gpus runs one single-process arm per GPU; --nproc > 1 gives each arm several: "
                                   "use one of them")
        if args.fastest_bf16 and args.bf16_on_te:
            raise TrainConfigError("--fastest-bf16 runs both BF16 configurations, the --bf16-on-te one included: "
                                   "drop --bf16-on-te")
        recipes = _recipes(args.recipes)
        configs = arm_configs(args, recipes, overrides)
        first = next(iter(configs.values()))
        train_config = json.loads(json.dumps({  # as the evidence holds it (JSON types), to compare with earlier files
            **{k: v for k, v in asdict(first).items() if k != "recipe"},
            "backend": args.backend,  # the FP8 arms'
            "fuse_norm": args.fuse_norm, "fuse_mlp": args.fuse_mlp,  # FP8 arms only (and --bf16-on-te's bf16)
            "gradient_accumulation_fusion": args.gradient_accumulation_fusion,  # plain path: arms with TE layers
            **({"bf16_on_te": True} if args.bf16_on_te else {}),
            **({"fastest_bf16": True} if args.fastest_bf16 else {}),
            "compress_activations": args.compress_activations,  # FP8 arms only
            **({"fp8_recompute": args.fp8_recompute} if args.fp8_recompute else {}),  # FP8 arms only
            **({"blockwise_gemms": list(args.blockwise_gemms)} if args.blockwise_gemms != ("te",) else {}),
            **({"param_dtypes": list(args.param_dtypes)} if args.param_dtypes != ("fp32",) else {}),
            "fp8_margin": args.fp8_margin}))  # delayed arms only
        runs, continued_from = (_earlier_runs(args.continue_from, train_config, recipes, args.nproc)
                                if args.continue_from else ({}, []))
        # --continue-from completes the evidence of this same A/B (_earlier_runs checked it is): it may replace it
        claim_evidence(stem, args.out_dir, args.force or args.continue_from is not None,
                       suffixes=(".json", ".md", ".png"))
        for cfg in configs.values():  # what each arm's process would refuse, before any runs
            preflight(cfg, model_config(cfg))
    except (ValueError, PlanError) as err:  # TrainConfigError and EvidenceError are ValueErrors
        print(f"fp8stack ab: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    sequences = first.global_batch or first.micro_batch * args.nproc
    split_bytes = load_split("train", first.max_data_bytes, source=first.data_source).numel()
    passes = args.steps * sequences * model_config(first).seq_len / split_bytes
    repeat_names = repeat_arms(args.baseline_runs)
    results: dict[str, dict | str] = {name: run for name, run in runs.items() if name in configs}
    repeats: dict[str, dict | str] = {name: runs[name] for name in repeat_names if name in runs}
    backends: dict[str, str | PlanError] = {}
    for name, cfg in configs.items():
        try:
            backends[name] = _planned_backend(cfg.recipe, cfg.backend)
        except PlanError as err:  # e.g. --backend te with a torchao-only recipe: no process to start
            backends[name] = err

    def pending() -> list[str]:
        """The arms still to run, in order (the bf16 repeats unless every BF16 configuration failed)."""
        todo = [name for name in configs if name not in results]
        if reference_arm(results) or any(is_bf16_arm(name) and name not in results for name in configs):
            todo += [name for name in repeat_names if name not in repeats]
        return todo

    def record() -> tuple[list[Arm], list[dict], tuple[list[str], list[list]], str, Path | None, Path | None]:
        """Judge the arms run so far and write the evidence: after every arm, so a run killed later (a
        call's time limit) keeps what it measured, marked partial until nothing is pending; nothing while no arm
        has measured anything (the paths are then None)."""
        todo = pending()
        named = {name: args.backend if isinstance(b, PlanError) else b for name, b in backends.items()}
        arms, repeat_records = judge(results, named, tolerance, peaks, repeats, passes)
        dtype = next((r["dtype"] for r in results.values() if isinstance(r, dict)), None)
        payload = {
            "complete": not todo,
            "pending_arms": todo,
            "device": env["device"],
            "versions": {k: v for k, v in env.items() if k not in ("device", "compute_capability")},
            "model": args.model, "steps": args.steps, "nproc": args.nproc, "gpus": args.gpus,
            "recipes": recipes, "train_config": train_config,
            "continued_from": continued_from,
            "noise_method": NOISE_METHOD if repeat_records else NOISE_METHOD_SINGLE,
            "baseline_repeats": repeat_records,
            "activation_dtype": dtype,
            "loss_tolerance": tolerance,
            "train_split_bytes": split_bytes,
            "train_split_passes": passes,
            "mfu_basis": (None if peaks is None else
                          f"model GEMM FLOPs (3 x forward, attention included) over the dense peak blended by the "
                          f"arm's FP8 FLOP share; peaks {peaks} TFLOP/s"),
            "arms": [asdict(arm) for arm in arms],
            "runs": {**results, **repeats},
        }
        table = _table(arms)
        side_by_side = (f" (arms side by side on GPUs {','.join(args.gpus)})" if args.gpus and len(args.gpus) > 1 else
                        f" (on GPU {args.gpus[0]})" if args.gpus else "")
        bf16_arms = ("the bf16 arms are the plan without FP8, plain and on TE modules; the faster is the reference, "
                     "which the bf16 repeats rerun"
                     if args.fastest_bf16 else
                     f"the bf16 arm is the plan without FP8{', on TE modules' if args.bf16_on_te else ''}")
        arm_notes = (f" The FP8 arms recompute {', '.join(args.fp8_recompute)} in every block in backward."
                     if args.fp8_recompute else "")
        if any(library != "te" for library in args.blockwise_gemms):
            arm_notes += (f" {blockwise_arm('deepgemm')}: TE's blockwise modules with their GEMMs on DeepGEMM's "
                          "dense kernels (--blockwise-gemms).")
        if "bf16" in args.param_dtypes:
            arm_notes += (f" Arms named '...{BF16_PARAMS_SUFFIX}' keep BF16 parameters with FP32 masters in the "
                          "optimizer, copied to them once per step (Megatron's --bf16); the others FP32 parameters, "
                          "cast at every forward. Every BF16 run, with either, is a candidate for the reference.")
        if "fp8" in args.param_dtypes:
            arm_notes += (f" Arms named '...{FP8_PARAMS_SUFFIX}' keep the FP8 layers' weights in FP8 only (TE's "
                          "quantized_model_init) and the others in BF16, with FP32 masters in the optimizer "
                          "quantized into them once per step.")
        notes = (f"\nSame seed and data in every arm, each arm a fresh process{side_by_side}; {sequences} sequences "
                 f"per optimizer step in micro-batches of {first.micro_batch}; activations in {dtype} "
                 f"({bf16_arms}).{arm_notes} Noise: {payload['noise_method']}"
                 f"{repeat_note(repeat_records)}. Loss tolerance: +-{tolerance:.2%} relative "
                 f"(final loss = mean of the last "
                 f"{LAST_FRACTION:.0%} of steps), compared up to {MAX_PASSES:g} pass over the training text "
                 f"(this run: {passes:.2f} passes over {split_bytes / 1e6:.1f} MB) and while the bf16 runs' final "
                 "losses span at most that. "
                 f"MFU: {payload['mfu_basis'] or 'not reported on this device'}."
                 + "".join(f" Runs {', '.join(c['runs'])} from an earlier call ({c['date']}: `{c['command']}`)."
                           for c in continued_from) + "\n")
        markdown = markdown_table(*table)
        banner = (f"**Partial: the run has not finished.** Measured: {', '.join(results)}; pending: "
                  f"{', '.join(todo)}. Verdicts may change once they have run (the bf16 repeats set the "
                  "noise).\n\n") if todo else ""
        if not any(isinstance(run, dict) for run in payload["runs"].values()):
            return arms, repeat_records, table, markdown, None, None
        json_path, md_path = write_evidence(stem, payload, banner + markdown + notes, out_dir=args.out_dir,
                                            replace=True)  # claimed above
        return arms, repeat_records, table, markdown, json_path, md_path

    slots = args.gpus or [None]
    # A repeat reruns the reference, known once every BF16 configuration ran: with several (--fastest-bf16,
    # --param-dtypes) the repeats wait for the arms' waves; with one they take the last wave's free GPUs if any.
    several = sum(map(is_bf16_arm, configs)) > 1
    phases = [[name for name in configs], repeat_names] if several else [[*configs, *repeat_names]]
    phases = [[name for name in phase if name in pending()] for phase in phases]  # not those an earlier call ran
    jobs = sum(phases, [])
    with tempfile.TemporaryDirectory(prefix="fp8stack-ab-") as scratch:
        waves = (phase[start:start + len(slots)] for phase in phases for start in range(0, len(phase), len(slots)))
        for wave in waves:
            outcomes: dict[str, _RunningArm | str] = {}
            for name, gpu in zip(wave, slots):
                if name in repeat_names and name not in pending():
                    continue  # every BF16 configuration failed: nothing to repeat
                # A repeat reruns the reference (bf16 while, the only BF16 configuration, it still runs beside it).
                arm = name if name not in repeat_names else reference_arm(results) or BF16
                cfg = configs[arm]
                print(f"[{jobs.index(name) + 1}/{len(jobs)}] {cfg.model} {name} ({cfg.steps} steps, fresh process"
                      + (f", GPU {gpu})" if gpu else ")"), flush=True)
                if isinstance(backends[arm], PlanError):
                    outcomes[name] = " ".join(str(backends[arm]).split())
                    print(f"    skipped: {outcomes[name]}", flush=True)
                else:
                    outcomes[name] = _RunningArm(cfg, Path(scratch), args.nproc, gpu, name)
            for name, outcome in outcomes.items():  # in job order: bf16 stays first
                result = outcome.result() if isinstance(outcome, _RunningArm) else outcome
                if name in repeat_names:
                    repeats[name] = result
                else:
                    results[name] = result
            if pending():
                record()

    arms, repeat_records, table, markdown, json_path, md_path = record()
    if json_path is None:
        _print_table(table, markdown)
        print("no arm measured anything: no evidence written", file=sys.stderr)
        return 1
    png = plot(arms, repeat_records, json_path.with_suffix(".png"), title=f"{args.model} on {env['device']}")
    _print_table(table, markdown)
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0 if any(arm.verdict == "baseline" for arm in arms) else 1


def _earlier_runs(path: Path, train_config: dict, recipes: list[str], nproc: int
                  ) -> tuple[dict[str, dict | str], list[dict]]:
    """(the runs a partial evidence file holds, by arm name, and where they came from) for --continue-from, or
    ValueError when the file is not of this A/B (another configuration, other arms or process count, or written
    before files kept their runs)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read --continue-from {path}: {err}") from None
    if "runs" not in record:
        raise ValueError(f"{path} holds no runs to continue from (written before A/B files kept them): rerun the A/B")
    differ = sorted(k for k in set(train_config) | set(record["train_config"])
                    if train_config.get(k) != record["train_config"].get(k))
    if differ or record.get("recipes") != recipes or record.get("nproc") != nproc:
        what = (f"train_config differs in {', '.join(differ)}" if differ else
                f"its arms are {record.get('recipes')} on {record.get('nproc')} process(es) each")
        raise ValueError(f"{path} is another A/B ({what}): continue it with the command that wrote it")
    earlier = record["continued_from"] + [{"date": record["date"], "command": record["command"],
                                           "runs": [name for name in record["runs"]
                                                    if not any(name in c["runs"] for c in record["continued_from"])]}]
    return record["runs"], earlier


def _recipes(text: str) -> list[str]:
    """The arms in order, bf16 first (added when missing: every verdict compares with it)."""
    names = list(dict.fromkeys(comma_separated(text)))
    unknown = [r for r in names if r != BF16 and r not in RECIPES]
    if unknown:
        raise PlanError(f"unknown recipe(s) {', '.join(unknown)} in --recipes: use {', '.join([BF16, *RECIPES])}")
    return [BF16] + [r for r in names if r != BF16]


def _planned_backend(recipe: str, preference: str) -> str:
    """The backend the plan gives dense linears under `recipe` (bf16 for the bf16 arm, te with --bf16-on-te)."""
    if recipe == BF16:
        return "te" if preference == "te" else BF16
    return dense_backend(get_recipe(recipe), preference)


class _RunningArm:
    """Fresh `python -m fp8stack.train` process(es) for one arm, started on construction (on `gpu` alone when given)."""

    def __init__(self, cfg, scratch: Path, nproc: int, gpu: str | None = None, name: str = ""):
        stem = (name or cfg.recipe).replace(" ", "_")  # the bf16 repeat runs bf16's config under its own name
        self.config_path, self.result_path = (scratch / f"{stem}.{kind}.json" for kind in ("config", "result"))
        self.config_path.write_text(json.dumps(asdict(cfg)))
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        command = [sys.executable, *launcher, "-m", "fp8stack.train", "--config", str(self.config_path),
                   "--result-json", str(self.result_path)]
        env = {**os.environ, **NO_MULTICAST_ENV, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})}
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: arms side by side never block on it
        self.process = subprocess.Popen(command, stderr=self.stderr, text=True, env=env)
        self.ran_between = [time.time()]
        """[start, collection] in seconds since the epoch; collection is when result() returned."""

    def result(self) -> dict | str:
        """Wait for the arm: its TrainResult dict (with ran_between), or the error it ended with."""
        code = self.process.wait()
        self.ran_between.append(time.time())
        self.stderr.seek(0)
        stderr = self.stderr.read()
        self.stderr.close()
        if code != 0 or not self.result_path.is_file():
            lines = [line for line in stderr.splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()]
            why = (errors or lines or [f"exit code {code}"])[-1]
            print(f"    failed: {why}", flush=True)
            return why.removeprefix("python -m fp8stack.train: error: ")
        return {**json.loads(self.result_path.read_text()), "ran_between": self.ran_between}


def _table(arms: list[Arm]) -> tuple[list[str], list[list]]:
    header = ["recipe", "backend", "step ms", "tokens/s", "TFLOP/s", "MFU", "mem GiB", "final loss", "loss gap",
              "verdict", "reason"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    rows = [[a.recipe, a.backend, fmt(a.step_ms, ".1f"), fmt(a.tokens_per_s, ",.0f"), fmt(a.tflops, ".3g"),
             fmt(a.mfu, ".1%"), fmt(a.peak_mem_gib, ".2f"), fmt(a.final_loss, ".4f"), fmt(a.rel_loss_gap, "+.2%"),
             a.verdict, a.reason] for a in arms]
    return header, rows


def _print_table(table: tuple[list[str], list[list]], markdown: str) -> None:
    """A rich table on a terminal; the Markdown table elsewhere (logs keep every column whole)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        print(markdown, end="")
        return
    header, rows = table
    view = Table(*header)
    for column in view.columns[:-1]:
        column.no_wrap = True
    for row in rows:
        view.add_row(*map(str, row))
    console.print(view)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fp8stack.ab ...`: the same as `fp8stack ab ...`."""
    parser = argparse.ArgumentParser(prog="python -m fp8stack.ab", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return run_ab(parser.parse_args(argv))
