"""The measured speed of each expert-GEMM path per GPU arch and expert-block shape: the whole expert block (w13,
SwiGLU, w2; forward and backward, quantization included) over its BF16 grouped GEMM, read from expert_speeds.json.

That file is generated from the backends benchmark's evidence (python -m fp8stack.bench.expert_table), never edited
by hand; each measurement names its shape, device, date and evidence file. A speedup holds at the shape it was
measured at: fewer tokens per expert or smaller GEMMs give launch and quantization costs a larger share, so the plan
reads a model's expert GEMMs at their own shape where measured, else at the nearest measured one, and says which.
Pure data: no torch, no CUDA.
"""

import importlib.util
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("expert_speeds.json")
"""The packaged table."""
GROUPED_KERNELS = ("auto", "deepgemm", "torch")
"""What grouped_fp8's blockwise GEMMs can run on where the model trains (PolicyConfig.grouped_kernels)."""


@dataclass(frozen=True, order=True)
class ExpertShape:
    """A whole expert block as the backends benchmark times it: `experts` SwiGLU experts of dim -> hidden
    (w13 [2 * hidden, dim], w2 [dim, hidden]), each given tokens_per_expert rows."""

    experts: int
    """Experts in the grouped GEMMs (one GPU's, under expert parallelism)."""
    dim: int
    """The model width D: w13's input and w2's output features."""
    hidden: int
    """The expert's SwiGLU width F."""
    tokens_per_expert: int
    """Rows each expert's GEMMs get (balanced routing)."""

    def describe(self) -> str:
        """'8 experts of 7168 -> 2048 with 4096 tokens each'."""
        return f"{self.experts} experts of {self.dim} -> {self.hidden} with {self.tokens_per_expert} tokens each"


@dataclass(frozen=True)
class ExpertGemm:
    """One expert GEMM of a model as the plan sees it: `experts` weights [n, k], which is w13 [2F, D] or w2 [D, F]."""

    experts: int
    """Experts sharing the GEMM."""
    n: int
    """Output features."""
    k: int
    """Input features."""
    tokens_per_expert: int
    """Rows each expert gets from one sequence (seq_len x top-k / experts): breaks ties between measured shapes."""
    role: str = ""
    """'w13' or 'w2' where known (the block's other GEMM tells which), '' where not: the GEMM is then read both ways."""

    def distance(self, shape: ExpertShape) -> tuple[int, float]:
        """How far a measured block is from this GEMM's: first how many of (experts, dim, hidden) differ, reading
        the GEMM as its role's (as w13 or as w2, whichever is nearer, where the role is unknown), then how far apart
        the tokens per expert are in log scale. (0, ...) is this GEMM's own shape."""
        as_role = {"w13": (self.k, self.n / 2), "w2": (self.n, self.k)}  # (dim, hidden) if it is w13, if it is w2
        readings = [as_role[self.role]] if self.role else as_role.values()
        differ = min((self.experts != shape.experts) + (dim != shape.dim) + (hidden != shape.hidden)
                     for dim, hidden in readings)
        return differ, abs(math.log(self.tokens_per_expert / shape.tokens_per_expert))

    def describe(self) -> str:
        """'32 experts of [3072, 2048] with 1024 tokens each per sequence'."""
        return f"{self.experts} experts of [{self.n}, {self.k}] with {self.tokens_per_expert} tokens each per sequence"


@dataclass(frozen=True)
class Measurement:
    """One expert path's whole-block speedup over BF16 at one shape on one device."""

    speedup: float
    """BF16 grouped experts' median step time over this path's (above 1: faster than BF16)."""
    shape: ExpertShape
    """The expert block it was measured at."""
    device: str
    """The GPU it was measured on, as torch names it."""
    date: str
    """When (the evidence's date, YYYY-MM-DD)."""
    source: str
    """The evidence file it comes from (profiles/runs/<folder>/<file>.json)."""
    kernels: str = ""
    """The grouped GEMM kernels it ran on where the backend has a choice (deepgemm, torch, deepgemm+te-quantizer:
    DeepGEMM on TE's quantizer's operands), else ''."""

    @classmethod
    def of(cls, row: dict) -> "Measurement":
        """A measurement from its dict in the table."""
        return cls(**{**row, "shape": ExpertShape(**row["shape"])})

    @property
    def folder(self) -> str:
        """The evidence folder (profiles/runs/<folder>)."""
        return str(Path(self.source).parent)

    def describe(self) -> str:
        """'measured 1.197x BF16 at 8 experts of 7168 -> 2048 with 4096 tokens each on NVIDIA H100 80GB HBM3
        (profiles/runs/...)', with the kernels where named."""
        on = f" with {self.kernels} kernels" if self.kernels else ""
        return f"measured {self.speedup}x BF16{on} at {self.shape.describe()} on {self.device} ({self.folder})"


