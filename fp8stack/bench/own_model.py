"""A user's own model through the public API against fp8stack's own trainer, in one A/B-style run: the
torchtitan-layout Llama of examples/own_model (its BF16 script, torchao tensorwise applied by hand, and the five
fp8stack lines) beside `python -m fp8stack.train` with its fastest flags, at llama-1b-like shapes, each arm a fresh
process, every arm's tokens/s read the same way (the median of its steady-state step times).

    python -m fp8stack.bench.own_model --steps 12
    python -m fp8stack.bench.own_model --steps 20 --profile    # and where each arm's step time goes

Writes profiles/runs/<date>-own-model-<device>/own-model-<device>.json, .md and .png, with each target's ratio:
the own model with fp8stack at >= 0.95x the trainer's tokens/s (delayed and blockwise) and >= 1.15x torchao by hand.

--profile: after its timed run, each chosen arm runs again in a fresh process under fp8stack.bench.profile_script,
PROFILE_WARMUP_STEPS unprofiled steps then PROFILED_STEPS profiled ones, and the evidence gets each arm's breakdown
per step: kernel time by category, top kernels, GPU idle time and its longest gaps, and the host's top ops by self CPU
time with their calls per step. The tokens/s stay the timed runs' (the profiler slows a step), and the profiled runs
are the timed ones' commands with fewer steps. Not profiled: an arm whose timed run failed, and the --earlier-tree
arms (their trees may lack the profiler wrapper). --memory (with --profile, on a GPU) adds each arm's first profiled
step's memory peak and the code holding it (profile_script --memory): where one arm's memory goes beside another's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fp8stack.ab.plot import pyplot, save_figure
from fp8stack.bench.profile_script import breakdown_markdown
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.profile import MemoryPeak, RunProfile, memory_table
from fp8stack.train.timing import relative_spread, steady_state

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_model"
SHAPE = {"model": "llama-1b-like", "micro_batch": 2, "accumulation": 8}
"""llama-1b-like at micro-batch 2, 8 micro-batches per step (global batch 16), sequence 4096."""

TRAINER_FASTEST = ["--backend", "te", "--sdpa-backend", "cudnn", "--fuse-norm", "--fuse-mlp",
                   "--gradient-accumulation-fusion", "--compile", "--param-dtype", "bf16"]
"""fp8stack's own trainer with its fastest measured flags."""

ARMS = {
    "trainer delayed": ("trainer", "delayed"),
    "own bf16": ("train_bf16.py", "bf16"),
    "own torchao tensorwise by hand": ("train_torchao.py", "tensorwise"),
    "own fp8stack delayed": ("train_fp8stack.py", "delayed"),
    "trainer blockwise": ("trainer", "blockwise"),
    "own fp8stack blockwise": ("train_fp8stack.py", "blockwise"),
}
"""Arm -> (what runs it: the trainer or a script of examples/own_model, recipe)."""

PROFILE_WARMUP_STEPS, PROFILED_STEPS = 3, 5
"""--profile: each arm's profiled run's unprofiled steps (compilation, allocator, scales), then its profiled ones."""
PROFILE_TIMEOUT_FACTOR = 2
"""A profiled run may take this many times --timeout: reading the profiler's record takes about as long again."""

TARGETS = (
    ("own fp8stack delayed", "trainer delayed", 0.95),
    ("own fp8stack delayed", "own torchao tensorwise by hand", 1.15),
    ("own fp8stack blockwise", "trainer blockwise", 0.95),
)
"""(arm, against, the least tokens/s ratio that meets the target)."""


EARLIER = "trainer delayed, code of"
"""The arms running the trainer of other source trees (--earlier-tree), to tell a change from the machine."""


def runner_and_recipe(arm: str) -> tuple[str, str]:
    """What runs `arm` and with which recipe: ARMS', and the trainer's delayed for an --earlier-tree arm."""
    return ARMS.get(arm, ("trainer", "delayed"))


def command(arm: str, steps: int, result: Path) -> list[str]:
    runner, recipe = runner_and_recipe(arm)
    if runner == "trainer":
        return [sys.executable, "-m", "fp8stack.train", "--model", SHAPE["model"], "--fp8-recipe", recipe,
                "--micro-batch-size", str(SHAPE["micro_batch"]),
                "--global-batch-size", str(SHAPE["micro_batch"] * SHAPE["accumulation"]), *TRAINER_FASTEST,
                "--train-iters", str(steps), "--lr", "3e-4", "--lr-warmup-iters", "2", "--eval-iters", "0",
                "--no-progress", "--result-json", str(result)]
    return [sys.executable, str(EXAMPLE / runner), "--model", SHAPE["model"], "--recipe", recipe,
            "--micro-batch", str(SHAPE["micro_batch"]), "--accumulation", str(SHAPE["accumulation"]),
            "--steps", str(steps), "--result-json", str(result)]


