"""Where FP8 runs' final losses lie against the band of BF16 runs of one setting, read from A/B evidence
files (`fp8stack ab`). Two BF16 runs of one seed and batches part by chance (kernels that reduce in no fixed
order), so one repeat is a poor measure of the band; several A/B files of one setting hold more BF16 runs.

    python -m fp8stack.bench.loss_band --label seq1024-lr3e-4 \\
        profiles/runs/*/ab-llama-1b-like-loss-300steps-seq1024*-h200.json

Writes profiles/runs/<date>-loss-band-<model>-<label>-<device>/ (.json, .md and .png): every BF16 run's final loss,
their mean, span and standard deviation, and each FP8 run's gap to the BF16 mean, in standard deviations and against
the band's edges (a plan run more than once also by the mean of its runs); beside them each run's validation loss
and its gradient norms against the clip (how many steps the clip shortened, and the median norm over the last
quarter of the steps): where the clip shortens every step, each update has the same length, and a noisier gradient
points less of it along the descent. Files of different
settings (anything both arms share: model, shape, batch, LR schedule, steps, seed, data) are refused. The figure
plots each run's loss through training against the BF16 runs' band (window means, relative to the BF16 mean), and
the final losses against the band and the gate; `--plot-only BAND.json` draws it again from a band's JSON.
"""

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from fp8stack.ab.verdicts import (GATE_MIN_RUNS, GATE_STDEVS, GPU_LOSS_TOLERANCE, REPEAT_ARM, LossGate, is_bf16_arm,
                                  run_identity)
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.bench.plots import add_plot_only_option, plot_only, refuse_flags_beside_plot_only, write_plot
from fp8stack.bench.targets import plan_recipe
from fp8stack.plan.recipes import get_recipe, is_fp8

SHARED_SETTINGS = ("model", "model_impl", "steps", "warmup", "lr", "min_lr", "weight_decay", "grad_clip", "micro_batch",
                   "global_batch", "seq_len", "seed", "dtype", "compile", "sdpa_backend", "max_data_bytes",
                   "data_source", "tensor_parallel", "recompute")
"""train_config fields every run of one band must share (FP8 arms' own options, format and margin, may differ)."""
GATE_FLOOR = GPU_LOSS_TOLERANCE
"""The one-sided loss gate (fp8stack.ab.verdicts.LossGate, the rule `fp8stack ab` judges by with as many BF16 runs):
an FP8 run passes when its final loss is at most the BF16 runs' mean plus max(GATE_FLOOR of the mean, GATE_STDEVS
standard deviations of at least GATE_MIN_RUNS BF16 runs); ending below passes."""
OLDER_FILE_DEFAULTS = {"data_source": "stdlib"}
"""Values of fields that A/B files written before the field existed leave out."""


def flat_config(config: dict) -> dict:
    """A train_config under the flat names older A/B files used; newer ones nest the arms' shared job by section
    ({"job": {section: {field: value}}, "ab": ...})."""
    if "job" not in config:
        return config
    job = config["job"]
    training, optimizer = job["training"], job["optimizer"]
    return {"model": job["model"]["name"], "model_impl": job["model"]["impl"], "steps": training["steps"],
            "warmup": optimizer["warmup"], "lr": optimizer["lr"], "min_lr": optimizer["min_lr"],
            "weight_decay": optimizer["weight_decay"], "grad_clip": optimizer["grad_clip"],
            "micro_batch": training["micro_batch"], "global_batch": training["global_batch"],
            "seq_len": training["seq_len"], "seed": training["seed"], "dtype": training["dtype"],
            "compile": training["compile"], "sdpa_backend": training["sdpa_backend"],
            "max_data_bytes": job["data"]["max_bytes"], "data_source": job["data"]["source"],
            "tensor_parallel": job["parallelism"]["tensor_parallel"],
            "recompute": job["activation_checkpoint"]["layers"], "fp8_format": job["precision"]["fp8_format"],
            "fp8_margin": job["te"]["delayed_margin"],
            "gradient_accumulation_fusion": job["te"]["gradient_accumulation_fusion"]}


