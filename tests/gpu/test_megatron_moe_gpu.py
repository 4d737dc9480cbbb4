"""The trainer's Megatron path with MoE models on a GPU: megatron's TE spec builds the experts as TEGroupedMLP (TE
GroupedLinear, moe_grouped_gemm) and the plan's recipe reaches them (delayed and blockwise FP8); tiny-moe and
deepseek-moe-small (sigmoid routing with the expert bias) train in FP8 with losses close to BF16's, and a run
resumed from its middle checkpoint repeats the uninterrupted one bit for bit.
Run with `pytest -m gpu tests/gpu/test_megatron_moe_gpu.py`."""

import gc

import pytest
import torch
import torch.multiprocessing as mp

from gpu_skips import require_te, te_mark

pytestmark = pytest.mark.gpu

require_te(["delayed"])

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.bench.launches import LR  # noqa: E402
from fp8stack.config import JobConfig, from_overrides  # noqa: E402
from fp8stack.train import checkpoint  # noqa: E402
from fp8stack.train.loop import session, train  # noqa: E402

RECIPES = [pytest.param("delayed"), pytest.param("blockwise", marks=te_mark(["blockwise"]))]
"""The FP8 recipes megatron's grouped experts run here; blockwise needs a Hopper GPU or newer."""
RECIPE_CLASSES = {"delayed": "DelayedScaling", "blockwise": "Float8BlockScaling"}
"""TE's recipe class for each recipe."""
MIDDLE = 3
"""The checkpoint resumed from (checkpoints every MIDDLE steps)."""
DEEPSEEK_SETTINGS = {"training.steps": 12, "training.seq_len": 1024, "training.micro_batch": 1,
                     "training.global_batch": 1, "optimizer.lr": LR, "optimizer.warmup": 3}
"""deepseek-moe-small's runs: one 1024-token sequence a step at the peak LR of the project's loss comparisons
(fp8stack.bench.launches.LR), reached over 3 steps. At 1e-3 BF16's own first 6 losses swung between 8.7 and 11.9, so
no FP8 run could be held to them."""
FIRST_LOSS_RTOL = 1e-2
"""FP8 against BF16 at the first step: the same weights and batch, only the forward's rounding differs."""
LATER_MEAN_RTOL = 3e-2
"""FP8 against BF16, the mean loss of the second half of the steps: rounding differences grown through the updates."""


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


def _deepseek_case(_: int, recipe: str, out: str) -> None:
    """One recipe's case in a process of its own, so that no earlier case's 2.46 B-parameter models hold GPU memory:
    the routers' expert bias after one step, then the FP8 run and the BF16 run, each model freed before the next is
    built. Saves what the test judges to `out`."""
    cfg = megatron_moe("deepseek-moe-small", recipe, DEEPSEEK_SETTINGS)
    with session(cfg) as run:
        gpt = run.model.module if hasattr(run.model, "module") else run.model
        routers = [layer.mlp.router for layer in gpt.decoder.layers[1:]]
        biased = len(routers) == 7 and all(r.expert_bias is not None for r in routers)
        run.step(cfg.optimizer.grad_clip)
        moved = [r.expert_bias.abs().max().item() for r in routers]
    del run, gpt, routers
    losses = {}
    for arm, arm_cfg in ((recipe, cfg), ("bf16", megatron_moe("deepseek-moe-small", "bf16", DEEPSEEK_SETTINGS))):
        _free_the_last_model()
        losses[arm] = train(arm_cfg).losses
    torch.save({"biased": biased, "moved": moved, "fp8": losses[recipe], "bf16": losses["bf16"]}, out)


def _free_the_last_model() -> None:
    """What the last run left: its model and optimizer (collected with their reference cycles), the allocator's
    cached blocks and TE's FP8 buffers, as a new process would start."""
    gc.collect()
    torch.cuda.empty_cache()
    FP8GlobalStateManager.reset()


@pytest.mark.parametrize("recipe", RECIPES)
def test_deepseek_moe_small_trains_in_fp8_close_to_bf16(recipe, tmp_path):
    """deepseek-moe-small's shapes (32 experts top-8 with sigmoid scores and the expert bias, a shared expert; 2.46 B
    parameters with FP32 masters fit one H200) at 1024-token sequences, each recipe in its own process: BF16 learns
    smoothly at this LR, FP8's first loss is BF16's to 1% and its later mean to 3%; the routers' expert bias moved
    by the balancing update."""
    out = tmp_path / "case.pt"
    mp.spawn(_deepseek_case, args=(recipe, str(out)), nprocs=1, join=True)
    found = torch.load(out, weights_only=False)
    assert found["biased"] and found["moved"] == pytest.approx([1e-3] * 7)
    fp8, bf16 = found["fp8"], found["bf16"]
    assert all(x == x for x in fp8 + bf16), (fp8, bf16)
    assert max(bf16) <= 1.02 * bf16[0] and _mean(bf16[-3:]) < 0.97 * bf16[0], bf16  # no swing, and it learns
    assert _mean(fp8[-3:]) < 0.97 * fp8[0], fp8
    assert fp8[0] == pytest.approx(bf16[0], rel=FIRST_LOSS_RTOL), (fp8, bf16)
    half = len(bf16) // 2
    assert _mean(fp8[half:]) == pytest.approx(_mean(bf16[half:]), rel=LATER_MEAN_RTOL), (fp8, bf16)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


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
