"""Where any training script's step loses time, the script unchanged: `fp8stack profile`'s breakdown for a user's own
loop (issue 31).

    python -m fp8stack.bench.profile_script --warmup-steps 3 --steps 5 --out prof.json -- train.py --lr 1e-3
    python -m fp8stack.bench.profile_script --out prof.json -- -m fp8stack.train --model tiny --device cpu

Runs the script (or, after -m, the module) in this process as `python script.py args` would, its __main__ and
sys.argv its own. A step is an optimizer step: a global torch.optim post-step hook counts the steps of every
optimizer the script builds (a script stepping two optimizers per iteration counts two). After --warmup-steps steps
the hook starts torch.profiler (CPU ops; CUDA kernels too once the script has initialized CUDA), and after --steps
more it stops it, both times after the GPU has drained its queue, so the record holds those steps' work and no other.
The script then runs to its own end unprofiled (its control flow untouched: it writes its results and exits as it
would), so give it warmup + steps optimizer steps to spend no more time than the profile needs. Afterwards --out gets
fp8stack.profile's breakdown per profiled step (kernel categories, top kernels, GPU idle time and its longest gaps,
and the host's top ops by self CPU time with their calls: a step bound by Python and kernel launches shows thousands
of small ops there), and stdout its Markdown.

With --memory (a CUDA GPU) the first profiled step's allocations are recorded too (torch.cuda.memory's history,
Python stacks; one step bounds the trace): --out and stdout then also say where allocated memory peaked in that step
and which places in the code (the first frame outside torch: a TE module, fp8stack, the script's model) held the most
of it there, beside what was allocated before it (parameters, gradients, optimizer state, caches).

A script that takes fewer optimizer steps than warmup + steps is an error (exit 2, nothing written); one that fails
keeps its own exit status and writes nothing. One process: under torchrun every rank would write the same --out.
"""

import argparse
import importlib.util
import json
import os
import runpy
import sys
import time
from dataclasses import asdict
from pathlib import Path

from fp8stack.config import ConfigError
from fp8stack.config.flags import OneLineParser
from fp8stack.evidence import markdown_table
from fp8stack.profile import (GAP_MIN_US, HOST_NOTE, HOST_TITLE, MemoryPeak, RunProfile, category_table, gap_table,
                              host_table, kernel_table, memory_at_peak, memory_table, profile_from_record)
from fp8stack.train.preflight import check_output_file

PROG = "python -m fp8stack.bench.profile_script"


MEMORY_EVENTS = 4_000_000
"""Most allocation events --memory keeps (torch drops the oldest past it: MemoryPeak.events says when it did)."""


