"""`python -m fp8stack.bench.expert_parallel`: an MoE model's experts split over two GPUs (megatron-core's expert
parallelism on the Megatron path) against all experts on one GPU.

    python -m fp8stack.bench.expert_parallel [--model deepseek-moe-small] [--steps 60] [--fp8-recipe blockwise]

Arms: BF16 and FP8 (--fp8-recipe, the recipe the plan runs megatron's grouped experts in: blockwise by default,
DeepSeek-V3's, whose forward scales each token's 128-wide tiles on their own, so the first step's loss does not
depend on which rank computes which token; delayed scales each tensor from an amax history instead). Each is
trained by launch/train.sh at EP=1 on one GPU and at EP=2 on two (--expert-model-parallel-size 2: two data-parallel
ranks, each holding half the routed experts, the alltoall dispatcher sending every token to its expert's rank and
back), from the same seed, weights and batches with the same global batch (MODELS). The EP=1 runs train side by
side, one per GPU; the EP=2 runs one after another.

Per run: tokens/s (global), peak memory (the fullest GPU's), losses, and the collectives of PROFILED_STEPS steps
(fp8stack.train.comm_stats): the all-to-all bytes each rank sends per step, by element type. FP8 dispatch is not
provided (issue 37), so an FP8 arm's tokens travel in BF16 too, and its dispatch bytes over the BF16 arm's are
reported (a little above 1: FP8 pads each expert's tokens to a multiple of 16). Checks per arm: both runs took every
step, EP=2 ran on two ranks (FP8 GEMMs in the FP8 arm), EP=1 issued no all-to-all and EP=2 its tokens in BF16, the
losses of EP=2 against EP=1 (launches.loss_checks: the first step's loss and gradient norm, where only rounding
differs, and the mean of the last quarter). The evidence, profiles/runs/<date>-expert-parallel-<gpu>/ (.json, .md),
holds the exact launch commands; exit status 1 when a check fails.
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, LR, LR_WARMUP, compare_losses,
                                     launch, loss_checks, run_record, start, wait)
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.plan.recipes import BF16, is_fp8
from fp8stack.train.launch import on_gpu

PROG = "python -m fp8stack.bench.expert_parallel"


@dataclass(frozen=True)
class Batch:
    """A model's sequences and batches in this bench."""

    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per forward pass and rank."""
    global_batch: int
    """Sequences per optimizer step over the ranks: at EP=1 on one GPU and at EP=2 on two alike."""


MODELS = {"deepseek-moe-small": Batch(seq_len=1024, micro_batch=1, global_batch=8),
          "tiny-moe": Batch(seq_len=256, micro_batch=8, global_batch=16)}
"""The models this bench trains and their batches: deepseek-moe-small (32 experts top 8; 2.46 B parameters with
FP32 masters and AdamW fit one H200 at micro-batch 1, as tests/gpu/test_megatron_moe_gpu.py trains it), tiny-moe for
a quick run."""
EXPERT_PARALLEL = 2
"""The split degree: two GPUs."""
PROFILED_STEPS = 2
"""Steps whose collectives are counted: steps 1 and 2 (step 0 initialises lazily)."""
DEFAULT_STEPS = 60
"""Steps per run: the LR warm-up (a quarter) and a last-quarter mean of 15 steps, enough for the loss checks; the
four runs of deepseek-moe-small then fit one 10-minute device call on two H200s
(profiles/runs/2026-11-28-expert-parallel-h200: its small micro-batches make the EP=1 steps, not start-up, most of
the time)."""
BF16_ELEMENT = "c10::BFloat16"
"""The profiler's name of BF16 elements (comm_stats.ITEM_BYTES)."""
FP8_DISPATCH = "FP8 dispatch: not provided (issue 37): tokens travel in BF16"
"""What this bench's FP8 arm dispatches, stated in its evidence beside the element types measured."""