def profile_command(arm: str, out: Path, result: Path, memory: bool = False) -> list[str]:
    """The arm's own command for exactly the steps it profiles, under fp8stack.bench.profile_script writing `out`.
    The trainer arm runs there too (its `-m fp8stack.train ...`) rather than under `fp8stack profile`, which drives the
    trainer's steps itself from its own configuration flags and profiles a BF16 run first: so every arm is profiled
    as the same process its timed run was, cut into steps at the same optimizer-step boundaries."""
    argv = command(arm, PROFILE_WARMUP_STEPS + PROFILED_STEPS, result)
    return [sys.executable, "-m", "fp8stack.bench.profile_script", "--warmup-steps", str(PROFILE_WARMUP_STEPS),
            "--steps", str(PROFILED_STEPS), *(["--memory"] if memory else []), "--out", str(out), "--", *argv[1:]]


def run_process(argv: list[str], timeout: float, wrote: Path, tree: Path | None = None) -> str | None:
    """argv in a fresh process, as every arm runs (its fp8stack imported from `tree` when given): None when it ended
    well and wrote `wrote`, else what went wrong (its output's tail)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])} if tree else None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tree or REPO, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    return (done.stderr or done.stdout)[-3000:] if done.returncode or not wrote.is_file() else None


def run_arm(arm: str, steps: int, timeout: float, tree: Path | None = None) -> dict:
    """One arm in a fresh process (its fp8stack imported from `tree` when given): its tokens/s, spread, peak memory
    and losses, or its error."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        argv = command(arm, steps, result)
        error = run_process(argv, timeout, result, tree)
        if error is not None:
            return {"arm": arm, "command": argv, "error": error}
        measured = json.loads(result.read_text())
    steady = steady_state(measured["step_ms"])
    return {"arm": arm, "command": argv, "recipe": runner_and_recipe(arm)[1],
            "tokens_per_s": measured["tokens_per_step"] / statistics.median(steady) * 1000,
            "spread": relative_spread(steady), "peak_mem_gib": measured["peak_mem_gib"],
            "losses": measured["losses"], "step_ms": measured["step_ms"]}


def profile_arm(arm: str, timeout: float, memory: bool = False) -> dict:
    """The arm's profiled run (profile_command) in a fresh process: its breakdown per step (fp8stack.profile's
    RunProfile as a dict) and, with memory, its first profiled step's memory peak (MemoryPeak as a dict); or its
    error."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        argv = profile_command(arm, out, Path(folder) / "result.json", memory)
        error = run_process(argv, timeout * PROFILE_TIMEOUT_FACTOR, out)
        if error is not None:
            return {"profile_command": argv, "profile_error": error}
        written = json.loads(out.read_text())
        return {"profile_command": argv, "profile": written["profile"],
                **({"memory": written["memory"]} if written.get("memory") else {})}


def targets(arms: dict[str, dict]) -> list[dict]:
    rows = []
    for arm, against, least in TARGETS:
        a, b = arms.get(arm, {}), arms.get(against, {})
        ratio = a["tokens_per_s"] / b["tokens_per_s"] if "tokens_per_s" in a and "tokens_per_s" in b else None
        rows.append({"arm": arm, "against": against, "target": least, "ratio": ratio,
                     "met": None if ratio is None else ratio >= least})
    return rows


def render(record: dict) -> str:
    rows = [[a["arm"], a.get("recipe", "-"),
             f"{a['tokens_per_s']:,.0f}" if "tokens_per_s" in a else "failed",
             f"{a['spread']:.1%}" if "spread" in a else "-",
             f"{a['peak_mem_gib']:.2f}" if a.get("peak_mem_gib") else "-",
             f"{a['losses'][0]:.3f} -> {a['losses'][-1]:.3f}" if a.get("losses") else a.get("error", "")[-200:]]
            for a in record["arms"]]
    table = markdown_table(["arm", "recipe", "tokens/s", "step spread (IQR)", "peak GiB", "loss first -> last"], rows)
    verdicts = markdown_table(["arm", "against", "tokens/s ratio", "target", "met"],
                              [[t["arm"], t["against"], f"{t['ratio']:.3f}" if t["ratio"] else "-",
                                f">= {t['target']}", {True: "yes", False: "no", None: "not measured"}[t["met"]]]
                               for t in record["targets"]])
    shape = record["shape"]
    text = (f"{shape['model']}, micro-batch {shape['micro_batch']}, {shape['accumulation']} micro-batches per step, "
            f"{record['steps']} steps per arm, each arm a fresh process; tokens/s from the median of the "
            "steady-state step times.\n\n" + table + "\n" + verdicts)
    return text + render_profiles(record) if record.get("profile") else text


def render_profiles(record: dict) -> str:
    """--profile's section: the arms' breakdowns side by side, then each arm's top kernels, GPU waits and host ops."""
    settings = record["profile"]
    profiled = {a["arm"]: RunProfile.from_dict(a["profile"]) for a in record["arms"] if "profile" in a}
    failed = [f"- {a['arm']}: {a['profile_error'][-300:]}" for a in record["arms"] if "profile_error" in a]
    text = (f"\n## Where each arm's step goes (--profile)\n\nEach arm again in a fresh process under "
            f"fp8stack.bench.profile_script: {settings['warmup_steps']} unprofiled optimizer steps, then "
            f"{settings['steps']} profiled; per profiled step. The wall times carry the profiler's overhead: the "
            "tokens/s above are the unprofiled runs'.\n\n")
    text += breakdown_markdown(profiled) if profiled else "No arm was profiled.\n"
    for arm in (a for a in record["arms"] if a.get("memory")):
        text += (f"\n### {arm['arm']}: memory of its first profiled step (--memory)\n\n"
                 + memory_table(MemoryPeak.from_dict(arm["memory"]), markdown_table))
    return text + ("\nProfiles that failed:\n\n" + "\n".join(failed) + "\n" if failed else "")


