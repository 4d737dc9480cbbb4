"""BF16 Adam moments (optimizer.moments bf16: TE's FusedAdam) in the trainer on one GPU: the optimizer keeps BF16
moments and steps FP32 masters; a few steps train within a few percent of FP32 moments' losses, in the BF16 and FP8
arms alike, with 4 bytes less per parameter at the step's peak; a checkpoint resumes them bit for bit, with BF16
parameters on MasterWeights and under FSDP2 over one rank (DTensor parameters and moments).
Run with `pytest -m gpu tests/gpu/test_bf16_moments_gpu.py`."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from fp8stack.config import from_overrides
from fp8stack.train import checkpoint
from fp8stack.train.loop import session, train

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = {"model.name": "tiny", "precision.recipe": "delayed", "precision.backend": "te",
            "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 6,
            "optimizer.warmup": 1, "training.micro_batch": 2, "training.seq_len": 128, "training.eval_batches": 0,
            "data.max_bytes": 1 << 20, "logging.progress": False, "training.compile": False,
            "training.param_dtype": "fp32", "training.sdpa_backend": "auto", "te.gradient_accumulation_fusion": False,
            "optimizer.moments": "bf16"}
"""Every GEMM of the tiny model on TE delayed scaling, BF16 moments; 128-token sequences fit one attention tile, so
a run repeats bit for bit."""
ARMS = {"bf16": {"precision.recipe": "bf16", "precision.backend": "auto"}, "delayed": {}}
"""The BF16 arm and an FP8 arm."""
FSDP = {"parallelism.data_parallel": "fsdp", "parallelism.data_parallel_one_rank": True}
MIDDLE = 3
"""The checkpoint resumed from."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()  # each run starts as a new process would: no other model's FP8 buffers


def _train(settings: dict):
    result = train(from_overrides(settings))
    FP8GlobalStateManager.reset()
    return result


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_the_optimizer_keeps_bf16_moments_of_fp32_masters(param_dtype):
    with session(from_overrides({**SETTINGS, "training.param_dtype": param_dtype})) as run:
        run.step(1.0)
        assert isinstance(run.optimizer, FusedAdam)
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        assert params and {p.dtype for p in params} == {torch.float32}
        if param_dtype == "bf16":  # the optimizer steps the masters, not the model's BF16 parameters
            assert torch.bfloat16 in {p.dtype for p in run.model.parameters()}
            assert {id(p) for p in params} == {id(p) for p in run.masters.parameters()}
        states = [run.optimizer.state[p] for p in params]
        assert {t.dtype for state in states for t in (state["exp_avg"], state["exp_avg_sq"])} == {torch.bfloat16}
        assert all(state["exp_avg"].abs().sum() > 0 for state in states)  # the step wrote them


@pytest.mark.parametrize("arm", ARMS)
def test_bf16_moments_train_as_fp32_moments_with_4_bytes_less_per_parameter(arm):
    settings = {**SETTINGS, **ARMS[arm]}
    bf16, fp32 = _train(settings), _train({**settings, "optimizer.moments": "fp32"})
    assert bf16.losses == pytest.approx(fp32.losses, rel=0.03)
    assert bf16.losses != fp32.losses  # the moments did round
    (bf16_peak, bf16_params), (fp32_peak, fp32_params) = (_step_peak({**settings, "optimizer.moments": moments})
                                                          for moments in ("bf16", "fp32"))
    assert bf16_params == fp32_params
    assert (fp32_peak - bf16_peak) / bf16_params == pytest.approx(4, rel=0.25)


