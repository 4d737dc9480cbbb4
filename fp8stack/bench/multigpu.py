"""`python -m fp8stack.bench.multigpu`: the multi-GPU evidence (FSDP2 with FP8 all-gather, tensor parallel,
restart), every run a launch/train.sh subprocess.

    python -m fp8stack.bench.multigpu [--parts fsdp,tp,restart] [--steps 600] [--tp-steps 600] [--tp-dp 1] [--seed 0]

Parts (--parts, default all three):
- fsdp: FSDP2 over 2 ranks, torchao tensorwise on llama-1b-like, FSDP_MICRO_BATCH sequences of FSDP_SEQ per
  rank. Arms: weights all-gathered in BF16; in FP8 with the precomputed scales; in FP8 without them (a few
  steps, for the collective counts); and the 1-rank twin of each of the first two (ONE_RANK_TWINS: FSDP2 over
  one rank, twice the micro-batch, which reads the same global batches, fp8stack.train.data). Collectives
  and their bytes are counted by fp8stack.train.comm_stats over PROFILED_STEPS steps of each 2-rank arm.
- tp: tensor parallel 2, fp8stack.bench.multigpu_tp.run_tp (its dict goes under "tensor_parallel"); with --tp-dp N
  the TP=2 runs are data-parallel over N (2N GPUs) against TP=1 twins that accumulate the same global batch.
- restart: the tiny model on 2 ranks, per training path of RESTART_PATHS (--restart-paths; the fast path by
  default and FSDP2 with torchao's FP8 all-gather): an uninterrupted run; a run that saves every `interval` steps
  and whose rank 1 SIGKILLs itself (fp8stack.train.fault) before the second checkpoint; then both ranks restarted
  with --load latest. The restarted losses must equal the uninterrupted run's.

Every part judges itself ("checks"); one evidence run, profiles/runs/<date>-multigpu-<gpu>/ (.json + .md), holds all
parts with the exact launch commands. Exit status 1 when a check fails. Each part's wall time is in its
evidence (wall_s); split a run over two calls with --keep-other-parts.
"""

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from fp8stack.ab import chosen_names, comma_separated
from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, LOSS_STEPS, LR, LR_WARMUP,
                                     compare_losses, final_mean, launch, loss_checks, run_record, start, wait)
from fp8stack.bench.multigpu_tp import TP, label, processes, run_tp
from fp8stack.evidence import (add_force_option, claim_or_exit, device_slug, environment, markdown_table,
                               provenance, write_evidence)
from fp8stack.train.fault import KILL_AT_ENV
from fp8stack.train.launch import on_gpu

PARTS = ("fsdp", "tp", "restart")
TITLES = {"fsdp": "FSDP2 with FP8 all-gather", "tp": "tensor parallel 2", "restart": "kill a rank, restart"}
KEYS = {"fsdp": "fsdp", "tp": "tensor_parallel", "restart": "restart"}
"""Part -> its key in the evidence."""
FSDP_SEQ, FSDP_MICRO_BATCH = 1024, 4
"""FSDP arms' sequence length and micro-batch per rank: 8 sequences (8k tokens) per step over 2 ranks. At sequence
4096 and micro-batch 1 (2 sequences per step, the same tokens) the 600-step runs parted by more than the 1%
tolerance, FP8 and BF16 all-gather alike (1.46% and 0.87%; profiles/archive/2026-11-22-multigpu-seq4096-h200/),
while the TP part, at 1024 x 4 sequences, stayed within 0.6%: the fewer the sequences per step, the noisier each
gradient and the further two runs that round differently drift apart."""
PROFILED_STEPS = 2
"""Steps whose collectives are counted: steps 1 and 2 (step 0 initialises lazily); with 30 or more steps the
step-time median skips them as warm-up (fp8stack.train.timing.steady_state)."""
ALL_GATHER_RATIO = 0.55
"""The target: FP8 all-gather bytes per step at most this share of the BF16 all-gather's, judged over the
all-gathers of the transformer blocks, whose weights the FP8 all-gather carries. The root group's (embeddings,
final norm, output head) stay BF16 by plan rule 1 and weigh the same in both arms; the whole-model ratio is
reported beside it: 0.5 x (1 - s) + s for a root share s of the BF16 bytes, under 0.55 once s < 0.1."""
RESTART_RTOL_NONDETERMINISTIC = 1e-3
"""Restart tolerance when the pre-kill steps show that two identical runs already differ (nondeterministic
GPU kernels); otherwise the restarted losses must be bit-identical. A restart bug (lost Adam moments, a
wrong data position or LR step) moves the next losses by percents."""


