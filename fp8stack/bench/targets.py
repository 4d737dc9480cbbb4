"""The FP8 targets (speed, memory, blockwise, MoE, quantize overhead, loss) against the evidence files that
measured them, read on any machine:

    python -m fp8stack.bench.targets --label h200 --ab profiles/runs/*/ab-...-h200.json [...] \\
        --experts profiles/runs/*/backends-...-h200.json --profile profiles/runs/*/profile-...-h200.json \\
        --loss-band profiles/runs/*/loss-band-...-h200.json

Per target: the best value the files hold, the file and arm it comes from, and met / not met / inconclusive (a
loss gap beyond the tolerance while the FP8 run lies among the BF16 runs, whose own spread exceeds it).
Ratios are against each A/B file's reference arm (`fp8stack ab`'s baseline: the fastest of its BF16
configurations). Only a file whose BF16 configurations include the fastest one known (--fastest-bf16: plain and on
TE; --param-dtypes with bf16: BF16 parameters with FP32 masters, 1-2% faster than FP32 ones) can
show a target met; any other file can show it not met (its reference is no faster than the fastest), and a row
that would be met says "not judged". Where other files repeat
the chosen arm (same name and settings), the row lists them and, when they straddle the limit, reads "met in k of n
runs". Writes profiles/runs/<date>-targets-<model>-<label>-<device>/ (.json and .md).
"""

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8stack.ab.verdicts import BF16_ON_TE_ARM, is_bf16_arm
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.plan.recipes import BF16, get_recipe, is_fp8


@dataclass(frozen=True)
class Target:
    """One FP8 target."""

    key: str
    """Short name, the row's id."""
    what: str
    """What is measured, in words."""
    limit: float
    """The target value."""
    at_least: bool
    """True: the value must be >= limit (a speed-up); False: <= limit (memory, overhead, loss gap)."""

    def met(self, value: float) -> bool:
        return value >= self.limit if self.at_least else value <= self.limit


TARGETS = {t.key: t for t in (
    Target("speed", "fastest FP8 arm, tokens/s over the reference BF16 arm", 1.45, True),
    Target("memory", "peak memory of that fastest arm over the reference's", 0.90, False),
    Target("memory-lean", "the FP8 arm with the lowest peak memory over the reference's (its speed beside)", 0.90,
           False),
    Target("blockwise", "fastest blockwise (1x128 / 128x128) arm, tokens/s over the reference", 1.30, True),
    Target("moe", "grouped blockwise FP8 expert GEMM (w13, fwd+bwd) over the BF16 grouped GEMM", 1.75, True),
    Target("quantize", "quantize + scale overhead over GEMM time in the FP8 profile (fused norm and activation "
                       "kernels by their excess over BF16's)", 0.10, False),
    Target("bound", "the profiled recipe's arm, tokens/s over the reference, as a share of the profile's Amdahl bound "
                    "at the FP8 GEMM speed-up it measured", 0.97, True),
    Target("loss", "FP8 final loss after 2 000 steps over the BF16 runs' mean, relative; one-sided: passes up to "
                   "max(0.25 %, 2 standard deviations of >= 3 BF16 runs) above it (fp8stack.bench.loss_band)", 0.0025,
           False),
)}


def ab_arms(path: Path) -> list[dict]:
    """Each FP8 arm of an A/B file with its tokens/s and peak memory over the file's reference arm."""
    record = json.loads(path.read_text())
    arms = [a for a in record["arms"] if a.get("tokens_per_s")]
    reference = next((a for a in arms if a.get("verdict") == "baseline"), None)
    if reference is None:
        raise ValueError(f"{path} has no reference (baseline) arm that ran: nothing to compare the FP8 arms with")
    settings = ab_settings(record)
    levers = settings["recompute"]
    # Files of one blockwise run with --blockwise-gemms deepgemm named it blockwise; later ones, blockwise on deepgemm.
    on_deepgemm = settings["blockwise_gemms"] == "deepgemm"
    missing = [flag for flag, given in (("--fastest-bf16", settings["fastest_bf16"]),
                                        ("--param-dtypes bf16", "bf16" in settings["param_dtypes"]))
               if not given]
    note = f"reference not the fastest BF16 configuration: run without {' and '.join(missing)}" if missing else ""
    return [{"file": path.name, "arm": a["recipe"] + (f", recompute {','.join(levers)}" if levers else "")
             + (", GEMMs on DeepGEMM" if on_deepgemm and get_recipe(plan_recipe(a["recipe"])).gemms_on_deepgemm
                else ""),
             "recipe": plan_recipe(a["recipe"]),
             "reference": reference["recipe"], "reference_without": missing, "note": note,
             "setup": settings["setup"], "device": record["device"],
             "model": record["model"],
             "speedup": a["tokens_per_s"] / reference["tokens_per_s"],
             "memory": a["peak_mem_gib"] / reference["peak_mem_gib"]}
            for a in arms if not is_bf16_arm(a["recipe"])]


