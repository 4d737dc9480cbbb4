"""The trainer on a GPU with TE DelayedScaling: a run resumed from its middle checkpoint continues with
bit-identical losses, its TE modules' amax histories and scales restored as they were saved (the run trusts
its own checkpoint: TE unpickles that state), and those FP8 states are what makes the next loss come out the
same.
Run with `pytest -m gpu tests/gpu/test_train_gpu.py`."""

import pickle

import pytest
import torch

from fp8stack.models import Llama
from fp8stack.train import checkpoint
from fp8stack.train.checkpoint import EXTRA_STATE_SUFFIX
from fp8stack.config import from_overrides
from fp8stack.train.loop import session, train

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = {"model.name": "tiny", "precision.recipe": "delayed", "precision.backend": "te", "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 6, "optimizer.warmup": 1, "training.micro_batch": 2, "training.seq_len": 128, "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False,
            # the levers a GPU run resolves to by default, off: each test turns on what it tests
            "training.compile": False, "training.param_dtype": "fp32", "training.sdpa_backend": "auto",
            "te.gradient_accumulation_fusion": False, "precision.fuse_norm": False, "precision.fuse_mlp": False}
"""Every GEMM of the tiny model on TE delayed scaling; 128-token sequences fit one attention tile, so
the BF16 attention backward adds in a fixed order and the run repeats bit for bit."""
MIDDLE = 3
"""The checkpoint resumed from (checkpoints every MIDDLE steps)."""
FP8_STATE = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
"""What TE's get_extra_state saves for a DelayedScaling module (the names of its pickled dict)."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def _module_state(module: TransformerEngineBaseModule) -> dict[str, torch.Tensor]:
    """A TE module's live FP8 scaling state, under the names of FP8_STATE."""
    meta = module.fp8_meta
    return {name: getattr(meta[f"scaling_{name.rsplit('_', 1)[1]}"], name.rsplit("_", 1)[0]).cpu()
            for name in FP8_STATE}


def _saved_states(path) -> dict[str, dict[str, torch.Tensor]]:
    """fqn -> the FP8 scaling state a checkpoint holds for each TE module (as TE pickled it)."""
    extra = torch.load(path / "rank0.pt", weights_only=True)["extra_state"]  # TE's pickles, decoded here as ours
    states = {key.removesuffix("." + EXTRA_STATE_SUFFIX): pickle.loads(value.numpy().tobytes())
              for key, value in extra.items() if value.numel()}
    return {fqn: {name: state[name] for name in FP8_STATE} for fqn, state in states.items()}


def _full_and_resumed(settings: dict, tmp_path) -> list[float]:
    """The losses of a run, after asserting that its resumed second half repeats them exactly."""
    full = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": MIDDLE}))
    FP8GlobalStateManager.reset()  # each run starts as a new process would: no other model's FP8 buffers
    middle = checkpoint.checkpoint_path(tmp_path, MIDDLE)
    resumed = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.resume": str(middle), "checkpoint.trust": True}))
    FP8GlobalStateManager.reset()
    assert resumed.first_step == MIDDLE
    assert resumed.losses == full.losses[MIDDLE:]  # exact equality, not approx
    return full.losses


def test_resume_with_delayed_scaling_is_bit_identical(tmp_path):
    full_losses = _full_and_resumed(SETTINGS, tmp_path)
    middle = checkpoint.checkpoint_path(tmp_path, MIDDLE)
    saved = _saved_states(middle)
    with session(from_overrides({**SETTINGS})) as run:
        te_modules = {fqn: m for fqn, m in run.model.named_modules()
                      if isinstance(m, TransformerEngineBaseModule) and m.autocast_recipe is not None}  # not the head
        assert len(te_modules) >= 4 * len(run.model.layers), "every linear of every block should be on TE"
        at = checkpoint.load(middle, run.model, run.optimizer, run.scheduler, trusted=True)
        assert set(saved) == set(te_modules)
        for fqn, module in te_modules.items():
            state = _module_state(module)
            for name in FP8_STATE:
                assert torch.equal(state[name], saved[fqn][name]), f"{fqn}: {name} not restored"
            # With history length 1 the amax row is cleared once it has set the scale: the scales carry it.
            assert (state["scale_fwd"] != 1).any() and (state["scale_bwd"] != 1).any(), \
                f"{fqn}: the saved DelayedScaling scales never moved off their initial 1"

        # The restored state is what reproduces the next loss: with it reset, the same step differs.
        tokens, targets = (t.to(run.env.device) for t in run.data.batch(at.data_position))
        restored = {fqn: m.get_fp8_meta_tensors() for fqn, m in te_modules.items()}

        def next_loss() -> float:
            with run.autocast():
                logits = run.model(tokens)
            return float(Llama.loss(logits, targets))

        assert next_loss() == full_losses[MIDDLE]
        for fqn, module in te_modules.items():
            module.reset_fp8_meta_tensors()  # scales 1, amax histories 0: a fresh module's state
        assert next_loss() != full_losses[MIDDLE], "the FP8 scaling state made no difference to the loss"
        for fqn, module in te_modules.items():
            module.reset_fp8_meta_tensors(restored[fqn])
        assert next_loss() == full_losses[MIDDLE]