def warmup(steps: int) -> int:
    """The LR warm-up of a run of `steps`: the loss comparisons' (launches.LR_WARMUP), at most a quarter of the run."""
    return min(LR_WARMUP, steps // 4)


def train_flags(model: str, recipe: str, expert_parallel: int, steps: int, seed: int) -> list[str]:
    """launch/train.sh arguments of one run (launches.start adds where it writes)."""
    batch = MODELS[model]
    return ["--model-impl", "megatron", "--model", model, "--fp8-recipe", recipe, "--seq-length", str(batch.seq_len),
            "--micro-batch-size", str(batch.micro_batch), "--global-batch-size", str(batch.global_batch),
            "--train-iters", str(steps), "--lr", str(LR), "--lr-warmup-iters", str(warmup(steps)), "--seed", str(seed),
            "--eval-iters", "0", "--expert-model-parallel-size", str(expert_parallel),
            "--profile-collectives", str(PROFILED_STEPS), "--log-interval", "50"]


def run_expert_parallel(workdir: Path, model: str, fp8_recipe: str, steps: int, seed: int = 0) -> dict:
    """Train the BF16 and FP8 arms at EP=1 and EP=2 through launch/train.sh and judge them."""
    import torch

    recipes = (BF16, fp8_recipe)
    base = {"model": model, **asdict(MODELS[model]), "recipes": list(recipes), "steps": steps, "seed": seed,
            "lr": LR, "lr_warmup": warmup(steps), "profiled_steps": PROFILED_STEPS, "fp8_dispatch": FP8_DISPATCH,
            "tolerances": {"loss_rtol": LOSS_RTOL, "first_loss_rtol": FIRST_LOSS_RTOL,
                           "first_grad_norm_rtol": GRAD_NORM_RTOL}}
    gpus = torch.cuda.device_count()
    if gpus < EXPERT_PARALLEL:
        return {**base, "checks": {"two GPUs visible": False}, "error": f"{gpus} CUDA GPU(s) visible: run on two"}
    # EP=1 side by side, one per GPU (each has its GPU to itself); then each EP=2 run on both in turn.
    started = [start(f"{recipe}-ep1", workdir, 1, train_flags(model, recipe, 1, steps, seed),
                     on_gpu(i)) for i, recipe in enumerate(recipes)]
    runs = {(recipe, 1): run_record(wait(run)) for recipe, run in zip(recipes, started)}
    for recipe in recipes:
        runs[recipe, EXPERT_PARALLEL] = run_record(launch(
            f"{recipe}-ep{EXPERT_PARALLEL}", workdir, EXPERT_PARALLEL,
            train_flags(model, recipe, EXPERT_PARALLEL, steps, seed)))
    return {**base, **judge(runs, recipes, steps), "commands": [run["command"] for run in runs.values()]}


def judge(runs: dict[tuple[str, int], dict], recipes: Sequence[str], steps: int) -> dict:
    """Arms, figures and checks from the run records keyed (recipe, expert-parallel degree)."""
    arms, checks = {}, {}
    for recipe in recipes:
        one, split = runs[recipe, 1], runs[recipe, EXPERT_PARALLEL]
        kept = arms[recipe] = {"ep1": one, f"ep{EXPERT_PARALLEL}": split}
        ran = all(run["returncode"] == 0 and len(run.get("losses", ())) == steps for run in (one, split))
        checks[f"{recipe}: EP=1 and EP={EXPERT_PARALLEL} ran {steps} steps"] = ran
        if not ran:
            continue
        kept["comparison"] = gaps = compare_losses(one, split)
        kept["dispatch"] = dispatch = all_to_all(split)
        kept["tokens_per_s_ratio"] = split["tokens_per_s"] / one["tokens_per_s"]
        fp8_gemms = split["plan_summary"]["fp8_gemms"]
        checks[f"{recipe}: EP={EXPERT_PARALLEL} ran on {EXPERT_PARALLEL} ranks with "
               f"{'' if is_fp8(recipe) else 'no '}FP8 GEMMs"] = (
            split["world_size"] == EXPERT_PARALLEL and (fp8_gemms > 0) == is_fp8(recipe))
        checks[f"{recipe}: EP=1 issues no all-to-all"] = all_to_all(one)["calls_per_step"] == 0
        checks[f"{recipe}: EP={EXPERT_PARALLEL} dispatches its tokens in BF16 (no FP8 dispatch)"] = (
            dispatch["calls_per_step"] > 0 and BF16_ELEMENT in dispatch["bytes_by_dtype"]
            and not any("Float8" in element for element in dispatch["bytes_by_dtype"]))
        checks.update(loss_checks(f"{recipe}, EP={EXPERT_PARALLEL} vs EP=1", gaps))
    measured = [arms[recipe].get("dispatch", {}).get("bytes_per_step") for recipe in recipes]
    figures = {"fp8_over_bf16_dispatch_bytes": measured[1] / measured[0]} if all(measured) else {}
    return {"arms": arms, "figures": figures, "checks": checks}


def all_to_all(record: dict) -> dict:
    """A run's all-to-alls per step (comm_stats over the profiled steps): calls, bytes sent, bytes by element type."""
    collectives = record.get("collectives") or {}
    return {"calls_per_step": collectives.get("counts", {}).get("all_to_all", 0),
            "bytes_per_step": collectives.get("bytes", {}).get("all_to_all", 0),
            "bytes_by_dtype": collectives.get("all_to_all_bytes_by_dtype", {})}


def render(payload: dict) -> str:
    """The evidence's Markdown: the runs, the EP=2 vs EP=1 losses, the checks, every launch command."""
    verdict = "PASS" if payload["passed"] else "FAIL"
    text = (f"Expert parallel {EXPERT_PARALLEL} against all experts on one GPU: {payload['model']}, sequence "
            f"{payload['seq_len']}, global batch {payload['global_batch']} (micro-batch {payload['micro_batch']}), "
            f"{payload['steps']} steps, LR {payload['lr']:g} after {payload['lr_warmup']} warm-up steps, seed "
            f"{payload['seed']}. Overall: **{verdict}**.\n\n{payload['fp8_dispatch']}.\n\n")
    arms = payload.get("arms", {})
    rows = [[recipe, degree.removeprefix("ep"), *_run_row(run)] for recipe, arm in arms.items()
            for degree, run in arm.items() if degree.startswith("ep")]
    if rows:
        text += markdown_table(["arm", "EP", "ranks", "tokens/s", "step ms (median)", "peak GiB (rank 0)",
                                "all-to-alls/step", "all-to-all MB sent/step (rank 0)", "by element type"], rows)
        text += (f"\n\nThe EP=1 runs trained side by side, one per GPU; the EP={EXPERT_PARALLEL} runs one after "
                 f"another on both. All-to-all bytes: what rank 0 sends, its own share included, counted by "
                 f"fp8stack.train.comm_stats over {payload['profiled_steps']} steps.\n\n")
    compared = [(recipe, arm) for recipe, arm in arms.items() if "comparison" in arm]
    if compared:
        text += markdown_table(["arm", f"EP={EXPERT_PARALLEL} / EP=1 tokens/s", "final mean, EP=1",
                                f"final mean, EP={EXPERT_PARALLEL}", "final gap", "first-step loss gap",
                                "first grad-norm gap", "any step's max gap"],
                               [[recipe, f"{arm['tokens_per_s_ratio']:.3f}x", *_gap_cells(arm["comparison"])]
                                for recipe, arm in compared]) + "\n\n"
    ratio = payload.get("figures", {}).get("fp8_over_bf16_dispatch_bytes")
    if ratio:
        text += f"Dispatch bytes, FP8 arm over BF16 arm: {ratio:.3f}x.\n\n"
    text += markdown_table(["check", "result"], [[name, "pass" if ok else "**FAIL**"]
                                                 for name, ok in payload["checks"].items()])
    if "error" in payload:
        text += f"\n\nerror: {payload['error']}"
    commands = "\n".join(payload.get("commands", [])) or "(none)"
    return text + f"\n\n## Launch commands (from the repository root)\n\n```\n{commands}\n```\n"


def _run_row(run: dict) -> list[str]:
    """A run's cells after its arm and degree: what it measured, or how it ended."""
    if "losses" not in run:
        return ["-", "-", "-", "-", "-", "-", f"exit {run['returncode']}"]
    sent = all_to_all(run)
    dtypes = ", ".join(f"{element} {size / 1e6:.1f}" for element, size in sent["bytes_by_dtype"].items()) or "-"
    return [str(run["world_size"]), f"{run['tokens_per_s']:,.0f}", f"{run['step_ms_median']:.1f}",
            f"{run['peak_mem_gib']:.2f}" if run.get("peak_mem_gib") is not None else "-",
            f"{sent['calls_per_step']:g}", f"{sent['bytes_per_step'] / 1e6:.1f}", dtypes]


def _gap_cells(gaps: dict) -> list[str]:
    return [f"{gaps['loss_final_mean_reference']:.4f}", f"{gaps['loss_final_mean']:.4f}",
            f"{gaps['final_rel_gap']:.2%}", f"{gaps['first_loss_rel_gap']:.3%}",
            f"{gaps['first_grad_norm_rel_gap']:.3%}", f"{gaps['max_step_rel_gap']:.2%}"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="deepseek-moe-small")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per run")
    parser.add_argument("--fp8-recipe", choices=("blockwise", "delayed"), default="blockwise",
                        help="the FP8 arm's recipe")
    parser.add_argument("--seed", type=int, default=0, help="weights and batches of every run")
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if args.steps < 4 * PROFILED_STEPS:
        parser.error(f"--steps {args.steps}: pass at least {4 * PROFILED_STEPS} (the collectives are counted over "
                     f"steps 1-{PROFILED_STEPS}, the loss over the last quarter)")
    name = f"expert-parallel-{device_slug()}"
    claim_or_exit(PROG, name, args.out_dir, args.force)
    with tempfile.TemporaryDirectory(prefix="fp8stack-expert-parallel-") as scratch:
        payload = run_expert_parallel(args.workdir or Path(scratch), args.model, args.fp8_recipe, args.steps,
                                      args.seed)
    payload["passed"] = all(payload["checks"].values())
    text = render(payload)
    print(text, flush=True)
    paths = write_evidence(name, payload, text, args.out_dir, replace=True)
    print(f"[expert-parallel] evidence: {', '.join(map(str, paths))}", flush=True)
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
