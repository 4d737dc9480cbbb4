"""Verdicts of the Megatron bench (pure Python, no torch): fp8stack's factory spec against megatron's own TE
spec, both trained from the same weights on the same batches, their timed windows interleaved.

- throughput: factory tokens/s >= megatron tokens/s x (1 - noise), where the noise is measured: the larger
  of the two arms' window-to-window spread (interquartile range / median of the steady-state windows);
- loss: |factory final loss / megatron final loss - 1| <= LOSS_TOLERANCE, final loss being the mean of
  the last 10% of steps (fp8stack.ab.final_loss);
- an MoE arm trains: every loss finite, and the final loss below the mean of the first 10% of steps.
"""

import math
import statistics

from fp8stack.ab import GPU_LOSS_TOLERANCE, LAST_FRACTION, final_loss
from fp8stack.train.timing import relative_spread, steady_state

LOSS_TOLERANCE = 2 * GPU_LOSS_TOLERANCE
"""Largest relative final-loss gap between the two specs of one recipe: 0.5%. The two arms are the same
computation (the same TE modules, built from the same seed, trained on the same batches): under the bench's
deterministic mode (the default) their curves agree to the bit unless the specs differ. Without it they part
through GPU reductions in no fixed order (atomics in the embedding and attention backward), which training
amplifies: at step 50 by 0.04% in one run and by 3.1% in the next, so that --no-deterministic verdicts say
little. What the tolerance must catch are differences in what is trained (a module left out, weights that
stop updating, another FP8 treatment), which move the loss far more."""
MIN_WINDOWS = 6
"""Timed windows per arm, at least: steady_state drops the first two, relative_spread needs four."""
NOISE_METHOD = ("each arm trains in windows of --window steps, the arms of a group taking turns (A B, B A, "
                "A B, ...); tokens/s = tokens per step / median step time of the windows after the first two "
                "(warm-up); noise = the larger of the two arms' interquartile range / median of those window "
                "step times")


def window_order(arms: int, rounds: int) -> list[tuple[int, int]]:
    """(round, arm) in run order: each round runs every arm's next window, in reverse order on odd rounds
    (A B, B A, A B, ...), so a drift in the machine's speed favours no arm."""
    return [(r, a) for r in range(rounds) for a in (range(arms) if r % 2 == 0 else reversed(range(arms)))]


def rounds_for(steps: int, window: int) -> int:
    """How many windows `steps` steps make (the last one may be shorter)."""
    return math.ceil(steps / window)


def window_summary(window_step_s: list[float], tokens_per_step: int) -> dict:
    """Throughput and its noise from one arm's windows (mean step seconds of each, in run order)."""
    steady = steady_state(window_step_s)
    step_s = statistics.median(steady)
    return {"median_step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "noise": relative_spread(steady),
            "windows_used": len(steady)}


def throughput_verdict(factory_tps: float, megatron_tps: float, noise: float) -> tuple[bool, str]:
    """(passed, reason): the factory spec is at least as fast as megatron's within the noise."""
    difference = factory_tps / megatron_tps - 1.0
    passed = factory_tps >= megatron_tps * (1.0 - noise)
    verdict = "factory >= megatron within noise" if passed else "factory slower than megatron beyond the noise"
    return passed, f"{verdict} ({difference:+.2%}, noise {noise:.2%})"


def loss_verdict(factory_losses: list[float], megatron_losses: list[float],
                 tolerance: float = LOSS_TOLERANCE) -> tuple[bool, str, float]:
    """(passed, reason, relative gap): the two specs end at the same loss within `tolerance`."""
    gap = final_loss(factory_losses) / final_loss(megatron_losses) - 1.0
    passed = abs(gap) <= tolerance
    verdict = "same loss within tolerance" if passed else "loss differs beyond the tolerance"
    return passed, f"{verdict} ({gap:+.3%}, tolerance {tolerance:.2%})", gap


def judge_pair(recipe: str, megatron: dict, factory: dict, tolerance: float = LOSS_TOLERANCE) -> dict:
    """Both verdicts for one recipe from its two arm records ('arm', 'status', 'losses', 'tokens_per_s',
    'noise'); an arm that did not finish fails both."""
    record = {"recipe": recipe, "megatron_tokens_per_s": megatron.get("tokens_per_s"),
              "factory_tokens_per_s": factory.get("tokens_per_s"),
              "megatron_final_loss": _final(megatron), "factory_final_loss": _final(factory)}
    unfinished = [f"{a['arm']}: {a['status']}" for a in (megatron, factory) if a["status"] != "ok"]
    if unfinished:
        why = "not judged, " + "; ".join(unfinished)
        return {**record, "throughput_passed": False, "throughput": why, "loss_passed": False, "loss": why,
                "passed": False}
    noise = max(megatron["noise"], factory["noise"])
    tp_passed, tp_reason = throughput_verdict(factory["tokens_per_s"], megatron["tokens_per_s"], noise)
    loss_passed, loss_reason, gap = loss_verdict(factory["losses"], megatron["losses"], tolerance)
    return {**record, "noise": noise, "throughput_passed": tp_passed, "throughput": tp_reason,
            "rel_loss_gap": gap, "loss_passed": loss_passed, "loss": loss_reason,
            "passed": tp_passed and loss_passed}


def trains(losses: list[float]) -> tuple[bool, str]:
    """(passed, reason): every loss is finite and the final loss is below the mean of the first steps."""
    if not losses or not all(map(math.isfinite, losses)):
        return False, "non-finite loss"
    head = statistics.fmean(losses[:max(1, round(len(losses) * LAST_FRACTION))])
    tail = final_loss(losses)
    if tail < head:
        return True, f"finite, decreasing ({head:.3f} -> {tail:.3f})"
    return False, f"loss not decreasing ({head:.3f} -> {tail:.3f})"


def against(baseline: dict | None, arm: dict) -> dict:
    """The arm's throughput and final loss relative to a bf16 baseline arm (None where either is missing)."""
    if not baseline or baseline.get("status") != "ok" or arm.get("status") != "ok":
        return {"vs_bf16_speedup": None, "vs_bf16_loss_gap": None}
    return {"vs_bf16_speedup": arm["tokens_per_s"] / baseline["tokens_per_s"],
            "vs_bf16_loss_gap": final_loss(arm["losses"]) / final_loss(baseline["losses"]) - 1.0}


def _final(arm: dict) -> float | None:
    return final_loss(arm["losses"]) if arm.get("losses") else None