# --- part 1: FSDP2 with FP8 all-gather ----------------------------------------------------------

ONE_RANK_TWINS = {"fp8_all_gather": "one_rank_fp8_all_gather", "bf16_all_gather": "one_rank_bf16_all_gather"}
"""2-rank arm -> the 1-rank run its loss is compared with: the same flags on one process with FSDP2 over a 1-rank
mesh (--data-parallel-one-rank) and micro-batch 2x, so both run FSDP's numerics (BF16 parameters, the same weight casts)
and differ only by the sharding. A plain 1-GPU run is autocast over FP32 parameters, which casts each weight per use
and accumulates FP32 gradients itself: a difference in precision policy, not in sharding."""


def fsdp_arms(steps: int, model: str, micro_batch: int, seq_len: int, seed: int,
              extra: Sequence[str]) -> dict[str, tuple[int, int, list[str]]]:
    """Arm -> (processes, steps, train flags)."""
    common = ["--model", model, "--fp8-recipe", "tensorwise", "--backend", "torchao", "--small-gemm-filter", "off",
              "--seq-length", str(seq_len), "--seed", str(seed), "--lr", str(LR), "--lr-warmup-iters", str(LR_WARMUP),
              "--eval-iters", "0", "--log-interval", "50", *extra]
    fp8, bf16 = ["--fsdp-float8-all-gather", "--precompute-fp8-scales"], ["--no-fsdp-float8-all-gather"]
    two = ["--micro-batch-size", str(micro_batch), "--profile-collectives", str(PROFILED_STEPS)]
    one = ["--micro-batch-size", str(2 * micro_batch), "--data-parallel-one-rank"]
    short = PROFILED_STEPS + 2  # the counts only: the first step, the profiled ones, one more
    arms = {
        "bf16_all_gather": (2, steps, [*two, *bf16]),
        "fp8_all_gather": (2, steps, [*two, *fp8]),
        "fp8_all_gather_no_precompute": (2, short, [*two, "--fsdp-float8-all-gather", "--no-precompute-fp8-scales"]),
        "one_rank_bf16_all_gather": (1, steps, [*one, *bf16]),
        "one_rank_fp8_all_gather": (1, steps, [*one, *fp8]),
    }
    return {name: (nproc, n, [*common, "--train-iters", str(n), *flags]) for name, (nproc, n, flags) in arms.items()}


def run_fsdp(workdir: Path, steps: int, model: str = "llama-1b-like", micro_batch: int = FSDP_MICRO_BATCH,
             seq_len: int = FSDP_SEQ, seed: int = 0, extra: Sequence[str] = ()) -> dict:
    """Part 1: the 2-rank arms one after another (their step times are compared), then the 1-rank twins side by
    side, one per GPU; then judge_fsdp."""
    planned = fsdp_arms(steps, model, micro_batch, seq_len, seed, extra)
    runs = {name: launch(name, workdir, nproc, flags) for name, (nproc, _, flags) in planned.items() if nproc == 2}
    twins = [start(name, workdir, 1, planned[name][2], on_gpu(gpu))
             for gpu, name in enumerate(ONE_RANK_TWINS.values())]
    runs.update((run.name, run) for run in map(wait, twins))
    base = {"model": model, "seq_len": seq_len, "micro_batch_per_rank": micro_batch, "steps": steps, "seed": seed,
            "profiled_steps": PROFILED_STEPS,
            "commands": [run.command for run in runs.values()],
            "tolerances": {"all_gather_ratio": ALL_GATHER_RATIO, "loss_rtol": LOSS_RTOL,
                           "first_loss_rtol": FIRST_LOSS_RTOL, "first_grad_norm_rtol": GRAD_NORM_RTOL}}
    return {**base, **judge_fsdp({name: run_record(run) for name, run in runs.items()},
                                 {name: n for name, (_, n, _) in planned.items()})}