class StepWindow:
    """The optimizer-step hook: profiles the steps after the first `warmup` ones, `steps` of them (and, with memory,
    records their allocations)."""

    def __init__(self, warmup: int, steps: int, memory: bool = False):
        self.warmup, self.steps, self.memory = warmup, steps, memory
        self.taken = 0
        """Optimizer steps counted so far."""
        self.profiler = None
        self.on_gpu = False
        self.began = self.wall_ms_per_step = None
        self.baseline_bytes = 0
        self.memory_peak: MemoryPeak | None = None
        """With memory, once done on a GPU: where the window's allocated memory peaked."""

    @property
    def done(self) -> bool:
        return self.wall_ms_per_step is not None

    def __call__(self, *_optimizer_hook_args) -> None:
        self.taken += 1
        if self.taken == self.warmup:
            self._start()
        if self.taken == self.warmup + 1:
            self._stop_memory()
        if self.taken == self.warmup + self.steps:
            self._stop()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.on_gpu = torch.cuda.is_initialized()
        self._drain()
        if self.memory and self.on_gpu:
            self.baseline_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=MEMORY_EVENTS)
        self.profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else []))
        self.profiler.start()
        self.began = time.perf_counter()

    def _stop(self) -> None:
        self._drain()
        self.wall_ms_per_step = (time.perf_counter() - self.began) * 1000 / self.steps
        self.profiler.stop()

    def _stop_memory(self) -> None:
        """With memory, after the first profiled step: its allocations are the record (one step bounds the trace)."""
        if self.memory and self.on_gpu:
            import torch

            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_peak = memory_at_peak(trace, self.baseline_bytes)

    def abandon(self) -> None:
        """Stop a profiler the script left running by ending before the window's last step."""
        if self.profiler is not None and not self.done:
            self.profiler.stop()

    def _drain(self) -> None:
        """Wait for the kernels already launched: the window's first kernel is its first step's, and its wall time
        ends with its last step's GPU work."""
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def record(self, label: str) -> RunProfile:
        """The profiled steps' breakdown (once done)."""
        return profile_from_record(self.profiler.key_averages(), self.profiler.events(), steps=self.steps, recipe=label,
                                   wall_ms_per_step=self.wall_ms_per_step, on_gpu=self.on_gpu)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this tool's options, the target: [script, args...] or ['-m', module, args...]); a bad one ends the process
    with one line and exit code 2 before anything runs."""
    parser = OneLineParser(prog=PROG, usage="%(prog)s [options] -- script.py|-m module [its args]",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="optimizer steps run before the profiler starts (compilation, allocator; at least 1: "
                             "the profiler starts at a step's end)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps profiled")
    parser.add_argument("--out", type=Path, required=True, help="the JSON breakdown's path")
    parser.add_argument("--memory", action="store_true",
                        help="also record the first profiled step's allocations (a CUDA GPU): where allocated memory "
                             "peaked and which code held it")
    split = argv.index("--") if "--" in argv else len(argv)
    args, target = parser.parse_args(argv[:split]), argv[split + 1:]
    if args.steps < 1 or args.warmup_steps < 1:
        parser.error(f"need --steps >= 1 and --warmup-steps >= 1, got {args.steps} and {args.warmup_steps}")
    if not target or target == ["-m"]:
        parser.error("no training script given: pass it after --, e.g. -- train.py --lr 1e-3, or -- -m package.module")
    if target[0] == "-m" and not _importable(target[1]):
        parser.error(f"no module named {target[1]}: pass an importable module after -m, or a script's path")
    if target[0] != "-m" and not Path(target[0]).is_file():
        parser.error(f"script {target[0]} is not a file: pass the training script's path after --")
    if args.memory and not _cuda_available():
        parser.error("--memory records CUDA allocations, and torch sees no CUDA GPU here: run it on a GPU machine, or "
                     "drop --memory")
    try:
        check_output_file(args.out, "--out")
    except ConfigError as err:
        parser.error(str(err))
    return args, target


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is missing
        return False


def run_target(target: list[str]) -> int:
    """Run the script or module as its own __main__ with its own sys.argv and sys.path[0] (as `python target`
    would; both restored after); its exit status (0 when it ends without sys.exit)."""
    as_module = target[0] == "-m"
    argv, first_path = sys.argv, sys.path[0]
    sys.argv = target[1:] if as_module else list(target)  # run_module puts the module's file in argv[0], as -m does
    if not as_module:
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # the script's own imports (from loop import ...)
    try:
        if as_module:
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as ended:
        if ended.code is None or isinstance(ended.code, int):
            return ended.code or 0
        print(ended.code, file=sys.stderr)  # sys.exit("message"), as python reports it
        return 1
    finally:
        sys.argv, sys.path[0] = argv, first_path
    return 0


def breakdown_markdown(runs: dict[str, RunProfile]) -> str:
    """Runs' breakdowns side by side (categories, GPU idle), then each run's top kernels, longest GPU waits and top
    host ops."""
    text = f"Times: {next(iter(runs.values())).time_basis}.\n\n" + category_table(runs, markdown_table)
    if all(run.idle_ms_per_step is not None for run in runs.values()):
        text += ("\nGPU idle (no kernel on any stream) per step, ms: "
                 + ", ".join(f"{name} {run.idle_ms_per_step:.3f}" for name, run in runs.items()) + ".\n")
    for name, run in runs.items():
        text += f"\n### {name}\n\nTop {len(run.top_kernels)}:\n\n" + kernel_table(run, markdown_table)
        if run.gaps:
            text += (f"\nLongest GPU waits (gaps of at least {GAP_MIN_US:g} us, by the kernels around them):\n\n"
                     + gap_table(run, markdown_table))
        if run.host_ops:
            text += f"\n{HOST_TITLE} ({HOST_NOTE}):\n\n" + host_table(run, markdown_table)
    return text


def main(argv: list[str] | None = None) -> int:
    try:
        args, target = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as done:  # --help printed, or a usage error already reported in one line
        return done.code if isinstance(done.code, int) else 0
    from torch.optim.optimizer import register_optimizer_step_post_hook

    # The script's own `import fp8stack` loads the backends' libraries (TE's cuDNN before torch's) only when torch
    # came first; here fp8stack came first, so load them before the script runs any kernel.
    import fp8stack.assembly  # noqa: F401

    window = StepWindow(args.warmup_steps, args.steps, memory=args.memory)
    hook = register_optimizer_step_post_hook(window)
    try:
        code = run_target(target)
    finally:
        hook.remove()
        window.abandon()
    if code:
        return code
    if not window.done:
        print(f"fp8stack: error: {' '.join(target)} took {window.taken} optimizer step(s), fewer than --warmup-steps "
              f"{args.warmup_steps} + --steps {args.steps}: give it more steps (its own flag) or profile fewer",
              file=sys.stderr)
        return 2
    label = " ".join(target[:2] if target[0] == "-m" else target[:1])
    profiled = window.record(label)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    memory = asdict(window.memory_peak) if window.memory_peak is not None else None
    args.out.write_text(json.dumps({"target": target, "warmup_steps": args.warmup_steps, "steps": args.steps,
                                    "optimizer_steps": window.taken, "profile": asdict(profiled), "memory": memory},
                                   indent=1) + "\n")
    print(breakdown_markdown({label: profiled}), end="")
    if window.memory_peak is not None:
        print("\nMemory of the first profiled step\n\n" + memory_table(window.memory_peak, markdown_table), end="")
    elif args.memory:
        print(f"\n--memory: {label} ran no CUDA work before the window, so nothing was recorded")
    print(f"profiled {args.steps} optimizer steps of {label}: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
