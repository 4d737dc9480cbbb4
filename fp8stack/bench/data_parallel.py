"""`python -m fp8stack.bench.data_parallel`: the fast path on one GPU unwrapped, under DDP and under FSDP2 (each
over a 1-rank process group: the data-parallel code paths, collectives included, without a second GPU).

    python -m fp8stack.bench.data_parallel [--arms unwrapped,ddp,fsdp,fsdp_fp8_params] [--steps 40]

Every arm is a launch/train.sh run (NPROC=1) of the same model, recipe, batches and seed with the configuration's
defaults otherwise (the measured fast path: BF16 parameters with FP32 masters, TE's fused weight-gradient
accumulation where the wrapper allows it, compile, cuDNN attention), plus:
- ddp: --parallelism.data-parallel ddp --parallelism.data-parallel-one-rank (FP32 main_grads averaged per step);
- fsdp_bound: unwrapped, less the two levers TE keeps off under fully_shard (fused weight-gradient accumulation and
  the FP8 weight cache): the step time an FSDP2 arm could at best reach with TE as it is;
- fsdp: --parallelism.data-parallel fsdp --parallelism.data-parallel-one-rank (FSDP2's mixed precision: sharded FP32
  parameters, BF16 all-gathered copies; TE cannot fuse weight-gradient accumulation under it);
- fsdp_fp8_params: fsdp with --param-dtype fp8 (TE weights held in FP8 and all-gathered in FP8);
- fsdp_gather_once, fsdp_fp8_params_gather_once: those with --no-parallelism.fsdp-reshard-after-forward (the gathered
  parameters kept from forward to backward and across a step's micro-batches: one all-gather per step).
Over one rank FSDP2 copies its shards in without a collective, so the profiler counts no all-gather bytes there; the
all-gather check runs where it does (2+ ranks), and tests/gpu/test_fsdp_te_gpu.py checks FP8 inputs at one.
Collectives are counted over PROFILED_STEPS steps (fp8stack.train.comm_stats). The evidence, profiles/runs/<date>-
data-parallel-<gpu>/, holds tokens/s, peak memory, bytes, losses, the checks and every launch command, and with
matplotlib a figure of the step time against the unwrapped arm's, peak memory and the loss curves;
`--plot-only <run folder>/<stem>.json` draws the figure of a run measured before it existed.
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fp8stack.ab import chosen_names
from fp8stack.ab.plot import pyplot, relative_gap
from fp8stack.bench.plots import (FIGURE_WIDTH, add_plot_only_option, figure_height, loss_panel, note_unmeasured,
                                  plot_only, refuse_flags_beside_plot_only, write_plot)
from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, compare_losses, launch, run_record)
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence

PROG = "python -m fp8stack.bench.data_parallel"
ARMS = {"unwrapped": [],
        "ddp": ["--parallelism.data-parallel", "ddp", "--parallelism.data-parallel-one-rank"],
        "fsdp_bound": ["--no-te.gradient-accumulation-fusion", "--no-te.cache-fp8-weights"],
        "fsdp": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank"],
        "fsdp_fp8_params": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                            "--param-dtype", "fp8"],
        "fsdp_gather_once": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                             "--no-parallelism.fsdp-reshard-after-forward"],
        "fsdp_fp8_params_gather_once": ["--parallelism.data-parallel", "fsdp", "--parallelism.data-parallel-one-rank",
                                        "--param-dtype", "fp8", "--no-parallelism.fsdp-reshard-after-forward"]}
"""Arm -> its flags beside the common ones."""
BOUND = "fsdp_bound"
"""The unwrapped arm without what TE cannot do under FSDP2: the FSDP2 arms' step time over it is FSDP2's own cost."""
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
        if name.startswith("fsdp") and name != BOUND and BOUND in records:
            figures[name]["step_time_over_bound"] = record["step_ms_median"] / records[BOUND]["step_ms_median"]
        if name != BOUND:
            checks[f"{name}: step time within {STEP_TIME_RATIO - 1:.0%} of unwrapped"] = ratio <= STEP_TIME_RATIO
        checks[f"{name}: first step's loss within {FIRST_LOSS_RTOL:.1%}"] = gaps["first_loss_rel_gap"] <= FIRST_LOSS_RTOL
        checks[f"{name}: first step's gradient norm within {GRAD_NORM_RTOL:.0%}"] = \
            gaps["first_grad_norm_rel_gap"] <= GRAD_NORM_RTOL
        checks[f"{name}: final mean loss within {FINAL_LOSS_RTOL:.0%}"] = gaps["final_rel_gap"] <= FINAL_LOSS_RTOL
    bf16, fp8 = (block_all_gather_bytes(records.get(name, {})) for name in ("fsdp", "fsdp_fp8_params"))
    if bf16:  # none counted over one rank (see the module docstring)
        figures["all_gather_bytes_fp8_over_bf16_blocks"] = fp8 / bf16
        checks[f"fsdp_fp8_params: blocks' all-gather bytes at most {ALL_GATHER_RATIO}x fsdp's (FP8 travels as FP8)"] \
            = fp8 / bf16 <= ALL_GATHER_RATIO
    return {"figures": figures, "checks": checks}


def block_all_gather_bytes(record: dict) -> float:
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
        over_bound = figures.get(name, {}).get("step_time_over_bound")
        rows.append([name, f"{record.get('tokens_per_s', 0):,.0f}", f"{record.get('step_ms_median', 0):.1f}",
                     f"{ratio:.3f}x" if ratio else "-", f"{over_bound:.3f}x" if over_bound else "-",
                     f"{record.get('peak_mem_gib', 0):.2f}",
                     f"{collectives['bytes'].get('all_gather', 0) / 2**30:.2f}",
                     f"{collectives['bytes'].get('reduce_scatter', 0) / 2**30:.2f}",
                     f"{collectives['bytes'].get('all_reduce', 0) / 2**30:.2f}",
                     f"{record['losses'][-1]:.4f}" if record.get("losses") else "-"])
    table = markdown_table(["arm", "tokens/s", "step ms (median)", "step time / unwrapped",
                            f"step time / {BOUND}", "peak GiB",
                            "all-gather GiB/step", "reduce-scatter GiB/step", "all-reduce GiB/step", "last loss"], rows)
    checks = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in payload["checks"].items())
    gather = figures.get("all_gather_bytes_fp8_over_bf16_blocks")
    commands = "\n".join(record["command"] for record in records.values())
    return (f"The fast path unwrapped, under DDP and under FSDP2 (1 rank each): {payload['model']}, recipe "
            f"{payload['recipe']}, {payload['steps']} steps per arm.\n\n{table}\n\n" +
            (f"FP8-parameter all-gather bytes over the blocks, vs BF16 (fsdp): {gather:.3f}x.\n\n" if gather else "") +
            f"## Checks\n\n{checks}\n\n## Launch commands (from the repository root)\n\n```\n{commands}\n```\n")


REFERENCE = "unwrapped"
"""The arm the others' step time is judged against."""
TARGET_COLOURS = {"reference": "tab:gray", "within": "tab:green", "beyond": "tab:red"}
"""Step-time bars: the reference, and the arms within or beyond STEP_TIME_RATIO of it."""


