"""FP8 compression of saved activations: bytes counted, gradients within FP8 tolerance of the
uncompressed run, and what is never compressed (weights, FP8 tensors, FP32, small, integer, bool). CPU,
BF16 autocast where a model runs (what the trainer runs on a GPU)."""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_training_tensor import Float8TrainingTensor

from fp8stack.models import load_model_config
from fp8stack.models import Llama
from fp8stack.runtime import compress_saved_activations
from fp8stack.runtime.compress import is_quantized_tensor

FP8_GRAD_REL_ERR = 0.08
"""||g_compressed - g|| / ||g||: activations rounded to E4M3 (3 mantissa bits, ~2.5% rms) feed the
weight gradients directly; twice that, with room for the products of two rounded factors."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_a_llama_step_with_compressed_activations(granularity):
    torch.manual_seed(0)
    model = Llama(load_model_config("tiny"))
    compressed_model = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 65))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Llama.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        with compress_saved_activations(compressed_model, granularity=granularity) as saved:
            loss = Llama.loss(compressed_model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert saved.compressed > 20 and saved.bytes_after < 0.55 * saved.bytes_before  # BF16 -> FP8 plus scales
    assert saved.skipped["weight"] > 0  # every linear saves its weight for the input gradient
    assert saved.skipped["dtype float32"] > 0  # the loss's FP32 log-softmax and the norms' FP32 statistics
    for (name, p), q in zip(model.named_parameters(), compressed_model.parameters()):
        assert rel_err(q.grad, p.grad) < FP8_GRAD_REL_ERR, name
    errs = [rel_err(q.grad, p.grad) for p, q in zip(model.parameters(), compressed_model.parameters())]
    assert max(errs) > 1e-4  # compression did happen


def test_saved_views_come_back_with_their_strides_for_a_compiled_backward():
    """Attention's q, k and v are views of the fused projection's output, strided as the whole: a compiled backward
    asserts the strides it saved with (inductor's assert_size_stride), so unpacking restores them."""
    from fp8stack.runtime.compress import ActivationCompressor

    fused = torch.randn(4, 64, 3 * 128, dtype=torch.bfloat16)
    view = fused[..., 128:256]
    compressor = ActivationCompressor(min_numel=16)
    packed = compressor.pack(view)
    restored = ActivationCompressor.unpack(packed)
    assert restored.stride() == view.stride() != restored.contiguous().stride()
    subnormal = float(view.abs().max()) / 448 * 2**-9  # E4M3's smallest step at this tensor's scale
    torch.testing.assert_close(restored.float(), view.float(), rtol=0.07, atol=subnormal)

    def step(x, w):
        q, k, v = (x @ w).view(2, 64, 3, 4, 32).unbind(2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).sum()

    x = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 3 * 128, dtype=torch.bfloat16, requires_grad=True)
    with compress_saved_activations(min_numel=16):
        loss = torch.compile(step, backend="inductor")(x, w)
    loss.backward()  # without the strides: AssertionError from the compiled backward's assert_size_stride
    assert torch.isfinite(w.grad.float()).all()


def test_weights_are_never_compressed():
    linear = nn.Linear(128, 128)
    x = torch.randn(64, 128, dtype=torch.bfloat16).requires_grad_(True)
    grads = []
    for compressing in (False, True):
        h = x * 1.0  # an activation (x itself is a leaf that trains, which counts as a weight)
        with compress_saved_activations(linear, min_numel=1) if compressing else nullcontext() as saved:
            y = F.linear(h, linear.weight.bfloat16())
        y.float().sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert saved.skipped["weight"] == 1 and saved.compressed == 1  # the weight kept, the activation compressed
    # the input gradient needs only the weight: unchanged (an FP8 weight would be off by ~3%)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_autocast_copies_of_weights_are_weights_too():
    linear = nn.Linear(128, 128)
    x = torch.randn(64, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), compress_saved_activations(min_numel=1) as saved:
        y = linear(x)
    y.float().sum().backward()
    assert saved.skipped["weight"] >= 1


def test_small_integer_and_bool_tensors_are_kept():
    with compress_saved_activations(min_numel=1000) as saved:
        small = torch.randn(10, dtype=torch.bfloat16, requires_grad=True)
        (small.exp() * 2).sum()
        big = torch.randn(100, 100, dtype=torch.bfloat16, requires_grad=True)
        index = torch.randint(0, 100, (50,))
        big.exp()[index].sum()  # saves the index tensor (int64)
        mask = torch.rand(100, 100) > 0.5
        big.exp().masked_fill(mask, 0).sum()  # saves the bool mask
    assert saved.skipped["small"] >= 1 and saved.skipped["not floating"] >= 2


def test_fp8_tensors_are_recognised_without_importing_te():
    x = torch.randn(32, 32)
    assert is_quantized_tensor(x.to(torch.float8_e4m3fn)) and is_quantized_tensor(x.to(torch.float8_e5m2))
    assert not is_quantized_tensor(x)
    assert issubclass(Float8TrainingTensor, torch.Tensor) and any(
        c.__name__ == "Float8TrainingTensor" for c in Float8TrainingTensor.__mro__)


COMPRESSION_ON_FP8_FACTOR = 1.25
"""A torchao FP8 MLP's input gradient is ~8.5% (rel.) from FP32, mostly from its E5M2 gradient casts;
compressing its saved activations too must not add more than a quarter to that (measured: ~5%)."""


def test_torchao_float8_layers_train_under_compression():
    """Float8Linear layers run as usual; compressing what they and the GELU save costs little on top
    of FP8 itself (both against the same MLP in FP32)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).bfloat16()
    fp8 = convert_to_float8_training(copy.deepcopy(base))
    compressed = copy.deepcopy(fp8)
    x, target = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    grads = []
    for model in (base, fp8, compressed):
        xi = (x * 1.0).requires_grad_(True)
        with compress_saved_activations(model, min_numel=1) if model is compressed else nullcontext() as saved:
            loss = F.mse_loss(model(xi), target)
        loss.backward()
        grads.append(xi.grad)
    assert saved.compressed >= 3
    assert rel_err(grads[2], grads[0]) < COMPRESSION_ON_FP8_FACTOR * rel_err(grads[1], grads[0])
