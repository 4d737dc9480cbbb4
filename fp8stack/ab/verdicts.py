"""How an A/B arm is judged against the reference BF16 arm, from the measurements of its run.

Each arm gets three verdicts and an overall one, each of them against what the A/B measured of its own noise:
- speed: faster | slower | inconclusive. The arm's tokens/s over the reference's is faster above 1 + noise, slower
  below 1 - noise, inconclusive in between (the gap is within the noise, noise_band). The noise is the largest of the
  bf16 runs' step-time differences (the bf16 arm runs --baseline-runs times, default 2: first and last) and the
  arm's and the reference's step-time spread after warm-up (interquartile range / median). A machine whose speed
  changes during the A/B (other work, clocks, heat) widens the noise and so cannot make an arm look faster.
- memory: less | more | same | inconclusive, the arm's peak memory over the reference's against the memory noise
  measured as follows: on a GPU, CUDA's peak allocated memory, which one configuration reaches again byte for byte,
  so the noise is the bf16 runs' differences when they differ and 0 otherwise; on a CPU, the process's max RSS
  (allocator and library state), so the noise is the bf16 runs' max-RSS differences, unmeasured when bf16 ran once.
- loss: within | above | below the tolerance, inconclusive, or not judged. Final loss is the mean over the last
  LAST_FRACTION of steps. A run shorter than its loss_horizon is not judged. The loss is inconclusive where the
  comparison cannot resolve the tolerance: past one pass over the training text (the runs memorise it, at a rate set
  by rounding chaos: two bf16 runs of one configuration ended 2.6% apart after 4.2 passes,
  profiles/runs/2026-11-23-ab-loss-gb4-h200/), or when the bf16 runs' final losses span more than the tolerance; the
  reason then says whether the arm's final loss lies between theirs. With GATE_MIN_RUNS bf16 runs or more
  (--baseline-runs) the arm meets the one-sided loss gate instead (LossGate: above the bf16 runs' mean + max(the
  tolerance, GATE_STDEVS standard deviations) is above), the rule fp8stack.bench.loss_band applies over several A/B
  files, which their spread widens rather than leaves unresolved.
- overall (overall_verdict): ship when faster and the loss not above the tolerance; rollback when slower or the
  loss above the tolerance, or when the arm failed; inconclusive otherwise, so a gap within the noise never reads
  rollback. The loss counts one-sided (issue 36's gate): an FP8 run ending below bf16 passes, its reason saying so.
  Memory does not enter it: it is there to be read.
- router (MoE models; a note, not part of the overall verdict): the arm's final-window mean expert load imbalance
  (TrainResult.router's 'imbalance', max expert load / mean load averaged over the MoE layers, over the last
  LAST_FRACTION of steps) against the BF16 runs' (the reference and its repeats): 'differs' outside their range
  widened by router_margin on each side, 'within' inside it (router_check).
A ship judged against a single bf16 run says that the loss spread between runs went unmeasured. With two BF16
configurations (--fastest-bf16: plain, and on TE modules) the faster one is the reference every FP8 arm is judged
against, as the fastest BF16 configuration of a model is the fair baseline. On a CPU the BF16 configurations run
their activations in FP32: the table and the plot name them so (arm_label); the evidence's JSON keeps their keys.
"""

