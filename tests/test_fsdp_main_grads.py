"""fp8stack.backends.fsdp_main_grads on two CPU ranks over gloo: weights whose module adds its weight gradient into
main_grad itself (as TE's fuse_wgrad_accumulation does; here a reference autograd function, TE needs a GPU:
tests/gpu/test_fsdp_te_gpu.py runs TE's) reach the same sharded gradients under FSDP2 as autograd's, bit for bit,
whether FSDP2 reduce-scatters once per step or after every micro-batch, over two steps (the accumulators start anew
after each reduction); a writer outside every FSDP2 unit is refused."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gloo_ranks import on_gloo_ranks

from fp8stack.backends import fsdp_main_grads

pytestmark = pytest.mark.slow


class _AddIntoMainGrad(torch.autograd.Function):
    """x @ weight.T whose backward adds the weight gradient into weight.main_grad and gives autograd none."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.weight.main_grad.add_(grad.flatten(0, -2).t() @ x.flatten(0, -2))
        return grad @ weight, None


class Block(nn.Module):
    def __init__(self, writes_main_grad: bool):
        super().__init__()
        self.proj = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 16)  # autograd's gradients in the same FSDP2 unit
        self.writes_main_grad = writes_main_grad

    def forward(self, x):
        y = _AddIntoMainGrad.apply(x, self.proj.weight) if self.writes_main_grad else self.proj(x)
        return x + self.out(torch.relu(y))


def _sharded_grads(rank: int, world: int, writes_main_grad: bool, reduce_each_micro_batch: bool) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(writes_main_grad), Block(writes_main_grad), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:2]:
        block.compile(backend="eager")  # as assemble compiles blocks: the hooks run inside the compiled call
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    if writes_main_grad:
        assert fsdp_main_grads.install(model, [(block.proj, "weight") for block in model[:2]]) == 2
    batches = torch.randn(2, 2, 4, 8, 16, generator=torch.Generator().manual_seed(rank))  # steps, micro-batches
    steps = []
    for step_batches in batches:
        for micro, batch in enumerate(step_batches):
            model.set_requires_gradient_sync(reduce_each_micro_batch or micro == len(step_batches) - 1)
            model(batch.bfloat16()).float().pow(2).mean().backward()
        steps.append({name: p.grad.to_local().clone() for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return steps


def _refusal(world: int) -> str:
    """install's error for a writer that no FSDP2 unit holds."""
    model = nn.Sequential(Block(True), nn.Linear(16, 4))
    fully_shard(model[1], mesh=init_device_mesh("cpu", (world,)))
    try:
        fsdp_main_grads.install(model, [(model[0].proj, "weight")])
    except ValueError as refused:
        return str(refused)
    return "not refused"


def _all_cases(rank: int, world: int) -> dict:
    cases = {(writes, each): _sharded_grads(rank, world, writes, each) for writes in (False, True)
             for each in (False, True)}
    return {**cases, "refusal": _refusal(world)}


def test_weights_writing_main_grad_reach_autograds_sharded_gradients_bit_for_bit(tmp_path):
    cases = on_gloo_ranks(_all_cases, 2, tmp_path)
    for each in (False, True):
        autograd, written = cases[(False, each)], cases[(True, each)]
        for step, (expected, got) in enumerate(zip(autograd, written, strict=True)):
            assert expected.keys() == got.keys()
            for name in expected:
                assert torch.equal(got[name], expected[name]), (each, step, name)
    assert not torch.equal(cases[(True, False)][0]["0.proj.weight"], cases[(True, False)][1]["0.proj.weight"])
    assert "in no fully_shard unit of this model: fully_shard the module holding them" in cases["refusal"]