def ab_settings(record: dict) -> dict:
    """What ab_arms reads of an A/B file's train_config: the recompute lever (modules), blockwise_gemms, whether the
    BF16 configurations included the fastest (bf16 on TE, BF16 parameters), and the settings as one JSON text, so
    that repeats of one arm in several files are seen as such (the GEMM library is in the arm's name, so not in it).
    Files of the configuration tree hold {"job": sections, "ab": the A/B's options}; earlier ones, flat fields."""
    config = record["train_config"]
    if "job" not in config:
        return {"recompute": config.get("fp8_recompute"), "blockwise_gemms": config.get("blockwise_gemms"),
                "fastest_bf16": config.get("fastest_bf16"), "param_dtypes": config.get("param_dtypes", ()),
                "setup": json.dumps({k: v for k, v in config.items() if k != "blockwise_gemms"}, sort_keys=True)}
    job, ab = config["job"], config["ab"]
    checkpointed = job["activation_checkpoint"]
    return {"recompute": checkpointed["modules"] if checkpointed["layers"] else None,
            "blockwise_gemms": ab["blockwise_gemms"],
            "fastest_bf16": any(a["recipe"].startswith(BF16_ON_TE_ARM) for a in record["arms"]),
            "param_dtypes": ab["param_dtypes"] or (job["training"]["param_dtype"],),
            "setup": json.dumps({"job": job, "ab": {k: v for k, v in ab.items() if k != "blockwise_gemms"}},
                                sort_keys=True)}


def plan_recipe(arm: str) -> str:
    """The plan recipe an A/B arm ran: its name up to the GEMM library (' on deepgemm') or parameter dtype (', bf16
    params')."""
    return arm.split(",")[0].split(" on ")[0]


def ab_rows(arms: list[dict]) -> list[dict]:
    """The speed, memory, memory-lean and blockwise rows from every A/B file's FP8 arms."""
    if not arms:
        raise ValueError("the A/B files hold no FP8 arm that ran")
    # Arms judged against the fastest BF16 configuration first: a higher ratio over plain BF16 proves nothing.
    fastest = max(arms, key=lambda a: (not a["note"], a["speedup"]))
    leanest = min(arms, key=lambda a: (bool(a["note"]), a["memory"]))
    rows = [arm_row("speed", "speedup", fastest, arms),
            arm_row("memory", "memory", fastest, arms),
            arm_row("memory-lean", "memory", leanest, arms, f"{leanest['speedup']:.3f}x tokens/s.")]
    blockwise = [a for a in arms if is_fp8(a["recipe"]) and get_recipe(a["recipe"]).block_scaled]
    if blockwise:
        best = max(blockwise, key=lambda a: (not a["note"], a["speedup"]))
        rows.append(arm_row("blockwise", "speedup", best, arms))
    return rows


def arm_row(key: str, measure: str, arm: dict, arms: list[dict], note: str = "") -> dict:
    """The row of `arm`'s `measure`: 'met' only against a --fastest-bf16 reference (arm note empty), and, where
    other files repeat the arm (same name and settings), in how many of its runs: the best of several runs alone
    would hide a target met once and missed once."""
    target, value = TARGETS[key], arm[measure]
    repeats = [a for a in arms if a is not arm and (a["arm"], a["setup"], a["note"]) == (arm["arm"], arm["setup"],
                                                                                          arm["note"])]
    runs_met = sum(target.met(a[measure]) for a in [arm, *repeats])
    if repeats:
        note += " Repeats: " + ", ".join(f"{render(a[measure], key)} ({a['file']})" for a in repeats) + "."
    status = None
    if arm["note"] and target.met(value):
        status = "not judged"
    elif runs_met and runs_met <= len(repeats):
        status = f"met in {runs_met} of {len(repeats) + 1} runs"
    return row(key, value, arm, f"{note} {arm['note']}", status)