def judge_fsdp(arms: dict[str, dict], planned_steps: dict[str, int]) -> dict:
    """The FSDP part's figures and checks from its run records (arm name -> run_record)."""
    checks = {f"{name} ran {n} steps": len(arms[name].get("losses", ())) == n for name, n in planned_steps.items()}
    if not all(checks.values()):
        return {"arms": arms, "checks": checks}
    bf16, fp8, fp8_plain = (arms[n]["collectives"] for n in ("bf16_all_gather", "fp8_all_gather",
                                                              "fp8_all_gather_no_precompute"))
    root = fp8["all_gather_bytes_by_group"].get("root", 0.0)
    blocks = {n: sum(v for k, v in c["all_gather_bytes_by_group"].items() if k != "root")
              for n, c in (("bf16", bf16), ("fp8", fp8))}
    gather = {
        "bytes_per_step": {"bf16": bf16["bytes"]["all_gather"], "fp8": fp8["bytes"]["all_gather"]},
        "ratio_whole_model": fp8["bytes"]["all_gather"] / bf16["bytes"]["all_gather"],
        "ratio_blocks": blocks["fp8"] / blocks["bf16"],
        "root_bytes_per_step": {"bf16": bf16["all_gather_bytes_by_group"].get("root", 0.0), "fp8": root},
        "root_share_of_bf16_bytes": bf16["all_gather_bytes_by_group"].get("root", 0.0) / bf16["bytes"]["all_gather"],
    }
    other_all_reduces = fp8_plain["counts"]["all_reduce"] - fp8_plain["all_reduces_in_all_gather"]
    precompute = {
        "all_reduces_per_step": {"with": fp8["counts"]["all_reduce"], "without": fp8_plain["counts"]["all_reduce"]},
        "scale_all_reduces_in_all_gathers": {"with": fp8["all_reduces_in_all_gather"],
                                             "without": fp8_plain["all_reduces_in_all_gather"]},
        "all_reduces_besides_scales": other_all_reduces,
        "precompute_all_reduces": fp8["counts"]["all_reduce"] - other_all_reduces,
    }
    # The BF16 all-gather pair is the control: what sharding alone moves when FP8 all-gather is off.
    loss = {name: compare_losses(arms[twin], arms[name]) for name, twin in ONE_RANK_TWINS.items()}
    step_ms = {n: arms[n]["step_ms_median"] for n in ("bf16_all_gather", "fp8_all_gather")}
    checks.update({
        f"FP8 all-gather bytes <= {ALL_GATHER_RATIO}x BF16, transformer blocks (all FP8 weights)":
            gather["ratio_blocks"] <= ALL_GATHER_RATIO,
        "precompute: no per-weight scale all-reduce in the all-gathers, one all-reduce per step instead":
            precompute["scale_all_reduces_in_all_gathers"]["without"] > 0
            and precompute["scale_all_reduces_in_all_gathers"]["with"] == 0
            and precompute["precompute_all_reduces"] == 1,
        **loss_checks("FP8 all-gather, 2 ranks vs 1", loss["fp8_all_gather"]),
    })
    return {"arms": arms, "checks": checks, "all_gather": gather, "precompute": precompute,
            "loss_vs_one_rank": loss, "step_ms": step_ms,
            "step_time_fp8_over_bf16_all_gather": step_ms["fp8_all_gather"] / step_ms["bf16_all_gather"]}


