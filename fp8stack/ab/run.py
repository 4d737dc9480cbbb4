"""`fp8stack ab`: train the same model with the same seed and data under several recipes, each in a
fresh process, and say per FP8 arm whether to ship it or roll back, with the numbers behind it.

This module is the command: its options, the arms as fresh `python -m fp8stack.train` processes (in waves
over --gpus), and the evidence: profiles/ab-<model>-<device>.json and .md after every arm ("complete": false
and the pending arms until the last one has run, so a killed run keeps what it measured, and --continue-from
runs the pending arms later), and a .png at the end (with matplotlib installed). SIGTERM or SIGINT stops the running
arms after their current step (exit code 128 + the signal); with --arm-checkpoints each saves a checkpoint there and
the evidence keeps the steps it ran, which --continue-from resumes from that checkpoint. Evidence of the same name is
replaced only with --force (or when --continue-from continues it), checked before any arm runs; a run in
which no arm measured anything writes none. How arms are judged: fp8stack.ab.verdicts.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fp8stack.ab.plot import plot
from fp8stack.ab.verdicts import (BF16_ON_TE_ARM, BF16_PARAMS_SUFFIX, CPU_LOSS_TOLERANCE, FP8_ATTENTION_SUFFIX,
                                  FP8_PARAMS_SUFFIX, GATE_MIN_RUNS, GATE_STDEVS,
                                  GPU_LOSS_TOLERANCE, LAST_FRACTION, MAX_PASSES, NOISE_METHOD, NOISE_METHOD_SINGLE,
                                  Arm, arm_label, is_bf16_arm, judge, judged_by_gate, peak_tflops, reference_arm,
                                  repeat_arms, repeat_note, run_identity, verdict_cells)
from fp8stack.config import ConfigError, JobConfig, add_config_arguments, add_section_arguments, job_from_args, to_dict
from fp8stack.config.flags import add_megatron_recompute_arguments, from_overrides, run_command
from fp8stack.plan import PlanError, PolicyConfig
from fp8stack.plan.recipes import (AB_RECIPES, BF16, BLOCKWISE_GEMMS, PARAM_DTYPES, dense_backend,
                                   fp8_attention_recipes, get_recipe, is_fp8, recipe_name)
from fp8stack.train.launch import NO_MULTICAST_ENV, launcher, on_gpu
from fp8stack.train.stop import StopSignals
from fp8stack.train.timing import tokens_per_s

if TYPE_CHECKING:  # the parser is built without torch, which fp8stack.models imports
    from fp8stack.models import LlamaConfig


@dataclass
class AbConfig:
    """The arms of an A/B and how they are judged; every other option is the training configuration each arm runs."""

    recipes: tuple[str, ...] | None = None
    """The arms' recipes (bf16 is added first if missing). None: those the project measures on this machine:
    bf16, delayed and blockwise where TE runs them, torchao's recipes elsewhere (a CPU)."""
    fastest_bf16: bool | None = None
    """Run two BF16 configurations, the plain model and one on TE modules without FP8 ('bf16 on te'), and judge the
    FP8 arms against the faster, which the bf16 repeats rerun. None: on where TE runs (plain path)."""
    bf16_on_te: bool = False
    """The bf16 arm alone runs on TE modules without FP8 (plain path)."""
    param_dtypes: tuple[str, ...] | None = None
    """One run of every arm per parameter dtype (fp32, bf16, fp8; named with a suffix after the first). None: one
    run each with training.param_dtype."""
    blockwise_gemms: tuple[str, ...] = ("te",)
    """One blockwise arm per library running TE's blockwise GEMMs: te (cuBLAS) and/or deepgemm."""
    attention: tuple[str, ...] | None = None
    """One run of each FP8 arm per attention precision: bf16 and/or fp8 (TE's FP8 dot-product attention, named with
    FP8_ATTENTION_SUFFIX), fp8 only for the arms whose recipe has it (precision.fp8_attention says which). None: fp8
    for those arms with --fp8-dot-product-attention, else bf16."""
    levers: tuple[str, ...] = ()
    """Training options (FIELD=VALUE, the dotted field as in a config file: te.one_autocast_per_forward=true; several
    settings for one run joined by '+') each FP8 arm also runs with, one run per lever named '<arm> +FIELD=VALUE': a
    lever's delta measured in the same A/B, against the same BF16 runs."""
    baseline_runs: int = 2
    """bf16 runs: the first, and the repeats after the FP8 arms, which measure the noise."""
    loss_tolerance: float | None = None
    """Largest relative final-loss gap above bf16 that ships (one-sided: a final loss below bf16 passes). None:
    GPU_LOSS_TOLERANCE on a GPU, CPU_LOSS_TOLERANCE on a CPU."""
    nproc: int = 1
    """Processes (GPUs) per arm; above 1 each arm runs under torchrun --standalone."""
    gpus: tuple[str, ...] | None = None
    """Run the arms side by side, one per listed GPU, in waves (long loss runs; step times then overlap). A GPU
    listed twice runs two arms at once (loss runs on a GPU with room for both)."""
    continue_from: str | None = None
    """A partial evidence file of this same A/B (one stopped by a time limit): keep its runs, run the pending ones."""
    bf16_from: tuple[str, ...] | None = None
    """Earlier A/Bs' evidence files (comma-separated) whose bf16 runs (each file's bf16 arm and its repeats) this A/B
    takes instead of running them, in the files' order and up to --baseline-runs, a run held by several files taken
    once; refused unless they trained what this A/B's bf16 arm would (the same model, data, batch, optimizer and
    steps on the same device): new FP8 arms judged against a recorded BF16 band, e.g. a loss gate's, without its
    2 000 BF16 steps again. Runs still missing run here. Their speed was measured in other calls."""
    arm_checkpoints: str | None = None
    """Keep each arm's checkpoints in DIR/<arm> (saved when the A/B is stopped by SIGTERM or SIGINT, and every
    --save-interval steps if given; removed once the arm has run all its steps), so that --continue-from resumes an
    arm cut by a time limit from its checkpoint instead of step 0."""
    out_dir: str = "profiles"
    """Where the evidence goes."""
    label: str | None = None
    """Added to the evidence's name, so a variant run does not replace the main evidence."""
    force: bool = False
    """Replace evidence of the same name (.json, .md, .png)."""


AB_ALIASES = {"ab.recipes": ("--recipes",), "ab.fastest_bf16": ("--fastest-bf16",), "ab.bf16_on_te": ("--bf16-on-te",),
              "ab.param_dtypes": ("--param-dtypes",), "ab.blockwise_gemms": ("--blockwise-gemms",),
              "ab.attention": ("--attention",), "ab.levers": ("--levers",),
              "ab.baseline_runs": ("--baseline-runs",), "ab.loss_tolerance": ("--loss-tolerance",),
              "ab.nproc": ("--nproc",), "ab.gpus": ("--gpus",), "ab.continue_from": ("--continue-from",),
              "ab.bf16_from": ("--bf16-from",),
              "ab.arm_checkpoints": ("--arm-checkpoints",), "ab.out_dir": ("--out-dir",), "ab.label": ("--label",),
              "ab.force": ("--force",)}