def row(key: str, value: float, source: dict, note: str = "", status: str | None = None) -> dict:
    target = TARGETS[key]
    return {"target": key, "what": target.what, "limit": target.limit, "at_least": target.at_least, "value": value,
            "status": status or ("met" if target.met(value) else "not met"), "file": source["file"],
            "arm": source["arm"], "reference": source.get("reference", ""), "note": note.strip()}


def experts_row(path: Path) -> dict:
    """The best grouped blockwise FP8 w13 entry at MoE target's expert shape of a backends file."""
    record = json.loads(path.read_text())
    entries = [e for e in record.get("grouped", []) if e.get("source") == "issue-7" and e.get("gemm") == "w13"
               and is_fp8(e.get("recipe", BF16)) and get_recipe(e["recipe"]).block_scaled
               and e.get("speedup_vs_bf16")]
    if not entries:
        raise ValueError(f"{path} has no timed blockwise w13 entry at the MoE target's expert shape")
    best = max(entries, key=lambda e: e["speedup_vs_bf16"])
    others = ", ".join(f"{describe(e)} {e['speedup_vs_bf16']:.3f}x" for e in entries if e is not best)
    return row("moe", best["speedup_vs_bf16"], {"file": path.name, "arm": describe(best), "reference": "bf16"},
               f"others: {others}" if others else "")


def describe(entry: dict) -> str:
    options = ", ".join(f"{k} {v}" for k, v in (entry.get("options") or {}).items())
    return f"{entry['module']}" + (f" ({options})" if options else "")


def profile_row(path: Path) -> dict:
    """The quantize row: quantize time net of fused norm and activation work (fp8stack.profile.quantize_overhead)
    over GEMM time, from the file's own figure, or, in files written before it, derived from each run's top
    kernels (families outside them subtract nothing: never an understatement); the whole-kernel share beside."""
    from fp8stack.profile import amdahl_bound, family_ms, fused_note, measured_gemm_speedup, quantize_overhead

    record = json.loads(path.read_text())
    overhead, derived = record.get("quantize_overhead_over_gemm"), ""
    if overhead is None:
        fp8, bf16 = record["runs"][record["recipe"]], record["runs"]["bf16"]
        fp8_top, bf16_top = (family_ms([(k["name"], k["ms_per_step"]) for k in run["top_kernels"]])
                             for run in (fp8, bf16))
        overhead_ms, fused = quantize_overhead(fp8["categories"]["quantize"]["ms_per_step"], fp8_top, bf16_top)
        overhead = overhead_ms / fp8["categories"]["gemm"]["ms_per_step"]
        derived = f" Derived here from each run's top {len(fp8['top_kernels'])} kernels: {fused_note(fused)}"
    bound = f"Amdahl bound of this configuration at a 2x FP8 GEMM: {record['amdahl_bound']:.3f}x"
    if "runs" in record:  # the bound at the speed-up the profile measured (computed here for older files too)
        bf16_gemm, fp8_gemm = (record["runs"][r]["categories"]["gemm"]["ms_per_step"] for r in (BF16, record["recipe"]))
        speedup = measured_gemm_speedup(bf16_gemm, fp8_gemm, record["fp8_share_of_gemm_flops"])
        if speedup:
            bound += (f"; at the FP8 GEMMs' measured {speedup:.2f}x: "
                      f"{amdahl_bound(record['gemm_share'], record['fp8_share_of_gemm_flops'], speedup):.3f}x")
    return row("quantize", overhead, {"file": path.name, "arm": record["recipe"]},
               f"whole quantize kernels {record['quantize_over_gemm']:.2%} of GEMM time.{derived} {bound}")


def bound_row(path: Path, arms: list[dict]) -> dict:
    """The A/B's arm of the profiled recipe (its fastest, where files repeat it) over the profile's Amdahl bound at
    the measured FP8 GEMM speed-up."""
    record = json.loads(path.read_text())
    bound = record.get("amdahl_bound_at_measured_speedup")
    same = [a for a in arms if a["arm"] == record["recipe"]]
    if not bound or not same:
        raise ValueError(f"{path} and the A/B files give no bound check: it needs the profile's bound at its measured "
                         f"GEMM speed-up and an A/B arm named {record['recipe']!r}")
    best = max(same, key=lambda a: a["speedup"])
    return row("bound", best["speedup"] / bound, {"file": best["file"], "arm": best["arm"]},
               f"{best['speedup']:.3f}x over {best['reference']} against the bound {bound:.3f}x of {path.name}")