import math
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
MIN_LOSS_WINDOW = 5
"""Steps the final-loss mean averages at the shortest run whose loss is judged (loss_horizon): one step's loss
carries its batch's noise, ~1% of the loss on the tiny model (CPU_LOSS_TOLERANCE); a mean of 5 steps cuts that
to under half, under a quarter of the CPU tolerance."""
GATE_STDEVS = 2.0
"""The one-sided loss gate's width in standard deviations of the BF16 runs' final losses (LossGate)."""
GATE_MIN_RUNS = 3
"""BF16 runs the loss gate needs: fewer measure no standard deviation worth the name."""
ROUTER_SIGMAS = 2.0
"""How many standard errors of the final-window means (router_margin) two runs' imbalances may part by when the
BF16 runs' own spread is smaller: about a 5% chance of 'differs' between runs that route alike, for a normal mean."""
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
FP8_ATTENTION_SUFFIX = ", fp8 attention"
"""After an FP8 arm's name when its attention cores run as TE's FP8 dot-product attention (precision.fp8_attention)."""
SINGLE_RUN_CAVEAT = ("bf16 ran once, so the loss spread between runs is unmeasured (it can exceed the tolerance: "
                     "two bf16 runs of one seed part by 1-3.5% at 2 sequences per step; --baseline-runs 2 or more "
                     "measures it)")
"""Added to a ship verdict judged against a single bf16 run."""
FP32_ACTIVATIONS = "float32"
"""TrainResult.dtype of a run whose activations are FP32 (a CPU's default): its BF16 configurations hold no BF16."""
NO_FP8 = "(no FP8)"
"""After the name a BF16 configuration is shown under when it ran in FP32 (arm_label)."""

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
    """The arm's key: plan recipe; bf16 is the plan without FP8, 'bf16 on te' the same on TE modules
    (--fastest-bf16)."""
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
    """final_loss / the reference's final_loss - 1."""
    noise: float | None = None
    """Step-time interquartile range / median of this arm."""
    verdict: str = "rollback"
    """The overall verdict (overall_verdict): baseline (the reference) | ship | rollback | inconclusive | error (no
    BF16 configuration ran) | alternative (a slower or failed BF16 configuration)."""
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
    label: str = ""
    """The arm's name in the table and the plot (arm_label): its key, but a BF16 configuration run with FP32
    activations reads 'fp32 (no FP8)'."""
    activation_dtype: str | None = None
    """Activation dtype the run used (TrainResult.dtype: float32 | bfloat16)."""
    speed_ratio: float | None = None
    """tokens_per_s over the reference's."""
    speed_noise: float | None = None
    """The noise the speed verdict was judged against, as a share of the reference's tokens/s (noise_band); the
    reference's own: the largest of the bf16 runs' step-time differences and its step-time spread."""
    speed_verdict: str | None = None
    """faster | slower | inconclusive (speed_ratio within the noise); None for the reference and failed arms."""
    memory_ratio: float | None = None
    """peak_mem_gib over the reference's."""
    memory_noise: float | None = None
    """The relative noise the memory verdict was judged against; None when unmeasured (max RSS, bf16 ran once)."""
    memory_verdict: str | None = None
    """less | more | same (equal, noise 0) | inconclusive (within the noise, or unmeasured noise); None for the
    reference and failed arms."""
    steps: int | None = None
    """Training steps the run took (the length of loss_curve)."""
    loss_horizon: int | None = None
    """The fewest steps whose final loss is judged (loss_horizon of the run's LR warm-up)."""
    loss_verdict: str | None = None
    """within | above | below the tolerance | inconclusive (loss_unresolved) | not judged (steps < loss_horizon);
    None for the reference and failed arms."""
    router_imbalance: float | None = None
    """MoE models: mean over the last LAST_FRACTION of steps of the max / mean expert load, averaged over the MoE
    layers (router_window); None for a dense model or a failed arm."""
    router_verdict: str | None = None
    """MoE models: within | differs, the arm's router_imbalance against the BF16 runs' (router_check); None for the
    reference, dense models and failed arms."""


def peak_tflops(device: str) -> dict[str, float] | None:
    """Dense BF16 and FP8 peaks of a GPU by name, or None when it is not in the table (or a CPU)."""
    for (model, variant), peaks in DENSE_PEAK_TFLOPS.items():
        if model in device and variant in device:
            return peaks
    return None


