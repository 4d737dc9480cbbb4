"""The plan's table of expert-path speeds, generated from the backends benchmark's evidence:

    python -m fp8stack.bench.expert_table profiles/runs/*/backends-*.json [--out fp8stack/plan/expert_speeds.json]

Takes each file's whole expert block rows (gemm 'experts': w13, SwiGLU, w2, forward + backward, quantization
included) at the MoE target's expert shape (fp8stack.bench.backends.ISSUE7_EXPERTS) and files their speedup over
BF16 by GPU arch and path (recipe/backend, with the grouped kernels where the backend has a choice), one per device:
the newest evidence of that device. Rows at other shapes, untimed rows and BF16's own are left out. The plan reads
the table (fp8stack.plan.expert_speeds); tests/test_expert_table.py regenerates it from the evidence in profiles/,
so it cannot drift from it.
"""

import argparse
import json
import sys
from pathlib import Path

from fp8stack.bench.backends import ISSUE7_EXPERTS
from fp8stack.plan.expert_speeds import TABLE_PATH, table_key
from fp8stack.plan.recipes import is_fp8

COMMAND = "python -m fp8stack.bench.expert_table profiles/runs/*/backends-*.json"
"""How the packaged table is made (written into it)."""


class EvidenceError(ValueError):
    """An input file is not the backends benchmark's evidence."""


def rows_of(path: Path) -> list[tuple[str, str, dict]]:
    """(arch like 'sm90', table key, measurement) for each whole-expert-block row of one evidence file at the
    target shape."""
    try:
        record = json.loads(path.read_text())
        grouped, environment, date = record["grouped"], record["environment"], record["date"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EvidenceError(f"{path} is not fp8stack.bench.backends evidence ({type(err).__name__}: {err}): pass its "
                            "backends-*.json files") from None
    arch = "sm" + environment["compute_capability"].replace(".", "")
    rows = []
    for row in grouped:
        at_target = all(row.get(name) == value for name, value in ISSUE7_EXPERTS.items())
        if row.get("gemm") != "experts" or not at_target or "speedup_vs_bf16" not in row or not is_fp8(row["recipe"]):
            continue
        kernels = row.get("options", {}).get("kernels", "")
        rows.append((arch, table_key(row["recipe"], row["backend"], kernels),
                     {"speedup": row["speedup_vs_bf16"], "device": environment["device"], "date": date[:10],
                      "source": path.as_posix(), "kernels": kernels}))
    return rows


def build_table(paths: list[Path]) -> dict:
    """The table from these evidence files: per arch and key, the newest measurement of each device (a later file
    of the same date wins)."""
    newest: dict[tuple[str, str, str], dict] = {}
    for path in paths:
        for arch, key, measurement in rows_of(path):
            slot = (arch, key, measurement["device"])
            if slot not in newest or measurement["date"] >= newest[slot]["date"]:
                newest[slot] = measurement
    archs: dict[str, dict[str, list[dict]]] = {}
    for (arch, key, _), measurement in sorted(newest.items()):
        archs.setdefault(arch, {}).setdefault(key, []).append(measurement)
    return {"generated_by": COMMAND, "measures": "whole expert block (w13, SwiGLU, w2) forward + backward, "
            "quantization included, over BF16 grouped GEMMs; balanced routing", "shape": ISSUE7_EXPERTS,
            "archs": archs}


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
        print("fp8stack.bench.expert_table: no whole-expert-block measurement at the target shape in these files: "
              "pass backends evidence run with the MoE target's shape (python -m fp8stack.bench.backends --shapes '')",
              file=sys.stderr)
        return 2
    args.out.write_text(render(table))
    print(f"{args.out}: {sum(len(keys) for keys in table['archs'].values())} expert paths from {len(args.evidence)} "
          "files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
