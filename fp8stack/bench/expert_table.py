"""The plan's table of expert-path speeds, generated from the backends benchmark's evidence:

    python -m fp8stack.bench.expert_table profiles/runs/*/backends-*.json [--out fp8stack/plan/expert_speeds.json]

Takes each file's whole expert block rows (gemm 'experts': w13, SwiGLU, w2, forward + backward, quantization
included) at every shape the file measured (the MoE target's, fp8stack.bench.backends.ISSUE7_EXPERTS, and each
model's the run named) and files their speedup over BF16 by GPU arch and path (recipe/backend, with the grouped
kernels where the backend has a choice), each with its shape, one per device and shape: the newest evidence of that
device. Untimed rows and BF16's own are left out. The plan reads the table (fp8stack.plan.expert_speeds) at each
model's expert shape; tests/test_expert_table.py regenerates it from the evidence in profiles/, so it cannot drift
from it.
"""

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from fp8stack.plan.expert_speeds import TABLE_PATH, ExpertShape, table_key
from fp8stack.plan.recipes import is_fp8

COMMAND = "python -m fp8stack.bench.expert_table profiles/runs/*/backends-*.json"
"""How the packaged table is made (written into it)."""
SHAPE_FIELDS = tuple(field.name for field in fields(ExpertShape))
"""An evidence row's fields that make its shape (experts, dim, hidden, tokens_per_expert)."""


class EvidenceError(ValueError):
    """An input file is not the backends benchmark's evidence."""


def rows_of(path: Path) -> list[tuple[str, str, dict]]:
    """(arch like 'sm90', table key, measurement) for each timed FP8 whole-expert-block row of one evidence file."""
    try:
        record = json.loads(path.read_text())
        grouped, environment, date = record["grouped"], record["environment"], record["date"]
        arch = "sm" + environment["compute_capability"].replace(".", "")
        timed = [row for row in grouped
                 if row.get("gemm") == "experts" and "speedup_vs_bf16" in row and is_fp8(row["recipe"])]
        shapes = [ExpertShape(**{field: row[field] for field in SHAPE_FIELDS}) for row in timed]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise EvidenceError(f"{path} is not fp8stack.bench.backends evidence ({type(err).__name__}: {err}): pass its "
                            "backends-*.json files") from None
    rows = []
    for row, shape in zip(timed, shapes):
        kernels = kernels_label(row.get("options", {}))
        rows.append((arch, table_key(row["recipe"], row["backend"], kernels),
                     {"speedup": row["speedup_vs_bf16"], "shape": asdict(shape), "device": environment["device"],
                      "date": date, "source": path.as_posix(), "kernels": kernels}))
    return rows


def kernels_label(options: dict) -> str:
    """What a grouped row ran on where the backend has a choice: 'deepgemm', 'torch', 'deepgemm+te-quantizer' (TE's
    1x128 quantizer; rows without a quantizer option, or with inductor, had fp8stack's), else ''."""
    quantizer = "+te-quantizer" if options.get("quantizer") == "te" else ""
    return options.get("kernels", "") + quantizer


def build_table(paths: list[Path]) -> dict:
    """The table from these evidence files: per arch and key, the newest measurement of each device at each shape
    (by the evidence's timestamp; of two of the same time, the later file), ordered by shape then device; with the
    shapes it holds. The table gives each measurement's day."""
    newest: dict[tuple[str, str, ExpertShape, str], dict] = {}
    for path in paths:
        for arch, key, measurement in rows_of(path):
            slot = (arch, key, ExpertShape(**measurement["shape"]), measurement["device"])
            if slot not in newest or measurement["date"] >= newest[slot]["date"]:
                newest[slot] = measurement
    archs: dict[str, dict[str, list[dict]]] = {}
    for (arch, key, _, _), measurement in sorted(newest.items()):
        archs.setdefault(arch, {}).setdefault(key, []).append({**measurement, "date": measurement["date"][:10]})
    shapes = sorted({shape for _, _, shape, _ in newest})
    return {"generated_by": COMMAND, "measures": "whole expert block (w13, SwiGLU, w2) forward + backward, "
            "quantization included, over BF16 grouped GEMMs; balanced routing",
            "shapes": [asdict(shape) for shape in shapes], "archs": archs}


def render(table: dict) -> str:
    """The table as the packaged file holds it."""
    return json.dumps(table, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.expert_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("evidence", nargs="+", type=Path, help="backends-*.json evidence files")
    parser.add_argument("--out", type=Path, default=TABLE_PATH, help="where to write the table")
    args = parser.parse_args(argv)
    try:
        table = build_table(sorted(args.evidence))
    except EvidenceError as err:
        print(f"fp8stack.bench.expert_table: {err}", file=sys.stderr)
        return 2
    if not table["archs"]:
        print("fp8stack.bench.expert_table: no timed FP8 whole-expert-block measurement in these files: pass backends "
              "evidence with expert shapes (python -m fp8stack.bench.backends --grouped-only)", file=sys.stderr)
        return 2
    args.out.write_text(render(table))
    print(f"{args.out}: {sum(len(keys) for keys in table['archs'].values())} expert paths at "
          f"{len(table['shapes'])} shapes from {len(args.evidence)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
