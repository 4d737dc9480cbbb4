"""The torchao backend swaps exactly the planned linears for Float8Linear, keeps their weights, honours
the plan's FP8 format, and the converted model computes what the BF16 model computes, up to FP8 rounding."""

import copy

import pytest
import torch
from torch import nn
from torchao.float8.config import e4m3_dtype, e5m2_dtype
from torchao.float8.float8_linear import Float8Linear

from fp8stack.models import load_model_config
from fp8stack import PolicyConfig, load_description, make_plan
from fp8stack.backends import get_backend
from fp8stack.backends.torchao import TorchaoBackend, _check_swapped_exactly, float8_config
from fp8stack.models import Llama
from fp8stack.plan import Component, Decision, Plan

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
LOSS_RTOL = 1e-3
"""FP8 vs unconverted loss on the tiny Llama at init (observed <= 1e-4: the loss averages FP8
rounding over every token and logit)."""
GRAD_RTOL = 0.15
"""Per-parameter ||g_fp8 - g|| / ||g|| (observed <= 0.07 with E4M3 gradients, <= 0.10 with E5M2:
E5M2 keeps 2 mantissa bits, a relative step of 2^-2, and backward chains several FP8 GEMMs)."""


def tiny_plan(recipe: str = "tensorwise", **policy) -> Plan:
    return make_plan(load_description("tiny"), PolicyConfig(recipe=recipe, small_gemm_filter="off", **policy))


def convert(model: nn.Module, plan: Plan, **options) -> nn.Module:
    model, _ = TorchaoBackend(**options).convert(model, plan.for_backend("torchao"), plan)
    return model


def linear_plan(fqn: str, recipe: str = "tensorwise", fp8_format: str = "hybrid", n: int = 32, k: int = 64) -> Plan:
    decision = Decision(Component(fqn, "linear", n, k), "torchao", recipe, "test")
    return Plan(model="test", recipe=recipe, fp8_format=fp8_format, arch=90, decisions=(decision,))


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(0))


def test_registry_gives_the_torchao_backend():
    backend = get_backend("torchao")
    assert backend.name == "torchao" and backend.available() == (True, "")


