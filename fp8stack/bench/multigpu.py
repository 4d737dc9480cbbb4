"""`python -m fp8stack.bench.multigpu`: issue 8's two-GPU evidence, every run a launch/train.sh subprocess.

    python -m fp8stack.bench.multigpu [--parts fsdp,tp,restart] [--steps 300]

Parts (--parts, default all three):
- fsdp: FSDP2 over 2 ranks, torchao tensorwise on llama-1b-like, micro-batch 1 per rank. Arms: weights
  all-gathered in BF16; in FP8 with the precomputed scales; in FP8 without them (a few steps, for the
  collective counts); and 1 rank with micro-batch 2, which reads the same global batches
  (fp8stack.train.data). Collectives and their bytes are counted by fp8stack.train.comm_stats over
  PROFILED_STEPS steps of each 2-rank arm.
- tp: tensor parallel 2, fp8stack.bench.multigpu_tp.run_tp (its dict goes under "tensor_parallel").
- restart: the tiny model, FSDP2 with FP8 all-gather, 2 ranks: an uninterrupted run; a run that saves
  every `interval` steps and whose rank 1 SIGKILLs itself (fp8stack.train.fault) before the second
  checkpoint; then both ranks restarted with --load latest. The restarted losses must equal the
  uninterrupted run's.

Every part judges itself ("checks"); one evidence file, profiles/multigpu-<gpu>.json + .md, holds all
parts with the exact launch commands. Exit status 1 when a check fails. About 7 minutes on two H200s
(fsdp 3.2, tp 2.9, restart 0.9).
"""

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fp8stack.bench.evidence import device_slug, environment, markdown_table, provenance, write_evidence
from fp8stack.train.fault import KILL_AT_ENV
from fp8stack.train.timing import relative_spread, steady_state

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("fsdp", "tp", "restart")
TITLES = {"fsdp": "FSDP2 with FP8 all-gather", "tp": "tensor parallel 2", "restart": "kill a rank, restart"}
KEYS = {"fsdp": "fsdp", "tp": "tensor_parallel", "restart": "restart"}
"""Part -> its key in the evidence."""
LR, LR_WARMUP = 3e-4, 30
"""FSDP arms' peak LR and warm-up: the trainer's defaults (2e-3, 4) suit tiny; llama-1b-like then spikes and
the 2-rank vs 1-rank loss comparison would measure the instability, not the sharding."""
PROFILED_STEPS = 2
"""Steps whose collectives are counted: steps 1 and 2 (step 0 initialises lazily); with 30 or more steps the
step-time median skips them as warm-up (fp8stack.train.timing.steady_state)."""
ALL_GATHER_RATIO = 0.55
"""Issue 8: FP8 all-gather bytes per step at most this share of the BF16 all-gather's, judged over the
all-gathers of the transformer blocks, whose weights the FP8 all-gather carries. The root group's (embeddings,
final norm, output head) stay BF16 by plan rule 1 and weigh the same in both arms; the whole-model ratio is
reported beside it: 0.5 x (1 - s) + s for a root share s of the BF16 bytes, under 0.55 once s < 0.1."""
LOSS_RTOL = 0.01
"""|2-rank - 1-rank| / 1-rank of the mean loss over the last LOSS_WINDOW steps. Not zero: tensorwise FP8
scales activations and gradients by the amax of each rank's own micro-batch (1 rank: of both), and the
FP8 all-gather casts the FP32 shard where the BF16 arm casts the gathered BF16 weight, so the runs round
differently from the first step on. A sharding bug (a missing gradient reduction, wrong batches) moves the
loss by far more."""
LOSS_WINDOW = 50
"""Steps the loss comparison averages, at the end of the run. The 2-rank arms part from the 1-rank run by
chance as training amplifies rounding differences, FP8 and BF16 all-gather alike: after 30 steps (window 10)
by 2.4-3.4%, after 100 steps (window 20) by 0.4-0.8% in one run and 0.7-1.1% in the next. Hence 300 steps;
even there the BF16-all-gather control parted by 2.1% in the first such run (FP8 all-gather: 0.25%), so read
the check next to the control's gap, which the evidence prints. The second such run gave FP8 all-gather 1.05%,
BF16 control 0.31% (profiles/multigpu-second-run-h200.md); with the LR decayed to lr / 10 instead of to 2e-4,
1.57% and 0.60%. In all three runs the FP8 all-gather arm ended 0.7-1.8% below the BF16 all-gather arm: a
consistent sign, not yet explained (issue 8's note)."""
GRAD_NORM_RTOL = 0.02
"""Relative gap of the first step's gradient norm, 2 ranks vs 1 (same weights, same global batch: only the
rounding differs). A missing or doubled gradient reduction moves it by 50% or more."""
RESTART_RTOL_NONDETERMINISTIC = 1e-3
"""Restart tolerance when the pre-kill steps show that two identical runs already differ (nondeterministic
GPU kernels); otherwise the restarted losses must be bit-identical. A restart bug (lost Adam moments, a
wrong data position or LR step) moves the next losses by percents."""
RUN_TIMEOUT_S = 300
"""One launch/train.sh run that takes longer is killed and recorded as failed."""


