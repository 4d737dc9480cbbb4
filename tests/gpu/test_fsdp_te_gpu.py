"""The TE fast path under fully_shard (FSDP2) on one GPU: an NCCL group of one rank and a 1-rank mesh, the tiny Llama
built on the GPU, TE delayed scaling with fused norms and MLPs.

(a) BF16 compute: FSDP2 keeps FP32 sharded parameters (their own masters) and all-gathers BF16 copies; the losses
    match the unwrapped model trained with MasterWeights (BF16 parameters, FP32 masters).
(b) FP8 parameters (TE fp8_weights) with ShardedMasterWeights: the weights are DTensors whose local shards are TE
    QuantizedTensors; FSDP2 all-gathers their FP8 bytes (1 byte per element, the scale travels as metadata); no BF16
    or FP32 copy of an FP8 weight stays resident after forward and backward; the losses match the unwrapped
    fp8_weights run with MasterWeights.
(c) What TE cannot do under fully_shard is refused (fused wgrad accumulation) or switched off with a note (the FP8
    weight cache), and the pre-shard weights are freed.
(d) With the gathered weights kept after forward (reshard_after_forward=False), the FP8 weight cache stays on: TE
    keeps its FP8 weight workspace, keyed to the sharded weights, and trains bit for bit as without it (tensorwise)
    and as the unwrapped cached fast path (delayed). Fused wgrad accumulation runs there too, into FP32 buffers FSDP2
    reduce-scatters (fp8stack.backends.fsdp_main_grads), and trains as the unwrapped fused fast path.

Both runs of (a) and (b) keep TE's fused wgrad accumulation off, so that both add BF16 weight gradients in FP32. Run
with `pytest -m gpu tests/gpu/test_fsdp_te_gpu.py`."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fp8stack import OrderingError, PolicyConfig, assemble, load_description, make_plan
from fp8stack.assembly import apply_fp8, apply_fsdp, describe_assembly
from fp8stack.models import Llama, load_model_config
from fp8stack.precision import MasterWeights, ShardedMasterWeights
from fp8stack.train.comm_stats import CollectiveCounter

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch import QuantizedTensor  # noqa: E402
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

STEPS = 20
"""Optimizer steps per run, on one fixed batch."""
LOSS_RTOL = 5e-3
"""FSDP2 vs unwrapped, per step. Both compute with the same BF16 (or FP8) copies of FP32 masters that AdamW steps in
FP32, with the same delayed scales. What differs: FSDP2 takes the embedding's dense BF16 gradient where MasterWeights
adds its rows token by token in FP32 (a 2^-9 relative rounding of that gradient), which AdamW carries into the
weights and the scales follow. On CPU the same difference gives 5e-5 after 4 steps, growing about 3x a step while
the loss falls fastest (tests/test_sharded_masters.py); this bound leaves room for 20 steps. The failure message
prints the observed differences."""
POLICY = PolicyConfig(recipe="delayed", small_gemm_filter="off", fuse_norm=True, fuse_mlp=True)
"""Every linear on TE delayed scaling, norms folded into TE LayerNormLinear / LayerNormMLP (the fast path)."""


@pytest.fixture(scope="module")
def mesh():
    """This process as a 1-rank NCCL group, and its mesh."""
    owned = not dist.is_initialized()
    if owned:
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    assert dist.get_world_size() == 1 and dist.get_backend() == "nccl"
    yield init_device_mesh("cuda", (1,))
    if owned:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(0)).cuda()


def assembled(mesh=None, *, fp8_weights: bool = False, **te_options) -> nn.Module:
    """The tiny Llama built in FP32 on the GPU, assembled on the fast path, fully_shard'ed over `mesh` if given."""
    FP8GlobalStateManager.reset()
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    options = {"fp8_weights": fp8_weights, "fuse_wgrad_accumulation": False, **te_options}
    return assemble(model, make_plan(load_description("tiny"), POLICY), fsdp_mesh=mesh, backend_options={"te": options})