def blended_peak(peaks: dict[str, float], fp8_share: float) -> float:
    """The peak a run reaches if each GEMM FLOP ran at the peak of its precision: FP8 GEMMs at the FP8
    peak, the rest (the attention core unless fp8_attention, head, BF16 layers) at the BF16 peak. Harmonic, as times
    add."""
    return 1.0 / (fp8_share / peaks["fp8"] + (1.0 - fp8_share) / peaks["bf16"])


def final_window(series: list[float]) -> list[float]:
    """The last LAST_FRACTION of a per-step series (at least one step)."""
    return series[-max(1, round(len(series) * LAST_FRACTION)):]


def final_loss(losses: list[float]) -> float:
    """Mean over the last LAST_FRACTION of the steps (at least one step)."""
    return statistics.fmean(final_window(losses))


def router_window(result: dict) -> tuple[float, float] | None:
    """(mean, standard error) of a run's per-step mean expert load imbalance (TrainResult.router's 'imbalance') over
    its last LAST_FRACTION of steps, the error as step-to-step standard deviation / sqrt(steps) (0 from one step);
    None for a run that logged no router statistics (a dense model)."""
    series = [step["imbalance"] for step in result.get("router") or []]
    if not series:
        return None
    tail = final_window(series)
    error = statistics.stdev(tail) / math.sqrt(len(tail)) if len(tail) > 1 else 0.0
    return statistics.fmean(tail), error


def router_margin(arm: tuple[float, float], bf16: list[tuple[float, float]]) -> float:
    """How far outside the BF16 runs' range of final-window imbalances (`bf16`: router_window of each) `arm`'s may lie
    and still route alike: the larger of the range's width, which measures run-to-run chaos as the loss band does,
    and ROUTER_SIGMAS standard errors of the difference between two window means (the arm's and the noisiest BF16
    run's), which measures what a window of that many steps can resolve when the BF16 runs agree bit for bit or ran
    once."""
    means = [mean for mean, _ in bf16]
    resolution = ROUTER_SIGMAS * math.hypot(arm[1], max(error for _, error in bf16))
    return max(max(means) - min(means), resolution)


def router_check(arm: tuple[float, float], bf16: list[tuple[float, float]]) -> tuple[str, str]:
    """(within | differs, the sentence saying so): `arm`'s final-window imbalance (router_window) against the BF16
    runs' range widened by router_margin on each side."""
    means = [mean for mean, _ in bf16]
    low, high, margin = min(means), max(means), router_margin(arm, bf16)
    verdict = "within" if low - margin <= arm[0] <= high + margin else "differs"
    runs = f"the {len(means)} bf16 runs' {low:.3f} to {high:.3f}" if len(means) > 1 else f"bf16's {low:.3f}"
    return verdict, (f"experts max/mean {arm[0]:.3f} over the last {LAST_FRACTION:.0%} of steps "
                     f"{'within' if verdict == 'within' else 'outside'} {runs} +-{margin:.3f} (router statistics "
                     f"{'alike' if verdict == 'within' else 'differ'})")


def loss_horizon(warmup: int) -> int:
    """The fewest steps of a run whose final loss is judged: its LR warm-up (a loss taken while the learning rate
    still ramps says nothing of the recipe: a 12-step run with 4 warm-up steps can end far above its first loss), plus
    the steps whose last LAST_FRACTION holds MIN_LOSS_WINDOW of them."""
    return warmup + round(MIN_LOSS_WINDOW / LAST_FRACTION)


def noise_band(noise: float) -> tuple[float, float]:
    """The ratios to the reference (tokens/s or peak memory over the reference's) that lie within `noise`: 1 - noise
    (not below 0) to 1 + noise, the gap as a share of the reference. Judged so, a slower arm's gap is smaller than the
    same arm's gap in step time, so the band errs toward inconclusive, never toward rollback: past 100% noise no arm
    is slower."""
    return max(0.0, 1.0 - noise), 1.0 + noise


def speed_verdict(ratio: float, noise: float) -> str:
    """faster | slower | inconclusive: tokens/s over the reference's (`ratio`) above, below or within noise_band."""
    low, high = noise_band(noise)
    return "faster" if ratio > high else "slower" if ratio < low else "inconclusive"


