"""`python -m fp8stack.bench.data_parallel`: the fast path on one GPU unwrapped, under DDP and under FSDP2 (each
over a 1-rank process group: the data-parallel code paths, collectives included, without a second GPU).

    python -m fp8stack.bench.data_parallel [--arms unwrapped,ddp,fsdp,fsdp_fp8_params] [--steps 40]

Every arm is a launch/train.sh run (NPROC=1) of the same model, recipe, batches and seed with the configuration's
defaults otherwise (the measured fast path: BF16 parameters with FP32 masters, TE's fused weight-gradient
accumulation where the wrapper allows it, compile, cuDNN attention), plus:
- ddp: --parallelism.data-parallel ddp --parallelism.data-parallel-one-rank (FP32 main_grads averaged per step);
- fsdp: --parallelism.data-parallel fsdp --parallelism.data-parallel-one-rank (FSDP2's mixed precision: sharded FP32
  parameters, BF16 all-gathered copies; TE cannot fuse weight-gradient accumulation under it);
- fsdp_fp8_params: fsdp with --param-dtype fp8 (TE weights held in FP8 and all-gathered in FP8);
- fsdp_gather_once, fsdp_fp8_params_gather_once: those with --no-parallelism.fsdp-reshard-after-forward (the gathered
  parameters kept from forward to backward and across a step's micro-batches: one all-gather per step).
Over one rank FSDP2 copies its shards in without a collective, so the profiler counts no all-gather bytes there; the
all-gather check runs where it does (2+ ranks), and tests/gpu/test_fsdp_te_gpu.py checks FP8 inputs at one.
Collectives are counted over PROFILED_STEPS steps (fp8stack.train.comm_stats). The evidence, profiles/runs/<date>-
data-parallel-<gpu>/, holds tokens/s, peak memory, bytes, losses, the checks and every launch command.
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fp8stack.ab import comma_separated
from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, compare_losses, launch, run_record)
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence

ARMS = {"unwrapped": [],
        "ddp": ["--parallelism.data-parallel", "ddp", "--parallelism.data-parallel-one-rank"],
        "fsdp": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank"],
        "fsdp_fp8_params": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                            "--param-dtype", "fp8"],
        "fsdp_gather_once": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                             "--no-parallelism.fsdp-reshard-after-forward"],
        "fsdp_fp8_params_gather_once": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                                        "--param-dtype", "fp8", "--no-parallelism.fsdp-reshard-after-forward"]}
"""Arm -> its flags beside the common ones."""
STEP_TIME_RATIO = 1.03
"""The target: a wrapped arm's median step time at most this multiple of the unwrapped fast path's."""
ALL_GATHER_RATIO = 0.55
"""The target: the FP8-parameter arm's all-gather bytes over the blocks at most this share of the BF16 fsdp arm's."""
FINAL_LOSS_RTOL = 0.01
"""Mean loss of the last quarter of the steps, wrapped vs unwrapped: the same weights and batches, rounding apart
(FSDP's BF16 all-gathered copies are the BF16 parameters; FP8 parameters round the masters once more)."""
PROFILED_STEPS = 2
"""Steps whose collectives are counted (steps 1 and 2; step 0 initialises lazily)."""


def run_arms(workdir: Path, arms: Sequence[str], steps: int, common: Sequence[str]) -> dict[str, dict]:
    """Each arm to its end, one after another (their step times are compared)."""
    return {name: run_record(launch(name, workdir, 1, [*common, "--train-iters", str(steps), *ARMS[name]]))
            for name in arms}


def judge(records: dict[str, dict], steps: int) -> dict:
    """Ratios and checks of the wrapped arms against the unwrapped one."""
    checks = {f"{name} ran {steps} steps": len(record.get("losses", ())) == steps for name, record in records.items()}
    if not all(checks.values()) or "unwrapped" not in records:
        return {"checks": checks}
    reference = records["unwrapped"]
    figures = {}
    for name, record in records.items():
        if name == "unwrapped":
            continue
        gaps = compare_losses(reference, record)
        ratio = record["step_ms_median"] / reference["step_ms_median"]
        figures[name] = {"step_time_ratio": ratio, "tokens_per_s_ratio": record["tokens_per_s"] /
                         reference["tokens_per_s"], "peak_mem_gib_delta": record["peak_mem_gib"] -
                         reference["peak_mem_gib"], **gaps}
        checks[f"{name}: step time within {STEP_TIME_RATIO - 1:.0%} of unwrapped"] = ratio <= STEP_TIME_RATIO
        checks[f"{name}: first step's loss within {FIRST_LOSS_RTOL:.1%}"] = gaps["first_loss_rel_gap"] <= FIRST_LOSS_RTOL
        checks[f"{name}: first step's gradient norm within {GRAD_NORM_RTOL:.0%}"] = \
            gaps["first_grad_norm_rel_gap"] <= GRAD_NORM_RTOL
        checks[f"{name}: final mean loss within {FINAL_LOSS_RTOL:.0%}"] = gaps["final_rel_gap"] <= FINAL_LOSS_RTOL
    bf16, fp8 = (_block_all_gather_bytes(records.get(name, {})) for name in ("fsdp", "fsdp_fp8_params"))
    if bf16:  # none counted over one rank (see the module docstring)
        figures["all_gather_bytes_fp8_over_bf16_blocks"] = fp8 / bf16
        checks[f"fsdp_fp8_params: blocks' all-gather bytes at most {ALL_GATHER_RATIO}x fsdp's (FP8 travels as FP8)"] \
            = fp8 / bf16 <= ALL_GATHER_RATIO
    return {"figures": figures, "checks": checks}


def _block_all_gather_bytes(record: dict) -> float:
    """All-gather bytes per step of the transformer blocks' groups (the root group's stay BF16 by plan rule 1)."""
    by_group = (record.get("collectives") or {}).get("all_gather_bytes_by_group", {})
    return sum(value for group, value in by_group.items() if group != "root")


def render(payload: dict) -> str:
    """The evidence's Markdown: one row per arm, the ratios, the checks, the commands."""
    records, figures = payload["arms"], payload.get("figures", {})
    rows = []
    for name, record in records.items():
        collectives = record.get("collectives") or {"bytes": {}}
        ratio = figures.get(name, {}).get("step_time_ratio")
        rows.append([name, f"{record.get('tokens_per_s', 0):,.0f}", f"{record.get('step_ms_median', 0):.1f}",
                     f"{ratio:.3f}x" if ratio else "-", f"{record.get('peak_mem_gib', 0):.2f}",
                     f"{collectives['bytes'].get('all_gather', 0) / 2**30:.2f}",
                     f"{collectives['bytes'].get('reduce_scatter', 0) / 2**30:.2f}",
                     f"{collectives['bytes'].get('all_reduce', 0) / 2**30:.2f}",
                     f"{record['losses'][-1]:.4f}" if record.get("losses") else "-"])
    table = markdown_table(["arm", "tokens/s", "step ms (median)", "step time / unwrapped", "peak GiB",
                            "all-gather GiB/step", "reduce-scatter GiB/step", "all-reduce GiB/step", "last loss"], rows)
    checks = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in payload["checks"].items())
    gather = figures.get("all_gather_bytes_fp8_over_bf16_blocks")
    commands = "\n".join(record["command"] for record in records.values())
    return (f"The fast path unwrapped, under DDP and under FSDP2 (1 rank each): {payload['model']}, recipe "
            f"{payload['recipe']}, {payload['steps']} steps per arm.\n\n{table}\n\n" +
            (f"FP8-parameter all-gather bytes over the blocks, vs BF16 (fsdp): {gather:.3f}x.\n\n" if gather else "") +
            f"## Checks\n\n{checks}\n\n## Launch commands (from the repository root)\n\n```\n{commands}\n```\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=40, help="steps per arm")
    parser.add_argument("--model", default="llama-1b-like")
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="passed to every run (default: auto)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    add_force_option(parser)
    args = parser.parse_args(argv)
    arms = comma_separated(args.arms)
    unknown = sorted(set(arms) - set(ARMS))
    if not arms or unknown:
        parser.error(f"--arms {args.arms!r}: name some of {','.join(ARMS)}")
    name = f"data-parallel-{device_slug()}"
    claim_or_exit("fp8stack.bench.data_parallel", name, args.out_dir, args.force)
    common = ["--model", args.model, "--fp8-recipe", args.recipe, "--eval-iters", "0", "--log-interval", "10",
              "--profile-collectives", str(PROFILED_STEPS), *(("--device", args.device) if args.device else ())]
    with tempfile.TemporaryDirectory(prefix="fp8stack-data-parallel-") as scratch:
        records = run_arms(Path(scratch), arms, args.steps, common)
    payload = {"model": args.model, "recipe": args.recipe, "steps": args.steps, "arms": records,
               "targets": {"step_time_ratio": STEP_TIME_RATIO, "all_gather_ratio": ALL_GATHER_RATIO,
                           "final_loss_rtol": FINAL_LOSS_RTOL},
               "commands": [record["command"] for record in records.values()], **judge(records, args.steps)}
    payload["passed"] = all(payload["checks"].values())
    text = render(payload)
    print(text, flush=True)
    paths = write_evidence(name, payload, text, args.out_dir, replace=args.force)
    print(f"[data-parallel] evidence: {', '.join(map(str, paths))}", flush=True)
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
