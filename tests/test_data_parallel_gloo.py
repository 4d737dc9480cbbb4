"""Replicas on two CPU ranks over gloo (fp8stack.precision's DDP): MasterWeights(model, data_parallel=...) with BF16
parameters and DataParallelGradients with FP32 ones train as one process does on the same global batch.

Both sides split a step's 4 sequences into micro-batches of one; one process accumulates 4 of them, each rank 2 (the
first under no_sync) and then averages. Each micro-batch's loss is divided by the micro-batches it adds up with (4, or
2 and then the average's /2): powers of two, so the BF16 gradients round alike and only the FP32 summation order
differs. Observed: the losses agree to 1e-7; LOSS_RTOL leaves room for the CPU's FP8 emulation (tensorwise).
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gloo_ranks import on_gloo_ranks

from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.models import Llama, load_model_config
from fp8stack.precision import DataParallelGradients, MasterWeights

pytestmark = pytest.mark.slow

STEPS = 3
"""Optimizer steps on one fixed global batch."""
GLOBAL_BATCH, SEQ = 4, 32
"""Sequences per step over all ranks, tokens per sequence."""
LOSS_RTOL = 1e-4
"""Agreement of the 2-rank losses with the 1-process ones (see the module docstring)."""
RECIPES = ("bf16", "tensorwise")


def losses(rank: int, world: int, recipe: str, param_dtype: str) -> tuple[list[float], dict]:
    """Losses of STEPS AdamW steps of the tiny Llama on this rank's share of the global batch, and what each rank saw
    of its gradients (to check no_sync held the average back)."""
    torch.manual_seed(rank)  # replicas built differently: the wrapper must start them from rank 0's values
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe=recipe, small_gemm_filter="off"))
    model = assemble(Llama(load_model_config("tiny")), plan)
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    if param_dtype == "bf16":
        masters = MasterWeights(model, data_parallel=mesh)
        optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3))
        sync, grads = masters, lambda: [p.main_grad for p in masters.params]
    else:
        sync = DataParallelGradients(model, mesh) if mesh else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    micro_batches = tokens.chunk(world)[rank].chunk(GLOBAL_BATCH // world)
    seen, out = {}, []
    for _ in range(STEPS):
        step_loss = 0.0
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with sync.no_sync() if sync and not last else nullcontext():
                loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:]) / len(micro_batches)
                loss.backward()
            step_loss += loss.item()
            if world > 1 and not seen:
                seen["after_first_backward"] = _agree(grads())
        if world > 1 and "after_last_backward" not in seen:
            seen["after_last_backward"] = _agree(grads())
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            mean = torch.tensor(step_loss)
            dist.all_reduce(mean)
            step_loss = mean.item() / world
        out.append(step_loss)
    return out, seen


def _agree(grads: list[torch.Tensor]) -> bool:
    """Every rank holds the same gradients."""
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
    other = flat.clone()
    dist.broadcast(other, src=0)
    agree = torch.tensor(int(torch.equal(flat, other)))
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree)


CASES = [(recipe, param_dtype) for recipe in RECIPES for param_dtype in ("bf16", "fp32")]


def _two_rank_results(rank: int, world: int) -> dict:
    return {case: losses(rank, world, *case) for case in CASES}

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Every case in one 2-process run: each process start costs seconds of imports."""
    return on_gloo_ranks(_two_rank_results, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.parametrize("recipe,param_dtype", CASES)
def test_replicas_train_as_one_process(two_ranks, recipe, param_dtype):
    two, seen = two_ranks[(recipe, param_dtype)]
    torch.manual_seed(0)
    one, _ = losses(0, 1, recipe, param_dtype)
    assert two[-1] < two[0], f"the loss should fall on a repeated batch: {two}"
    assert two == pytest.approx(one, rel=LOSS_RTOL)
    assert seen == {"after_first_backward": False, "after_last_backward": True}, \
        "no_sync held the average back, and the step's last backward averaged the gradients"


def test_replicas_refuse_sharded_or_low_precision_models():
    model = Llama(load_model_config("tiny")).to(torch.bfloat16)
    with pytest.raises(ValueError, match="use MasterWeights"):
        DataParallelGradients(model, dist.group.WORLD if dist.is_initialized() else None)