def train(model: nn.Module, masters, after_backward=None) -> list[float]:
    """Losses of STEPS AdamW steps on one batch; after_backward(step, optimizer) runs before each optimizer step."""
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3))
    batch, losses = tokens(), []
    for step in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        if after_backward is not None:
            after_backward(step, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def unwrapped_losses(**te_options) -> list[float]:
    """The losses of the unwrapped fast path with MasterWeights (BF16 parameters, FP32 masters); nothing of it stays
    alive afterwards."""
    model = assembled(**te_options)
    losses = train(model, MasterWeights(model))
    del model
    gc.collect()
    return losses


def assert_losses_match(sharded: list[float], unwrapped: list[float]) -> None:
    differences = [abs(a - b) / b for a, b in zip(sharded, unwrapped, strict=True)]
    assert sharded[-1] < sharded[0], sharded
    assert max(differences) <= LOSS_RTOL, f"relative differences per step {differences}"


def fp8_weights_of(model: nn.Module) -> dict[str, DTensor]:
    return {name: p for name, p in model.named_parameters()
            if isinstance(p, DTensor) and isinstance(p.to_local(), QuantizedTensor)}


def test_bf16_compute_under_fully_shard_trains_as_the_unwrapped_fast_path(mesh):
    unwrapped = unwrapped_losses()
    model = assembled(mesh)
    assert isinstance(model, FSDPModule)
    assert {type(p.to_local()) for p in model.parameters()} == {torch.Tensor}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_losses_match(train(model, ShardedMasterWeights(model)), unwrapped)


def test_fp8_weights_under_fully_shard_gather_fp8_keep_no_high_precision_copy_and_train_as_unwrapped(mesh):
    initial = {name: p.detach().clone() for name, p in assembled().named_parameters()}  # fused layout, FP32
    unwrapped = unwrapped_losses(fp8_weights=True)
    # What earlier tests and the unwrapped run left alive cannot be a copy of the sharded model's weights. Known by
    # identity, held weakly: a copy made later at a freed tensor's address is still counted.
    gc.collect()
    earlier = {id(t): weakref.ref(t) for t in _live_cuda_tensors()}
    model = assembled(mesh, fp8_weights=True)
    masters = ShardedMasterWeights(model)
    fp8 = fp8_weights_of(model)
    te_weights = {name for name, p in model.named_parameters() if _in_fp8_te_module(model, name)}
    assert fp8 and set(fp8) == te_weights, sorted(te_weights ^ set(fp8))
    held = dict(masters.module.named_parameters())
    for name, weight in fp8.items():
        assert isinstance(held[name], DTensor) and held[name].placements == weight.placements
        assert torch.equal(held[name].full_tensor(), initial[name]), f"{name}: the master starts from the FP32 weight"
        assert held[name].grad is weight.grad and weight.grad.dtype == torch.float32
    del initial  # FP32 tensors shaped as the FP8 weights, which the residency check would count
    with pytest.raises(RuntimeError, match="is held in FP8 only and the FP32 values its master starts from are gone"):
        ShardedMasterWeights(model)

    memory, resident = {}, {}

    def check_residency(step: int, optimizer: torch.optim.Optimizer) -> None:
        if step in (2, 3):
            torch.cuda.synchronize()
            memory[step] = torch.cuda.memory_allocated()
            resident[step] = high_precision_copies(model, masters, optimizer, fp8, earlier)

    losses = train(model, masters, check_residency)
    assert resident == {2: [], 3: []}, resident
    assert memory[3] - memory[2] <= 64 << 10, f"memory after backward grew from {memory[2]} to {memory[3]} bytes"
    print(f"peak memory under FSDP2 with FP8 weights: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    assert_losses_match(losses, unwrapped)
    for name, weight in fp8.items():  # the last step's masters were quantized into the weights
        master = held[name].to_local()
        torch.testing.assert_close(weight.to_local().dequantize(dtype=torch.float32), master, rtol=0.07,
                                   atol=1e-3 * master.abs().max().item())
    assert_fp8_all_gathers(model, fp8)  # last: its passes move the delayed scales


def _in_fp8_te_module(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is a 2-D weight of a TE module running FP8."""
    owner, _, _ = name.rpartition(".")
    module = model.get_submodule(owner)
    return (isinstance(module, TransformerEngineBaseModule) and module.autocast_recipe is not None
            and model.get_parameter(name).ndim == 2)


def assert_fp8_all_gathers(model: nn.Module, fp8: dict[str, DTensor]) -> None:
    """What FSDP2 hands to the all-gather for each FP8 weight (its all_gather_inputs, from TE's fsdp_pre_all_gather)
    is one uint8 tensor of one byte per element of the shard: the scale travels as metadata. Recent torch skips the
    collective at world size 1 and copies those inputs instead; where the profiler sees all-gathers, their bytes are
    those inputs' bytes."""
    names = {id(p): name for name, p in model.named_parameters()}
    handed = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            inputs = fsdp_param.all_gather_inputs
            handed[names[id(fsdp_param.sharded_param)]] = [(t.dtype, t.numel() * t.element_size()) for t in inputs]
    for name, weight in fp8.items():
        assert handed[name] == [(torch.uint8, weight.to_local().numel())], (name, handed[name])
    others = [name for name in handed if name not in fp8]
    assert all(dtype == torch.bfloat16 for name in others for dtype, _ in handed[name]), "the rest gathers BF16"
    with CollectiveCounter(steps=1) as counter:
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(tokens()[:, :-1]).float().sum().backward()
            counter.step_done()
    model.zero_grad(set_to_none=False)
    gathered = counter.result.bytes.get("all_gather", 0.0)
    if gathered:  # forward, and backward again for the blocks resharded after forward
        once = sum(size for pieces in handed.values() for _, size in pieces)
        assert once <= gathered <= 2 * once, (gathered, once)


def high_precision_copies(model: nn.Module, masters, optimizer: torch.optim.Optimizer,
                          fp8: dict[str, DTensor], earlier: dict[int, weakref.ref]) -> list[str]:
    """Live BF16 or FP32 CUDA tensors shaped as an FP8 weight that are not a parameter's shard, a gradient, a master
    or optimizer state, nor alive before the sharded model was built (`earlier`): a high-precision copy of an FP8
    weight kept past backward (FSDP2 frees its unsharded parameters after backward, so those have no storage left)."""
    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    known = set()
    for tensor in [*model.parameters(), *masters.parameters(), *states,
                   *(p.grad for p in [*model.parameters(), *masters.parameters()])]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local is not None and not isinstance(local, QuantizedTensor):
            known.add(local.data_ptr())
    shapes = {tuple(p.shape) for p in fp8.values()}
    return [f"{t.dtype} {tuple(t.shape)}" for t in _live_cuda_tensors()
            if t.dtype in (torch.bfloat16, torch.float32) and tuple(t.shape) in shapes and t.data_ptr() not in known
            and not (id(t) in earlier and earlier[id(t)]() is t)]


def _live_cuda_tensors() -> list[torch.Tensor]:
    """Plain CUDA tensors with storage that the garbage collector tracks; compiled graphs of earlier tests leave fake
    tensors, with symbolic shapes, which are skipped."""
    return [obj for obj in gc.get_objects()
            if isinstance(obj, torch.Tensor) and not isinstance(obj, (DTensor, QuantizedTensor, FakeTensor))
            and obj.is_cuda and all(isinstance(size, int) for size in obj.shape)
            and obj.untyped_storage().size() > 0]


def test_fused_wgrad_accumulation_under_fully_shard_is_refused_naming_te(mesh):
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), POLICY)
    te_reason = "outside autograd, and fully_shard \\(FSDP2\\) reduce-scatters autograd's gradients"
    with pytest.raises(OrderingError, match=te_reason):
        assemble(model, plan, fsdp_mesh=mesh, backend_options={"te": {"fuse_wgrad_accumulation": True}})
    converted = apply_fp8(model, plan, backend_options={"te": {"fuse_wgrad_accumulation": True}})
    with pytest.raises(OrderingError, match=te_reason):
        apply_fsdp(converted, mesh)
    assert not any(isinstance(m, FSDPModule) for m in converted.modules()), "refused before any module was sharded"


def test_a_te_head_without_fp8_gathered_in_fp32_is_refused_before_sharding(mesh):
    """TE under fully_shard re-casts a weight for the backward with the module's FP8 quantizer, which the head on TE
    (no FP8) lacks: gathered in FP32 for BF16 compute, its dgrad GEMM would fail mid-step ("columnwise representation
    unavailable"), so fully_shard is refused before any module is sharded; gathered in BF16 it trains."""
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), POLICY)
    assert any(d.component.kind == "head" and d.backend == "te" for d in plan.decisions), "the head runs on TE"
    converted = apply_fp8(model, plan, backend_options={"te": {"fuse_wgrad_accumulation": False}})
    with pytest.raises(OrderingError, match="output runs on a TE module without FP8 whose weight fully_shard would "
                                            "all-gather in FP32"):
        apply_fsdp(converted, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    assert not any(isinstance(m, FSDPModule) for m in converted.modules()), "refused before any module was sharded"


def test_under_fully_shard_te_leaves_wgrad_fusion_and_the_weight_cache_off_with_notes(mesh):
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), POLICY)
    model = apply_fp8(model, plan, backend_options={"te": {"fuse_wgrad_accumulation": False}})
    te_modules = [m for m in model.modules() if isinstance(m, TransformerEngineBaseModule)]
    assert te_modules and all(m.cached_weights for m in te_modules if m.autocast_recipe is not None)
    pre_shard = [weakref.ref(p) for m in te_modules for p in m.parameters()]
    apply_fsdp(model, mesh)
    gc.collect()
    assert all(m.cached_weights == () for m in te_modules)
    assert not [ref for ref in pre_shard if ref() is not None], "fully_shard's replaced weights should be freed"
    assert "cache_fp8_weights: off for" in describe_assembly(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens()[:, :-1])
    assert all(m.is_fsdp2 for m in te_modules), "TE sees the FSDP2 tree and skips its own FP8 weight workspace"

    FP8GlobalStateManager.reset()
    with torch.device("cuda"):
        auto = assemble(Llama(load_model_config("tiny")), plan, fsdp_mesh=mesh)
    described = describe_assembly(auto)
    assert "fuse_wgrad_accumulation (auto): off under fully_shard" in described and "accumulate in FP32" in described
    assert not any(getattr(m, "main_grad_weights", ()) for m in auto.modules())


