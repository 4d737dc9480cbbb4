"""How an A/B arm is judged against bf16, from the measurements of its run.

An arm ships only if it is faster than the bf16 arm by more than the measured noise AND its final
loss is within the tolerance of the bf16 arm's, above or below. The loss is not compared, and a faster
FP8 arm is "inconclusive", where the comparison cannot resolve the tolerance: past one pass over the
training text (the runs memorise it, at a rate set by rounding chaos: two bf16 runs of one configuration
ended 2.6% apart after 4.2 passes, profiles/runs/2026-11-23-ab-loss-gb4-h200/), or when the bf16 runs' final losses
span more than the tolerance; the verdict then says whether the arm's final loss lies between theirs.
The bf16 arm runs --baseline-runs times (default 2: first and last), so the noise is run-to-run: the
largest of the bf16 runs' step-time differences and each compared arm's step-time spread after warm-up
(interquartile range / median); a ship verdict judged against a single bf16 run says that the loss
spread between runs went unmeasured. A machine whose speed changes during the A/B (other work, clocks,
heat) widens the noise and so cannot make an arm look faster. Final loss is the mean over the last 10%
of steps. With two BF16 configurations (--fastest-bf16: plain, and on TE modules) the faster one is the
reference every FP8 arm is judged against, as the fastest BF16 configuration of a model is the fair baseline.
"""

import statistics
from dataclasses import dataclass

from fp8stack.plan.recipes import BF16
from fp8stack.train.timing import relative_spread, steady_state

GPU_LOSS_TOLERANCE = 0.0025
"""Largest relative final-loss gap to bf16 that still ships on a GPU: 0.25%."""
CPU_LOSS_TOLERANCE = 0.02
"""On a CPU the default run is a few dozen steps of the tiny model, where the loss is still falling
fast and step-to-step batch noise is ~1% of it; 2% flags a broken recipe without failing sound ones."""
NOISE_METHOD = ("the largest of: the step-time differences between the first bf16 run and its repeats, and the "
                "step-time interquartile range / median after warm-up of the arm and of bf16")
NOISE_METHOD_SINGLE = ("step-time interquartile range / median after warm-up, the larger of the arm's and "
                       "bf16's (bf16 ran once: --baseline-runs 1)")
MAX_PASSES = 1.0
"""Training tokens over the training split's size beyond which final losses are not compared."""
LAST_FRACTION = 0.10
"""Final loss = mean over this share of the last steps (at least one)."""
REPEAT_ARM = "bf16 (repeat)"
"""The second bf16 run, as a partial evidence file lists it among the pending arms (then 'bf16 (repeat 2)', ...)."""
BF16_ON_TE_ARM = "bf16 on te"
"""The second BF16 configuration of --fastest-bf16: the bf16 plan on TE modules without FP8."""
BF16_ARMS = (BF16, BF16_ON_TE_ARM)
"""The arms that are BF16 configurations, candidates for the reference (with BF16_PARAMS_SUFFIX too)."""
BF16_PARAMS_SUFFIX = ", bf16 params"
"""After an arm's name when its run keeps BF16 parameters with FP32 masters (--param-dtypes bf16)."""
FP8_PARAMS_SUFFIX = ", fp8 params"
"""After an FP8 arm's name when its TE layers hold their weights in FP8 only, FP32 masters (--param-dtypes fp8)."""
SINGLE_RUN_CAVEAT = ("bf16 ran once, so the loss spread between runs is unmeasured (it can exceed the tolerance: "
                     "two bf16 runs of one seed part by 1-3.5% at 2 sequences per step; --baseline-runs 2 or more "
                     "measures it)")
"""Added to a ship verdict judged against a single bf16 run."""

DENSE_PEAK_TFLOPS = {
    # (name marker, variant marker or '') -> {precision: dense TFLOP/s}, NVIDIA datasheets (no sparsity).
    ("H100", "PCIe"): {"bf16": 756.0, "fp8": 1513.0},
    ("H100", "NVL"): {"bf16": 835.0, "fp8": 1671.0},
    ("H100", ""): {"bf16": 989.4, "fp8": 1978.9},
    ("H800", ""): {"bf16": 989.4, "fp8": 1978.9},
    ("H200", ""): {"bf16": 989.4, "fp8": 1978.9},
}
"""Checked in order; the first whose markers are both in the device name wins."""


