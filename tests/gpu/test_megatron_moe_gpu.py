"""The trainer's Megatron path with MoE models on a GPU: megatron's TE spec builds the experts as TEGroupedMLP (TE
GroupedLinear, moe_grouped_gemm) and the plan's recipe reaches them (delayed and blockwise FP8); tiny-moe and
deepseek-moe-small (sigmoid routing with the expert bias) train in FP8 with losses close to BF16's, and a run
resumed from its middle checkpoint repeats the uninterrupted one bit for bit.
Run with `pytest -m gpu tests/gpu/test_megatron_moe_gpu.py`."""

import pytest

from gpu_skips import require_te, te_mark

pytestmark = pytest.mark.gpu

require_te(["delayed"])

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.config import JobConfig, from_overrides  # noqa: E402
from fp8stack.train import checkpoint  # noqa: E402
from fp8stack.train.loop import session, train  # noqa: E402

RECIPES = [pytest.param("delayed"), pytest.param("blockwise", marks=te_mark(["blockwise"]))]
"""The FP8 recipes megatron's grouped experts run here; blockwise needs a Hopper GPU or newer."""
RECIPE_CLASSES = {"delayed": "DelayedScaling", "blockwise": "Float8BlockScaling"}
"""TE's recipe class for each recipe."""
MIDDLE = 3
"""The checkpoint resumed from (checkpoints every MIDDLE steps)."""


@pytest.fixture(autouse=True)
def no_megatron_state_left_by_other_modules():
    """The trainer sets up megatron's parallel state itself; each run starts as a new process would."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    yield
    FP8GlobalStateManager.reset()


def megatron_moe(model: str, recipe: str, overrides: dict) -> JobConfig:
    return from_overrides({"model.name": model, "model.impl": "megatron", "precision.recipe": recipe,
                           "training.device": "cuda", "training.eval_batches": 0, "logging.progress": False,
                           "optimizer.lr": 1e-3, "optimizer.warmup": 2, **overrides})


def _train(cfg: JobConfig):
    result = train(cfg)
    FP8GlobalStateManager.reset()  # the next run starts as a new process would
    return result


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_grouped_experts_are_te_grouped_linears_running_the_plans_recipe(recipe):
    """tiny-moe on the TE spec: every MoE layer's experts a TEGroupedMLP whose GroupedLinears run FP8 under the
    plan's recipe, tokens padded for FP8 by the router (megatron's moe_router_padding_for_quantization)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    cfg = megatron_moe("tiny-moe", recipe, {"training.steps": 1})
    with session(cfg) as run:
        gpt = run.model.module if hasattr(run.model, "module") else run.model
        config = gpt.config
        assert config.moe_grouped_gemm and config.moe_router_padding_for_quantization and config.moe_permute_fusion
        experts = [layer.mlp.experts for layer in gpt.decoder.layers[1:]]
        assert all(isinstance(e, TEGroupedMLP) for e in experts)
        assert {(d.backend, d.recipe) for d in run.plan.decisions if d.component.kind == "expert"} == {("te", recipe)}
        seen = {}
        for fqn, module in gpt.decoder.named_modules():
            if isinstance(module, te.GroupedLinear):
                def recording(*args, fqn=fqn, prepare=module.prepare_forward, **kwargs):
                    seen[fqn] = (FP8GlobalStateManager.is_fp8_enabled(),
                                 type(FP8GlobalStateManager.get_fp8_recipe()).__name__)
                    return prepare(*args, **kwargs)
                module.prepare_forward = recording
        run.step(cfg.optimizer.grad_clip)
    assert len(seen) == 2 * 3 and set(seen.values()) == {(True, RECIPE_CLASSES[recipe])}, seen


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_moe_trains_in_fp8_close_to_bf16(recipe):
    """20 steps of tiny-moe from the same weights and data: the FP8 run's losses within 5% of BF16's at every
    step, both learning."""
    settings = {"training.steps": 20, "training.seq_len": 256}
    fp8 = _train(megatron_moe("tiny-moe", recipe, settings))
    bf16 = _train(megatron_moe("tiny-moe", "bf16", settings))
    assert all(x == x for x in fp8.losses + bf16.losses)
    assert fp8.losses == pytest.approx(bf16.losses, rel=5e-2), (fp8.losses, bf16.losses)
    for result in (fp8, bf16):
        assert sum(result.losses[-3:]) < 0.9 * sum(result.losses[:3]), result.losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_deepseek_moe_small_trains_in_fp8_close_to_bf16(recipe):
    """deepseek-moe-small's shapes (32 experts top-8 with sigmoid scores and the expert bias, a shared expert; 2.46 B
    parameters with FP32 masters fit one H200) at 1024-token sequences: 6 steps of FP8 within 5% of BF16's losses;
    the routers' expert bias moved by the balancing updates."""
    settings = {"training.steps": 6, "training.seq_len": 1024, "training.micro_batch": 1, "training.global_batch": 1}
    cfg = megatron_moe("deepseek-moe-small", recipe, settings)
    with session(cfg) as run:
        gpt = run.model.module if hasattr(run.model, "module") else run.model
        routers = [layer.mlp.router for layer in gpt.decoder.layers[1:]]
        assert len(routers) == 7 and all(r.expert_bias is not None for r in routers)
        run.step(cfg.optimizer.grad_clip)
        assert all(r.expert_bias.abs().max().item() == pytest.approx(1e-3) for r in routers)
    FP8GlobalStateManager.reset()
    fp8 = _train(cfg)
    bf16 = _train(megatron_moe("deepseek-moe-small", "bf16", settings))
    assert all(x == x for x in fp8.losses + bf16.losses)
    assert fp8.losses == pytest.approx(bf16.losses, rel=5e-2), (fp8.losses, bf16.losses)
    assert fp8.losses[-1] < fp8.losses[0]


@pytest.mark.parametrize("fusion", [False, True], ids=["autograd", "fused-wgrad"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_megatron_moe_checkpoints_resume_bit_identically(recipe, fusion, tmp_path):
    """tiny-moe resumed from its middle checkpoint (the experts' weights and AdamW's moments in megatron's sharded
    layout, TE's scaling state in the rank files) repeats the uninterrupted run's losses and gradient norms exactly,
    with autograd's gradients and with the GroupedLinears' wgrad fused into DDP's FP32 buffers."""
    cfg = megatron_moe("tiny-moe", recipe, {
        "training.steps": 6, "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4,
        "training.seq_len": 128, "data.max_bytes": 1 << 20, "te.gradient_accumulation_fusion": fusion,
        "checkpoint.dir": str(tmp_path), "checkpoint.interval": MIDDLE})
    full = _train(cfg)
    resumed = _train(from_overrides({"checkpoint.resume": str(checkpoint.checkpoint_path(tmp_path, MIDDLE)),
                                     "checkpoint.trust": True}, cfg))
    assert resumed.first_step == MIDDLE
    assert resumed.losses == full.losses[MIDDLE:]  # exact equality, not approx
    assert resumed.grad_norms == full.grad_norms[MIDDLE:]