def draw(record: dict):
    """The arms' tokens/s as horizontal bars, half the steady-state spread as error bars."""
    measured = [a for a in record["arms"] if "tokens_per_s" in a]
    figure, axes = pyplot().subplots(figsize=(9, 4))
    speeds = [a["tokens_per_s"] for a in measured]
    errors = [a["spread"] * s / 2 for a, s in zip(measured, speeds)]
    axes.barh([a["arm"] for a in measured], speeds, xerr=errors, color="tab:blue")
    axes.set_xlabel("tokens/s (error bar: half the steady-state IQR)")
    axes.invert_yaxis()
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds an arm may take")
    parser.add_argument("--out-dir", type=Path, default=REPO / "profiles",
                        help="evidence folder; the run goes in its runs/<date>-<name>/ (default: profiles)")
    parser.add_argument("--label", default="", help="added to the evidence's name, own-model-<label>-<device> (a "
                                                    "second run of the same day)")
    parser.add_argument("--earlier-tree", type=Path, action="append", default=[],
                        help="also run the trainer (delayed) of this source tree (repeatable)")
    parser.add_argument("--profile", action="store_true",
                        help=f"also profile each chosen arm, in a fresh process after its timed run: "
                             f"{PROFILE_WARMUP_STEPS} + {PROFILED_STEPS} steps under fp8stack.bench.profile_script")
    parser.add_argument("--memory", action="store_true",
                        help="with --profile: also record each arm's first profiled step's CUDA allocations "
                             "(fp8stack.bench.profile_script --memory): its memory peak and the code holding it")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if args.memory and not args.profile:
        parser.error("--memory records the profiled runs' allocations: add --profile")
    chosen = [arm.strip() for arm in args.arms.split(",")]
    unknown = [arm for arm in chosen if arm not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: use {', '.join(ARMS)}")
    stem = "-".join(filter(None, ("own-model", args.label, device_slug())))
    claim_or_exit(parser.prog, stem, args.out_dir, args.force)
    runs = [(arm, None) for arm in chosen] + [(f"{EARLIER} {tree}", tree) for tree in args.earlier_tree]
    arms = {}
    for arm, tree in runs:
        arms[arm] = run_arm(arm, args.steps, args.timeout, tree)
        print(f"{arm}: {arms[arm].get('tokens_per_s', arms[arm].get('error', '')[-300:])}", flush=True)
        if args.profile and tree is None and "error" not in arms[arm]:
            arms[arm].update(profile_arm(arm, args.timeout, args.memory))
            print(f"{arm} profiled: " + (f"wall {arms[arm]['profile']['wall_ms_per_step']:.1f} ms/step"
                                         if "profile" in arms[arm] else arms[arm]["profile_error"][-300:]), flush=True)
    record = {"shape": SHAPE, "steps": args.steps, "trainer_flags": TRAINER_FASTEST, "arms": list(arms.values()),
              "targets": targets(arms),
              "earlier_trees": [str(tree) for tree in args.earlier_tree],
              "profile": {"warmup_steps": PROFILE_WARMUP_STEPS, "steps": PROFILED_STEPS, "memory": args.memory}
              if args.profile else None}
    json_path, _ = write_evidence(stem, record, render(record), out_dir=args.out_dir, replace=args.force)
    save_figure(lambda: draw(record), json_path.with_suffix(".png"))
    print(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