def train_accumulating(model: nn.Module, masters, micro_batches: int = 2) -> list[float]:
    """Losses of STEPS AdamW steps, each over `micro_batches` micro-batches of one fixed batch (the FP8 weight cache
    casts at a step's first micro-batch and reuses the copy in the others)."""
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3))
    batch, losses = tokens(), []
    for _ in range(STEPS):
        for micro_batch in batch.chunk(micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = Llama.loss(model(micro_batch[:, :-1]), micro_batch[:, 1:]) / micro_batches
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def gathered_once(mesh, recipe: str, cache: bool, fuse_wgrad_accumulation: bool = False) -> nn.Module:
    """The tiny Llama on the fast path with `recipe`, fully_shard'ed keeping the gathered weights after forward."""
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    policy = PolicyConfig(recipe=recipe, backend="te", small_gemm_filter="off", fuse_norm=True, fuse_mlp=True)
    return assemble(model, make_plan(load_description("tiny"), policy), fsdp_mesh=mesh,
                    fsdp_reshard_after_forward=False,
                    backend_options={"te": {"fuse_wgrad_accumulation": fuse_wgrad_accumulation,
                                            "cache_fp8_weights": cache}})


def assert_gathered_once_trains_as_unwrapped(mesh, fuse_wgrad_accumulation: bool) -> str:
    """Delayed, cached, gathered once under fully_shard against the unwrapped fast path with MasterWeights, both
    with or both without TE's fused wgrad accumulation, over two micro-batches a step; the sharded model's
    describe_assembly."""
    model = gathered_once(mesh, "delayed", cache=True, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
    described = describe_assembly(model)
    losses = train_accumulating(model, ShardedMasterWeights(model))
    del model
    gc.collect()
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        unwrapped = Llama(load_model_config("tiny"))
    unwrapped = assemble(unwrapped, make_plan(load_description("tiny"), POLICY),
                         backend_options={"te": {"fuse_wgrad_accumulation": fuse_wgrad_accumulation}})
    assert_losses_match(losses, train_accumulating(unwrapped, MasterWeights(unwrapped)))
    return described


def test_gathered_once_te_keeps_its_fp8_weight_cache_keyed_to_the_sharded_weights_bit_for_bit(mesh):
    """Tensorwise scales come from the weight itself: the cached cast and the casts at every forward and backward
    without the cache are the same bytes, so the losses are equal, not close."""
    uncached = gathered_once(mesh, "tensorwise", cache=False)
    uncached_losses = train_accumulating(uncached, ShardedMasterWeights(uncached))
    assert all(m.is_fsdp2 for m in uncached.modules() if isinstance(m, TransformerEngineBaseModule))
    del uncached
    gc.collect()

    model = gathered_once(mesh, "tensorwise", cache=True)
    cached = [m for m in model.modules() if getattr(m, "cached_weights", ())]
    assert cached and all(isinstance(w, DTensor) for m in cached for w in m.cached_weights), "keyed to the shards"
    assert "cache_fp8_weights: on for" in describe_assembly(model)
    losses = train_accumulating(model, ShardedMasterWeights(model))
    te_modules = [m for m in model.modules() if isinstance(m, TransformerEngineBaseModule) and m.fp8_initialized]
    assert te_modules and not any(m.is_fsdp2 for m in te_modules)
    assert all(m._fp8_workspaces for m in te_modules), "TE keeps its FP8 weight workspace"
    assert losses[-1] < losses[0], losses
    assert losses == uncached_losses


def test_gathered_once_te_cache_frees_the_pre_shard_weights_and_trains_as_the_unwrapped_cached_path(mesh):
    assert_gathered_once_trains_as_unwrapped(mesh, fuse_wgrad_accumulation=False)

    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    model = apply_fp8(model, make_plan(load_description("tiny"), POLICY),
                      backend_options={"te": {"fuse_wgrad_accumulation": False}})
    pre_shard = [weakref.ref(p) for m in model.modules() if isinstance(m, TransformerEngineBaseModule)
                 for p in m.parameters()]
    apply_fsdp(model, mesh, reshard_after_forward=False)
    gc.collect()
    assert not [ref for ref in pre_shard if ref() is not None], "fully_shard's replaced weights should be freed"


def test_gathered_once_te_accumulates_weight_gradients_into_what_fsdp2_reduce_scatters(mesh):
    """TE's weight-gradient GEMMs add into FP32 buffers that FSDP2 takes as its accumulators: the losses follow the
    unwrapped fast path with the same fusion (FP32 accumulation inside the GEMM in both), over two micro-batches a
    step reduce-scattered after each (a buffer not zeroed after a reduction would count a micro-batch twice)."""
    described = assert_gathered_once_trains_as_unwrapped(mesh, fuse_wgrad_accumulation=True)
    assert "fuse_wgrad_accumulation: on for" in described
