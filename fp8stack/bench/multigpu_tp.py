"""Issue 8, tensor parallel 2: does a TP=2 run train like the TP=1 run of the same model, seed and batches?

    python -m fp8stack.bench.multigpu_tp [--steps 200] [--workdir DIR]     # prints run_tp's dict as JSON

Arms, each trained once with NPROC=1 and once with NPROC=2 --tensor-model-parallel-size 2 by launch/train.sh:
- megatron-te-tensorwise, megatron-te-delayed: a megatron-core GPTModel through fp8stack's block factory,
  TE FP8 linears, megatron's TP with sequence parallelism (--model-impl megatron);
- torchao-tensorwise: the plain Llama with unfused projections, torchao tensorwise Float8Linear, sharded by
  fp8stack.assembly.apply_tp with Float8ColwiseParallel / Float8RowwiseParallel.

Model: llama-1b-like (4 layers of Llama-3-8B width: hidden 4096, ffn 14336) at sequence 1024, micro-batch 4.
Its GEMMs per rank at TP=2 (2048-3072 wide) are the shapes TP is used for, and the runs stay short (about
50 ms a step on an H200; process start-up, imports, NCCL and the CPU weight init, takes longer than the
steps). The tiny model would also satisfy TE's multiples of 16, but its GEMMs are too small to say anything
about FP8 at TP. LR schedule: the FSDP part's (multigpu.LR, LR_WARMUP). The TP=1 runs of all arms start
together (one per GPU, two on one), then the TP=2 runs one after another: about 3 minutes on two H200s.

Both TP degrees start from the same weights (megatron: the plain Llama's, copied shard by shard by
train.megatron_model.load_llama_weights; plain Llama: one full init that apply_tp shards) and read the same
batches. What may differ: TE's current scaling scales each weight shard by its own amax where TP=1 has one
scale (delayed scaling reduces amaxes over the TP group; torchao's Float8 styles scale the whole DTensor), and
sums run in another order. A TP bug (a missing gradient reduction, a wrong shard layout) moves the gradient
norm at the first step by far more than that; the losses, once training amplifies the rounding differences,
part by chance too (see STEPS and EARLY_STEPS for what the runs measured).
"""

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fp8stack.bench.multigpu import LR, LR_WARMUP, run_record, start, wait

MODEL, SEQ, MICRO_BATCH = "llama-1b-like", 1024, 4
STEPS = 200
"""Steps per run. Measured end-of-run gaps (profiles/multigpu-h200.md and its git history): at 50 steps with a
5-step warm-up 4.4% (megatron delayed), 0.7% (megatron tensorwise), 0.0007% (torchao); at 200 steps with the
FSDP part's 30-step warm-up and LR decayed to lr / 10, 0.2%, 2.3% and 2.0% (TP=2 above TP=1 for megatron
tensorwise, below for torchao). Runs that differ only in rounding settle 1-2% apart at these horizons, in
either direction, so FINAL_RTOL is tighter than the noise here (issue 8's note)."""
FINAL_RTOL = 0.01
"""|mean loss TP=2 - mean loss TP=1| / mean loss TP=1 over the last quarter of the steps."""
EARLY_STEPS, EARLY_RTOL = 5, 0.01
"""Each of the first EARLY_STEPS losses within EARLY_RTOL (relative). A TP bug (a missing gradient reduction, a
wrong shard layout) shows from the first steps on; later steps part by chance as well, because training
amplifies rounding differences (mid-run, megatron's TP=1 and TP=2 curves parted by up to 10% at single steps
and met again by the end), so those are judged through the final mean only. Adam's first steps are nearly
sign steps and amplify rounding differences too: at 200 steps / warm-up 30 the tensorwise arms parted by 5% at
step 4 (delayed: 0.02%), where the 50-step / warm-up 5 run kept every arm within 0.45%."""
GRAD_NORM_RTOL = 0.02
"""Relative gap of the first step's gradient norm (same weights, same batch: only FP8 rounding differs)."""
RUN_TIMEOUT_S = 240
"""One launch/train.sh run (start-up included) that takes longer is killed and recorded as failed."""


@dataclass(frozen=True)
class Arm:
    """One model/recipe trained at TP=1 and TP=2."""

    name: str
    """Label in the results."""
    flags: tuple[str, ...]
    """python -m fp8stack.train flags besides the shared ones."""


ARMS = (
    Arm("megatron-te-tensorwise", ("--model-impl", "megatron", "--fp8-recipe", "tensorwise")),
    Arm("megatron-te-delayed", ("--model-impl", "megatron", "--fp8-recipe", "delayed")),
    Arm("torchao-tensorwise", ("--no-fused-projections", "--backend", "torchao", "--fp8-recipe", "tensorwise",
                               "--small-gemm-filter", "off")),
)


