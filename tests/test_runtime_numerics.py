"""Numerics guards: a non-finite loss stops with the batch and RNG pinned, the first non-finite layer is
named, FP8 statistics per layer, and the FP32 precision map (plan.FP32_STATE) checked claim by claim. CPU."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.config import e4m3_dtype
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig

from fp8stack.models import load_model_config
from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.models import GroupedExperts, Llama
from fp8stack.plan.plan import FP32_STATE
from fp8stack.runtime import (NonFiniteLossError, check_finite, fp8_stats, load_pin, track_fp8_stats, watch_layers,
                              zero_fp8_weight_grads)
from fp8stack.runtime.numerics import rng_states


def test_a_finite_loss_passes(tmp_path):
    check_finite(torch.tensor(1.5), step=3, batch=torch.zeros(2), pin_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_nan_loss_raises_and_pins_the_batch_and_rng(tmp_path):
    batch = {"tokens": torch.arange(10).view(2, 5)}
    torch.manual_seed(7)
    random.seed(7)
    before = rng_states()
    with pytest.raises(NonFiniteLossError, match="at step 12: batch and RNG states pinned in .*nonfinite-step12.pt"):
        check_finite(torch.tensor(float("nan")), step=12, batch=batch, pin_dir=tmp_path / "pins", rng=before)
    pin = load_pin(tmp_path / "pins" / "nonfinite-step12.pt")
    assert pin["step"] == 12 and torch.equal(pin["batch"]["tokens"], batch["tokens"])
    torch.set_rng_state(pin["rng"]["torch"])
    random.setstate(pin["rng"]["python"])
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.set_rng_state(pin["rng"]["torch"])
    assert torch.equal(torch.rand(3), expected)  # the pinned state replays the draws


def test_watch_layers_names_the_first_non_finite_module():
    model = Llama(load_model_config("tiny"))
    with torch.no_grad():
        model.layers[2].feed_forward.w2.weight[0, 0] = float("inf")
    tokens = torch.randint(0, 256, (1, 16))
    with watch_layers(model) as watch:
        model(tokens)
        assert watch.first_nonfinite() == "layers.2.feed_forward.w2"
        watch.clear()
        assert watch.first_nonfinite() is None


class ExpertsLeavingNaNPastTheGroups(GroupedExperts):
    """GroupedExperts whose GEMMs leave NaN in the rows past the last group, as uninitialised memory may hold on a
    GPU (torch._grouped_mm and grouped_fp8's kernels write none of those rows)."""

    def grouped_mm(self, x, weight, offsets):
        out = super().grouped_mm(x, weight, offsets)
        past = (torch.arange(out.shape[0]) >= offsets[-1]).unsqueeze(1)
        return torch.where(past, float("nan"), out)


def test_watch_layers_judges_grouped_experts_by_their_groups_rows():
    """The experts' rows past their groups are no reader's (MoE gathers its slots' rows): NaN there names no layer,
    while a non-finite row of a group names the experts module."""
    model = Llama(load_model_config("tiny-moe"))
    experts = model.layers[1].moe.experts
    leaving_nan = ExpertsLeavingNaNPastTheGroups(experts.w13.shape[2], experts.w2.shape[2], experts.num_experts)
    leaving_nan.load_state_dict(experts.state_dict())
    model.layers[1].moe.experts = leaving_nan
    tokens = torch.randint(0, 256, (1, 16))
    with watch_layers(model) as watch:
        assert torch.isfinite(model(tokens)).all()
        assert watch.first_nonfinite() is None
        watch.clear()
        with torch.no_grad():
            leaving_nan.w2[:, 0, 0] = float("inf")
        model(tokens)
        assert watch.first_nonfinite() == "layers.1.moe.experts"


def test_fp8_stats_of_torchao_layers():
    model = convert_to_float8_training(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    x = torch.randn(32, 64)
    x[0, 0] = 1e-9  # rounds to 0 in E4M3 next to values of ~1
    x[1, 1] = 50.0  # the amax, alone at the top of the range
    assert fp8_stats(model)["0"] == {"source": "not tracked: call track_fp8_stats(model) before the forward"}
    handles = track_fp8_stats(model)
    model(x)
    model(x)
    stats = fp8_stats(model)
    for h in handles:
        h.remove()
    first = stats["0"]
    assert first["amax"]["input"] == pytest.approx(float(x.abs().max()))
    assert first["scale"]["weight"] == pytest.approx(448 / float(model[0].weight.detach().abs().max()))
    assert first["overflow_count"]["input"] == 2  # the amax lands on 448, once per call
    assert first["underflow_count"]["input"] >= 2
    assert set(stats) == {"0", "1"}


def test_zero_fp8_weight_grads_names_fp8_weights_that_train_nothing():
    model = convert_to_float8_training(nn.Sequential(*(nn.Linear(64, n, bias=False) for n in (64, 64, 8))),
                                       module_filter_fn=lambda _module, fqn: fqn != "2")
    x = torch.randn(32, 64)
    model(x).sum().backward()
    assert zero_fp8_weight_grads(model) == []
    model.zero_grad()
    with torch.no_grad():
        model[0].weight.zero_()  # layer 1 then sees a zero input: its weight gradient is all zero, layer 0's is not
    model(x).sum().backward()
    assert zero_fp8_weight_grads(model) == ["1.weight"], "only FP8 modules' weights count (layer 2 stays nn.Linear)"
    main_grad = model[0].weight  # megatron's fused accumulation leaves .grad None and fills main_grad
    main_grad.main_grad, main_grad.grad = torch.zeros_like(main_grad), None
    assert zero_fp8_weight_grads(model) == ["0.weight", "1.weight"]


# --- the precision map: every FP32_STATE claim checked where it can be on CPU -------------------------

def _trained_tiny():
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="tensorwise", small_gemm_filter="off"))
    model = assemble(Llama(load_model_config("tiny")), plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = Llama.loss(logits, tokens[:, 1:])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return model, optimizer, logits, loss, norm


def check_master_weights(model, optimizer, logits, loss, norm):
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def check_optimizer_states(model, optimizer, logits, loss, norm):
    states = list(optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


def check_loss(model, optimizer, logits, loss, norm):
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32  # BF16 logits, FP32 loss


def check_grad_norm(model, optimizer, logits, loss, norm):
    assert norm.dtype == torch.float32


def check_reductions(*_):
    """RMSNorm's mean of squares and softmax's exp-sum, on BF16 inputs, land within one BF16 step
    of the FP32 computation (a BF16 accumulation over 4096 values would be off by far more)."""
    torch.manual_seed(0)
    x = torch.randn(8, 4096) * 3
    norm = nn.RMSNorm(4096).to(torch.bfloat16)
    ref = F.rms_norm(x.bfloat16().float(), (4096,), eps=norm.eps)
    torch.testing.assert_close(norm(x.bfloat16()).float(), ref, rtol=2 ** -7, atol=1e-6)
    ref_softmax = x.bfloat16().float().softmax(-1)
    torch.testing.assert_close(x.bfloat16().softmax(-1).float(), ref_softmax, rtol=2 ** -7, atol=1e-7)


def check_fp8_scales(*_):
    """torchao's dynamic cast of a BF16 tensor keeps an FP32 scale (TE's fp8_meta: tests/gpu)."""
    cast = hp_tensor_to_float8_dynamic(torch.randn(16, 16, dtype=torch.bfloat16), e4m3_dtype, LinearMMConfig())
    assert cast._scale.dtype == torch.float32


def check_fp8_gemm_accumulation(*_):
    """torch._scaled_mm (the CPU kernel here; cuBLASLt on GPU) accumulates in FP32: a BF16-output product
    of FP8 operands equals the FP32 product of the same values rounded once to BF16."""
    a = torch.randn(32, 512).to(torch.float8_e4m3fn)
    b = torch.randn(64, 512).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    ref = (a.float() @ b.float().t()).bfloat16()
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=0)


CHECKS = {
    "master weights": check_master_weights,
    "optimizer states (Adam m, v)": check_optimizer_states,
    "loss (log-softmax + cross-entropy)": check_loss,
    "gradient norm and clipping": check_grad_norm,
    "softmax and norm reductions": check_reductions,
    "FP8 scales and amax statistics": check_fp8_scales,
    "FP8 GEMM accumulation": check_fp8_gemm_accumulation,
}


def test_every_fp32_claim_has_a_check():
    assert [what for what, _ in FP32_STATE] == list(CHECKS)


@pytest.mark.parametrize("claim", [what for what, _ in FP32_STATE])
def test_the_precision_map_holds(claim):
    CHECKS[claim](*_trained_tiny())
