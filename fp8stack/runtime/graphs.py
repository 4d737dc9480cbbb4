"""CUDA-graph guards: know when a capture is under way, write steps that can be captured, and find out
which module stops a training step from being captured.

A captured step may not read device values on the host (`.item()`, `if x.max() > 1`, `.tolist()`),
make shapes that depend on data, or allocate outside the graph's pool. `no_host_sync` turns the first
kind into an error wherever it happens; `capture_check` tries a real capture and names the module
that was running when it broke. A module that knows it reads the host (a grouped-GEMM library taking
Python lists of group sizes) says so beforehand through the `cuda_graph_blocker(backward) -> str`
method ('' when capturable); `capture_blockers` and `check_capturable` refuse such a model before any
compute, naming the module, why, and what to do.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CaptureRefused", "CaptureReport", "branchless_clamp", "capture_blockers", "capture_check",
           "check_capturable", "is_graph_capturing", "no_host_sync", "te_graphed"]


def is_graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def branchless_clamp(x: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor) -> torch.Tensor:
    """x clamped to [lo, hi] with no host sync and x's shape: the bounds may be Python numbers or
    tensors on x's device (a scale computed on the GPU), never read to the host. Use it instead of
    `if x.max() > hi: ...`, which reads x on the host and cannot be captured. NaN stays NaN, so a
    later finiteness check still sees it."""
    return torch.clamp(x, min=lo, max=hi)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, any operation that synchronizes the host with the GPU raises (torch.cuda's sync debug
    mode 'error'); the previous mode is restored on exit. Without CUDA there is no device to wait for
    and nothing is changed."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class CaptureRefused(RuntimeError):
    """A model holds a module that says it cannot be captured in a CUDA graph."""


def capture_blockers(model: nn.Module, backward: bool = True) -> list[tuple[str, str]]:
    """(fqn, why and what to do) of each module of `model` whose `cuda_graph_blocker(backward)` says its
    forward (and, with backward=True, its backward) cannot be captured; fqn '<root>' for the model itself.
    Found by that method alone, whichever library the module comes from."""
    blockers = []
    for fqn, module in model.named_modules():
        blocker = getattr(module, "cuda_graph_blocker", None)
        reason = blocker(backward) if callable(blocker) else ""
        if reason:
            blockers.append((fqn or "<root>", reason))
    return blockers


def check_capturable(model: nn.Module, backward: bool = True) -> None:
    """Raise CaptureRefused naming the first module that cannot be captured (forward, and backward when asked),
    why, and the fix, in one line; return quietly when none says so. Needs no GPU: call it before capturing."""
    blockers = capture_blockers(model, backward)
    if blockers:
        fqn, reason = blockers[0]
        more = f" (and {len(blockers) - 1} more module(s) like it)" if len(blockers) > 1 else ""
        raise CaptureRefused(f"cannot capture {fqn} in a CUDA graph{more}: {reason}")


@dataclass
class CaptureReport:
    """Whether one training step could be captured as a CUDA graph, and if not, where and why."""

    captured: bool
    """The step was captured and replayed once."""
    reason: str = ""
    """Why not: the first error, its type and message ('' when captured)."""
    phase: str = ""
    """Where it failed: 'setup', or '<warmup|capture> <forward|backward|optimizer>', or 'replay'."""
    module: str | None = None
    """fqn of the innermost module running when it failed ('<root>' for the model itself), if known."""
    loss: float | None = None
    """The replayed step's loss (read after the replay)."""

    def summary(self) -> str:
        if self.captured:
            return f"captured (replayed loss {self.loss:.4f})"
        where = f" in {self.module}" if self.module else ""
        return f"not captured: {self.phase}{where}: {self.reason}"


class _ModuleTracker:
    """Forward pre/post hooks keeping the stack of modules being executed."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self._handles = []
        for fqn, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(fqn or "<root>")))
            self._handles.append(module.register_forward_hook(self._pop))

    def _push(self, fqn: str):
        def hook(_module, _args) -> None:
            self.stack.append(fqn)
        return hook

    def _pop(self, _module, _args, _out) -> None:
        if self.stack:
            self.stack.pop()

    def innermost(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _first_error(err: BaseException) -> BaseException:
    """The error that started it: a failed capture's cleanup (capture_end) raises a second one on top."""
    while err.__context__ is not None and err.__cause__ is None:
        err = err.__context__
    return err


def capture_check(model: nn.Module, batch, loss_fn: Callable[[nn.Module, object], torch.Tensor],
                  optimizer: torch.optim.Optimizer | None = None, warmup: int = 3) -> CaptureReport:
    """Try to capture one training step (forward, backward, and optimizer.step when given) with
    torch.cuda.graph after `warmup` eager steps on a side stream, then replay it once.
    loss_fn(model, batch) -> scalar loss. Never raises for a step that cannot be captured: the report
    says in which phase and module it broke and why. The model's parameters and gradients are changed
    by the steps: run it on a copy when that matters. A model holding a module that says it cannot be
    captured (capture_blockers) is refused at 'setup', before any compute."""
    blockers = capture_blockers(model, backward=True)
    if blockers:
        fqn, reason = blockers[0]
        return CaptureReport(False, f"refused: {reason}", "setup", fqn)
    if not torch.cuda.is_available():
        return CaptureReport(False, "needs CUDA: torch.cuda.is_available() is False, so there is no graph to capture",
                             "setup")
    tracker = _ModuleTracker(model)
    stage, phase = "warmup", "setup"

    def step() -> torch.Tensor:
        nonlocal phase
        phase = "forward"
        loss = loss_fn(model, batch)
        phase = "backward"
        loss.backward()
        if optimizer is not None:
            phase = "optimizer"
            optimizer.step()
        return loss

    def zero_grad() -> None:
        (optimizer or model).zero_grad(set_to_none=True)

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                zero_grad()
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        zero_grad()  # the captured backward then allocates the gradients from the graph's pool
        stage = "capture"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
        stage, phase = "replay", "replay"
        graph.replay()
        torch.cuda.synchronize()
        return CaptureReport(True, loss=float(loss))
    except Exception as err:  # any failure is the answer, not an error of the check
        first = _first_error(err)
        message = (str(first).strip().splitlines() or [""])[0]
        return CaptureReport(False, f"{type(first).__name__}: {message}",
                             phase if stage == phase else f"{stage} {phase}",
                             tracker.innermost() if phase == "forward" else None)
    finally:
        tracker.remove()
        try:
            torch.cuda.synchronize()
        except Exception:  # a capture that broke may leave an error behind; the report already says why
            pass


def te_graphed(module: nn.Module, sample_args: tuple[torch.Tensor, ...], recipe) -> nn.Module:
    """`module` (a region of TE modules, in training mode) with its forward and backward captured as
    CUDA graphs by TransformerEngine's make_graphed_callables under FP8 with `recipe` (a
    transformer_engine.common.recipe object); returned as the same module, whose calls now replay.
    The quantize kernels inside the graphs read the scales and write the amaxes; the delayed-scaling
    update of scales from amax histories runs outside them, at the exit of a te.autocast around the
    replay and at the end of its backward. So every replay runs under te.autocast(recipe) here: a bare
    replay would leave DelayedScaling's scales where the capture left them. TE is imported here,
    never at import time."""
    import transformer_engine.pytorch as te

    graphed = te.make_graphed_callables(module, sample_args, enabled=True, recipe=recipe)
    replay = graphed.forward

    def forward(*args, **kwargs):
        with te.autocast(enabled=True, recipe=recipe):
            return replay(*args, **kwargs)

    graphed.forward = forward
    return graphed
