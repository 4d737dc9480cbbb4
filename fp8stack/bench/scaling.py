"""`python -m fp8stack.bench.scaling`: BF16 and the fast FP8 path on N GPUs under DDP and under FSDP2, against the
same runs on one GPU.

    python -m fp8stack.bench.scaling --nproc 2 [--model llama-1b-like] [--recipe delayed] [--steps 40]
                                     [--wrappers ddp,fsdp,fsdp_fp8_params] [-- <flags of every run>]
    python -m fp8stack.bench.scaling --nproc 2 --model llama3-8b --one-gpu-model llama3-8b-16-layers \
        --wrappers fsdp_gather_once -- --activation-checkpoint.layers all --micro-batch-size 1

Every run is a launch/train.sh run of the same model, recipe and seed with the configuration's defaults otherwise
(the measured fast path: BF16 parameters with FP32 masters, TE's fused weight-gradient accumulation and FP8 weight
cache where the wrapper keeps them, compile, cuDNN attention). Each rank trains the one-GPU run's micro-batch and
accumulation (weak scaling: the global batch grows with N), so a rank's compute is the one-GPU run's and what differs
is what the wrapper adds. Runs:
- one_gpu: NPROC=1, unwrapped, BF16 and the recipe, side by side (one per GPU when there are two); a model whose
  replica does not fit one GPU is set against --one-gpu-model, the same blocks at fewer layers (its FP8/BF16 is the
  reference; scaling efficiency, which compares tokens/s, is then not computed);
- each wrapper at NPROC=N, BF16 and the recipe, one after another:
  ddp (--parallelism.data-parallel ddp: a replica per GPU, FP32 main_grads averaged once per step),
  fsdp (FSDP2: sharded FP32 masters, BF16 all-gathered copies, FP32 reduce-scatter),
  fsdp_gather_once (fsdp with --no-parallelism.fsdp-reshard-after-forward: one all-gather per step),
  fsdp_fp8_params (fsdp with --param-dtype fp8: TE's FP8 weights all-gathered in FP8; the recipe only, as BF16 has
  no FP8 weights, beside fsdp's BF16 run even where fsdp is not asked for), fsdp_fp8_params_gather_once (both),
  fsdp_gather_once_fused (fsdp_gather_once with TE's fused weight-gradient accumulation, --te.gradient-accumulation-
  fusion, into FP32 buffers FSDP2 reduce-scatters; the recipe only, beside fsdp_gather_once's BF16 run).
TE keeps no FP8 weight cache under FSDP2 (it quantizes each gathered BF16 weight in every forward and backward)
unless the gathered weights stay over the step (the gather-once wrappers keep it: TEBackend.before_fully_shard); FP8
parameters gather what is already FP8. Nor does TE accumulate weight gradients into main_grad there.
one_gpu_fsdp2_bound (asked for like a wrapper) measures what both cost: one process, BF16 and the recipe, without
those two levers (--no-te.gradient-accumulation-fusion --no-te.cache-fp8-weights); each FSDP2 wrapper's FP8/BF16 is
then also judged against its ratio. one_gpu_uncached and one_gpu_unfused (BOUND_PARTS) drop one lever each: what each
costs, reported (one_gpu_unfused is the bound of the gather-once wrappers).
Judged: each wrapper's FP8/BF16 tokens/s within RATIO_TOLERANCE of one_gpu's (what the wrapper costs must not eat
FP8's gain; an FP8-parameter wrapper over its BF16-parameter twin's BF16 run, FP8_ONLY), and an FP8-parameter
wrapper's all-gather bytes over the transformer blocks at most ALL_GATHER_RATIO of its twin's with the same recipe
(FP8 travels as FP8). Reported: tokens/s of the whole job and per GPU, scaling efficiency (N-GPU
tokens/s over N one-GPU runs'), peak and resident memory of the fullest GPU, collectives per step. The evidence,
profiles/runs/<date>-scaling-<model>-<N>gpu-<gpu>/, holds them, the checks and every launch command, and with
matplotlib a figure of per-GPU tokens/s and the FP8/BF16 ratios against the one-GPU band; `--plot-only <json>` draws
the figure of a run measured before it existed.
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fp8stack.ab import chosen_names
from fp8stack.ab.plot import pyplot
from fp8stack.bench.data_parallel import ARMS as ONE_RANK_ARMS, BOUND, block_all_gather_bytes
from fp8stack.bench.launches import launch, run_record, start, wait
from fp8stack.bench.plots import (FIGURE_WIDTH, add_plot_only_option, figure_height, note_unmeasured, plot_only,
                                  refuse_flags_beside_plot_only, write_plot)
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.plan.recipes import BF16
from fp8stack.train.launch import on_gpu

PROG = "python -m fp8stack.bench.scaling"
ONE_GPU = "one_gpu"
"""The reference runs: one process, no wrapper."""
FSDP2_BOUND = "one_gpu_fsdp2_bound"
"""One process without the two TE levers FSDP2 takes away when it reshards after forward
(TEBackend.before_fully_shard): fused weight-gradient accumulation into main_grad and the FP8 weight cache. Its
FP8/BF16 is the most such an FSDP2 wrapper can reach with TE."""
BOUND_PARTS = {"one_gpu_uncached": ["--no-te.cache-fp8-weights"],
               "one_gpu_unfused": ["--no-te.gradient-accumulation-fusion"]}
"""One process without one of FSDP2_BOUND's two levers each, reported beside it (not judged): what each costs, so
that a way to keep one of them under FSDP2 can be weighed before it is built."""
WRAPPERS = {"ddp": ["--parallelism.data-parallel", "ddp"],
            "fsdp": ["--parallelism.data-parallel", "fsdp"],
            "fsdp_gather_once": ["--parallelism.data-parallel", "fsdp", "--no-parallelism.fsdp-reshard-after-forward"],
            "fsdp_fp8_params": ["--parallelism.data-parallel", "fsdp", "--param-dtype", "fp8"],
            "fsdp_fp8_params_gather_once": ["--parallelism.data-parallel", "fsdp", "--param-dtype", "fp8",
                                            "--no-parallelism.fsdp-reshard-after-forward"],
            "fsdp_gather_once_fused": ["--parallelism.data-parallel", "fsdp",
                                       "--no-parallelism.fsdp-reshard-after-forward",
                                       "--te.gradient-accumulation-fusion"],
            FSDP2_BOUND: ONE_RANK_ARMS[BOUND], **BOUND_PARTS}
"""Wrapper -> its flags beside the common ones, at NPROC=N (FSDP2_BOUND and BOUND_PARTS at NPROC=1)."""
DEFAULT_WRAPPERS = ("ddp", "fsdp", "fsdp_fp8_params")
FP8_ONLY = {"fsdp_fp8_params": "fsdp", "fsdp_fp8_params_gather_once": "fsdp_gather_once"}
"""Wrappers that hold FP8 weights, run with the recipe only -> the wrapper whose BF16 run their FP8/BF16 is over
(BF16 has no FP8 weights: FSDP2's BF16 run is what a user would otherwise train)."""
RECIPE_ONLY = {**FP8_ONLY, "fsdp_gather_once_fused": "fsdp_gather_once"}
"""Wrappers run with the recipe only -> the wrapper whose BF16 run their FP8/BF16 is over: FP8_ONLY's, and the TE
weight-gradient fusion (a TE lever: the BF16 run has no TE modules to fuse)."""
RATIO_TOLERANCE = 0.03
"""The target: |FP8/BF16 tokens/s under a wrapper on N GPUs - the same on one GPU| at most this."""
ALL_GATHER_RATIO = 0.55
"""The target: fsdp_fp8_params' all-gather bytes over the blocks at most this share of fsdp's (same recipe); the
root group (embeddings, final norm, output head) stays BF16 by plan rule 1 in both."""
PROFILED_STEPS = 2
"""Steps whose collectives are counted (steps 1 and 2; step 0 initialises lazily)."""


def runs(wrappers: Sequence[str], recipe: str) -> list[tuple[str, str]]:
    """(wrapper, recipe) of every run, the one-GPU pair first. A RECIPE_ONLY wrapper brings its twin's BF16 run, the
    run its FP8/BF16 is over, where the twin is not asked for."""
    recipes = (BF16, recipe)
    planned = [(ONE_GPU, r) for r in recipes]
    for wrapper in wrappers:
        if wrapper in RECIPE_ONLY:
            planned += [(RECIPE_ONLY[wrapper], BF16), (wrapper, recipe)]
        else:
            planned += [(wrapper, r) for r in recipes]
    return list(dict.fromkeys(planned))


def run_name(wrapper: str, recipe: str) -> str:
    return f"{wrapper}/{recipe}"


def is_single(wrapper: str) -> bool:
    """A run of one process: the reference, the FSDP2 bound or one of its parts."""
    return wrapper in (ONE_GPU, FSDP2_BOUND, *BOUND_PARTS)


def run_all(workdir: Path, planned: list[tuple[str, str]], nproc: int, common: Sequence[str], gpus: int,
            models: dict[str, str]) -> dict[str, dict]:
    """The one-process runs side by side, as many at once as there are GPUs (one after another without two), then
    the N-GPU runs one after another (their step times are compared). models: ONE_GPU's model and the wrapped runs'
    (key None)."""
    def flags(wrapper: str, recipe: str) -> list[str]:
        model = models[ONE_GPU if is_single(wrapper) else None]
        return ["--model", model, *common, "--fp8-recipe", recipe, *WRAPPERS.get(wrapper, [])]

    singles = [run for run in planned if is_single(run[0])]
    records = {}
    if gpus >= 2:
        for first in range(0, len(singles), gpus):
            started = [start(run_name(*run), workdir, 1, flags(*run), on_gpu(gpu))
                       for gpu, run in enumerate(singles[first:first + gpus])]
            records.update((run.name, run_record(run)) for run in map(wait, started))
    else:
        records.update((run_name(*run), run_record(launch(run_name(*run), workdir, 1, flags(*run))))
                       for run in singles)
    for run in planned:
        if not is_single(run[0]):
            records[run_name(*run)] = run_record(launch(run_name(*run), workdir, nproc, flags(*run)))
    return records


def judge(records: dict[str, dict], planned: list[tuple[str, str]], recipe: str, nproc: int, steps: int,
          same_model: bool = True) -> dict:
    """Per wrapper: FP8/BF16 against one GPU's, per-GPU tokens/s and scaling efficiency (same_model: the one-GPU
    runs trained the wrapped runs' model, not fewer layers of it); the all-gather ratio."""
    checks = {f"{name} ran {steps} steps": len(records[name].get("losses", ())) == steps
              for name in (run_name(*run) for run in planned)}
    tokens = {name: record["tokens_per_s"] for name, record in records.items() if "tokens_per_s" in record}
    figures: dict = {"per_gpu_tokens_per_s": {name: value / (1 if is_single(name.split("/")[0]) else nproc)
                                              for name, value in tokens.items()}}
    one = {r: tokens.get(run_name(ONE_GPU, r)) for r in (BF16, recipe)}
    figures["scaling_efficiency"] = {name: value / (nproc * one[name.split("/")[1]])
                                     for name, value in tokens.items()
                                     if same_model and not is_single(name.split("/")[0]) and one[name.split("/")[1]]}
    ratios = {wrapper: tokens[run_name(wrapper, recipe)] / tokens[run_name(RECIPE_ONLY.get(wrapper, wrapper), BF16)]
              for wrapper in dict.fromkeys(w for w, _ in planned)
              if run_name(wrapper, recipe) in tokens and run_name(RECIPE_ONLY.get(wrapper, wrapper), BF16) in tokens}
    figures["fp8_over_bf16"] = ratios
    for wrapper, ratio in ratios.items():
        if ONE_GPU in ratios and not is_single(wrapper):
            checks[f"{wrapper}: FP8/BF16 {ratio:.3f} within {RATIO_TOLERANCE} of one GPU's "
                   f"{ratios[ONE_GPU]:.3f}"] = abs(ratio - ratios[ONE_GPU]) <= RATIO_TOLERANCE
        if FSDP2_BOUND in ratios and wrapper.startswith("fsdp"):
            checks[f"{wrapper}: FP8/BF16 {ratio:.3f} within {RATIO_TOLERANCE} of the FSDP2 bound's "
                   f"{ratios[FSDP2_BOUND]:.3f} (one GPU without the TE levers FSDP2 takes away)"] = \
                abs(ratio - ratios[FSDP2_BOUND]) <= RATIO_TOLERANCE
    gathers = {}
    for fp8_params, twin in FP8_ONLY.items():
        fp8_gather = block_all_gather_bytes(records.get(run_name(fp8_params, recipe), {}))
        twin_run = records.get(run_name(twin, recipe)) or records.get(run_name(twin, BF16), {})
        bf16_gather = block_all_gather_bytes(twin_run)  # the twin gathers BF16 weights under either recipe
        if bf16_gather and fp8_gather:
            gathers[fp8_params] = fp8_gather / bf16_gather
            checks[f"{fp8_params}: blocks' all-gather bytes at most {ALL_GATHER_RATIO}x {twin}'s"] = \
                gathers[fp8_params] <= ALL_GATHER_RATIO
    figures["all_gather_bytes_fp8_over_bf16_blocks"] = gathers
    return {"figures": figures, "checks": checks}


def render(payload: dict) -> str:
    """The evidence's Markdown: a row per run, the ratios, the checks, the commands."""
    figures, nproc = payload.get("figures", {}), payload["nproc"]
    rows = []
    for name, record in payload["runs"].items():
        if "tokens_per_s" not in record:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "-", f"failed (exit {record.get('returncode')})"])
            continue
        collectives = record.get("collectives") or {}
        moved, calls = collectives.get("bytes", {}), collectives.get("counts", {})
        efficiency = figures.get("scaling_efficiency", {}).get(name)
        rows.append([name, record.get("world_size", "-"), f"{record['tokens_per_s']:,.0f}",
                     f"{figures['per_gpu_tokens_per_s'][name]:,.0f}", f"{efficiency:.3f}" if efficiency else "-",
                     f"{record['peak_mem_gib']:.2f}", _gib(record.get("resident_mem_gib")),
                     f"{moved.get('all_gather', 0) / 2**30:.2f} / {moved.get('reduce_scatter', 0) / 2**30:.2f}",
                     f"{calls.get('all_reduce', 0):g}", f"{record['losses'][-1]:.4f}"])
    table = markdown_table(["run", "ranks", "tokens/s", "tokens/s per GPU", f"scaling efficiency ({nproc} GPUs)",
                            "peak GiB (fullest GPU)", "resident GiB", "all-gather / reduce-scatter GiB per step",
                            "all-reduces per step", "last loss"], rows)
    ratios = markdown_table(["wrapper", "FP8/BF16 tokens/s"], [[wrapper, f"{ratio:.3f}x"] for wrapper, ratio in
                                                                 figures.get("fp8_over_bf16", {}).items()])
    gathers = "".join(f"{wrapper}'s all-gather bytes over the blocks, FP8 weights vs {FP8_ONLY[wrapper]}'s BF16 "
                      f"copies: {ratio:.3f}x.\n\n" for wrapper, ratio in
                      figures.get("all_gather_bytes_fp8_over_bf16_blocks", {}).items())
    checks = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in payload["checks"].items())
    commands = "\n".join(record["command"] for record in payload["runs"].values())
    reference = payload.get("one_gpu_model")
    reference = (f" The one-GPU runs trained {reference}, the same blocks at fewer layers (its replica fits one GPU): "
                 "their FP8/BF16 is the reference, and no scaling efficiency is computed." if reference else "")
    return (f"BF16 and {payload['recipe']} on {nproc} GPUs under each data-parallel wrapper and on one GPU: "
            f"{payload['model']}, {payload['steps']} steps per run, each rank training the one-GPU run's micro-batches "
            f"(weak scaling).{reference}\n\n{table}\n\n{ratios}\n\n{gathers}## Checks\n\n{checks}\n\n"
            f"## Launch commands (from the repository root)\n\n```\n{commands}\n```\n")


