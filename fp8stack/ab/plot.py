"""The A/B evidence's figure: loss curves, loss relative to bf16 per step, throughput by verdict."""

from pathlib import Path

from fp8stack.ab.verdicts import Arm

SMOOTHING_WINDOWS = 50
"""The relative-loss panel averages each curve over len(curve) / this many steps: per-step batch noise
(several % at a few sequences per step) would hide the drift it is there to show."""


def relative_gap(curve: list[float], base: list[float], window: int) -> list[float]:
    """100 x (curve / base - 1), step by step, as a trailing mean over `window` steps."""
    gaps = [100 * (a / b - 1) for a, b in zip(curve, base)]
    sums = [0.0]
    for gap in gaps:
        sums.append(sums[-1] + gap)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(gaps))]


def plot(arms: list[Arm], repeats: list[dict], path: Path, title: str) -> Path | None:
    """Loss curves, loss relative to bf16 per step (same batches in every arm, so the ratio is
    meaningful step by step; smoothed, see SMOOTHING_WINDOWS; the bf16 repeats' curves, dashed, show how
    far runs part by chance) and throughput bars; None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (pip install 'fp8stack[plot]' for the plot)")
        return None
    colours = {"baseline": "tab:gray", "alternative": "silver", "ship": "tab:green", "rollback": "tab:red",
               "inconclusive": "tab:orange", "error": "black"}
    ran = [a for a in arms if a.loss_curve]
    reference = next((a for a in arms if a.verdict == "baseline"), arms[0])
    base = reference.loss_curve
    window = max(1, len(base or []) // SMOOTHING_WINDOWS)
    fig, (losses, gaps, speed) = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, arm in enumerate(ran):
        steps, line = range(1, len(arm.loss_curve) + 1), {"label": arm.recipe, "color": f"C{index}", "linewidth": 1.2}
        losses.plot(steps, arm.loss_curve, **line)
        if base and arm is not reference:
            gaps.plot(steps, relative_gap(arm.loss_curve, base, window), **line)
    for repeat in (r for r in repeats if base and r.get("loss_curve")):
        curve = repeat["loss_curve"]
        gaps.plot(range(1, len(curve) + 1), relative_gap(curve, base, window), label=repeat["run"], color="tab:gray",
                  linewidth=0.8, linestyle="--")
    losses.set(xlabel="step", ylabel="training loss", title="loss")
    losses.legend()
    gaps.axhline(0, color="tab:gray", linewidth=0.8)
    smoothing = f", mean of {window} steps" if window > 1 else ""
    gaps.set(xlabel="step", ylabel=f"% vs {reference.recipe}",
             title=f"loss relative to {reference.recipe} (same batches{smoothing})")
    if gaps.get_lines()[1:]:  # beyond the zero line
        gaps.legend()
    speed.bar([a.recipe for a in ran], [a.tokens_per_s for a in ran], color=[colours[a.verdict] for a in ran])
    speed.set(ylabel="tokens/s", title="throughput\n(green ship, red rollback, orange inconclusive, grey bf16)")
    fig.suptitle(title)
    fig.tight_layout()
    from fp8stack.bench.evidence import device_copy  # here: importing fp8stack ab stays free of torch

    for target in filter(None, (path, device_copy(path))):
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    plt.close(fig)
    return path
