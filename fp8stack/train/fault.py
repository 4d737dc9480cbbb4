"""Fault injection for restart tests: FP8STACK_KILL_AT=<rank>:<step> makes that rank SIGKILL itself
as step <step> (0-based) begins, the way the OOM killer or a lost node ends a process: no Python
cleanup, no checkpoint, no goodbye to the other ranks. Unset, it does nothing.
"""

import os
import signal

KILL_AT_ENV = "FP8STACK_KILL_AT"


def kill_point() -> tuple[int, int] | None:
    """(rank, step) from FP8STACK_KILL_AT, or None when unset."""
    value = os.environ.get(KILL_AT_ENV)
    if not value:
        return None
    try:
        rank, step = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{KILL_AT_ENV}={value!r}: write <rank>:<step>, e.g. 1:12, or unset it") from None
    return rank, step


def kill_if_due(rank: int, step: int) -> None:
    """SIGKILL this process if FP8STACK_KILL_AT names this rank and step."""
    if kill_point() == (rank, step):
        print(f"{KILL_AT_ENV}: rank {rank} kills itself (SIGKILL) at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
