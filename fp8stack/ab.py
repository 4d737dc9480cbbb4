"""`fp8stack ab`: train the same model with the same seed and data under several recipes, each in a
fresh process, and say per FP8 arm whether to ship it or roll back, with the numbers behind it.

An arm ships only if it is faster than the bf16 arm by more than the measured noise AND its final
loss is within the tolerance of the bf16 arm's, above or below. The loss is not compared, and a faster
FP8 arm is "inconclusive", where the comparison cannot resolve the tolerance: past one pass over the
training text (the runs memorise it, at a rate set by rounding chaos: two bf16 runs of one configuration
ended 2.6% apart after 4.2 passes, profiles/NOTES.md section 10), or when the bf16 runs' final losses
span more than the tolerance; the verdict then says whether the arm's final loss lies between theirs.
The bf16 arm runs --baseline-runs times (default 2: first and last), so the noise is run-to-run: the
largest of the bf16 runs' step-time differences and each compared arm's step-time spread after warm-up
(interquartile range / median); a ship verdict judged against a single bf16 run says that the loss
spread between runs went unmeasured. A machine whose speed changes
during the A/B (other work, clocks, heat) widens it and so cannot make an arm look faster. Final
loss is the mean over the last 10% of steps.
Writes profiles/ab-<model>-<device>.json and .md after every arm ("complete": false and the pending
arms until the last one has run, so a killed run keeps what it measured, and --continue-from runs the
pending arms later), and a .png at the end (with matplotlib installed).
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8stack.plan import PlanError
from fp8stack.plan.recipes import BACKEND_PREFERENCES, BF16, FP8_FORMATS, RECIPES, dense_backend, get_recipe
from fp8stack.train.timing import relative_spread, steady_state

CPU_RECIPES = (BF16, "tensorwise", "rowwise", "rowwise_gw_hp")
"""The default arms: torchao recipes, which also run on a CPU."""
DEFAULT_STEPS = 40
"""Sized so the four default arms on the tiny model finish in under 3 minutes on 2 CPU cores."""
GPU_LOSS_TOLERANCE = 0.0025
"""Largest relative final-loss gap to bf16 that still ships on a GPU: 0.25%."""
CPU_LOSS_TOLERANCE = 0.02
"""On a CPU the default run is a few dozen steps of the tiny model, where the loss is still falling
fast and step-to-step batch noise is ~1% of it; 2% flags a broken recipe without failing sound ones."""
NOISE_METHOD = ("the largest of: the step-time differences between the first bf16 run and its repeats, and the "
                "step-time interquartile range / median after warm-up of the arm and of bf16")
NOISE_METHOD_SINGLE = ("step-time interquartile range / median after warm-up, the larger of the arm's and "
                       "bf16's (bf16 ran once: --baseline-runs 1)")
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every arm (as launch/env.sh does): on a shared multi-GPU host a
program using it can take the host's GPUs out of service for everyone."""
MAX_PASSES = 1.0
"""Training tokens over the training split's size beyond which final losses are not compared."""
LAST_FRACTION = 0.10
"""Final loss = mean over this share of the last steps (at least one)."""
REPEAT_ARM = "bf16 (repeat)"
"""The second bf16 run, as a partial evidence file lists it among the pending arms (then 'bf16 (repeat 2)', ...)."""
SINGLE_RUN_CAVEAT = ("bf16 ran once, so the loss spread between runs is unmeasured (it can exceed the tolerance: "
                     "profiles/NOTES.md 13; --baseline-runs 2 or more measures it)")
"""Added to a ship verdict judged against a single bf16 run."""

DENSE_PEAK_TFLOPS = {
    # (name marker, variant marker or '') -> {precision: dense TFLOP/s}, NVIDIA datasheets (no sparsity).
    ("H100", "PCIe"): {"bf16": 756.0, "fp8": 1513.0},
    ("H100", "NVL"): {"bf16": 835.0, "fp8": 1671.0},
    ("H100", ""): {"bf16": 989.4, "fp8": 1978.9},
    ("H800", ""): {"bf16": 989.4, "fp8": 1978.9},
    ("H200", ""): {"bf16": 989.4, "fp8": 1978.9},
}
"""Checked in order; the first whose markers are both in the device name wins."""


