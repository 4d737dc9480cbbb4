"""The measured speed of each expert-GEMM path per GPU arch: the whole expert block (w13, SwiGLU, w2; forward and
backward, quantization included) over its BF16 grouped GEMM, read from expert_speeds.json.

That file is generated from the backends benchmark's evidence (python -m fp8stack.bench.expert_table), never edited
by hand; each measurement names its device, date and evidence file. Pure data: no torch, no CUDA.
"""

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("expert_speeds.json")
"""The packaged table."""


@dataclass(frozen=True)
class Measurement:
    """One expert path's whole-block speedup over BF16 on one device."""

    speedup: float
    """BF16 grouped experts' median step time over this path's (above 1: faster than BF16)."""
    device: str
    """The GPU it was measured on, as torch names it."""
    date: str
    """When (the evidence's date, YYYY-MM-DD)."""
    source: str
    """The evidence file it comes from (profiles/runs/<folder>/<file>.json)."""
    kernels: str = ""
    """The grouped GEMM kernels it ran on where the backend has a choice (deepgemm, torch), else ''."""

    @property
    def folder(self) -> str:
        """The evidence folder (profiles/runs/<folder>)."""
        return str(Path(self.source).parent)

    def describe(self) -> str:
        """'measured 1.197x BF16 on NVIDIA H100 80GB HBM3 (profiles/runs/...)', with the kernels where named."""
        on = f" with {self.kernels} kernels" if self.kernels else ""
        return f"measured {self.speedup}x BF16{on} on {self.device} ({self.folder})"


def table_key(recipe: str, backend: str, kernels: str = "") -> str:
    """A measurement's key in the table: 'recipe/backend', or 'recipe/backend:kernels'."""
    return f"{recipe}/{backend}" + (f":{kernels}" if kernels else "")


@cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """The table: {'archs': {'sm90': {key: [measurement dicts, one per device]}}, ...}."""
    return json.loads(path.read_text())


def measured(arch: int, recipe: str, backend: str, table: dict | None = None) -> Measurement | None:
    """What one expert path (the expert GEMMs' recipe on `backend`) is worth on sm`arch`, None when unmeasured there.
    Per kernel choice the slowest device of the arch counts (the plan holds for every GPU measured); of the kernel
    choices the fastest counts, which the backend runs when it can (grouped_fp8 takes DeepGEMM when installed)."""
    rows = (table or load_table())["archs"].get(f"sm{arch}", {})
    prefix = table_key(recipe, backend)
    per_kernels = [min((Measurement(**m) for m in devices), key=lambda m: m.speedup)
                   for key, devices in rows.items() if key == prefix or key.startswith(prefix + ":")]
    return max(per_kernels, key=lambda m: m.speedup, default=None)


def shape_note(experts: int, n: int, k: int, table: dict | None = None) -> str:
    """'' when an expert GEMM of `experts` experts and weight [n, k] is one of the measured block's (w13 [2F, D] or
    w2 [D, F]), else what was measured and that this shape was not: a whole-block speedup at one shape does not carry
    to fewer tokens per expert or smaller GEMMs (launch and quantization costs grow in share)."""
    shape = (table or load_table())["shape"]
    dim, hidden = shape["dim"], shape["hidden"]
    if experts == shape["experts"] and (n, k) in ((2 * hidden, dim), (dim, hidden)):
        return ""
    return (f"; measured at {shape['experts']} experts of {dim} -> {hidden} with {shape['tokens_per_expert']} tokens "
            f"each, not at this GEMM's {experts} experts of [{n}, {k}]: measure this model (fp8stack ab)")

