"""Plan rendering: a grouped table (rich), Markdown, JSON."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # plan.Plan prints itself through this module
    from fp8stack.plan.plan import Plan


@dataclass(frozen=True)
class Row:
    """Identical decisions for the same component in several layers, shown once."""

    layers: str
    """Layer ranges ('0-2, 5') or '-' outside the layers."""
    name: str
    kind: str
    shape: str
    backend: str
    recipe: str
    reason: str


def grouped_rows(plan: Plan) -> list[Row]:
    """Merge decisions that differ only in their layer index, keeping first-seen order."""
    groups: dict[tuple, list[int | None]] = {}
    for d in plan.decisions:
        c = d.component
        shape = f"{c.experts}x {c.n}x{c.k}" if c.experts > 1 else f"{c.n}x{c.k}"
        key = (c.block, c.name, c.kind, shape, d.backend, d.recipe, d.reason)
        groups.setdefault(key, []).append(c.layer)
    return [Row(_ranges(layers), f"{block}: {name}" if block != "model" else name, kind, shape, backend, recipe, reason)
            for (block, name, kind, shape, backend, recipe, reason), layers in groups.items()]


def _ranges(layers: list[int | None]) -> str:
    if layers == [None]:
        return "-"
    spans, start, prev = [], None, None
    for i in sorted(x for x in layers if x is not None):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            spans.append((start, prev))
            start = prev = i
    spans.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _summary_lines(plan: Plan) -> list[str]:
    s = plan.summary()
    lines = [
        f"GEMM FLOPs/token (forward): {s['gemm_flops_per_token']:.3e}",
        "share by precision: " + ", ".join(f"{k} {v:.1%}" for k, v in s["flops_share_by_precision"].items()),
        "share by backend:   " + ", ".join(f"{k} {v:.1%}" for k, v in s["flops_share_by_backend"].items()),
        f"GEMMs in FP8: {s['fp8_gemms']}, in high precision: {s['high_precision_gemms']}",
        f"norms fused with what reads them: {s['fused_norms']}",
    ]
    lines += [f"not fused: {norms}: {why}" for why, norms in _not_fused(plan).items()]
    lines += [f"WARNING: {plan.little_fp8}"] if plan.little_fp8 else []
    return [*lines, "FP32: " + ", ".join(what for what, _ in plan.fp32)]


def _not_fused(plan: Plan) -> dict[str, str]:
    """Why -> the norms it holds for (named inside their layer, with the layers), identical layers shown once."""
    layers: dict[tuple[str, str], list[int | None]] = {}
    for fqn, why in plan.not_fused:
        parts = fqn.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        name = ".".join(parts[index + 1:]) if index is not None else (fqn or "the model")
        layers.setdefault((why, name), []).append(int(parts[index]) if index is not None else None)
    out: dict[str, list[str]] = {}
    for (why, name), found in layers.items():
        where = f" (layers {_ranges(found)})" if found != [None] else ""
        out.setdefault(why, []).append(name + where)
    return {why: ", ".join(names) for why, names in out.items()}


_COLUMNS = ("layers", "component", "kind", "shape (n x k)", "backend", "recipe")
"""Table columns before the reason."""
MIN_REASON_WIDTH = 40
"""Narrower than this, the reason column would fold every few words: reasons become numbered notes."""


def render_table(plan: Plan, width: int = 160) -> str:
    """The human view: one row per group of identical layers, then the summary.

    Reasons sit in the last column when `width` leaves them MIN_REASON_WIDTH characters, else
    each distinct reason is printed once below the table and rows point to it by number.
    """
    rows = grouped_rows(plan)
    cells = [(r.layers, r.name, r.kind, r.shape, r.backend, r.recipe) for r in rows]
    used = sum(max([len(h), *(len(c[i]) for c in cells)]) + 3 for i, h in enumerate(_COLUMNS))  # + padding, border
    inline = width - used - 4 >= MIN_REASON_WIDTH
    notes = list(dict.fromkeys(r.reason for r in rows))
    table = Table(title=f"{plan.model} - recipe {plan.recipe} ({plan.fp8_format}), target sm{plan.arch}")
    for column in _COLUMNS:
        table.add_column(column, overflow="fold")
    table.add_column("reason" if inline else "why", overflow="fold")
    for row, cell in zip(rows, cells):
        table.add_row(*cell, row.reason if inline else f"[{notes.index(row.reason) + 1}]")
    out = io.StringIO()
    # markup and emoji off: reasons from recipe files are plain text, '[...]' and ':x:' included
    console = Console(file=out, width=width, no_color=True, highlight=False, markup=False, emoji=False)
    console.print(table)
    if not inline:
        for i, note in enumerate(notes, 1):
            console.print(f"[{i}] {note}")
    for line in _summary_lines(plan):
        console.print(line)
    return out.getvalue()


def render_markdown(plan: Plan) -> str:
    """The same grouped table as GitHub Markdown."""
    lines = [f"### {plan.model}: recipe {plan.recipe} ({plan.fp8_format}), sm{plan.arch}", "",
             "| layers | component | kind | shape | backend | recipe | reason |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.layers} | {r.name} | {r.kind} | {r.shape} | {r.backend} | {r.recipe} | {r.reason} |"
              for r in grouped_rows(plan)]
    lines += [""] + [f"- {line}" for line in _summary_lines(plan)]
    return "\n".join(lines) + "\n"


def render_json(plan: Plan) -> str:
    """Plan.as_dict() as indented JSON."""
    return json.dumps(plan.as_dict(), indent=2)


RENDERERS = {"table": render_table, "markdown": render_markdown, "json": render_json}