@dataclass
class Run:
    """One launch/train.sh subprocess and what it left behind."""

    name: str
    """Label in the results."""
    command: str
    """The exact shell line, runnable from the repository root."""
    returncode: int | None
    """Exit status (None: killed after RUN_TIMEOUT_S)."""
    wall_s: float
    """Seconds from start to exit."""
    result: dict | None
    """Its TrainResult (--result-json), when it wrote one."""
    logged: list[dict] = field(default_factory=list)
    """train.jsonl records (rank 0, one per step, appended to by a resumed run)."""
    log_tail: str = ""
    """The end of its output when it failed."""


@dataclass
class Started:
    """A launch/train.sh subprocess on its way: what wait() needs to collect it."""

    name: str
    """Label in the results."""
    command: str
    """The exact shell line, runnable from the repository root."""
    process: subprocess.Popen
    """The torchrun process."""
    out: Path
    """Its folder: output.log, result.json, log/train.jsonl."""
    began: float
    """time.perf_counter() at its start."""
    timeout: float
    """Seconds from its start after which wait() kills it."""


def start(name: str, workdir: Path, nproc: int, flags: Sequence[str], env: dict | None = None,
          timeout: float = RUN_TIMEOUT_S) -> Started:
    """Start launch/train.sh with NPROC=nproc, writing under workdir/name; runs started together overlap."""
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    settings = {"NPROC": str(nproc), "MASTER_PORT": str(_free_port()),
                "PYTHON": os.environ.get("PYTHON", sys.executable), **(env or {})}
    argv = ["launch/train.sh", *flags, "--tensorboard-dir", str(out / "log"), "--result-json", str(out / "result.json")]
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items()) + " " + shlex.join(argv)
    print(f"[multigpu] {name}: {command}", flush=True)
    with open(out / "output.log", "w") as output:  # the child keeps its own handle
        process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **settings}, stdout=output,
                                   stderr=subprocess.STDOUT)
    return Started(name, command, process, out, time.perf_counter(), timeout)


def wait(started: Started) -> Run:
    """Wait for a started run (killed once its timeout from the start has passed) and read what it wrote."""
    try:
        returncode = started.process.wait(timeout=max(1.0, started.timeout - (time.perf_counter() - started.began)))
    except subprocess.TimeoutExpired:
        started.process.kill()
        started.process.wait()
        returncode = None
    wall = time.perf_counter() - started.began
    result_path, jsonl = started.out / "result.json", started.out / "log" / "train.jsonl"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    logged = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    tail = "" if returncode == 0 else (started.out / "output.log").read_text()[-3000:]
    print(f"[multigpu] {started.name}: exit {returncode} after {wall:.0f} s", flush=True)
    return Run(started.name, started.command, returncode, round(wall, 1), result, logged, tail)


def launch(name: str, workdir: Path, nproc: int, flags: Sequence[str], env: dict | None = None,
           timeout: float = RUN_TIMEOUT_S) -> Run:
    """Run launch/train.sh with NPROC=nproc to its end (see start)."""
    return wait(start(name, workdir, nproc, flags, env, timeout))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _mean_tail(losses: list[float]) -> float:
    return statistics.fmean(losses[-LOSS_WINDOW:])


def run_record(run: Run) -> dict:
    """What the evidence keeps of a run (every part's): command, status, and, when it wrote its result,
    its figures; the end of its output when it failed."""
    record = {"command": run.command, "returncode": run.returncode, "wall_s": run.wall_s}
    if run.result:
        ms = steady_state(run.result["step_ms"])
        record.update(losses=run.result["losses"], step_ms_median=statistics.median(ms),
                      step_ms_spread=relative_spread(ms), tokens_per_s=run.result["tokens_per_s"],
                      peak_mem_gib=run.result["peak_mem_gib"], world_size=run.result["world_size"],
                      device=run.result["device"], collectives=run.result.get("collectives"),
                      first_step=run.result["first_step"], plan_summary=run.result["plan_summary"],
                      grad_norms=run.result["grad_norms"])
    if run.log_tail:
        record["log_tail"] = run.log_tail
    return record