def figure(payload: dict):
    """The evidence's figure: each arm's median step time over the unwrapped arm's with the target (step_time_panel),
    peak memory (memory_panel), every arm's loss curve and, as the curves lie on one another, each wrapped arm's loss
    relative to the unwrapped arm's (loss_gap_panel)."""
    plt = pyplot()
    names = list(payload["arms"])
    size = (FIGURE_WIDTH * 4 / 3, figure_height(len(names) + 1))  # + 1: the legend under the step times
    fig, (speed, memory, losses, gaps) = plt.subplots(1, 4, figsize=size, width_ratios=(1.3, 1, 1, 1),
                                                      layout="constrained")
    step_time_panel(speed, payload)
    memory_panel(memory, payload["arms"])
    loss_panel(losses, [(name, record["losses"], {}) for name, record in payload["arms"].items()
                        if record.get("losses")])
    loss_gap_panel(gaps, payload["arms"])
    device = (payload.get("environment") or {}).get("device", "an unrecorded device")
    fig.suptitle(f"The fast path unwrapped, under DDP and under FSDP2 (1 rank each) on {device}: {payload['model']}, "
                 f"recipe {payload['recipe']}, {payload['steps']} steps per arm")
    return fig


def _unmeasured(record: dict) -> str | None:
    """Why an arm has no figures (its run failed), or None."""
    return None if "step_ms_median" in record else f"failed (exit {record.get('returncode')})"