@dataclass
class Arm:
    """One recipe's run, as the JSON reports it (None where the arm did not run or the device has no value)."""

    recipe: str
    """Plan recipe; bf16 is the plan without FP8, 'bf16 on te' the same on TE modules (--fastest-bf16)."""
    backend: str
    """Backend(s) the plan used other than plain bf16 ('torchao', 'te', 'torchao+grouped_fp8'; te for 'bf16 on
    te'), bf16 for the plain BF16 arm."""
    step_ms: float | None = None
    """Median steady-state step time."""
    tokens_per_s: float | None = None
    """Tokens per second over all processes."""
    tflops: float | None = None
    """Model TFLOP/s per process (GPU): 3 x forward GEMM FLOPs per token, attention included."""
    mfu: float | None = None
    """tflops over the GPU's dense peak blended by the FP8 FLOP share; None on a CPU or an unlisted GPU."""
    peak_mem_gib: float | None = None
    """CUDA peak allocated memory, or the process's max RSS on a CPU (see memory_kind)."""
    final_loss: float | None = None
    """Mean training loss over the last 10% of steps."""
    rel_loss_gap: float | None = None
    """final_loss / bf16's final_loss - 1."""
    noise: float | None = None
    """Step-time interquartile range / median of this arm."""
    verdict: str = "rollback"
    """baseline (the reference) | ship | rollback | inconclusive (the loss cannot resolve the tolerance:
    loss_unresolved) | error (no BF16 configuration ran) | alternative (a slower or failed BF16 configuration)."""
    reason: str = ""
    """Why, with the numbers."""
    val_loss: float | None = None
    """Validation loss after the last step."""
    memory_kind: str | None = None
    """cuda_peak_allocated | process_max_rss."""
    fp8_flops_share: float | None = None
    """Share of forward GEMM FLOPs the plan runs in FP8."""
    loss_curve: list[float] | None = None
    """Training loss per step."""
    ran_between: list[float] | None = None
    """[start, collection] of the arm's process(es) in seconds since the epoch (arms run with --gpus overlap)."""
    zero_fp8_weight_grads: list[list[str]] | None = None
    """Per first step: FP8 weights whose whole gradient was zero (TrainResult.zero_fp8_weight_grads)."""


def peak_tflops(device: str) -> dict[str, float] | None:
    """Dense BF16 and FP8 peaks of a GPU by name, or None when it is not in the table (or a CPU)."""
    for (model, variant), peaks in DENSE_PEAK_TFLOPS.items():
        if model in device and variant in device:
            return peaks
    return None


def blended_peak(peaks: dict[str, float], fp8_share: float) -> float:
    """The peak a run reaches if each GEMM FLOP ran at the peak of its precision: FP8 GEMMs at the FP8
    peak, the rest (attention core, head, BF16 layers) at the BF16 peak. Harmonic, as times add."""
    return 1.0 / (fp8_share / peaks["fp8"] + (1.0 - fp8_share) / peaks["bf16"])


def final_loss(losses: list[float]) -> float:
    """Mean over the last LAST_FRACTION of the steps (at least one step)."""
    tail = max(1, round(len(losses) * LAST_FRACTION))
    return statistics.fmean(losses[-tail:])


def verdict(arm_ms: float, base_ms: float, noise: float, loss_gap: float, tolerance: float,
            unresolved: str = "", reference: str = BF16) -> tuple[str, str]:
    """('ship' | 'rollback' | 'inconclusive', reason): ship only if faster than the `reference` BF16 arm by
    more than `noise` (relative) and the relative loss gap is within `tolerance` either way (an arm far below
    bf16 computes something else too). A faster arm is inconclusive when `unresolved` says why the loss cannot
    be judged."""
    speedup = base_ms / arm_ms - 1.0
    if speedup <= noise:
        speed = f"not faster than {reference} by more than the noise ({speedup:+.1%} speed-up, noise {noise:.1%})"
    else:
        speed = f"{speedup:+.1%} faster than {reference} (noise {noise:.1%})"
    if speedup > noise and unresolved:
        return "inconclusive", f"{speed}; loss not compared: {unresolved}"
    problems = [] if speedup > noise else [speed]
    if abs(loss_gap) > tolerance:
        problems.append(f"loss {loss_gap:+.2%} vs {reference} is outside the +-{tolerance:.2%} tolerance")
    if problems:
        return "rollback", "; ".join(problems)
    return "ship", f"{speed}, loss {loss_gap:+.2%} within +-{tolerance:.2%}"


