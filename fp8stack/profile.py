"""`fp8stack profile`: where a training step's time goes, and how much FP8 can gain at most.

Runs a few trainer steps under torch.profiler (CUDA kernels on a GPU, CPU ops on a CPU), sorts each
kernel's time into a category by its name (CLASSIFIER) and bounds the plan's FP8 gain by Amdahl's
law: with GEMMs at share s of the bf16 step's time, FP8 GEMMs `r` times faster and the plan's FP8
share f of the GEMM FLOPs, a step gets at most 1 / (1 - s*f + s*f/r) faster. s comes from a bf16
profile of the same model (profiled first for an FP8 recipe: in the FP8 run the GEMMs are already the
faster ones). Also reports quantize/scale time over GEMM time in the FP8 run (target: at most 10%), whole
and as overhead (quantize_overhead: a norm or activation kernel that writes FP8 counts by its excess over the
bf16 run's kernel of the same family), and the measured gain when `fp8stack ab` evidence for the same model and
device exists.
Beside the kernels, the host's side of the same record: the CPU ops and record_function ranges with the most self CPU
time per step and their calls per step, which tell a step bound by Python and kernel launches from one bound by the
GPU. profile_from_record turns a profiler record into this breakdown for any steps: fp8stack.bench.profile_script
profiles a user's own training script with it.
Writes profile-<model>-<device>.json and .md evidence.
"""

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fp8stack.config import ConfigError, JobConfig, add_config_arguments, add_section_arguments, job_from_args, to_dict
from fp8stack.config.flags import DERIVED_FIELDS, add_megatron_recompute_arguments, run_command
from fp8stack.plan import Plan, PlanError
from fp8stack.plan.recipes import BF16, is_fp8

CLASSIFIER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "reducescatter", "all_to_all", "alltoall", "c10d::", "gloo")),
    # Before gemm: flash/cuDNN/cutlass attention kernels also name wgmma or cutlass.
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    # Before quantize: FP8 GEMMs name their e4m3/float8 operand types.
    ("gemm", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "wgmma", "scaled_mm", "grouped_mm", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
    # Before norm and elementwise: a cast to FP8 is an elementwise kernel on Float8 types, and a compiled
    # norm fused with its amax counts here (the overhead QUANTIZE_TARGET bounds).
    ("quantize", ("quantize", "cast_transpose", "compute_scale", "scale_update", "amax", "fp8", "float8",
                  "e4m3", "e5m2")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "rsqrt")),
    ("elementwise", ("elementwise", "triton_poi", "multi_tensor_apply", "foreach", "silu", "gelu", "swiglu",
                     "act_lu", "aten::add", "aten::mul", "aten::sub", "aten::div", "aten::neg", "aten::copy_",
                     "aten::_to_copy", "aten::to", "aten::fill_", "aten::zero_", "aten::clamp", "aten::pow",
                     "aten::sqrt", "aten::exp", "aten::abs", "aten::reciprocal", "aten::where", "aten::lerp",
                     "aten::addc", "aten::cat")),
)
"""(category, lower-case name substrings), first match wins; a name matching none is 'other'."""
CATEGORIES = tuple(category for category, _ in CLASSIFIER) + ("other",)
DEFAULT_GEMM_SPEEDUP = 2.0
"""FP8 over BF16 GEMM throughput: the dense tensor-core peaks' ratio on Hopper."""
QUANTIZE_TARGET = 0.10
"""Quantize/scale time at most this share of GEMM time: above it, the casts eat the FP8 GEMMs' gain."""
TOP_KERNELS = 30
"""Kernels listed in the evidence, by time."""
NAME_WIDTH = 110
"""Kernel names longer than this are cut in the Markdown table (the JSON keeps them whole)."""
GAP_MIN_US = 20.0
"""GPU idle gaps at least this long are listed by the kernels around them; shorter ones are launch latency."""
TOP_GAPS = 15
"""Kernel pairs listed in the evidence, by idle time between them."""
TOP_HOST_OPS = 20
"""Host ops listed in the evidence, by self CPU time."""
TOP_MEMORY_SITES = 20
"""Allocation sites listed in a memory breakdown (memory_at_peak)."""
HOST_TITLE = "Host: top ops by self CPU time per step"
"""The heading of the host table in the evidence's Markdown."""
HOST_NOTE = ("CPU ops and record_function ranges, the whole step's left out, self time summed over threads: thousands "
             "of calls of small ops per step mark a step bound by the host, not the GPU")