# --- part 3: kill a rank, restart from the checkpoint --------------------------------------------

def restart_plan(steps: int) -> tuple[int, int]:
    """(checkpoint interval, step at which rank 1 dies): after the first checkpoint, before the second,
    so interval - 1 steps are lost and trained again."""
    interval = max(2, steps // 3)
    if steps < 2 * interval:
        raise ValueError(f"restart needs at least {2 * interval} steps, got {steps}: raise --restart-steps")
    return interval, 2 * interval - 1


RESTART_PATHS = {
    "fast": ("the one-GPU fast path under DDP: TE delayed scaling, BF16 parameters with FP32 masters, fused "
             "weight-gradient accumulation and the FP8 weight cache",
             ["--fp8-recipe", "delayed", "--backend", "te", "--parallelism.data-parallel", "ddp",
              "--checkpoint.trust"]),
    "fsdp_fp8_all_gather": ("FSDP2 + torchao tensorwise with FP8 all-gather and precomputed scales",
                            ["--fp8-recipe", "tensorwise", "--backend", "torchao", "--fsdp-float8-all-gather",
                             "--precompute-fp8-scales"]),
}
"""Training path -> (what it is, its flags) for the restart part. The fast path's delayed-scaling state is TE's
pickle in the checkpoint, which loads only with --checkpoint.trust (the checkpoint is this run's own)."""


def run_restarts(workdir: Path, steps: int, paths: Sequence[str], micro_batch: int = 4,
                 extra: Sequence[str] = ()) -> dict:
    """Part 3 for each training path: run_restart's record per path, their checks named after the path."""
    done = {path: run_restart(workdir / path, steps, path, micro_batch=micro_batch, extra=extra) for path in paths}
    return {"paths": done, "checks": {f"{path}: {name}": ok for path, part in done.items()
                                      for name, ok in part["checks"].items()},
            "commands": [command for part in done.values() for command in part["commands"]]}


def run_restart(workdir: Path, steps: int, path: str = "fast", model: str = "tiny", micro_batch: int = 4,
                extra: Sequence[str] = ()) -> dict:
    """Uninterrupted vs killed-and-restarted on one training path of RESTART_PATHS."""
    interval, kill_step = restart_plan(steps)
    saved = workdir / "checkpoints"
    flags = ["--model", model, *RESTART_PATHS[path][1], "--small-gemm-filter", "off",
             "--micro-batch-size", str(micro_batch), "--train-iters", str(steps), "--seed", "0", "--eval-iters", "0",
             *extra]
    checkpointed = [*flags, "--save", str(saved), "--save-interval", str(interval)]
    uninterrupted = launch("uninterrupted", workdir, 2, flags)
    killed = launch("killed", workdir, 2, checkpointed, env={KILL_AT_ENV: f"1:{kill_step}"})
    left = sorted(p.name for p in saved.glob("step-*")) if saved.exists() else []
    restarted = launch("restarted", workdir, 2, [*checkpointed, "--load", "latest"])

    base = {"path": path, "model": model, "steps": steps, "checkpoint_interval": interval, "killed_rank": 1,
            "kill_at_step": kill_step, "checkpoints_after_kill": left,
            "runs": {r.name: run_record(r) for r in (uninterrupted, killed, restarted)},
            "commands": [r.command for r in (uninterrupted, killed, restarted)]}
    checks = {
        "uninterrupted run finished": uninterrupted.returncode == 0 and bool(uninterrupted.result),
        "torchrun failed when rank 1 was killed": killed.returncode not in (0, None),
        f"killed mid-run: only checkpoint step {interval} was written":
            left == [f"step-{interval:08d}"] and len(killed.logged) == kill_step,
        "restart finished": restarted.returncode == 0 and bool(restarted.result),
    }
    if not all(checks.values()):
        return {**base, "checks": checks}
    reference = uninterrupted.result["losses"]
    resumed = restarted.result["losses"]
    before_kill = [record["loss"] for record in killed.logged]
    pre_kill_gap = _max_rel_gap(before_kill, reference[:kill_step])
    restart_gap = _max_rel_gap(resumed, reference[interval:])
    tolerance = 0.0 if pre_kill_gap == 0 else RESTART_RTOL_NONDETERMINISTIC
    checks.update({
        f"restart resumed at step {interval}": restarted.result["first_step"] == interval
            and len(resumed) == steps - interval,
        f"restarted losses equal the uninterrupted run's (max relative gap <= {tolerance:g})": restart_gap <= tolerance,
    })
    return {**base, "checks": checks, "bit_identical": resumed == reference[interval:],
            "max_rel_gap_restart": restart_gap, "max_rel_gap_before_kill": pre_kill_gap, "tolerance": tolerance,
            "losses": {"uninterrupted": reference, "killed": before_kill, "restarted": resumed}}


def _max_rel_gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)), default=0.0)