def is_bf16_arm(name: str) -> bool:
    """Whether the arm `name` is a BF16 configuration (BF16_ARMS, with FP32 or BF16 parameters)."""
    return name.removesuffix(BF16_PARAMS_SUFFIX) in BF16_ARMS


def repeat_arms(baseline_runs: int) -> list[str]:
    """Names of the bf16 runs after the first: REPEAT_ARM, then 'bf16 (repeat 2)', ..."""
    return [REPEAT_ARM, *(f"{BF16} (repeat {i})" for i in range(2, baseline_runs))] if baseline_runs > 1 else []


def reference_arm(results: dict[str, dict | str]) -> str | None:
    """The BF16 configuration (is_bf16_arm) that ran with the shortest median steady-state step, or None while none
    has: the baseline of every verdict, and the configuration the bf16 repeats rerun."""
    ran = {name: statistics.median(steady_state(result["step_ms"])) for name, result in results.items()
           if is_bf16_arm(name) and isinstance(result, dict)}
    return min(ran, key=ran.get) if ran else None


def judge(results: dict[str, dict | str], backends: dict[str, str], tolerance: float, peaks: dict | None,
          repeats: dict[str, dict | str] | None = None, passes: float = 0.0) -> tuple[list[Arm], list[dict]]:
    """The arms with their measurements and verdicts, and what each repeated bf16 run (`repeats`, by name)
    measured. The baseline is reference_arm's (bf16 alone unless --fastest-bf16), and the repeats rerun it; a str
    in place of a result is the error a run hit.
    `passes`: training tokens per arm over the training split's size (see loss_unresolved)."""
    arms = [_measure(name, result, backends[name], peaks) for name, result in results.items()]
    configurations = [arm for arm in arms if is_bf16_arm(arm.recipe)]
    reference = reference_arm(results)
    if reference is None:
        for arm in arms:
            arm.verdict, arm.reason = ("error", f"bf16 baseline failed: {results[arm.recipe]}") if (
                is_bf16_arm(arm.recipe)) else ("rollback", "no bf16 baseline to compare with")
        return arms, []
    baseline = next(arm for arm in configurations if arm.recipe == reference)
    baseline.verdict, baseline.rel_loss_gap = "baseline", 0.0
    ran = sum(isinstance(results[arm.recipe], dict) for arm in configurations)
    baseline.reason = "the reference arm" + (", the fastest BF16 configuration" if ran > 1 else "")
    for other in configurations:
        if other is baseline:
            continue
        other.verdict = "alternative"
        if isinstance(results[other.recipe], str):
            other.reason = f"failed: {results[other.recipe]}; {baseline.recipe} is the reference"
            continue
        other.rel_loss_gap = other.final_loss / baseline.final_loss - 1.0
        other.reason = (f"a BF16 configuration; {baseline.recipe}, {other.step_ms / baseline.step_ms - 1:.1%} faster, "
                        "is the reference")
    records = []
    for name, repeat in (repeats or {}).items():
        if isinstance(repeat, str):
            records.append({"run": name, "error": repeat})
            continue
        again = _measure(BF16, repeat, BF16, peaks)
        step_gap = abs(again.step_ms - baseline.step_ms) / min(again.step_ms, baseline.step_ms)
        records.append({"run": name, "of": reference, "step_ms": again.step_ms, "final_loss": again.final_loss,
                        "run_to_run_noise": step_gap, "rel_loss_gap": again.final_loss / baseline.final_loss - 1.0,
                        "ran_between": again.ran_between, "loss_curve": again.loss_curve})
    measured = [r for r in records if "error" not in r]
    run_to_run = max((r["run_to_run_noise"] for r in measured), default=0.0)
    unresolved = loss_unresolved(passes, [r["rel_loss_gap"] for r in measured], tolerance)
    for arm, result in zip(arms, results.values()):
        if is_bf16_arm(arm.recipe):
            continue
        if isinstance(result, str):
            arm.verdict, arm.reason = "rollback", f"failed: {result}"
            continue
        noise = max(run_to_run, baseline.noise, arm.noise)
        arm.rel_loss_gap = arm.final_loss / baseline.final_loss - 1.0
        arm.verdict, arm.reason = verdict(arm.step_ms, baseline.step_ms, noise, arm.rel_loss_gap, tolerance, unresolved,
                                          baseline.recipe)
        if arm.verdict == "ship" and not measured:
            arm.reason += f"; {SINGLE_RUN_CAVEAT}"
        if arm.verdict == "inconclusive" and measured:
            arm.reason += f"; {band_note(arm.final_loss, [baseline.final_loss, *(r['final_loss'] for r in measured)])}"
    return arms, records