@dataclass
class Arm:
    """One recipe's run, as the JSON reports it (None where the arm did not run or the device has no value)."""

    recipe: str
    """Plan recipe; bf16 is the baseline without FP8."""
    backend: str
    """FP8 backend(s) the plan used ('torchao', 'te', 'torchao+grouped_fp8'), bf16 for the baseline."""
    step_ms: float | None = None
    """Median steady-state step time."""
    tokens_per_s: float | None = None
    """Tokens per second over all processes."""
    tflops: float | None = None
    """Model TFLOP/s per process (GPU): 3 x forward GEMM FLOPs per token, attention included."""
    mfu: float | None = None
    """tflops over the GPU's dense peak blended by the FP8 FLOP share; None on a CPU or an unlisted GPU."""
    peak_mem_gib: float | None = None
    """CUDA peak allocated memory, or the process's max RSS on a CPU (see memory_kind)."""
    final_loss: float | None = None
    """Mean training loss over the last 10% of steps."""
    rel_loss_gap: float | None = None
    """final_loss / bf16's final_loss - 1."""
    noise: float | None = None
    """Step-time interquartile range / median of this arm."""
    verdict: str = "rollback"
    """baseline | ship | rollback | inconclusive (the loss cannot resolve the tolerance: loss_unresolved) | error
    (the baseline failed)."""
    reason: str = ""
    """Why, with the numbers."""
    val_loss: float | None = None
    """Validation loss after the last step."""
    memory_kind: str | None = None
    """cuda_peak_allocated | process_max_rss."""
    fp8_flops_share: float | None = None
    """Share of forward GEMM FLOPs the plan runs in FP8."""
    loss_curve: list[float] | None = None
    """Training loss per step."""
    ran_between: list[float] | None = None
    """[start, collection] of the arm's process(es) in seconds since the epoch (arms run with --gpus overlap)."""
    zero_fp8_weight_grads: list[list[str]] | None = None
    """Per first step: FP8 weights whose whole gradient was zero (TrainResult.zero_fp8_weight_grads)."""


def peak_tflops(device: str) -> dict[str, float] | None:
    """Dense BF16 and FP8 peaks of a GPU by name, or None when it is not in the table (or a CPU)."""
    for (model, variant), peaks in DENSE_PEAK_TFLOPS.items():
        if model in device and variant in device:
            return peaks
    return None


def blended_peak(peaks: dict[str, float], fp8_share: float) -> float:
    """The peak a run reaches if each GEMM FLOP ran at the peak of its precision: FP8 GEMMs at the FP8
    peak, the rest (attention core, head, BF16 layers) at the BF16 peak. Harmonic, as times add."""
    return 1.0 / (fp8_share / peaks["fp8"] + (1.0 - fp8_share) / peaks["bf16"])


def final_loss(losses: list[float]) -> float:
    """Mean over the last LAST_FRACTION of the steps (at least one step)."""
    tail = max(1, round(len(losses) * LAST_FRACTION))
    return statistics.fmean(losses[-tail:])