def step_time_panel(axes, payload: dict) -> None:
    """Each arm's median step time over the unwrapped arm's, as a bar from 1 (the unwrapped arm's line) to its
    ratio, labelled with its tokens/s; the target STEP_TIME_RATIO dotted. Without a measured unwrapped arm: the
    median step times in ms."""
    from matplotlib.patches import Patch

    arms, target = payload["arms"], payload["targets"]["step_time_ratio"]
    reference = arms.get(REFERENCE, {}).get("step_ms_median")
    rows, names = list(range(len(arms))), list(arms)
    measured = [record.get("step_ms_median") for record in arms.values()]
    if reference:
        ratios = [ms / reference if ms else None for ms in measured]
        colours = [TARGET_COLOURS["reference" if name == REFERENCE else "within" if ratio and ratio <= target
                                  else "beyond"] for name, ratio in zip(names, ratios)]
        bars = axes.barh(rows, [ratio - 1 if ratio else 0 for ratio in ratios], left=1, color=colours)
        axes.axvline(1, color="black", linewidth=1, linestyle="--")
        axes.axvline(target, color="tab:red", linewidth=1.2, linestyle=":")
        axes.set(xlabel=f"median step time / {REFERENCE}'s", title=f"step time against {REFERENCE} "
                 f"(dotted: the target, {target:.2f}x)")
        axes.legend(handles=[Patch(color=TARGET_COLOURS["within"], label=f"within {target:.2f}x"),
                             Patch(color=TARGET_COLOURS["beyond"], label=f"beyond {target:.2f}x")],
                    fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
        axes.use_sticky_edges = False  # room left of the line at 1
    else:
        bars = axes.barh(rows, [ms or 0 for ms in measured], color=TARGET_COLOURS["reference"])
        axes.set(xlabel="median step time, ms", title=f"step time ({REFERENCE} not measured: no target)")
    axes.bar_label(bars, [f"{record['tokens_per_s']:,.0f} tokens/s" if "step_ms_median" in record else ""
                          for record in arms.values()], padding=3, fontsize="small")
    note_unmeasured(axes, rows, [_unmeasured(record) for record in arms.values()])
    axes.set_yticks(rows, names)
    axes.invert_yaxis()
    axes.margins(x=0.3)


def memory_panel(axes, arms: dict[str, dict]) -> None:
    """Peak GiB per arm, the unwrapped arm's dashed; rows as step_time_panel's, the names left to it."""
    rows = list(range(len(arms)))
    peaks = [record.get("peak_mem_gib") if "step_ms_median" in record else None for record in arms.values()]
    bars = axes.barh(rows, [peak or 0 for peak in peaks], color=TARGET_COLOURS["reference"])
    axes.bar_label(bars, [f"{peak:.2f}" if peak is not None else "" for peak in peaks], padding=3, fontsize="small")
    note_unmeasured(axes, rows, [_unmeasured(record) for record in arms.values()])
    reference = arms.get(REFERENCE, {}).get("peak_mem_gib")
    if reference:
        axes.axvline(reference, color="black", linewidth=1, linestyle="--")
    axes.set_yticks(rows, [""] * len(rows))
    axes.invert_yaxis()
    axes.margins(x=0.15)
    axes.set(xlabel="GiB", title="peak memory" + (f" (dashed: {REFERENCE})" if reference else ""))


def loss_gap_panel(axes, arms: dict[str, dict]) -> None:
    """Each wrapped arm's loss over the unwrapped arm's per step, in % (same weights and batches: only rounding
    parts them), in the loss panel's colours."""
    reference = arms.get(REFERENCE, {}).get("losses")
    for index, (name, record) in enumerate(arms.items()):
        if reference and name != REFERENCE and record.get("losses"):
            gaps = relative_gap(record["losses"], reference, window=1)
            axes.plot(range(1, len(gaps) + 1), gaps, label=name, color=f"C{index}", linewidth=1.2)
    axes.axhline(0, color="black", linewidth=0.8, linestyle="--")
    axes.set(xlabel="step", ylabel=f"% vs {REFERENCE}", title=f"loss relative to {REFERENCE}" if reference else
             f"loss relative to {REFERENCE} ({REFERENCE} not measured)")
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")


def is_data_parallel_record(record: dict) -> bool:
    """The JSON is this bench's evidence: its arms by name, each with its launch command, and its targets."""
    return isinstance(record.get("arms"), dict) and isinstance(record.get("targets"), dict) and \
        "step_time_ratio" in record["targets"] and all(isinstance(r, dict) and "command" in r
                                                       for r in record["arms"].values())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=40, help="steps per arm")
    parser.add_argument("--model", default="llama-1b-like")
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="passed to every run (default: auto)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    add_force_option(parser)
    add_plot_only_option(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        refuse_flags_beside_plot_only(parser, args)
        return plot_only(PROG, args.plot_only, is_data_parallel_record, figure)
    arms = chosen_names(parser, "--arms", args.arms, list(ARMS))
    name = f"data-parallel-{device_slug()}"
    claim_or_exit(PROG, name, args.out_dir, args.force)
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
    paths += tuple(filter(None, [write_plot(paths[0], figure)]))
    print(f"[data-parallel] evidence: {', '.join(map(str, paths))}", flush=True)
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
