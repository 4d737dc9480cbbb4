"""TE's FP8 GEMMs at a model's linear shapes, and what other kernels would make of the same operands:
`python -m fp8stack.bench.te_gemms [--models llama-1b-like] [--tokens 8192]`.

Operands come from TE's own quantizers, as its modules make them. Per shape and GEMM (fprop, dgrad, wgrad
accumulating into an FP32 main_grad as with fused wgrad accumulation), against torch's BF16 matmul:
- blockwise (1x128 activations and gradients, 128x128 weights): TE's cuBLAS GEMM, and DeepGEMM's dense
  kernels on the same bytes and scales (1D2D for fprop/dgrad, 1D1D for wgrad), where DeepGEMM is installed;
- per-tensor current scaling: TE's cuBLAS GEMM with the split accumulator TE uses for dgrad and wgrad,
  and with fast accumulation (the recipe's MMParams switch).
Each entry has its median ms, TF/s and relative error against the FP32 product of the unquantized inputs.
Writes profiles/te-gemms-<gpu>.json and .md.
"""

import argparse
import statistics
from collections.abc import Callable

import torch

from fp8stack.ab import comma_separated
from fp8stack.backends import deepgemm
from fp8stack.bench.backends import linear_shapes, time_steps
from fp8stack.bench.evidence import device_slug, markdown_table, write_evidence

GEMMS = ("fprop", "dgrad", "wgrad")
LAYOUTS = {"fprop": "TN", "dgrad": "NN", "wgrad": "NT"}
"""TE general_gemm's layout per GEMM: D = op(B) @ op(A)^T with A the weight (fprop, dgrad) or the input (wgrad)."""


