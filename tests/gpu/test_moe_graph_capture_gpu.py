"""The MoE layer (router, sync-free permutation, experts, weighted unpermute, shared expert) captured in a
CUDA graph, per expert backend: warm-up on a side stream, capture with torch.cuda.graph, then replays on new
inputs of the same shape (new routing, new expert group sizes) against the same layer run eagerly.

- BF16 GroupedExperts (torch._grouped_mm) and grouped_fp8 rowwise / rowwise_gw_hp (torch._scaled_grouped_mm):
  forward and forward + backward captured.
- grouped_fp8 blockwise on DeepGEMM, with the BF16 and with the FP8 dispatch (fp8_dispatch): forward captured
  (rows labelled with their experts on the GPU, the FP8 rows gathered through an index of static size), with
  cache_fp8_weights too (bypassed under capture: a replay quantizes the current weights); its backward reads the
  group sizes for the K-grouped wgrad, so the guard refuses a training-step capture.
- grouped_fp8 blockwise on torch's per-expert scaled_mm, and TE GroupedLinear: the guard refuses, with the
  reason and the fix; their forward does read the host (checked with torch's sync debug mode).

Run with `pytest -m gpu tests/gpu/test_moe_graph_capture_gpu.py`.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from fp8stack.backends import deepgemm
from fp8stack.backends.grouped import Float8GroupedExperts, TorchBlockwiseKernels, TorchRowwiseKernels
from fp8stack.models.moe import MoE, MoEConfig
from fp8stack.runtime import CaptureRefused, capture_check, check_capturable, no_host_sync

from gpu_skips import require_cuda, te_mark

pytestmark = pytest.mark.gpu

require_cuda()

SM = torch.cuda.get_device_capability()
DIM, EXPERT_FFN, SHARED_FFN, EXPERTS, TOP_K, TOKENS = 256, 128, 256, 8, 2, 384
"""Weight dims are multiples of 128 (blockwise); 384 tokens x top-2 over 8 experts leave some groups unaligned."""
REPLAYS = 3
"""Replays compared with eager runs, each on a new input (new routing)."""
REPLAY_REL_ERR = 1e-3
"""||replayed - eager|| / ||eager||. A replay runs the captured kernels on the same inputs as the eager run, so
they agree up to the order of additions inside a GEMM (cuBLAS may pick another algorithm under capture); a replay
that kept the capture's routing or group sizes puts rows under the wrong experts, far above this."""
WARMUP = 3

NEEDS_SM90 = pytest.mark.skipif(SM != (9, 0), reason=f"blockwise grouped GEMMs run on sm90 only, this is sm{SM[0]}{SM[1]}")
NEEDS_FP8_GROUPED = pytest.mark.skipif(SM not in ((9, 0), (10, 0)),
                                       reason=f"torch's FP8 grouped GEMM runs on sm90 and sm100, this is sm{SM[0]}{SM[1]}")
NEEDS_DEEPGEMM = pytest.mark.skipif(deepgemm.load()[0] is None, reason=deepgemm.load()[1] or "DeepGEMM missing")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def _moe(experts: str, cache_fp8_weights: bool = False) -> MoE:
    """A DeepSeek-style MoE layer (sigmoid router, renormalised top-k, a shared expert) in BF16 on the GPU,
    its routed experts on `experts`: bf16, rowwise, rowwise_gw_hp, blockwise-deepgemm, blockwise-deepgemm-fp8-dispatch,
    blockwise-torch, te."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_ffn_dim=EXPERT_FFN, shared_ffn_dim=SHARED_FFN,
                       score_func="sigmoid", route_norm=True)
    with torch.device("cuda"):
        moe = MoE(DIM, config)
    moe.init_weights(0.02)
    moe = moe.to(torch.bfloat16)
    both = {"w13": experts.split("-")[0], "w2": experts.split("-")[0]}
    if experts in ("rowwise", "rowwise_gw_hp"):
        moe.experts = Float8GroupedExperts.from_experts(moe.experts, both, None, TorchRowwiseKernels())
    elif experts.startswith("blockwise-deepgemm"):
        moe.experts = Float8GroupedExperts.from_experts(moe.experts, both, deepgemm.DeepGemmKernels(), None,
                                                        fp8_dispatch=experts.endswith("fp8-dispatch"),
                                                        cache_fp8_weights=cache_fp8_weights)
    elif experts == "blockwise-torch":
        moe.experts = Float8GroupedExperts.from_experts(moe.experts, both, TorchBlockwiseKernels(), None)
    elif experts == "te":
        from fp8stack.backends.te import te_recipe
        from fp8stack.backends.te_modules import grouped_experts_from

        moe.experts = grouped_experts_from(moe.experts, te_recipe("tensorwise", "hybrid"), name="experts")
    return moe


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, upstream gradient) for one replay: new values, so a new routing."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    return x, torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)


def _capture_forward(moe: MoE, static_x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(WARMUP):  # compiles the quantizers, JIT-builds DeepGEMM's kernels
            moe(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = moe(static_x)
    return graph, static_out


def _capture_step(moe: MoE, static_x: torch.Tensor, static_grad: torch.Tensor):
    """Forward + backward captured; returns (graph, output, [input grad, parameter grads]) as static tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            moe.zero_grad(set_to_none=True)
            static_x.grad = None
            moe(static_x).backward(static_grad)
    torch.cuda.current_stream().wait_stream(side)
    moe.zero_grad(set_to_none=True)  # the captured backward allocates the gradients from the graph's pool
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
        static_out.backward(static_grad)
    return graph, static_out, [static_x.grad, *(p.grad for p in moe.parameters())]


