"""patches/te_swiglu_fp8_dgrad.py on a GPU: where it fuses (a bias-free swiglu LayerNormMLP under delayed scaling,
recomputing or not), where it leaves TE alone (a biased MLP, current scaling), what its one rounding does to the
gradient against TE's two, and the te backend applying it.
Run with `pytest -m gpu tests/gpu/test_te_swiglu_patch_gpu.py`."""

import copy

import pytest
import torch

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed", "tensorwise"])

import transformer_engine.pytorch as te  # noqa: E402
import transformer_engine_torch as tex  # noqa: E402
from transformer_engine.common import recipe as te_recipes  # noqa: E402
from transformer_engine.pytorch.module.layernorm_mlp import _LayerNormMLP  # noqa: E402
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer  # noqa: E402

from fp8stack.models import load_model_config
from fp8stack.backends.te import TEBackend  # noqa: E402
from fp8stack.models import Llama  # noqa: E402
from fp8stack.plan import PolicyConfig, load_description, make_plan  # noqa: E402
from fp8stack.patches import te_swiglu_fp8_dgrad as patch  # noqa: E402

DIM, HIDDEN, TOKENS = 256, 512, 2048
PASSES = 3
"""Forward + backward passes per run; the last one's gradients are compared (delayed scaling's first pass has no
amax yet)."""
GRAD_REL_DIFF = 0.03
"""Bound on ||patched - TE|| / ||TE|| of each gradient. Rounding once instead of twice moves about 1.5% of the FC1
output gradient's E5M2 values by one step (12-25% of a value; profiles/runs/2026-11-25-probe-dswiglu-fp8-h100/),
~2-3% rms, which the dgrad and wgrad GEMMs pass on (1.7% in the input gradient on an H100); a wrong gate/up order
or scale would differ by O(1)."""


def delayed():
    return te_recipes.DelayedScaling(fp8_format=te_recipes.Format.HYBRID, amax_history_len=1,
                                     amax_compute_algo="most_recent")


@pytest.fixture
def restore_patch_state():
    """Each test decides itself whether the patch is on; the state before the test comes back after it."""
    was_applied = hasattr(_LayerNormMLP, patch._MARK)
    yield
    patch.apply() if was_applied else patch.revert()


@pytest.fixture
def spy(monkeypatch):
    """Counts the patch's fused calls and TE's two-pass cast (bgrad_quantize)."""
    calls = {"fused": 0, "bgrad_quantize": 0}
    fused, two_pass = patch._dswiglu_quantize, tex.bgrad_quantize

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(patch, "_dswiglu_quantize", counted("fused", fused))
    monkeypatch.setattr(tex, "bgrad_quantize", counted("bgrad_quantize", two_pass))
    return calls


def mlp(bias: bool, checkpoint: bool = False) -> te.LayerNormMLP:
    torch.manual_seed(0)
    return te.LayerNormMLP(DIM, HIDDEN, bias=bias, normalization="RMSNorm", activation="swiglu",
                           params_dtype=torch.bfloat16, checkpoint=checkpoint, device="cuda")


def grads(module: te.LayerNormMLP, recipe) -> dict[str, torch.Tensor]:
    """Input and parameter gradients of the last of PASSES passes, same inputs for every module."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(PASSES):
        x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
        dy = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        module.zero_grad(set_to_none=True)
        with te.autocast(enabled=True, recipe=recipe):
            out = module(x)
        out.backward(dy)
    return {"input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved", "recomputed"])
def test_bias_free_swiglu_under_delayed_scaling_fuses(checkpoint, restore_patch_state, spy):
    base = mlp(bias=False, checkpoint=checkpoint)
    patch.revert()
    te_grads = grads(copy.deepcopy(base), delayed())
    assert spy == {"fused": 0, "bgrad_quantize": PASSES}
    assert patch.apply().startswith("applied")
    patched_grads = grads(copy.deepcopy(base), delayed())
    assert spy == {"fused": PASSES, "bgrad_quantize": PASSES}, "the patched backward should fuse on every pass"
    assert te_grads.keys() == patched_grads.keys()
    for name, grad in patched_grads.items():
        assert grad is not None and torch.isfinite(grad).all(), name
        assert rel_diff(grad, te_grads[name]) < GRAD_REL_DIFF, name


@pytest.mark.parametrize("bias, recipe", [(True, delayed), (False, te_recipes.Float8CurrentScaling)],
                         ids=["biased-delayed", "bias-free-current-scaling"])
def test_other_mlps_run_te_unchanged(bias, recipe, restore_patch_state, spy):
    base = mlp(bias=bias)
    patch.revert()
    te_grads = grads(copy.deepcopy(base), recipe())
    patch.apply()
    patched_grads = grads(copy.deepcopy(base), recipe())
    assert spy["fused"] == 0
    for name, grad in patched_grads.items():
        assert torch.equal(grad, te_grads[name]), name
    if bias:
        assert patched_grads["fc1_bias"] is not None and patched_grads["fc1_bias"].abs().sum() > 0


def test_one_rounding_is_at_least_as_close_to_the_fp32_gradient():
    """At llama-1b-like's FC1 width: the fused FP8 gradient against TE's two-pass one, both dequantized, against the
    FP32 gradient of swiglu; and the amax each hands delayed scaling against the FP32 gradient's."""
    torch.manual_seed(0)
    fc1_out = torch.randn(1024, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(1024, 14336, device="cuda", dtype=torch.bfloat16) * 0.02
    gate, up = fc1_out.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    reference = torch.cat([grad.float() * up * sig * (1 + gate * (1 - sig)), grad.float() * gate * sig], dim=-1)

    def quantizer():
        return Float8Quantizer(torch.full((1,), 2.0 ** 10, device="cuda"), torch.zeros(1, device="cuda"),
                               tex.DType.kFloat8E5M2, rowwise=True, columnwise=True)

    two_pass = tex.bgrad_quantize(tex.dswiglu(grad, fc1_out, None), quantizer())[1]
    _, fused = patch._dswiglu_quantize(grad, fc1_out, quantizer())
    errors = {name: rel_diff(out.dequantize(dtype=torch.float32), reference)
              for name, out in (("two_pass", two_pass), ("fused", fused))}
    assert errors["fused"] <= errors["two_pass"], errors
    assert float(fused._quantizer.amax) == pytest.approx(float(reference.abs().max()), rel=1e-6)
    # the transpose is the data's own transpose, for the wgrad GEMM
    assert torch.equal(fused._transpose.view(torch.uint8), fused._data.view(torch.uint8).t())


@pytest.mark.parametrize("recipe, noted", [("delayed", True), ("tensorwise", False)])
def test_te_backend_applies_it_for_fused_mlps_under_delayed_scaling(recipe, noted, restore_patch_state):
    patch.revert()
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe=recipe, backend="te", small_gemm_filter="off"))
    _, record = TEBackend().convert(model, plan.for_backend("te"), plan)  # the policy fuses norms and MLPs by default
    notes = [note for note in record.notes if "te_swiglu_fp8_dgrad" in note]
    assert bool(notes) == noted, record.notes
    assert hasattr(_LayerNormMLP, patch._MARK) == noted
    if noted:
        assert notes[0].startswith(f"fused MLPs, delayed: applied: {patch.WHAT}")
