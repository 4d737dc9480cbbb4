"""torchao backend on a Hopper GPU: every torchao recipe x format, forward and both gradients of a
converted BF16 linear against the BF16 nn.Linear it came from."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from fp8stack.backends import get_backend
from fp8stack.bench.backends import linear_plan

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("requires_cuda")]

REL_ERR_BOUNDS = {"out": 0.08, "grad_input": 0.12, "grad_weight": 0.12}
"""||fp8 - bf16|| / ||bf16|| per tensor: E4M3 has 3 mantissa bits (~6% relative rounding per element,
averaging down over K); E5M2 gradients (hybrid) have 2 and sit near the top of the gradient bounds."""


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("n,k", [(1024, 512), (4096, 2048)])
def test_converted_linear_matches_bf16(recipe, fmt, n, k):
    torch.manual_seed(0)
    plan, decisions = linear_plan(n, k, recipe, "torchao")
    plan = dataclasses.replace(plan, fp8_format=fmt)
    reference = nn.Sequential()
    reference.add_module("layers", nn.ModuleList([nn.Module()]))
    reference.layers[0].linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    model, record = get_backend("torchao").convert(copy.deepcopy(reference), decisions, plan)
    fp8_linear = model.layers[0].linear
    assert type(fp8_linear).__name__ == "Float8Linear" and record.converted == {"layers.0.linear": "Float8Linear"}
    assert torch.equal(fp8_linear.weight, reference.layers[0].linear.weight)

    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(2048, n, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, linear in (("ref", reference.layers[0].linear), ("fp8", fp8_linear)):
        inp = x.clone().requires_grad_()
        out = linear(inp)
        out.backward(grad)
        results[name] = {"out": out, "grad_input": inp.grad, "grad_weight": linear.weight.grad}
    for tensor, bound in REL_ERR_BOUNDS.items():
        error = rel_err(results["fp8"][tensor], results["ref"][tensor])
        if recipe == "rowwise_gw_hp" and tensor == "grad_weight":  # this GEMM stays BF16 by design
            assert error < 1e-3, (tensor, error)
        else:
            assert 0 < error < bound, (tensor, error)  # > 0: FP8 really ran