def loss_rows(path: Path) -> list[dict]:
    """Each FP8 run of a loss-band file under its one-sided gate (met: at most the gate's limit, ending below BF16
    included); not judged where the band has no gate (fewer than 3 BF16 runs) or its runs memorised the text."""
    record = json.loads(path.read_text())
    band = record["bf16_band"]
    rows = []
    for run in record["fp8_runs"]:
        gate = run.get("gate")
        status = ("not judged" if gate is None or record.get("memorised") else "met" if gate == "pass" else "not met")
        why = (f"; not a gate: {', '.join(record['memorised'])} read the training text more than once"
               if record.get("memorised") else "")
        rows.append(row("loss", run["gap_to_mean"], {"file": run["file"], "arm": run["run"], "reference": "BF16 mean"},
                        f"{band['runs']} BF16 runs, standard deviation {band['stdev'] / band['mean']:.2%} of their "
                        f"mean; gate limit {run.get('gate_limit', float('nan')):.4f}; {run['position']} (band file "
                        f"{path.name}){why}", status))
    return rows


def render(value: float, key: str) -> str:
    return f"{value:.2%}" if key in ("quantize", "loss") else f"{value:.3f}" if key == "bound" else f"{value:.3f}x"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ab", nargs="+", type=Path, required=True, help="A/B evidence files (speed, memory)")
    parser.add_argument("--experts", type=Path, help="a backends evidence file with the MoE target's expert shape")
    parser.add_argument("--profile", type=Path, help="a profile evidence file of the fastest FP8 configuration")
    parser.add_argument("--loss-band", type=Path, help="a loss-band file of the 2 000-step runs")
    parser.add_argument("--label", required=True, help="names the evidence: targets-<model>-<label>-<device>")
    parser.add_argument("--out-dir", default="profiles", help="where the evidence goes (default: profiles)")
    add_force_option(parser)
    args = parser.parse_args(argv)
    try:
        arms = [arm for path in args.ab for arm in ab_arms(path)]
        rows = ab_rows(arms)
        rows += [experts_row(args.experts)] if args.experts else []
        rows += [profile_row(args.profile), bound_row(args.profile, arms)] if args.profile else []
        rows += loss_rows(args.loss_band) if args.loss_band else []
    except (OSError, KeyError, ValueError) as err:
        print(f"targets: error: {err}", file=sys.stderr)
        return 2
    devices, models = {a["device"] for a in arms}, {a["model"] for a in arms}
    if len(devices) > 1 or len(models) > 1:
        print(f"targets: error: the A/B files are of several devices or models ({sorted(devices | models)})",
              file=sys.stderr)
        return 2
    (device,), (model,) = devices, models
    stem = f"targets-{model}-{args.label}-{device_slug(device)}"
    claim_or_exit("targets", stem, args.out_dir, args.force)
    rows.sort(key=lambda r: list(TARGETS).index(r["target"]))
    table = [[r["target"], ("≥ " if r["at_least"] else "≤ ") + render(r["limit"], r["target"]),
              render(r["value"], r["target"]), r["status"], f"`{r['file']}`", r["arm"], r["note"]] for r in rows]
    markdown = (f"Read on this machine from evidence files measured on {device} ({model}); each file has its own "
                "date, command and versions. Targets (TARGETS in fp8stack/bench/targets.py):\n\n"
                + "\n".join(f"- {t.key}: {t.what}" for t in TARGETS.values()) + "\n\n"
                + markdown_table(["target", "limit", "measured", "status", "file", "arm", "note"], table)
                + "\nEvery FP8 arm read:\n\n"
                + markdown_table(["file", "arm", "reference", "tokens/s over it", "peak memory over it"],
                                 [[f"`{a['file']}`", a["arm"],
                                   a["reference"] + (f" (run without {', '.join(a['reference_without'])})"
                                                     if a["reference_without"] else " (the fastest BF16 configuration)"),
                                   f"{a['speedup']:.3f}x",
                                   f"{a['memory']:.3f}x"] for a in arms]))
    payload = {"targets": [asdict(t) for t in TARGETS.values()], "rows": rows, "arms": arms,
               "sources": [str(p) for p in [*args.ab, args.experts, args.profile, args.loss_band] if p]}
    json_path, md_path = write_evidence(stem, payload, markdown, out_dir=args.out_dir, replace=True)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