def _gib(value: float | None) -> str:
    """GiB to two decimals; '-' where the run did not record it."""
    return "-" if value is None else f"{value:.2f}"


RECIPE_COLOURS = {"bf16": "tab:gray", "fp8": "tab:blue"}


def figure(payload: dict):
    """Per-GPU tokens/s of every run (BF16 grey, FP8 blue), and each wrapper's FP8/BF16 ratio against one GPU's
    with the tolerance band around it."""
    plt = pyplot()
    wrappers = list(dict.fromkeys(name.split("/")[0] for name in payload["runs"]))
    fig, (speed, ratio) = plt.subplots(1, 2, figsize=(FIGURE_WIDTH * 2 / 3, figure_height(len(payload["runs"]))),
                                       layout="constrained")
    per_gpu = payload.get("figures", {}).get("per_gpu_tokens_per_s", {})
    names = list(payload["runs"])
    rows = list(range(len(names)))
    bars = speed.barh(rows, [per_gpu.get(name, 0) for name in names],
                      color=[RECIPE_COLOURS["bf16" if name.endswith("/" + BF16) else "fp8"] for name in names])
    speed.bar_label(bars, [f"{per_gpu[name]:,.0f}" if name in per_gpu else "" for name in names], padding=3,
                    fontsize="small")
    note_unmeasured(speed, rows, [None if name in per_gpu else "failed" for name in names])
    speed.set_yticks(rows, names)
    speed.invert_yaxis()
    speed.margins(x=0.2)
    speed.set(xlabel="tokens/s per GPU", title="tokens/s per GPU (grey BF16, blue FP8)")
    ratios = payload.get("figures", {}).get("fp8_over_bf16", {})
    measured = [w for w in wrappers if w in ratios]
    values = [ratios[w] for w in measured]
    bars = ratio.bar(range(len(measured)), values, color=RECIPE_COLOURS["fp8"])
    ratio.bar_label(bars, [f"{value:.3f}x" for value in values], padding=3, fontsize="small")
    if ONE_GPU in ratios:
        reference = ratios[ONE_GPU]
        ratio.axhspan(reference - RATIO_TOLERANCE, reference + RATIO_TOLERANCE, color="tab:green", alpha=0.3,
                      label=f"one GPU's ratio ± {RATIO_TOLERANCE}")
        ratio.legend(fontsize="small", loc="upper right")
        values += [reference - RATIO_TOLERANCE, reference + RATIO_TOLERANCE]
    ratio.set_xticks(range(len(measured)), measured)
    ratio.set(ylabel="FP8 / BF16 tokens/s", title="FP8 over BF16 per wrapper",
              ylim=(max(0.0, min(values, default=1) - 0.15), max(values, default=1) + 0.1))
    device = (payload.get("environment") or {}).get("device", "an unrecorded device")
    fig.suptitle(f"{payload['model']}, {payload['recipe']} vs BF16 on {payload['nproc']} GPUs and one ({device})")
    return fig


