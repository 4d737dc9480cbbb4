"""Collectives per training step, counted from torch.profiler's record of the c10d operators.

Every collective of every backend (NCCL, gloo) passes through one dispatcher operator of the
`c10d::` namespace (`_allgather_base_`, `_reduce_scatter_base_`, `allreduce_`, ...): torch's
ProcessGroup methods call them, and so do the functional collectives DTensor and torchao use
(`_c10d_functional::all_reduce` dispatches to `c10d::allreduce_`). The profiler records each such
call with its tensors' shapes and dtypes (record_shapes=True), on whichever thread issued it
(autograd's backward threads included). Counting those records counts each collective once, as
the caller asked for it, independent of how the backend moves it.

Bytes are the unsharded tensor's size: the output of an all-gather, the input of a reduce-scatter
(the first two arguments of both are (output, input)). A ring moves (world - 1) / world of that
through each rank's links in each direction, so ratios of these bytes are ratios of wire traffic.
An all-to-all's bytes are its input's, what the rank sends, its share for itself included: an MoE
layer's dispatch of its tokens to the experts' ranks, their return, and both again in the backward,
by element type (tokens in the activations' dtype, routing weights in theirs).
FSDP2 all-gathers a group whose parameters have mixed dtypes (FP8 weights, BF16 norms) as one uint8
buffer: its element count is then its byte count, which the dtype table below accounts for.

All-reduces issued inside an FSDP all-gather (the profiler range `FSDP::all_gather (<module>)`) are
counted apart: those are the per-weight amax reductions torchao's Float8Linear runs when it casts a
weight to FP8 for the all-gather without a precomputed scale.
"""

import json
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile

KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather_list",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::alltoall_": "all_to_all_list",
}
"""c10d operator -> the collective it runs; other c10d operators are counted under their own name. all_gather_list is
all_gather's list form (torch.distributed.all_gather into a list, and all_gather_object, which checkpoint planning
issues): the profiler leaves its tensor lists without a dtype, so it is counted apart, without bytes; so is
all_to_all_list, all_to_all's list form (all_to_all_single is all_to_all)."""
COUNTED_ARG = {"all_gather": 0, "reduce_scatter": 1, "all_to_all": 1}
"""Kind -> which argument (output 0, input 1) holds the bytes reported: the unsharded tensor of an all-gather or a
reduce-scatter, what a rank sends to an all-to-all."""
ITEM_BYTES = {"double": 8, "long int": 8, "float": 4, "int": 4, "c10::BFloat16": 2, "c10::Half": 2, "short int": 2,
              "unsigned char": 1, "signed char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
              "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1}
"""The profiler's 'Input type' names (C++ type names) -> bytes per element."""
FSDP_ALL_GATHER = "FSDP::all_gather"
"""Profiler range around one FSDP2 parameter group's all-gather; its module's name follows in parentheses."""
ROOT_GROUP = "root"
"""Group name for the root module's parameters (its range carries no module name)."""


@dataclass
class Collectives:
    """What the profiled steps issued, per step (averaged over the profiled steps)."""

    steps: int
    """Steps profiled."""
    counts: dict[str, float] = field(default_factory=dict)
    """Kind (all_gather, reduce_scatter, all_reduce, or a c10d operator name) -> calls per step."""
    bytes: dict[str, float] = field(default_factory=dict)
    """all_gather / reduce_scatter -> bytes of the unsharded tensors per step; all_to_all -> bytes sent per step."""
    all_gather_bytes_by_group: dict[str, float] = field(default_factory=dict)
    """FSDP parameter group (module name, or 'root') -> all-gather bytes per step."""
    all_gather_dtypes: list[str] = field(default_factory=list)
    """Element types the all-gathers moved (the profiler's names)."""
    all_reduces_in_all_gather: float = 0.0
    """All-reduces issued inside FSDP all-gathers per step: torchao's per-weight FP8 scale reductions."""
    all_to_all_bytes_by_dtype: dict[str, float] = field(default_factory=dict)
    """Element type (the profiler's name) -> all-to-all bytes sent per step: in which precision an MoE layer's
    dispatch moves its tokens and routing weights."""


class CollectiveCounter:
    """Profiles `steps` training steps (CPU activity only, so no CUDA tracing overhead) after the first
    step of the run, which includes lazy initialisation. Call step_done() at the end of every step;
    `result` holds the Collectives once the profiled steps are over (None when profiling is off)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.done = 0
        self.profiler: profile | None = None
        self.result: Collectives | None = None

    def __enter__(self) -> "CollectiveCounter":
        return self

    def step_done(self) -> None:
        if self.steps <= 0 or self.result is not None:
            return
        if self.profiler is None:
            self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.profiler.start()
            return
        self.done += 1
        if self.done == self.steps:
            self._finish()

    def __exit__(self, exc_type, *exc) -> None:
        if self.profiler is None or self.result is not None:
            return
        if exc_type is None:
            self._finish()  # the run ended before `steps` profiled steps: report the ones it took
        else:
            self.profiler.stop()  # the step failed: let its error through

    def _finish(self) -> None:
        self.profiler.stop()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            self.profiler.export_chrome_trace(path)
            with open(path) as file:
                events = json.load(file)["traceEvents"]
        self.profiler = None
        self.result = summarize(events, self.done)


def summarize(events: list[dict], steps: int) -> Collectives:
    """Collectives per step from a chrome trace's events covering `steps` steps."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("c10d::")]
    gathers = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(FSDP_ALL_GATHER)
               and not e["name"].startswith(FSDP_ALL_GATHER + "_")]  # not FSDP::all_gather_copy_out
    counts, sizes, by_group, dtypes, in_gather, to_all = Counter(), Counter(), Counter(), set(), 0, Counter()
    for op in ops:
        kind = KINDS.get(op["name"], op["name"])
        counts[kind] += 1
        enclosing = next((g for g in gathers if _inside(op, g)), None)
        if kind == "all_reduce" and enclosing is not None:
            in_gather += 1
        if kind in COUNTED_ARG:
            size, dtype = _tensor_bytes(op, COUNTED_ARG[kind])
            sizes[kind] += size
            if kind == "all_gather":
                dtypes.add(dtype)
                by_group[_group(enclosing) if enclosing is not None else "outside FSDP"] += size
            if kind == "all_to_all":
                to_all[dtype] += size
    per_step = max(steps, 1)
    return Collectives(steps=steps, counts={k: v / per_step for k, v in sorted(counts.items())},
                       bytes={k: v / per_step for k, v in sorted(sizes.items())},
                       all_gather_bytes_by_group={k: v / per_step for k, v in sorted(by_group.items())},
                       all_gather_dtypes=sorted(dtypes), all_reduces_in_all_gather=in_gather / per_step,
                       all_to_all_bytes_by_dtype={k: v / per_step for k, v in sorted(to_all.items())})


def _inside(inner: dict, outer: dict) -> bool:
    """Whether `inner` ran within `outer` on the same thread (chrome trace times are microseconds)."""
    return (inner.get("pid"), inner.get("tid")) == (outer.get("pid"), outer.get("tid")) and \
        outer["ts"] <= inner["ts"] and inner["ts"] + inner.get("dur", 0) <= outer["ts"] + outer.get("dur", 0)


def _group(gather: dict) -> str:
    """'FSDP::all_gather (layers.0)' -> 'layers.0'; the root's range has no module name."""
    name = gather["name"].removeprefix(FSDP_ALL_GATHER).strip()
    return name[1:-1] if name.startswith("(") else ROOT_GROUP


def _tensor_bytes(op: dict, index: int) -> tuple[int, str]:
    args = op.get("args", {})
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or len(dims) <= index:
        raise RuntimeError(f"profiler event {op['name']} carries no tensor shapes: profile with record_shapes=True")
    dtype = types[index]
    if dtype not in ITEM_BYTES:
        raise RuntimeError(f"{op['name']} moved elements of type {dtype!r}, which comm_stats.ITEM_BYTES does not "
                           "know: add its size in bytes there")
    return math.prod(dims[index]) * ITEM_BYTES[dtype], dtype