"""How to read the host table."""


def classify(name: str) -> str:
    """The CLASSIFIER category of a kernel or op name."""
    lowered = name.lower()
    for category, markers in CLASSIFIER:
        if any(marker in lowered for marker in markers):
            return category
    return "other"


def amdahl_bound(gemm_share: float, fp8_share: float, speedup: float) -> float:
    """Largest step speed-up when the share `fp8_share` of GEMM time, itself `gemm_share` of the step,
    runs `speedup` times faster and nothing else changes."""
    sped_up = gemm_share * fp8_share
    return 1.0 / (1.0 - sped_up + sped_up / speedup)


def measured_gemm_speedup(bf16_gemm_ms: float, fp8_gemm_ms: float, fp8_share: float) -> float | None:
    """How much faster the FP8 GEMMs ran than in BF16, from two profiled runs' GEMM time: the BF16 run's split by
    the plan's FP8 FLOP share `fp8_share`, the GEMMs the plan keeps in BF16 taken at their BF16-run time in the FP8
    run too. None where the FP8 run's GEMMs took no longer than those alone would."""
    kept = (1.0 - fp8_share) * bf16_gemm_ms
    return fp8_share * bf16_gemm_ms / (fp8_gemm_ms - kept) if fp8_gemm_ms > kept else None


@dataclass
class Kernel:
    """One kernel (GPU) or op (CPU), summed over the profiled steps."""

    name: str
    """Kernel or op name as the profiler reports it."""
    category: str
    """classify(name)."""
    ms_per_step: float
    """Self time per profiled step."""
    share: float
    """Of the run's total profiled time."""
    calls_per_step: float
    """Launches per profiled step."""


@dataclass
class Gap:
    """GPU idle time between two kernels, summed over the profiled steps: where the GPU waited on the host."""

    previous_kernel: str
    """The kernel whose end opened the gap (the latest-ending kernel so far, any stream)."""
    next_kernel: str
    """The kernel whose start closed it."""
    ms_per_step: float
    """Idle time per profiled step."""
    count_per_step: float
    """Gaps between this pair per profiled step."""


@dataclass
class HostOp:
    """One CPU op or record_function range, summed over the profiled steps: the host's side of a step."""

    name: str
    """Op or range name as the profiler reports it (aten::copy_, Optimizer.step#AdamW.step, cudaLaunchKernel)."""
    self_ms_per_step: float
    """CPU time in it and not in the ops it called, per profiled step, summed over threads."""
    calls_per_step: float
    """Calls per profiled step."""


@dataclass
class RunProfile:
    """Where one recipe's steps spend their time."""

    recipe: str
    """Plan recipe, bf16 for none (fp8stack.bench.profile_script: the script or module profiled)."""
    time_basis: str
    """What the times are: summed CUDA kernel time, or CPU self time of profiled ops."""
    wall_ms_per_step: float
    """Wall time per profiled step (the profiler's overhead included)."""
    busy_ms_per_step: float
    """Sum of all kernels' (ops') times per step: the share's denominator."""
    categories: dict[str, dict[str, float]]
    """category -> {'ms_per_step', 'share'}, in CATEGORIES order."""
    top_kernels: list[Kernel]
    """The TOP_KERNELS longest, longest first."""
    idle_ms_per_step: float | None = None
    """GPU time with no kernel running on any stream, from the first profiled kernel to the last (None on a CPU)."""
    gaps: list[Gap] | None = None
    """The TOP_GAPS kernel pairs with the most idle time between them, in gaps of at least GAP_MIN_US."""
    family_ms: dict[str, dict[str, float]] | None = None
    """category -> kernel_family -> ms per step, over every kernel (None in files written before it existed)."""
    host_ops: list[HostOp] | None = None
    """The TOP_HOST_OPS CPU ops and record_function ranges with the most self CPU time, the whole step's range left
    out (None in files written before it existed)."""

    def share(self, category: str) -> float:
        return self.categories[category]["share"]

    @classmethod
    def from_dict(cls, record: dict) -> "RunProfile":
        """A RunProfile from its JSON form (asdict), fields added later absent or None in older files."""
        nested = {"top_kernels": Kernel, "gaps": Gap, "host_ops": HostOp}
        return cls(**{**record, **{name: [kind(**item) for item in record[name]] for name, kind in nested.items()
                                   if record.get(name) is not None}})


