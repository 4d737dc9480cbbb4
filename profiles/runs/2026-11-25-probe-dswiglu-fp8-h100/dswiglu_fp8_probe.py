"""Probe: can TE 2.20.2's LayerNormMLP backward under delayed scaling write SwiGLU's gradient straight to FP8?

Today (layernorm_mlp.py, swiglu has no fused dbias+dact+quantize entry) it runs tex.dswiglu into BF16, then
tex.bgrad_quantize (cast + transpose + a bias-gradient reduction a bias-free MLP discards). tex.dswiglu also takes
the quantizer (TE's ops.SwiGLU passes it). At llama-1b-like's FC1 shape (8192 tokens, 2 x 14336), per call:
bytes of the fused path's rowwise data, transpose and scale_inv against today's path, and the time of each path
(median of 50 after 10 warm-ups); also the fused path with rowwise output only plus TE's own transpose
(update_usage). The fused path rounds once (FP32 -> FP8) where today's rounds twice (FP32 -> BF16 -> FP8), so bytes
may differ by one FP8 step: each path's dequantized gradient is also compared with an FP32 reference, and the amax
each path hands delayed scaling with the reference's. Run from the project root on a GPU with TE:
python3 profiles/probes/dswiglu_fp8_probe.py
"""
import statistics
import sys

import torch

sys.path.insert(0, ".")
import transformer_engine.pytorch  # noqa: E402,F401  (loads TE's extension, transformer_engine_torch)
from fp8stack.bench.evidence import device_slug, markdown_table, write_evidence  # noqa: E402

TOKENS, FFN = 8192, 14336


def quantizer(columnwise: bool):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    scale = torch.full((1,), 2.0 ** 10, device="cuda")  # a delayed scale: grad amax ~ 2^-3 here
    return Float8Quantizer(scale, torch.zeros(1, device="cuda"), tex.DType.kFloat8E5M2, rowwise=True,
                           columnwise=columnwise)


def today(grad, fc1_out):
    import transformer_engine_torch as tex

    dact = tex.dswiglu(grad, fc1_out, None)
    return tex.bgrad_quantize(dact, quantizer(True))[1]


def fused(grad, fc1_out):
    import transformer_engine_torch as tex

    return tex.dswiglu(grad, fc1_out, quantizer(True))


def fused_then_transpose(grad, fc1_out):
    import transformer_engine_torch as tex

    out = tex.dswiglu(grad, fc1_out, quantizer(False))
    out.update_usage(columnwise_usage=True)
    return out


def reference(grad, fc1_out):
    """FP32 gradient of TE's swiglu (silu of the first half times the second) with respect to FC1's output."""
    gate, up = fc1_out.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad.float()
    return torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1)


def accuracy(out, ref) -> dict:
    """Relative rms error of the dequantized FP8 gradient against the FP32 reference, its amax against the
    reference's, and the share of FP8 bytes that differ from today's path."""
    deq = out.dequantize(dtype=torch.float32)
    return {"rel_rms_err": float((deq - ref).norm() / ref.norm()),
            "amax": float(out._quantizer.amax.item()) if out._quantizer is not None else None}


def median_ms(fn, *args) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def same(a, b) -> bool | None:
    if a is None or b is None:
        return None
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def main():
    torch.manual_seed(0)
    fc1_out = torch.randn(TOKENS, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, FFN, device="cuda", dtype=torch.bfloat16) * 0.02
    baseline = today(grad, fc1_out)
    ref = reference(grad, fc1_out)
    rows, results = [], {}
    for name, fn in (("fused dswiglu (rowwise + transpose)", fused),
                     ("fused dswiglu rowwise, then update_usage transpose", fused_then_transpose)):
        out = fn(grad, fc1_out)
        transpose = out._transpose if not out._transpose_invalid else None
        results[name] = {"data_equal": same(out._data, baseline._data),
                         "data_bytes_differing": float((out._data != baseline._data).float().mean()),
                         "transpose_equal": same(transpose, baseline._transpose),
                         "scale_inv_equal": bool(torch.equal(out._scale_inv, baseline._scale_inv)),
                         **accuracy(out, ref), "ms": median_ms(fn, grad, fc1_out)}
    results["today: dswiglu to BF16, bgrad_quantize"] = {**accuracy(baseline, ref),
                                                         "ms": median_ms(today, grad, fc1_out)}
    ref_amax = float(ref.abs().max())
    for name, r in results.items():
        rows.append([name, r.get("data_equal", "-"), f"{r.get('data_bytes_differing', 0):.2e}",
                     r.get("transpose_equal", "-"), r.get("scale_inv_equal", "-"), f"{r['rel_rms_err']:.5f}",
                     f"{r['amax']:.6g}" if r["amax"] is not None else "-", f"{r['ms']:.4f}"])
    markdown = (f"FC1 shape {TOKENS} x 2*{FFN}, E5M2 gradient, delayed scale 2^10; equal = bytes equal to today's "
                f"path; error = relative rms error of the dequantized gradient against an FP32 reference; amax = "
                f"what the path hands delayed scaling (the reference's: {ref_amax:.6g}).\n\n"
                + markdown_table(["path", "data equal", "bytes differing", "transpose equal", "scale_inv equal",
                                  "error", "amax", "ms per call"], rows))
    write_evidence(f"dswiglu-fp8-probe-{device_slug()}", {"tokens": TOKENS, "ffn": FFN, "reference_amax": ref_amax,
                                                         "results": results},
                   markdown, "profiles/probes")
    print(markdown)


if __name__ == "__main__":
    main()
