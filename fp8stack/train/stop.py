"""SIGTERM and SIGINT end a run after its current step, with a final checkpoint (when it keeps checkpoints)
and one line, where Python's defaults end it mid-step: SIGINT with a traceback, SIGTERM (a scheduler's
preemption, torchrun's shutdown) with nothing saved. The same signal again ends it at once, as without this.
"""

import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):
    """The run stopped on a signal after a completed step; the message says what was saved and how to resume."""

    def __init__(self, message: str, signal_number: int, result):
        super().__init__(message)
        self.signal_number = signal_number
        """The signal that stopped the run."""
        self.result = result
        """The TrainResult of the steps taken."""


class StopSignals:
    """While inside: STOP_SIGNALS are recorded for the loop to act on (from the main thread; elsewhere Python
    delivers no signals and this changes nothing)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._record) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def agreed(self, device: "torch.device", world_size: int) -> int | None:
        """The signal any rank received, so that all ranks stop after the same step (a collective when several)."""
        if world_size == 1:
            return self.received
        import torch  # here: fp8stack ab's stop (a subclass) imports this module without torch
        import torch.distributed as dist

        flag = torch.tensor([self.received or 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    def _record(self, number: int, _frame) -> None:
        if self.received is None:
            self.received = number
            return
        self._restore()  # asked twice: the default behaviour, now
        signal.raise_signal(number)

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
