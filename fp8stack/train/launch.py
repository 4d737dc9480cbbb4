"""How the tools start training processes on this node: the interpreter, under torchrun for several processes, and
the environment every child gets (what launch/env.sh exports for the shell launchers). Pure Python: no torch import."""

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
