"""TE regions replayed as CUDA graphs (fp8stack.runtime.te_graphed: TransformerEngine's
make_graphed_callables with the recipe): replay after replay, with new inputs each time, forward
output and input / weight gradients match the same region run eagerly under te.autocast with that
recipe; under DelayedScaling the amax histories and scales move across replays exactly as they do
eagerly. Run with `pytest -m gpu tests/gpu/test_runtime_graphs_gpu.py`."""

import copy
import inspect

import pytest
import torch
from torch import nn

from fp8stack.backends.te import te_recipe
from fp8stack.runtime import te_graphed

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed", "tensorwise"])

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

REPLAY_REL_ERR = 1e-3
"""||graphed - eager|| / ||eager|| for outputs and gradients. A replay runs the captured kernels on the
same inputs and FP8 scales as the eager run, so the two agree up to the order of additions inside the
GEMMs (cuBLASLt may pick another algorithm under capture). A graph that lost FP8 (about 3% off, see
MIN_FP8_REL_ERR) or kept stale delayed scales (inputs grow 2x per replay here) lands far above it."""

MIN_FP8_REL_ERR = 0.01
"""A BF16 run of the region lands near 0.002 from FP32; the FP8 replays must differ from it by more."""

REPLAYS = 4
"""Forward + backward replays compared with eager steps, each on a new input twice as large."""

ROWS, DIM, HIDDEN = 128, 256, 512


def _region() -> nn.Sequential:
    """RMSNorm + Linear fused (te.LayerNormLinear), GELU, te.Linear: BF16 parameters on the GPU."""
    with torch.device("cuda"):
        return nn.Sequential(
            te.LayerNormLinear(DIM, HIDDEN, normalization="RMSNorm", bias=False, params_dtype=torch.bfloat16),
            nn.GELU(),
            te.Linear(HIDDEN, DIM, params_dtype=torch.bfloat16))


def _te_modules(region: nn.Module) -> list[TransformerEngineBaseModule]:
    return [m for m in region.modules() if isinstance(m, TransformerEngineBaseModule)]


def _delayed_state(region: nn.Module) -> list[torch.Tensor]:
    """Every TE module's forward and backward scales and amax histories (copies)."""
    return [getattr(m.fp8_meta[key], name).clone() for m in _te_modules(region)
            for key in ("scaling_fwd", "scaling_bwd") for name in ("scale", "amax_history")]


def _step(region: nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe=None) -> tuple[torch.Tensor, ...]:
    """(output, input gradient, parameter gradients...) of one forward + backward, under te.autocast
    with `recipe` when given (the graphed region enters it itself)."""
    x = x.detach().clone().requires_grad_(True)
    for p in region.parameters():
        p.grad = None
    if recipe is None:
        out = region(x)
    else:
        with te.autocast(enabled=True, recipe=recipe):
            out = region(x)
    out.backward(dy)
    return (out, x.grad, *(p.grad for p in region.parameters()))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def test_te_graphed_passes_the_recipe_by_its_te_2_20_names():
    names = inspect.signature(te.make_graphed_callables).parameters
    assert {"enabled", "recipe"} <= set(names), sorted(names)


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed"])
def test_graphed_region_replays_match_eager_steps(recipe_name):
    recipe = te_recipe(recipe_name, "hybrid")
    torch.manual_seed(0)
    eager = _region()
    bf16 = copy.deepcopy(eager)
    sample = torch.randn(ROWS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te_graphed(copy.deepcopy(eager), (sample,), recipe)
    # The capture leaves the FP8 state as it found it: fresh, as the eager region's is.

    delayed = recipe_name == "delayed"
    states, out_pointers = [], set()
    for replay in range(REPLAYS):
        x = torch.randn(ROWS, DIM, device="cuda", dtype=torch.bfloat16) * 2.0 ** replay
        dy = torch.randn(ROWS, DIM, device="cuda", dtype=torch.bfloat16) * 2.0 ** -replay
        expected = _step(eager, x, dy, recipe)
        got = _step(graphed, x, dy)
        out_pointers.add(got[0].data_ptr())  # a replay returns the graph's static output buffer
        names = ["output", "input grad", *(name for name, _ in graphed.named_parameters())]
        for name, g, e in zip(names, got, expected):
            assert rel_err(g, e) < REPLAY_REL_ERR, f"replay {replay}: {name}"
        if delayed:
            state, eager_state = _delayed_state(graphed), _delayed_state(eager)
            for tensor, eager_tensor in zip(state, eager_state):
                torch.testing.assert_close(tensor, eager_tensor, rtol=REPLAY_REL_ERR, atol=0)
            states.append(state)
    assert len(out_pointers) == 1, "the graphed region ran eagerly instead of replaying its graph"
    assert rel_err(_step(bf16, x, dy)[0], got[0]) > MIN_FP8_REL_ERR, "the replays did not run in FP8"
    if delayed:
        forward_scales = [state[0] for state in states]  # first module: input, weight, output scales
        assert all(not torch.equal(a, b) for a, b in zip(forward_scales, forward_scales[1:])), \
            f"DelayedScaling scales did not move across replays: {forward_scales}"
