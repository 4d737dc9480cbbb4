"""DDP on one GPU (NCCL over a 1-rank group): MasterWeights(model, data_parallel=mesh) with TE's fused weight-gradient
accumulation writing the flat FP32 main_grad buffers that the end of each step's last backward all-reduces. Over one
rank the average divides by 1 and sums one value, so the run must train exactly as MasterWeights without
data_parallel does; the all-reduces are counted, one round per step. Run with `pytest -m gpu
tests/gpu/test_data_parallel_gpu.py`."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.models import Llama, load_model_config
from fp8stack.precision import MasterWeights

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

STEPS, MICRO_BATCHES, SEQ = 4, 2, 128


@pytest.fixture
def one_rank_mesh():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    assert dist.get_world_size() == 1
    yield init_device_mesh("cuda", (1,))
    if owned:
        dist.destroy_process_group()


def train(mesh, fp8_weights: bool) -> tuple[list[float], int]:
    """Losses of STEPS AdamW steps of the tiny Llama on TE delayed scaling with fused norms, MLPs and weight-gradient
    accumulation, BF16 (or FP8) parameters; and the all-reduces the masters issued."""
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="delayed", backend="te", small_gemm_filter="off",
                                                            fuse_norm=True, fuse_mlp=True))
    model = assemble(Llama(load_model_config("tiny")).cuda(), plan,
                     backend_options={"te": {"fuse_wgrad_accumulation": True, "fp8_weights": fp8_weights}})
    masters = MasterWeights(model, data_parallel=mesh)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3, fused=True))
    tokens = torch.randint(0, 256, (MICRO_BATCHES, 2, SEQ + 1), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    reduced, all_reduce = [0], dist.all_reduce

    def counted(*args, **kwargs):
        reduced[0] += 1
        return all_reduce(*args, **kwargs)

    losses = []
    dist.all_reduce = counted
    try:
        for _ in range(STEPS):
            total = 0.0
            for i, batch in enumerate(tokens):
                with masters.no_sync() if i < MICRO_BATCHES - 1 else nullcontext():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:]) / MICRO_BATCHES
                    loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
    finally:
        dist.all_reduce = all_reduce
    return losses, reduced[0]


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16-params", "fp8-params"])
def test_ddp_over_one_rank_trains_exactly_as_one_process(one_rank_mesh, fp8_weights):
    alone, none_reduced = train(None, fp8_weights)
    replicated, reduced = train(one_rank_mesh, fp8_weights)
    assert none_reduced == 0
    assert reduced > 0 and reduced % STEPS == 0, f"{reduced} all-reduces over {STEPS} steps: one round per step"
    assert alone[-1] < alone[0], alone
    assert replicated == alone, (replicated, alone)