def memory_verdict(ratio: float, noise: float | None) -> str:
    """less | more | same | inconclusive: peak memory over the reference's (`ratio`) below, above or within
    noise_band; same only where the noise is 0 (deterministic) and the peaks equal; inconclusive, whatever the
    ratio, where the noise is unmeasured (None)."""
    if noise is None:
        return "inconclusive"
    if noise == 0.0 and ratio == 1.0:
        return "same"
    low, high = noise_band(noise)
    return "more" if ratio > high else "less" if ratio < low else "inconclusive"


@dataclass(frozen=True)
class LossGate:
    """The one-sided loss gate over BF16 runs' final losses (issue 36): a final loss passes up to their mean +
    max(floor of the mean, GATE_STDEVS standard deviations); ending below passes."""

    mean: float
    stdev: float
    runs: int
    floor: float
    """The relative gap the gate allows however close the BF16 runs lie (the A/B's loss tolerance)."""

    @classmethod
    def of(cls, bf16_losses: list[float], floor: float) -> "LossGate":
        return cls(statistics.fmean(bf16_losses), statistics.stdev(bf16_losses), len(bf16_losses), floor)

    @property
    def limit(self) -> float:
        """The largest final loss the gate passes."""
        return self.mean + max(self.floor * self.mean, GATE_STDEVS * self.stdev)

    def verdict(self, loss: float) -> str:
        """above (fails) | below (as far under the mean as the limit is over it) | within."""
        return "above" if loss > self.limit else "below" if loss < 2 * self.mean - self.limit else "within"

    def describe(self) -> str:
        return (f"the {self.runs} bf16 runs' mean {self.mean:.4f} + max({self.floor:.2%}, {GATE_STDEVS:g} standard "
                f"deviations) = {self.limit:.4f}")


def judged_by_gate(repeat_records: list[dict]) -> bool:
    """Whether the bf16 runs (the reference and the repeats that ran: `judge`'s records) are enough for the loss
    gate."""
    return 1 + sum("error" not in r for r in repeat_records) >= GATE_MIN_RUNS


def loss_verdict(loss_gap: float, tolerance: float, steps: int, horizon: int, unresolved: str = "") -> str:
    """not judged (fewer `steps` than `horizon`) | inconclusive (`unresolved` says why the tolerance cannot be
    resolved) | above | below | within: the relative final-loss gap outside the tolerance either way, or inside."""
    if steps < horizon:
        return "not judged"
    if unresolved:
        return "inconclusive"
    return "above" if loss_gap > tolerance else "below" if loss_gap < -tolerance else "within"


def overall_verdict(speed: str, loss: str) -> str:
    """ship | rollback | inconclusive from an FP8 arm's speed and loss verdicts: ship when faster and the loss within
    the tolerance or below it (one-sided: ending lower than bf16 passes); rollback when slower or the loss above the
    tolerance; inconclusive otherwise (a speed gap within the noise, or a faster arm whose loss is not judged or
    inconclusive)."""
    if speed == "slower" or loss == "above":
        return "rollback"
    return "ship" if speed == "faster" and loss in ("within", "below") else "inconclusive"


def is_bf16_arm(name: str) -> bool:
    """Whether the arm `name` is a BF16 configuration (BF16_ARMS, with FP32 or BF16 parameters)."""
    return name.removesuffix(BF16_PARAMS_SUFFIX) in BF16_ARMS


def arm_label(name: str, dtype: str | None) -> str:
    """The name an arm or a bf16 repeat is shown under: its key, but a BF16 configuration that ran its activations
    in FP32 (`dtype`, TrainResult.dtype, is FP32_ACTIVATIONS: a CPU) holds no BF16, so 'bf16' reads 'fp32 (no FP8)',
    'bf16 on te' 'fp32 on te (no FP8)' and 'bf16 (repeat)' 'fp32 (no FP8) (repeat)'."""
    configuration, repeat, count = name.partition(" (repeat")
    if dtype != FP32_ACTIVATIONS or not is_bf16_arm(configuration):
        return name
    return f"fp32{configuration.removeprefix(BF16)} {NO_FP8}" + (f"{repeat}{count}" if repeat else "")