"""The A/B's own flags by their earlier names (the training flags have theirs in fp8stack.config.flags)."""


ATTENTION_PRECISIONS = (BF16, "fp8")
"""What --attention takes: the attention core in BF16, or as TE's FP8 dot-product attention."""


def comma_separated(text: str) -> tuple[str, ...]:
    """An option's 'a, b,c' -> ('a', 'b', 'c'): items stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def chosen_names(parser: argparse.ArgumentParser, option: str, text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """The names `option` lists (comma_separated), or parser.error naming the allowed ones when it lists none or an
    unknown one."""
    names = comma_separated(text)
    if not names or set(names) - set(allowed):
        parser.error(f"{option} {text!r}: name some of {','.join(allowed)}")
    return names


def blockwise_arm(library: str) -> str:
    """The A/B arm of recipe blockwise with its GEMMs on `library`: 'blockwise' on TE's own (cuBLAS)."""
    return "blockwise" if library == "te" else f"blockwise on {library}"


def model_label(job: JobConfig) -> str:
    """The model as evidence names it: a named model's name, a YAML's file stem, a factory's function."""
    if job.model.factory:
        return job.model.factory.rpartition(":")[2]
    return Path(job.model.name).stem if job.model.name.endswith((".yaml", ".yml")) else job.model.name


def to_plain(ab: AbConfig) -> dict:
    """The ab section as JSON data."""
    return json.loads(json.dumps(asdict(ab)))


def ab_config(args: argparse.Namespace) -> AbConfig:
    """The ab section of the options given (lists may be comma lists)."""
    given = {k.removeprefix("ab."): v for k, v in vars(args).items() if k.startswith("ab.")}
    for name in ("recipes", "param_dtypes", "blockwise_gemms", "attention", "levers", "gpus", "bf16_from"):
        if name in given:
            parts = [part for item in given[name] for part in comma_separated(item)]
            given[name] = tuple(parts if name == "gpus" else dict.fromkeys(parts))  # a GPU listed twice runs 2 arms
    return AbConfig(**given)


def base_job(args: argparse.Namespace, ab: AbConfig) -> JobConfig:
    """The configuration every arm runs (job_from_args). Some options hold under some recipes only (a delayed-scaling
    margin) and arm_configs gives them to the arms they fit, so without --fp8-recipe they are checked under the arms'
    FP8 recipes in turn, the first that takes them; where none does, the error is the one under --fp8-recipe's
    default."""
    try:
        return job_from_args(args)
    except ConfigError:
        if hasattr(args, "precision.recipe"):
            raise
        candidates = ab.recipes or sorted({r for names in AB_RECIPES.values() for r in names})
        for recipe in (r for r in map(recipe_name, candidates) if is_fp8(r)):
            try:
                return job_from_args(argparse.Namespace(**{**vars(args), "precision.recipe": recipe}))
            except ConfigError:
                continue
        raise


def arm_configs(ab: AbConfig, base: JobConfig, recipes: list[str], te_runs: bool) -> dict[str, JobConfig]:
    """Arm name -> its JobConfig: bf16 (and bf16 on te with fastest_bf16), then each FP8 recipe; blockwise once per
    blockwise_gemms library; each FP8 arm once per attention precision its recipe has (FP8_ATTENTION_SUFFIX after
    fp8 attention's); each once per param_dtypes entry (BF16_PARAMS_SUFFIX after bf16's, FP8_PARAMS_SUFFIX after
    fp8's, which BF16 arms, having no FP8 weights, skip). Options that only some arms' plans use go to those arms: a
    delayed-scaling margin to recipes scaled from history, explicit TE weight-gradient fusion to arms with TE
    layers, the FP8 dispatch to recipes whose grouped experts run blockwise."""
    if ab.blockwise_gemms != ("te",) and not any(is_fp8(r) and get_recipe(r).gemms_on_deepgemm for r in recipes):
        raise ConfigError(f"--blockwise-gemms {','.join(ab.blockwise_gemms)} sets the blockwise runs' GEMMs, and "
                          "--recipes has no blockwise: add blockwise to --recipes or drop --blockwise-gemms")
    fastest_bf16 = ab.fastest_bf16 if ab.fastest_bf16 is not None else te_runs and base.model.impl == "torch"
    if (fastest_bf16 or ab.bf16_on_te) and base.model.impl == "megatron":
        raise ConfigError("--bf16-on-te and --fastest-bf16 put the plain model's BF16 linears on TE; megatron's BF16 "
                          "run is on TE already: drop them")
    if ab.fastest_bf16 and ab.bf16_on_te:
        raise ConfigError("--fastest-bf16 runs both BF16 configurations, the --bf16-on-te one included: drop "
                          "--bf16-on-te")
    arms = [(BF16, BF16, "te" if ab.bf16_on_te else "auto", "te", False),
            *([(BF16_ON_TE_ARM, BF16, "te", "te", False)] if fastest_bf16 else [])]
    attention = ab.attention or (("fp8",) if base.precision.fp8_attention else (BF16,))
    for recipe in recipes[1:]:
        libraries = ab.blockwise_gemms if get_recipe(recipe).gemms_on_deepgemm else ("te",)
        in_fp8 = [a == "fp8" for a in attention if a == BF16 or _has_fp8_attention(base, recipe)]
        arms += [((blockwise_arm(library) if library != "te" else recipe) + (FP8_ATTENTION_SUFFIX if fp8 else ""),
                  recipe, base.precision.backend, library, fp8)
                 for library in libraries for fp8 in (in_fp8 or [False])]
    if ab.attention and "fp8" in ab.attention and not any(fp8 for *_, fp8 in arms):
        raise ConfigError(f"--attention fp8 runs TE's FP8 dot-product attention, which none of --recipes "
                          f"{', '.join(recipes[1:])} has here (it runs under {fp8_attention_recipes()}, with the "
                          "linears on TE): add such a recipe to --recipes or drop fp8 from --attention")
    suffixes = {"fp32": "", "bf16": BF16_PARAMS_SUFFIX, "fp8": FP8_PARAMS_SUFFIX}
    param_dtypes = ab.param_dtypes or (base.training.param_dtype,)
    configs = {name + (suffixes[dtype] if ab.param_dtypes else ""): _arm(base, recipe, backend, library, dtype, fp8)
               for name, recipe, backend, library, fp8 in arms for dtype in param_dtypes
               if not (dtype == "fp8" and not is_fp8(recipe))}
    return {**configs, **{f"{name} +{lever}": with_lever(config, lever) for lever in ab.levers
                          for name, config in configs.items() if is_fp8(config.precision.recipe)}}


LEVER_JOIN = re.compile(r"\+(?=[A-Za-z_][\w.]*=)")
"""Where one --levers entry joins several settings into one arm: a '+' before the next FIELD=."""


def with_lever(config: JobConfig, lever: str) -> JobConfig:
    """`config` with one --levers entry set: FIELD=VALUE, or several joined by '+' for one arm
    (precision.expert_backend=auto+training.allow_little_fp8=true); each VALUE as JSON where it parses (true, 2,
    0.5), else the text; validated as a configuration file's would be."""
    settings = {}
    for setting in LEVER_JOIN.split(lever):
        field, equals, text = setting.partition("=")
        if not equals:
            raise ConfigError(f"--levers {lever!r}: give FIELD=VALUE, the dotted field as in a config file "
                              "(te.one_autocast_per_forward=true), several for one arm joined by '+'")
        try:
            settings[field] = json.loads(text)
        except json.JSONDecodeError:
            settings[field] = text
    return from_overrides(settings, config)


