"""Run a computation on CPU processes over gloo and hand back rank 0's result: what the multi-rank tests share (each
spawn costs seconds of imports, so a test module runs all its multi-rank cases in one)."""

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8stack.train.loop import cpu_fp8_gemms


def on_gloo_ranks(compute: Callable[[int, int], object], world: int, folder: Path) -> object:
    """compute(rank, world) on `world` spawned processes in one gloo group (a module-level function, so that the
    processes can import it); rank 0's return value."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the processes start: their OpenMP pools share the cores
    mp.spawn(_rank, args=(compute, world, str(folder)), nprocs=world, join=True)
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
