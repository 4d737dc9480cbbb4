"""grouped_fp8 on a Hopper GPU: the real kernels against the FP32 reference, and a converted MoE Llama
training. Run with `pytest -m gpu tests/gpu/test_grouped_fp8_gpu.py`.

Bounds per GEMM: against the dequantized FP32 reference (same quantized operands) only the accumulation
order and the BF16 output rounding differ (KERNEL_TOLERANCE); against an FP32 GEMM of the unquantized
operands the E4M3 rounding of both operands adds ~4% (FP8_TOLERANCE).
"""

import pytest
import torch

from fp8stack.models import load_model_config
from fp8stack.backends import deepgemm
from fp8stack.backends.blockwise import (Fp8Tensor, quantize_1x128, quantize_128x128, reference_grouped_dgrad,
                                         reference_grouped_gemm, reference_grouped_wgrad)
from fp8stack.backends.grouped import (INDUCTOR_QUANTIZER, BlockwiseGroupedMM, Float8GroupedExperts,
                                       GroupedFP8Backend, RowwiseGroupedMM, TokenGroupPadding, TorchBlockwiseKernels,
                                       TorchRowwiseKernels)
from fp8stack.backends.fp8_quant import quantize_rowwise
from fp8stack.backends.base import optimizer_steps
from fp8stack.models import Llama
from fp8stack.plan import PolicyConfig, load_description, make_plan

from gpu_skips import require_cuda, te_mark

pytestmark = pytest.mark.gpu

require_cuda()
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip(f"needs an sm90 (Hopper) GPU: torch's DeepSeek-style scaled_mm is sm90-only, this is "
                f"sm{''.join(map(str, torch.cuda.get_device_capability()))}", allow_module_level=True)

FP8_TOLERANCE = 6e-2
KERNEL_TOLERANCE = 1e-2
DEVICE = torch.device("cuda")
UNEVEN = [130, 0, 7, 300]
"""Rows per expert: unaligned groups, an empty expert."""

KERNELS = {"torch": TorchBlockwiseKernels}
if deepgemm.load()[0] is not None:
    KERNELS["deepgemm"] = deepgemm.DeepGemmKernels


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)


def spans(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def exact_grouped(x, w, grad_y, offsets):
    """FP32 GEMMs of the unquantized operands: (y, grad_x, grad_w)."""
    x, w, grad_y = x.float(), w.float(), grad_y.float()
    return (torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(spans(offsets))]),
            torch.cat([grad_y[s:e] @ w[i] for i, (s, e) in enumerate(spans(offsets))]),
            torch.stack([grad_y[s:e].T @ x[s:e] for s, e in spans(offsets)]))


@pytest.mark.parametrize("kernels,quantizer", [*((name, "inductor") for name in KERNELS), ("deepgemm", "te")],
                         ids=[*KERNELS, "deepgemm-te-quantizer"])
@pytest.mark.parametrize("counts", [UNEVEN, [128, 0, 256, 384]], ids=["uneven", "aligned"])
@pytest.mark.parametrize("k", [640, 1024], ids=["k640", "k1024"])
def test_blockwise_fwd_dgrad_wgrad_match_the_reference(kernels, quantizer, counts, k):
    """K = 640 and N = 384 make K/128 and N/128 not multiples of 4 (pytorch#166752 gave silently wrong
    blockwise results there): forward and dgrad both reduce over such a dim. With TE quantizing x and grad_y for
    DeepGEMM, its operands are the reference's (blockwise.quantize_1x128 follows TE's arithmetic), so the same bounds
    hold; the uneven groups run through the padding gather, then TE."""
    operands = _te_quantizer_or_skip() if quantizer == "te" else None
    torch.manual_seed(0)
    n = 384
    offsets = offsets_of(counts)
    x = torch.randn(sum(counts), k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), n, k, device=DEVICE) * 0.05).requires_grad_(True)
    y = BlockwiseGroupedMM.apply(x, w, offsets, KERNELS[kernels](), *((False, None, operands) if operands else ()))
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    exact_y, exact_dgrad, exact_wgrad = exact_grouped(x.detach(), w.detach(), grad_y, offsets)
    assert rel_err(y, reference_grouped_gemm(x.detach(), w.detach(), offsets)) < KERNEL_TOLERANCE
    assert rel_err(x.grad, reference_grouped_dgrad(grad_y, w.detach(), offsets)) < KERNEL_TOLERANCE
    assert rel_err(w.grad, reference_grouped_wgrad(grad_y, x.detach(), offsets)) < KERNEL_TOLERANCE
    assert rel_err(y, exact_y) < FP8_TOLERANCE
    assert rel_err(x.grad, exact_dgrad) < FP8_TOLERANCE
    assert rel_err(w.grad, exact_wgrad) < FP8_TOLERANCE
    if 0 in counts:
        assert (w.grad[counts.index(0)] == 0).all()