def verdict(arm_ms: float, base_ms: float, noise: float, loss_gap: float, tolerance: float,
            unresolved: str = "") -> tuple[str, str]:
    """('ship' | 'rollback' | 'inconclusive', reason): ship only if faster than bf16 by more than `noise`
    (relative) and the relative loss gap is within `tolerance` either way (an arm far below bf16 computes
    something else too). A faster arm is inconclusive when `unresolved` says why the loss cannot be judged."""
    speedup = base_ms / arm_ms - 1.0
    if speedup <= noise:
        speed = f"not faster than bf16 by more than the noise ({speedup:+.1%} speed-up, noise {noise:.1%})"
    else:
        speed = f"{speedup:+.1%} faster than bf16 (noise {noise:.1%})"
    if speedup > noise and unresolved:
        return "inconclusive", f"{speed}; loss not compared: {unresolved}"
    problems = [] if speedup > noise else [speed]
    if abs(loss_gap) > tolerance:
        problems.append(f"loss {loss_gap:+.2%} vs bf16 is outside the +-{tolerance:.2%} tolerance")
    if problems:
        return "rollback", "; ".join(problems)
    return "ship", f"{speed}, loss {loss_gap:+.2%} within +-{tolerance:.2%}"


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
    parser.add_argument("--fp8-margin", type=int, default=0, metavar="N",
                        help="delayed runs: scales leave 2^N headroom below the FP8 maximum (Megatron's --fp8-margin)")
    parser.add_argument("--global-batch-size", dest="global_batch", type=int, metavar="N",
                        help="sequences per optimizer step in every run, accumulated over micro-batches (default: "
                             "one micro-batch per step); TE FP8 runs then cast their weights once per step")
    parser.add_argument("--gradient-accumulation-fusion", action="store_true",
                        help="--model-impl megatron, every run: megatron DDP's FP32 main_grad buffers written by "
                             "TE's wgrad GEMMs (the BF16 run's TE linears too)")
    parser.add_argument("--model-impl", choices=("torch", "megatron"), default="torch",
                        help="torch: the plain Llama; megatron: megatron-core's GPTModel through fp8stack's block "
                             "factory, TE linears (default: torch)")


def speed_levers(args: argparse.Namespace, recipe: str) -> dict:
    """TrainConfig fields of add_speed_levers' options for a run of `recipe` (FP8 levers stay off in bf16, the
    delayed-scaling margin off in the other recipes)."""
    return {"sdpa_backend": args.sdpa_backend, "fuse_norm": args.fuse_norm and recipe != BF16,
            "fp8_margin": args.fp8_margin if recipe == "delayed" else 0,
            "fuse_mlp": args.fuse_mlp and recipe != BF16,
            "compress_activations": args.compress_activations and recipe != BF16, "model_impl": args.model_impl,
            "global_batch": args.global_batch, "gradient_accumulation_fusion": args.gradient_accumulation_fusion}


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
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks in every arm")
    add_speed_levers(parser)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: TrainConfig's)")
    parser.add_argument("--warmup", type=int, help="LR warm-up steps (default: TrainConfig's)")
    parser.add_argument("--loss-tolerance", type=float,
                        help=f"largest relative final-loss gap that ships (default: {GPU_LOSS_TOLERANCE} on a GPU, "
                             f"{CPU_LOSS_TOLERANCE} on a CPU)")
    parser.add_argument("--baseline-runs", type=int, default=2, metavar="N",
                        help="bf16 runs: the first, and N-1 repeats after the FP8 arms; a loss gap is judged only "
                             "while their final losses span less than the tolerance (default: 2)")
    parser.add_argument("--no-repeat-baseline", dest="baseline_runs", action="store_const", const=1,
                        help="--baseline-runs 1: faster, but the noise is then only step-time spread and the loss "
                             "spread between runs unmeasured")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes (GPUs) per arm; above 1 each arm runs under torchrun --standalone with FSDP2")
    parser.add_argument("--gpus", type=lambda text: [g.strip() for g in text.split(",") if g.strip()], metavar="0,1",
                        help="run the arms side by side, one per listed GPU (CUDA_VISIBLE_DEVICES), in waves, the bf16 "
                             "repeat included: for long loss runs; each arm's step time is then taken while the "
                             "others run")
    parser.add_argument("--continue-from", type=Path, metavar="JSON",
                        help="a partial evidence file of this same A/B (one stopped by a time limit): keep the runs it "
                             "holds, run the pending ones, write the merged evidence")
    parser.add_argument("--out-dir", default="profiles", help="where the evidence goes (default: profiles)")
    parser.add_argument("--label", help="added to the evidence's name, ab-<model>[-megatron]-<label>-<gpu>, so a "
                                        "variant run does not replace the main evidence")