def table_key(recipe: str, backend: str, kernels: str = "") -> str:
    """A measurement's key in the table: 'recipe/backend', or 'recipe/backend:kernels'."""
    return f"{recipe}/{backend}" + (f":{kernels}" if kernels else "")


@cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """The table: {'archs': {'sm90': {key: [measurement dicts, one per device and shape]}}, ...}."""
    return json.loads(path.read_text())


def deep_gemm_installed() -> bool:
    """Whether this Python has a deep_gemm package (found, not imported: the plan loads no GPU library)."""
    return importlib.util.find_spec("deep_gemm") is not None


def runnable_kernels(grouped_kernels: str) -> frozenset[str]:
    """The kernel choices (Measurement.kernels) whose measurements count where grouped_fp8's blockwise GEMMs run on
    `grouped_kernels` (GROUPED_KERNELS): auto is deepgemm where this Python can import deep_gemm (looked up, not
    imported), else torch. With DeepGEMM the backend runs TE's quantizer where TE imports, so its measurements count
    too; '' is a path without a kernel choice (TE's)."""
    if grouped_kernels not in GROUPED_KERNELS:
        raise ValueError(f"grouped_kernels={grouped_kernels!r}: use one of {', '.join(GROUPED_KERNELS)}")
    if grouped_kernels == "auto":
        grouped_kernels = "deepgemm" if deep_gemm_installed() else "torch"
    on_deepgemm = {"deepgemm", "deepgemm+te-quantizer"} if grouped_kernels == "deepgemm" else set()
    return frozenset({"", "torch"} | on_deepgemm)


def measured(arch: int, recipe: str, backend: str, gemm: ExpertGemm, table: dict | None = None,
             kernels: frozenset[str] | None = None) -> Measurement | None:
    """What one expert path (the expert GEMMs' recipe on `backend`) is worth for `gemm` on sm`arch`, None when the
    path is unmeasured there. Read at the path's measured shape nearest the GEMM's (ExpertGemm.distance; its own
    where measured); there, per kernel choice the slowest device counts (the plan holds for every GPU measured), and
    of the kernel choices the fastest, which the backend runs when it can (grouped_fp8 takes DeepGEMM when
    installed, and TE's quantizer with it where TE imports). kernels: only the kernel choices that can run where the
    model trains (runnable_kernels; None: every one)."""
    rows = (table or load_table())["archs"].get(f"sm{arch}", {})
    prefix = table_key(recipe, backend)
    found = [(key, Measurement.of(m)) for key, devices in rows.items() if key == prefix or key.startswith(prefix + ":")
             for m in devices if kernels is None or m["kernels"] in kernels]
    if not found:
        return None
    nearest = min({m.shape for _, m in found}, key=lambda shape: (gemm.distance(shape), shape))
    slowest: dict[str, Measurement] = {}
    for key, m in found:
        if m.shape == nearest and (key not in slowest or m.speedup < slowest[key].speedup):
            slowest[key] = m
    return max(slowest.values(), key=lambda m: m.speedup)


def shape_note(m: Measurement, gemm: ExpertGemm) -> str:
    """'' when `m` was measured at `gemm`'s own shape (its experts, dim and hidden), else that it was not: a
    whole-block speedup does not carry to fewer tokens per expert or smaller GEMMs."""
    if gemm.distance(m.shape)[0] == 0:
        return ""
    shape = m.shape
    return (f"; {shape.experts} experts of {shape.dim} -> {shape.hidden} is the nearest shape measured to this GEMM's "
            f"{gemm.describe()}: measure this model (fp8stack ab)")