def band_note(loss: float, bf16_losses: list[float]) -> str:
    """Where a final loss lies against the bf16 runs' final losses: what an unresolved comparison can still say."""
    low, high = min(bf16_losses), max(bf16_losses)
    band = f"the {len(bf16_losses)} bf16 runs' ({low:.4f} to {high:.4f})"
    if low <= loss <= high:
        return f"its final loss lies between {band}"
    return f"its final loss lies {loss / high - 1:+.2%} above {band}" if loss > high else (
        f"its final loss lies {loss / low - 1:+.2%} below {band}")


def loss_unresolved(passes: float, repeat_gaps: list[float], tolerance: float) -> str:
    """Why final losses cannot be judged at `tolerance` ('' when they can): more than MAX_PASSES passes over
    the training text, or bf16 runs whose final losses span more than `tolerance` (`repeat_gaps`: each repeat's
    relative gap to the first bf16 run)."""
    if passes > MAX_PASSES:
        return (f"{passes:.1f} passes over the training text memorise it (rerun with fewer steps or tokens per "
                "step, or more text: --data-source python --max-data-bytes N)")
    spread = max([0.0, *repeat_gaps]) - min([0.0, *repeat_gaps])
    if spread <= tolerance:
        return ""
    runs = (f"the two bf16 runs differ by {repeat_gaps[0]:+.2%}" if len(repeat_gaps) == 1 else
            f"the {len(repeat_gaps) + 1} bf16 runs' final losses span {spread:.2%}")
    return (f"{runs}, more than the +-{tolerance:.2%} tolerance (a lower LR, more sequences per step or a longer run "
            "narrows that spread)")


def repeat_note(records: list[dict]) -> str:
    """The evidence's sentence on the bf16 repeats (`judge`'s records): step-time and final-loss gaps, failures."""
    notes = [f"{r['run']} failed: {r['error']}" for r in records if "error" in r]
    measured = [r for r in records if "error" not in r]
    if measured:
        gaps = ", ".join(f"{r['rel_loss_gap']:+.3%}" for r in measured)
        notes.insert(0, f"bf16 run-to-run over {len(measured) + 1} runs: up to "
                        f"{max(r['run_to_run_noise'] for r in measured):.1%} in step time, final loss {gaps} from the "
                        "first run")
    return f" ({'; '.join(notes)})" if notes else ""


def _measure(recipe: str, result: dict | str, backend: str, peaks: dict | None) -> Arm:
    """Throughput, FLOPs, memory and final loss of one arm's TrainResult. `backend` names the planned
    dense backend; a run reports every FP8 backend its plan used (torchao+grouped_fp8 for MoE)."""
    if isinstance(result, str):
        return Arm(recipe=recipe, backend=backend)
    summary = result["plan_summary"]
    fp8_share = summary["flops_share_by_precision"].get("fp8", 0.0)
    backends = sorted(b for b in summary["flops_share_by_backend"] if b != BF16) or [BF16]
    steady = steady_state(result["step_ms"])
    step_ms = statistics.median(steady)
    tokens_per_s = result["tokens_per_step"] / step_ms * 1000
    tflops = 3 * summary["gemm_flops_per_token"] * tokens_per_s / result["world_size"] / 1e12
    on_cuda = result["peak_mem_gib"] is not None
    return Arm(
        recipe=recipe, backend="+".join(backends), step_ms=step_ms, noise=relative_spread(steady),
        tokens_per_s=tokens_per_s, tflops=tflops,
        mfu=tflops / blended_peak(peaks, fp8_share) if peaks else None,
        peak_mem_gib=result["peak_mem_gib"] if on_cuda else result["max_rss_gib"],
        memory_kind="cuda_peak_allocated" if on_cuda else "process_max_rss",
        final_loss=final_loss(result["losses"]), val_loss=result["val_loss"], fp8_flops_share=fp8_share,
        loss_curve=result["losses"], ran_between=result["ran_between"],
        zero_fp8_weight_grads=result["zero_fp8_weight_grads"])
