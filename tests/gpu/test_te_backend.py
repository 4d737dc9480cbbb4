"""The te backend on a GPU: converted Linear / GroupedExperts against references, the tiny Llama
(dense and MoE) training, DelayedScaling state per module, the plan's fusions, a model built on 'meta'.
Run with `pytest -m gpu tests/gpu/test_te_backend.py`."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from fp8stack.models import load_model_config
from fp8stack import OrderingError, assemble
from fp8stack.backends.fused import FoldedNorm
from fp8stack.backends.te import DELAYED_AMAX_HISTORY_LEN, TE_RECIPES, TEBackend, te_recipe
from fp8stack.models import GroupedExperts, Llama
from fp8stack.plan import PolicyConfig, description_from_dict, load_description, make_plan
from fp8stack.plan.recipes import FP8_FORMATS, get_recipe

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["tensorwise"])  # its tests run FP8

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as te_recipes  # noqa: E402
from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx  # noqa: E402
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

REL_ERR_BOUNDS = {
    "delayed": {"out": 0.07, "grad_e4m3": 0.07, "grad_hybrid": 0.12},
    "tensorwise": {"out": 0.07, "grad_e4m3": 0.07, "grad_hybrid": 0.12},
    "blockwise": {"out": 0.07, "grad_e4m3": 0.07, "grad_hybrid": 0.12},
    "mxfp8": {"out": 0.07, "grad_e4m3": 0.07, "grad_hybrid": 0.12},
}
"""Upper bounds on ||fp8 - ref|| / ||ref|| for one converted Linear against an FP32 reference on the
same BF16 inputs and weights: the output, and the input and weight gradients (E4M3 gradients with
fp8_format e4m3, E5M2 with hybrid). Rounding a Gaussian operand to E4M3 (3 mantissa bits) costs about
2.5% rms, to E5M2 (2 bits) about 5%; a GEMM of two rounded operands lands near 3.5% (E4M3 x E4M3) or
5.5% (E5M2 x E4M3). Every scaling (per tensor, 1x128/128x128 blocks, 1x32 MXFP8 blocks) keeps the
mantissa, so the bounds, about twice those figures, are the same for every recipe. The second of two
steps is measured: DelayedScaling's first step runs with scale 1 before any amax is known."""

EXPERT_BOUND_FACTOR = 2.0
"""GroupedExperts runs two FP8 GEMMs with a SwiGLU between, so its errors compound: bounds x this."""

MIN_FP8_REL_ERR = 0.01
"""A BF16 GEMM lands near 0.002 from the FP32 reference; an error below this means FP8 did not run."""

FUSE_NORM_REL_ERR = 0.05
"""Fused RMSNorm casts its FP32 result to FP8 directly, unfused rounds to BF16 first: a few FP8 values
differ by one step, so the tiny Llama's logits differ by ~1%, not more."""


def _recipe_formats() -> list:
    params = []
    for recipe in TE_RECIPES:
        ok, why = TEBackend().available([recipe])
        for fp8_format in FP8_FORMATS:
            params.append(pytest.param(recipe, fp8_format, id=f"{recipe}-{fp8_format}",
                                       marks=() if ok else pytest.mark.skip(reason=why)))
    return params


RECIPE_FORMATS = _recipe_formats()


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    """TE keeps every delayed-scaling module's amax buffers in process-global state: drop them between tests."""
    yield
    FP8GlobalStateManager.reset()


class Holder(nn.Module):
    """Puts modules at layers.0.<name>: the fqns of a one-block model description."""

    def __init__(self, **modules: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict(modules)])


def one_block(*components: dict):
    return description_from_dict({"name": "one-block", "seq_len": 128, "blocks": {"dense": list(components)},
                                  "layers": [{"block": "dense"}]})