# --- part 2 and the evidence ---------------------------------------------------------------------

def run_tp_part(workdir: Path, steps: int, seed: int, dp: int = 1) -> dict:
    """Part 2 (another module's work): its dict, or its failure recorded as a failed check."""
    try:
        return run_tp(workdir, steps, seed, dp)
    except Exception:  # keep the other parts' evidence: the error is recorded, not dropped
        return {"checks": {"run_tp finished": False}, "error": traceback.format_exc()[-3000:]}


def render(payload: dict) -> str:
    """The evidence's Markdown: one section per part, its checks, then every launch command."""
    verdict = "PASS" if payload["passed"] else "FAIL"
    pending = f" Partial: not yet run: {', '.join(payload['pending'])}." if payload.get("pending") else ""
    sections = [f"Multi-GPU checks on {payload['gpus']} GPU(s). Overall: **{verdict}**.{pending}\n"]
    renderers = {"fsdp": _render_fsdp, "tp": _render_tp, "restart": _render_restarts}
    for part in PARTS:
        found = payload.get(KEYS[part])
        if found:
            measured = found.get("measured")
            sections.append(renderers[part](found) + (
                f"\nMeasured {measured['date']} by `{measured['command']}`.\n" if measured else ""))
    commands = "\n".join(payload["commands"]) or "(none)"
    sections.append(f"## Launch commands (from the repository root)\n\n```\n{commands}\n```\n")
    return "\n".join(sections)


def _render_tp(part: dict) -> str:
    dp = part.get("data_parallel", 1)  # evidence from before data parallelism ran at DP=1
    parallel = label(dp)
    text = f"## Tensor parallel 2 (fp8stack.bench.multigpu_tp): TP={TP} x DP={dp} on {processes(TP, dp)} GPUs\n\n"
    if "arms" in part:
        text += (f"{part['model']}, sequence {part['seq_len']}, micro-batch {part['micro_batch']}, {part['steps']} "
                 f"steps per run; the reference is TP=1, the gaps relative. The TP=1 runs shared the GPUs, so "
                 f"tokens/s are not throughput figures.\n\n")
        if dp > 1:
            text += (f"Data parallel {dp}: each step's global batch of {part['global_batch']} sequences is split "
                     f"over the {dp} data-parallel ranks (megatron's DDP; FSDP2 on the plain path), one micro-batch "
                     f"each; the TP=1 twin on one GPU accumulates the same {dp} micro-batches (torchao's under FSDP2 "
                     f"over one rank).\n\n")
        text += _loss_table(f"arm ({parallel} vs TP=1)", [(name, arm["comparison"])
                                                           for name, arm in part["arms"].items()
                                                           if "comparison" in arm])
        rows = [[name, f"{arm['tp1']['tokens_per_s']:,.0f}", f"{arm['tp2']['tokens_per_s']:,.0f}"]
                for name, arm in part["arms"].items() if "comparison" in arm]
        text += "\n" + markdown_table(["arm", "tokens/s TP=1", f"tokens/s {parallel}"], rows) + "\n"
    return text + _render_checks(part) + (f"\nerror: {part['error']}\n" if "error" in part else "")


