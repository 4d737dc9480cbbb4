"""Launching launch/train.sh runs and comparing their losses: what the multi-GPU evidence's parts share
(fp8stack.bench.multigpu's FSDP and restart parts, fp8stack.bench.multigpu_tp's tensor parallel part)."""

import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fp8stack.train.launch import stop
from fp8stack.train.timing import relative_spread, steady_state

ROOT = Path(__file__).resolve().parents[2]
"""The repository root, where launch/train.sh runs from."""
LR, LR_WARMUP = 1e-4, 60
"""Peak LR and warm-up of every loss comparison here (FSDP and TP). At 3e-4 / 30 steps, llama-1b-like on these
4-8k-token batches spiked (single-step losses 15% above the neighbours'), and a spike in one run and not in its
twin left the two 1-3% apart for a hundred steps: runs that differ only in rounding parted by 1-2.3% at 200-300
steps, in either direction, FP8 and BF16 all-gather alike (profiles/archive/2026-11-22-multigpu-second-h200/ and
the git history of profiles/runs/2026-11-22-multigpu-h200/multigpu-h200.md). A lower LR and a longer warm-up make
Adam's first, nearly sign-like steps (where rounding differences are amplified most) smaller and spikes rarer;
single steps still part by up to 16% (max_step_rel_gap), which is why only the first step and the last quarter's
mean are judged."""
LOSS_STEPS = 600
"""Steps of every run whose loss is compared: long enough for the LR to decay to lr / 10 and the curve to flatten,
so that the mean over the last quarter measures where the run ended, not a spike on the way there."""
LOSS_RTOL = 0.01
"""|run - reference| / reference of the mean loss over the last quarter of the steps (final_window). Not zero:
tensorwise FP8 scales activations and gradients by the amax of each rank's own micro-batch (or TP shard), and
sums run in another order, so the runs round differently from the first step on and training amplifies that. A
sharding bug (a missing gradient reduction, wrong batches or shards) moves the loss by far more."""
FIRST_LOSS_RTOL = 1e-3
"""Relative gap of the first step's loss: the same weights and batch, so only the forward's rounding differs
(measured: at most 0.04% over every run so far). A wrong shard layout or batch split shows here before any update."""
GRAD_NORM_RTOL = 0.02
"""Relative gap of the first step's gradient norm (same weights, same global batch: only the rounding differs;
measured: at most 0.17%). A missing or doubled gradient reduction moves it by 50% or more."""
RUN_TIMEOUT_S = 420
"""One launch/train.sh run that takes longer is killed and recorded as failed."""


@dataclass
class Run:
    """One launch/train.sh subprocess and what it left behind."""

    name: str
    """Label in the results."""
    command: str
    """The exact shell line, runnable from the repository root."""
    returncode: int | None
    """Exit status (None: stopped after RUN_TIMEOUT_S)."""
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
    """Wait for a started run (stopped once its timeout from the start has passed: launch.stop) and read what it
    wrote."""
    try:
        returncode = started.process.wait(timeout=max(1.0, started.timeout - (time.perf_counter() - started.began)))
    except subprocess.TimeoutExpired:
        stop(started.process)
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


def final_window(steps: int) -> int:
    """Steps the final loss averages: the last quarter of the run."""
    return max(1, steps // 4)


def final_mean(losses: list[float]) -> float:
    """Mean loss over the last quarter of the steps (final_window)."""
    return statistics.fmean(losses[-final_window(len(losses)):])


def compare_losses(reference: dict, run: dict) -> dict:
    """Relative gaps of a run against its reference (run records of the same model, weights, batches and steps):
    first step's loss and gradient norm, final mean (judged against LOSS_RTOL, FIRST_LOSS_RTOL, GRAD_NORM_RTOL),
    and the largest single-step gap (reported only: single steps part by chance mid-run)."""
    a, b = reference["losses"], run["losses"]
    final_a, final_b = final_mean(a), final_mean(b)
    g1, g2 = reference["grad_norms"][0], run["grad_norms"][0]
    return {"first_loss_rel_gap": abs(b[0] - a[0]) / a[0], "first_grad_norm_rel_gap": abs(g2 - g1) / g1,
            "final_rel_gap": abs(final_b - final_a) / final_a, "final_window": final_window(len(a)),
            "max_step_rel_gap": max(abs(y - x) / x for x, y in zip(a, b)), "loss_first": a[0],
            "loss_final_mean_reference": final_a, "loss_final_mean": final_b}


def loss_checks(label: str, gaps: dict) -> dict[str, bool]:
    """The checks every loss comparison makes (TP and FSDP), named after `label`."""
    return {
        f"{label}: first step's loss within {FIRST_LOSS_RTOL:.1%}": gaps["first_loss_rel_gap"] <= FIRST_LOSS_RTOL,
        f"{label}: first step's gradient norm within {GRAD_NORM_RTOL:.0%}":
            gaps["first_grad_norm_rel_gap"] <= GRAD_NORM_RTOL,
        f"{label}: mean loss of the last {gaps['final_window']} steps within {LOSS_RTOL:.0%}":
            gaps["final_rel_gap"] <= LOSS_RTOL,
        f"{label}: loss trains (final mean < first step)":
            max(gaps["loss_final_mean_reference"], gaps["loss_final_mean"]) < gaps["loss_first"],
    }


def run_record(run: Run) -> dict:
    """What the evidence keeps of a run (every part's): command, status, and, when it wrote its result,
    its figures; the end of its output when it failed."""
    record = {"command": run.command, "returncode": run.returncode, "wall_s": run.wall_s}
    if run.result:
        ms = steady_state(run.result["step_ms"])
        record.update(losses=run.result["losses"], step_ms_median=statistics.median(ms),
                      step_ms_spread=relative_spread(ms), tokens_per_s=run.result["tokens_per_s"],
                      peak_mem_gib=run.result["peak_mem_gib"], resident_mem_gib=run.result.get("resident_mem_gib"),
                      world_size=run.result["world_size"],
                      device=run.result["device"], collectives=run.result.get("collectives"),
                      first_step=run.result["first_step"], plan_summary=run.result["plan_summary"],
                      grad_norms=run.result["grad_norms"])
    if run.log_tail:
        record["log_tail"] = run.log_tail
    return record