def policy(recipe: str, fp8_format: str, fuse_norm: bool = False, fuse_mlp: bool = False,
           head_on_te: bool | None = False) -> PolicyConfig:
    """Every GEMM but the head's on TE; norms fused only when asked (the tests compare fused against unfused)."""
    return PolicyConfig(recipe=recipe, fp8_format=fp8_format, backend="te", small_gemm_filter="off",
                        arch=100 if recipe == "mxfp8" else 90, expert_backend="te", fuse_norm=fuse_norm,
                        fuse_mlp=fuse_mlp, head_on_te=head_on_te)


PLAIN = {"cache_fp8_weights": False, "fuse_wgrad_accumulation": False}
"""TEBackend options for modules that cast their weights at every forward and hand autograd their gradients."""


def convert(model: nn.Module, description, recipe: str, fp8_format: str, **options):
    plan = make_plan(description, policy(recipe, fp8_format))
    return TEBackend(**{**PLAIN, **options}).convert(model, plan.for_backend("te"), plan)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def forward_backward(module: nn.Module, inputs: tuple, grad: torch.Tensor, params: list[torch.Tensor]):
    """(output, input grad, [param grads]) of one step with upstream gradient `grad`."""
    x = inputs[0].detach().requires_grad_()
    for p in params:
        p.grad = None
    out = module(x, *inputs[1:])
    out.backward(grad)
    return out.detach(), x.grad, [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def check_errors(label: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor, float]]) -> None:
    for name, got, ref, bound in pairs:
        err = rel_err(got, ref)
        assert MIN_FP8_REL_ERR < err < bound, (
            f"{label} {name}: relative error {err:.4f} outside ({MIN_FP8_REL_ERR}, {bound:.3f})")


def test_te_recipe_objects():
    delayed = te_recipe("delayed", "hybrid")
    assert isinstance(delayed, te_recipes.DelayedScaling)
    assert (delayed.amax_history_len, delayed.amax_compute_algo, delayed.margin) == (
        DELAYED_AMAX_HISTORY_LEN, "most_recent", 0)
    assert te_recipe("delayed", "hybrid", delayed_margin=2).margin == 2  # Megatron's --fp8-margin
    classes = {"tensorwise": te_recipes.Float8CurrentScaling, "blockwise": te_recipes.Float8BlockScaling,
               "mxfp8": te_recipes.MXFP8BlockScaling}
    for name, cls in classes.items():
        for fp8_format, fmt in (("e4m3", te_recipes.Format.E4M3), ("hybrid", te_recipes.Format.HYBRID)):
            made = te_recipe(name, fp8_format)
            assert isinstance(made, cls) and made.fp8_format == fmt


def test_available_passes_te_reasons():
    for recipe, check in (("blockwise", te.is_fp8_block_scaling_available), ("mxfp8", te.is_mxfp8_available)):
        te_ok, te_why = check(return_reason=True)
        ok, why = TEBackend().available([recipe])
        assert ok == te_ok
        assert ok or te_why in why


