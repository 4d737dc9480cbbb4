"""How the tools start training processes on this node: the interpreter, under torchrun for several processes, and
the environment every child gets (what launch/env.sh exports for the shell launchers). Pure Python: no torch import."""

import os
import subprocess
import sys

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every child: on a shared multi-GPU host a program using it can take the host's GPUs
out of service for everyone."""


def on_gpu(gpu: str | int) -> dict[str, str]:
    """The environment that puts a child on one GPU of this process's: `gpu` counts among the GPUs an inherited
    CUDA_VISIBLE_DEVICES leaves visible (a scheduler or a lane gave this process those), as torch numbers them; a
    name that is not a number (a GPU UUID) is taken as it is. ValueError for a number past the visible GPUs."""
    visible = [name.strip() for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    if not visible or not str(gpu).isdigit():
        return {"CUDA_VISIBLE_DEVICES": str(gpu)}
    if int(gpu) >= len(visible):
        raise ValueError(f"GPU {gpu}: CUDA_VISIBLE_DEVICES={','.join(visible)} leaves {len(visible)} GPU(s) visible, "
                         f"numbered from 0: name GPUs below {len(visible)}")
    return {"CUDA_VISIBLE_DEVICES": visible[int(gpu)]}


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
