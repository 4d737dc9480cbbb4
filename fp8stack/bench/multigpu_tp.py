"""Tensor parallel 2: does a TP=2 run train like the TP=1 run of the same model, seed and batches?

    python -m fp8stack.bench.multigpu_tp [--steps 600] [--dp 1] [--workdir DIR]   # prints run_tp's dict as JSON

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

With data parallelism (dp > 1: --dp here, --tp-dp in fp8stack.bench.multigpu) the TP=2 runs take NPROC=2 x dp,
data-parallel ranks over TP pairs of consecutive ranks (megatron's parallel state and the trainer's (dp, tp) mesh
agree: data-parallel rank = rank // 2): megatron's DDP on the Megatron path, FSDP2 over the mesh's dp dimension on the
plain path (its mixed precision keeps BF16 parameters). Each step's global batch is dp x MICRO_BATCH sequences and
data-parallel rank r trains on the r-th MICRO_BATCH of them (fp8stack.train.data). The TP=1 twin, on one GPU, reads
that global batch (--global-batch-size) in dp micro-batches of MICRO_BATCH whose gradients it accumulates: the same
sequences in the same groups, so tensorwise scaling takes each group's amax as the data-parallel ranks do, and its
mean loss is the ranks' mean. The torchao twin runs FSDP2 over one rank (--data-parallel-one-rank), the data-parallel
run's precision policy (as fp8stack.bench.multigpu's ONE_RANK_TWINS).
"""

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, LOSS_STEPS, LR, LR_WARMUP,
                                     compare_losses, loss_checks, run_record, start, wait)
from fp8stack.train.launch import on_gpu

MODEL, SEQ, MICRO_BATCH = "llama-1b-like", 1024, 4
TP = 2
"""The tensor-parallel degree compared with TP=1."""


@dataclass(frozen=True)
class Arm:
    """One model/recipe trained at TP=1 and TP=2."""

    name: str
    """Label in the results."""
    flags: tuple[str, ...]
    """python -m fp8stack.train flags besides the shared ones."""
    twin_flags: tuple[str, ...] = ()
    """Flags the TP=1 twin of a data-parallel run adds, so that it runs that run's precision policy."""


ARMS = (
    Arm("megatron-te-tensorwise", ("--model-impl", "megatron", "--fp8-recipe", "tensorwise")),
    Arm("megatron-te-delayed", ("--model-impl", "megatron", "--fp8-recipe", "delayed")),
    Arm("torchao-tensorwise", ("--no-fused-projections", "--backend", "torchao", "--fp8-recipe", "tensorwise",
                               "--small-gemm-filter", "off"), twin_flags=("--data-parallel-one-rank",)),
)


def train_flags(arm: Arm, tp: int, steps: int, seed: int = 0, dp: int = 1, model: str = MODEL, seq_len: int = SEQ,
                micro_batch: int = MICRO_BATCH) -> list[str]:
    """launch/train.sh arguments of one run (launches.start adds where it writes): the TP=tp run of a comparison at
    data-parallel degree dp, on processes(tp, dp). With dp > 1 both runs name the global batch, dp micro-batches:
    one per data-parallel rank, or all of them accumulated by the TP=1 twin."""
    batch = ["--global-batch-size", str(global_batch(dp, micro_batch))] if dp > 1 else []
    twin = list(arm.twin_flags) if dp > 1 and tp == 1 else []
    return ["--model", model, "--seq-length", str(seq_len), "--micro-batch-size", str(micro_batch), *batch,
            "--train-iters", str(steps), "--lr", str(LR), "--lr-warmup-iters", str(LR_WARMUP), "--seed", str(seed),
            "--eval-iters", "0", "--tensor-model-parallel-size", str(tp), *arm.flags, *twin, "--log-interval", "50"]


def global_batch(dp: int, micro_batch: int = MICRO_BATCH) -> int:
    """Sequences per step of a comparison at data-parallel degree dp: one micro-batch per data-parallel rank."""
    return dp * micro_batch