def load_runs(paths: Sequence[Path]) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """(the shared settings, the BF16 runs, the FP8 runs, each file's date and command), each run with its file,
    name and final loss; ValueError when the files are not of one setting or device. A run that several files hold
    (taken by --bf16-from or --continue-from: the same losses step for step) counts once, in the first."""
    settings, device, bf16_runs, fp8_runs, sources = None, None, [], [], []
    seen: set[tuple] = set()
    for path in paths:
        record = json.loads(Path(path).read_text())
        sources.append({"file": str(path), "date": record["date"], "command": record["command"],
                        "train_split_passes": record.get("train_split_passes")})
        config = flat_config(record["train_config"])
        these = {k: OLDER_FILE_DEFAULTS.get(k) if config.get(k) is None else config[k] for k in SHARED_SETTINGS}
        if settings is None:
            settings, device = these, record["device"]
        elif these != settings or record["device"] != device:
            differ = sorted(k for k in SHARED_SETTINGS if these[k] != settings[k]) or ["device"]
            raise ValueError(f"{path} is of another setting than {paths[0]} ({', '.join(differ)} differ): "
                             "a band compares runs of one setting only")
        fp8_format, margin = config.get("fp8_format") or "recipe default format", config.get("fp8_margin") or 0
        fused = ", fused wgrad accumulation" if config.get("gradient_accumulation_fusion") else ""
        own_runs = {name: own for name, own in (record.get("runs") or {}).items() if isinstance(own, dict)}
        validation = {name: own.get("val_loss") for name, own in own_runs.items()}
        norms = {name: gradient_norms(own.get("grad_norms"), config["grad_clip"]) for name, own in own_runs.items()}
        windows = {name: window_means(own.get("losses")) for name, own in own_runs.items()}
        again = {name for name, own in own_runs.items() if run_identity(own) in seen}  # None is never in seen
        seen |= {run_identity(own) for own in own_runs.values()} - {None}
        for arm in record["arms"]:
            if arm["final_loss"] is None or arm["recipe"] in again:
                continue
            run = {"file": Path(path).name, "final_loss": arm["final_loss"], "val_loss": validation.get(arm["recipe"]),
                   "window_losses": windows.get(arm["recipe"]), **norms.get(arm["recipe"], NO_NORMS)}
            if is_bf16_arm(arm["recipe"]):
                bf16_runs.append({**run, "run": arm["recipe"]})
            else:
                recipe = plan_recipe(arm["recipe"])
                own = (record.get("runs") or {}).get(arm["recipe"])
                overridden = []  # modules a recipe file gave another recipe, e.g. MoE experts blockwise
                if isinstance(own, dict) and "te" in own.get("config", {}):  # the arm's own resolved options
                    arm_config = flat_config({"job": own["config"]})
                    margin = arm_config["fp8_margin"]
                    fused = ", fused wgrad accumulation" if arm_config["gradient_accumulation_fusion"] else ""
                    overridden = [f"{o['fqn']} {o['recipe']}" for o in own["config"]["precision"].get("overrides") or ()
                                  if o.get("recipe")]
                options = (f"{fp8_format}, margin {margin}" if is_fp8(recipe) and get_recipe(recipe).scales_from_history
                           else fp8_format) + fused
                fp8_runs.append({**run, "run": f"{', '.join([arm['recipe'], *overridden])} ({options})",
                                 "backend": arm.get("backend"), "fp8_flop_share": fp8_flop_share(own)})
        repeats = record.get("baseline_repeats") or (  # files before --baseline-runs held one repeat
            [{"run": REPEAT_ARM, **record["baseline_repeat"]}] if record.get("baseline_repeat") else [])
        bf16_runs += [{"file": Path(path).name, "run": r["run"], "final_loss": r["final_loss"],
                       "val_loss": validation.get(r["run"]), "window_losses": windows.get(r["run"]),
                       **norms.get(r["run"], NO_NORMS)}
                      for r in repeats if "error" not in r and r["run"] not in again]
    return {**settings, "device": device}, bf16_runs, fp8_runs, sources