CAPTURABLE_STEP = ["bf16", pytest.param("rowwise", marks=NEEDS_FP8_GROUPED),
                   pytest.param("rowwise_gw_hp", marks=NEEDS_FP8_GROUPED)]
CAPTURABLE_FORWARD = [*CAPTURABLE_STEP, *(pytest.param(experts, marks=[NEEDS_SM90, NEEDS_DEEPGEMM])
                                          for experts in ("blockwise-deepgemm", "blockwise-deepgemm-fp8-dispatch"))]


@pytest.mark.parametrize("experts", CAPTURABLE_FORWARD)
def test_captured_forward_replays_like_eager_on_new_routings(experts):
    moe = _moe(experts)
    check_capturable(moe, backward=False)  # the guard lets it through
    eager = copy.deepcopy(moe)
    static_x = _inputs(0)[0].clone()
    graph, static_out = _capture_forward(moe, static_x)
    group_sizes_seen = set()
    for seed in range(1, REPLAYS + 1):
        x, _ = _inputs(seed)
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            expected = eager(x)
            _, chosen = eager.router(x)
        group_sizes_seen.add(tuple(torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()))
        assert rel_err(static_out, expected) < REPLAY_REL_ERR, f"{experts} replay {seed}"
    assert len(group_sizes_seen) == REPLAYS  # every replay had other expert group sizes than the others


@NEEDS_SM90
@NEEDS_DEEPGEMM
@pytest.mark.parametrize("experts", ["blockwise-deepgemm", "blockwise-deepgemm-fp8-dispatch"])
def test_a_captured_forward_quantizes_cached_weights_at_every_replay(experts):
    """cache_fp8_weights is bypassed while a graph is captured: the graph holds the weights' quantization, so a replay
    after the weights changed (as an optimizer step changes them) computes with the new weights, as eager does."""
    moe = _moe(experts, cache_fp8_weights=True)
    assert moe.experts.caches_fp8_weights
    eager = copy.deepcopy(moe)
    static_x = _inputs(0)[0].clone()
    graph, static_out = _capture_forward(moe, static_x)
    graph.replay()
    before = static_out.clone()
    with torch.no_grad():
        for model in (moe, eager):
            for weight in (model.experts.w13, model.experts.w2):
                weight.mul_(-1.5)
        graph.replay()
        expected = eager(static_x)
    assert rel_err(static_out, before) > 100 * REPLAY_REL_ERR, "the weights' change must show in the output"
    assert rel_err(static_out, expected) < REPLAY_REL_ERR


@pytest.mark.parametrize("experts", CAPTURABLE_FORWARD)
def test_capturable_forward_reads_nothing_on_the_host(experts):
    moe = _moe(experts)
    x = _inputs(0)[0]
    with torch.no_grad():
        moe(x)  # compiles and JIT-builds outside the check
        with no_host_sync():
            moe(x)