@pytest.mark.parametrize("in_features, out_features", [(512, 1024), (2048, 4096)])
@pytest.mark.parametrize("recipe, fp8_format", RECIPE_FORMATS)
def test_linear_matches_reference(recipe, fp8_format, in_features, out_features):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, device="cuda", dtype=torch.bfloat16)
    description = one_block({"name": "proj", "kind": "linear", "n": out_features, "k": in_features})
    model, record = convert(Holder(proj=linear), description, recipe, fp8_format)
    converted = model.layers[0].proj
    assert record.converted == {"layers.0.proj": "TELinear"} and record.recipe == recipe
    assert isinstance(converted, te.Linear)
    assert torch.equal(converted.weight, linear.weight) and torch.equal(converted.bias, linear.bias)
    assert converted.weight.dtype == torch.bfloat16

    x = torch.randn(4, 128, in_features, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(4, 128, out_features, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        out, dx, (dw,) = forward_backward(converted, (x,), grad, [converted.weight])
    assert converted.fp8, "the module's forward did not run in FP8"
    assert not FP8GlobalStateManager.is_fp8_enabled(), "the FP8 autocast leaked out of the module"

    x32, w32, g32 = x.float(), linear.weight.float(), grad.float()
    reference = (x32 @ w32.T + linear.bias.float(), g32 @ w32, g32.flatten(0, 1).T @ x32.flatten(0, 1))
    bf16 = forward_backward(linear, (x,), grad, [linear.weight])
    for got, ref in zip((bf16[0], bf16[1], bf16[2][0]), reference):
        assert rel_err(got, ref) < MIN_FP8_REL_ERR, "the BF16 Linear should be far closer than FP8"
    bounds = REL_ERR_BOUNDS[recipe]
    grad_bound = bounds[f"grad_{fp8_format}"]
    check_errors(f"{recipe}/{fp8_format} {in_features}->{out_features}", [
        ("output", out, reference[0], bounds["out"]),
        ("input grad", dx, reference[1], grad_bound),
        ("weight grad", dw, reference[2], grad_bound),
    ])


@pytest.mark.parametrize("recipe, fp8_format", RECIPE_FORMATS)  # blockwise too: policy() has expert_backend=te
def test_grouped_experts_match_bf16(recipe, fp8_format):
    num_experts, dim, hidden = 4, 512, 256
    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = GroupedExperts(dim, hidden, num_experts)
    experts.init_weights(0.02)
    experts = experts.to(torch.bfloat16)
    description = one_block(
        {"name": "moe.experts.w13", "kind": "expert", "n": 2 * hidden, "k": dim, "experts": num_experts, "active": 2},
        {"name": "moe.experts.w2", "kind": "expert", "n": dim, "k": hidden, "experts": num_experts, "active": 2})
    model, record = convert(Holder(moe=nn.ModuleDict({"experts": experts})), description, recipe, fp8_format)
    converted = model.layers[0].moe.experts
    assert record.converted == {"layers.0.moe.experts.w13": "TEGroupedExperts",
                                "layers.0.moe.experts.w2": "TEGroupedExperts"}
    fc1 = [getattr(converted.fc1, f"weight{e}") for e in range(num_experts)]
    fc2 = [getattr(converted.fc2, f"weight{e}") for e in range(num_experts)]
    for e in range(num_experts):
        assert torch.equal(fc1[e], experts.w13[e]) and torch.equal(fc2[e], experts.w2[e])
    assert converted.group_alignment == (32 if recipe == "mxfp8" else 16)

    # Expert 1 gets no rows; 40 and 120 are not multiples of 16 (TE pads them); 8 padding rows at the end.
    counts = [40, 0, 96, 120]
    rows = sum(counts)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(rows + 8, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows + 8, dim, device="cuda", dtype=torch.bfloat16)
    grad[rows:] = 0  # rows past offsets[-1] are padding: their output is unspecified in GroupedExperts
    for _ in range(2):
        out, dx, dws = forward_backward(converted, (x, offsets), grad, fc1 + fc2)
    assert torch.count_nonzero(out[rows:]) == 0
    dw13, dw2 = torch.stack(dws[:num_experts]), torch.stack(dws[num_experts:])
    assert torch.count_nonzero(dw13[1]) == 0 and torch.count_nonzero(dw2[1]) == 0, \
        "an expert without rows must get a zero gradient (TE allocates wgrads with torch.empty)"

    ref_out, ref_dx, (ref_dw13, ref_dw2) = forward_backward(experts, (x, offsets), grad, [experts.w13, experts.w2])
    bounds = {k: v * EXPERT_BOUND_FACTOR for k, v in REL_ERR_BOUNDS[recipe].items()}
    grad_bound = bounds[f"grad_{fp8_format}"]
    check_errors(f"experts {recipe}/{fp8_format}", [
        ("output", out[:rows], ref_out[:rows], bounds["out"]),
        ("input grad", dx[:rows], ref_dx[:rows], grad_bound),
        ("w13 grad", dw13, ref_dw13, grad_bound),
        ("w2 grad", dw2, ref_dw2, grad_bound),
    ])


@pytest.mark.parametrize("fp8_format", FP8_FORMATS)
def test_delayed_scaling_scales_follow_each_modules_own_amax(fp8_format):
    """Each module's autocast exit updates every delayed-scaling module; with a one-entry history
    each scale must still come from that module's own latest amax, step after step."""
    torch.manual_seed(0)
    a, b = (nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    description = one_block({"name": "a", "kind": "linear", "n": 256, "k": 256},
                            {"name": "b", "kind": "linear", "n": 256, "k": 256})
    model, _ = convert(Holder(a=a, b=b), description, "delayed", fp8_format)
    te_a, te_b = model.layers[0].a, model.layers[0].b
    fwd_max, bwd_max = 448.0, (448.0 if fp8_format == "e4m3" else 57344.0)

    for magnitude_a, magnitude_b in ((1.0, 100.0), (4.0, 0.25), (0.5, 8.0)):
        x_a = magnitude_a * torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        x_b = magnitude_b * torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        g_a, g_b = (torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * s for s in (3.0, 0.01))
        out_a = te_a(x_a)
        assert not FP8GlobalStateManager.is_fp8_enabled()
        out_b = te_b(x_b)
        ((out_a.float() * g_a).sum() + (out_b.float() * g_b).sum()).backward()
        for module, x, g in ((te_a, x_a, g_a), (te_b, x_b, g_b)):
            fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
            assert fwd.amax_history.shape[0] == DELAYED_AMAX_HISTORY_LEN
            expected = {
                "input": (fwd.scale[FP8FwdTensorIdx.GEMM1_INPUT], fwd_max / x.abs().max().float()),
                "weight": (fwd.scale[FP8FwdTensorIdx.GEMM1_WEIGHT], fwd_max / module.weight.abs().max().float()),
                "grad output": (bwd.scale[FP8BwdTensorIdx.GRAD_OUTPUT1], bwd_max / g.abs().max().float()),
            }
            for name, (scale, want) in expected.items():
                torch.testing.assert_close(scale, want, rtol=1e-3, atol=0,
                                           msg=lambda m, n=name: f"{n} scale after magnitudes "
                                                                 f"({magnitude_a}, {magnitude_b}): {m}")


def _same_weights(new: nn.Module, old: nn.Module, converted: dict[str, str]) -> None:
    new_modules, old_modules = dict(new.named_modules()), dict(old.named_modules())
    for fqn, cls in converted.items():
        if cls == "TEGroupedExperts":
            module_fqn, _, half = fqn.rpartition(".")
            gl = new_modules[module_fqn].fc1 if half == "w13" else new_modules[module_fqn].fc2
            weights = getattr(old_modules[module_fqn], half)
            assert all(torch.equal(getattr(gl, f"weight{e}"), weights[e]) for e in range(len(weights))), fqn
        elif cls == "TELinear":
            assert torch.equal(new_modules[fqn].weight, old_modules[fqn].weight), fqn


def _train(model: Llama, tokens: torch.Tensor, steps: int = 5) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = Llama.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model_name, config", [("tiny", load_model_config("tiny")), ("tiny-moe", load_model_config("tiny-moe"))],
                         ids=["dense", "moe"])
@pytest.mark.parametrize("recipe", list(TE_RECIPES))
def test_tiny_llama_trains(model_name, config, recipe):
    ok, why = TEBackend().available([recipe])
    if not ok:
        pytest.skip(why)
    torch.manual_seed(0)
    with torch.device("cuda"):
        bf16 = Llama(config).to(torch.bfloat16)
    plan = make_plan(load_description(model_name), policy(recipe, "hybrid"))
    rng = torch.cuda.get_rng_state()
    fp8, record = TEBackend().convert(copy.deepcopy(bf16), plan.for_backend("te"), plan)
    assert torch.equal(torch.cuda.get_rng_state(), rng), "converting must not draw from the CUDA RNG"
    assert set(record.converted) == {d.fqn for d in plan.for_backend("te")}
    assert set(record.converted.values()) <= {"TELinear", "TEGroupedExperts"}
    assert any(note.startswith("cache_fp8_weights:") for note in record.notes), record.notes
    _same_weights(fp8, bf16, record.converted)

    modules = dict(fp8.named_modules())
    fp8_seen = []
    for name in ("tok_embeddings", "layers.0.attention_norm", "layers.0.attention", "norm", "output"):
        modules[name].register_forward_pre_hook(
            lambda module, args, name=name: fp8_seen.append((name, FP8GlobalStateManager.is_fp8_enabled())))

    tokens = torch.randint(0, config.vocab_size, (4, 129), device="cuda")
    fp8_losses, bf16_losses = _train(fp8, tokens), _train(bf16, tokens)
    assert fp8_seen and not any(enabled for _, enabled in fp8_seen), f"BF16 modules ran inside FP8: {fp8_seen}"
    te_modules = [m for m in fp8.modules() if isinstance(m, TransformerEngineBaseModule)]
    assert te_modules and all(m.fp8 for m in te_modules)
    assert all(torch.isfinite(torch.tensor(fp8_losses))), fp8_losses
    assert fp8_losses[-1] < fp8_losses[0], f"FP8 loss did not go down: {fp8_losses}"
    gaps = [abs(f - b) for f, b in zip(fp8_losses, bf16_losses)]
    assert max(gaps) < 0.2, f"FP8 {fp8_losses} strays from BF16 {bf16_losses}"


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fuse_norm_matches_unfused(recipe):
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = Llama(load_model_config("tiny")).to(torch.bfloat16)
    description = load_description("tiny")
    plan = make_plan(description, policy(recipe, "hybrid", head_on_te=None))
    fused_plan = make_plan(description, policy(recipe, "hybrid", fuse_norm=True, head_on_te=None))
    unfused, _ = TEBackend(**PLAIN).convert(copy.deepcopy(base), plan.for_backend("te"), plan)
    fused, record = TEBackend(**PLAIN).convert(copy.deepcopy(base), fused_plan.for_backend("te"), fused_plan)
    for i, (layer, original) in enumerate(zip(fused.layers, base.layers)):
        for norm, linear in (("attention_norm", "attention.wqkv"), ("ffn_norm", "feed_forward.w13")):
            assert record.converted[f"layers.{i}.{linear}"] == "TELayerNormLinear"
            assert isinstance(layer.get_submodule(norm), FoldedNorm)
            fused_linear = layer.get_submodule(linear)
            assert torch.equal(fused_linear.layer_norm_weight, original.get_submodule(norm).weight)
            assert torch.equal(fused_linear.weight, original.get_submodule(linear).weight)
            assert fused_linear.eps == original.get_submodule(norm).eps
        assert record.converted[f"layers.{i}.attention.wo"] == "TELinear"
    assert record.converted["output"] == "TELayerNormLinear"  # the final norm folds into the head (BF16, on TE)
    assert any(note.startswith("fused norms: 9 norm(s) folded into TE LayerNormLinear") for note in record.notes)

    tokens = torch.randint(0, 256, (4, 128), device="cuda")
    for _ in range(2):  # grad mode on, so DelayedScaling's scales update after the first pass
        logits_fused, logits_unfused = fused(tokens), unfused(tokens)
    err = rel_err(logits_fused, logits_unfused)
    assert err < FUSE_NORM_REL_ERR, f"fused vs unfused logits: relative difference {err:.4f}"
    loss = Llama.loss(logits_fused[:, :-1], tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)


@pytest.mark.parametrize("fuse", [False, True], ids=["linears", "fused-norms-and-mlps"])
def test_converting_lets_go_of_the_replaced_weights(fuse):
    """TE keeps each module's init_method for later reset_parameters calls; the one that copies the replaced
    module's weights must not keep them alive (it once did: +3.7 GiB on llama-1b-like,
    profiles/archive/2026-11-25-ab-fp8-params-init-leak-h100/)."""
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), policy("tensorwise", "hybrid", fuse_norm=fuse, fuse_mlp=fuse))
    before = [weakref.ref(p) for p in model.parameters()]
    model, record = TEBackend().convert(model, plan.for_backend("te"), plan)
    assert record.converted
    gc.collect()
    kept = {id(p) for p in model.parameters()}
    alive = [ref() for ref in before if ref() is not None and id(ref()) not in kept]
    assert not alive, f"{len(alive)} replaced parameter(s) still referenced, e.g. of shape {tuple(alive[0].shape)}"