def fp8_flop_share(run) -> float | None:
    """The share of a run's GEMM FLOPs its plan ran in FP8 (which modules a recipe file or the plan's measurements
    left in BF16 shows here, not in the recipe's name); None for a run recorded without its plan."""
    summary = run.get("plan_summary") if isinstance(run, dict) else None
    return (summary.get("flops_share_by_precision") or {}).get("fp8") if isinstance(summary, dict) else None


NO_NORMS = {"clipped_share": None, "late_grad_norm": None}
"""A run whose gradient norms the A/B file does not hold (files before the runs' records)."""


WINDOWS = 50
"""The figure's loss curves: each run's training loss as the means of this many windows of steps (per-step batch
noise, several % at a few sequences per step, would hide a drift of a fraction of one)."""


def window_means(losses: Sequence[float] | None) -> list[list[float]] | None:
    """[[last step of the window, mean loss over it], ...] of WINDOWS windows of whole steps (fewer for a shorter run);
    None without per-step losses (files before the runs' records)."""
    if not losses:
        return None
    size = max(1, len(losses) // WINDOWS)
    return [[end, statistics.fmean(losses[end - size:end])] for end in range(size, len(losses) + 1, size)]


DRIFT_STRETCHES = 10
"""The drift table's rows: stretches of the run, each the mean of WINDOWS / DRIFT_STRETCHES window means."""


def drift(bf16_runs: list[dict], fp8_runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Where each FP8 run stands along the run, from the window means: per stretch of steps the BF16 runs' mean loss,
    their spread around it and each FP8 run's gap to it; and each FP8 run with `behind_from_step`, the first step
    from which every later window of it is above every BF16 run's (None: it ends inside or below them). ([], the
    runs as they are) when a run lacks per-step losses or the runs' windows differ."""
    windows = [r["window_losses"] for r in bf16_runs + fp8_runs]
    if not bf16_runs or any(w is None or [end for end, _ in w] != [end for end, _ in windows[0]] for w in windows):
        return [], fp8_runs
    bf16 = [[loss for _, loss in r["window_losses"]] for r in bf16_runs]
    ends = [end for end, _ in windows[0]]
    size = max(1, len(ends) // DRIFT_STRETCHES)
    rows = []
    for first in range(0, len(ends) - size + 1, size):
        means = [statistics.fmean(run[first:first + size]) for run in bf16]
        mean = statistics.fmean(means)
        rows.append({"to_step": ends[first + size - 1], "bf16_mean": mean, "bf16_low": min(means) / mean - 1,
                     "bf16_high": max(means) / mean - 1,
                     "fp8_gaps": [statistics.fmean(loss for _, loss in r["window_losses"][first:first + size]) / mean
                                  - 1 for r in fp8_runs]})
    highest = [max(run[i] for run in bf16) for i in range(len(ends))]
    starts = [1, *(end + 1 for end in ends)]  # each window's first step; past the last: the run ended above
    placed = []
    for r in fp8_runs:
        last_inside = max((i for i, (_, loss) in enumerate(r["window_losses"]) if loss <= highest[i]), default=-1)
        placed.append({**r, "behind_from_step": starts[last_inside + 1] if last_inside < len(ends) - 1 else None})
    return rows, placed


def drift_markdown(rows: list[dict], fp8_runs: list[dict]) -> str:
    """drift's table, and a line per FP8 run saying from which step it stayed above the BF16 runs."""
    if not rows:
        return ""
    lines = [f"- {r['run']} ({r['file']}): " + (f"above every BF16 run from step {r['behind_from_step']} to the end"
                                               if r["behind_from_step"] else "not above every BF16 run at the end")
             for r in fp8_runs]
    table = markdown_table(["steps to", "BF16 mean", "BF16 runs", *(f"FP8 {i + 1}" for i in range(len(fp8_runs)))],
                           [[str(row["to_step"]), f"{row['bf16_mean']:.4f}",
                             f"{row['bf16_low']:+.2%} to {row['bf16_high']:+.2%}",
                             *(f"{gap:+.2%}" for gap in row["fp8_gaps"])] for row in rows])
    return ("\n\nAlong the run (means over stretches of steps; the BF16 runs' spread and each FP8 run's gap, in the "
            "order of the table above, against the BF16 mean):\n\n" + table + "\n" + "\n".join(lines) + "\n")


def is_band_record(record: dict) -> bool:
    """The JSON is this tool's evidence: its settings, BF16 band and runs."""
    return all(isinstance(record.get(key), kind) for key, kind in (("settings", dict), ("bf16_band", dict),
                                                                   ("bf16_runs", list), ("fp8_runs", list)))


def source_names(record: dict) -> list[str]:
    """The names of the A/B files a band reads, in its order (the figure numbers them)."""
    return [Path(source["file"]).name for source in record["sources"]]


def run_labels(record: dict) -> list[str]:
    """The figure's name of each BF16 then FP8 run: its arm without the options, and where the band reads several
    files, the file's number among them ([1], [2], ...: two files' first BF16 runs are both 'bf16')."""
    files = source_names(record)
    runs = [*record["bf16_runs"], *record["fp8_runs"]]
    return [run["run"].split(" (recipe")[0] + (f" [{files.index(run['file']) + 1}]" if len(files) > 1 else "")
            for run in runs]


def draw(record: dict):
    """The band's figure: each run's window-mean loss relative to the BF16 runs' mean window by window, the BF16
    runs' span shaded; and every final loss against the BF16 band, its mean and the gate's limit."""
    from fp8stack.ab.plot import pyplot

    plt = pyplot()
    labels = run_labels(record)
    fig, (curves, finals) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    bf16 = [r["window_losses"] for r in record["bf16_runs"] if r.get("window_losses")]
    if bf16 and len({len(w) for w in bf16}) == 1:
        steps = [end for end, _ in bf16[0]]
        means = [statistics.fmean(w[i][1] for w in bf16) for i in range(len(steps))]
        relative = [[100 * (w[i][1] / means[i] - 1) for i in range(len(steps))] for w in bf16]
        curves.fill_between(steps, [min(c) for c in zip(*relative)], [max(c) for c in zip(*relative)],
                            color="silver", alpha=0.6, label=f"{len(bf16)} BF16 runs (span)")
        for index, run in enumerate(record["fp8_runs"]):
            if run.get("window_losses") and len(run["window_losses"]) == len(steps):
                curves.plot(steps, [100 * (w[1] / m - 1) for w, m in zip(run["window_losses"], means)],
                            linewidth=1.2, color=f"C{index}", label=labels[len(record["bf16_runs"]) + index])
        curves.axhline(0, color="tab:gray", linewidth=0.8)
        curves.legend(fontsize="small")
    else:
        curves.text(0.5, 0.5, "the files hold no per-step losses of every BF16 run", transform=curves.transAxes,
                    ha="center", color="tab:gray")
    curves.set(xlabel="step", ylabel="training loss vs the BF16 runs' mean (%)",
               title=f"training loss, means of {WINDOWS} windows of steps")
    band_stats, runs = record["bf16_band"], [*record["bf16_runs"], *record["fp8_runs"]]
    finals.axvspan(band_stats["min"], band_stats["max"], color="silver", alpha=0.6, label="BF16 runs (span)")
    finals.axvline(band_stats["mean"], color="tab:gray", linewidth=1, label="BF16 mean")
    if band_stats["runs"] >= GATE_MIN_RUNS and record.get("gate_limit") is not None:  # bands before the gate: none
        finals.axvline(record["gate_limit"], color="tab:red", linestyle="--", linewidth=1, label="gate limit")
    rows = range(len(runs))
    finals.scatter([r["final_loss"] for r in runs], rows, zorder=3,
                   c=["tab:gray"] * len(record["bf16_runs"]) + [f"C{i}" for i in range(len(record["fp8_runs"]))])
    finals.set_yticks(list(rows), labels, fontsize="small")
    finals.invert_yaxis()
    finals.set(xlabel="final loss (mean of the last 10% of steps)", title="final loss against the BF16 band")
    finals.legend(fontsize="small")
    files = source_names(record)
    fig.suptitle(f"{record['settings']['model']}, {record['settings']['steps']} steps, on "
                 f"{record['settings']['device']}"
                 + ("".join(f"\n[{i}] {name}" for i, name in enumerate(files, 1)) if len(files) > 1 else ""),
                 fontsize="medium")
    fig.tight_layout()
    return fig


def gradient_norms(norms: Sequence[float] | None, clip: float | None) -> dict:
    """clipped_share: the share of steps whose gradient norm exceeded the clip (None without a clip);
    late_grad_norm: the median norm over the last quarter of the steps."""
    if not norms:
        return NO_NORMS
    late = norms[len(norms) - max(1, len(norms) // 4):]
    return {"clipped_share": sum(n > clip for n in norms) / len(norms) if clip else None,
            "late_grad_norm": statistics.median(late)}


def late_norm_gaps(bf16_runs: list[dict], fp8_runs: list[dict]) -> tuple[float | None, list[dict]]:
    """The BF16 runs' mean late gradient norm (where every BF16 run has one), and each FP8 run with its gap to it."""
    norms = [r["late_grad_norm"] for r in bf16_runs]
    mean = None if not norms or None in norms else statistics.fmean(norms)
    return mean, [{**r, "late_norm_gap": None if mean is None or r["late_grad_norm"] is None
                   else r["late_grad_norm"] / mean - 1.0} for r in fp8_runs]


def clipping_summary(clip: float | None, bf16_runs: list[dict], fp8_runs: list[dict], bf16_late_norm: float) -> str:
    """One paragraph: how often the clip shortened the steps of each side, and the FP8 runs' late gradient norms
    against the BF16 runs'."""
    def shares(runs: list[dict]) -> str:
        values = [r["clipped_share"] for r in runs if r["clipped_share"] is not None]
        return f"{min(values):.0%} to {max(values):.0%}" if values else "-"

    gaps = [r["late_norm_gap"] for r in fp8_runs if r["late_norm_gap"] is not None]
    spread = f", the FP8 runs' {min(gaps):+.1%} to {max(gaps):+.1%} of it" if gaps else ""
    clipped = (f"The clip ({clip:g}) shortened {shares(bf16_runs)} of the BF16 runs' steps and {shares(fp8_runs)} of "
               "the FP8 runs'. " if clip else "No clip. ")
    return (f"{clipped}Median gradient norm over the last quarter of the steps: BF16 runs' mean "
            f"{bf16_late_norm:.3f}{spread}.\n\n")


def band(bf16_losses: list[float]) -> dict:
    """Mean, edges, span (max - min over the mean) and sample standard deviation of the BF16 final losses."""
    if len(bf16_losses) < 2:
        raise ValueError(f"a band needs at least 2 BF16 runs, the files hold {len(bf16_losses)}")
    mean = statistics.fmean(bf16_losses)
    return {"runs": len(bf16_losses), "mean": mean, "min": min(bf16_losses), "max": max(bf16_losses),
            "span": (max(bf16_losses) - min(bf16_losses)) / mean, "stdev": statistics.stdev(bf16_losses)}


def place(loss: float, bf16: dict) -> dict:
    """An FP8 run's final loss against the band: relative gap to the mean, standard deviations, position, and the
    one-sided gate (gate_limit, gate: pass / fail, or None with fewer than GATE_MIN_RUNS BF16 runs)."""
    position = ("above every BF16 run" if loss > bf16["max"] else
                "below every BF16 run" if loss < bf16["min"] else "within the BF16 runs")
    limit = gate_limit(bf16)
    return {"gap_to_mean": loss / bf16["mean"] - 1.0, "stdevs": (loss - bf16["mean"]) / bf16["stdev"],
            "position": position, "gate_limit": limit,
            "gate": None if bf16["runs"] < GATE_MIN_RUNS else "pass" if loss <= limit else "fail"}


def gate_limit(bf16: dict) -> float:
    """The largest final loss the one-sided gate passes (GATE_FLOOR)."""
    return LossGate(bf16["mean"], bf16["stdev"], bf16["runs"], GATE_FLOOR).limit


def repeated_plans(fp8_runs: list[dict], bf16: dict) -> list[dict]:
    """Each FP8 plan that several runs trained (the same arm and options, backend and FP8 share): its runs' final
    losses, their mean against the BF16 mean, the gate on that mean, and how many of its runs passed. A plan whose
    runs end near the gate's limit passes or fails by chance run by run; the mean of its runs says where it lies."""
    plans: dict[tuple, list[dict]] = {}
    for r in fp8_runs:
        plans.setdefault((r["run"], r.get("backend"), r["fp8_flop_share"]), []).append(r)
    out = []
    for (name, backend, share), runs in plans.items():
        if len(runs) > 1:
            mean = statistics.fmean(r["final_loss"] for r in runs)
            placed = place(mean, bf16)
            out.append({"run": name, "backend": backend, "fp8_flop_share": share,
                        "final_losses": [r["final_loss"] for r in runs], "mean": mean,
                        "gap_to_mean": placed["gap_to_mean"], "gate": placed["gate"],
                        "passed_runs": sum(r["gate"] == "pass" for r in runs)})
    return out


def repeated_plans_markdown(plans: list[dict]) -> str:
    """repeated_plans' table, after the FP8 runs' ('' where no plan ran twice)."""
    if not plans:
        return ""
    rows = [[p["run"], p["backend"] or "-", _share_cell(p["fp8_flop_share"]),
             ", ".join(f"{loss:.4f}" for loss in p["final_losses"]), f"{p['mean']:.4f}", f"{p['gap_to_mean']:+.2%}",
             f"{p['passed_runs']} of {len(p['final_losses'])}", p["gate"] or "-"] for p in plans]
    return ("\n\nPlans run more than once (the mean of their runs' final losses against the gate):\n\n"
            + markdown_table(["FP8 run", "backend", "FP8 share of GEMM FLOPs", "final losses", "mean",
                              "vs BF16 mean", "runs passing", "gate on the mean"], rows))


def validation_band(bf16_runs: list[dict], fp8_runs: list[dict]) -> tuple[dict | None, list[dict]]:
    """The BF16 runs' band of validation losses (the held-out split's loss at the end) where every BF16 run has one,
    and each FP8 run with its gap to that band's mean (None where either is missing). Beside the gate, not in it:
    the gate is on the training loss, as the issue sets it."""
    losses = [r["val_loss"] for r in bf16_runs]
    if len(losses) < 2 or None in losses:
        return None, [{**r, "val_gap_to_mean": None} for r in fp8_runs]
    val = band(losses)
    return val, [{**r, "val_gap_to_mean": None if r["val_loss"] is None else r["val_loss"] / val["mean"] - 1.0}
                 for r in fp8_runs]


def _loss_cell(loss: float | None, gap: float | None = None) -> str:
    """'0.8297', with its gap to the BF16 mean where given, '-' where unmeasured."""
    if loss is None:
        return "-"
    return f"{loss:.4f}" + (f" ({gap:+.2%})" if gap is not None else "")


def _share_cell(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def past_one_pass(sources: list[dict]) -> list[str]:
    """The files whose runs read their training text more than once (they memorise it: not a loss gate)."""
    return [Path(s["file"]).name for s in sources if (s.get("train_split_passes") or 0) > 1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.loss_band", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, default=[], help="A/B evidence files (.json) of one setting")
    parser.add_argument("--label", help="names the evidence: loss-band-<model>-<label>-<device> (required)")
    parser.add_argument("--out-dir", default="profiles", help="where the evidence goes (default: profiles)")
    add_force_option(parser)
    add_plot_only_option(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        refuse_flags_beside_plot_only(parser, args)
        return plot_only("loss_band", args.plot_only, is_band_record, draw)
    if not args.files or not args.label:
        parser.error("give the A/B evidence files of one setting and --label NAME (or --plot-only BAND.json)")
    try:
        settings, bf16_runs, fp8_runs, sources = load_runs(args.files)
        bf16 = band([r["final_loss"] for r in bf16_runs])
    except (OSError, KeyError, ValueError) as err:
        print(f"loss_band: error: {err}", file=sys.stderr)
        return 2
    fp8_runs = [{**r, **place(r["final_loss"], bf16)} for r in fp8_runs]
    val, fp8_runs = validation_band(bf16_runs, fp8_runs)
    bf16_late_norm, fp8_runs = late_norm_gaps(bf16_runs, fp8_runs)
    drift_rows, fp8_runs = drift(bf16_runs, fp8_runs)
    plans = repeated_plans(fp8_runs, bf16)
    stem = f"loss-band-{settings['model']}-{args.label}-{device_slug(settings['device'])}"
    claim_or_exit("loss_band", stem, args.out_dir, args.force)
    memorised = past_one_pass(sources)
    gate = (f"The one-sided gate passes a final loss up to {gate_limit(bf16):.4f} (the mean + max({GATE_FLOOR:.2%}, "
            f"{GATE_STDEVS:g} standard deviations))" if bf16["runs"] >= GATE_MIN_RUNS else
            f"No gate: it needs at least {GATE_MIN_RUNS} BF16 runs")
    gate += (f"; NOT A GATE: {', '.join(memorised)} read the training text more than once (the runs memorise it): "
             "rerun with more text (--max-data-bytes) or fewer tokens" if memorised else "")
    summary = (f"{bf16['runs']} BF16 runs: final loss mean {bf16['mean']:.4f}, {bf16['min']:.4f} to {bf16['max']:.4f} "
               f"(span {bf16['span']:.2%} of the mean), standard deviation {bf16['stdev']:.4f} "
               f"({bf16['stdev'] / bf16['mean']:.2%}). {gate}.\n\n")
    if val is not None:
        summary += (f"Validation loss (the held-out split at the end; beside the gate, not in it): BF16 mean "
                    f"{val['mean']:.4f}, {val['min']:.4f} to {val['max']:.4f}, standard deviation "
                    f"{val['stdev'] / val['mean']:.2%} of the mean.\n\n")
    if bf16_late_norm is not None:
        summary += clipping_summary(settings["grad_clip"], bf16_runs, fp8_runs, bf16_late_norm)
    markdown = (f"Computed on this machine from {len(sources)} A/B files whose runs were measured on "
                f"{settings['device']} (their dates and commands are in the JSON). Settings: "
                f"{', '.join(f'{k} {v}' for k, v in settings.items() if k != 'device')}. Final loss = mean training "
                "loss over the last 10% of steps (as `fp8stack ab` computes it).\n\n" + summary
                + markdown_table(["file", "run", "final loss", "validation loss", "steps clipped",
                                  "grad norm, last quarter"],
                                 [[r["file"], r["run"], f"{r['final_loss']:.4f}", _loss_cell(r["val_loss"]),
                                   _share_cell(r["clipped_share"]), _loss_cell(r["late_grad_norm"])]
                                  for r in bf16_runs]) + "\n"
                + markdown_table(["file", "FP8 run", "FP8 share of GEMM FLOPs", "final loss", "vs BF16 mean",
                                  "BF16 std devs", "position", "gate", "validation loss (vs BF16 mean)",
                                  "steps clipped", "grad norm, last quarter (vs BF16 mean)"],
                                 [[r["file"], r["run"], _share_cell(r["fp8_flop_share"]), f"{r['final_loss']:.4f}",
                                   f"{r['gap_to_mean']:+.2%}",
                                   f"{r['stdevs']:+.1f}", r["position"],
                                   f"{r['gate'] or '-'}{' (not a gate)' if memorised and r['gate'] else ''}",
                                   _loss_cell(r["val_loss"], r["val_gap_to_mean"]), _share_cell(r["clipped_share"]),
                                   _loss_cell(r["late_grad_norm"], r["late_norm_gap"])]
                                  for r in fp8_runs]) + repeated_plans_markdown(plans)
                + drift_markdown(drift_rows, fp8_runs))
    payload = {"settings": settings, "sources": sources, "bf16_band": bf16, "gate_limit": gate_limit(bf16),
               "bf16_validation_band": val, "bf16_late_grad_norm": bf16_late_norm, "memorised": memorised,
               "bf16_runs": bf16_runs, "fp8_runs": fp8_runs, "repeated_plans": plans, "drift": drift_rows}
    json_path, md_path = write_evidence(stem, payload, markdown, out_dir=args.out_dir, replace=True)
    png = write_plot(json_path, draw)
    print(summary + f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