def train_flags(arm: Arm, tp: int, steps: int) -> list[str]:
    """launch/train.sh arguments of one run (multigpu.start adds where it writes)."""
    return ["--model", MODEL, "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(steps), "--lr", str(LR), "--lr-warmup-iters", str(LR_WARMUP), "--seed", "0",
            "--eval-iters", "0", "--tensor-model-parallel-size", str(tp), *arm.flags, "--log-interval", "10"]


def compare(tp1: dict, tp2: dict) -> dict:
    """Relative gaps of TP=2 against TP=1 (see the tolerances above)."""
    a, b = tp1["losses"], tp2["losses"]
    gaps = [abs(y - x) / x for x, y in zip(a, b)]
    window = max(1, len(a) // 4)
    mean1, mean2 = sum(a[-window:]) / window, sum(b[-window:]) / window
    g1, g2 = tp1["grad_norms"][0], tp2["grad_norms"][0]
    return {"max_step_rel_gap": max(gaps), "early_max_rel_gap": max(gaps[:EARLY_STEPS]),
            "final_rel_gap": abs(mean2 - mean1) / mean1, "final_window": window,
            "first_grad_norm_rel_gap": abs(g2 - g1) / g1, "loss_first": a[0], "loss_final_mean_tp1": mean1,
            "loss_final_mean_tp2": mean2}


def run_tp(workdir: Path, steps: int) -> dict:
    """Train every arm at TP=1 and TP=2 through launch/train.sh and compare their losses per step."""
    import torch

    workdir = Path(workdir)
    began = time.perf_counter()
    gpus = torch.cuda.device_count()
    base = {"model": MODEL, "seq_len": SEQ, "micro_batch": MICRO_BATCH, "steps": steps,
            "tolerances": {"final_rel_gap": FINAL_RTOL, "early_steps": EARLY_STEPS, "early_rel_gap": EARLY_RTOL,
                           "first_grad_norm_rel_gap": GRAD_NORM_RTOL}}
    if gpus < 2:
        return {**base, "checks": {"two GPUs visible": False}, "error": f"{gpus} CUDA GPU(s) visible: run on two"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    # TP=1 runs side by side, spread over two GPUs (losses, not times, are compared); then the TP=2 runs in turn.
    started = [start(f"{arm.name}-tp1", workdir, 1, train_flags(arm, 1, steps), {"CUDA_VISIBLE_DEVICES": ids[i % 2]},
                     RUN_TIMEOUT_S) for i, arm in enumerate(ARMS)]
    runs = {(arm.name, 1): run_record(wait(run)) for arm, run in zip(ARMS, started)}
    for arm in ARMS:
        runs[arm.name, 2] = run_record(wait(start(f"{arm.name}-tp2", workdir, 2, train_flags(arm, 2, steps),
                                               timeout=RUN_TIMEOUT_S)))
    arms, checks = judge(runs, steps)
    commands = [run["command"] for run in runs.values()]
    return {**base, "checks": checks, "arms": arms, "commands": commands,
            "wall_s": round(time.perf_counter() - began, 1)}


def judge(runs: dict[tuple[str, int], dict], steps: int) -> tuple[dict, dict]:
    """(arms, checks) from the summaries of every arm's TP=1 and TP=2 runs, keyed (arm name, TP degree)."""
    arms, checks = {}, {}
    for arm in ARMS:
        tp1, tp2 = runs[arm.name, 1], runs[arm.name, 2]
        kept = arms[arm.name] = {"tp1": tp1, "tp2": tp2}
        ran = (tp1["returncode"] == tp2["returncode"] == 0 and "losses" in tp1 and "losses" in tp2
               and len(tp1["losses"]) == len(tp2["losses"]) == steps)
        checks[f"{arm.name}: TP=1 and TP=2 ran {steps} steps"] = ran
        if not ran:
            continue
        gaps = kept["comparison"] = compare(tp1, tp2)
        checks[f"{arm.name}: TP=2 ran on 2 ranks with FP8 GEMMs"] = (
            tp2["world_size"] == 2 and tp2["plan_summary"]["fp8_gemms"] > 0)
        checks[f"{arm.name}: loss trains (final mean < first)"] = (
            max(gaps["loss_final_mean_tp1"], gaps["loss_final_mean_tp2"]) < gaps["loss_first"])
        checks[f"{arm.name}: final loss gap <= {FINAL_RTOL:.0%}"] = gaps["final_rel_gap"] <= FINAL_RTOL
        checks[f"{arm.name}: first {EARLY_STEPS} steps' loss gaps <= {EARLY_RTOL:.0%}"] = (
            gaps["early_max_rel_gap"] <= EARLY_RTOL)
        checks[f"{arm.name}: first grad-norm gap <= {GRAD_NORM_RTOL:.0%}"] = (
            gaps["first_grad_norm_rel_gap"] <= GRAD_NORM_RTOL)
    return arms, checks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fp8stack-tp-") as scratch:
        print(json.dumps(run_tp(args.workdir or Path(scratch), args.steps), indent=2))


if __name__ == "__main__":
    main()
