"""MasterWeights(release_main_grads=True) where GEMMs write main_grad themselves: TE's fused weight-gradient GEMMs
(fuse_wgrad_accumulation, which fetch it in their backward through get_main_grad() on a weight marked __fsdp_param__)
and grouped_fp8's blockwise expert GEMMs on DeepGEMM; training bit-identical to the persistent main_grads, and the
memory they held gone between steps and from the peak. The hook path is a CPU test (tests/test_release_main_grads.py).
Run with `pytest -m gpu tests/gpu/test_release_main_grads_gpu.py`."""

import gc
import weakref

import pytest
import torch
from torch import nn

from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.backends import deepgemm
from fp8stack.config import from_overrides
from fp8stack.models import Llama, load_model_config
from fp8stack.precision import MasterWeights
from fp8stack.train.loop import session

from gpu_skips import require_te, te_mark

pytestmark = pytest.mark.gpu

require_te(["tensorwise"])

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

STEPS, MICRO_BATCHES = 3, 2
"""Optimizer steps, each accumulating this many micro-batches (TE's cached FP8 weights: is_first_microbatch)."""
NO_DEEPGEMM = deepgemm.load()[1] or "DeepGEMM unavailable"


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def _converted(name: str, recipe: str, expert_backend: str = "auto") -> nn.Module:
    """`name` built on the GPU in FP32 and converted through make_plan / assemble: TE layers accumulating their weight
    gradients into main_grad, FP8 weights cached across a step's micro-batches."""
    torch.manual_seed(0)
    plan = make_plan(load_description(name), PolicyConfig(recipe=recipe, backend="te", expert_backend=expert_backend,
                                                         small_gemm_filter="off"))
    with torch.device("cuda"):
        model = Llama(load_model_config(name))
    options = {"te": {"fuse_wgrad_accumulation": True, "cache_fp8_weights": True}}
    if expert_backend == "grouped_fp8":
        options["grouped_fp8"] = {"kernels": "deepgemm"}
    return assemble(model, plan, backend_options=options)


def _steps(model: nn.Module, release: bool) -> dict:
    """STEPS AdamW steps of MICRO_BATCHES micro-batches: the masters' gradients before each step, masters and
    parameters after, and the main_grads alive after each step."""
    masters = MasterWeights(model, release_main_grads=release)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3, weight_decay=0.1))
    vocab = model.tok_embeddings.num_embeddings
    generator = torch.Generator(device="cuda").manual_seed(1)
    out = {"grads": [], "masters": [], "params": [], "alive_after_step": []}
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (2 * MICRO_BATCHES, 129), device="cuda", generator=generator)
        for batch in tokens.chunk(MICRO_BATCHES):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
            (loss / MICRO_BATCHES).backward()
        out["grads"].append([m.grad.clone() for m in masters.masters])
        optimizer.step()
        optimizer.zero_grad()
        out["alive_after_step"].append(sum(b is not None for b in masters.buffers)
                                       + sum(hasattr(p, "main_grad") for p in masters.params))
        out["masters"].append([m.detach().clone() for m in masters.masters])
        out["params"].append([p.detach().clone() for p in masters.params])
    return out


def _assert_bit_identical(persistent: dict, released: dict) -> None:
    for key in ("grads", "masters", "params"):
        for step, (kept, freed) in enumerate(zip(persistent[key], released[key], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(kept, freed, strict=True)), f"{key} differ at step {step}"


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise", "delayed",
                                    pytest.param("blockwise", marks=te_mark(["blockwise"]))])
def test_te_fused_wgrad_trains_bit_identically_with_released_main_grads(recipe):
    model = _converted("tiny", recipe)
    te_weights = [p for m in model.modules() if isinstance(m, TransformerEngineBaseModule)
                  for p in m.parameters(recurse=False) if p.ndim == 2]
    assert te_weights and all(getattr(p, "main_grad", None) is not None for p in te_weights)  # TE's fusion is on
    persistent = _steps(model, release=False)
    FP8GlobalStateManager.reset()
    released_model = _converted("tiny", recipe)
    released = _steps(released_model, release=True)
    _assert_bit_identical(persistent, released)
    assert released["alive_after_step"] == [0] * STEPS
    assert all(hasattr(p, "__fsdp_param__") for m in released_model.modules()
               if isinstance(m, TransformerEngineBaseModule) for p in m.parameters(recurse=False) if p.ndim == 2)


