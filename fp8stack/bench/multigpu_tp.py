"""Tensor parallel 2: does a TP=2 run train like the TP=1 run of the same model, seed and batches?

    python -m fp8stack.bench.multigpu_tp [--steps 600] [--workdir DIR]     # prints run_tp's dict as JSON

Arms, each trained once with NPROC=1 and once with NPROC=2 --tensor-model-parallel-size 2 by launch/train.sh:
- megatron-te-tensorwise, megatron-te-delayed: a megatron-core GPTModel through fp8stack's block factory,
  TE FP8 linears, megatron's TP with sequence parallelism (--model-impl megatron);
- torchao-tensorwise: the plain Llama with unfused projections, torchao tensorwise Float8Linear, sharded by
  fp8stack.assembly.apply_tp with Float8ColwiseParallel / Float8RowwiseParallel.

Model: llama-1b-like (4 layers of Llama-3-8B width: hidden 4096, ffn 14336) at sequence 1024, micro-batch 4.
Its GEMMs per rank at TP=2 (2048-3072 wide) are the shapes TP is used for, and the runs stay short (about
50 ms a step on an H200; process start-up, imports, NCCL and the CPU weight init, takes longer than the
steps). The tiny model would also satisfy TE's multiples of 16, but its GEMMs are too small to say anything
about FP8 at TP. LR schedule and steps: the FSDP part's (launches.LR, LR_WARMUP, LOSS_STEPS). The TP=1 runs of all
arms start together (one per GPU, two on one), then the TP=2 runs one after another.

Both TP degrees start from the same weights (megatron: the plain Llama's, copied shard by shard by
train.megatron_model.load_llama_weights; plain Llama: one full init that apply_tp shards) and read the same
batches. What may differ: TE's current scaling scales each weight shard by its own amax where TP=1 has one
scale (delayed scaling reduces amaxes over the TP group; torchao's Float8 styles scale the whole DTensor), and
sums run in another order. A TP bug (a missing gradient reduction, a wrong shard layout) moves the first step's
loss or gradient norm by far more than that; later steps are judged through the final mean only
(launches.compare_losses): Adam's first steps are nearly sign steps and amplify rounding differences, so at a 30-step
warm-up to 3e-4 the tensorwise arms parted by 5% at step 4 while delayed stayed within 0.02%, and all arms' losses
met again later (the git history of profiles/runs/2026-11-22-multigpu-h200/multigpu-h200.md).
"""

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, LOSS_STEPS, LR, LR_WARMUP,
                                     compare_losses, loss_checks, run_record, start, wait)

MODEL, SEQ, MICRO_BATCH = "llama-1b-like", 1024, 4


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


def train_flags(arm: Arm, tp: int, steps: int, seed: int = 0) -> list[str]:
    """launch/train.sh arguments of one run (launches.start adds where it writes)."""
    return ["--model", MODEL, "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
            "--train-iters", str(steps), "--lr", str(LR), "--lr-warmup-iters", str(LR_WARMUP), "--seed", str(seed),
            "--eval-iters", "0", "--tensor-model-parallel-size", str(tp), *arm.flags, "--log-interval", "50"]


def run_tp(workdir: Path, steps: int, seed: int = 0) -> dict:
    """Train every arm at TP=1 and TP=2 through launch/train.sh and compare their losses per step."""
    import torch

    workdir = Path(workdir)
    gpus = torch.cuda.device_count()
    base = {"model": MODEL, "seq_len": SEQ, "micro_batch": MICRO_BATCH, "steps": steps, "seed": seed,
            "tolerances": {"loss_rtol": LOSS_RTOL, "first_loss_rtol": FIRST_LOSS_RTOL,
                           "first_grad_norm_rtol": GRAD_NORM_RTOL}}
    if gpus < 2:
        return {**base, "checks": {"two GPUs visible": False}, "error": f"{gpus} CUDA GPU(s) visible: run on two"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    # TP=1 runs side by side, spread over two GPUs (losses, not times, are compared); then the TP=2 runs in turn.
    started = [start(f"{arm.name}-tp1", workdir, 1, train_flags(arm, 1, steps, seed),
                     {"CUDA_VISIBLE_DEVICES": ids[i % 2]}) for i, arm in enumerate(ARMS)]
    runs = {(arm.name, 1): run_record(wait(run)) for arm, run in zip(ARMS, started)}
    for arm in ARMS:
        runs[arm.name, 2] = run_record(wait(start(f"{arm.name}-tp2", workdir, 2, train_flags(arm, 2, steps, seed))))
    arms, checks = judge(runs, steps)
    commands = [run["command"] for run in runs.values()]
    return {**base, "checks": checks, "arms": arms, "commands": commands}


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
        gaps = kept["comparison"] = compare_losses(tp1, tp2)
        checks[f"{arm.name}: TP=2 ran on 2 ranks with FP8 GEMMs"] = (
            tp2["world_size"] == 2 and tp2["plan_summary"]["fp8_gemms"] > 0)
        checks.update(loss_checks(f"{arm.name}, TP=2 vs TP=1", gaps))
    return arms, checks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=LOSS_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fp8stack-tp-") as scratch:
        print(json.dumps(run_tp(args.workdir or Path(scratch), args.steps, args.seed), indent=2))


if __name__ == "__main__":
    main()