def kernel_family(name: str) -> str:
    """A kernel's function without its template arguments and parameters, so that the same work at other dtypes
    is one family: 'void ns::dgated_act_kernel<16, true, float, ...>(...)' -> 'ns::dgated_act_kernel'."""
    return re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0].strip()


def family_ms(kernels: Sequence[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """category -> kernel_family -> summed ms, from (kernel name, ms) pairs."""
    families: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, ms in kernels:
        families[classify(name)][kernel_family(name)] += ms
    return {category: dict(found) for category, found in families.items()}


def quantize_overhead(quantize_ms: float, fp8_families: dict[str, dict[str, float]],
                      bf16_families: dict[str, dict[str, float]]) -> tuple[float, list[dict]]:
    """(quantize ms net of fused work, the fused families): a quantize kernel of a family the bf16 run runs outside
    quantize (a norm or an activation that writes FP8 here and BF16 there, fused with its cast) counts only by its
    excess over that counterpart; every other quantize kernel counts whole. Family times missing from the bf16 side
    (a file's top kernels only) subtract nothing, so the overhead is never understated."""
    counterparts: dict[str, float] = defaultdict(float)
    for category, families in bf16_families.items():
        if category != "quantize":
            for family, ms in families.items():
                counterparts[family] += ms
    fused = [{"family": family, "ms_per_step": ms, "bf16_ms_per_step": counterparts[family]}
             for family, ms in fp8_families.get("quantize", {}).items() if family in counterparts]
    return quantize_ms - sum(min(f["ms_per_step"], f["bf16_ms_per_step"]) for f in fused), fused


def fp8_matmul_share(plan: Plan) -> float:
    """Share of the plan's weight-GEMM FLOPs run in FP8. The attention core is left out, in BF16 or FP8
    (fp8_attention), as its kernels classify as attention, not GEMM (Plan.summary()'s share counts it)."""
    from fp8stack.plan.description import GEMM_KINDS

    gemms = [d for d in plan.decisions if d.component.kind in GEMM_KINDS and d.component.kind != "attn_core"]
    total = sum(d.component.flops_per_token for d in gemms)
    return sum(d.component.flops_per_token for d in gemms if d.precision == "fp8") / total if total else 0.0


def summarize(times_us: dict[str, float], calls: dict[str, int], steps: int, recipe: str, time_basis: str,
              wall_ms_per_step: float) -> RunProfile:
    """A RunProfile from per-name self times (microseconds) and call counts over `steps` steps."""
    busy_us = sum(times_us.values()) or 1.0
    per_category: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    for name, us in times_us.items():
        per_category[classify(name)] += us
    ranked = sorted(times_us, key=times_us.get, reverse=True)[:TOP_KERNELS]
    return RunProfile(
        recipe=recipe, time_basis=time_basis, wall_ms_per_step=wall_ms_per_step,
        busy_ms_per_step=busy_us / steps / 1000,
        categories={c: {"ms_per_step": us / steps / 1000, "share": us / busy_us} for c, us in per_category.items()},
        top_kernels=[Kernel(name=n, category=classify(n), ms_per_step=times_us[n] / steps / 1000,
                            share=times_us[n] / busy_us, calls_per_step=calls[n] / steps) for n in ranked],
        family_ms=family_ms([(n, us / steps / 1000) for n, us in times_us.items()]))


def idle_gaps(kernels: Sequence[tuple[str, float, float]], steps: int) -> tuple[float, list[Gap]]:
    """(idle ms per step, the TOP_GAPS longest-waiting kernel pairs) from (name, start us, end us) kernel intervals
    on any stream: idle is where no kernel runs, between the first start and the last end."""
    idle_us, by_pair, counts = 0.0, defaultdict(float), defaultdict(int)
    busy_until, last = None, ""
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        if busy_until is not None and start > busy_until:
            idle_us += start - busy_until
            if start - busy_until >= GAP_MIN_US:
                by_pair[last, name] += start - busy_until
                counts[last, name] += 1
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    ranked = sorted(by_pair, key=by_pair.get, reverse=True)[:TOP_GAPS]
    return idle_us / steps / 1000, [Gap(previous_kernel=p, next_kernel=n, ms_per_step=by_pair[p, n] / steps / 1000,
                                        count_per_step=counts[p, n] / steps) for p, n in ranked]


def profile_run(cfg, warmup: int, steps: int) -> tuple[RunProfile, Plan]:
    """Profile `steps` steps of cfg's run after `warmup` unprofiled ones (and one profiler warm-up
    step); returns the profile and the run's plan."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from fp8stack.train.loop import session

    with session(cfg) as run:
        on_gpu = run.env.device.type == "cuda"
        for _ in range(warmup):
            run.step(cfg.optimizer.grad_clip)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        cycles = []  # the profiler clears its events when the cycle ends: keep them as it ends
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda done: cycles.append((done.key_averages(), done.events()))) as profiler:
            step_ms = []
            for _ in range(1 + steps):
                began = time.perf_counter()
                run.step(cfg.optimizer.grad_clip)  # its host sync, as in train()
                step_ms.append((time.perf_counter() - began) * 1000)
                profiler.step()  # not timed: the last one stops the profiler and collects its events
        wall_ms = sum(step_ms[1:]) / steps
        averages, events = cycles[0]
        return profile_from_record(averages, events, steps=steps, recipe=cfg.precision.recipe,
                                   wall_ms_per_step=wall_ms, on_gpu=on_gpu), run.plan


def profile_from_record(averages, events, *, steps: int, recipe: str, wall_ms_per_step: float,
                        on_gpu: bool) -> RunProfile:
    """The breakdown of `steps` profiled steps from one torch.profiler record (its key_averages() and events()):
    CUDA kernels by category with the GPU's idle gaps on a GPU, CPU ops on a CPU, and the host's top ops on both."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in averages:
        if event.device_type != kind or _is_annotation(event):
            continue
        name = _without_step_number(event.key)
        times[name] += event.self_device_time_total if on_gpu else event.self_cpu_time_total
        calls[name] += event.count
    basis = ("CUDA kernel time, summed over streams" if on_gpu else
             "CPU self time of the profiled ops (the main thread's view; intra-op threads inside)")
    profiled = summarize(times, calls, steps, recipe, basis, wall_ms_per_step)
    if on_gpu:  # CPU ops nest, so only kernels have gaps worth reading
        profiled.idle_ms_per_step, profiled.gaps = idle_gaps(
            [(e.name, e.time_range.start, e.time_range.end) for e in events
             if e.device_type == DeviceType.CUDA and not _is_annotation(e)], steps)
    profiled.host_ops = top_host_ops(averages, steps)
    return profiled


def top_host_ops(averages, steps: int) -> list[HostOp]:
    """The TOP_HOST_OPS CPU ops and record_function ranges by self CPU time per step, from a profiler record's
    key_averages(): the whole step's range (ProfilerStep#N) left out, as its self time is only the gaps between
    the ops inside it."""
    from torch.autograd import DeviceType

    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in averages:
        if event.device_type == DeviceType.CPU and not event.key.startswith("ProfilerStep"):
            name = _without_step_number(event.key)
            self_us[name] += event.self_cpu_time_total
            calls[name] += event.count
    ranked = sorted(self_us, key=self_us.get, reverse=True)[:TOP_HOST_OPS]
    return [HostOp(name=n, self_ms_per_step=self_us[n] / steps / 1000, calls_per_step=calls[n] / steps)
            for n in ranked]


def _without_step_number(key: str) -> str:
    """ProfilerStep#3 -> ProfilerStep: the same range in every step is one name."""
    return re.sub(r"#\d+$", "", key)


def _free_finished_run() -> None:
    """Let the next profiled run start on an empty GPU: torch.compile's leftovers hold some of a compiled model's
    parameters in cycles only the collector frees."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_annotation(event) -> bool:
    """A record_function range (ProfilerStep#N, Optimizer.step#AdamW.step) rather than a kernel: on
    CUDA its device time spans the kernels inside it, so counting it would count them twice."""
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith("ProfilerStep")


def measured_gain(ab_path: Path, recipe: str) -> float | None:
    """tokens/s of `recipe`'s arm over the reference bf16 arm in an `fp8stack ab` JSON; None when absent."""
    if not ab_path.is_file():
        return None
    arms = json.loads(ab_path.read_text()).get("arms", [])
    reference = next((arm for arm in arms if arm.get("verdict") == "baseline"), {})
    base = reference.get("tokens_per_s")
    arm = next((arm for arm in arms if arm["recipe"] == recipe), {}).get("tokens_per_s")
    return arm / base if base and arm else None


@dataclass
class ProfileConfig:
    """What is profiled and how the bound is computed; every other option is the training configuration profiled."""

    steps: int = 5
    """Profiled steps per run."""
    warmup_steps: int = 3
    """Unprofiled steps first: allocator, kernel selection, compilation."""
    gemm_speedup: float = DEFAULT_GEMM_SPEEDUP
    """Assumed FP8 over BF16 GEMM speed for the bound."""
    out_dir: str = "profiles"
    """Where the evidence goes and the A/B evidence is read from."""
    label: str | None = None
    """Added to the evidence's name, profile-<model>-<label>-<gpu>; the A/B evidence read is the one
    `fp8stack ab --label` of the same label wrote."""
    force: bool = False
    """Replace evidence of the same name (.json, .md)."""


PROFILE_ALIASES = {"profile.steps": ("--steps",), "profile.gemm_speedup": ("--gemm-speedup",),
                   "profile.out_dir": ("--out-dir",), "profile.label": ("--label",), "profile.force": ("--force",)}
"""The profile's own flags by their earlier names."""


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `profile` subcommand to an argparse subparsers object; it runs run_profile(args)."""
    parser = subparsers.add_parser(
        "profile", help="profile training steps: time per kernel category and the Amdahl bound on FP8's gain",
        description=__doc__.split("\n\n")[0], usage="%(prog)s [options]")
    _add_arguments(parser)
    parser.set_defaults(run=run_profile)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_section_arguments(parser, "profile", ProfileConfig(), aliases=PROFILE_ALIASES)
    add_config_arguments(parser, skip=(*DERIVED_FIELDS, "training.steps"))
    add_megatron_recompute_arguments(parser)


def run_profile(args: argparse.Namespace) -> int:
    """Profile bf16 (for the GEMM share) and the recipe, write and print the evidence."""
    from fp8stack.evidence import (EvidenceError, claim_evidence, device_slug, environment, latest_evidence,
                                         markdown_table, write_evidence)
    from fp8stack.train.loop import resolve_job
    from fp8stack.train.model import model_shape
    from fp8stack.train.preflight import preflight

    env = environment()
    try:
        options = ProfileConfig(**{k.removeprefix("profile."): v for k, v in vars(args).items()
                                   if k.startswith("profile.")})
        job = job_from_args(args)
        name = "-".join(filter(None, (job.model.name, options.label, device_slug(env["device"]))))
        stem = f"profile-{name}"
        if options.steps < 1 or options.warmup_steps < 0 or not 0 < options.gemm_speedup < float("inf"):
            raise ConfigError(f"need --profile.steps >= 1, --profile.warmup-steps >= 0 and --gemm-speedup > 0, got "
                              f"{options.steps}, {options.warmup_steps} and {options.gemm_speedup}")
        job = replace(job, training=replace(job.training, steps=options.warmup_steps + 1 + options.steps),
                      logging=replace(job.logging, progress=False))
        recipe = job.precision.recipe
        # a BF16 plan has no FP8 weights: FP8 parameters are profiled against BF16 ones, as the A/B judges them
        configs = [resolve_job(_without_fp8(job)), *([resolve_job(job)] if is_fp8(recipe) else [])]
        claim_evidence(stem, options.out_dir, options.force)
        for cfg in configs:
            preflight(cfg, model_shape(cfg))
        runs, plan = {}, None
        for cfg in configs:
            print(f"profiling {cfg.model.name} {cfg.precision.recipe}: {options.warmup_steps} + 1 warm-up and "
                  f"{options.steps} profiled steps", flush=True)
            runs[cfg.precision.recipe], plan = profile_run(cfg, options.warmup_steps, options.steps)
            _free_finished_run()
    except (ConfigError, PlanError, EvidenceError) as err:
        print(f"fp8stack profile: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2

    ab_path = latest_evidence(f"ab-{name}", options.out_dir)
    profiled, baseline = runs[recipe], runs[BF16]
    gemm_share, fp8_share = baseline.share("gemm"), fp8_matmul_share(plan)
    gemm_ms = profiled.categories["gemm"]["ms_per_step"]
    measured = measured_gemm_speedup(baseline.categories["gemm"]["ms_per_step"], gemm_ms, fp8_share)
    overhead_ms, fused = quantize_overhead(profiled.categories["quantize"]["ms_per_step"], profiled.family_ms,
                                           baseline.family_ms)
    payload = {
        "model": job.model.name, "recipe": recipe, "steps": options.steps, "warmup": options.warmup_steps,
        "train_config": to_dict(configs[-1]),
        "plan_summary": plan.summary(),
        "fp8_share_of_gemm_flops": fp8_share,
        "gemm_share": gemm_share,
        "gemm_speedup": options.gemm_speedup,
        "amdahl_bound": amdahl_bound(gemm_share, fp8_share, options.gemm_speedup),
        "measured_gemm_speedup": measured,
        "amdahl_bound_at_measured_speedup": amdahl_bound(gemm_share, fp8_share, measured) if measured else None,
        "quantize_over_gemm": profiled.categories["quantize"]["ms_per_step"] / gemm_ms if gemm_ms else None,
        "quantize_overhead_over_gemm": overhead_ms / gemm_ms if gemm_ms else None,
        "quantize_fused_families": fused,
        "quantize_target": QUANTIZE_TARGET,
        "measured_gain": measured_gain(ab_path, recipe) if is_fp8(recipe) else None,
        "ab_evidence": str(ab_path) if ab_path.is_file() else None,
        "classifier": [{"category": c, "substrings": list(m)} for c, m in CLASSIFIER],
        "runs": {recipe: asdict(run) for recipe, run in runs.items()},
    }
    markdown = _markdown(payload, runs, markdown_table)
    json_path, md_path = write_evidence(stem, payload, markdown, out_dir=options.out_dir, replace=True)  # claimed
    print(markdown, end="")
    print(f"wrote {json_path}, {md_path}")
    return 0


def _without_fp8(job: JobConfig) -> JobConfig:
    """The BF16 run a profile compares with: the same configuration under recipe bf16, BF16 parameters where the
    profiled run's are FP8, without the FP8 runs' options (no FP8 experts: grouped_fp8's options of blockwise experts
    at their defaults; no recipe file's overrides)."""
    param_dtype = "bf16" if job.training.param_dtype == "fp8" else job.training.param_dtype
    return replace(job, precision=replace(job.precision, recipe=BF16, fp8_attention=False, overrides=()),
                   te=replace(job.te, delayed_margin=0, blockwise_gemms="te"),
                   grouped_fp8=job.grouped_fp8.without_blockwise_experts(),
                   training=replace(job.training, param_dtype=param_dtype))


def _markdown(payload: dict, runs: dict[str, RunProfile], markdown_table) -> str:
    recipe, profiled = payload["recipe"], runs[payload["recipe"]]
    s, f, r = payload["gemm_share"], payload["fp8_share_of_gemm_flops"], payload["gemm_speedup"]
    gain = payload["measured_gain"]
    ratio = payload["quantize_over_gemm"]
    lines = [
        f"Times: {profiled.time_basis}.",
        f"GEMM share of the bf16 step s = {s:.1%}; FP8 share of the plan's GEMM FLOPs f = {f:.1%}; "
        f"assumed FP8 GEMM speed-up r = {r:g}.",
        f"Amdahl bound on {recipe}'s gain: 1 / (1 - s*f + s*f/r) = {payload['amdahl_bound']:.2f}x; measured (A/B "
        f"tokens/s over bf16): " + (f"{gain:.2f}x" if gain is not None else
                                    f"none (no {recipe} and bf16 arms in {payload['ab_evidence'] or 'an A/B JSON'}: "
                                    f"run `fp8stack ab --model {payload['model']} --recipes {recipe}`)") + ".",
        "The FP8 GEMMs ran " + (f"{payload['measured_gemm_speedup']:.2f}x faster than in bf16 (the GEMM time split "
                                f"by f, the BF16 GEMMs at their bf16-run time): the bound at that speed-up is "
                                f"{payload['amdahl_bound_at_measured_speedup']:.3f}x."
                                if payload["measured_gemm_speedup"] else "no faster than in bf16."),
        f"Quantize/scale time over GEMM time in {recipe}: "
        + (f"{ratio:.1%} whole, {payload['quantize_overhead_over_gemm']:.1%} as overhead"
           if ratio is not None else "- (no GEMM time)") + f" (target <= {QUANTIZE_TARGET:.0%}). "
        + fused_note(payload["quantize_fused_families"]),
    ]
    text = (category_table(runs, markdown_table) + "\n" + "\n\n".join(lines) + "\n\n"
            + f"Top {len(profiled.top_kernels)} in {recipe}:\n\n" + kernel_table(profiled, markdown_table))
    if profiled.gaps is not None:
        idle = ", ".join(f"{r} {run.idle_ms_per_step:.3f}" for r, run in runs.items())
        text += (f"\n\nGPU idle (no kernel on any stream) per step, ms: {idle}; the steps' host syncs and the "
                 f"profiler's own per-step work sit in the gaps between steps. Longest waits in {recipe} (gaps of at "
                 f"least {GAP_MIN_US:g} us, by the kernels around them):\n\n" + gap_table(profiled, markdown_table))
    return text + f"\n\n{HOST_TITLE} in {recipe} ({HOST_NOTE}):\n\n" + host_table(profiled, markdown_table)


def category_table(runs: dict[str, RunProfile], markdown_table) -> str:
    """Each run's time per category side by side (ms per step, then share), its busy and wall time below."""
    header = ["category"] + [f"{r} ms/step" for r in runs] + [f"{r} share" for r in runs]
    rows = [[c] + [f"{run.categories[c]['ms_per_step']:.3f}" for run in runs.values()]
            + [f"{run.share(c):.1%}" for run in runs.values()] for c in CATEGORIES]
    rows.append(["total (busy)"] + [f"{run.busy_ms_per_step:.3f}" for run in runs.values()] + ["100%"] * len(runs))
    rows.append(["wall"] + [f"{run.wall_ms_per_step:.3f}" for run in runs.values()] + [""] * len(runs))
    return markdown_table(header, rows)


def kernel_table(run: RunProfile, markdown_table) -> str:
    """The run's top kernels (ops on a CPU), longest first."""
    return markdown_table(
        ["kernel", "category", "ms/step", "share", "calls/step"],
        [[_cut(k.name), k.category, f"{k.ms_per_step:.3f}", f"{k.share:.1%}", f"{k.calls_per_step:g}"]
         for k in run.top_kernels])


def gap_table(run: RunProfile, markdown_table) -> str:
    """The kernel pairs with the longest GPU idle time between them."""
    return markdown_table(
        ["previous kernel", "next kernel", "idle ms/step", "gaps/step"],
        [[_cut(g.previous_kernel), _cut(g.next_kernel), f"{g.ms_per_step:.3f}", f"{g.count_per_step:g}"]
         for g in run.gaps or ()])


def host_table(run: RunProfile, markdown_table) -> str:
    """The run's top host ops by self CPU time per step, with their calls per step."""
    return markdown_table(["op", "self CPU ms/step", "calls/step"],
                          [[_cut(op.name), f"{op.self_ms_per_step:.3f}", f"{op.calls_per_step:g}"]
                           for op in run.host_ops or ()])


@dataclass
class MemorySite:
    """Allocations live at a window's memory peak that one place in the code made."""

    site: str
    """The first frame of their stacks outside torch's own code ('transformer_engine/pytorch/module/linear.py:512
    forward'), or 'torch: <its innermost function>' where every frame is torch's."""
    gib: float
    """Their bytes at the peak, GiB."""
    allocations: int
    """How many of them."""


@dataclass
class MemoryPeak:
    """Where a recorded window's allocated memory peaked, and what was live then (torch.cuda.memory's trace)."""

    peak_gib: float
    """Allocated at the peak: what was allocated when the record began, plus the most the window's allocations and
    frees added to it."""
    baseline_gib: float
    """Allocated when the record began (parameters, gradients, optimizer state, caches: their stacks unrecorded)."""
    baseline_live_gib: float
    """Of baseline_gib, still allocated at the peak."""
    sites: list[MemorySite]
    """The TOP_MEMORY_SITES sites with the most bytes live at the peak among the window's own allocations."""
    events: int
    """Trace events read: a trace as long as its max_entries has lost its first events, and the figures with them."""

    @classmethod
    def from_dict(cls, record: dict) -> "MemoryPeak":
        return cls(**{**record, "sites": [MemorySite(**site) for site in record["sites"]]})


def memory_at_peak(events: Sequence[dict], baseline_bytes: int) -> MemoryPeak:
    """The peak of allocated memory over a torch.cuda.memory._snapshot() device trace (its 'alloc' and
    'free_completed' events, in order) recorded from a moment when baseline_bytes were allocated, and what was live
    then by allocation site. A free of an allocation the trace did not see came out of the baseline."""
    change = {"alloc": 1, "free_completed": -1}
    running = peak = 0
    at = -1
    for index, event in enumerate(events):
        running += change.get(event["action"], 0) * event["size"]
        if running > peak:
            peak, at = running, index
    live: dict[int, dict] = {}
    baseline_freed = 0
    for event in events[:at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is None:
            baseline_freed += event["size"]
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        totals = by_site[allocation_site(event.get("frames") or [])]
        totals[0] += event["size"]
        totals[1] += 1
    ranked = sorted(by_site.items(), key=lambda item: item[1][0], reverse=True)[:TOP_MEMORY_SITES]
    return MemoryPeak(peak_gib=(baseline_bytes + peak) / 2**30, baseline_gib=baseline_bytes / 2**30,
                      baseline_live_gib=(baseline_bytes - baseline_freed) / 2**30,
                      sites=[MemorySite(site, size / 2**30, count) for site, (size, count) in ranked],
                      events=len(events))


def allocation_site(frames: Sequence[dict]) -> str:
    """The first frame (innermost first, as the trace lists them) outside torch's own code, as 'path:line function'
    with the path from its package on; 'torch: <innermost function>' when every frame is torch's."""
    for frame in frames:
        path = frame["filename"].replace("\\", "/")
        if "/torch/" not in path and not path.startswith("<"):
            return f"{_from_package(path)}:{frame['line']} {frame['name']}"
    return f"torch: {frames[0]['name']}" if frames else "no stack recorded"


def _from_package(path: str) -> str:
    """site-packages/x/y.py -> x/y.py; a path under the working directory, relative to it."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    cwd = os.getcwd().rstrip("/") + "/"
    return path.removeprefix(cwd)


def memory_table(peak: MemoryPeak, markdown_table) -> str:
    """The window's memory peak and the sites of its own allocations live at it, largest first."""
    head = (f"Allocated at the peak: {peak.peak_gib:.2f} GiB; {peak.baseline_gib:.2f} GiB were allocated when the "
            f"record began (their stacks unrecorded), {peak.baseline_live_gib:.2f} GiB of them still live at the peak. "
            f"The window's own allocations live at the peak, by the first frame outside torch ({peak.events} trace "
            "events):\n\n")
    return head + markdown_table(["site", "GiB", "allocations"],
                                 [[_cut(site.site), f"{site.gib:.3f}", str(site.allocations)] for site in peak.sites])


def fused_note(fused: list[dict]) -> str:
    """What the overhead figure leaves out: each fused family's time here and its counterpart's in the bf16 run."""
    if not fused:
        return "No quantize kernel is fused with work the bf16 run does too: overhead = whole."
    return ("Overhead counts these quantize kernels, fused with work the bf16 run does too, by their excess over it: "
            + "; ".join(f"{f['family']} {f['ms_per_step']:.3f} ms (bf16 {f['bf16_ms_per_step']:.3f})" for f in fused)
            + ".")


def _cut(name: str) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fp8stack.profile ...`: the same as `fp8stack profile ...`."""
    return run_command("fp8stack profile", _add_arguments, run_profile, argv)


if __name__ == "__main__":
    sys.exit(main())