def _step_peak(settings: dict) -> tuple[int, int]:
    """(the most bytes a second optimizer step's forward, backward and update hold above what was allocated before
    the session, the parameters the optimizer steps)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with session(from_overrides(settings)) as run:
        run.step(1.0)  # makes the moments: the second step holds them throughout
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        moment_bytes = sum(t.numel() * t.element_size() for p in params
                           for t in (run.optimizer.state[p]["exp_avg"], run.optimizer.state[p]["exp_avg_sq"]))
        per_param = 4 if settings["optimizer.moments"] == "bf16" else 8
        assert moment_bytes == per_param * sum(p.numel() for p in params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run.step(1.0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    FP8GlobalStateManager.reset()
    return peak, sum(p.numel() for p in params)


@pytest.mark.parametrize("layout", ["bf16-masters", "fsdp"])
def test_resume_restores_bf16_moments_bit_for_bit(layout, tmp_path):
    settings = {**SETTINGS, **({"training.param_dtype": "bf16"} if layout == "bf16-masters" else FSDP)}
    full = _train({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": MIDDLE})
    if layout == "fsdp":  # FP32 weights gathered for BF16 activations: the head off TE (resolve.head_on_te)
        assert full.config["precision"]["head_on_te"] is False
    middle = checkpoint.checkpoint_path(tmp_path, MIDDLE)
    resumed = _train({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.resume": str(middle),
                      "checkpoint.trust": True})
    assert resumed.first_step == MIDDLE
    assert resumed.losses == full.losses[MIDDLE:]  # exact equality, not approx
    with session(from_overrides(settings)) as run:
        checkpoint.load(middle, run.model, run.optimizer, run.scheduler, masters=run.masters.module
                        if run.masters else None, trusted=True)
        states = list(run.optimizer.state.values())
        moments = [state[name] for state in states for name in ("exp_avg", "exp_avg_sq")]
        assert moments and {t.dtype for t in moments} == {torch.bfloat16}
        assert all(isinstance(t, DTensor) for t in moments) == (layout == "fsdp")
        assert {group["step"] for group in run.optimizer.param_groups} == {MIDDLE}


@pytest.mark.parametrize("layout", ["bf16-masters", "fsdp"])
def test_a_resumed_session_holds_what_was_saved_piece_by_piece_and_steps_alike(layout, tmp_path):
    """test_resume_restores_bf16_moments_bit_for_bit under FSDP2 found the second resumed step's loss off by 1e-4
    (2026-11-28-gpu-tests-moe-h200): this names the tensors that differ, loaded against saved and one step later."""
    settings = from_overrides({**SETTINGS, **({"training.param_dtype": "bf16"} if layout == "bf16-masters" else FSDP)})
    with session(settings) as run:
        for _ in range(MIDDLE):
            run.step(1.0)
        saved, position, registered = _state(run), run.data.position, _amax_registry()
        checkpoint.save(tmp_path, MIDDLE, run.model, run.optimizer, run.scheduler, position,
                        masters=run.masters.module if run.masters else None, layout=run.checkpoint_layout)
        next_loss, after = float(run.step(1.0)[0]), _state(run)
    FP8GlobalStateManager.reset()
    with session(settings) as run:
        resumed = checkpoint.load(checkpoint.checkpoint_path(tmp_path, MIDDLE), run.model, run.optimizer,
                                  run.scheduler, masters=run.masters.module if run.masters else None, trusted=True,
                                  layout=run.checkpoint_layout)
        if run.masters:
            run.masters.after_step()
        run.data.position = resumed.data_position
        assert _differing(saved, _state(run)) == [], "loaded differs from saved"
        # Every module in TE's amax registry before the first forward, as in the uninterrupted session: its first
        # autocast exit applies the forward amaxes the checkpoint holds pending (FSDP2's backward weight casts).
        assert _amax_registry() == registered
        resumed_loss, resumed_after = float(run.step(1.0)[0]), _state(run)
    assert resumed_loss == next_loss
    scales = [name for name in after if name.startswith("scaling_")]  # before the gradients they change
    assert _differing({name: after[name] for name in scales}, resumed_after) == [], "FP8 state one step later"
    assert _differing(after, resumed_after) == [], "one step after the checkpoint"


def _amax_registry() -> dict[str, int]:
    """TE's delayed-scaling amax registry: the amaxes registered per direction and recipe."""
    return {key: len(amaxes) for key, amaxes in FP8GlobalStateManager.quantization_state.global_amax_buffer.items()}


def _state(run) -> dict[str, torch.Tensor]:
    """What a step depends on, by name, as FP32 copies of local shards: parameters (and masters), Adam's moments and
    step, TE's delayed-scaling scales and amax histories, the LR."""
    local = (lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().float().clone())
    masters = run.masters.module.named_parameters() if run.masters else ()
    named = [*run.model.named_parameters(), *((f"masters.{name}", p) for name, p in masters)]
    names = {id(p): name for name, p in named}
    state = {f"param {name}": local(p) for name, p in named}
    for index, group in enumerate(run.optimizer.param_groups):
        state[f"step of group {index}"] = torch.tensor(float(group["step"]))
        state[f"lr of group {index}"] = torch.tensor(float(group["lr"]))
    for param, moments in run.optimizer.state.items():
        state.update({f"{key} {names[id(param)]}": local(moments[key]) for key in ("exp_avg", "exp_avg_sq")})
    for name, module in run.model.named_modules():
        for direction, recipe_state in (getattr(module, "fp8_meta", None) or {}).items():
            if direction in ("scaling_fwd", "scaling_bwd"):
                state[f"{direction}.scale {name}"] = local(recipe_state.scale)
                state[f"{direction}.amax_history {name}"] = local(recipe_state.amax_history)
    return state


def _differing(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names missing from `got` or not bit-equal there (the first 12)."""
    return [name for name, tensor in expected.items()
            if name not in got or not torch.equal(tensor.cpu(), got[name].cpu())][:12]


def test_a_checkpoint_resumes_only_with_the_moments_it_holds(tmp_path):
    _train({**SETTINGS, "training.steps": 1, "checkpoint.dir": str(tmp_path)})
    with pytest.raises(checkpoint.CheckpointMismatchError, match="holds BF16 Adam moments and this run keeps FP32"):
        train(from_overrides({**SETTINGS, "optimizer.moments": "fp32", "checkpoint.dir": str(tmp_path),
                              "checkpoint.resume": "latest", "checkpoint.resume_despite_changes": True}))
