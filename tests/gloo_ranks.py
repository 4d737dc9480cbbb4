"""Run a computation on CPU processes over gloo and hand back rank 0's result: what the multi-rank tests share (each
start of processes costs seconds, so a test module runs all its multi-rank cases in one)."""

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8stack.train.loop import cpu_fp8_gemms

PRELOADED = ["torch", "torch.distributed", "fp8stack.train.loop"]
"""What the forkserver imports, once per pytest process: each rank it forks starts with them imported, where a spawned
rank spent about 4 s of CPU importing them."""


def spawn(function: Callable, args: tuple, nprocs: int) -> None:
    """function(rank, *args) on `nprocs` processes, as torch.multiprocessing.spawn runs it, but forked from a
    forkserver holding PRELOADED: each process is as fresh as a spawned one (the forkserver only imported modules: it
    holds no test's state and no process group), without the imports."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the forkserver starts: its forks share the cores
    mp.set_forkserver_preload(PRELOADED)
    mp.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def on_gloo_ranks(compute: Callable[[int, int], object], world: int, folder: Path) -> object:
    """compute(rank, world) on `world` processes (spawn) in one gloo group (a module-level function, so that the
    processes can import it); rank 0's return value."""
    spawn(_rank, (compute, world, str(folder)), world)
    return torch.load(folder / "out.pt", weights_only=False)


def _rank(rank: int, compute: Callable[[int, int], object], world: int, folder: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        with cpu_fp8_gemms(torch.device("cpu")):  # a spawned process does not inherit conftest's setting
            result = compute(rank, world)
        if rank == 0:
            torch.save(result, f"{folder}/out.pt")
        dist.barrier()  # no rank tears the group down while another still has a collective in flight
    finally:
        dist.destroy_process_group()
