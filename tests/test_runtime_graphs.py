"""CUDA-graph guards on CPU: the helpers' semantics, and capture_check's clear answer without CUDA.
Capturing real steps is in tests/gpu/test_runtime_gpu.py."""

import pytest
import torch
from torch import nn

from fp8stack.models import load_model_config
from fp8stack.models import Llama
from fp8stack.runtime import branchless_clamp, capture_check, is_graph_capturing, no_host_sync
from fp8stack.runtime.graphs import _ModuleTracker


def test_not_capturing_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU answer")
    assert is_graph_capturing() is False


def test_branchless_clamp_takes_numbers_and_tensors_and_keeps_nan():
    x = torch.tensor([-3.0, -0.5, 0.5, 3.0, float("nan")])
    assert torch.equal(branchless_clamp(x, -1, 1)[:4], torch.tensor([-1.0, -0.5, 0.5, 1.0]))
    lo, hi = torch.tensor(-0.25), torch.tensor(2.0)
    out = branchless_clamp(x, lo, hi)
    assert torch.equal(out[:4], torch.tensor([-0.25, -0.25, 0.5, 2.0])) and out[4].isnan()
    per_element = branchless_clamp(x[:4], torch.zeros(4), torch.full((4,), 0.6))
    assert torch.equal(per_element, torch.tensor([0.0, 0.0, 0.5, 0.6]))
    assert branchless_clamp(x, -1, 1).shape == x.shape


def test_no_host_sync_is_a_no_op_without_cuda():
    with no_host_sync():
        assert float(torch.ones(1).sum()) == 1.0  # nothing to sync with on CPU


def test_capture_check_says_it_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU answer")
    model = Llama(load_model_config("tiny"))
    tokens = torch.randint(0, 256, (1, 17))
    report = capture_check(model, tokens, lambda m, b: Llama.loss(m(b[:, :-1]), b[:, 1:]))
    assert not report.captured and report.phase == "setup" and "needs CUDA" in report.reason
    assert report.summary().startswith("not captured: setup: needs CUDA")


class Syncs(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:  # a host read: not capturable
            raise RuntimeError("operation not permitted when stream is capturing")
        return x


def test_the_tracker_names_the_innermost_module_that_raised():
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.ReLU(), Syncs()))
    tracker = _ModuleTracker(model)
    model(-torch.ones(1, 4))  # passes
    assert tracker.innermost() is None
    with pytest.raises(RuntimeError):
        model(torch.ones(1, 4) * 100)
    assert tracker.innermost() == "1.1"
    tracker.remove()