FUSE_MLP_REL_ERR = 0.05
"""LayerNormMLP computes SwiGLU in FP32 from FC1's BF16 output and casts once; torch rounds silu(gate) and the
product to BF16 first: as with fuse_norm, a few FP8 values move by one step. A wrong gate/up order or a
missing norm weight would differ by O(1)."""


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fuse_mlp_matches_unfused(recipe):
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = Llama(load_model_config("tiny")).to(torch.bfloat16)
    fmt = get_recipe(recipe).default_format
    plan = make_plan(load_description("tiny"), policy(recipe, fmt, fuse_norm=True))
    mlp_plan = make_plan(load_description("tiny"), policy(recipe, fmt, fuse_norm=True, fuse_mlp=True))
    unfused, _ = TEBackend(**PLAIN).convert(copy.deepcopy(base), plan.for_backend("te"), plan)
    fused, record = TEBackend(**PLAIN).convert(copy.deepcopy(base), mlp_plan.for_backend("te"), mlp_plan)
    for i, (layer, original) in enumerate(zip(fused.layers, base.layers)):
        assert isinstance(layer.ffn_norm, FoldedNorm)
        assert record.converted[f"layers.{i}.feed_forward.w13"] == record.converted[f"layers.{i}.feed_forward.w2"] \
            == "TELayerNormMLP"
        assert record.converted[f"layers.{i}.attention.wqkv"] == "TELayerNormLinear"
        mlp = layer.feed_forward
        assert torch.equal(mlp.layer_norm_weight, original.ffn_norm.weight)
        assert torch.equal(mlp.fc1_weight, original.feed_forward.w13.weight)
        assert torch.equal(mlp.fc2_weight, original.feed_forward.w2.weight)
        assert (mlp.activation, mlp.normalization, mlp.eps) == ("swiglu", "RMSNorm", original.ffn_norm.eps)
    assert any(note.startswith("fused MLPs: 4 norm + SwiGLU MLP(s)") for note in record.notes), record.notes
    assert any(note.startswith("fused norms: 4 norm(s)") for note in record.notes), record.notes

    tokens = torch.randint(0, 256, (4, 128), device="cuda")
    for _ in range(2):  # DelayedScaling's first pass runs with scale 1 (its gradients underflow): compare the second
        for model in (fused, unfused):
            model.zero_grad(set_to_none=True)
        logits_fused, logits_unfused = fused(tokens), unfused(tokens)
        Llama.loss(logits_fused[:, :-1], tokens[:, 1:]).backward()
        Llama.loss(logits_unfused[:, :-1], tokens[:, 1:]).backward()
    err = rel_err(logits_fused, logits_unfused)
    assert err < FUSE_MLP_REL_ERR, f"LayerNormMLP vs unfused logits: relative difference {err:.4f}"
    for i in range(len(fused.layers)):
        got, ref = fused.layers[i].feed_forward.fc1_weight.grad, unfused.layers[i].feed_forward.w13.weight.grad
        assert rel_err(got, ref) < 2 * FUSE_MLP_REL_ERR, f"layer {i} FC1 weight gradient: {rel_err(got, ref):.4f}"