def deepgemm_operand(tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """TE Float8BlockwiseQTensor storage -> DeepGEMM's (E4M3 [rows, K], FP32 scales). TE keeps 1x128 scales
    as [K/128, rows padded to 4] and 128x128 scales as [rows/128, K/128 padded to 4]: the first transposed is
    DeepGEMM's MN-major TMA-aligned layout as is, the second is sliced to its K blocks."""
    data = tensor._rowwise_data if rowwise else tensor._columnwise_data
    scale = tensor._rowwise_scale_inv if rowwise else tensor._columnwise_scale_inv
    data = data.reshape(-1, data.shape[-1]).view(torch.float8_e4m3fn)
    rows, k = data.shape
    scale = scale[:, : -(-k // 128)].contiguous() if tensor._is_2D_scaled else scale.t()[:rows]
    return data, scale


def deepgemm_gemm(library, a_te, b_te, gemm: str, out: torch.Tensor) -> torch.Tensor:
    """The GEMM TE's general_gemm(a_te, b_te, layout) computes, on DeepGEMM: out = B' @ A'^T, wgrad accumulated."""
    layout = LAYOUTS[gemm]
    a = deepgemm_operand(b_te, rowwise=layout[1] == "N")
    b = deepgemm_operand(a_te, rowwise=layout[0] == "T")
    if gemm == "wgrad":
        library.fp8_gemm_nt(a, b, out, c=out, recipe=(1, 1, 128))
    else:
        library.fp8_gemm_nt(a, b, out, disable_ue8m0_cast=True)
    return out


def measure(fn: Callable[[], torch.Tensor], reference: torch.Tensor, flop: int, iters: int,
            reset: Callable[[], None] = lambda: None) -> dict:
    """Median ms, TF/s and relative error of fn()'s result (after reset()) against `reference`."""
    try:
        reset()
        error = ((fn().float() - reference).norm() / reference.norm()).item()
        ms = statistics.median(time_steps(lambda _: fn(), [], iters, warmup=5))
    except Exception as err:  # a kernel this GPU or build lacks: recorded, the other variants still run
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return {"median_ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "rel_error": round(error, 5)}


def bench_shape(n: int, k: int, tokens: int, iters: int, library) -> dict:
    """Every variant of the three GEMMs of a [tokens, k] x [n, k]^T linear."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    flop = 2 * tokens * n * k
    references = {"fprop": x.float() @ w.float().t(), "dgrad": dy.float() @ w.float(),
                  "wgrad": dy.float().t() @ x.float()}
    bf16 = {"fprop": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}

    def blockwise(dim: int):
        return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)

    def per_tensor(dtype):
        return Float8CurrentScalingQuantizer(dtype, torch.device("cuda"), rowwise=True, columnwise=True)

    operand_sets = {
        "blockwise": (blockwise(1)(x), blockwise(2)(w), blockwise(1)(dy)),
        # TE's HYBRID format, as its recipes default to: E4M3 forward, E5M2 gradients.
        "per-tensor": (per_tensor(tex.DType.kFloat8E4M3)(x), per_tensor(tex.DType.kFloat8E4M3)(w),
                       per_tensor(tex.DType.kFloat8E5M2)(dy)),
    }

    def gemm_operands(operands, gemm: str) -> tuple:
        """(A, B) of TE's general_gemm for `gemm` from (x, w, dy) quantized."""
        xq, wq, dyq = operands
        return (xq, dyq) if gemm == "wgrad" else (wq, dyq if gemm == "dgrad" else xq)

    def te_gemm(operands, gemm: str, split: bool) -> Callable[[], torch.Tensor]:
        a, b = gemm_operands(operands, gemm)
        if gemm == "wgrad":
            return lambda: general_gemm(a, b, out_dtype=torch.float32, layout="NT", out=main_grad, accumulate=True,
                                        grad=True, use_split_accumulator=split)[0]
        return lambda: general_gemm(a, b, out_dtype=torch.bfloat16, layout=LAYOUTS[gemm], grad=gemm == "dgrad",
                                    use_split_accumulator=split)[0]

    result = {"n": n, "k": k, "tokens": tokens, "gemms": {}}
    for gemm in GEMMS:
        reset = main_grad.zero_ if gemm == "wgrad" else (lambda: None)
        variants = {"bf16": bf16[gemm],
                    "blockwise TE (cuBLAS)": te_gemm(operand_sets["blockwise"], gemm, split=True),
                    "per-tensor TE, split accumulator": te_gemm(operand_sets["per-tensor"], gemm, split=True),
                    "per-tensor TE, fast accumulation": te_gemm(operand_sets["per-tensor"], gemm, split=False)}
        if library is not None:
            a, b = gemm_operands(operand_sets["blockwise"], gemm)
            out = main_grad if gemm == "wgrad" else torch.empty_like(references[gemm], dtype=torch.bfloat16)
            variants["blockwise DeepGEMM"] = (
                lambda a=a, b=b, out=out, gemm=gemm: deepgemm_gemm(library, a, b, gemm, out))
        result["gemms"][gemm] = {name: measure(fn, references[gemm], flop, iters, reset)
                                 for name, fn in variants.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b-like", help="comma-separated model descriptions")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of every GEMM (M): micro-batch x sequence")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="profiles")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8stack.bench.te_gemms needs a CUDA GPU with TransformerEngine: nothing was run")
        return 1
    library, why = deepgemm.load()
    torch.manual_seed(0)
    shapes = linear_shapes(list(comma_separated(args.models)))
    shapes.append({"source": "head (BF16 in the plan; for scale)", "n": 32000, "k": 4096, "names": ["output"]})
    results = [{**shape, **bench_shape(shape["n"], shape["k"], args.tokens, args.iters, library)} for shape in shapes]
    rows = []
    for r in results:
        for gemm, variants in r["gemms"].items():
            for name, v in variants.items():
                base = r["gemms"][gemm]["bf16"].get("median_ms")
                cells = ([v["median_ms"], v["tflops"], round(base / v["median_ms"], 3) if base else "", v["rel_error"]]
                         if "median_ms" in v else [v["error"], "", "", ""])
                rows.append([",".join(r["names"]), f"{r['n']}x{r['k']}", gemm, name, *cells])
    markdown = (f"M = {args.tokens} tokens; operands quantized by TE's quantizers; wgrad accumulates into FP32. "
                + ("" if library is not None else f"DeepGEMM not measured: {why}. ") + "\n\n"
                + markdown_table(["linear", "n x k", "GEMM", "variant", "ms", "TF/s", "over bf16", "rel. error"], rows))
    payload = {"tokens": args.tokens, "iters": args.iters, "deepgemm": why or "installed", "shapes": results}
    _, md_path = write_evidence(f"te-gemms-{device_slug()}", payload, markdown, args.out)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
