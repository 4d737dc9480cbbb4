"""Selective recompute (RECOMPUTE_MODULES through assemble's recompute_modules), the same precision in
forward and recompute (PrecisionProbe, with a negative control: a wrapper that recomputes outside the
forward's context, the Megatron-LM PR 7538 bug, must be caught), dropout masks repeated. CPU, torchao."""

import copy

import pytest
import torch
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

from fp8stack.models import load_model_config
from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.plan.policy import Override
from fp8stack.assembly import apply_fp8
from fp8stack.models import Llama
from fp8stack.runtime import RECOMPUTE_MODULES, PrecisionProbe, checkpoint_module
from fp8stack.runtime.recompute import CheckpointWrapper


CPU_EXPERTS = Override(fqn="*.experts.*", backend="bf16",
                       reason="grouped_fp8 needs a GPU; the dense layers run torchao")


def plan_for(model_name: str, recipe: str = "tensorwise"):
    model = load_description(model_name)
    has_experts = any(c.kind == "expert" for c in model.components)  # an override matching nothing is refused
    return make_plan(model, PolicyConfig(recipe=recipe, small_gemm_filter="off",
                                         overrides=(CPU_EXPERTS,) if has_experts else ()))


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))


def wrapped(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def grads(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    Llama.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("names", "expected"), [
    (["block"], ["layers.0", "layers.1", "layers.2", "layers.3"]),
    (["mlp"], ["layers.0.feed_forward"]),
    (["moe"], ["layers.1.moe", "layers.2.moe", "layers.3.moe"]),
    (["moe_act"], [f"layers.{i}.moe.experts.act" for i in (1, 2, 3)]),
    (["core_attn", "layernorm"], [f"layers.{i}.{n}" for i in range(4)
                                  for n in ("attention_norm", "attention.core", "ffn_norm")]),
    (["attn", "shared_experts"], ["layers.0.attention"] + [f"layers.{i}.{n}" for i in (1, 2, 3)
                                                           for n in ("attention", "moe.shared_experts")]),
])
def test_recompute_modules_wrap_the_named_regions_and_keep_the_gradients(names, expected, batch):
    """Each name checkpoints its submodules, the state dict keeps its names, and the gradients equal
    those of the same FP8 model without recompute (the recompute repeats the forward exactly)."""
    model = Llama(load_model_config("tiny-moe"))
    plain = apply_fp8(copy.deepcopy(model), plan_for("tiny-moe"))
    recomputed = assemble(model, plan_for("tiny-moe"), recompute="all", recompute_modules=names)
    assert sorted(wrapped(recomputed)) == sorted(expected)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    expected_grads = grads(plain, batch)
    for name, grad in grads(recomputed, batch).items():
        assert torch.equal(grad, expected_grads[name.replace("._checkpoint_wrapped_module", "")]), name


def test_every_name_is_in_the_table():
    assert set(RECOMPUTE_MODULES) == {"core_attn", "attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm",
                                      "block"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"recompute": "all", "recompute_modules": ["mlpp"]}, "unknown name.*'mlpp'"),
    ({"recompute": "all", "recompute_modules": ["moe"]}, "'moe': none of blocks 0, 1, 2, 3 has moe"),
    ({"recompute": "all", "recompute_modules": ["block", "mlp"]}, "inside layers.0: recomputing a region twice"),
    ({"recompute": "all", "recompute_modules": ["attn", "core_attn"]}, "attention.core inside layers.0.attention"),
    ({"recompute_modules": ["mlp"]}, "no effect without recompute"),
])
def test_bad_selections_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        assemble(Llama(load_model_config("tiny")), plan_for("tiny"), **kwargs)


# --- the recompute runs in the forward's precision --------------------------------------------------

class _RecomputeInBackward(torch.autograd.Function):
    """Reentrant recompute that does not restore the forward's context: it recomputes under whatever
    context backward() runs in, which is what Megatron's tensor_parallel.checkpoint did with
    fp8_autocast (Megatron-LM PR 7538)."""

    @staticmethod
    def forward(ctx, module, x, rope):
        ctx.module = module
        ctx.save_for_backward(x, rope)
        with torch.no_grad():
            return module(x, rope)

    @staticmethod
    def backward(ctx, grad):
        x, rope = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.module(x, rope)
        torch.autograd.backward(out, grad)
        return None, x.grad, None


class RecomputeOutsideContext(nn.Module):
    """A deliberately wrong checkpoint wrapper (the negative control)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x, rope):
        return _RecomputeInBackward.apply(self.module, x, rope)


def probed_step(model: nn.Module, batch: torch.Tensor) -> PrecisionProbe:
    """Forward under a bf16 autocast (the forward's context), backward outside it, as a training loop does."""
    with PrecisionProbe(model) as probe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:])
        with probe.recomputing():
            loss.backward()
    return probe


def test_recompute_sees_the_forward_precision(batch):
    """Every Float8Linear recomputed runs with the config and the context (autocast) of its forward."""
    model = assemble(Llama(load_model_config("tiny")), plan_for("tiny"), recompute="all")
    probe = probed_step(model, batch)
    recomputed = probe.records["recompute"]
    fp8_layers = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert recomputed.keys() == fp8_layers and len(fp8_layers) == 16  # wqkv, wo, w13, w2 x 4 blocks
    first = next(iter(recomputed.values()))[0]
    assert first["autocast_cpu"] == "torch.bfloat16" and "Float8LinearConfig" in first["float8_config"]
    assert probe.mismatches() == []


def test_the_probe_catches_a_recompute_outside_the_forward_context(batch):
    """Negative control: the same check fails for a wrapper that recomputes outside the autocast."""
    model = apply_fp8(Llama(load_model_config("tiny")), plan_for("tiny"))
    for i, block in enumerate(model.layers):
        model.layers[i] = RecomputeOutsideContext(block)
    probe = probed_step(model, batch)
    problems = probe.mismatches()
    assert problems and all("'autocast_cpu': 'torch.bfloat16'" in p and "'autocast_cpu': None" in p for p in problems)


def test_dropout_masks_repeat_in_the_recompute():
    """Dropout > 0 inside a checkpointed FP8 region: the recompute draws the same mask (RNG state
    restored), so the gradients equal the non-checkpointed run's exactly."""
    torch.manual_seed(0)
    region = convert_to_float8_training(nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.3), nn.GELU(),
                                                      nn.Linear(128, 64)))
    assert isinstance(region[0], Float8Linear)
    x = torch.randn(32, 64)
    results = []
    for module in (region, checkpoint_module(copy.deepcopy(region), fp8_active=True)):
        torch.manual_seed(1)
        xi = x.clone().requires_grad_(True)
        module(xi).square().sum().backward()
        results.append([xi.grad, *(p.grad for p in module.parameters())])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], torch.zeros_like(results[0][0]))