def _has_fp8_attention(base: JobConfig, recipe: str) -> bool:
    """Whether an arm of `recipe` under `base`'s precision options (backend, target arch) can run FP8 attention."""
    try:
        PolicyConfig(**{**vars(base.precision), "recipe": recipe, "fp8_attention": True})
    except PlanError:
        return False
    return True


def _arm(base: JobConfig, recipe: str, backend: str, library: str, param_dtype: str | None,
         fp8_attention: bool = False) -> JobConfig:
    on_te = _planned_backend(recipe, backend) == "te"
    fp8 = is_fp8(recipe)
    wgrad = base.te.gradient_accumulation_fusion
    fp8_recipes = [recipe, *(o.recipe for o in base.precision.overrides if o.recipe and is_fp8(o.recipe))]
    blockwise_experts = fp8 and any(map(_dispatches_fp8, fp8_recipes))
    return replace(
        base, precision=replace(base.precision, recipe=recipe, backend=backend, fp8_attention=fp8_attention,
                                overrides=base.precision.overrides if fp8 else ()),  # a BF16 arm is the plan without FP8
        te=replace(base.te, delayed_margin=base.te.delayed_margin if fp8 and get_recipe(recipe).scales_from_history
                   else 0, blockwise_gemms=library,
                   gradient_accumulation_fusion=wgrad if on_te or base.model.impl == "megatron" or not wgrad else None),
        grouped_fp8=base.grouped_fp8 if blockwise_experts else base.grouped_fp8.without_blockwise_experts(),
        training=replace(base.training, param_dtype=param_dtype),
        logging=replace(base.logging, interval=max(1, base.training.steps // 4)))


def _dispatches_fp8(recipe: str) -> bool:
    """Whether grouped_fp8 can permute tokens in FP8 to the grouped experts of an FP8 `recipe` (its expert recipe's),
    the arm's own or a recipe file override's."""
    return get_recipe(get_recipe(recipe).expert_recipe).fp8_dispatch


def add_ab_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `ab` subcommand to an argparse subparsers object; it runs run_ab(args)."""
    parser = subparsers.add_parser(
        "ab", help="A/B FP8 recipes against bf16: throughput, memory, loss; ship or rollback",
        description=__doc__.split("\n\n")[0].replace("\n", " "), usage="%(prog)s [options]")
    _add_arguments(parser)
    parser.set_defaults(run=run_ab)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_section_arguments(parser, "ab", AbConfig(), aliases=AB_ALIASES)
    parser.add_argument("--no-repeat-baseline", dest="ab.baseline_runs", action="store_const", const=1,
                        default=argparse.SUPPRESS,
                        help="--ab.baseline-runs 1: faster, but the noise is then only step-time spread")
    add_config_arguments(parser)
    add_megatron_recompute_arguments(parser)


def run_ab(args: argparse.Namespace) -> int:
    """Run every arm, judge them, write and print the evidence. 0 when a bf16 arm ran, else 1."""
    import torch  # after argument parsing: --help stays fast

    from fp8stack.backends import get_backend  # torch too
    from fp8stack.evidence import claim_evidence, device_slug, environment, markdown_table, write_evidence
    from fp8stack.train.data import load_split
    from fp8stack.train.model import model_shape
    from fp8stack.train.preflight import preflight
    from fp8stack.train.resolve import resolve

    env = environment()
    try:
        ab = ab_config(args)
        base = base_job(args, ab)
        on_gpu = base.training.device == "cuda" or (base.training.device == "auto" and torch.cuda.is_available())
        te_runs = on_gpu and get_backend("te").available(["delayed"])[0]
        tolerance = ab.loss_tolerance if ab.loss_tolerance is not None else (
            GPU_LOSS_TOLERANCE if on_gpu else CPU_LOSS_TOLERANCE)
        _check(ab, tolerance)
        recipes = _recipes(ab.recipes or AB_RECIPES["te" if te_runs else "torchao"])
        shape = model_shape(base)
        _check_arm_checkpoints(ab, base, shape)
        configs = {name: resolve(cfg, shape, ab.nproc)
                   for name, cfg in arm_configs(ab, base, recipes, te_runs).items()}
        first = next(iter(configs.values()))
        impl = "megatron" if base.model.impl == "megatron" else None  # the plain path's evidence keeps its name
        stem = "-".join(filter(None, ("ab", model_label(base), impl, ab.label, device_slug(env["device"]))))
        train_config = {"job": to_dict(replace(first, precision=replace(first.precision, recipe=BF16))),
                        "ab": {k: v for k, v in to_plain(ab).items()
                               if k not in NOT_THE_AB}}
        runs, continued_from = (_earlier_runs(Path(ab.continue_from), train_config, recipes, ab.nproc,
                                              dense=shape.moe is None)
                                if ab.continue_from else ({}, []))
        repeat_names = repeat_arms(ab.baseline_runs)
        if ab.bf16_from:
            taken, sources = _bf16_runs_from_files(ab.bf16_from, configs, [BF16, *repeat_names], env["device"], runs)
            runs, continued_from = {**taken, **runs}, [*sources, *continued_from]
        # --continue-from completes the evidence of this same A/B (_earlier_runs checked it is): it may replace it
        claim_evidence(stem, ab.out_dir, ab.force or ab.continue_from is not None, suffixes=(".json", ".md", ".png"))
        for cfg in configs.values():  # what each arm's process would refuse, before any runs
            preflight(cfg, model_shape(cfg))
        resume_from = _resume_points(ab, [*configs, *repeat_names], runs)
    except (ValueError, PlanError) as err:  # ConfigError and EvidenceError are ValueErrors
        print(f"fp8stack ab: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    peaks = peak_tflops(env["device"]) if on_gpu else None
    sequences = first.training.global_batch or first.training.micro_batch * ab.nproc
    split_bytes = load_split("train", first.data.max_bytes, source=first.data.source).numel()
    tokens = first.training.steps * sequences * first.training.seq_len
    passes = tokens / split_bytes
    if passes > MAX_PASSES:
        print(f"fp8stack ab: warning: {repeated_text(tokens, split_bytes)}", file=sys.stderr, flush=True)
    results: dict[str, dict | str] = {name: run for name, run in runs.items() if name in configs and not stopped(run)}
    repeats: dict[str, dict | str] = {name: runs[name] for name in repeat_names
                                      if name in runs and not stopped(runs[name])}
    partials: dict[str, dict] = {name: runs[name] for name in resume_from}
    """Runs a stop cut, by arm name: pending, each resumed from its checkpoint (in --arm-checkpoints)."""
    backends: dict[str, str | PlanError] = {}
    for name, cfg in configs.items():
        try:
            backends[name] = _planned_backend(cfg.precision.recipe, cfg.precision.backend)
        except PlanError as err:  # e.g. --backend te with a torchao-only recipe: no process to start
            backends[name] = err

    def pending() -> list[str]:
        """The arms still to run, in order (the bf16 repeats unless every BF16 configuration failed)."""
        todo = [name for name in configs if name not in results]
        if reference_arm(results) or any(is_bf16_arm(name) and name not in results for name in configs):
            todo += [name for name in repeat_names if name not in repeats]
        return todo

    def record() -> tuple[list[Arm], list[dict], tuple[list[str], list[list]], str, Path | None, Path | None]:
        """Judge the arms run so far and write the evidence: after every arm, so a run killed later (a
        call's time limit) keeps what it measured, marked partial until nothing is pending; nothing while no arm
        has measured anything (the paths are then None)."""
        todo = pending()
        named = {name: base.precision.backend if isinstance(b, PlanError) else b for name, b in backends.items()}
        arms, repeat_records = judge(results, named, tolerance, peaks, repeats, passes)
        dtype = next((r["dtype"] for r in results.values() if isinstance(r, dict)), None)
        payload = {
            "complete": not todo,
            "pending_arms": todo,
            "device": env["device"],
            "versions": {k: v for k, v in env.items() if k not in ("device", "compute_capability")},
            "model": model_label(base), "steps": first.training.steps, "nproc": ab.nproc,
            "gpus": list(ab.gpus) if ab.gpus else None,
            "recipes": recipes, "train_config": train_config,
            "continued_from": continued_from,
            "noise_method": NOISE_METHOD if repeat_records else NOISE_METHOD_SINGLE,
            "baseline_repeats": repeat_records,
            "activation_dtype": dtype,
            "loss_tolerance": tolerance,
            "train_split_bytes": split_bytes,
            "train_split_passes": passes,
            "mfu_basis": (None if peaks is None else
                          f"model GEMM FLOPs (3 x forward, attention included) over the dense peak blended by the "
                          f"arm's FP8 FLOP share; peaks {peaks} TFLOP/s"),
            "arms": [asdict(arm) for arm in arms],
            "runs": {name: recorded_run(run) for name, run in {**results, **repeats, **partials}.items()},
        }
        table = _table(arms)
        side_by_side = (f" (arms side by side on GPUs {','.join(ab.gpus)})" if ab.gpus and len(ab.gpus) > 1 else
                        f" (on GPU {ab.gpus[0]})" if ab.gpus else "")
        bf16_arms = ("the bf16 arms are the plan without FP8, plain and on TE modules; the faster is the reference, "
                     "which the bf16 repeats rerun"
                     if BF16_ON_TE_ARM in configs else
                     f"the {arm_label(BF16, dtype)} arm"
                     f"{'' if arm_label(BF16, dtype) == BF16 else ' (bf16 in the JSON)'} is the plan without FP8"
                     f"{', on TE modules' if ab.bf16_on_te else ''}")
        checkpointed = first.activation_checkpoint
        blocks = "every block" if checkpointed.layers == "all" else f"blocks {checkpointed.layers}"
        arm_notes = (f" Every arm recomputes {', '.join(checkpointed.modules)} in {blocks} in backward."
                     if checkpointed.layers else "")
        if any(library != "te" for library in ab.blockwise_gemms):
            arm_notes += (f" {blockwise_arm('deepgemm')}: TE's blockwise modules with their GEMMs on DeepGEMM's "
                          "dense kernels (--blockwise-gemms).")
        if any(cfg.precision.fp8_attention for cfg in configs.values()):
            arm_notes += (f" Arms named '...{FP8_ATTENTION_SUFFIX}' run their attention cores as TE's FP8 dot-product "
                          "attention (--fp8-dot-product-attention); the others in BF16.")
        if ab.param_dtypes and "bf16" in ab.param_dtypes:
            arm_notes += (f" Arms named '...{BF16_PARAMS_SUFFIX}' keep BF16 parameters with FP32 masters in the "
                          "optimizer, copied to them once per step (Megatron's --bf16); the others FP32 parameters, "
                          "cast at every forward. Every BF16 run, with either, is a candidate for the reference.")
        if ab.param_dtypes and "fp8" in ab.param_dtypes:
            arm_notes += (f" Arms named '...{FP8_PARAMS_SUFFIX}' keep the FP8 layers' weights in FP8 only (TE's "
                          "quantized_model_init) and the others in BF16, with FP32 masters in the optimizer "
                          "quantized into them once per step.")
        if ab.levers:
            arm_notes += (" Arms named '... +FIELD=VALUE' are the arm before the + with that training option set "
                          "(--levers).")
        notes = (f"\nSame seed and data in every arm, each arm a fresh process{side_by_side}; {sequences} sequences "
                 f"per optimizer step in micro-batches of {first.training.micro_batch}; activations in {dtype} "
                 f"({bf16_arms}).{arm_notes} Noise: {payload['noise_method']}"
                 f"{repeat_note(repeat_records)}. Loss tolerance: +-{tolerance:.2%} relative "
                 f"(final loss = mean of the last "
                 f"{LAST_FRACTION:.0%} of steps), compared up to {MAX_PASSES:g} pass over the training text "
                 f"(this run: {passes:.2f} passes over {split_bytes / 1e6:.1f} MB) and while the bf16 runs' final "
                 "losses span at most that"
                 + (f"; with {GATE_MIN_RUNS} bf16 runs or more, the one-sided gate instead: their mean + "
                    f"max({tolerance:.2%}, {GATE_STDEVS:g} standard deviations). "
                    if judged_by_gate(repeat_records) else ". ") +
                 f"MFU: {payload['mfu_basis'] or 'not reported on this device'}."
                 + (f" Experts max/mean: the max / mean expert load of each MoE layer, averaged over the layers and "
                    f"the last {LAST_FRACTION:.0%} of steps; an arm's is judged alike the bf16 runs' within their "
                    "range widened by its width or two standard errors of the window means, whichever is larger "
                    "(a note in the reason, not part of the verdict)."
                    if any(arm.router_imbalance is not None for arm in arms) else "")
                 + "".join(f" Runs {', '.join(c['runs'])} from an earlier call ({c['date']}: `{c['command']}`)."
                           for c in continued_from) + "\n")
        markdown = markdown_table(*table)
        banner = (f"**Partial: the run has not finished.** Measured: {', '.join(results)}; pending: "
                  f"{', '.join(_pending_label(name, partials.get(name), first.training.steps) for name in todo)}. "
                  "Verdicts may change once they have run (the bf16 repeats set the "
                  "noise).\n\n") if todo else ""
        if not any(isinstance(run, dict) for run in payload["runs"].values()):
            return arms, repeat_records, table, markdown, None, None
        json_path, md_path = write_evidence(stem, payload, banner + markdown + notes, out_dir=ab.out_dir,
                                            replace=True)  # claimed above
        return arms, repeat_records, table, markdown, json_path, md_path

    slots = list(ab.gpus or [None])
    # A repeat reruns the reference, known once every BF16 configuration ran: with several (--fastest-bf16,
    # --param-dtypes) the repeats wait for the arms' waves; with one they take the last wave's free GPUs if any.
    several = sum(map(is_bf16_arm, configs)) > 1
    phases = [[name for name in configs], repeat_names] if several else [[*configs, *repeat_names]]
    phases = [[name for name in phase if name in pending()] for phase in phases]  # not those an earlier call ran
    jobs = sum(phases, [])
    with tempfile.TemporaryDirectory(prefix="fp8stack-ab-") as scratch, _ArmStop() as stop:
        waves = (phase[start:start + len(slots)] for phase in phases for start in range(0, len(phase), len(slots)))
        for wave in waves:
            outcomes: dict[str, _RunningArm | str] = {}
            for name, gpu in zip(wave, slots):
                if stop.received:
                    break  # no arm starts once the A/B is stopped
                if name in repeat_names and name not in pending():
                    continue  # every BF16 configuration failed: nothing to repeat
                # A repeat reruns the reference (bf16 while, the only BF16 configuration, it still runs beside it).
                arm = name if name not in repeat_names else reference_arm(results) or BF16
                cfg = configs[arm]
                print(f"[{jobs.index(name) + 1}/{len(jobs)}] {cfg.model.name} {name} ({cfg.training.steps} steps, "
                      "fresh process"
                      + (f", resumed from {resume_from[name]}" if name in resume_from else "")
                      + (f", GPU {gpu})" if gpu else ")"), flush=True)
                if isinstance(backends[arm], PlanError):
                    outcomes[name] = " ".join(str(backends[arm]).split())
                    print(f"    skipped: {outcomes[name]}", flush=True)
                else:
                    if ab.arm_checkpoints:
                        cfg = _checkpointed(cfg, _arm_folder(ab, name), resume_from.get(name))
                    # With checkpoints, in a process group of their own: a signal to the A/B's group (`timeout`'s)
                    # reaches them once, forwarded, where a second ends a training run without its checkpoint.
                    outcomes[name] = stop.started(_RunningArm(cfg, Path(scratch), ab.nproc, gpu, name,
                                                              own_group=ab.arm_checkpoints is not None))
            for name, outcome in _as_they_end(outcomes):  # recorded at once: a killed wave keeps its ended arms
                result = outcome.result() if isinstance(outcome, _RunningArm) else outcome
                partial = partials.pop(name, None)
                if stop.received and isinstance(result, str):
                    if partial:  # ended by the stop, maybe: pending, as it was
                        partials[name] = partial
                    continue
                if partial and isinstance(result, dict):
                    result = stitched(partial, result)
                if stopped(result):
                    if ab.arm_checkpoints:  # pending: --continue-from resumes it from its checkpoint
                        partials[name] = result
                elif name in repeat_names:
                    repeats[name] = result
                else:
                    results[name] = result
                    ordered = {arm: results.pop(arm) for arm in configs if arm in results}  # bf16 stays first
                    results.update(ordered)
                if ab.arm_checkpoints and isinstance(result, dict) and not stopped(result):
                    _drop_checkpoints(_arm_folder(ab, name))
                if pending():
                    record()

    arms, repeat_records, table, markdown, json_path, md_path = record()
    if stop.received:
        _print_table(table, markdown)
        print(f"fp8stack ab: {_stopped_text(stop.received, partials, json_path, ab)}", file=sys.stderr)
        return 128 + stop.received
    if json_path is None:
        _print_table(table, markdown)
        print("no arm measured anything: no evidence written", file=sys.stderr)
        return 1
    png = plot(arms, repeat_records, json_path.with_suffix(".png"), title=f"{model_label(base)} on {env['device']}")
    _print_table(table, markdown)
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0 if any(arm.verdict == "baseline" for arm in arms) else 1


NOT_THE_AB = ("continue_from", "bf16_from", "force", "out_dir", "label", "gpus", "arm_checkpoints")
"""A/B options that change where its evidence (and its arms' checkpoints) go, where and how many of its arms run at
once, or where its bf16 runs come from (a continuation holds them already), not what they run: a continued A/B may
change them."""


RAN_BEFORE_THE_OPTION = {"job.grouped_fp8.cache_fp8_weights": False}
"""Options whose default changed after they were added, with what runs written before them did: their continuation
must do the same."""


MOE_ONLY = ("job.grouped_fp8.",)
"""Configuration that reaches MoE experts only: it cannot change what an A/B of a dense model runs."""

SAME_BYTES = ("job.grouped_fp8.wgrad_flatten",)
"""Options whose settings lay out the same bytes, tested bit for bit (tests/gpu/test_grouped_fp8_gpu.py: the compiled
and Triton wgrad flattenings against the per-expert copies): only the speed differs, so an A/B continues across
them."""


def _earlier_runs(path: Path, train_config: dict, recipes: list[str], nproc: int, dense: bool = False
                  ) -> tuple[dict[str, dict | str], list[dict]]:
    """(the runs a partial evidence file holds, by arm name, and where they came from) for --continue-from, or
    ValueError when the file is not of this A/B (another configuration, other arms or process count, or written
    before files kept their runs). An option the file does not name was added since: it is this A/B's where it keeps
    its default (or, for RAN_BEFORE_THE_OPTION, what the file's runs did). A dense model's A/B ignores the MoE-only
    options, and every A/B the SAME_BYTES ones (their runs' step times are then each call's own)."""
    record = _evidence_record(path, "--continue-from")
    if "runs" not in record:
        raise ValueError(f"{path} holds no runs to continue from (written before A/B files kept them): rerun the A/B")
    theirs = {k: v for k, v in _leaves(record["train_config"]).items() if k.removeprefix("ab.") not in NOT_THE_AB}
    differ = _options_apart(_leaves(train_config), theirs,
                            moot=lambda k: (dense and k.startswith(MOE_ONLY)) or k in SAME_BYTES)
    if differ or record.get("recipes") != recipes or record.get("nproc") != nproc:
        what = (f"train_config differs in {', '.join(differ)}" if differ else
                f"its arms are {record.get('recipes')} on {record.get('nproc')} process(es) each")
        raise ValueError(f"{path} is another A/B ({what}): continue it with the command that wrote it")
    runs = [_call_share(name, run) for name, run in record["runs"].items()]
    earlier = record["continued_from"] + [{"date": record["date"], "command": record["command"],
                                           "runs": [run for run in runs
                                                    if not any(run in c["runs"] for c in record["continued_from"])]}]
    return record["runs"], earlier


def _evidence_record(path: Path, option: str) -> dict:
    """The A/B evidence file that `option` names, or ValueError naming it when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {option} {path}: {err}") from None


def _options_apart(ours: dict, theirs: dict, moot: Callable[[str], bool]) -> list[str]:
    """The dotted options (_leaves of {"job": ..., "ab": ...}) two configurations set differently, those `moot`
    names aside. An option `theirs` does not name was added since it was written: apart only where `ours` leaves
    it off its default (or, for RAN_BEFORE_THE_OPTION, off what runs before it did)."""
    defaults = _leaves({"job": to_dict(JobConfig()), "ab": to_plain(AbConfig())})
    added_at_default = {k for k in set(ours) - set(theirs)
                        if k in defaults and ours[k] == RAN_BEFORE_THE_OPTION.get(k, defaults[k])}
    return sorted(k for k in (set(ours) | set(theirs)) - added_at_default
                  if not moot(k) and ours.get(k) != theirs.get(k))


NOT_IN_A_BF16_RUN = ("job.precision.", "job.te.", "job.grouped_fp8.", "job.deepgemm.", "job.torchao.",
                     "job.checkpoint.", "job.logging.", "job.training.allow_little_fp8")
"""What cannot change the plain bf16 arm's run: the FP8 plan's and its backends' options (its plan runs no TE,
grouped_fp8, DeepGEMM or torchao module), where checkpoints and logs go, and the admission of little FP8."""


def _bf16_runs_from_files(paths: Sequence[str], configs: dict[str, JobConfig], names: Sequence[str], device: str,
                          held: dict) -> tuple[dict[str, dict], list[dict]]:
    """(the runs --bf16-from's files give this A/B's bf16 runs `names` that `held` (a continuation's) lacks, by this
    A/B's name; per file that gave any, its date, command, path and the names its runs took), each file's runs in
    order and a run several files hold (the same losses) taken once; ValueError as _bf16_runs_from."""
    free = [name for name in names if name not in held]
    seen = {run_identity(run) for run in held.values() if isinstance(run, dict)} - {None}
    taken, sources = {}, []
    for path in paths:
        runs, source = _bf16_runs_from(Path(path), configs, device)
        fresh = [run for run in runs.values() if run_identity(run) not in seen]  # None is never in seen
        given = dict(zip(free[len(taken):], fresh))
        seen |= {run_identity(run) for run in given.values()} - {None}
        if given:
            taken |= given
            sources.append({**source, "file": str(path), "runs": list(given)})
    return taken, sources


def _bf16_runs_from(path: Path, configs: dict[str, JobConfig], device: str) -> tuple[dict[str, dict], dict]:
    """(the finished runs of the bf16 arm and its repeats that the A/B file at path holds, by its names, in order;
    its date and command) for --bf16-from, or ValueError when this A/B has another BF16 arm whose runs it would need,
    or the file's bf16 runs trained something else than configs' bf16 arm (NOT_IN_A_BF16_RUN aside; an option the
    file does not name, added since, at its default) or on another device."""
    others = [name for name in configs if is_bf16_arm(name) and name != BF16]
    if others:
        raise ValueError(f"--bf16-from takes the plain bf16 arm's runs, and this A/B also runs {', '.join(others)}: "
                         "pass --no-fastest-bf16 and no BF16 parameter variants")
    record = _evidence_record(path, "--bf16-from")
    recorded = record.get("runs") or {}
    if any(is_bf16_arm(name) and name != BF16 for name in recorded):
        raise ValueError(f"--bf16-from {path} ran several BF16 arms, whose repeats rerun the faster: give an A/B run "
                         "with --no-fastest-bf16")
    runs = {name: recorded[name] for name in (BF16, *repeat_arms(len(recorded) + 1))
            if isinstance(recorded.get(name), dict) and not stopped(recorded[name])}
    if BF16 not in runs:
        raise ValueError(f"--bf16-from {path} holds no finished bf16 run: give an A/B file whose bf16 arm ran")
    if record.get("device") != device:
        raise ValueError(f"--bf16-from {path} ran on {record.get('device')}, and this A/B runs on {device}: give "
                         "an A/B file of this device")
    differ = _options_apart(_leaves({"job": to_dict(configs[BF16])}), _leaves({"job": runs[BF16]["config"]}),
                            moot=lambda key: key.startswith(NOT_IN_A_BF16_RUN))
    if differ:
        raise ValueError(f"--bf16-from {path}: its bf16 runs trained with another {', '.join(differ)} than this "
                         "A/B's bf16 arm: give an A/B file of the same model, data and training settings")
    return runs, {"date": record["date"], "command": record["command"]}


def _call_share(name: str, run: dict | str) -> str:
    """What a call ran of an arm, as its continuation names it: the arm, or how far it got when a stop cut it (a
    run resumed from its checkpoints spans several calls)."""
    return f"{name} (to step {run['stopped_after']})" if stopped(run) else name


def _leaves(tree: dict, prefix: str = "") -> dict:
    """A nested record as {dotted path: value} of its leaves ('job.training.steps')."""
    leaves = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def _recipes(names: Sequence[str]) -> list[str]:
    """The arms in order, bf16 first (added when missing: every verdict compares with it); torchao's names
    accepted."""
    names = list(dict.fromkeys(recipe_name(name) for name in names))
    return [BF16] + [r for r in names if is_fp8(r)]


def _check(ab: AbConfig, tolerance: float) -> None:
    """The A/B's own options that cannot work."""
    if ab.baseline_runs < 1:
        raise ConfigError(f"--baseline-runs {ab.baseline_runs}: the bf16 arm runs at least once")
    if ab.nproc < 1:
        raise ConfigError(f"--nproc {ab.nproc}: each arm runs in at least one process")
    if not 0 <= tolerance < float("inf"):
        raise ConfigError(f"--loss-tolerance {tolerance}: pass a relative gap >= 0, e.g. 0.0025")
    if ab.gpus and ab.nproc > 1:
        raise ConfigError("--gpus runs one single-process arm per GPU; --nproc > 1 gives each arm several: use one of "
                          "them")
    for gpu in ab.gpus or ():
        on_gpu(gpu)  # refuses a GPU past those CUDA_VISIBLE_DEVICES leaves, before any arm runs
    unknown = [d for d in ab.param_dtypes or () if d not in PARAM_DTYPES]
    unknown += [g for g in ab.blockwise_gemms if g not in BLOCKWISE_GEMMS]
    unknown += [a for a in ab.attention or () if a not in ATTENTION_PRECISIONS]
    if unknown:
        raise ConfigError(f"unknown {', '.join(unknown)} in --param-dtypes/--blockwise-gemms/--attention: use "
                          f"{', '.join(PARAM_DTYPES)} / {', '.join(BLOCKWISE_GEMMS)} / "
                          f"{', '.join(ATTENTION_PRECISIONS)}")


def _check_arm_checkpoints(ab: AbConfig, base: JobConfig, shape: "LlamaConfig | None") -> None:
    """--arm-checkpoints names a folder that can be written in, on a disk with room for the checkpoints of the arms
    that run at once (a stop saves them all), and no other checkpoint option competes with it."""
    from fp8stack.train.preflight import check_checkpoint_space, check_output_dir

    if ab.arm_checkpoints is None:
        return
    check_output_dir(ab.arm_checkpoints, "--arm-checkpoints")
    if shape is not None:
        check_checkpoint_space(ab.arm_checkpoints, "--arm-checkpoints", base, shape, copies=len(ab.gpus or [None]))
    if base.checkpoint.dir or base.checkpoint.resume:
        raise ConfigError("--arm-checkpoints keeps each arm's checkpoints in a folder of its own and resumes them "
                          "itself: drop --save and --load")


def _arm_folder(ab: AbConfig, name: str) -> Path:
    """Where arm `name` keeps its checkpoints: <--arm-checkpoints>/<its file stem>."""
    return Path(ab.arm_checkpoints) / arm_stem(name)


def _resume_points(ab: AbConfig, names: Sequence[str], runs: dict[str, dict | str]) -> dict[str, Path]:
    """Arm name -> the checkpoint it resumes from: of an arm whose run in the continued evidence a stop cut, the
    newest checkpoint in its folder at or before the step the run stopped after (a hard kill may have left later
    ones). A cut run without one reruns from step 0, said in a line. ConfigError for arm folders that hold
    checkpoints where no A/B is continued: another run's, which the arms would take for their own."""
    from fp8stack.train.checkpoint import saved_steps

    points = {}
    for name in names:
        saved = saved_steps(_arm_folder(ab, name)) if ab.arm_checkpoints else {}
        if saved and not ab.continue_from:
            raise ConfigError(f"--arm-checkpoints {ab.arm_checkpoints}: {_arm_folder(ab, name)} holds checkpoints "
                              "of an earlier run: pass an empty folder, or continue the A/B that wrote them with "
                              "--continue-from its evidence")
        run = runs.get(name)
        if not stopped(run):
            continue
        reached = run["first_step"] + len(run["losses"])
        usable = [step for step in saved if run["first_step"] <= step <= reached]
        if usable:
            points[name] = saved[max(usable)]
        else:
            where = (f"no checkpoint at or before step {reached} in {_arm_folder(ab, name)}" if ab.arm_checkpoints
                     else "no --arm-checkpoints to resume it from")
            print(f"{name}: its run in {ab.continue_from} stopped after step {reached}, and {where}: it reruns from "
                  "step 0", flush=True)
    return points


def _checkpointed(cfg: JobConfig, folder: Path, resume: Path | None) -> JobConfig:
    """An arm's configuration keeping its checkpoints in `folder` and resuming from `resume`, trusted: the A/B wrote
    it. No save after the last step: a finished arm's checkpoints would be removed at once. Saving only when stopped,
    it keeps its newest alone (each stop records the step it saved); with --save-interval, every one, as asked: a
    hard kill after an interval's save leaves the evidence at an earlier step, which only an earlier checkpoint
    resumes."""
    keep = cfg.checkpoint.keep_latest if cfg.checkpoint.interval else 1
    return replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(folder), resume=str(resume) if resume else None,
                                           trust=resume is not None, save_last=False, keep_latest=keep))


def _drop_checkpoints(folder: Path) -> None:
    """Remove the checkpoints of an arm that has run all its steps (nothing resumes them, and a long A/B's would fill
    the disk), and its folder when that empties it."""
    from fp8stack.train.checkpoint import saved_steps

    for path in saved_steps(folder).values():
        shutil.rmtree(path)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def stopped(run: dict | str | None) -> bool:
    """Whether an arm's recorded run is one a stop cut (TrainResult.stopped_after): partial, so still pending."""
    return isinstance(run, dict) and run.get("stopped_after") is not None


LAYER_ROUTING_EVERY = 50
"""The evidence keeps each MoE layer's routing statistics every this many steps (and the last); the statistics over
the layers, which the verdicts read, at every step. Every layer at every step (five numbers a layer) would make a
long MoE A/B's evidence tens of MB; the trainer's TensorBoard scalars keep them all."""


PER_STEP_DIGITS = 7
"""Significant digits the evidence keeps of the per-step step times, learning rates, gradient norms and routing
statistics (ROUNDED_PER_STEP): their run-to-run noise sits orders of magnitude above the seventh, and the digits
after it made up about half of a long MoE A/B's file. The losses stay as measured: resumed and repeated runs are
compared bit for bit by them."""
ROUNDED_PER_STEP = ("step_ms", "lrs", "grad_norms", "router")


def recorded_run(run: dict | str) -> dict | str:
    """An arm's run as the evidence keeps it: ROUNDED_PER_STEP to PER_STEP_DIGITS significant digits, its router
    statistics per layer thinned to every LAYER_ROUTING_EVERY steps (those over the layers kept at every step); the
    rest as the run returned it."""
    if not isinstance(run, dict):
        return run
    kept = dict(run)
    if run.get("router"):
        last = len(run["router"]) - 1
        kept["router"] = [step if index % LAYER_ROUTING_EVERY == 0 or index == last else
                          {key: value for key, value in step.items() if "/" not in key}
                          for index, step in enumerate(run["router"])]
    return {**kept, **{key: _significant(kept[key]) for key in ROUNDED_PER_STEP if key in kept}}


def _significant(value):
    """`value` with each float in it (in lists and dicts too) rounded to PER_STEP_DIGITS significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{PER_STEP_DIGITS}g}")
    if isinstance(value, list):
        return [_significant(item) for item in value]
    if isinstance(value, dict):
        return {key: _significant(item) for key, item in value.items()}
    return value


PER_STEP = ("losses", "step_ms", "lrs", "grad_norms", "router")
"""The TrainResult lists with one entry per step."""


def stitched(partial: dict, resumed: dict) -> dict:
    """An arm's run cut by a stop and the run resumed from its checkpoint, as one run: the cut run's steps before the
    checkpoint's (where the resumed run began), then the resumed run's; the throughput over them all, as the trainer
    measures it; the larger memory peaks; everything else (the validation loss, stopped_after) the resumed run's.
    resumed_at lists the steps it resumed at."""
    kept = resumed["first_step"] - partial["first_step"]
    run = {**resumed, **{key: partial[key][:kept] + resumed[key] for key in PER_STEP},
           "first_step": partial["first_step"], "resumed_at": [*partial.get("resumed_at", []), resumed["first_step"]],
           "zero_fp8_weight_grads": partial["zero_fp8_weight_grads"]}  # the checks of the run's first steps
    run["tokens_per_s"] = tokens_per_s(run["tokens_per_step"], run["step_ms"])
    for key in ("peak_mem_gib", "max_rss_gib"):
        run[key] = max((value for value in (partial[key], resumed[key]) if value is not None), default=None)
    return run


def _pending_label(name: str, partial: dict | None, steps: int) -> str:
    """A pending arm as the partial evidence names it: with the step a stop cut its run after, if one did."""
    return f"{name} (stopped after step {partial['stopped_after']} of {steps})" if partial else name


def _stopped_text(number: int, partials: dict[str, dict], json_path: Path | None, ab: AbConfig) -> str:
    """What a stopped A/B says: the signal, the arms it cut and where they resume from, and how to continue."""
    kept = "; ".join(f"{name} after step {run['stopped_after']}" for name, run in partials.items())
    resume = f" --arm-checkpoints {ab.arm_checkpoints}" if ab.arm_checkpoints else ""
    return (f"stopped by {signal.Signals(number).name}" + (f" ({kept}, checkpoints in {ab.arm_checkpoints})"
                                                           if kept else "")
            + (f": continue with --continue-from {json_path}{resume}" if json_path
               else ": no arm measured anything, no evidence written"))


def repeated_text(tokens: int, split_bytes: int) -> str:
    """Why an A/B reading its training text more than MAX_PASSES times will not compare final losses, and the fix
    (said before any run: a 2 000-step loss A/B found it out after its GPU time was spent)."""
    return (f"{tokens:,} training tokens per arm read the training text ({split_bytes / 1e6:.1f} MB) "
            f"{tokens / split_bytes:.2f} times: the runs memorise it and their final losses will not be compared; for "
            f"a loss verdict pass --max-data-bytes {math.ceil(tokens / MAX_PASSES)} or more (or train fewer tokens)")


def _planned_backend(recipe: str, preference: str) -> str:
    """The backend the plan gives dense linears under `recipe` (bf16 for the bf16 arm, te with --bf16-on-te)."""
    if not is_fp8(recipe):
        return "te" if preference == "te" else BF16
    return dense_backend(get_recipe(recipe), preference)


STOP_WAIT_S = 900
"""Seconds an arm told to stop has to end its step and save its checkpoint (GBs on a GPU) before it is killed."""


FAILURE_TAIL_LINES = 20
"""Lines of a failed arm's standard error shown above its reason (the reason alone is one line)."""


def ended_without_error(code: int, wrote_result: bool) -> str:
    """Why an arm failed whose standard error names no error: the signal that ended it, or its exit code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        ended = f"killed by {name}"
    else:
        ended = f"exit code {code}"
    return f"{ended}, {'after writing' if wrote_result else 'without'} its result"


def arm_stem(name: str) -> str:
    """An arm's name as a file or folder name: spaces and anything a path would split on (a lever's value may be a
    path) as '_'."""
    return re.sub(r"[^\w.,+=()*-]", "_", name)


class _ArmStop(StopSignals):
    """While inside: SIGTERM and SIGINT stop the A/B after its running arms' current steps: the signal is forwarded
    to each arm started (once: a second ends a training run at once, without its checkpoint), and no further arm
    starts. The same signal again ends the A/B at once, as without this (StopSignals)."""

    def __init__(self):
        super().__init__()
        self._arms: list[_RunningArm] = []

    def started(self, arm: "_RunningArm") -> "_RunningArm":
        """Track `arm`; an arm started as the signal came is stopped too. Returns it."""
        self._arms.append(arm)
        if self.received:  # the handler ran before the arm was tracked (it runs once, whole, before this line)
            arm.stop(self.received)
        return arm

    def _record(self, number: int, frame) -> None:
        first = self.received is None
        super()._record(number, frame)
        if first:
            for arm in self._arms:
                arm.stop(number)


class _RunningArm:
    """Fresh `python -m fp8stack.train` process(es) for one arm, started on construction (on `gpu` alone when given;
    in a process group of its own with `own_group`, so that only what the A/B forwards reaches it)."""

    def __init__(self, cfg, scratch: Path, nproc: int, gpu: str | None = None, name: str = "", own_group: bool = False):
        stem = arm_stem(name or cfg.precision.recipe)  # the bf16 repeat runs bf16's config under its own name
        self.config_path, self.result_path = (scratch / f"{stem}.{kind}.json" for kind in ("config", "result"))
        self.config_path.write_text(json.dumps(to_dict(cfg)))
        command = [*launcher(nproc), "-m", "fp8stack", "train", "--config", str(self.config_path),
                   "--result-json", str(self.result_path)]
        env = {**os.environ, **NO_MULTICAST_ENV, **(on_gpu(gpu) if gpu else {})}
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: arms side by side never block on it
        self.process = subprocess.Popen(command, stderr=self.stderr, text=True, env=env,
                                        process_group=0 if own_group else None)
        self.ran_between = [time.time()]
        """[start, collection] in seconds since the epoch; collection is when result() returned."""
        self._kill: threading.Timer | None = None
        """Once stop() has sent its signal: what kills the arm if it has not ended STOP_WAIT_S later."""

    def stop(self, number: int) -> None:
        """Send the signal `number` (once) to the arm's process, if it still runs: it stops after its current step,
        and is killed if it has not ended STOP_WAIT_S later."""
        if self._kill is None and self.process.poll() is None:
            self.process.send_signal(number)
            self._kill = threading.Timer(STOP_WAIT_S, self.process.kill)
            self._kill.daemon = True
            self._kill.start()

    def result(self) -> dict | str:
        """Wait for the arm: its TrainResult dict (with ran_between; stopped_after set when a signal stopped it), or
        the error it ended with."""
        code = self.process.wait()
        if self._kill:
            self._kill.cancel()
        self.ran_between.append(time.time())
        self.stderr.seek(0)
        stderr = self.stderr.read()
        self.stderr.close()
        if code != 0 and self.result_path.is_file():
            cut = json.loads(self.result_path.read_text())
            if cut.get("stopped_after") is not None:
                print(f"    stopped after step {cut['stopped_after']}", flush=True)
                return {**cut, "ran_between": self.ran_between}
        if code != 0 or not self.result_path.is_file():
            lines = [line for line in stderr.splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()]
            why = errors[-1] if errors else ended_without_error(code, self.result_path.is_file())
            print("\n".join(f"    | {line}" for line in lines[-FAILURE_TAIL_LINES:]), flush=True)
            print(f"    failed: {why}", flush=True)
            return why.removeprefix("fp8stack train: error: ")
        return {**json.loads(self.result_path.read_text()), "ran_between": self.ran_between}


def _as_they_end(outcomes: dict[str, "_RunningArm | str"], poll_s: float = 1.0):
    """(name, outcome) of a wave's arms in the order their processes end; an arm that never started first."""
    waiting = dict(outcomes)
    while waiting:
        ended = [name for name, outcome in waiting.items()
                 if not isinstance(outcome, _RunningArm) or outcome.process.poll() is not None]
        for name in ended:
            yield name, waiting.pop(name)
        if waiting and not ended:
            time.sleep(poll_s)


def _table(arms: list[Arm]) -> tuple[list[str], list[list]]:
    """The evidence's table: one row per arm, under the name it is shown by (Arm.label), with its measurements, its
    speed, memory and loss verdicts (verdict_cells) and the overall verdict with its reason; for an MoE model also
    its final-window mean expert load imbalance (Arm.router_imbalance)."""
    header = ["arm", "backend", "step ms", "tokens/s", "TFLOP/s", "MFU", "mem GiB", "final loss", "speed", "memory",
              "loss", "verdict", "reason"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    rows = [[a.label, a.backend, fmt(a.step_ms, ".1f"), fmt(a.tokens_per_s, ",.0f"), fmt(a.tflops, ".3g"),
             fmt(a.mfu, ".1%"), fmt(a.peak_mem_gib, ".2f"), fmt(a.final_loss, ".4f"), *verdict_cells(a),
             a.verdict, a.reason] for a in arms]
    if any(a.router_imbalance is not None for a in arms):  # an MoE model: its routing beside its final loss
        at = header.index("final loss") + 1
        header.insert(at, "experts max/mean")
        for arm, row in zip(arms, rows):
            row.insert(at, fmt(arm.router_imbalance, ".3f"))
    return header, rows


def _print_table(table: tuple[list[str], list[list]], markdown: str) -> None:
    """A rich table on a terminal; the Markdown table elsewhere (logs keep every column whole). On a terminal the
    numbers stay on one line; the arm's name, the verdicts and the reason wrap."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        print(markdown, end="")
        return
    header, rows = table
    view = Table(*header)
    wrapping = {"arm", "speed", "memory", "loss", "reason"}
    for name, column in zip(header, view.columns):
        column.no_wrap = name not in wrapping
    for row in rows:
        view.add_row(*map(str, row))
    console.print(view)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fp8stack.ab ...`: the same as `fp8stack ab ...`."""
    return run_command("fp8stack ab", _add_arguments, run_ab, argv)