def run_ab(args: argparse.Namespace) -> int:
    """Run every arm, judge them, write and print the evidence. 0 when the bf16 arm ran, else 1."""
    import torch  # after argument parsing: --help stays fast

    from fp8stack.bench.evidence import device_slug, environment, markdown_table, write_evidence
    from fp8stack.train.data import load_split
    from fp8stack.train.loop import TrainConfig, TrainConfigError, model_config

    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    tolerance = args.loss_tolerance if args.loss_tolerance is not None else (
        GPU_LOSS_TOLERANCE if on_gpu else CPU_LOSS_TOLERANCE)
    env = environment()
    peaks = peak_tflops(env["device"]) if on_gpu else None
    overrides = {"model": args.model, "steps": args.steps, "backend": args.backend, "fp8_format": args.fp8_format,
                 "seed": args.seed, "device": args.device, "dtype": args.dtype, "compile": args.compile,
                 **{k: getattr(args, k) for k in ("lr", "warmup") if getattr(args, k) is not None},
                 **({"micro_batch": args.micro_batch} if args.micro_batch else {}),
                 **({"seq_len": args.seq_len} if args.seq_len else {}),
                 **({"max_data_bytes": args.max_data_bytes} if args.max_data_bytes else {}),
                 **({"data_source": args.data_source} if args.data_source else {})}
    try:
        if args.baseline_runs < 1:
            raise TrainConfigError(f"--baseline-runs {args.baseline_runs}: the bf16 arm runs at least once")
        if args.gpus and args.nproc > 1:
            raise TrainConfigError("--gpus runs one single-process arm per GPU; --nproc > 1 gives each arm several: "
                                   "use one of them")
        recipes = _recipes(args.recipes)
        configs = [TrainConfig(**overrides, recipe=recipe, **speed_levers(args, recipe),
                               log_interval=max(1, args.steps // 4)) for recipe in recipes]
        train_config = json.loads(json.dumps({  # as the evidence holds it (JSON types), to compare with earlier files
            **{k: v for k, v in asdict(configs[0]).items() if k != "recipe"},
            "fuse_norm": args.fuse_norm, "fuse_mlp": args.fuse_mlp,  # FP8 arms only
            "compress_activations": args.compress_activations,  # FP8 arms only
            "fp8_margin": args.fp8_margin}))  # delayed arms only
        runs, continued_from = (_earlier_runs(args.continue_from, train_config, recipes, args.nproc)
                                if args.continue_from else ({}, []))
    except (ValueError, PlanError) as err:  # TrainConfigError is a ValueError
        print(f"fp8stack ab: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    sequences = configs[0].global_batch or configs[0].micro_batch * args.nproc
    split_bytes = load_split("train", configs[0].max_data_bytes, source=configs[0].data_source).numel()
    passes = args.steps * sequences * model_config(configs[0]).seq_len / split_bytes
    impl = "megatron" if args.model_impl == "megatron" else None  # the plain path's evidence keeps its name
    stem = "-".join(filter(None, ("ab", args.model, impl, args.label, device_slug(env["device"]))))
    repeat_names = repeat_arms(args.baseline_runs)
    results: dict[str, dict | str] = {name: run for name, run in runs.items() if name in recipes}
    repeats: dict[str, dict | str] = {name: runs[name] for name in repeat_names if name in runs}
    backends: dict[str, str | PlanError] = {}
    for cfg in configs:
        try:
            backends[cfg.recipe] = _planned_backend(cfg.recipe, args.backend)
        except PlanError as err:  # e.g. --backend te with a torchao-only recipe: no process to start
            backends[cfg.recipe] = err

    def pending() -> list[str]:
        """The arms still to run, in order (the bf16 repeats only once the first bf16 run worked)."""
        todo = [cfg.recipe for cfg in configs if cfg.recipe not in results]
        if isinstance(results.get(BF16, {}), dict):
            todo += [name for name in repeat_names if name not in repeats]
        return todo

    def record() -> tuple[list[Arm], list[dict], tuple[list[str], list[list]], str, Path, Path]:
        """Judge the arms run so far and write the evidence: after every arm, so a run killed later (a
        call's time limit) keeps what it measured, marked partial until nothing is pending."""
        todo = pending()
        named = {recipe: args.backend if isinstance(b, PlanError) else b for recipe, b in backends.items()}
        arms, repeat_records = _judge(results, named, tolerance, peaks, repeats, passes)
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
        side_by_side = f" (arms side by side on GPUs {','.join(args.gpus)})" if args.gpus else ""
        notes = (f"\nSame seed and data in every arm, each arm a fresh process{side_by_side}; {sequences} sequences "
                 f"per optimizer step in micro-batches of {configs[0].micro_batch}; activations in {dtype} (the "
                 f"bf16 arm is the plan without FP8). Noise: {payload['noise_method']}"
                 f"{_repeat_note(repeat_records)}. Loss tolerance: +-{tolerance:.2%} relative "
                 f"(final loss = mean of the last "
                 f"{LAST_FRACTION:.0%} of steps), compared up to {MAX_PASSES:g} pass over the training text "
                 f"(this run: {passes:.2f} passes over {split_bytes / 1e6:.1f} MB) and while the bf16 runs' final "
                 "losses span less than it. "
                 f"MFU: {payload['mfu_basis'] or 'not reported on this device'}."
                 + "".join(f" Runs {', '.join(c['runs'])} from an earlier call ({c['date']}: `{c['command']}`)."
                           for c in continued_from) + "\n")
        markdown = markdown_table(*table)
        banner = (f"**Partial: the run has not finished.** Measured: {', '.join(results)}; pending: "
                  f"{', '.join(todo)}. Verdicts may change once they have run (the bf16 repeats set the "
                  "noise).\n\n") if todo else ""
        json_path, md_path = write_evidence(stem, payload, banner + markdown + notes, out_dir=args.out_dir)
        return arms, repeat_records, table, markdown, json_path, md_path

    slots = args.gpus or [None]
    jobs = [(cfg.recipe, cfg) for cfg in configs] + [(name, configs[0]) for name in repeat_names]
    jobs = [(name, cfg) for name, cfg in jobs if name in pending()]  # not those an earlier call ran
    with tempfile.TemporaryDirectory(prefix="fp8stack-ab-") as scratch:
        # In waves of one run per slot; the bf16 repeats take the last wave's free GPUs when there are some.
        for wave in itertools.batched(enumerate(jobs, 1), len(slots)):
            outcomes: dict[str, _RunningArm | str] = {}
            for (index, (name, cfg)), gpu in zip(wave, slots):
                if name in repeat_names and name not in pending():
                    continue  # the first bf16 run failed: nothing to repeat
                print(f"[{index}/{len(jobs)}] {cfg.model} {name} ({cfg.steps} steps, fresh process"
                      + (f", GPU {gpu})" if gpu else ")"), flush=True)
                if isinstance(backends[cfg.recipe], PlanError):
                    outcomes[name] = " ".join(str(backends[cfg.recipe]).split())
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
    png = _plot(arms, repeat_records, Path(args.out_dir) / f"{stem}.png", title=f"{args.model} on {env['device']}")
    _print_table(table, markdown)
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0 if arms[0].verdict == "baseline" else 1


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
    names = list(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))
    unknown = [r for r in names if r != BF16 and r not in RECIPES]
    if unknown:
        raise PlanError(f"unknown recipe(s) {', '.join(unknown)} in --recipes: use {', '.join([BF16, *RECIPES])}")
    return [BF16] + [r for r in names if r != BF16]


def _planned_backend(recipe: str, preference: str) -> str:
    """The backend the plan gives dense linears under `recipe` (bf16 for the bf16 arm)."""
    return BF16 if recipe == BF16 else dense_backend(get_recipe(recipe), preference)


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


def repeat_arms(baseline_runs: int) -> list[str]:
    """Names of the bf16 runs after the first: REPEAT_ARM, then 'bf16 (repeat 2)', ..."""
    return [REPEAT_ARM, *(f"{BF16} (repeat {i})" for i in range(2, baseline_runs))] if baseline_runs > 1 else []


def _judge(results: dict[str, dict | str], backends: dict[str, str], tolerance: float, peaks: dict | None,
           repeats: dict[str, dict | str] | None = None, passes: float = 0.0) -> tuple[list[Arm], list[dict]]:
    """The arms with their measurements and verdicts, and what each repeated bf16 run (`repeats`, by name)
    measured. results[bf16] is the baseline; a str in place of a result is the error a run hit.
    `passes`: training tokens per arm over the training split's size (see loss_unresolved)."""
    arms = [_measure(recipe, result, backends[recipe], peaks) for recipe, result in results.items()]
    baseline = arms[0]
    if isinstance(results[BF16], str):
        baseline.verdict, baseline.reason = "error", f"bf16 baseline failed: {results[BF16]}"
        for arm in arms[1:]:
            arm.verdict, arm.reason = "rollback", "no bf16 baseline to compare with"
        return arms, []
    baseline.verdict, baseline.reason, baseline.rel_loss_gap = "baseline", "the reference arm", 0.0
    records = []
    for name, repeat in (repeats or {}).items():
        if isinstance(repeat, str):
            records.append({"run": name, "error": repeat})
            continue
        again = _measure(BF16, repeat, BF16, peaks)
        step_gap = abs(again.step_ms - baseline.step_ms) / min(again.step_ms, baseline.step_ms)
        records.append({"run": name, "step_ms": again.step_ms, "final_loss": again.final_loss,
                        "run_to_run_noise": step_gap, "rel_loss_gap": again.final_loss / baseline.final_loss - 1.0,
                        "ran_between": again.ran_between, "loss_curve": again.loss_curve})
    measured = [r for r in records if "error" not in r]
    run_to_run = max((r["run_to_run_noise"] for r in measured), default=0.0)
    unresolved = loss_unresolved(passes, [r["rel_loss_gap"] for r in measured], tolerance)
    for arm, result in zip(arms[1:], list(results.values())[1:]):
        if isinstance(result, str):
            arm.verdict, arm.reason = "rollback", f"failed: {result}"
            continue
        noise = max(run_to_run, baseline.noise, arm.noise)
        arm.rel_loss_gap = arm.final_loss / baseline.final_loss - 1.0
        arm.verdict, arm.reason = verdict(arm.step_ms, baseline.step_ms, noise, arm.rel_loss_gap, tolerance, unresolved)
        if arm.verdict == "ship" and not measured:
            arm.reason += f"; {SINGLE_RUN_CAVEAT}"
        if arm.verdict == "inconclusive" and measured:
            arm.reason += f"; {band_note(arm.final_loss, [baseline.final_loss, *(r['final_loss'] for r in measured)])}"
    return arms, records


def band_note(loss: float, bf16_losses: list[float]) -> str:
    """Where a final loss lies against the bf16 runs' final losses: what an unresolved comparison can still say."""
    low, high = min(bf16_losses), max(bf16_losses)
    band = f"the {len(bf16_losses)} bf16 runs' ({low:.4f} to {high:.4f})"
    if low <= loss <= high:
        return f"its final loss lies between {band}"
    return f"its final loss lies {loss / high - 1:+.2%} above {band}" if loss > high else (
        f"its final loss lies {loss / low - 1:+.2%} below {band}")


def loss_unresolved(passes: float, repeat_gaps: list[float], tolerance: float) -> str:
    """Why final losses cannot be judged at `tolerance` ('' when they can): more than MAX_PASSES passes over
    the training text, or bf16 runs whose final losses span more than `tolerance` (`repeat_gaps`: each repeat's
    relative gap to the first bf16 run)."""
    if passes > MAX_PASSES:
        return (f"{passes:.1f} passes over the training text memorise it (rerun with fewer steps or tokens per "
                "step, or more text: --data-source python --max-data-bytes N)")
    spread = max([0.0, *repeat_gaps]) - min([0.0, *repeat_gaps])
    if spread <= tolerance:
        return ""
    runs = (f"the two bf16 runs differ by {repeat_gaps[0]:+.2%}" if len(repeat_gaps) == 1 else
            f"the {len(repeat_gaps) + 1} bf16 runs' final losses span {spread:.2%}")
    return (f"{runs}, more than the +-{tolerance:.2%} tolerance (a lower LR, more sequences per step or a longer run "
            "narrows that spread)")


def _repeat_note(records: list[dict]) -> str:
    notes = [f"{r['run']} failed: {r['error']}" for r in records if "error" in r]
    measured = [r for r in records if "error" not in r]
    if measured:
        gaps = ", ".join(f"{r['rel_loss_gap']:+.3%}" for r in measured)
        notes.insert(0, f"bf16 run-to-run over {len(measured) + 1} runs: up to "
                        f"{max(r['run_to_run_noise'] for r in measured):.1%} in step time, final loss {gaps} from the "
                        "first run")
    return f" ({'; '.join(notes)})" if notes else ""


def _measure(recipe: str, result: dict | str, backend: str, peaks: dict | None) -> Arm:
    """Throughput, FLOPs, memory and final loss of one arm's TrainResult. `backend` names the planned
    dense backend; a run reports every FP8 backend its plan used (torchao+grouped_fp8 for MoE)."""
    if isinstance(result, str):
        return Arm(recipe=recipe, backend=backend)
    summary = result["plan_summary"]
    fp8_share = summary["flops_share_by_precision"].get("fp8", 0.0)
    backends = sorted(b for b in summary["flops_share_by_backend"] if b != BF16) or [BF16]
    steady = steady_state(result["step_ms"])
    step_ms = statistics.median(steady)
    tokens_per_s = result["tokens_per_step"] / step_ms * 1000
    tflops = 3 * summary["gemm_flops_per_token"] * tokens_per_s / result["world_size"] / 1e12
    on_cuda = result["peak_mem_gib"] is not None
    return Arm(
        recipe=recipe, backend="+".join(backends), step_ms=step_ms, noise=relative_spread(steady),
        tokens_per_s=tokens_per_s, tflops=tflops,
        mfu=tflops / blended_peak(peaks, fp8_share) if peaks else None,
        peak_mem_gib=result["peak_mem_gib"] if on_cuda else result["max_rss_gib"],
        memory_kind="cuda_peak_allocated" if on_cuda else "process_max_rss",
        final_loss=final_loss(result["losses"]), val_loss=result["val_loss"], fp8_flops_share=fp8_share,
        loss_curve=result["losses"], ran_between=result["ran_between"],
        zero_fp8_weight_grads=result["zero_fp8_weight_grads"])


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


def _plot(arms: list[Arm], repeats: list[dict], path: Path, title: str) -> Path | None:
    """Loss curves, loss relative to bf16 per step (same batches in every arm, so the ratio is
    meaningful step by step; the bf16 repeats' curves, dashed, show how far runs part by chance) and
    throughput bars; None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (pip install matplotlib for the plot)")
        return None
    colours = {"baseline": "tab:gray", "ship": "tab:green", "rollback": "tab:red", "inconclusive": "tab:orange",
               "error": "black"}
    ran = [a for a in arms if a.loss_curve]
    base = arms[0].loss_curve
    fig, (losses, gaps, speed) = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, arm in enumerate(ran):
        steps, line = range(1, len(arm.loss_curve) + 1), {"label": arm.recipe, "color": f"C{index}", "linewidth": 1.2}
        losses.plot(steps, arm.loss_curve, **line)
        if base and arm is not arms[0]:
            gaps.plot(steps, [100 * (a / b - 1) for a, b in zip(arm.loss_curve, base)], **line)
    for repeat in (r for r in repeats if base and r.get("loss_curve")):
        curve = repeat["loss_curve"]
        gaps.plot(range(1, len(curve) + 1), [100 * (a / b - 1) for a, b in zip(curve, base)], label=repeat["run"],
                  color="tab:gray", linewidth=0.8, linestyle="--")
    losses.set(xlabel="step", ylabel="training loss", title="loss")
    losses.legend()
    gaps.axhline(0, color="tab:gray", linewidth=0.8)
    gaps.set(xlabel="step", ylabel="% vs bf16", title="loss relative to bf16 (same batches)")
    if gaps.get_lines()[1:]:  # beyond the zero line
        gaps.legend()
    speed.bar([a.recipe for a in ran], [a.tokens_per_s for a in ran], color=[colours[a.verdict] for a in ran])
    speed.set(ylabel="tokens/s", title="throughput (green ship, red rollback, orange inconclusive, grey bf16)")
    fig.suptitle(title)
    fig.tight_layout()
    targets = [path] + ([Path(os.environ["OUT"]) / path.name] if os.environ.get("OUT") else [])
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fp8stack.ab ...`: the same as `fp8stack ab ...`."""
    parser = argparse.ArgumentParser(prog="python -m fp8stack.ab", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return run_ab(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
