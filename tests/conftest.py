"""Fixtures shared by test modules."""

import pytest
import torch


@pytest.fixture(scope="session")
def model_parallel(tmp_path_factory):
    """A one-rank gloo group and megatron's model-parallel state, as a megatron GPTModel needs them."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