def _render_checks(part: dict) -> str:
    return markdown_table(["check", "result"], [[name, "pass" if ok else "**FAIL**"]
                                                for name, ok in part["checks"].items()])


def _gb(value: float) -> str:
    return f"{value / 1e9:.3f}"


def _render_fsdp(part: dict) -> str:
    text = (f"## FSDP2 + torchao tensorwise, {part['model']}, sequence {part['seq_len']}, micro-batch "
            f"{part['micro_batch_per_rank']} per rank, {part['steps']} steps, seed {part['seed']}\n\nThe 2-rank arms "
            f"ran one after another; the 1-rank twins (FSDP2 over a 1-rank mesh, micro-batch "
            f"{2 * part['micro_batch_per_rank']}, the same global batches) side by side, one per GPU.\n\n")
    rows = []
    for name, arm in part["arms"].items():
        if "losses" not in arm:
            rows.append([name, "-", "-", "-", "-", "-", "-", f"exit {arm['returncode']}"])
            continue
        comm = arm["collectives"] or {"counts": {}, "bytes": {}, "all_reduces_in_all_gather": 0}
        rows.append([name, arm["world_size"], _gb(comm["bytes"].get("all_gather", 0)) if comm["bytes"] else "-",
                     f"{comm['counts'].get('all_gather', 0):g}" if comm["counts"] else "-",
                     f"{comm['counts'].get('all_reduce', 0):g} ({comm['all_reduces_in_all_gather']:g})"
                     if comm["counts"] else "-",
                     f"{arm['step_ms_median']:.1f} ± {arm['step_ms_spread']:.1%}", f"{arm['tokens_per_s']:,.0f}",
                     f"{final_mean(arm['losses']):.4f}"])
    text += markdown_table(["arm", "ranks", "all-gather GB/step", "all-gathers/step",
                            "all-reduces/step (in all-gathers)", "step ms (median ± IQR)", "tokens/s",
                            "loss, mean of the last quarter"], rows)
    if "all_gather" in part:
        g, p = part["all_gather"], part["precompute"]
        text += (f"\nFP8 / BF16 all-gather bytes per step: transformer blocks {g['ratio_blocks']:.3f}, whole model "
                 f"{g['ratio_whole_model']:.3f}. The root group (embeddings, final norm, output head: BF16 by plan "
                 f"rule 1) all-gathers {_gb(g['root_bytes_per_step']['fp8'])} GB per step in both arms, a share s = "
                 f"{g['root_share_of_bf16_bytes']:.3f} of the BF16 arm's bytes: whole = blocks x (1 - s) + s. "
                 f"Bytes: the unsharded size of each all-gather (a ring moves half of it through each of the 2 "
                 f"ranks), counted by fp8stack.train.comm_stats over {part['profiled_steps']} steps.\n\n"
                 f"Precompute: all-reduces per step {p['all_reduces_per_step']['without']:g} without, "
                 f"{p['all_reduces_per_step']['with']:g} with; per-weight scale all-reduces inside the all-gathers "
                 f"{p['scale_all_reduces_in_all_gathers']['without']:g} -> "
                 f"{p['scale_all_reduces_in_all_gathers']['with']:g}; the precompute itself: "
                 f"{p['precompute_all_reduces']:g} all-reduce per step (the others: loss mean and gradient norm).\n\n"
                 f"Step time, FP8 over BF16 all-gather: {part['step_time_fp8_over_bf16_all_gather']:.3f}x.\n\n"
                 f"Loss, 2 ranks vs their 1-rank twin (the BF16 all-gather pair is the control):\n\n")
        text += _loss_table("2-rank arm", part["loss_vs_one_rank"].items())
    return text + "\n" + _render_checks(part)