# --- part 1: FSDP2 with FP8 all-gather ----------------------------------------------------------

def fsdp_arms(steps: int, model: str, micro_batch: int, extra: Sequence[str]) -> dict[str, tuple[int, int, list[str]]]:
    """Arm -> (processes, steps, train flags)."""
    common = ["--model", model, "--fp8-recipe", "tensorwise", "--backend", "torchao", "--small-gemm-filter", "off",
              "--seed", "0", "--lr", str(LR), "--lr-warmup-iters", str(LR_WARMUP), "--eval-iters", "0",
              "--log-interval", "10", *extra]
    two = ["--micro-batch-size", str(micro_batch), "--profile-collectives", str(PROFILED_STEPS)]
    short = PROFILED_STEPS + 2  # the counts only: the first step, the profiled ones, one more
    arms = {
        "bf16_all_gather": (2, steps, [*two, "--no-fsdp-float8-all-gather"]),
        "fp8_all_gather": (2, steps, [*two, "--fsdp-float8-all-gather", "--precompute-fp8-scales"]),
        "fp8_all_gather_no_precompute": (2, short, [*two, "--fsdp-float8-all-gather", "--no-precompute-fp8-scales"]),
        "one_rank": (1, steps, ["--micro-batch-size", str(2 * micro_batch)]),
    }
    return {name: (nproc, n, [*common, "--train-iters", str(n), *flags]) for name, (nproc, n, flags) in arms.items()}


def run_fsdp(workdir: Path, steps: int, model: str = "llama-1b-like", micro_batch: int = 1,
             extra: Sequence[str] = ()) -> dict:
    """Part 1: bytes and counts of the collectives, step time and loss of each arm, and the checks."""
    planned = fsdp_arms(steps, model, micro_batch, extra)
    runs = {name: launch(name, workdir, nproc, flags) for name, (nproc, _, flags) in planned.items()}
    arms = {name: run_record(run) for name, run in runs.items()}
    base = {"model": model, "micro_batch_per_rank": micro_batch, "steps": steps, "profiled_steps": PROFILED_STEPS,
            "arms": arms, "commands": [run.command for run in runs.values()],
            "tolerances": {"all_gather_ratio": ALL_GATHER_RATIO, "loss_rtol": LOSS_RTOL, "loss_window": LOSS_WINDOW,
                           "first_grad_norm_rtol": GRAD_NORM_RTOL}}
    checks = {f"{name} ran {planned[name][1]} steps": bool(run.result) and len(run.result["losses"]) == planned[name][1]
              for name, run in runs.items()}
    if not all(checks.values()):
        return {**base, "checks": checks}

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
    first_norm = arms["one_rank"]["grad_norms"][0]
    grad_norm_gap = {n: abs(arms[n]["grad_norms"][0] - first_norm) / first_norm
                     for n in ("bf16_all_gather", "fp8_all_gather")}
    reference = _mean_tail(arms["one_rank"]["losses"])
    loss = {"one_rank": reference, **{n: _mean_tail(arms[n]["losses"]) for n in ("bf16_all_gather", "fp8_all_gather")}}
    loss_gap = {n: abs(loss[n] - reference) / reference for n in ("bf16_all_gather", "fp8_all_gather")}
    step_ms = {n: arms[n]["step_ms_median"] for n in ("bf16_all_gather", "fp8_all_gather")}
    checks.update({
        f"FP8 all-gather bytes <= {ALL_GATHER_RATIO}x BF16, transformer blocks (all FP8 weights)":
            gather["ratio_blocks"] <= ALL_GATHER_RATIO,
        "precompute: no per-weight scale all-reduce in the all-gathers, one all-reduce per step instead":
            precompute["scale_all_reduces_in_all_gathers"]["without"] > 0
            and precompute["scale_all_reduces_in_all_gathers"]["with"] == 0
            and precompute["precompute_all_reduces"] == 1,
        f"FP8 all-gather first gradient norm vs 1 rank within {GRAD_NORM_RTOL:.0%}":
            grad_norm_gap["fp8_all_gather"] <= GRAD_NORM_RTOL,
        f"FP8 all-gather loss vs 1 rank within {LOSS_RTOL:.0%}": loss_gap["fp8_all_gather"] <= LOSS_RTOL,
        "loss trains (final mean < first step)": loss["fp8_all_gather"] < arms["fp8_all_gather"]["losses"][0],
    })
    return {**base, "checks": checks, "all_gather": gather, "precompute": precompute, "loss_mean_last": loss,
            "loss_gap_vs_one_rank": loss_gap, "first_grad_norm_gap_vs_one_rank": grad_norm_gap, "step_ms": step_ms,
            "step_time_fp8_over_bf16_all_gather": step_ms["fp8_all_gather"] / step_ms["bf16_all_gather"]}