BF16_ON_TE_REL_ERR = 0.02
"""TE's BF16 GEMMs against torch's on the same BF16 weights: both cuBLAS, the same math up to the kernel's
summation order and TE's RMSNorm (FP32 inside, like torch's): well under 1% on the logits; FP8 lands near 5%."""


@pytest.mark.parametrize("model_name, fuse", [("tiny", False), ("tiny", True), ("tiny-moe", False)])
def test_a_bf16_plan_on_te_runs_te_modules_without_fp8(model_name, fuse):
    """Recipe bf16 with backend te (the BF16 baseline on TE's kernels): every linear and expert GEMM is a TE
    module, none runs inside an FP8 autocast, and the logits are the plain BF16 model's up to summation order."""
    torch.manual_seed(0)
    config = load_model_config("tiny") if model_name == "tiny" else load_model_config("tiny-moe")
    with torch.device("cuda"):
        base = Llama(config).to(torch.bfloat16)
    plan = make_plan(load_description(model_name), PolicyConfig(recipe="bf16", backend="te", small_gemm_filter="off",
                                                                fuse_norm=fuse, fuse_mlp=fuse))
    assert plan.for_backend("te") and {d.recipe for d in plan.for_backend("te")} == {"bf16"}
    on_te, record = TEBackend().convert(copy.deepcopy(base), plan.for_backend("te"), plan)
    te_modules = [m for m in on_te.modules() if isinstance(m, TransformerEngineBaseModule)]
    assert te_modules and set(record.converted) >= {d.fqn for d in plan.for_backend("te")}
    fp8_seen = []
    for module in te_modules:
        module.register_forward_pre_hook(lambda *_: fp8_seen.append(FP8GlobalStateManager.is_fp8_enabled()))
    tokens = torch.randint(0, 256, (4, 128), device="cuda")
    with torch.no_grad():
        err = rel_err(on_te(tokens), base(tokens))
    assert fp8_seen and not any(fp8_seen), "a TE module of the bf16 plan ran inside an FP8 autocast"
    assert err < BF16_ON_TE_REL_ERR, f"logits {err:.4f} from the plain BF16 model's"


