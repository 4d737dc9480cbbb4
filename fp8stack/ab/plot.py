"""The A/B evidence's figure: loss curves, loss relative to bf16 per step, throughput by verdict with its noise."""

import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fp8stack.ab.verdicts import Arm

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SMOOTHING_WINDOWS = 50
"""The relative-loss panel averages each curve over len(curve) / this many steps: per-step batch noise
(several % at a few sequences per step) would hide the drift it is there to show."""
VERDICT_COLOURS = {"baseline": "tab:gray", "alternative": "silver", "ship": "tab:green", "rollback": "tab:red",
                   "inconclusive": "tab:orange", "error": "black"}
"""Throughput bars by the arm's overall verdict."""
BAR_INCHES = 0.45
"""Figure height per throughput bar: one line of an arm's name per bar, so that names of any length never overlap
(they are written beside horizontal bars, not under vertical ones)."""


def relative_gap(curve: list[float], base: list[float], window: int) -> list[float]:
    """100 x (curve / base - 1), step by step, as a trailing mean over `window` steps."""
    gaps = [100 * (a / b - 1) for a, b in zip(curve, base)]
    sums = [0.0]
    for gap in gaps:
        sums.append(sums[-1] + gap)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(gaps))]


def pyplot():
    """matplotlib's pyplot drawing to files only (the Agg backend: no display needed); ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(draw: Callable[[], "Figure"], path: Path) -> Path | None:
    """Write the figure `draw` returns to `path` (and to $OUT when set); None (with a note) when matplotlib is
    missing: the figure is optional, the JSON and Markdown beside it are the evidence."""
    try:
        plt = pyplot()
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (pip install 'fp8stack[plot]' for the plot)")
        return None
    fig = draw()
    from fp8stack.evidence import device_copy, palette_png  # here: importing fp8stack ab stays free of torch

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=110)
    plt.close(fig)
    png = palette_png(rendered.getvalue())
    for target in filter(None, (path, device_copy(path))):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png)
    return path


def plot(arms: list[Arm], repeats: list[dict], path: Path, title: str) -> Path | None:
    """Write `figure` to `path` (save_figure)."""
    return save_figure(lambda: figure(arms, repeats, title), path)


def figure(arms: list[Arm], repeats: list[dict], title: str):
    """A matplotlib Figure of three panels: loss curves; loss relative to the reference per step (same batches in
    every arm, so the ratio is meaningful step by step; smoothed, see SMOOTHING_WINDOWS; the bf16 repeats' curves,
    dashed, show how far runs part by chance); tokens/s as horizontal bars, one per arm under its label, with
    the noise its speed was judged against as error bars (throughput_panel)."""
    plt = pyplot()
    ran = [a for a in arms if a.loss_curve]
    reference = next((a for a in arms if a.verdict == "baseline"), arms[0])
    base = reference.loss_curve
    window = max(1, len(base or []) // SMOOTHING_WINDOWS)
    fig, (losses, gaps, speed) = plt.subplots(1, 3, figsize=(17, max(4.5, 2.2 + BAR_INCHES * len(ran))),
                                              width_ratios=(1, 1, 1.3), layout="constrained")
    for index, arm in enumerate(ran):
        steps, line = range(1, len(arm.loss_curve) + 1), {"label": arm.label, "color": f"C{index}", "linewidth": 1.2}
        losses.plot(steps, arm.loss_curve, **line)
        if base and arm is not reference:
            gaps.plot(steps, relative_gap(arm.loss_curve, base, window), **line)
    for repeat in (r for r in repeats if base and r.get("loss_curve")):
        curve = repeat["loss_curve"]
        gaps.plot(range(1, len(curve) + 1), relative_gap(curve, base, window), label=repeat["label"],
                  color="tab:gray", linewidth=0.8, linestyle="--")
    losses.set(xlabel="step", ylabel="training loss", title="loss")
    losses.legend(fontsize="small")
    gaps.axhline(0, color="tab:gray", linewidth=0.8)
    smoothing = f", mean of {window} steps" if window > 1 else ""
    gaps.set(xlabel="step", ylabel=f"% vs {reference.label}",
             title=f"loss relative to {reference.label}\n(same batches{smoothing})")
    if gaps.get_lines()[1:]:  # beyond the zero line
        gaps.legend(fontsize="small")
    throughput_panel(speed, ran, reference)
    fig.suptitle(title)
    return fig


def throughput_panel(axes, arms: list[Arm], reference: Arm) -> None:
    """Tokens/s of `arms` as horizontal bars, first arm on top, coloured by verdict, with a dashed line at the
    `reference`'s tokens/s and error bars of +- the noise each arm's speed was judged against (Arm.speed_noise, a
    share of the reference's tokens/s, noise_band; cut at 0 tokens/s): an arm is faster or slower exactly where its
    error bar clears that line, inconclusive where the line crosses it."""
    from matplotlib.patches import Patch

    values = [a.tokens_per_s for a in arms]
    noise = [(reference.tokens_per_s or 0.0) * (a.speed_noise or 0.0) for a in arms]
    rows = range(len(arms))
    axes.barh(rows, values, xerr=[[min(n, v) for n, v in zip(noise, values)], noise],
              color=[VERDICT_COLOURS[a.verdict] for a in arms], error_kw={"capsize": 4, "elinewidth": 1.2})
    axes.set_yticks(rows, [a.label for a in arms])
    axes.invert_yaxis()
    if reference.tokens_per_s:
        axes.axvline(reference.tokens_per_s, color="black", linewidth=0.8, linestyle="--")
    shown = dict.fromkeys(a.verdict for a in arms)
    axes.legend(handles=[Patch(color=VERDICT_COLOURS[v], label=v) for v in shown], fontsize="small",
                loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=len(shown), frameon=False)  # below: off the bars
    axes.set(xlabel="tokens/s", title=f"throughput, error bars: the noise\n(dashed: {reference.label})")
