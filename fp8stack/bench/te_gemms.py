"""TE's FP8 GEMMs at a model's linear shapes, and what other kernels would make of the same operands:
`python -m fp8stack.bench.te_gemms [--models llama-1b-like] [--tokens 8192]`.

Operands come from TE's own quantizers, as its modules make them. Per shape and GEMM (fprop, dgrad, wgrad
accumulating into an FP32 main_grad as with fused wgrad accumulation), against torch's BF16 matmul:
- blockwise (1x128 activations and gradients, 128x128 weights): TE's cuBLAS GEMM, and DeepGEMM's dense
  kernels on the same bytes and scales (1D2D for fprop/dgrad, 1D1D for wgrad), where DeepGEMM is installed;
- per-tensor current scaling: TE's cuBLAS GEMM with the split accumulator TE uses for dgrad and wgrad,
  and with fast accumulation (the recipe's MMParams switch).
Each entry has its median ms, TF/s and relative error against the FP32 product of the unquantized inputs.
Writes profiles/runs/<date>-te-gemms-<gpu>/ (.json and .md).
"""

import argparse
import statistics
from collections.abc import Callable

import torch

from fp8stack.ab import comma_separated
from fp8stack.backends import deepgemm, te_deepgemm
from fp8stack.bench.backends import linear_shapes, time_steps
from fp8stack.evidence import (add_force_option, claim_or_exit, device_slug, markdown_table, rerender,
                                     write_evidence)

GEMMS = ("fprop", "dgrad", "wgrad")
HEAD = "head (BF16 in the plan; for scale)"
"""The output head's shape entry, timed for scale and left out of the block totals."""


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
    from transformer_engine.pytorch.cpp_extensions import general_gemm  # loads and registers transformer_engine_torch
    import transformer_engine_torch as tex
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
        return lambda: general_gemm(a, b, out_dtype=torch.bfloat16, layout=te_deepgemm.LAYOUTS[gemm],
                                    grad=gemm == "dgrad", use_split_accumulator=split)[0]

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
            layout = te_deepgemm.LAYOUTS[gemm]
            variants["blockwise DeepGEMM"] = (  # the operands' layout conversion timed with the GEMM
                lambda a=a, b=b, out=out, layout=layout: te_deepgemm.gemm(library, te_deepgemm.operands(a, b, layout),
                                                                          layout, out))
        result["gemms"][gemm] = {name: measure(fn, references[gemm], flop, iters, reset)
                                 for name, fn in variants.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b-like", help="comma-separated model descriptions")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of every GEMM (M): micro-batch x sequence")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="profiles")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the .md beside this evidence JSON from it")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if args.render:
        print(rerender(args.render, render).read_text())
        return 0
    if not torch.cuda.is_available():
        print("fp8stack.bench.te_gemms needs a CUDA GPU with TransformerEngine: nothing was run")
        return 1
    stem = f"te-gemms-{device_slug()}"
    claim_or_exit("fp8stack.bench.te_gemms", stem, args.out, args.force)
    library, why = deepgemm.load()
    torch.manual_seed(0)
    shapes = linear_shapes(list(comma_separated(args.models)))
    shapes.append({"source": HEAD, "n": 32000, "k": 4096, "names": ["output"]})
    results = [{**shape, **bench_shape(shape["n"], shape["k"], args.tokens, args.iters, library)} for shape in shapes]
    payload = {"tokens": args.tokens, "iters": args.iters, "deepgemm": why or "installed", "shapes": results}
    _, md_path = write_evidence(stem, payload, render(payload), args.out, replace=True)
    print(md_path.read_text())
    return 0


def block_totals(shapes: list[dict]) -> dict[str, dict[str, float]]:
    """Per variant, each GEMM's ms summed over one block's linears (the head excluded), and their total; a variant
    missing or failed on any of them is left out."""
    block = [shape for shape in shapes if shape["source"] != HEAD]
    totals = {}
    for variant in block[0]["gemms"]["fprop"]:
        try:
            per_gemm = {gemm: sum(shape["gemms"][gemm][variant]["median_ms"] * len(shape["names"]) for shape in block)
                        for gemm in GEMMS}
        except KeyError:
            continue
        totals[variant] = {**{gemm: round(ms, 4) for gemm, ms in per_gemm.items()},
                           "total": round(sum(per_gemm.values()), 4)}
    return totals


def render(payload: dict) -> str:
    """The evidence's Markdown: per-block totals per variant, then every GEMM of every shape."""
    rows = []
    for r in payload["shapes"]:
        for gemm, variants in r["gemms"].items():
            for name, v in variants.items():
                base = r["gemms"][gemm]["bf16"].get("median_ms")
                cells = ([v["median_ms"], v["tflops"], round(base / v["median_ms"], 3) if base else "", v["rel_error"]]
                         if "median_ms" in v else [v["error"], "", "", ""])
                rows.append([",".join(r["names"]), f"{r['n']}x{r['k']}", gemm, name, *cells])
    totals = block_totals(payload["shapes"])
    bf16 = totals.get("bf16", {}).get("total")
    total_rows = [[name, *(t[key] for key in (*GEMMS, "total")), round(bf16 / t["total"], 3) if bf16 else ""]
                  for name, t in totals.items()]
    why = payload["deepgemm"]
    return (f"M = {payload['tokens']} tokens; operands quantized by TE's quantizers; wgrad accumulates into FP32. "
            + ("" if why == "installed" else f"DeepGEMM not measured: {why}. ") + "\n\n"
            + "One block's linears (each GEMM's ms summed over them, the head excluded):\n\n"
            + markdown_table(["variant", *(f"{gemm} ms" for gemm in GEMMS), "total ms", "over bf16"], total_rows)
            + "\nEvery GEMM:\n\n"
            + markdown_table(["linear", "n x k", "GEMM", "variant", "ms", "TF/s", "over bf16", "rel. error"], rows))


if __name__ == "__main__":
    raise SystemExit(main())