@pytest.mark.parametrize("param_dtype", ["bf16", "fp8"])
def test_resume_with_low_precision_parameters_is_bit_identical(param_dtype, tmp_path):
    """The checkpoint holds the FP32 masters; the resumed run copies them into its BF16 or FP8 parameters, the FP8
    ones quantized with the restored delayed scales, as the uninterrupted run's last optimizer step did."""
    _full_and_resumed({**SETTINGS, "training.param_dtype": param_dtype}, tmp_path)


@pytest.mark.parametrize("fuse_mlp", [False, True], ids=["linears", "layernorm-mlp"])
def test_fp8_weights_are_cast_once_per_step_and_again_after_each_optimizer_step(fuse_mlp):
    """With two micro-batches per step the TE modules cast their weights on the first and reuse that copy on
    the second (TEBackend.cache_fp8_weights, on with gradient accumulation); any optimizer step makes the next
    forward cast the updated weights. Tensorwise scales come from the weights alone, so the cached run computes
    exactly what a run casting at every micro-batch computes, and a run whose cache is kept past the steps
    trains on step 0's FP8 weights."""
    from fp8stack.backends.base import optimizer_steps

    cfg = from_overrides({**{**SETTINGS, "precision.recipe": "tensorwise", "training.steps": 3, "training.global_batch": 4, "precision.fuse_mlp": fuse_mlp}})

    def losses(variant: str) -> list[float]:
        with session(cfg) as run:
            caches = [m for m in run.model.modules() if getattr(m, "cached_weights", ())]
            assert run.micro_batches == 2 and caches, "gradient accumulation turns the FP8 weight cache on"
            assert any(type(m).__name__ == "TELayerNormMLP" for m in caches) == fuse_mlp
            if variant == "uncached":
                for module in caches:
                    module.cached_weights = ()
            elif variant == "stale":  # every cache taken for current after each step
                run.after_optimizer_step = lambda: [setattr(
                    m, "_cast_at", (optimizer_steps(), tuple(w._version for w in m.cached_weights)))
                    for m in caches]
            return [float(run.step(cfg.optimizer.grad_clip)[0]) for _ in range(cfg.training.steps)]

    cached, uncached, stale = losses("cached"), losses("uncached"), losses("stale")
    assert cached == uncached
    assert stale[0] == cached[0] and stale[1:] != cached[1:], "a stale cache must show: the check can fail"


@pytest.mark.parametrize("model, recipe, fuse_mlp", [("tiny", "tensorwise", False), ("tiny-moe", "tensorwise", False),
                                                     ("tiny", "tensorwise", True), ("tiny", "delayed", True)])
def test_cached_fp8_weights_run_under_torch_compile(model, recipe, fuse_mlp):
    """TE modules run outside torch.compile (dynamo tracing into cached FP8 weights failed on llama-1b-like:
    'Float8Tensor' object has no attribute '_data'); the compiled blocks around them still compile."""
    settings = {**SETTINGS, "model.name": model, "precision.recipe": recipe, "training.steps": 3, "training.global_batch": 4, "precision.fuse_mlp": fuse_mlp}
    compiled, eager = train(from_overrides({**settings, "training.compile": True})), train(from_overrides({**settings}))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-2), (compiled.losses, eager.losses)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gradient_accumulation_fusion_trains_as_autograd_accumulation(compile):
    """The plain path with --gradient-accumulation-fusion: the TE weights' gradients accumulate in FP32 main_grad
    over a step's micro-batches and restart from zero at the next step, so each step's gradient norm (the TE weights
    hold most of the tiny model's) matches the unfused run's; double counting or a sum carried into the next step
    would move it by tens of percent."""
    settings = {**SETTINGS, "precision.recipe": "tensorwise", "training.steps": 3, "training.global_batch": 4, "precision.fuse_norm": True,
                "precision.fuse_mlp": True, "training.compile": compile}
    with session(from_overrides({**settings, "te.gradient_accumulation_fusion": True})) as run:  # the head's wgrad fused too
        assert isinstance(run.model.output, TransformerEngineBaseModule) and run.model.output.autocast_recipe is None
    fused, plain = (train(from_overrides({**settings, "te.gradient_accumulation_fusion": True})), train(from_overrides({**settings})))
    assert fused.grad_norms == pytest.approx(plain.grad_norms, rel=0.02), (fused.grad_norms, plain.grad_norms)
    assert fused.losses == pytest.approx(plain.losses, rel=1e-2), (fused.losses, plain.losses)
    assert not any(fused.zero_fp8_weight_grads), fused.zero_fp8_weight_grads


