"""Shared by the GPU tests: `requires_cuda` skips a test without a CUDA device, saying so (module-level skips:
gpu_skips.py).

Use it as a fixture argument (it returns the device) or for a whole module with
`pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("requires_cuda")]`.
"""

import pytest
import torch
from gpu_skips import NO_CUDA


@pytest.fixture
def requires_cuda() -> torch.device:
    """The current CUDA device; skips the test when torch sees none."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device("cuda", torch.cuda.current_device())