def run_identity(run: dict) -> tuple | None:
    """A run's per-step losses, which tell one run from another wherever it is stored (an A/B that took it by
    --bf16-from or --continue-from holds it too); None for a run recorded without them."""
    return tuple(run["losses"]) if run.get("losses") else None


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
    in place of a result is the error a run hit. Every arm that ran gets speed, memory and loss verdicts against the
    reference; the FP8 arms an overall one (overall_verdict), the other BF16 configurations 'alternative'.
    `passes`: training tokens per arm over the training split's size (see loss_unresolved)."""
    dtype = next((result["dtype"] for result in results.values() if isinstance(result, dict)), None)
    arms = [_measure(name, result, backends[name], peaks, dtype) for name, result in results.items()]
    reference = reference_arm(results)
    if reference is None:
        for arm in arms:
            arm.verdict, arm.reason = ("error", f"bf16 baseline failed: {results[arm.recipe]}") if (
                is_bf16_arm(arm.recipe)) else ("rollback", "no bf16 baseline to compare with")
        return arms, []
    baseline = next(arm for arm in arms if arm.recipe == reference)
    records = _repeat_records(repeats or {}, baseline, peaks, dtype)
    measured = [r for r in records if "error" not in r]
    baseline.verdict, baseline.rel_loss_gap = "baseline", 0.0
    baseline.speed_noise = max([baseline.noise, *(r["run_to_run_noise"] for r in measured)])
    baseline.memory_noise = _memory_noise(baseline.memory_kind, measured)
    ran = sum(isinstance(results[arm.recipe], dict) for arm in arms if is_bf16_arm(arm.recipe))
    baseline.reason = "the reference arm" + (", the fastest BF16 configuration" if ran > 1 else "")
    bf16_losses = [baseline.final_loss, *(r["final_loss"] for r in measured)]
    gate = LossGate.of(bf16_losses, tolerance) if judged_by_gate(records) else None
    # The gate widens with the bf16 runs' spread; a single comparison cannot resolve a tolerance they exceed.
    unresolved = loss_unresolved(passes, [] if gate else [r["rel_loss_gap"] for r in measured], tolerance)
    bf16_routing = [window for window in (router_window(run) for run in (results[reference],
                    *(repeat for repeat in (repeats or {}).values() if isinstance(repeat, dict))))
                    if window is not None]
    for arm, result in zip(arms, results.values()):
        if arm is baseline:
            continue
        if isinstance(result, str):
            arm.verdict, arm.reason = ("alternative", f"failed: {result}; {baseline.label} is the reference") if (
                is_bf16_arm(arm.recipe)) else ("rollback", f"failed: {result}")
            continue
        loss = _compare(arm, baseline, tolerance, unresolved, gate)
        if is_bf16_arm(arm.recipe):
            arm.verdict = "alternative"
            arm.reason = (f"a BF16 configuration; {baseline.label}, {arm.step_ms / baseline.step_ms - 1:.1%} faster, "
                          "is the reference")
            continue
        arm.verdict = overall_verdict(arm.speed_verdict, arm.loss_verdict)
        arm.reason = f"{_speed_reason(arm, baseline.label)}; {loss}"
        if arm.verdict == "ship" and not measured:
            arm.reason += f"; {SINGLE_RUN_CAVEAT}"
        if arm.loss_verdict == "inconclusive" and measured:
            arm.reason += f"; {band_note(arm.final_loss, bf16_losses)}"
        window = router_window(result)
        if window is not None and bf16_routing:
            arm.router_verdict, note = router_check(window, bf16_routing)
            arm.reason += f"; {note}"
    return arms, records