@pytest.mark.skipif(deepgemm.load()[0] is None, reason=NO_DEEPGEMM)
@te_mark(["blockwise"])
def test_grouped_fp8_blockwise_experts_train_bit_identically_with_released_main_grads():
    """The experts' DeepGEMM wgrad GEMMs fetch the released main_grad in their backward (and TE's blockwise layers
    theirs)."""
    from fp8stack.backends.grouped import Float8GroupedExperts

    persistent_model = _converted("tiny-moe", "blockwise", expert_backend="grouped_fp8")
    experts = [m for m in persistent_model.modules() if isinstance(m, Float8GroupedExperts)]
    assert experts and all(m.wgrad_into_main_grad is False for m in experts)
    persistent = _steps(persistent_model, release=False)
    assert all(m.wgrad_into_main_grad for m in experts)
    FP8GlobalStateManager.reset()
    released = _steps(_converted("tiny-moe", "blockwise", expert_backend="grouped_fp8"), release=True)
    _assert_bit_identical(persistent, released)
    assert released["alive_after_step"] == [0] * STEPS


MEMORY_SETTINGS = {"model.name": "llama-1b-like", "precision.recipe": "tensorwise", "precision.backend": "te",
                   "training.device": "cuda", "training.dtype": "bf16", "training.param_dtype": "bf16",
                   "te.gradient_accumulation_fusion": True, "training.compile": False, "training.micro_batch": 2,
                   "training.global_batch": 4, "training.seq_len": 2048, "training.steps": 3,
                   "training.eval_batches": 0, "logging.progress": False}
"""The measured arm's shape (llama-1b-like, two micro-batches of two 2048-token sequences, TE's fused wgrad), eager."""


def _memory(release: bool, micro_batches: int = 2) -> tuple[int, int, int]:
    """(peak bytes over steps 2 and 3, bytes allocated after step 3, main_grad bytes) of the trainer's session."""
    FP8GlobalStateManager.reset()
    settings = {**MEMORY_SETTINGS, "training.release_main_grads": release,
                "training.global_batch": micro_batches * MEMORY_SETTINGS["training.micro_batch"]}
    with session(from_overrides(settings)) as run:
        main_grad_bytes = 4 * sum(p.numel() for p in run.masters.params)
        run.step(1.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run.step(1.0)
        run.step(1.0)
        torch.cuda.synchronize()
        peak, resident = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    # This session's model, masters and main_grads must be gone before the next one measures: `run` held them, and
    # a gc.collect() while it did freed nothing (the released run then measured 8.35 GB more, on an H200).
    del run
    gc.collect()
    torch.cuda.empty_cache()
    return peak, resident, main_grad_bytes


def test_released_main_grads_lower_the_resident_memory_and_the_peak_of_one_micro_batch_steps():
    """Between steps the main_grads' 4 bytes per parameter are gone (to the allocator's rounding). With one
    micro-batch per step the peak, at the start of the backward where few gradients exist yet, falls by at least half
    of them; with more, the peak is a later micro-batch's forward, main_grads allocated either way, and stays."""
    gib = 2**30
    for micro_batches in (1, 2):
        kept_peak, kept_resident, main_grad_bytes = _memory(release=False, micro_batches=micro_batches)
        freed_peak, freed_resident, _ = _memory(release=True, micro_batches=micro_batches)
        print(f"{micro_batches} micro-batch(es): peak {kept_peak / gib:.2f} -> {freed_peak / gib:.2f} GiB, between "
              f"steps {kept_resident / gib:.2f} -> {freed_resident / gib:.2f} GiB, main_grads "
              f"{main_grad_bytes / gib:.2f} GiB")
        assert kept_resident - freed_resident == pytest.approx(main_grad_bytes, rel=1e-3)
        if micro_batches == 1:
            assert kept_peak - freed_peak > main_grad_bytes / 2
        else:
            assert freed_peak == pytest.approx(kept_peak, rel=1e-3)


@pytest.mark.parametrize("release", [False, True], ids=["persistent", "released"])
def test_a_finished_session_on_te_is_freed_with_its_last_reference(release):
    """As on a CPU (tests/test_master_weights.py), on TE's path with its fused wgrad (get_main_grad, __fsdp_param__):
    nothing makes a cycle that only the collector would free, once TE's global FP8 state is reset."""
    FP8GlobalStateManager.reset()
    gc.collect()
    gc.disable()
    try:
        with session(from_overrides({**MEMORY_SETTINGS, "model.name": "tiny", "precision.small_gemm_filter": "off",
                                     "training.seq_len": 128, "data.max_bytes": 1 << 20,
                                     "training.release_main_grads": release})) as run:
            run.step(1.0)
            run.step(1.0)
            alive = [weakref.ref(o) for o in (run.model, run.optimizer, run.masters, *run.masters.params,
                                              *run.masters.masters)]
        del run
        FP8GlobalStateManager.reset()
        assert [ref() is not None for ref in alive] == [False] * len(alive)
    finally:
        gc.enable()