def test_a_bf16_run_on_te_trains_as_the_plain_bf16_run():
    """--fp8-recipe bf16 --backend te with the TE levers (the A/B's --bf16-on-te): TE modules in BF16 with fused
    norms, MLPs and weight-gradient accumulation train like the plain BF16 model over a few steps."""
    settings = {**SETTINGS, "precision.recipe": "bf16", "training.steps": 3, "training.global_batch": 4}  # SETTINGS' backend is te
    on_te = from_overrides({**settings, "precision.fuse_norm": True, "precision.fuse_mlp": True, "te.gradient_accumulation_fusion": True})
    with session(on_te) as run:
        assert any(isinstance(m, TransformerEngineBaseModule) for m in run.model.modules())
    te_run, plain = train(on_te), train(from_overrides({**{**settings, "precision.backend": "auto"}}))
    assert te_run.grad_norms == pytest.approx(plain.grad_norms, rel=0.02), (te_run.grad_norms, plain.grad_norms)
    assert te_run.losses == pytest.approx(plain.losses, rel=1e-2), (te_run.losses, plain.losses)


def test_delayed_scaling_updates_its_scales_inside_compiled_blocks():
    """TE modules run eagerly inside compiled blocks, so DelayedScaling updates its amaxes and scales at every
    step as in an eager run: the compiled run ends with the eager run's scales (up to the compiled glue's
    rounding), moved away from their initial 1.0."""
    def final_scales(compile: bool) -> dict[str, torch.Tensor]:
        cfg = from_overrides({**{**SETTINGS, "training.steps": 3}, "training.compile": compile})
        with session(cfg) as run:
            for _ in range(cfg.training.steps):
                run.step(cfg.optimizer.grad_clip)
            return {fqn: _module_state(m)["scale_fwd"] for fqn, m in run.model.named_modules()
                    if isinstance(m, TransformerEngineBaseModule) and m.autocast_recipe is not None}  # FP8 ones

    compiled, eager = final_scales(True), final_scales(False)
    assert compiled.keys() == eager.keys() and compiled
    for fqn in eager:
        assert not torch.all(compiled[fqn] == 1.0), f"{fqn}: DelayedScaling never updated its scales under compile"
        torch.testing.assert_close(compiled[fqn], eager[fqn], rtol=0.1, atol=0)


def test_priming_passes_end_the_delayed_scaling_cold_start():
    """TE DelayedScaling's scales start at 1, so unprimed the first step's E4M3 gradient casts flush: FP8 weights
    get all-zero gradients. With the default fp8_priming_passes no FP8 weight gradient of the first steps is zero.
    If the unprimed run stops showing zeros, TE has changed its start: re-check whether priming is still needed."""
    settings = {**SETTINGS, "training.steps": 3, "precision.fp8_format": "e4m3"}
    cold = train(from_overrides({**settings, "te.priming_passes": 0}))
    FP8GlobalStateManager.reset()
    primed = train(from_overrides({**settings}))
    assert cold.zero_fp8_weight_grads[0], cold.zero_fp8_weight_grads
    assert primed.zero_fp8_weight_grads == [[], [], []], primed.zero_fp8_weight_grads


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_cached_fp8_weights_are_cast_once_per_step_not_per_micro_batch(param_dtype):
    """With four micro-batches per step each cached TE module casts its weights at the step's first forward only,
    whether the optimizer writes FP32 weights (fused AdamW, which leaves their versions alone) or the masters are
    copied into BF16 ones: a recast per micro-batch would train the same and cost the cache's whole gain."""
    settings = {**SETTINGS, "training.steps": 3, "training.global_batch": 8, "training.param_dtype": param_dtype, "precision.fuse_norm": True,
                "precision.fuse_mlp": True, "te.gradient_accumulation_fusion": True, "te.priming_passes": 0}
    with session(from_overrides({**settings})) as run:
        cached = [m for m in run.model.modules() if getattr(m, "cached_weights", ())]
        casts = {id(m): 0 for m in cached}

        def count(module, *_hook_args):
            casts[id(module)] += module._cast_at != count.before[id(module)]

        def remember(module, *_hook_args):
            count.before[id(module)] = module._cast_at

        count.before = {}
        for module in cached:
            module.register_forward_pre_hook(remember)
            module.register_forward_hook(count)
        assert run.micro_batches == 4 and cached
        for _ in range(3):
            run.step(1.0)
    assert set(casts.values()) == {3}, casts


@pytest.mark.parametrize("overrides", [
    {"precision.recipe": "bf16"},
    {"training.param_dtype": "bf16", "te.gradient_accumulation_fusion": True, "precision.fuse_norm": True,
     "precision.fuse_mlp": True},  # the delayed defaults' levers
], ids=["bf16", "delayed-fastest"])
def test_a_step_syncs_the_host_once_and_not_after_its_optimizer_step(overrides):
    """Session.step reads its loss and gradient norm in one device-to-host copy before the optimizer step and
    uploads the batch from pinned memory: no other synchronizing CUDA call, so the host queues the optimizer and
    the next step while the GPU works (a sync after the optimizer step left the GPU idle at each step's start)."""
    cfg = from_overrides({**SETTINGS, "training.steps": 2, **overrides})
    with session(cfg) as run:
        run.step(cfg.optimizer.grad_clip)  # first-step allocations and scale priming aside
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning) as syncs:
                run.step(cfg.optimizer.grad_clip)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronizing = [f"{w.filename}:{w.lineno}" for w in syncs if "synchronizing" in str(w.message)]
    assert len(synchronizing) == 1, synchronizing