def verdict_cells(arm: Arm) -> list[str]:
    """The table's speed, memory and loss cells of `arm`: the speed and memory verdicts with the ratio to the reference
    and the noise they were judged against, the loss verdict with the gap or the steps short of the horizon ('-' for
    the reference and failed arms)."""
    if arm.speed_verdict is None:
        return ["-", "-", "-"]
    memory_noise = "unmeasured" if arm.memory_noise is None else f"{arm.memory_noise:.1%}"
    loss = (f"not judged ({arm.steps} steps < {arm.loss_horizon})" if arm.loss_verdict == "not judged" else
            f"{arm.loss_verdict} ({arm.rel_loss_gap:+.2%})")
    memory = "-" if arm.memory_verdict is None else (
        f"{arm.memory_verdict} ({arm.memory_ratio:.3f}x, noise {memory_noise})")
    return [f"{arm.speed_verdict} ({arm.speed_ratio:.3f}x, noise {arm.speed_noise:.1%})", memory, loss]


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
    """The evidence's sentence on the bf16 repeats (`judge`'s records): step-time, peak-memory and final-loss gaps,
    failures."""
    notes = [f"{r['run']} failed: {r['error']}" for r in records if "error" in r]
    measured = [r for r in records if "error" not in r]
    if measured:
        gaps = ", ".join(f"{r['rel_loss_gap']:+.3%}" for r in measured)
        memory = max((r["memory_run_to_run"] for r in measured if r["memory_run_to_run"] is not None), default=None)
        notes.insert(0, f"bf16 run-to-run over {len(measured) + 1} runs: up to "
                        f"{max(r['run_to_run_noise'] for r in measured):.1%} in step time, "
                        + (f"{memory:.1%} in peak memory, " if memory is not None else "")
                        + f"final loss {gaps} from the first run")
    return f" ({'; '.join(notes)})" if notes else ""


def _compare(arm: Arm, baseline: Arm, tolerance: float, unresolved: str, gate: LossGate | None = None) -> str:
    """Set `arm`'s speed, memory and loss verdicts against the reference `baseline` (whose speed_noise and memory_noise
    are set), its loss against `gate` where the bf16 runs make one; return the sentence on its loss."""
    arm.speed_noise = max(baseline.speed_noise, arm.noise)
    arm.speed_ratio = arm.tokens_per_s / baseline.tokens_per_s
    arm.speed_verdict = speed_verdict(arm.speed_ratio, arm.speed_noise)
    if arm.peak_mem_gib and baseline.peak_mem_gib:
        arm.memory_noise, arm.memory_ratio = baseline.memory_noise, arm.peak_mem_gib / baseline.peak_mem_gib
        arm.memory_verdict = memory_verdict(arm.memory_ratio, arm.memory_noise)
    arm.rel_loss_gap = arm.final_loss / baseline.final_loss - 1.0
    arm.loss_verdict = loss_verdict(arm.rel_loss_gap, tolerance, arm.steps, arm.loss_horizon, unresolved)
    if arm.loss_verdict == "not judged":
        return (f"loss not judged: {arm.steps} steps < {arm.loss_horizon} (the LR warm-up, then enough steps for a "
                f"{MIN_LOSS_WINDOW}-step final-loss mean)")
    if arm.loss_verdict == "inconclusive":
        return f"loss not compared: {unresolved}"
    if gate is not None:
        arm.loss_verdict = gate.verdict(arm.final_loss)
        return _gate_reason(arm, gate)
    if arm.loss_verdict == "within":
        return f"loss {arm.rel_loss_gap:+.2%} within +-{tolerance:.2%}"
    if arm.loss_verdict == "below":
        return (f"loss {arm.rel_loss_gap:+.2%} vs {baseline.label}, below its -{tolerance:.2%} tolerance: the "
                "one-sided gate passes it (its validation loss says whether it learnt the same thing better)")
    return f"loss {arm.rel_loss_gap:+.2%} vs {baseline.label} is outside the +-{tolerance:.2%} tolerance"


