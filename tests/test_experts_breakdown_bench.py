"""fp8stack.bench.experts_breakdown on CPU: what runs without a GPU (the MoE dispatch parts and the wgrad operand
layouts it times, its options)."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from fp8stack.backends import deepgemm
from fp8stack.backends.blockwise import Fp8Tensor
from fp8stack.backends.grouped import TorchBlockwiseKernels
from fp8stack.bench import experts_breakdown
from fp8stack.evidence import device_slug
from fp8stack.models.moe import MoE, MoEConfig


def test_the_moe_dispatch_parts_run_on_one_routing():
    """Each timed part runs on this layer's routing: the BF16 dispatch's row gather and quantization of its buffer,
    the FP8 dispatch's quantizer of the tokens, FP8 row gather and backward wgrad operand, on buffers of one size."""
    torch.manual_seed(0)
    moe = MoE(256, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=128))
    moe.init_weights(0.02)
    parts = experts_breakdown._dispatch_parts(moe, torch.randn(64, 256), TorchBlockwiseKernels())
    out = {name: fn() for name, fn in parts.items()}
    rows = 64 * 2 + 4 * 127
    buffer = -(-rows // 128) * 128
    assert out["BF16 dispatch: gather BF16 rows"].shape == (buffer, 256)  # the MoE's buffer: whole 128-row tiles
    assert [t.data.shape for t in out["BF16 dispatch: quantize its rows both ways"]] == [(buffer, 256), (256, buffer)]
    assert out["FP8 dispatch: quantize the tokens once"].data.shape == (64, 256)
    moved = out["FP8 dispatch: gather FP8 rows and scales"]
    assert moved.data.shape == (buffer, 256) and moved.data.dtype == torch.float8_e4m3fn
    assert out["FP8 dispatch: wgrad operand from the tokens"].data.shape == (256, buffer)


def test_one_run_times_every_wgrad_layout_of_deepgemm_s_operands():
    """The parts a DeepGEMM run adds: its wgrad operands (grad^T [N, T], x^T [D, T]) laid out by a copy per expert, by
    the compiled gather and by the Triton tile copy (grouped_fp8's wgrad_flatten), whatever --wgrad-flatten the steps
    take; the same bytes (the Triton kernel's on CPU: tests/test_grouped_fp8.py, interpreted)."""
    counts = (256, 0, 128, 384)
    generator = torch.Generator().manual_seed(0)
    a, b = (Fp8Tensor(torch.randint(0, 256, (dim, sum(counts) + 128), dtype=torch.uint8, generator=generator)
                      .view(torch.float8_e4m3fn), torch.ones(dim, 7)) for dim in (96, 64))
    parts = experts_breakdown.wgrad_layout_parts(a, b, counts)
    assert list(parts) == ["wgrad operands' layout: a copy per expert", "wgrad operands' layout: one compiled gather",
                           "wgrad operands' layout: one Triton tile copy"]
    copied, gathered = (fn() for fn in list(parts.values())[:2])
    for by_copies, by_gather, operand in zip(copied, gathered, (a, b), strict=True):
        assert by_gather.shape == (operand.data.shape[0] * sum(counts),)
        assert torch.equal(by_gather.view(torch.uint8), by_copies.view(torch.uint8))


def test_the_wgrad_flatten_option_reaches_deepgemm_s_kernels_and_needs_them(monkeypatch, capsys):
    library = SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=None, k_grouped_fp8_gemm_nt_contiguous=None,
                              get_mk_alignment_for_contiguous_layout=lambda: 128)
    monkeypatch.setattr(deepgemm, "load", lambda: (library, ""))
    for flatten in ("copies", "compiled", "triton"):
        kernels = experts_breakdown.blockwise_kernels(argparse.Namespace(kernels="deepgemm", wgrad_flatten=flatten))
        assert kernels.flatten_k_grouped is deepgemm.WGRAD_FLATTENERS[flatten]
    with pytest.raises(SystemExit) as exit_code:
        experts_breakdown.main(["--kernels", "torch", "--wgrad-flatten", "compiled"])
    assert exit_code.value.code == 2
    assert "--wgrad-flatten compiled lays out DeepGEMM's wgrad operands: use --kernels deepgemm" in \
        capsys.readouterr().err


def test_without_a_gpu_nothing_runs(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert experts_breakdown.main(["--moe"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out



def test_the_evidence_name_marks_the_options_off_their_defaults_and_the_label():
    def stem(kind, **options):
        args = argparse.Namespace(**{"kernels": "deepgemm", "quantizer": "inductor", "compile": False, "label": "",
                                     "wgrad_flatten": "copies", **options})
        return experts_breakdown.evidence_stem(kind, args)

    device = device_slug()
    assert stem("experts-breakdown") == f"experts-breakdown-deepgemm-{device}"
    assert stem("experts-breakdown", quantizer="te", label="r3") == (
        f"experts-breakdown-deepgemm-{device}-te-quantizer-r3")
    assert stem("moe-dispatch", compile=True, kernels="torch") == f"moe-dispatch-torch-{device}-compiled"
    assert stem("experts-breakdown", wgrad_flatten="compiled", label="small") == (
        f"experts-breakdown-deepgemm-{device}-compiled-wgrad-flatten-small")
    assert stem("experts-breakdown", compile=True) == f"experts-breakdown-deepgemm-{device}"  # --moe only


def test_gpu_time_per_call_sums_what_took_device_time():
    """The profiler's averages over 3 calls, as the GPU time per step beside the wall time: each kernel's or copy's
    device time and count per call; the host's runtime calls (no device time) left out."""
    averages = [SimpleNamespace(key="deep_gemm::fprop", device_time_total=4500.0, count=3),
                SimpleNamespace(key="Memcpy DtoH (Device -> Pinned)", device_time_total=30.0, count=3),
                SimpleNamespace(key="cudaLaunchKernel", device_time_total=0.0, count=90)]
    assert experts_breakdown.per_call(averages, calls=3) == {"deep_gemm::fprop": (1.5, 1),
                                                            "Memcpy DtoH (Device -> Pinned)": (0.01, 1)}