WGRAD_FUSION_REL_ERR = 0.02
"""Fused, each wgrad GEMM adds its FP32 result into main_grad; unfused, autograd rounds each micro-batch's weight
gradient to BF16 (the activations' dtype) and torch adds it in FP32: a few 0.1% apart. A gradient counted twice
(main_grad and an autograd .grad) or a lost micro-batch would be 33-100% off."""


@pytest.mark.parametrize("model_name, recipe, fuse_mlp", [
    ("tiny", "delayed", True), ("tiny", "tensorwise", True), ("tiny", "tensorwise", False),
    ("tiny-moe", "tensorwise", False)])
def test_fused_wgrad_accumulation_matches_autograd(model_name, recipe, fuse_mlp):
    """With fuse_wgrad_accumulation the TE weights' .grad is their FP32 main_grad, holding over two micro-batches
    what autograd accumulates unfused; zero_grad(set_to_none=True) starts the next sum from zero (the next forward
    zeroes main_grad), zero_grad(set_to_none=False) zeroes it in place."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # FP32 master weights under BF16 autocast, as the trainer runs them
        base = Llama(load_model_config("tiny") if model_name == "tiny" else load_model_config("tiny-moe"))
    plan = make_plan(load_description(model_name), policy(recipe, get_recipe(recipe).default_format,
                                                          fuse_norm=fuse_mlp, fuse_mlp=fuse_mlp))
    unfused, _ = TEBackend(**PLAIN).convert(copy.deepcopy(base), plan.for_backend("te"), plan)
    fused, record = TEBackend(cache_fp8_weights=False, fuse_wgrad_accumulation=True).convert(
        copy.deepcopy(base), plan.for_backend("te"), plan)
    weights = {name: p for name, p in fused.named_parameters() if hasattr(p, "main_grad")}
    gemm_weights = {f"{fqn}.{name}" for fqn, m in fused.named_modules() if isinstance(m, TransformerEngineBaseModule)
                    for name, _ in m.named_parameters(recurse=False) if "layer_norm" not in name}
    assert gemm_weights and set(weights) == gemm_weights
    assert any(f"of {len(weights)} TE weight(s) accumulate" in note for note in record.notes), record.notes
    unfused_params = dict(unfused.named_parameters())
    batches = torch.randint(0, 256, (2, 4, 129), device="cuda")

    def accumulate(model: nn.Module, micro_batches: torch.Tensor, set_to_none: bool = True) -> None:
        model.zero_grad(set_to_none=set_to_none)
        for tokens in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = Llama.loss(model(tokens[:, :-1]), tokens[:, 1:])
            (loss / len(micro_batches)).backward()

    def check(what: str) -> None:
        for name, weight in weights.items():
            assert weight.grad is weight.main_grad, f"{name}: .grad is not its main_grad"
            err = rel_err(weight.grad, unfused_params[name].grad)
            assert err < WGRAD_FUSION_REL_ERR, f"{what}: {name} gradient {err:.4f} from autograd's"

    for model in (fused, unfused):  # DelayedScaling's first pass runs with scale 1: its gradients flush
        accumulate(model, batches)
    for model in (fused, unfused):
        accumulate(model, batches)
    check("two micro-batches after zero_grad(set_to_none=True)")
    accumulate(fused, batches[:1], set_to_none=False)
    accumulate(unfused, batches[:1])
    check("one micro-batch after zero_grad(set_to_none=False)")


def test_model_built_on_meta_converts_then_materialises():
    plan = make_plan(load_description("tiny-moe"), policy("tensorwise", "hybrid"))
    with torch.device("meta"):
        model = Llama(load_model_config("tiny-moe"))
    model, record = TEBackend().convert(model, plan.for_backend("te"), plan)
    assert "TEGroupedExperts" in record.converted.values()
    model = model.to_empty(device="cuda")
    model.init_weights()
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 129), device="cuda")
    loss = Llama.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_one_autocast_per_forward_updates_scales_once_per_pass_and_trains_bit_for_bit_as_per_module(monkeypatch):
    """one_autocast_per_forward: one amax and scale update per forward and one per backward, where per-module regions
    update once per module in each; and the same losses: with an amax history of one entry and 'most_recent', a
    per-module update leaves the scale of a module that did not run since as it was (amax 0 keeps the scale), so each
    module casts with the scale from its own previous pass either way."""
    config = load_model_config("tiny")
    plan = make_plan(load_description("tiny"), policy("delayed", "hybrid"))
    tokens = torch.randint(0, config.vocab_size, (4, 129), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    original = FP8GlobalStateManager.reduce_and_update_fp8_tensors.__func__
    runs = {}
    for one_region in (False, True):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Llama(config).to(torch.bfloat16)
        model, record = TEBackend(**PLAIN, one_autocast_per_forward=one_region).convert(
            model, plan.for_backend("te"), plan)
        updates = []
        monkeypatch.setattr(FP8GlobalStateManager, "reduce_and_update_fp8_tensors",
                            classmethod(lambda cls, forward=True: (updates.append(forward), original(cls, forward))))
        runs[one_region] = _train(model, tokens, steps=3), updates, record.notes
        assert not FP8GlobalStateManager.is_fp8_enabled(), "the model's region closed after each forward"
        modules = sum(1 for m in model.modules() if isinstance(m, TransformerEngineBaseModule))
    (per_module, per_module_updates, _), (one, one_updates, notes) = runs[False], runs[True]
    assert one_updates == [True, False] * 3
    assert per_module_updates.count(True) == per_module_updates.count(False) == 3 * modules
    assert any(note.startswith("one_autocast_per_forward: the delayed-scaling modules") for note in notes), notes
    assert one == per_module


def test_one_autocast_per_forward_refuses_recompute():
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), policy("delayed", "hybrid"))
    with pytest.raises(OrderingError, match="one_autocast_per_forward runs the delayed-scaling modules in one autocast "
                                            "region per forward.*drop activation recompute"):
        assemble(model, plan, recompute="all", backend_options={"te": {"one_autocast_per_forward": True}})
