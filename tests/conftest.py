"""Fixtures shared by test modules."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs pytest-xdist workers, one per core: each process, the worker and every rank or arm it starts,
    # computes on one thread. Two workers with torch's default of one thread per core (and their children with as
    # many again) oversubscribe the cores and ran slower than one worker (tests/test_ab.py, test_train.py,
    # test_master_weights.py, test_launch.py on 2 cores: 251 s serial, 226 s on 2 workers, 177 s one thread each).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fp8stack.train.loop import cpu_fp8_gemms
from megatron_cpu import megatron_on_cpu


@pytest.fixture(autouse=True, scope="session")
def cpu_fp8_gemms_as_training_runs_them():
    """FP8 GEMMs that tests call directly run as a CPU training run's do (torch's emulation, not oneDNN's reference
    loop: see fp8stack.train.loop.cpu_fp8_gemms)."""
    with cpu_fp8_gemms(torch.device("cpu")):
        yield


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A 1-rank gloo group's mesh: enough for fully_shard and DTensor, no second process. Reuses a group an earlier
    test module left behind."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/init", rank=0,
                                world_size=1)
    assert dist.get_world_size() == 1
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def model_parallel(tmp_path_factory):
    """A one-rank gloo group and megatron's model-parallel state, as a megatron GPTModel needs them."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


@pytest.fixture
def cpu_megatron(monkeypatch, model_parallel):
    """Two test-only shims that let megatron's GPTModel run on CPU, nothing else of megatron replaced:
    GlobalMemoryBuffer.get_tensor allocates on CPU (megatron asks torch.cuda.current_device()), and the
    CUDA RNG tracker's fork is a no-op (there is no CUDA RNG state to fork): megatron_cpu.megatron_on_cpu."""
    megatron_on_cpu(monkeypatch)


LONGEST_FIRST = ("test_multigpu_cpu.py", "test_ab.py", "test_training_defaults.py", "test_peers_bench.py",
                 "test_training_defaults_wide.py", "test_grouped_fp8.py", "test_launch.py", "test_train.py",
                 "test_train_data_parallel.py", "test_train_megatron.py", "test_config.py", "test_ab_resume.py")
"""The test files that take half a minute or more of `make test` (measured on 2 cores), longest first. Under
pytest-xdist (`--dist loadfile --no-loadscope-reorder`) the workers take files in collection order: these start first,
so that neither worker starts a long file while the other runs out of work (xdist's own order, most tests first, left
the one-test width-2048 file to the last minute)."""


def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: other files keep pytest's order
