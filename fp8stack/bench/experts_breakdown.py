"""Where a blockwise grouped expert GEMM's time goes: `python -m fp8stack.bench.experts_breakdown`.

At the MoE target's expert shape (E experts x T tokens, D -> N, the w13 GEMM alone), forward + backward of
grouped_fp8's BlockwiseGroupedMM on the chosen kernels against torch's BF16 grouped GEMM, on groups the caller
aligned (what GroupedExperts under MoE hands it: no row moves) and through the padding path's row gathers, then
each part alone: the three FP8 GEMMs on pre-quantized operands (wgrad including the operand flattening its kernel
needs), the quantizers and unpaddings of both paths, and the aligned step's CUDA kernels by time. Writes
profiles/runs/<date>-experts-breakdown-<kernels>-<gpu>/.
"""

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from fp8stack.backends import deepgemm, fp8_quant
from fp8stack.backends.grouped import (AlignedTokenGroups, BlockwiseGroupedMM, TokenGroupPadding,
                                       TorchBlockwiseKernels)
from fp8stack.bench.backends import time_steps
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence

KERNELS = {"deepgemm": deepgemm.DeepGemmKernels, "torch": TorchBlockwiseKernels}


def median_ms(fn, grads_of: list[torch.Tensor], iters: int) -> float:
    """Median CUDA-event time of fn() (backends.time_steps: `grads_of` dropped before each call) after 5 warm-ups."""
    return statistics.median(time_steps(lambda _: fn(), grads_of, iters, warmup=5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=tuple(KERNELS), default="deepgemm")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per expert")
    parser.add_argument("--dim", type=int, default=7168, help="D, the GEMM's reduction dim")
    parser.add_argument("--out-features", type=int, default=4096, help="N (w13: 2 x the expert FFN width)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="profiles")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8stack.bench.experts_breakdown needs a CUDA GPU: nothing was run")
        return 1
    stem = f"experts-breakdown-{args.kernels}-{device_slug()}"
    claim_or_exit("fp8stack.bench.experts_breakdown", stem, args.out, args.force)
    e, t, d, n = args.experts, args.tokens, args.dim, args.out_features
    torch.manual_seed(0)
    x = torch.randn(e * t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    offsets = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * t
    grad = torch.randn(e * t, n, device="cuda", dtype=torch.bfloat16)
    kernels = KERNELS[args.kernels]()
    groups = AlignedTokenGroups(offsets, e * t, kernels.row_alignment)
    padding = TokenGroupPadding.build(offsets, e * t, kernels.row_alignment)
    gemm_flop = 2 * e * t * d * n

    def fp8_step(aligned: bool):
        BlockwiseGroupedMM.apply(x, w, offsets, kernels, aligned).backward(grad)

    def bf16_step():
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).backward(grad)

    steps = {"bf16 step": bf16_step, "fp8 step": lambda: fp8_step(aligned=True),
             "fp8 step, groups padded by gathers": lambda: fp8_step(aligned=False)}
    weight_fp8 = fp8_quant.quantize_blocks_128x128(w.detach())
    x_rows, x_cols = fp8_quant.quantize_both_1x128(x.detach())
    grad_rows, grad_cols = fp8_quant.quantize_both_1x128(grad)
    weight_t = fp8_quant.transpose_blocks(weight_fp8)
    y = torch.randn(e * t, n, device="cuda", dtype=torch.bfloat16)
    y_padded = padding.pad(y)
    parts = {
        "fprop GEMM": lambda: kernels.m_grouped(x_rows, weight_fp8, groups),
        "dgrad GEMM": lambda: kernels.m_grouped(grad_rows, weight_t, groups),
        "wgrad GEMM (with its operand layout)": lambda: kernels.k_grouped(grad_cols, x_cols, groups),
        "quantize x, rows and columns": lambda: groups.quantize_both_1x128(x.detach()),
        "quantize x, rows and columns, gathered": lambda: padding.quantize_both_1x128(x.detach()),
        "quantize w, 128x128": lambda: fp8_quant.quantize_blocks_128x128(w.detach()),
        "transpose w's FP8 blocks": lambda: fp8_quant.transpose_blocks(weight_fp8),
        "quantize grad, rows and columns": lambda: groups.quantize_both_1x128(grad),
        "quantize grad, rows and columns, gathered": lambda: padding.quantize_both_1x128(grad),
        "unpad y, zeroing rows past the groups": lambda: groups.unpad(y),
        "unpad y, gathered": lambda: padding.unpad(y_padded),
    }
    timings = {name: median_ms(fn, [x, w] if name in steps else [], args.iters)
               for name, fn in {**steps, **parts}.items()}
    flop = {**{name: 3 * gemm_flop for name in steps}, **{name: gemm_flop for name in parts if "GEMM" in name}}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            x.grad = w.grad = None
            fp8_step(aligned=True)
        torch.cuda.synchronize()
    kernel_rows = [[e.key[:100], round(e.device_time_total / 3 / 1e3, 4), e.count // 3]
                   for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]]
    rows = [[name, round(ms, 4), round(flop[name] / ms / 1e9, 1) if name in flop else ""]
            for name, ms in timings.items()]
    ratio = timings["bf16 step"] / timings["fp8 step"]
    gathered_ratio = timings["bf16 step"] / timings["fp8 step, groups padded by gathers"]
    markdown = (f"Blockwise w13 at E={e} x {t} tokens, {d} -> {n}, kernels {kernels.name}: forward + backward "
                f"{ratio:.3f}x the BF16 grouped GEMM's speed on aligned groups (as GroupedExperts under MoE hands "
                f"them), {gathered_ratio:.3f}x through the padding path's gathers.\n\n"
                + markdown_table(["part", "ms", "TF/s"], rows)
                + "\nCUDA kernels of one FP8 step (mean of 3):\n\n"
                + markdown_table(["kernel", "ms per step", "calls per step"], kernel_rows))
    payload = {"shape": {"experts": e, "tokens_per_expert": t, "dim": d, "out_features": n},
               "kernels": kernels.name, "iters": args.iters, "ms": timings, "fp8_over_bf16": ratio,
               "fp8_gathered_over_bf16": gathered_ratio,
               "kernels_per_step": kernel_rows}
    _, md_path = write_evidence(stem, payload, markdown, args.out, replace=True)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