@pytest.mark.parametrize("experts", CAPTURABLE_STEP)
def test_captured_training_step_replays_like_eager(experts):
    moe = _moe(experts)
    check_capturable(moe, backward=True)
    eager = copy.deepcopy(moe)
    static_x = _inputs(0)[0].clone().requires_grad_(True)
    static_grad = _inputs(0)[1].clone()
    graph, static_out, static_grads = _capture_step(moe, static_x, static_grad)
    names = ["x", *(name for name, _ in moe.named_parameters())]
    for seed in range(1, REPLAYS + 1):
        x, grad = _inputs(seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_grad.copy_(grad)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        x_eager = x.clone().requires_grad_(True)
        out = eager(x_eager)
        out.backward(grad)
        assert rel_err(static_out, out) < REPLAY_REL_ERR, f"{experts} replay {seed}: output"
        for name, got, expected in zip(names, static_grads, [x_eager.grad, *(p.grad for p in eager.parameters())]):
            assert rel_err(got, expected) < REPLAY_REL_ERR, f"{experts} replay {seed}: grad of {name}"


@NEEDS_SM90
@NEEDS_DEEPGEMM
def test_deepgemm_blockwise_training_step_is_refused_by_the_guard():
    moe = _moe("blockwise-deepgemm")
    check_capturable(moe, backward=False)
    with pytest.raises(CaptureRefused, match="blockwise experts on DeepGEMM: forward capturable .* capture the "
                                             "forward only, or use recipe rowwise"):
        check_capturable(moe, backward=True)
    report = capture_check(moe, _inputs(0)[0], lambda m, x: m(x).float().sum())
    assert (report.captured, report.phase, report.module) == (False, "setup", "experts"), report.summary()


@pytest.mark.parametrize("experts, message", [
    pytest.param("blockwise-torch", "grouped_fp8 blockwise experts on torch scaled_mm per expert: not capturable",
                 marks=NEEDS_SM90),
    pytest.param("te", "TE GroupedLinear experts: not capturable", marks=te_mark(["tensorwise"]))])
def test_uncapturable_experts_are_refused_and_do_read_the_host(experts, message):
    moe = _moe(experts)
    for backward in (False, True):
        with pytest.raises(CaptureRefused, match=f"cannot capture experts in a CUDA graph: {message}"):
            check_capturable(moe, backward=backward)
    report = capture_check(moe, _inputs(0)[0], lambda m, x: m(x).float().sum())
    assert (report.captured, report.phase, report.module) == (False, "setup", "experts"), report.summary()
    assert message in report.reason
    x = _inputs(0)[0]
    with torch.no_grad():
        moe(x)
        with pytest.raises(RuntimeError), no_host_sync():  # what the refusal says: the forward syncs
            moe(x)


@NEEDS_SM90
def test_torch_grouped_fp8_gemm_still_takes_no_block_scales():
    """Why the torch blockwise kernels slice per expert on the host: torch's grouped FP8 GEMM dispatches rowwise,
    MXFP8, MXFP4 and NVFP4 scales only. When a torch release accepts 1x128 / 128x128 scales with device offsets,
    this fails: move TorchBlockwiseKernels onto it and make it capturable."""
    rows, k, n = 256, 256, 128
    a = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(2, n, k, device="cuda").to(torch.float8_e4m3fn)
    scale_a = torch.ones(k // 128, rows, device="cuda").t()  # outer-dim-major 1x128 scales
    scale_b = torch.ones(2, n // 128, k // 128, device="cuda")
    offsets = torch.tensor([128, 256], device="cuda", dtype=torch.int32)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        F.scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, F.ScalingType.BlockWise1x128,
                            scale_b, F.ScalingType.BlockWise128x128, offs=offsets, output_dtype=torch.bfloat16)
        torch.cuda.synchronize()


@te_mark(["tensorwise"])
def test_a_compiled_moe_layer_on_te_experts_compiles_once_whatever_the_routing():
    """TE's GroupedLinear takes the row counts as Python ints: traced by dynamo they would become constants of the
    graph, recompiled for every routing until dynamo gives up on the frame. The experts run eagerly instead."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    moe = _moe("te")
    compiled = torch.compile(moe)
    for seed in range(4):
        x, grad = _inputs(seed)
        compiled(x.requires_grad_()).backward(grad)
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new routing recompiled the MoE layer"