def test_swaps_exactly_the_planned_linears():
    plan = tiny_plan(first_last_layers_bf16=True)  # layers 0 and 3 stay BF16
    model = Llama(load_model_config("tiny"))
    before = dict(model.named_modules())
    model, record = TorchaoBackend().convert(model, plan.for_backend("torchao"), plan)
    planned = {d.fqn for d in plan.for_backend("torchao")}
    assert planned == {f"layers.{i}.{name}" for i in (1, 2)
                       for name in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")}
    after = dict(model.named_modules())
    assert {fqn for fqn, m in after.items() if isinstance(m, Float8Linear)} == planned
    assert all(after[fqn] is module for fqn, module in before.items() if fqn not in planned)
    assert type(after["layers.0.attention.wqkv"]) is nn.Linear and type(after["output"]) is nn.Linear
    assert record.backend == "torchao" and record.recipe == "tensorwise"
    assert record.converted == {fqn: "Float8Linear" for fqn in sorted(planned)}


def test_weights_are_kept_bit_exactly():
    model = Llama(load_model_config("tiny"))
    params = dict(model.named_parameters())
    copies = {name: p.detach().clone() for name, p in params.items()}
    model = convert(model, tiny_plan())
    for name, p in model.named_parameters():
        assert p is params[name], f"{name} is a new Parameter"
        assert torch.equal(p, copies[name]), f"{name} changed in the swap"


def test_a_root_linear_is_swapped_in_the_returned_model():
    root = nn.Linear(64, 32)
    weight = root.weight.detach().clone()
    converted, record = TorchaoBackend().convert(root, linear_plan("").for_backend("torchao"), linear_plan(""))
    assert isinstance(converted, Float8Linear) and converted is not root
    assert converted.weight is root.weight and converted.bias is root.bias and torch.equal(converted.weight, weight)
    assert record.converted == {"": "Float8Linear"}
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    assert (converted(x) - root(x)).norm() / root(x).norm() < 0.1  # FP8 rounding, no more


def test_several_recipes_in_one_plan():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    decisions = tuple(Decision(Component(fqn, "linear", 64, 64), "torchao", recipe, "test")
                      for fqn, recipe in (("0", "rowwise"), ("2", "tensorwise")))
    plan = Plan(model="test", recipe="tensorwise", fp8_format="e4m3", arch=90, decisions=decisions)
    model, record = TorchaoBackend().convert(model, list(decisions), plan)
    assert model[0].config.cast_config_weight.short_str() == "dyn_axs_e4m3"
    assert model[2].config.cast_config_weight.short_str() == "dyn_ten_e4m3"
    assert record.recipe == "rowwise, tensorwise"


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
@pytest.mark.parametrize(("fp8_format", "grad_dtype"), [("e4m3", e4m3_dtype), ("hybrid", e5m2_dtype)])
def test_format_sets_the_gradient_dtype(recipe, fp8_format, grad_dtype):
    config = float8_config(recipe, fp8_format)
    assert config.cast_config_input.target_dtype == config.cast_config_weight.target_dtype == e4m3_dtype
    assert config.cast_config_grad_output.target_dtype == grad_dtype
    assert config.cast_config_grad_output_for_grad_weight.target_dtype == grad_dtype
    converted = convert(nn.Sequential(nn.Linear(64, 32)), linear_plan("0", recipe, fp8_format))
    assert converted[0].config.cast_config_grad_output.target_dtype == grad_dtype


def test_the_format_changes_the_gradients(batch):
    """E5M2 and E4M3 gradients round differently: the format reaches the GEMMs, it is not just a label."""
    grads = {}
    for fp8_format in ("e4m3", "hybrid"):
        model = convert(Llama(load_model_config("tiny")), tiny_plan(fp8_format=fp8_format))
        Llama.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads[fp8_format] = model.layers[1].attention.wqkv.weight.grad
    assert not torch.equal(grads["e4m3"], grads["hybrid"])


@pytest.mark.parametrize(("recipe", "fp8_format", "problem"), [
    ("blockwise", "hybrid", "torchao has no 'blockwise' recipe"),
    ("tensorwise", "e5m2", "torchao cannot run FP8 format 'e5m2'"),
])
def test_what_torchao_cannot_run_raises(recipe, fp8_format, problem):
    with pytest.raises(ValueError, match=problem):
        convert(nn.Sequential(nn.Linear(64, 32)), linear_plan("0", recipe, fp8_format))


def test_fsdp_float8_all_gather_is_tensorwise_only():
    plan = linear_plan("0", "rowwise")
    with pytest.raises(ValueError, match="needs tensorwise weight scales, not rowwise"):
        convert(nn.Sequential(nn.Linear(64, 32)), plan, enable_fsdp_float8_all_gather=True)
    model = convert(nn.Sequential(nn.Linear(64, 32)), linear_plan("0"), enable_fsdp_float8_all_gather=True)
    assert model[0].config.enable_fsdp_float8_all_gather
    assert type(model[0].weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"


@pytest.mark.parametrize(("model", "fqn", "found"), [
    (nn.Sequential(nn.Linear(64, 32)), "1", "is nothing"),
    (nn.Sequential(nn.LayerNorm(64)), "0", "is LayerNorm"),
])
def test_a_plan_that_does_not_fit_the_model_raises(model, fqn, found):
    with pytest.raises(ValueError, match=f"the plan's '{fqn}' {found}"):
        convert(model, linear_plan(fqn))


def test_converting_twice_raises():
    model = convert(nn.Sequential(nn.Linear(64, 32)), linear_plan("0"))
    with pytest.raises(ValueError, match="is Float8Linear"):
        convert(model, linear_plan("0"))


def test_the_swap_check_catches_a_silent_no_op_and_a_stray_swap():
    linear, other = nn.Linear(64, 32), nn.Linear(64, 32)
    with pytest.raises(RuntimeError, match="'a' is still Linear"):
        _check_swapped_exactly({"a": linear}, {"a": linear}, planned={"a"})
    with pytest.raises(RuntimeError, match="'b' was not planned for torchao but changed"):
        _check_swapped_exactly({"b": linear}, {"b": other}, planned=set())


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_converted_llama_matches_the_unconverted_one(recipe, batch):
    reference = Llama(load_model_config("tiny"))
    model = convert(copy.deepcopy(reference), tiny_plan(recipe))
    losses = [Llama.loss(m(batch[:, :-1]), batch[:, 1:]) for m in (reference, model)]
    for loss in losses:
        loss.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=LOSS_RTOL)
    errors = {}
    for (name, ref), (_, fp8) in zip(reference.named_parameters(), model.named_parameters()):
        errors[name] = ((fp8.grad - ref.grad).norm() / ref.grad.norm()).item()
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_RTOL, f"{worst}: relative gradient error {errors[worst]:.3f}"
    assert errors["layers.1.attention.wqkv.weight"] > 1e-3, "the gradients are exact: FP8 never ran"
