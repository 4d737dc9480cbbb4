"""FP8 compression of saved activations on a GPU (fp8stack.runtime.compress_saved_activations): the
tiny Llama in plain torch under BF16 autocast, and the same model with TE tensorwise FP8 linears,
trained one step with and without compression: gradients within FP8 rounding of each other, bytes
saved as the dtypes say, and what TE already keeps in FP8 left alone.
Run with `pytest -m gpu tests/gpu/test_runtime_compress_gpu.py`."""

import copy

import pytest
import torch

from fp8stack.models import load_model_config
from fp8stack.bench.runtime import build, token_loss
from fp8stack.models import Llama
from fp8stack.plan import PolicyConfig
from fp8stack.runtime import compress_saved_activations

from gpu_skips import require_cuda, te_mark

pytestmark = pytest.mark.gpu

require_cuda()
needs_te = te_mark(["tensorwise"])

COMPRESSED_GRAD_REL_ERR = 0.08
"""||g_compressed - g|| / ||g|| for a weight whose gradient takes one compressed activation in
directly (attention.wo, feed_forward.w2, the output head, embeddings, final norm): activations rounded
to E4M3 (3 mantissa bits, ~2.5% rms), twice that for products of two rounded factors (the CPU test's
bound). Measured on an H200: at most ~0.05."""

COMPOUNDED_GRAD_REL_ERR = 0.2
"""The same for weights behind a backward that itself reads several compressed tensors: SwiGLU's
(w13, ffn_norm: silu'(gate) * up from a rounded gate and up) and the fused attention kernels' (wqkv,
attention_norm: flash / memory-efficient / cuDNN backward recompute the softmax from rounded Q and K
against the forward's exact log-sum-exp, so logit errors come back exponentiated). Measured on an
H200: up to ~0.09 (SwiGLU) and ~0.13 (attention); a wrong scale or a misplaced tensor gives O(1)."""

COMPOUNDED = ("attention.wqkv", "attention_norm", "feed_forward.w13", "ffn_norm")
"""Parameter name parts under COMPOUNDED_GRAD_REL_ERR."""

SAVED_FRACTION = (0.49, 0.5)
"""bytes_saved / bytes_before: a BF16 activation shrinks by 1/2, less one FP32 scale. FP32 tensors (norm
statistics, attention log-sum-exps, the loss's log-softmax) are kept."""

TOKENS = (4, 257)
"""Batch and sequence + 1 of the step: 4 x 256 tokens, the tiny model's context."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _grads_with_and_without_compression(model, loss_fn, tokens):
    """(uncompressed grads, compressed grads, the compressor) of one forward + backward each."""
    compressed = copy.deepcopy(model)
    loss_fn(model, tokens).backward()
    with compress_saved_activations(compressed) as saved:
        loss = loss_fn(compressed, tokens)
    loss.backward()
    plain = {name: p.grad for name, p in model.named_parameters()}
    return plain, {name: p.grad for name, p in compressed.named_parameters()}, saved


def _assert_close_grads(plain: dict, compressed: dict) -> None:
    errors = {name: rel_err(compressed[name], grad) for name, grad in plain.items()}
    bound = {name: COMPOUNDED_GRAD_REL_ERR if any(part in name for part in COMPOUNDED) else COMPRESSED_GRAD_REL_ERR
             for name in errors}
    bad = {name: f"{err:.3f} (bound {bound[name]})" for name, err in errors.items() if not err < bound[name]}
    assert not bad, bad
    assert max(errors.values()) > 1e-4, "compression changed no gradient: nothing was compressed"


def test_bf16_llama_step_with_compressed_activations():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(load_model_config("tiny"))  # FP32 master weights, BF16 autocast: what the trainer runs

    def loss_fn(m, tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(tokens[:, :-1])
        return Llama.loss(logits, tokens[:, 1:])

    tokens = torch.randint(0, 256, TOKENS, device="cuda")
    plain, compressed, saved = _grads_with_and_without_compression(model, loss_fn, tokens)
    _assert_close_grads(plain, compressed)
    assert saved.compressed > 20 and saved.skipped["weight"] > 0  # autocast's BF16 weight copies kept
    assert saved.skipped["dtype float32"] > 0  # log-sum-exps, norm statistics, log-softmax kept
    assert saved.bytes_before > 0.5 * saved.bytes_seen, "most saved bytes are activations worth compressing"
    lo, hi = SAVED_FRACTION
    assert lo < saved.bytes_saved / saved.bytes_before < hi, (saved.bytes_saved, saved.bytes_before)


@needs_te
def test_te_fp8_llama_step_with_compressed_activations():
    """TE saves its GEMM inputs already quantized: a QuantizedTensor reaches the hook as itself
    ('already fp8'), a storage-only one (what TE 2.20's linears save) as its raw uint8 data and FP32
    scale ('not floating', 'small'). None of them may be compressed again, nor pass as an unknown
    tensor subclass; TE's own classes, not our name check, say which ones they are."""
    from transformer_engine.pytorch import QuantizedTensor
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    torch.manual_seed(0)
    model = build("tiny", PolicyConfig(recipe="tensorwise", backend="te", small_gemm_filter="off", fuse_norm=False,
                                       fuse_mlp=False))  # unfused modules: the bounds were set for them
    tokens = torch.randint(0, 256, TOKENS, device="cuda")
    try:
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            token_loss(model, tokens)  # tensorwise keeps no FP8 state: this forward changes nothing
        te_objects = sum(isinstance(t, QuantizedTensor) for t in seen)
        te_raw = sum(type(t) is torch.Tensor and t.dtype == torch.uint8 for t in seen)
        del seen
        plain, compressed, saved = _grads_with_and_without_compression(model, token_loss, tokens)
    finally:
        FP8GlobalStateManager.reset()
    print(f"TE saved {te_objects} QuantizedTensors and {te_raw} raw uint8 FP8 tensors; compressed "
          f"{saved.compressed}, skipped {dict(saved.skipped)}, saved {saved.bytes_saved} of {saved.bytes_seen} bytes")
    _assert_close_grads(plain, compressed)
    assert te_objects + te_raw >= 4 * len(model.layers), "TE saved no FP8 data for its linears"
    assert saved.skipped["already fp8"] == te_objects
    assert saved.skipped["not floating"] >= te_raw  # kept as they are, with the token ids
    assert saved.skipped["tensor subclass"] == 0, "a TE FP8 tensor class is not recognised as FP8"
    assert saved.compressed > 0 and saved.bytes_saved > 0  # norms, attention, SwiGLU stay BF16 and compress
