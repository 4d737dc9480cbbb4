"""CUDA-graph guards on CPU: the helpers' semantics, and capture_check's clear answer without CUDA.
Capturing real steps is in tests/gpu/test_runtime_gpu.py."""

import pytest
import torch
from torch import nn

from fp8stack.backends.grouped import Float8GroupedExperts, TorchBlockwiseKernels
from fp8stack.models import load_model_config
from fp8stack.models import Llama
from fp8stack.models.moe import MoE, MoEConfig
from fp8stack.runtime import (CaptureRefused, branchless_clamp, capture_blockers, capture_check, check_capturable,
                              is_graph_capturing, no_host_sync)
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


def _moe_with_torch_blockwise_experts() -> MoE:
    """A MoE layer whose experts run the blockwise recipe on torch's per-expert scaled_mm (not capturable)."""
    moe = MoE(256, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=128))
    moe.experts = Float8GroupedExperts.from_experts(moe.experts, {"w13": "blockwise", "w2": "blockwise"},
                                                    TorchBlockwiseKernels(), None)
    return moe


def test_the_guard_refuses_experts_that_say_they_read_the_host():
    moe = _moe_with_torch_blockwise_experts()
    [(fqn, reason)] = capture_blockers(moe)
    assert fqn == "experts"
    assert reason.startswith("grouped_fp8 blockwise experts on torch scaled_mm per expert: not capturable")
    with pytest.raises(CaptureRefused) as refused:
        check_capturable(moe)
    message = str(refused.value)
    assert message == f"cannot capture experts in a CUDA graph: {reason}" and "\n" not in message
    assert "build DeepGEMM" in message and "recipe rowwise" in message  # the fix
    assert capture_blockers(nn.Sequential(moe, _moe_with_torch_blockwise_experts()))[1][0] == "1.experts"


def test_capture_check_refuses_before_any_compute():
    moe = _moe_with_torch_blockwise_experts()  # its expert weights are not even initialised: nothing may run
    report = capture_check(moe, torch.randn(8, 256), lambda m, x: m(x).sum())
    assert not report.captured and report.phase == "setup" and report.module == "experts"
    assert report.reason.startswith("refused: grouped_fp8 blockwise experts on torch scaled_mm per expert")
    assert report.summary().startswith("not captured: setup in experts: refused: grouped_fp8 blockwise")


def test_the_guard_lets_bf16_experts_through():
    moe = MoE(256, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=128))
    assert capture_blockers(moe) == []
    check_capturable(moe)  # no error
