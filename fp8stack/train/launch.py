"""How the tools start training processes on this node: the interpreter, under torchrun for several processes, and
the environment every child gets (what launch/env.sh exports for the shell launchers). Pure Python: no torch import."""

import subprocess
import sys

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every child: on a shared multi-GPU host a program using it can take the host's GPUs
out of service for everyone."""


def launcher(nproc: int) -> list[str]:
    """The start of a child's command line: this interpreter, and for several processes torchrun on this node
    (--standalone: its own rendezvous on a free port, so children one after another never share one). A script path or
    `-m module` and its arguments follow."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *torchrun]


TERMINATE_GRACE_S = 60.0
"""Seconds a child stopped by stop() has between SIGTERM and SIGKILL: torchrun passes SIGTERM on to its workers and
kills them after 30 s."""


def stop(child: subprocess.Popen) -> None:
    """End a child that overran its time: SIGTERM first, SIGKILL after TERMINATE_GRACE_S. torchrun's workers run in
    sessions of their own, so a SIGKILL of torchrun alone would leave them holding the GPUs."""
    child.terminate()
    try:
        child.communicate(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
