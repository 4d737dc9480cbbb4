"""What the benches' figures share: drawing an evidence JSON's figure beside it as <stem>.png (during a run from the
JSON just written, or later with --plot-only from a JSON measured before the figure existed, measuring nothing), the
notes on bar rows of arms that did not run, and the loss-curve panel. Each bench draws its own panels
(fp8stack.bench.peers, fp8stack.bench.data_parallel); matplotlib stays optional (fp8stack.ab.plot.save_figure)."""

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fp8stack.ab.plot import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BAR_INCHES = 0.45
"""Figure height per bar row: one line of an arm's name per bar (names written beside horizontal bars never
overlap)."""
FIGURE_WIDTH = 18
"""Inches: three panels side by side, the arms' names at the left of two of them."""


def figure_height(rows: int) -> float:
    """Inches for `rows` bar rows, the titles and the legends below the bars."""
    return max(4.5, 2.8 + BAR_INCHES * rows)


def write_plot(json_path: Path, draw: Callable[[dict], "Figure"]) -> Path | None:
    """The figure `draw` makes of the evidence record in `json_path`, written beside it as <stem>.png (and under $OUT
    when set); None when matplotlib is missing (save_figure's note says so)."""
    record = json.loads(json_path.read_text())
    return save_figure(lambda: draw(record), json_path.with_suffix(".png"))


def add_plot_only_option(parser: argparse.ArgumentParser) -> None:
    """The --plot-only flag of a bench that draws its figure from its evidence JSON."""
    parser.add_argument("--plot-only", type=Path, metavar="JSON",
                        help="measure nothing: draw the figure of this evidence JSON beside it (<stem>.png)")


def refuse_flags_beside_plot_only(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--plot-only measures nothing, so a measuring flag beside it is a mistake: parser.error names it."""
    given = [name for name, value in vars(args).items() if name != "plot_only" and value != parser.get_default(name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        parser.error(f"--plot-only draws from a JSON and measures nothing: drop {flags}")


def check_plot_source(path: Path, prog: str, is_record: Callable[[dict], bool]) -> str | None:
    """Why the figure of `path` cannot be drawn (one line naming the fix), or None: matplotlib missing, not a JSON
    file, a record of another tool than `prog` (`is_record` False), a folder that cannot be written in."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed: pip install 'fp8stack[plot]' to draw the figure"
    fix = f"pass the <stem>.json that {prog} wrote in its run folder (profiles/runs/<date>-<stem>/)"
    if path.suffix != ".json" or not path.is_file():
        return f"--plot-only {path}: {'not a file' if not path.is_file() else 'not a .json file'}: {fix}"
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"--plot-only {path}: not JSON ({err}): {fix}"
    if not isinstance(record, dict) or not is_record(record):
        return f"--plot-only {path}: not the evidence of {prog}: {fix}"
    if not os.access(path.parent, os.W_OK):
        return f"--plot-only {path}: cannot write {path.with_suffix('.png').name} in {path.parent}: make it writable"
    return None


def plot_only(prog: str, path: Path, is_record: Callable[[dict], bool], draw: Callable[[dict], "Figure"]) -> int:
    """--plot-only: the figure `draw` makes of the JSON `path`, written beside it, 0; a source check_plot_source
    refuses: one line naming the fix, 2."""
    problem = check_plot_source(path, prog, is_record)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    print(f"wrote {write_plot(path, draw)}")
    return 0


def note_unmeasured(axes, rows: list[float], notes: list[str | None]) -> None:
    """Write each row's note (why its arm has no bar: failed, skipped, not measured) at the left of its empty row."""
    for row, note in zip(rows, notes):
        if note:
            axes.text(0.01, row, note, transform=axes.get_yaxis_transform(), va="center", fontsize="small",
                      color="tab:gray", style="italic")


def loss_panel(axes, curves: list[tuple[str, list[float], dict]]) -> None:
    """Each arm's training loss per step: (label, losses, extra line style) per arm that ran."""
    for label, losses, style in curves:
        axes.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2, **style)
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel="step", ylabel="training loss", title="loss per step")
    if curves:
        axes.legend(fontsize="small")
    else:
        axes.text(0.5, 0.5, "no arm ran", transform=axes.transAxes, ha="center", color="tab:gray")