# --- part 3: kill a rank, restart from the checkpoint --------------------------------------------

def restart_plan(steps: int) -> tuple[int, int]:
    """(checkpoint interval, step at which rank 1 dies): after the first checkpoint, before the second,
    so interval - 1 steps are lost and trained again."""
    interval = max(2, steps // 3)
    if steps < 2 * interval:
        raise ValueError(f"restart needs at least {2 * interval} steps, got {steps}: raise --restart-steps")
    return interval, 2 * interval - 1


def run_restart(workdir: Path, steps: int, model: str = "tiny", micro_batch: int = 4,
                extra: Sequence[str] = ()) -> dict:
    """Part 3: uninterrupted vs killed-and-restarted, FSDP2 + torchao tensorwise with FP8 all-gather."""
    interval, kill_step = restart_plan(steps)
    saved = workdir / "checkpoints"
    flags = ["--model", model, "--fp8-recipe", "tensorwise", "--backend", "torchao", "--small-gemm-filter", "off",
             "--fsdp-float8-all-gather", "--precompute-fp8-scales", "--micro-batch-size", str(micro_batch),
             "--train-iters", str(steps), "--seed", "0", "--eval-iters", "0", *extra]
    checkpointed = [*flags, "--save", str(saved), "--save-interval", str(interval)]
    uninterrupted = launch("uninterrupted", workdir, 2, flags)
    killed = launch("killed", workdir, 2, checkpointed, env={KILL_AT_ENV: f"1:{kill_step}"})
    left = sorted(p.name for p in saved.glob("step-*")) if saved.exists() else []
    restarted = launch("restarted", workdir, 2, [*checkpointed, "--load", "latest"])

    base = {"model": model, "steps": steps, "checkpoint_interval": interval, "killed_rank": 1,
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

def run_tp_part(workdir: Path, steps: int | None) -> dict:
    """Part 2 (another module's work): its dict, or its failure recorded as a failed check."""
    from fp8stack.bench.multigpu_tp import STEPS, run_tp  # here: multigpu_tp imports this module

    try:
        return run_tp(workdir, steps or STEPS)
    except Exception:  # keep the other parts' evidence: the error is recorded, not dropped
        return {"checks": {"run_tp finished": False}, "error": traceback.format_exc()[-3000:]}


def render(payload: dict) -> str:
    """The evidence's Markdown: one section per part, its checks, then every launch command."""
    verdict = "PASS" if payload["passed"] else "FAIL"
    pending = f" Partial: not yet run: {', '.join(payload['pending'])}." if payload.get("pending") else ""
    sections = [f"Issue 8 on {payload['gpus']} GPU(s). Overall: **{verdict}**.{pending}\n"]
    renderers = {"fsdp": _render_fsdp, "tp": _render_tp, "restart": _render_restart}
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
    text = "## Tensor parallel 2 (fp8stack.bench.multigpu_tp)\n\n"
    if "arms" in part:
        text += (f"{part['model']}, sequence {part['seq_len']}, micro-batch {part['micro_batch']}, {part['steps']} "
                 f"steps per run; gaps are TP=2 vs TP=1, relative; the TP=1 runs shared the GPUs, so their "
                 f"tokens/s are not throughput figures.\n\n")
        rows = [[name, f"{c['loss_final_mean_tp1']:.4f}", f"{c['loss_final_mean_tp2']:.4f}",
                 f"{c['final_rel_gap']:.2%}", f"{c['early_max_rel_gap']:.2%}", f"{c['max_step_rel_gap']:.2%}",
                 f"{c['first_grad_norm_rel_gap']:.3%}",
                 f"{arm['tp1']['tokens_per_s']:,.0f} / {arm['tp2']['tokens_per_s']:,.0f}"]
                for name, arm in part["arms"].items() if (c := arm.get("comparison"))]
        text += markdown_table(["arm", "final mean TP=1", "final mean TP=2", "final gap", "first steps' max gap",
                                "any step's max gap", "first grad-norm gap", "tokens/s TP=1 / TP=2"], rows) + "\n"
    return text + _render_checks(part) + (f"\nerror: {part['error']}\n" if "error" in part else "")


def _render_checks(part: dict) -> str:
    return markdown_table(["check", "result"], [[name, "pass" if ok else "**FAIL**"]
                                                for name, ok in part["checks"].items()])


def _gb(value: float) -> str:
    return f"{value / 1e9:.3f}"


def _render_fsdp(part: dict) -> str:
    text = (f"## FSDP2 + torchao tensorwise, {part['model']}, micro-batch {part['micro_batch_per_rank']} per rank, "
            f"{part['steps']} steps\n\n")
    rows = []
    for name, arm in part["arms"].items():
        if "losses" not in arm:
            rows.append([name, "-", "-", "-", "-", "-", "-", f"exit {arm['returncode']}"])
            continue
        comm = arm["collectives"] or {"counts": {}, "bytes": {}, "all_reduces_in_all_gather": 0}
        rows.append([name, arm["world_size"], _gb(comm["bytes"].get("all_gather", 0)) if comm["bytes"] else "-",
                     f"{comm['counts'].get('all_gather', 0):g}",
                     f"{comm['counts'].get('all_reduce', 0):g} ({comm['all_reduces_in_all_gather']:g})",
                     f"{arm['step_ms_median']:.1f} ± {arm['step_ms_spread']:.1%}", f"{arm['tokens_per_s']:,.0f}",
                     f"{_mean_tail(arm['losses']):.4f}"])
    text += markdown_table(["arm", "ranks", "all-gather GB/step", "all-gathers/step",
                            "all-reduces/step (in all-gathers)", "step ms (median ± IQR)", "tokens/s",
                            f"loss, mean of last {LOSS_WINDOW}"], rows)
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
                 f"Loss gap vs 1 rank x micro-batch {2 * part['micro_batch_per_rank']} (same global batches): FP8 "
                 f"all-gather {part['loss_gap_vs_one_rank']['fp8_all_gather']:.3%}, BF16 all-gather "
                 f"{part['loss_gap_vs_one_rank']['bf16_all_gather']:.3%} (tolerance {LOSS_RTOL:.0%}); first step's "
                 f"gradient norm: FP8 all-gather {part['first_grad_norm_gap_vs_one_rank']['fp8_all_gather']:.3%}, "
                 f"BF16 all-gather {part['first_grad_norm_gap_vs_one_rank']['bf16_all_gather']:.3%} (tolerance "
                 f"{GRAD_NORM_RTOL:.0%}). Step time, FP8 "
                 f"over BF16 all-gather: {part['step_time_fp8_over_bf16_all_gather']:.3f}x.\n")
    return text + "\n" + _render_checks(part)


def _render_restart(part: dict) -> str:
    text = (f"## Kill rank 1, restart from the checkpoint ({part['model']}, FSDP2 + torchao tensorwise, FP8 "
            f"all-gather, 2 ranks, {part['steps']} steps)\n\nCheckpoint every {part['checkpoint_interval']} steps; "
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
    parser.add_argument("--steps", type=int, default=300, help="steps of the fsdp arms")
    parser.add_argument("--tp-steps", type=int, help="steps of each tensor-parallel run (default multigpu_tp.STEPS)")
    parser.add_argument("--restart-steps", type=int, default=30, help="steps of the restart runs")
    parser.add_argument("--model", default="llama-1b-like", help="model of the fsdp part")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="per rank, fsdp part")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="passed to every fsdp/restart run (default: auto)")
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    parser.add_argument("--keep-other-parts", action="store_true",
                        help="keep the parts not run now from the existing evidence file (each part records its "
                             "own date and command), e.g. to rerun one part")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if not parts:
        parser.error(f"--parts is empty: name some of {','.join(PARTS)}")
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: use a subset of {','.join(PARTS)}")
    extra = ("--device", args.device) if args.device else ()

    import torch

    began = time.perf_counter()
    payload: dict = {"parts": parts, "gpus": torch.cuda.device_count()}
    if args.keep_other_parts:
        payload.update(earlier_parts(parts, args.out_dir))
    steps = {"fsdp": lambda workdir: run_fsdp(workdir, args.steps, args.model, args.micro_batch_size, extra),
             "tp": lambda workdir: run_tp_part(workdir, args.tp_steps),
             "restart": lambda workdir: run_restart(workdir, args.restart_steps, extra=extra)}
    todo = [part for part in PARTS if part in parts]
    with tempfile.TemporaryDirectory(prefix="fp8stack-multigpu-") as scratch:
        workdir = args.workdir or Path(scratch)
        for index, part in enumerate(todo):
            print(f"[multigpu] part {part}: {TITLES[part]}", flush=True)
            payload[KEYS[part]] = steps[part](workdir / part)
            payload[KEYS[part]]["measured"] = provenance()
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
    return write_evidence(f"multigpu-{device_slug()}", payload, render(payload), out_dir)


if __name__ == "__main__":
    sys.exit(main())