def _loss_table(first_column: str, comparisons) -> str:
    """Markdown rows of compare_losses results: (label, gaps) pairs."""
    rows = [[label, f"{c['loss_final_mean_reference']:.4f}", f"{c['loss_final_mean']:.4f}",
             f"{c['final_rel_gap']:.2%}", f"{c['first_loss_rel_gap']:.3%}", f"{c['first_grad_norm_rel_gap']:.3%}",
             f"{c['max_step_rel_gap']:.2%}"] for label, c in comparisons]
    return markdown_table([first_column, "final mean, reference", "final mean", "final gap", "first-step loss gap",
                           "first grad-norm gap", "any step's max gap"], rows) + "\n"


def _render_restarts(part: dict) -> str:
    return "\n".join(_render_restart(path) for path in part["paths"].values())


def _render_restart(part: dict) -> str:
    text = (f"## Kill rank 1, restart from the checkpoint ({part['model']}, {RESTART_PATHS[part['path']][0]}, 2 "
            f"ranks, {part['steps']} steps)\n\nCheckpoint every {part['checkpoint_interval']} steps; "
            f"rank 1 SIGKILLs itself as step {part['kill_at_step']} begins; checkpoints left: "
            f"{', '.join(part['checkpoints_after_kill']) or 'none'}. Runs: " +
            ", ".join(f"{name} exit {run['returncode']}" for name, run in part["runs"].items()) + ".\n")
    if "max_rel_gap_restart" in part:
        text += (f"\nRestarted vs uninterrupted losses: bit-identical {part['bit_identical']}, max relative gap "
                 f"{part['max_rel_gap_restart']:.2e} (tolerance {part['tolerance']:g}; the killed run's steps "
                 f"before the kill differ from the uninterrupted run's by {part['max_rel_gap_before_kill']:.2e}).\n")
    return text + "\n" + _render_checks(part)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.multigpu", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=LOSS_STEPS, help="steps of the fsdp arms")
    parser.add_argument("--tp-steps", type=int, default=LOSS_STEPS, help="steps of each tensor-parallel run")
    parser.add_argument("--tp-dp", type=int, default=1, metavar="N",
                        help=f"data-parallel degree of the TP={TP} runs, on {TP} x N GPUs (their TP=1 twins accumulate "
                             "N micro-batches)")
    parser.add_argument("--restart-steps", type=int, default=30, help="steps of the restart runs")
    parser.add_argument("--restart-paths", default=",".join(RESTART_PATHS),
                        help=f"training paths the restart part kills and restarts: some of {','.join(RESTART_PATHS)}")
    parser.add_argument("--model", default="llama-1b-like", help="model of the fsdp part")
    parser.add_argument("--micro-batch-size", type=int, default=FSDP_MICRO_BATCH, help="per rank, fsdp part")
    parser.add_argument("--seq-length", type=int, default=FSDP_SEQ, help="fsdp part")
    parser.add_argument("--seed", type=int, default=0, help="weights and batches of the fsdp and tp runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="passed to every fsdp/restart run (default: auto)")
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    parser.add_argument("--keep-other-parts", action="store_true",
                        help="keep the parts not run now from the existing evidence file (each part records its "
                             "own date and command), e.g. to rerun one part")
    add_force_option(parser)
    args = parser.parse_args(argv)
    parts = comma_separated(args.parts)
    unknown = sorted(set(parts) - set(PARTS))
    if not parts:
        parser.error(f"--parts is empty: name some of {','.join(PARTS)}")
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: use a subset of {','.join(PARTS)}")
    restart_paths = (chosen_names(parser, "--restart-paths", args.restart_paths, list(RESTART_PATHS))
                     if "restart" in parts else ())
    extra = ("--device", args.device) if args.device else ()
    if args.tp_dp < 1:
        parser.error(f"--tp-dp {args.tp_dp}: pass a data-parallel degree of 1 or more")

    import torch

    if "tp" in parts and args.tp_dp > 1 and torch.cuda.device_count() < processes(TP, args.tp_dp):
        parser.error(f"--tp-dp {args.tp_dp} runs TP={TP} x DP={args.tp_dp} on {processes(TP, args.tp_dp)} GPUs and "
                     f"{torch.cuda.device_count()} are visible: run on {processes(TP, args.tp_dp)} GPUs or lower "
                     "--tp-dp")

    # --keep-other-parts rewrites the evidence it continues
    claim_or_exit("fp8stack.bench.multigpu", f"multigpu-{device_slug()}", args.out_dir,
                  args.force or args.keep_other_parts)
    began = time.perf_counter()
    payload: dict = {"parts": parts, "gpus": torch.cuda.device_count()}
    if args.keep_other_parts:
        payload.update(earlier_parts(parts, args.out_dir))
    steps = {"fsdp": lambda workdir: run_fsdp(workdir, args.steps, args.model, args.micro_batch_size, args.seq_length,
                                              args.seed, extra),
             "tp": lambda workdir: run_tp_part(workdir, args.tp_steps, args.seed, args.tp_dp),
             "restart": lambda workdir: run_restarts(workdir, args.restart_steps, restart_paths, extra=extra)}
    todo = [part for part in PARTS if part in parts]
    with tempfile.TemporaryDirectory(prefix="fp8stack-multigpu-") as scratch:
        workdir = args.workdir or Path(scratch)
        for index, part in enumerate(todo):
            print(f"[multigpu] part {part}: {TITLES[part]}", flush=True)
            part_began = time.perf_counter()
            payload[KEYS[part]] = steps[part](workdir / part)
            payload[KEYS[part]].update(measured=provenance(), wall_s=round(time.perf_counter() - part_began, 1))
            paths = _write(payload, todo[index + 1:], began, args.out_dir)
    print(render(payload), flush=True)
    print(f"[multigpu] {payload['wall_s']:.0f} s; evidence: {', '.join(map(str, paths))}", flush=True)
    return 0 if payload["passed"] else 1


def earlier_parts(rerun: list[str], out_dir: str) -> dict:
    """Key -> the existing evidence's record of each part not rerun, when measured on this kind of device."""
    path = Path(out_dir) / f"multigpu-{device_slug()}.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier["environment"] != environment():
        raise SystemExit(f"--keep-other-parts: {path} was measured with {earlier['environment']}, this machine "
                         f"has {environment()}: rerun every part")
    return {KEYS[part]: earlier[KEYS[part]] for part in PARTS if part not in rerun and KEYS[part] in earlier}


def _write(payload: dict, pending: list[str], began: float, out_dir: str) -> tuple[Path, Path]:
    """(Re)write the evidence after each part, so a run cut short keeps what it measured ('pending' names the rest)."""
    done = [payload[KEYS[part]] for part in PARTS if KEYS[part] in payload]
    payload["checks"] = {f"{KEYS[part]}: {name}": ok for part in PARTS if KEYS[part] in payload
                         for name, ok in payload[KEYS[part]]["checks"].items()}
    payload["pending"] = pending
    payload["passed"] = bool(payload["checks"]) and all(payload["checks"].values()) and not pending
    payload["commands"] = [command for part in done for command in part.get("commands", [])]
    payload["wall_s"] = round(time.perf_counter() - began, 1)
    return write_evidence(f"multigpu-{device_slug()}", payload, render(payload), out_dir, replace=True)


if __name__ == "__main__":
    sys.exit(main())