def test_the_wgrad_s_host_reads_and_operand_layout_wait_for_nothing_on_the_gpu():
    """TokenGroups.prefetch_counts copies the group ends to the host behind the queued kernels: the backward's read
    of counts then synchronises nothing (torch's sync debug mode would raise), and gives what a synced read gives;
    flattening the wgrad operands by those counts synchronises nothing either. Under CUDA-graph capture
    prefetch_counts copies nothing (a replay would not refresh the copy)."""
    from fp8stack.backends.grouped import AlignedTokenGroups

    offsets = offsets_of([128, 0, 256, 384])
    prefetched, synced = (AlignedTokenGroups(offsets, 768, 128) for _ in range(2))
    operand = torch.randn(256, 768, device=DEVICE).to(torch.float8_e4m3fn)
    prefetched.prefetch_counts()
    torch.cuda._sleep(10_000_000)  # the GPU still busy when the counts are read
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = prefetched.counts
        flat = deepgemm.flatten_k_grouped(operand, counts)
        with pytest.raises(RuntimeError, match="synchroniz"):
            synced.counts
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts == synced.counts == (128, 0, 256, 384)
    expected = torch.cat([block.contiguous().view(-1) for block in operand.view(torch.uint8).split(counts, dim=1)])
    assert torch.equal(flat.view(torch.uint8), expected)
    captured = AlignedTokenGroups(offsets, 768, 128)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        captured.prefetch_counts()
    assert "_host_offsets" not in captured.__dict__


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_blockwise_wgrad_adds_into_main_grad_as_autograd_would(kernels):
    """The wgrad GEMM given the weight's FP32 main_grad (what master weights hand over) adds two micro-batches'
    gradients into it in place: their FP32 sum, within an FP32 rounding of autograd's per-micro-batch gradients;
    the empty expert's buffer keeps its value, and autograd returns no weight gradient."""
    torch.manual_seed(0)
    offsets = offsets_of(UNEVEN)
    x = torch.randn(sum(UNEVEN), 640, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(len(UNEVEN), 384, 640, device=DEVICE) * 0.05).requires_grad_(True)
    grads = [torch.randn(sum(UNEVEN), 384, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    expected = torch.full(w.shape, 0.5, device=DEVICE)
    for grad_y in grads:
        BlockwiseGroupedMM.apply(x, w, offsets, KERNELS[kernels]()).backward(grad_y)
        expected += w.grad.float()
        w.grad = None
    main_grad = torch.full(w.shape, 0.5, device=DEVICE)
    for grad_y in grads:
        BlockwiseGroupedMM.apply(x, w, offsets, KERNELS[kernels](), False, main_grad).backward(grad_y)
    assert w.grad is None
    assert rel_err(main_grad - 0.5, expected - 0.5) < 1e-5
    assert (main_grad[UNEVEN.index(0)] == 0.5).all()


def _both_paths(apply, x, w, grad_y):
    """(y, x.grad, w.grad) of apply(x, w, aligned) for aligned False (the gathers) and True (no row moves)."""
    outs = []
    for aligned in (False, True):
        leaves = (x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True))
        y = apply(*leaves, aligned)
        y.backward(grad_y)
        outs.append((y.detach(), leaves[0].grad, leaves[1].grad))
    return outs


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("extra_rows", [0, 3 * 127 + 5], ids=["rows-aligned", "rows-unaligned"])
def test_blockwise_aligned_path_equals_the_gather_path(kernels, extra_rows):
    """On the real kernels and the compiled quantizers, groups the caller aligned (an empty expert among them) give
    what the padding path gives: torch's per-expert GEMMs bit for bit; DeepGEMM tunes its tiles by the row count,
    which differs (T rounded up against T + E x 127), so within one BF16 rounding. Compared on the groups' rows: past
    the last group the gather path gives zeros and the aligned path what the kernel left there (GroupedExperts'
    contract), whatever x and grad_y hold there."""
    torch.manual_seed(0)
    counts = [256, 0, 384, 128]
    offsets = offsets_of(counts)
    x = torch.randn(sum(counts) + extra_rows, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(counts), 384, 1024, device=DEVICE) * 0.05
    grad_y = torch.randn(x.shape[0], 384, device=DEVICE, dtype=torch.bfloat16)

    def apply(a, b, aligned):
        return BlockwiseGroupedMM.apply(a, b, offsets, KERNELS[kernels](), aligned)

    general, aligned = _both_paths(apply, x, w, grad_y)
    rows = sum(counts)
    for before, after, per_token in zip(general, aligned, (True, True, False)):
        before, after = (before[:rows], after[:rows]) if per_token else (before, after)
        if kernels == "torch":
            assert torch.equal(before, after)
        else:
            assert rel_err(after, before) < 4e-3
    assert (general[0][rows:] == 0).all() and (general[1][rows:] == 0).all()
    assert (aligned[2][counts.index(0)] == 0).all()


@pytest.mark.parametrize("high_precision_wgrad", [False, True], ids=["rowwise", "rowwise_gw_hp"])
def test_rowwise_aligned_path_equals_the_gather_path(high_precision_wgrad):
    torch.manual_seed(0)
    counts = [32, 0, 48, 64]
    offsets = offsets_of(counts)
    x = torch.randn(sum(counts) + 3 * 15 + 2, 512, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(counts), 256, 512, device=DEVICE) * 0.05
    grad_y = torch.randn(x.shape[0], 256, device=DEVICE, dtype=torch.bfloat16)

    def apply(a, b, aligned):
        return RowwiseGroupedMM.apply(a, b, offsets, TorchRowwiseKernels(), high_precision_wgrad, aligned)

    general, aligned = _both_paths(apply, x, w, grad_y)
    rows = sum(counts)  # past the groups: zeros through the gathers, what the kernel left on the aligned path
    for before, after, per_token in zip(general, aligned, (True, True, False)):
        assert rel_err(after[:rows], before[:rows]) < 4e-3 if per_token else rel_err(after, before) < 4e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_grouped_experts_add_weight_gradients_into_main_grad(compiled):
    """The BF16 experts' fused wgrad (wgrad_into_main_grad, the bf16 backend's hand-over under master weights) on
    torch._grouped_mm's CUDA kernels, eager and compiled by inductor as the trainer compiles its blocks: two
    micro-batches in the FP32 main_grads, within a BF16 rounding of autograd's gradients summed in FP32; no .grad."""
    from fp8stack.models import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(512, 256, 4).to(DEVICE)
    experts.init_weights(0.02)
    experts = experts.bfloat16()
    offsets = offsets_of([128, 0, 256, 64])
    x = torch.randn(448 + 24, 512, device=DEVICE, dtype=torch.bfloat16)  # 24 rows past the last group
    grads = [torch.randn(x.shape[0], 512, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    expected = [torch.zeros(w.shape, device=DEVICE) for w in (experts.w13, experts.w2)]
    for grad_y in grads:
        experts(x, offsets).backward(grad_y)
        for total, weight in zip(expected, (experts.w13, experts.w2)):
            total += weight.grad.float()
        experts.zero_grad(set_to_none=True)
    for weight in (experts.w13, experts.w2):
        weight.main_grad = torch.zeros(weight.shape, device=DEVICE)
    experts.wgrad_into_main_grad = True
    forward = torch.compile(experts, fullgraph=True) if compiled else experts
    for grad_y in grads:
        forward(x.clone().requires_grad_(True), offsets).backward(grad_y)
    for total, weight in zip(expected, (experts.w13, experts.w2)):
        assert weight.grad is None
        assert rel_err(weight.main_grad, total) < 1e-2
        assert (weight.main_grad[1] == 0).all()


@pytest.mark.parametrize("k", [384, 640, 896, 1152])
def test_torch_blockwise_scaled_mm_when_k_blocks_are_not_a_multiple_of_4(k):
    """One GEMM straight through the native kernel, K/128 = 3, 5, 7, 9."""
    torch.manual_seed(0)
    a, b = torch.randn(256, k, device=DEVICE), torch.randn(1, 256, k, device=DEVICE)
    groups = TokenGroupPadding.build(offsets_of([256]), 256, alignment=128)
    out = TorchBlockwiseKernels().m_grouped(quantize_1x128(a), quantize_128x128(b), groups)
    reference = reference_grouped_gemm(a, b, offsets_of([256]))
    assert rel_err(out, reference) < KERNEL_TOLERANCE


def _rowwise_reference(x, w, offsets):
    xq, wq = quantize_rowwise(x), quantize_rowwise(w)
    xd, wd = xq.data.float() * xq.scale[:, None], wq.data.float() * wq.scale[..., None]
    return torch.cat([xd[s:e] @ wd[i].T for i, (s, e) in enumerate(spans(offsets))])


@pytest.mark.parametrize("high_precision_wgrad", [False, True], ids=["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("counts", [[20, 0, 45, 64], [32, 0, 48, 64]], ids=["uneven", "aligned16"])
def test_rowwise_grouped_vs_bf16(high_precision_wgrad, counts):
    torch.manual_seed(0)
    offsets = offsets_of(counts)
    x = torch.randn(sum(counts), 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), 256, 512, device=DEVICE) * 0.05).requires_grad_(True)
    y = RowwiseGroupedMM.apply(x, w, offsets, TorchRowwiseKernels(), high_precision_wgrad)
    bf16 = torch._grouped_mm(x.detach(), w.detach().bfloat16().transpose(-2, -1), offs=offsets)
    assert rel_err(y, bf16) < FP8_TOLERANCE
    assert rel_err(y, _rowwise_reference(x.detach(), w.detach(), offsets)) < KERNEL_TOLERANCE
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    _, exact_dgrad, exact_wgrad = exact_grouped(x.detach(), w.detach(), grad_y, offsets)
    assert rel_err(x.grad, exact_dgrad) < FP8_TOLERANCE
    assert rel_err(w.grad, exact_wgrad) < (KERNEL_TOLERANCE if high_precision_wgrad else FP8_TOLERANCE)
    assert (w.grad[1] == 0).all()


def test_available_on_hopper():
    assert GroupedFP8Backend().available() == (True, "")


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "rowwise_gw_hp"])
def test_converted_moe_llama_trains(recipe):
    decisions = _tiny_moe_plan(recipe).for_backend("grouped_fp8")
    assert {d.recipe for d in decisions} == {recipe} and len(decisions) == 6
    model, _ = _trains_close_to_bf16(recipe, GroupedFP8Backend(kernels="torch"))
    assert all(isinstance(model.layers[i].moe.experts, Float8GroupedExperts) for i in (1, 2, 3))


def _tiny_moe_plan(recipe: str):
    return make_plan(load_description("tiny-moe"), PolicyConfig(recipe=recipe, fp8_format="e4m3",
                                                                 expert_backend="grouped_fp8"))


def _trains_close_to_bf16(recipe: str, backend: GroupedFP8Backend) -> tuple[Llama, list[str]]:
    """The tiny MoE Llama converted by `backend`: its first loss within 2% of the BF16 model's, and 5 AdamW steps on
    one batch lower it; returns the converted model and the conversion's notes."""
    torch.manual_seed(0)
    model = Llama(load_model_config("tiny-moe")).to(DEVICE)
    plan = _tiny_moe_plan(recipe)
    tokens = torch.randint(0, 256, (4, 129), device=DEVICE)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16_loss = Llama.loss(model(inputs), targets).item()
    model, record = backend.convert(model, plan.for_backend("grouped_fp8"), plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = Llama.loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert abs(losses[0] - bf16_loss) < 0.02 * bf16_loss
    assert losses[-1] < losses[0]
    return model, record.notes


def test_fused_quantizers_match_the_eager_references_on_cuda():
    """The compiled (inductor/Triton) quantizers against the same Python run eagerly: scales bit for bit,
    FP8 codes at most 1 apart (Triton's division is div_rn like eager, so they should be equal too)."""
    from fp8stack.backends import fp8_quant
    from fp8stack.backends.grouped import TokenGroupPadding

    torch.manual_seed(0)
    x = torch.randn(640, 1024, device=DEVICE, dtype=torch.bfloat16) * torch.logspace(
        -3, 3, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(4, 384, 640, device=DEVICE)
    padding = TokenGroupPadding.build(offsets_of([20, 0, 45, 64]), num_tokens=200, alignment=16)
    aligned = offsets_of([32, 0, 48, 64])
    cases = [(fp8_quant.quantize_both_1x128, (x,)), (fp8_quant.quantize_blocks_128x128, (w,)),
             (fp8_quant.quantize_rowwise_transposed, (w,)),
             (fp8_quant.gather_quantize_rowwise_and_groups, (x[:200], padding.source, padding.offsets)),
             (fp8_quant.pad_quantize_both_1x128, (x[:200], 128)),
             (fp8_quant.pad_quantize_rowwise_and_groups, (x[:200], aligned, 16))]
    for fn, args in cases:
        fast, eager = fn(*args), fn.eager(*args)
        pairs = zip(fast, eager) if isinstance(fast[0], tuple) else [(fast, eager)]
        for a, b in pairs:
            assert torch.equal(a.scale, b.scale), fn.__name__
            assert a.data.stride() == b.data.stride(), fn.__name__
            codes = (a.data.view(torch.uint8).int() - b.data.view(torch.uint8).int()).abs()
            assert codes.max() <= 1, fn.__name__


def _moe_layer(experts: str, fp8_dispatch: bool, dim: int = 1024, ffn: int = 512, cache_fp8_weights: bool = False):
    """A DeepSeek-style BF16 MoE layer on the GPU (16 experts top-4, sigmoid router, a shared expert) with blockwise
    experts on `experts` kernels, the same weights whatever fp8_dispatch and cache_fp8_weights."""
    from fp8stack.models.moe import MoE, MoEConfig

    torch.manual_seed(0)
    config = MoEConfig(num_experts=16, top_k=4, expert_ffn_dim=ffn, shared_ffn_dim=ffn, score_func="sigmoid",
                       route_norm=True)
    with torch.device("cuda"):
        moe = MoE(dim, config)
    moe.init_weights(0.02)
    moe = moe.to(torch.bfloat16)
    moe.experts = Float8GroupedExperts.from_experts(moe.experts, {"w13": "blockwise", "w2": "blockwise"},
                                                    KERNELS[experts](), None, fp8_dispatch,
                                                    cache_fp8_weights=cache_fp8_weights)
    return moe


def _step(moe, x, grad) -> tuple[list[torch.Tensor], int]:
    """(output, input and parameter gradients) of one forward + backward, and the bytes the forward left allocated
    for its backward (saved tensors and output)."""
    x = x.clone().requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = moe(x)
    held = torch.cuda.memory_allocated() - before
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in moe.parameters())], held


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_fp8_dispatch_moe_layer_matches_the_bf16_dispatch_and_holds_less(kernels):
    """The FP8 dispatch (tokens quantized once, FP8 rows gathered; wgrad operand quantized in the backward from the
    tokens) against the BF16 dispatch on the real kernels and the compiled quantizers: on CPU the two are equal bit
    for bit (tests/test_grouped_fp8.py); here each path's quantizers are separately compiled kernels, which may round
    an element one FP8 code apart from the eager reference (test_fused_quantizers_match_the_eager_references_on_cuda),
    hence a bound far below one BF16 rounding of the result. Between forward and backward the FP8 dispatch holds less:
    the row index instead of x^T in FP8 (the tokens are the router's saved input already)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    moe = _moe_layer(kernels, fp8_dispatch=True)
    fp8_rows, fp8_held = _step(moe, x, grad)
    bf16_rows, bf16_held = _step(_moe_layer(kernels, fp8_dispatch=False), x, grad)
    names = ["y", "x", *(name for name, _ in moe.named_parameters())]
    for name, got, expected in zip(names, fp8_rows, bf16_rows, strict=True):
        assert rel_err(got, expected) < 1e-3, name
    assert fp8_held < bf16_held, (fp8_held, bf16_held)


def test_fp8_dispatch_moe_layer_compiles_like_eager():
    """torch.compile of the layer, as the trainer compiles its blocks: the dispatch's quantizer and gather are traced
    into the layer's graph where dynamo traces it (fp8_quant.fused runs their Python there); output and gradients as
    eager's, and a second routing compiles nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    kernels = "deepgemm" if "deepgemm" in KERNELS else "torch"
    eager, compiled_moe = _moe_layer(kernels, True), _moe_layer(kernels, True)
    compiled = torch.compile(compiled_moe)
    for seed in (1, 2):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(1024, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        grad = torch.randn(1024, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        eager.zero_grad(set_to_none=True)
        compiled_moe.zero_grad(set_to_none=True)
        expected, _ = _step(eager, x, grad)
        got, _ = _step(compiled, x, grad)
        for a, b in zip(got, expected, strict=True):
            assert rel_err(a, b) < FP8_TOLERANCE  # a near-tie in the compiled router may move one token's expert
        if seed == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new routing recompiled the layer"


# ---- cache_fp8_weights: the blockwise weights' FP8 blocks made once per optimizer step -------------------------

def _kernels_or_skip(kernels: str) -> str:
    if kernels not in KERNELS:
        pytest.skip(deepgemm.load()[1] or "deep_gemm is not importable")
    return kernels


def _train_three_steps(moe, after_step=None) -> tuple[list[float], list[torch.Tensor]]:
    """(losses, parameters) of three fused-AdamW steps of two micro-batches of seeded random tokens; after_step runs
    after each step's zero_grad."""
    optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-3, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(1024, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
            loss = moe(x).float().square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
    return losses, [p.detach().clone() for p in moe.parameters()]


@pytest.mark.parametrize("kernels", ["torch", "deepgemm"])
@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_cached_fp8_weights_train_as_uncached_bit_for_bit(kernels, fp8_dispatch):
    """Three steps of two micro-batches, fused AdamW between them (it leaves the weights' versions alone): the MoE
    layer with cache_fp8_weights gives the uncached layer's losses and parameters bit for bit (the uncached run
    repeats itself first: the comparison assumes deterministic kernels); a cache kept past the steps (taken for
    current after each step) trains on the first step's blocks, so the comparison can fail."""
    kernels = _kernels_or_skip(kernels)

    def train(variant: str) -> tuple[list[float], list[torch.Tensor]]:
        moe = _moe_layer(kernels, fp8_dispatch, cache_fp8_weights=variant != "uncached")

        def take_cache_for_current():
            for gemm, blocks in moe.experts.weight_blocks.items():
                blocks._made_at = (optimizer_steps(), getattr(moe.experts, gemm)._version)

        return _train_three_steps(moe, after_step=take_cache_for_current if variant == "stale" else None)

    uncached, again, cached, stale = (train(v) for v in ("uncached", "uncached", "cached", "stale"))
    assert again[0] == uncached[0], "the uncached run does not repeat itself: bit-for-bit comparisons cannot hold"
    assert cached[0] == uncached[0], (cached[0], uncached[0])
    assert all(torch.equal(a, b) for a, b in zip(cached[1], uncached[1], strict=True))
    assert stale[0][:2] == cached[0][:2] and stale[0][2:] != cached[0][2:]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kernels", ["torch", "deepgemm"])
def test_the_trainer_s_weight_cache_trains_as_uncached(kernels, compile, monkeypatch):
    """fp8stack's trainer with two micro-batches per step and --grouped-fp8.cache-fp8-weights: the tiny MoE Llama's
    blockwise experts on grouped_fp8, weight gradients into the master weights' main_grads, train with the losses of
    the uncached run (the default), bit for bit, eager and in compiled blocks (where the cache's lookup runs outside
    the graph)."""
    from fp8stack.config import from_overrides
    from fp8stack.train.loop import session, train

    if _kernels_or_skip(kernels) == "torch":  # grouped_fp8's kernels auto take DeepGEMM wherever it imports
        monkeypatch.setattr(deepgemm, "load", lambda: (None, "the test runs torch's kernels"))
    settings = {"model.name": "tiny-moe", "precision.recipe": "blockwise", "precision.expert_backend": "grouped_fp8",
                "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 3,
                "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4,
                "training.seq_len": 128, "training.eval_batches": 0, "data.max_bytes": 1 << 20,
                "logging.progress": False, "training.compile": compile, "grouped_fp8.cache_fp8_weights": True}
    with session(from_overrides(settings)) as run:
        experts = [m for m in run.model.modules() if isinstance(m, Float8GroupedExperts)]
        assert run.micro_batches == 2 and experts and all(m.caches_fp8_weights for m in experts)
        assert {m.blockwise_kernels.name for m in experts} == {KERNELS[kernels].name}
    cached = train(from_overrides(settings)).losses
    uncached, again = (train(from_overrides({**settings, "grouped_fp8.cache_fp8_weights": False})).losses
                       for _ in range(2))
    assert again == uncached, f"the uncached run does not repeat itself ({uncached} vs {again}): bit for bit fails"
    assert cached == uncached, (cached, uncached)


@te_mark(["delayed"])
def test_a_recipe_file_trains_blockwise_experts_beside_delayed_linears():
    """configs/recipes/blockwise-experts-delayed-dense through the trainer: tiny-moe's routed experts on grouped_fp8
    in block scales, its other linears on TE's delayed scaling, one model; the loss falls."""
    from fp8stack.train.command import job_from_flags
    from fp8stack.train.loop import session, train

    job = job_from_flags(["--model", "tiny-moe", "--recipe-file", "blockwise-experts-delayed-dense",
                          "--small-gemm-filter", "off", "--device", "cuda", "--train-iters", "30",
                          "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "128",
                          "--eval-iters", "0", "--max-data-bytes", str(1 << 20), "--no-progress"])
    with session(job) as run:
        paths = {(d.component.kind, d.backend, d.recipe) for d in run.plan.decisions if d.recipe != "bf16"}
    assert {("expert", "grouped_fp8", "blockwise"), ("linear", "te", "delayed")} <= paths
    losses = train(job).losses
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) / 5 < losses[0] - 0.2, losses


# ---- wgrad_flatten compiled / triton: DeepGEMM's wgrad operands laid out by one kernel per operand ----------

def _random_fp8(dim: int, tokens: int) -> torch.Tensor:
    """Random bytes as E4M3 on the GPU: every code, so that a byte moved to the wrong place shows."""
    return torch.randint(0, 256, (dim, tokens), dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("flatten", ["compiled", "triton"])
def test_the_one_kernel_wgrad_flattenings_give_the_copies_bytes(flatten):
    """The compiled gather and the Triton tile copy against the per-expert copies on the GPU, byte for byte: uneven
    groups, empty experts, one expert and 64, whole 8-byte words or not (bytes), a buffer past the groups, a strided
    operand."""
    torch.manual_seed(0)
    cases = [(384, [128, 0, 256, 1024], 256), (256, [0, 384, 128, 0], 0), (640, [384], 128),
             (384, [256, 256, 128, 16], 0), (256, [130, 0, 7, 3], 5), (7168, [128, 256, 0, 384] * 16, 128)]
    for dim, counts, past in cases:
        fp8 = _random_fp8(dim, sum(counts) + past)
        for operand in (fp8, fp8.t().contiguous().t()):
            expected = deepgemm.flatten_k_grouped(operand, counts)
            got = deepgemm.WGRAD_FLATTENERS[flatten](operand, counts)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (dim, counts, past)


def test_the_triton_wgrad_flattening_synchronises_nothing():
    """Laying an operand out by the Triton kernel synchronises nothing once compiled (the group ends go up through
    pinned memory), whatever the routing."""
    calls = [(2048, [256, 0, 512, 1024]), (3072, [128, 640, 0, 384]), (2048, [1024, 128, 128, 2048])]
    for index, (dim, counts) in enumerate(calls):
        operand = _random_fp8(dim, sum(counts) + 384)
        expected = deepgemm.flatten_k_grouped(operand, counts)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if index else "default")  # the first call compiles the kernel
        try:
            got = deepgemm.flatten_k_grouped_triton(operand, counts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), counts


def test_the_default_wgrad_flattening_runs_the_triton_copy_on_the_gpu(monkeypatch):
    """wgrad_flatten auto (the default) lays CUDA operands out by the Triton kernel, not the per-expert copies."""
    operand = _random_fp8(384, 640)
    expected = deepgemm.flatten_k_grouped(operand, [128, 0, 512])
    monkeypatch.setattr(deepgemm, "flatten_k_grouped", lambda *_: pytest.fail("auto copied expert by expert"))
    got = deepgemm.flatten_k_grouped_auto(operand, [128, 0, 512])
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_the_compiled_wgrad_flattening_neither_recompiles_nor_synchronises():
    """Once compiled, new group sizes and token counts and the other operand's dim (a wgrad's two differ) reuse the
    gather, and laying an operand out synchronises nothing (the group ends go up through pinned memory)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    calls = [(2048, [256, 0, 512, 1024]), (3072, [128, 640, 0, 384]), (2048, [1024, 128, 128, 2048])]
    graphs = None
    for dim, counts in calls:
        operand = _random_fp8(dim, sum(counts) + 384)
        expected = deepgemm.flatten_k_grouped(operand, counts)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if graphs is not None else "default")  # compiling may synchronise
        try:
            got = deepgemm.flatten_k_grouped_compiled(operand, counts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), counts
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs, "new group sizes or the other operand recompiled the gather"


@pytest.mark.parametrize("flatten", ["compiled", "triton"])
def test_blockwise_experts_train_as_with_the_copies_when_one_kernel_lays_out_the_wgrad_operands(flatten):
    """Three steps of two micro-batches of the MoE layer on DeepGEMM, weight gradients into autograd's .grad, with
    wgrad_flatten compiled or triton against the copies (the default): losses and parameters bit for bit, as all lay
    out the same bytes for DeepGEMM's K-grouped kernel (the copies' run repeats itself first: the comparison assumes
    deterministic kernels). Each routing has new group sizes: the gather compiles once."""
    _kernels_or_skip("deepgemm")

    def train(wgrad_flatten: str) -> tuple[list[float], list[torch.Tensor]]:
        moe = _moe_layer("deepgemm", fp8_dispatch=False)
        moe.experts.blockwise_kernels = deepgemm.DeepGemmKernels(wgrad_flatten=wgrad_flatten)
        return _train_three_steps(moe)

    copies, again, laid_out = (train(choice) for choice in ("copies", "copies", flatten))
    assert again[0] == copies[0], "the copies' run does not repeat itself: bit-for-bit comparisons cannot hold"
    assert laid_out[0] == copies[0], (laid_out[0], copies[0])
    assert all(torch.equal(a, b) for a, b in zip(laid_out[1], copies[1], strict=True))


# ---- quantizer te: TE's Float8BlockQuantizer kernel for the activations and gradients, on DeepGEMM ----------

def _te_quantizer_or_skip():
    from fp8stack.backends import te_quant

    make, why = te_quant.load()
    if make is None or "deepgemm" not in KERNELS:
        pytest.skip(why or "quantizer te runs with DeepGEMM's kernels, and deep_gemm is not importable")
    return te_quant.TEBlockQuantizer()


def _operand_difference(got: Fp8Tensor, expected: Fp8Tensor) -> dict:
    """How two 1x128 operands of one input differ: codes (how many, largest step between codes), scales (how many,
    largest distance in FP32 ulps), and the rows of the operand's data holding a differing code."""
    assert got.data.shape == expected.data.shape and got.scale.shape == expected.scale.shape
    steps = (got.data.view(torch.uint8).int() - expected.data.view(torch.uint8).int()).abs()
    ulps = (got.scale.contiguous().view(torch.int32).long() - expected.scale.contiguous().view(torch.int32).long())
    rows = steps.amax(dim=1).nonzero().flatten()
    return {"codes": int((steps > 0).sum()), "elements": steps.numel(), "step": int(steps.max()),
            "scales": int((ulps != 0).sum()), "ulps": int(ulps.abs().max()), "rows": rows[:6].tolist(),
            "row_count": rows.numel()}


def _difference_line(name: str, d: dict) -> str:
    more = ", ..." if d["row_count"] > len(d["rows"]) else ""
    return (f"{name}: {d['codes']} of {d['elements']} codes differ ({d['codes'] / d['elements']:.4%}), largest step "
            f"{d['step']}; {d['scales']} scales differ, by up to {d['ulps']} ulps; {d['row_count']} rows with a "
            f"differing code: {d['rows']}{more}")


def test_te_quantizer_operands_match_the_reference():
    """TE's kernel (exact scales, force_pow_2_scales off) against the reference quantizer, eager and compiled, on a
    buffer whose columns span 6 decades, in DeepGEMM's layouts: the same bytes, codes and scales (quantize_1x128
    follows TE's arithmetic: codes E4M3(x * (448 / amax)), scales 1 / (448 / amax); dividing by amax / 448 instead
    flipped ~0.03% of BF16 codes at rounding ties)."""
    from fp8stack.backends import fp8_quant
    from fp8stack.backends.grouped import AlignedTokenGroups

    quantizer = _te_quantizer_or_skip()
    torch.manual_seed(0)
    x = torch.randn(640, 1024, device=DEVICE, dtype=torch.bfloat16) * torch.logspace(
        -3, 3, 1024, device=DEVICE, dtype=torch.bfloat16)
    groups = AlignedTokenGroups(offsets_of([256, 0, 384]), 640, 128)
    rows, cols = quantizer.quantize_both_1x128(groups, x)
    compiled_rows, compiled_cols = fp8_quant.pad_quantize_both_1x128(x, 128)
    comparisons = {"rows vs eager": (rows, quantize_1x128(x)), "columns vs eager": (cols, quantize_1x128(x.t())),
                   "rows vs compiled": (rows, compiled_rows), "columns vs compiled": (cols, compiled_cols)}
    differences = {name: _operand_difference(*pair) for name, pair in comparisons.items()}
    report = "\n".join(_difference_line(name, d) for name, d in differences.items())
    same_bytes = all(d["codes"] == 0 and d["scales"] == 0 for d in differences.values())
    assert same_bytes, report
    assert rows.scale.stride() == (1, 640)  # MN-major: DeepGEMM takes it without transposing
    only_rows = quantizer.quantize_rows_1x128(groups, x)
    only_cols = quantizer.quantize_cols_1x128(groups, x)
    assert torch.equal(only_rows.data.view(torch.uint8), rows.data.view(torch.uint8))
    assert torch.equal(only_cols.data.view(torch.uint8), cols.data.view(torch.uint8))


@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_te_quantizer_moe_layer_matches_the_inductor_quantizer(fp8_dispatch):
    """A DeepSeek-style MoE layer with quantizer te against the same layer with the default quantizer: the MoE's
    buffer is whole tiles (TE reads it as it is), and the two quantizers write the same bytes, so the results differ
    by the layer's atomics at most (its gather's backward). test_te_quantizer_operands_in_the_moe_layer says which
    operand differs where this fails."""
    quantizer = _te_quantizer_or_skip()
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    te_moe = _moe_layer("deepgemm", fp8_dispatch)
    te_moe.experts.blockwise_quantizer = quantizer
    te_rows, _ = _step(te_moe, x, grad)
    inductor_rows, _ = _step(_moe_layer("deepgemm", fp8_dispatch), x, grad)
    names = ["y", "x", *(name for name, _ in te_moe.named_parameters())]
    for name, got, expected in zip(names, te_rows, inductor_rows, strict=True):
        assert rel_err(got, expected) < 1e-3, name


class ComparingQuantizer:
    """TE's quantizer, whose operands the layer runs on, checked call by call against the inductor quantizer on the
    same input: `differences` holds, per GEMM operand (labels in call order), how the two differ on the rows the GEMMs
    read (the groups': past them each quantizes whatever the kernels left there)."""

    name = "te"

    def __init__(self, te, labels: list[str]):
        self.te, self.labels, self.differences = te, list(labels), []

    def quantize_rows_1x128(self, groups, x):
        got = self.te.quantize_rows_1x128(groups, x)
        self._compare(groups, ["rows"], [got], [INDUCTOR_QUANTIZER.quantize_rows_1x128(groups, x)])
        return got

    def quantize_cols_1x128(self, groups, x):
        got = self.te.quantize_cols_1x128(groups, x)
        self._compare(groups, ["columns"], [got], [INDUCTOR_QUANTIZER.quantize_cols_1x128(groups, x)])
        return got

    def quantize_both_1x128(self, groups, x):
        got = self.te.quantize_both_1x128(groups, x)
        self._compare(groups, ["rows", "columns"], got, INDUCTOR_QUANTIZER.quantize_both_1x128(groups, x))
        return got

    def _compare(self, groups, forms, got, expected) -> None:
        end = int(groups.offsets[-1])
        label = self.labels.pop(0) if self.labels else f"unexpected call {len(self.differences)}"
        for form, a, b in zip(forms, got, expected, strict=True):
            if form == "rows":  # data [R, K], scales [R, K/128]
                a, b = (Fp8Tensor(t.data[:end], t.scale[:end]) for t in (a, b))
            else:  # data x^T [K, R], scales [K, R/128]
                a, b = (Fp8Tensor(t.data[:, :end], t.scale[:, :end // 128]) for t in (a, b))
            self.differences.append((f"{label}, {form}", _operand_difference(a, b)))


@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_te_quantizer_operands_in_the_moe_layer_are_the_inductor_quantizers(fp8_dispatch):
    """Localises test_te_quantizer_moe_layer_matches_the_inductor_quantizer: in the same MoE layer, every input the
    experts quantize goes through TE's kernel (the layer's operands) and through the inductor quantizer, which must
    write the same bytes on the rows the GEMMs read. The failure message lists, per GEMM operand, the codes that
    differ (how many, largest step), the scales (how many, by how many FP32 ulps) and the rows holding them, then
    the rows of y farthest from the inductor layer's."""
    labels = ["w13's x (fprop, wgrad)"] if not fp8_dispatch else []  # the FP8 dispatch quantizes the tokens itself
    labels += ["w2's h (fprop, wgrad)", "w2's output gradient (dgrad, wgrad)", "w13's output gradient (dgrad, wgrad)"]
    comparing = ComparingQuantizer(_te_quantizer_or_skip(), labels)
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    te_moe = _moe_layer("deepgemm", fp8_dispatch)
    te_moe.experts.blockwise_quantizer = comparing
    te_y = _step(te_moe, x, grad)[0][0].float()
    inductor_y = _step(_moe_layer("deepgemm", fp8_dispatch), x, grad)[0][0].float()
    per_row = (te_y - inductor_y).abs().amax(dim=1)
    worst = per_row.topk(3).indices.tolist()
    report = "\n".join([*(_difference_line(name, d) for name, d in comparing.differences),
                        f"y: rel. error {rel_err(te_y, inductor_y):.2e}, {int((per_row > 0).sum())} of {len(per_row)} "
                        "rows differ; farthest: " + "; ".join(
                            f"row {r} by {per_row[r]:.3g}: {te_y[r, :3].tolist()} vs {inductor_y[r, :3].tolist()}"
                            for r in worst)])
    assert not comparing.labels and len(comparing.differences) == 2 * len(labels), report
    same_bytes = all(d["codes"] == 0 and d["scales"] == 0 for _, d in comparing.differences)
    assert same_bytes, report
    assert rel_err(te_y, inductor_y) < 1e-3, report


@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["bf16-dispatch", "fp8-dispatch"])
def test_converted_moe_llama_trains_with_the_te_quantizer(fp8_dispatch):
    """GroupedFP8Backend(quantizer="te") on DeepGEMM: the conversion notes it, and the tiny MoE Llama trains as
    test_converted_moe_llama_trains does."""
    _te_quantizer_or_skip()
    model, notes = _trains_close_to_bf16("blockwise", GroupedFP8Backend(kernels="deepgemm", quantizer="te",
                                                                        fp8_dispatch=fp8_dispatch))
    assert any(note.startswith("quantizer te") for note in notes)
    assert "quantizer=te" in repr(model.layers[1].moe.experts)