def processes(tp: int, dp: int) -> int:
    """Processes (GPUs) of the TP=tp run of a comparison at data-parallel degree dp: the TP=1 twin runs on one."""
    return tp * dp if tp > 1 else 1


def label(dp: int) -> str:
    """The tensor-parallel run's name in checks and tables."""
    return f"TP={TP}" if dp == 1 else f"TP={TP} x DP={dp}"


def run_tp(workdir: Path, steps: int, seed: int = 0, dp: int = 1) -> dict:
    """Train every arm at TP=1 and TP=2 (x DP=dp) through launch/train.sh and compare their losses per step."""
    import torch

    workdir = Path(workdir)
    gpus, needed = torch.cuda.device_count(), processes(TP, dp)
    base = {"model": MODEL, "seq_len": SEQ, "micro_batch": MICRO_BATCH, "data_parallel": dp, "gpus_per_run": needed,
            "global_batch": global_batch(dp), "steps": steps, "seed": seed,
            "tolerances": {"loss_rtol": LOSS_RTOL, "first_loss_rtol": FIRST_LOSS_RTOL,
                           "first_grad_norm_rtol": GRAD_NORM_RTOL}}
    if gpus < needed:
        return {**base, "checks": {f"{needed} GPUs visible": False},
                "error": f"{gpus} CUDA GPU(s) visible: run on {needed}"}
    # TP=1 runs side by side, spread over the TP runs' GPUs (losses, not times, are compared); then the TP runs in turn.
    started = [start(f"{arm.name}-tp1", workdir, 1, train_flags(arm, 1, steps, seed, dp),
                     on_gpu(i % needed)) for i, arm in enumerate(ARMS)]
    runs = {(arm.name, 1): run_record(wait(run)) for arm, run in zip(ARMS, started)}
    name = f"tp{TP}" if dp == 1 else f"tp{TP}-dp{dp}"
    for arm in ARMS:
        runs[arm.name, TP] = run_record(wait(start(f"{arm.name}-{name}", workdir, needed,
                                                   train_flags(arm, TP, steps, seed, dp))))
    arms, checks = judge(runs, steps, dp)
    commands = [run["command"] for run in runs.values()]
    return {**base, "checks": checks, "arms": arms, "commands": commands}


def judge(runs: dict[tuple[str, int], dict], steps: int, dp: int = 1) -> tuple[dict, dict]:
    """(arms, checks) from the summaries of every arm's TP=1 and TP=2 runs, keyed (arm name, TP degree); dp: the TP=2
    runs' data-parallel degree."""
    arms, checks, parallel = {}, {}, label(dp)
    for arm in ARMS:
        tp1, tp2 = runs[arm.name, 1], runs[arm.name, TP]
        kept = arms[arm.name] = {"tp1": tp1, "tp2": tp2}
        ran = (tp1["returncode"] == tp2["returncode"] == 0 and "losses" in tp1 and "losses" in tp2
               and len(tp1["losses"]) == len(tp2["losses"]) == steps)
        checks[f"{arm.name}: TP=1 and {parallel} ran {steps} steps"] = ran
        if not ran:
            continue
        gaps = kept["comparison"] = compare_losses(tp1, tp2)
        ranks = processes(TP, dp)
        checks[f"{arm.name}: {parallel} ran on {ranks} ranks with FP8 GEMMs"] = (
            tp2["world_size"] == ranks and tp2["plan_summary"]["fp8_gemms"] > 0)
        checks.update(loss_checks(f"{arm.name}, {parallel} vs TP=1", gaps))
    return arms, checks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=LOSS_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp", type=int, default=1, help=f"data-parallel degree of the TP={TP} runs ({TP} x dp GPUs)")
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.dp < 1:
        parser.error(f"--dp {args.dp}: pass a data-parallel degree of 1 or more")
    with tempfile.TemporaryDirectory(prefix="fp8stack-tp-") as scratch:
        print(json.dumps(run_tp(args.workdir or Path(scratch), args.steps, args.seed, args.dp), indent=2))


if __name__ == "__main__":
    main()