def is_scaling_record(record: dict) -> bool:
    """The JSON is this bench's evidence: its runs by name, each with its launch command, and its GPU count."""
    return isinstance(record.get("runs"), dict) and isinstance(record.get("nproc"), int) and \
        all(isinstance(r, dict) and "command" in r for r in record["runs"].values())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="GPUs of the wrapped runs (at least 2)")
    parser.add_argument("--wrappers", default=",".join(DEFAULT_WRAPPERS),
                        help=f"comma-separated subset of {','.join(WRAPPERS)}")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--model", default="llama-1b-like")
    parser.add_argument("--one-gpu-model", help="the one-GPU runs' model where --model's replica does not fit one "
                        "GPU: the same blocks at fewer layers (default: --model)")
    parser.add_argument("--recipe", default="delayed", help="the FP8 recipe set against BF16")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="passed to every run (default: auto)")
    parser.add_argument("--out-dir", default="profiles", help="evidence folder")
    parser.add_argument("--label", default="", help="added to the evidence's name, scaling-<model>-<label>-<N>gpu-"
                        "<device> (runs of one day that differ in their flags)")
    parser.add_argument("train_flags", nargs="*", metavar="-- FLAGS",
                        help="after --: fp8stack train flags every run takes (a model that needs recompute, say)")
    add_force_option(parser)
    add_plot_only_option(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        refuse_flags_beside_plot_only(parser, args)
        return plot_only(PROG, args.plot_only, is_scaling_record, figure)
    wrappers = chosen_names(parser, "--wrappers", args.wrappers, list(WRAPPERS))
    if args.nproc < 2:
        parser.error(f"--nproc {args.nproc}: the wrapped runs need at least 2 GPUs (one GPU's wrappers: "
                     "python -m fp8stack.bench.data_parallel)")
    if args.recipe == BF16:
        parser.error("--recipe bf16: name the FP8 recipe set against BF16 (delayed, tensorwise, blockwise, ...)")
    name = f"scaling-{args.model}{'-' + args.label if args.label else ''}-{args.nproc}gpu-{device_slug()}"
    claim_or_exit(PROG, name, args.out_dir, args.force)
    common = ["--train-iters", str(args.steps), "--eval-iters", "0", "--log-interval", "10",
              "--profile-collectives", str(PROFILED_STEPS), *(("--device", args.device) if args.device else ()),
              *args.train_flags]
    planned = runs(wrappers, args.recipe)
    with tempfile.TemporaryDirectory(prefix="fp8stack-scaling-") as scratch:
        records = run_all(Path(scratch), planned, args.nproc, common, _gpu_count(),
                          {ONE_GPU: args.one_gpu_model or args.model, None: args.model})
    payload = {"model": args.model, "one_gpu_model": args.one_gpu_model, "recipe": args.recipe, "steps": args.steps,
               "nproc": args.nproc, "train_flags": args.train_flags, "runs": records,
               "targets": {"ratio_tolerance": RATIO_TOLERANCE, "all_gather_ratio": ALL_GATHER_RATIO},
               **judge(records, planned, args.recipe, args.nproc, args.steps, args.one_gpu_model is None)}
    payload["passed"] = all(payload["checks"].values())
    text = render(payload)
    print(text, flush=True)
    paths = write_evidence(name, payload, text, args.out_dir, replace=args.force)
    paths += tuple(filter(None, [write_plot(paths[0], figure)]))
    print(f"[scaling] evidence: {', '.join(map(str, paths))}", flush=True)
    return 0 if payload["passed"] else 1


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    sys.exit(main())
