"""Probe: TE blockwise operands; TE general_gemm (cuBLAS) vs DeepGEMM fp8_gemm_nt, fprop/dgrad/wgrad."""
import json, os, sys, torch
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
import deep_gemm

def q(dim):
    return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)

def operand(t, rowwise):
    data = t._rowwise_data if rowwise else t._columnwise_data
    s = t._rowwise_scale_inv if rowwise else t._columnwise_scale_inv
    r, c = data.shape[0] if data.dim() == 2 else data.reshape(-1, data.shape[-1]).shape[0], data.shape[-1]
    data = data.reshape(r, c).view(torch.float8_e4m3fn)
    if t._is_2D_scaled:
        sf = s[:, : (c + 127) // 128].contiguous()
    else:
        sf = s.t()[:r]
    return data, sf

def dg(A, B, layout, out_dtype, out=None, accumulate=False):
    a = operand(B, layout[1] == "N")
    b = operand(A, layout[0] == "T")
    if out is None:
        out = torch.empty(a[0].shape[0], b[0].shape[0], dtype=out_dtype, device="cuda")
    if out.dtype == torch.float32:
        if not accumulate:
            out.zero_()
        deep_gemm.fp8_gemm_nt(a, b, out, c=out, recipe=(1, 1, 128))
    else:
        deep_gemm.fp8_gemm_nt(a, b, out, disable_ue8m0_cast=True)
    return out

def timeit(fn, iters=30, warm=5):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2]

M = 8192
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336), "head": (32000, 4096)}
res = {"device": torch.cuda.get_device_name(), "rows": []}
for name, (N, K) in shapes.items():
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    xq, wq, dyq = q(1)(x), q(2)(w), q(1)(dy)
    mg = torch.zeros(N, K, device="cuda", dtype=torch.float32)
    cases = {
        "fprop": (lambda: general_gemm(wq, xq, out_dtype=torch.bfloat16, layout="TN")[0],
                  lambda: dg(wq, xq, "TN", torch.bfloat16), x.float() @ w.float().t(), 2 * M * N * K),
        "dgrad": (lambda: general_gemm(wq, dyq, out_dtype=torch.bfloat16, layout="NN", grad=True)[0],
                  lambda: dg(wq, dyq, "NN", torch.bfloat16), dy.float() @ w.float(), 2 * M * N * K),
        "wgrad": (lambda: general_gemm(xq, dyq, out_dtype=torch.float32, layout="NT", grad=True, out=mg, accumulate=True)[0],
                  lambda: dg(xq, dyq, "NT", torch.float32, out=mg, accumulate=True), dy.float().t() @ x.float(), 2 * M * N * K),
    }
    for case, (te_fn, dg_fn, ref, flops) in cases.items():
        row = {"shape": name, "N": N, "K": K, "M": M, "gemm": case}
        try:
            if case == "wgrad":
                mg.zero_(); te_out = te_fn().clone(); mg.zero_(); dg_out = dg_fn().clone()
            else:
                te_out, dg_out = te_fn().float(), dg_fn().float()
            row["te_rel_err"] = ((te_out - ref).norm() / ref.norm()).item()
            row["dg_rel_err"] = ((dg_out - ref).norm() / ref.norm()).item()
            row["te_vs_dg_rel"] = ((te_out - dg_out).norm() / te_out.norm()).item()
            row["te_ms"] = timeit(te_fn); row["dg_ms"] = timeit(dg_fn)
            row["te_tflops"] = flops / row["te_ms"] / 1e9; row["dg_tflops"] = flops / row["dg_ms"] / 1e9
            row["speedup"] = row["te_ms"] / row["dg_ms"]
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "dense_probe.json"), "w"), indent=1)