def _gate_reason(arm: Arm, gate: LossGate) -> str:
    """The sentence on a loss judged by the gate."""
    gap = f"final loss {arm.final_loss:.4f} ({arm.final_loss / gate.mean - 1:+.2%} vs the bf16 mean)"
    if arm.loss_verdict == "above":
        return f"{gap} is above the loss gate, {gate.describe()}"
    below = (": the one-sided gate passes it (its validation loss says whether it learnt the same thing better)"
             if arm.loss_verdict == "below" else "")
    return f"{gap} passes the loss gate, {gate.describe()}{below}"


def _speed_reason(arm: Arm, reference: str) -> str:
    """The reason's sentence on `arm`'s speed verdict against the `reference` arm's label."""
    low, high = noise_band(arm.speed_noise)
    where = (f"within the noise of {reference}" if arm.speed_verdict == "inconclusive" else
             f"{arm.speed_verdict} than {reference} beyond the noise")
    return f"{where}: {arm.speed_ratio:.3f}x its tokens/s (noise {arm.speed_noise:.1%}: {low:.3f}x to {high:.3f}x)"


def _memory_noise(memory_kind: str | None, measured: list[dict]) -> float | None:
    """The relative noise of peak memory: the largest difference between the bf16 runs; with
    one bf16 run, 0 for CUDA's deterministic peak, None (unmeasured) for a CPU's max RSS."""
    gaps = [r["memory_run_to_run"] for r in measured if r["memory_run_to_run"] is not None]
    if gaps:
        return max(gaps)
    return 0.0 if memory_kind == "cuda_peak_allocated" else None


def _repeat_records(repeats: dict[str, dict | str], baseline: Arm, peaks: dict | None, dtype: str | None
                    ) -> list[dict]:
    """What each bf16 repeat measured, against the reference `baseline` it reran (or the error it hit)."""
    records = []
    for name, repeat in repeats.items():
        if isinstance(repeat, str):
            records.append({"run": name, "error": repeat})
            continue
        again = _measure(BF16, repeat, BF16, peaks, dtype)
        memory_gap = (_relative_gap(again.peak_mem_gib, baseline.peak_mem_gib)
                      if again.peak_mem_gib and baseline.peak_mem_gib else None)
        records.append({"run": name, "label": arm_label(name, dtype), "of": baseline.recipe, "step_ms": again.step_ms,
                        "final_loss": again.final_loss,
                        "run_to_run_noise": _relative_gap(again.step_ms, baseline.step_ms),
                        "rel_loss_gap": again.final_loss / baseline.final_loss - 1.0,
                        "peak_mem_gib": again.peak_mem_gib, "memory_run_to_run": memory_gap,
                        "ran_between": again.ran_between, "loss_curve": again.loss_curve})
    return records


def _relative_gap(a: float, b: float) -> float:
    """|a - b| relative to the smaller: how far two bf16 runs of one configuration part, their run-to-run noise."""
    return abs(a - b) / min(a, b)


def _measure(recipe: str, result: dict | str, backend: str, peaks: dict | None, dtype: str | None) -> Arm:
    """Throughput, FLOPs, memory and final loss of one arm's TrainResult. `backend` names the planned
    dense backend; a run reports every FP8 backend its plan used (torchao+grouped_fp8 for MoE). `dtype`: the A/B's
    activation dtype, which names an arm that did not run."""
    if isinstance(result, str):
        return Arm(recipe=recipe, backend=backend, label=arm_label(recipe, dtype))
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
        zero_fp8_weight_grads=result["zero_fp8_weight_grads"], label=arm_label(recipe, result["dtype"]),
        activation_dtype=result["dtype"], steps=len(result["losses"]),
        router_imbalance=(router_window(result) or (None,))[0],
        loss_horizon=loss_horizon(result["config"]["optimizer"]["warmup"]))
