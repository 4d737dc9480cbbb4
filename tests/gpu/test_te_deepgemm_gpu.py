"""TE's blockwise modules with their GEMMs on DeepGEMM (TEBackend blockwise_gemms='deepgemm') against the same
model on TE's cuBLAS GEMMs. Run with `pytest -m gpu tests/gpu/test_te_deepgemm_gpu.py`."""

import copy

import pytest
import torch

from fp8stack.models import load_model_config
from fp8stack.backends import deepgemm, te_deepgemm
from fp8stack.backends.te import TEBackend
from fp8stack.models import Llama
from fp8stack.plan import PolicyConfig, load_description, make_plan

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["blockwise"])
LIBRARY, WHY_NOT = deepgemm.load()
if LIBRARY is None:
    pytest.skip(WHY_NOT, allow_module_level=True)


MAIN_GRAD_REL_ERR = 1e-6
"""Both libraries promote each 128-deep partial product to FP32 with the same scales in the same order (fprop and
dgrad come out bit-identical); wgrad adds into the FP32 main_grad, where the two may add the earlier micro-batch's
sum at a different point: one FP32 rounding apart, far below an FP8 GEMM's ~3% error."""


def test_blockwise_gemms_on_deepgemm_match_cublas_and_take_every_gemm():
    torch.manual_seed(0)
    with torch.device("cuda"):  # FP32 master weights under BF16 autocast, as the trainer runs them
        base = Llama(load_model_config("tiny"))  # every GEMM dim a multiple of 128, as DeepGEMM's kernels need
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="blockwise", backend="te",
                                                            small_gemm_filter="off", arch=90))
    options = {"fuse_wgrad_accumulation": True}  # the policy fuses norms and MLPs by default
    batches = torch.randint(0, 256, (2, 4, 129), device="cuda")  # 4 x 128 tokens per micro-batch

    def two_micro_batches(model):
        """Logits of each micro-batch and the gradients summed over both (main_grad overwritten, then added to)."""
        model.zero_grad(set_to_none=True)
        logits = []
        for tokens in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(tokens[:, :-1])
                loss = Llama.loss(out, tokens[:, 1:])
            loss.backward()
            logits.append(out.detach())
        return logits, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    on_cublas, _ = TEBackend(**options).convert(copy.deepcopy(base), plan.for_backend("te"), plan)
    reference = two_micro_batches(on_cublas)  # before the router exists: it replaces TE's general_gemm process-wide
    try:
        on_deepgemm, record = TEBackend(**options, blockwise_gemms="deepgemm").convert(
            copy.deepcopy(base), plan.for_backend("te"), plan)
        router = te_deepgemm.route_blockwise_gemms(LIBRARY)  # the one convert installed
        router.calls.update(deepgemm=0, te=0)
        logits, grads = two_micro_batches(on_deepgemm)
    finally:
        te_deepgemm.unroute()
    assert any("blockwise_gemms=deepgemm" in note for note in record.notes), record.notes
    # fprop, dgrad and wgrad of each blockwise linear, fused or not, on DeepGEMM; the head's, on TE without FP8,
    # stay cuBLAS's
    on_te = [d for d in plan.decisions if d.backend == "te" and d.component.kind in ("linear", "head")]
    blockwise = sum(d.recipe == "blockwise" for d in on_te)
    assert router.calls == {"deepgemm": 3 * blockwise * len(batches), "te": 3 * (len(on_te) - blockwise) * len(batches)}
    for got, want in zip(logits, reference[0]):
        assert torch.equal(got, want)
    assert grads.keys() == reference[1].keys()
    for name, grad in grads.items():
        want = reference[1][name]
        err = ((grad.float() - want.float()).norm() / want.float().norm()).item()
        assert err <= MAIN_GRAD_REL_ERR, f"{name}: {err:.2e} from the cuBLAS model's gradient"


def test_megatron_path_routes_its_te_linears_blockwise_gemms_and_trains_as_on_cublas():
    """--model-impl megatron --blockwise-gemms deepgemm: megatron's TE linears (subclasses of TE's Linear and
    LayerNormLinear) go through the same router. With gradient_accumulation_fusion every one of their GEMMs is
    routed: 4 linears x 3 GEMMs per layer and micro-batch; the first loss (no update yet) is bit-identical to the
    cuBLAS run's, and so is the first gradient up to FP32 rounding."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    from fp8stack.config import from_overrides
    from fp8stack.train.loop import train

    parallel_state.destroy_model_parallel()  # other GPU test modules leave theirs behind
    settings = {"model.name": "tiny", "model.impl": "megatron", "precision.recipe": "blockwise", "precision.backend": "te", "training.device": "cuda", "te.gradient_accumulation_fusion": True, "training.steps": 3, "training.micro_batch": 2, "training.global_batch": 4, "optimizer.lr": 1e-3, "optimizer.warmup": 1, "training.eval_batches": 0, "logging.progress": False}
    on_cublas = train(from_overrides({**settings}))
    try:
        on_deepgemm = train(from_overrides({**settings, "te.blockwise_gemms": "deepgemm"}))
        calls = dict(te_deepgemm.route_blockwise_gemms(LIBRARY).calls)  # the router the Megatron path installed
    finally:
        te_deepgemm.unroute()
    layers = load_model_config("tiny").n_layers
    micro_batches = settings["training.global_batch"] // settings["training.micro_batch"]
    assert calls == {"deepgemm": 4 * 3 * layers * micro_batches * settings["training.steps"], "te": 0}
    assert on_deepgemm.losses[0] == on_cublas.losses[0]
    # main_grad from DeepGEMM's wgrad: the first step's gradient norm as cuBLAS's, up to FP32 rounding (and the
    # attention backward's run-to-run order); the later losses then follow the same updates
    assert on_deepgemm.grad_norms[0] == pytest.approx(on_cublas.grad_norms[0], rel=1e-4)
    assert on_deepgemm.losses == pytest.approx(on_cublas.losses, rel=5e-3)
