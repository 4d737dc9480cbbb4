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


def test_te_weights_report_their_fused_gradients_so_every_bucket_is_averaged_during_the_backward(one_rank_mesh):
    """TE's fused wgrad GEMM writes main_grad outside autograd; with grad_added_to_main_grad set (Megatron's protocol)
    it hands autograd a placeholder, whose hook marks the weight ready: every bucket's all-reduce starts before the
    backward ends, and no placeholder is left as a .grad."""
    torch.manual_seed(0)
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="delayed", backend="te", small_gemm_filter="off",
                                                            fuse_norm=True, fuse_mlp=True))
    model = assemble(Llama(load_model_config("tiny")).cuda(), plan,
                     backend_options={"te": {"fuse_wgrad_accumulation": True}})
    masters = MasterWeights(model, data_parallel=one_rank_mesh, bucket_bytes=2**20)
    assert len(masters.buffers) > 2
    events, all_reduce, finish = [], dist.all_reduce, masters._average.finish
    masters._average.finish = lambda: (events.append("backward end"), finish())[1]
    dist.all_reduce = lambda *args, **kwargs: (events.append("start"), all_reduce(*args, **kwargs))[1]
    try:
        batch = torch.randint(0, 256, (2, SEQ + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
    finally:
        dist.all_reduce = all_reduce
    assert events == ["start"] * len(masters.buffers) + ["backward end"]
    assert all(p.grad is None for p in masters.params)
    assert all(p.main_grad.any() for p in masters.params if p.ndim == 2), "every weight got its gradient"


@pytest.mark.parametrize("local_amax", [False, True])
def test_local_amax_turns_off_the_delayed_recipes_amax_reduction(local_amax):
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="delayed", backend="te", small_gemm_filter="off"))
    model = assemble(Llama(load_model_config("tiny")).cuda(), plan, backend_options={"te": {"local_amax": local_amax}})
    recipes = [m.autocast_recipe for m in model.modules() if getattr(m, "autocast_recipe", None) is not None]
    assert recipes and {recipe.reduce_amax for recipe in recipes} == {not local_amax}
