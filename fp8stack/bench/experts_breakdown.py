"""Where a blockwise grouped expert GEMM's time goes: `python -m fp8stack.bench.experts_breakdown`.

At the MoE target's expert shape (E experts x T tokens, D -> N, the w13 GEMM alone), forward + backward of
grouped_fp8's BlockwiseGroupedMM on the chosen kernels against torch's BF16 grouped GEMM, on groups the caller
aligned (what GroupedExperts under MoE hands it: no row moves) and through the padding path's row gathers, both
steps also with the weight gradient added into an FP32 main_grad (as fp8stack's training runs them), the FP8 one
also with the weight's FP8 blocks and their transpose cached (grouped_fp8's cache_fp8_weights: what a step's later
micro-batches run), then each part alone: the three FP8 GEMMs on pre-quantized operands (wgrad including the operand
flattening its kernel needs), the quantizers and unpaddings of both paths, on DeepGEMM that flattening alone each way
(a copy per expert, one compiled gather, one Triton tile copy: grouped_fp8's wgrad_flatten), the steps' GPU time
beside their wall time (a single layer's backward waits for its forward's group sizes with nothing else queued; in a
model the other layers' work fills that gap), and the main_grad FP8 step's CUDA kernels by time. Writes
profiles/runs/<date>-experts-breakdown-<kernels>-<gpu>/ (-te-quantizer with --quantizer te: activations and
gradients quantized by TE's Float8BlockQuantizer, grouped_fp8's quantizer option, the GEMMs timed on its operands;
-compiled-wgrad-flatten with --wgrad-flatten compiled, every step and GEMM flattening by the gather, and so on).

With --moe, one whole MoE layer instead (router, permutation, SwiGLU experts, weighted combine; experts x tokens /
top_k tokens): forward + backward with BF16 experts, blockwise experts on the BF16 dispatch and on the FP8 dispatch
(grouped_fp8's fp8_dispatch), the memory each forward holds for its backward, and the dispatches' parts alone.
Writes profiles/runs/<date>-moe-dispatch-<kernels>-<gpu>/ (-compiled with --compile, -te-quantizer with --quantizer
te).
"""

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from fp8stack.backends import deepgemm, fp8_quant, te_quant
from fp8stack.backends.blockwise import Fp8Tensor
from fp8stack.backends.grouped import (INDUCTOR_QUANTIZER, AlignedTokenGroups, BlockwiseGroupedMM, Float8GroupedExperts,
                                       TokenGroupPadding, TorchBlockwiseKernels, UNCACHED, WeightBlocks)
from fp8stack.bench.backends import time_steps
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.models.moe import GroupedMMIntoMainGrad, MoE, MoEConfig, permute

KERNELS = ("deepgemm", "torch")
QUANTIZERS = {"inductor": lambda: INDUCTOR_QUANTIZER, "te": te_quant.TEBlockQuantizer}
"""grouped_fp8's quantizer option: who quantizes the activations and gradients in 1x128 tiles."""
BLOCKWISE = {"w13": "blockwise", "w2": "blockwise"}


def median_ms(fn, grads_of: list[torch.Tensor], iters: int) -> float:
    """Median CUDA-event time of fn() (backends.time_steps: `grads_of` dropped before each call) after 5 warm-ups."""
    return statistics.median(time_steps(lambda _: fn(), grads_of, iters, warmup=5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=KERNELS, default="deepgemm")
    parser.add_argument("--quantizer", choices=tuple(QUANTIZERS), default="inductor",
                        help="who quantizes activations and gradients (grouped_fp8's quantizer; te: DeepGEMM only)")
    parser.add_argument("--wgrad-flatten", default="copies",
                        choices=[choice for choice in deepgemm.WGRAD_FLATTENERS if choice != "auto"],
                        help="what lays out DeepGEMM's wgrad operands in the timed steps and wgrad GEMM "
                        "(grouped_fp8's wgrad_flatten); the parts time both layouts alone")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per expert")
    parser.add_argument("--dim", type=int, default=7168, help="D, the GEMM's reduction dim")
    parser.add_argument("--out-features", type=int, default=4096, help="N (w13: 2 x the expert FFN width)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--moe", action="store_true",
                        help="time one MoE layer with the BF16 and the FP8 dispatch instead of the w13 GEMM alone")
    parser.add_argument("--top-k", type=int, default=4, help="--moe: experts each token runs")
    parser.add_argument("--compile", action="store_true",
                        help="--moe: torch.compile the layer, as the trainer compiles its blocks on a GPU")
    parser.add_argument("--out", default="profiles")
    parser.add_argument("--label", default="", help="added to the evidence's name (a later run of the same day "
                        "beside an earlier one, e.g. after a change)")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if args.quantizer == "te" and args.kernels != "deepgemm":
        parser.error("--quantizer te lays TE's operands out for DeepGEMM: use --kernels deepgemm")
    if args.wgrad_flatten != "copies" and args.kernels != "deepgemm":
        parser.error(f"--wgrad-flatten {args.wgrad_flatten} lays out DeepGEMM's wgrad operands: use --kernels deepgemm")
    if not torch.cuda.is_available():
        print("fp8stack.bench.experts_breakdown needs a CUDA GPU: nothing was run")
        return 1
    return moe_breakdown(args) if args.moe else w13_breakdown(args)


def w13_breakdown(args: argparse.Namespace) -> int:
    stem = evidence_stem("experts-breakdown", args)
    claim_or_exit("fp8stack.bench.experts_breakdown", stem, args.out, args.force)
    e, t, d, n = args.experts, args.tokens, args.dim, args.out_features
    torch.manual_seed(0)
    x = torch.randn(e * t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    offsets = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * t
    grad = torch.randn(e * t, n, device="cuda", dtype=torch.bfloat16)
    kernels, quantizer = blockwise_kernels(args), QUANTIZERS[args.quantizer]()
    groups = AlignedTokenGroups(offsets, e * t, kernels.row_alignment)
    padding = TokenGroupPadding.build(offsets, e * t, kernels.row_alignment)
    gemm_flop = 2 * e * t * d * n

    main_grad = torch.zeros(e, n, d, device="cuda")
    steps = w13_steps(x, w, offsets, grad, kernels, quantizer, main_grad)
    weight_fp8 = fp8_quant.quantize_blocks_128x128(w.detach())
    # The GEMMs on the quantizer's operands: their scale layout decides whether DeepGEMM transposes the scales first.
    x_rows, x_cols = quantizer.quantize_both_1x128(groups, x.detach())
    grad_rows, grad_cols = quantizer.quantize_both_1x128(groups, grad)
    weight_t = fp8_quant.transpose_blocks(weight_fp8)
    y = torch.randn(e * t, n, device="cuda", dtype=torch.bfloat16)
    y_padded = padding.pad(y)
    parts = {
        "fprop GEMM": lambda: kernels.m_grouped(x_rows, weight_fp8, groups),
        "dgrad GEMM": lambda: kernels.m_grouped(grad_rows, weight_t, groups),
        "wgrad GEMM (with its operand layout)": lambda: kernels.k_grouped(grad_cols, x_cols, groups),
        "quantize x, rows and columns": lambda: quantizer.quantize_both_1x128(groups, x.detach()),
        "quantize x, rows and columns, gathered": lambda: quantizer.quantize_both_1x128(padding, x.detach()),
        "quantize w, 128x128": lambda: fp8_quant.quantize_blocks_128x128(w.detach()),
        "transpose w's FP8 blocks": lambda: fp8_quant.transpose_blocks(weight_fp8),
        "quantize grad, rows and columns": lambda: quantizer.quantize_both_1x128(groups, grad),
        "quantize grad, rows and columns, gathered": lambda: quantizer.quantize_both_1x128(padding, grad),
        "unpad y, aligned groups (the GEMM output as is, no kernel)": lambda: groups.unpad(y),
        "unpad y, gathered": lambda: padding.unpad(y_padded),
        **(wgrad_layout_parts(grad_cols, x_cols, groups.counts) if args.kernels == "deepgemm" else {}),
    }
    timings = {name: median_ms(fn, [x, w] if name in steps else [], args.iters)
               for name, fn in {**steps, **parts}.items()}
    flop = {**{name: 3 * gemm_flop for name in steps}, **{name: gemm_flop for name in parts if "GEMM" in name}}
    kernels_of = {name: kernel_times(steps[name], [x, w]) for name in BUSY_STEPS}
    busy = {name: sum(ms for ms, _ in kernels_of[name].values()) for name in BUSY_STEPS}
    kernel_rows = [[key[:100], round(ms, 4), count] for key, (ms, count) in
                   sorted(kernels_of[FP8_MAIN_GRAD_STEP].items(), key=lambda item: -item[1][0])[:25]]
    rows = [[name, round(ms, 4), round(flop[name] / ms / 1e9, 1) if name in flop else ""]
            for name, ms in timings.items()]
    busy_rows = [[name, round(timings[name], 4), round(busy[name], 4), round(timings[name] - busy[name], 4)]
                 for name in BUSY_STEPS]
    ratio = timings["bf16 step"] / timings["fp8 step"]
    gathered_ratio = timings["bf16 step"] / timings["fp8 step, groups padded by gathers"]
    main_grad_ratio = timings[BF16_MAIN_GRAD_STEP] / timings[FP8_MAIN_GRAD_STEP]
    cached_ratio = timings[BF16_MAIN_GRAD_STEP] / timings[FP8_CACHED_WEIGHT_STEP]
    busy_main_grad_ratio = busy[BF16_MAIN_GRAD_STEP] / busy[FP8_MAIN_GRAD_STEP]
    busy_cached_ratio = busy[BF16_MAIN_GRAD_STEP] / busy[FP8_CACHED_WEIGHT_STEP]
    markdown = (f"Blockwise w13 at E={e} x {t} tokens, {d} -> {n}, kernels {kernels.name}, quantizer "
                f"{quantizer.name}{_wgrad_layout(args)}: forward + backward "
                f"{ratio:.3f}x the BF16 grouped GEMM's speed on aligned groups (as GroupedExperts under MoE hands "
                f"them), {gathered_ratio:.3f}x through the padding path's gathers; {main_grad_ratio:.3f}x with the "
                "weight gradients added into an FP32 main_grad, as fp8stack's training runs both (master weights); "
                f"{cached_ratio:.3f}x with the weight's FP8 blocks also cached (cache_fp8_weights: a step's later "
                "micro-batches). On GPU time alone (the steps' kernels and copies, without the gaps the host leaves "
                "between them, which the other layers' work fills in a model): "
                f"{busy_main_grad_ratio:.3f}x into main_grad, {busy_cached_ratio:.3f}x with the FP8 weight cached."
                "\n\n"
                + markdown_table(["part", "ms", "TF/s"], rows)
                + "\nGPU time per step (mean of 3 profiled steps) against the timed wall time:\n\n"
                + markdown_table(["step", "wall ms", "GPU busy ms", "idle ms"], busy_rows)
                + f"\nCUDA kernels of one '{FP8_MAIN_GRAD_STEP}' (mean of 3):\n\n"
                + markdown_table(["kernel", "ms per step", "calls per step"], kernel_rows))
    payload = {"shape": {"experts": e, "tokens_per_expert": t, "dim": d, "out_features": n},
               "kernels": kernels.name, "quantizer": quantizer.name, "wgrad_flatten": args.wgrad_flatten,
               "iters": args.iters, "ms": timings,
               "fp8_over_bf16": ratio,
               "fp8_gathered_over_bf16": gathered_ratio,
               "fp8_over_bf16_into_main_grad": main_grad_ratio,
               "fp8_over_bf16_into_main_grad_weight_cached": cached_ratio,
               "busy_ms": busy,
               "busy_fp8_over_bf16_into_main_grad": busy_main_grad_ratio,
               "busy_fp8_over_bf16_into_main_grad_weight_cached": busy_cached_ratio,
               "kernels_per_step": kernel_rows}
    _, md_path = write_evidence(stem, payload, markdown, args.out, replace=True)
    print(md_path.read_text())
    return 0


def blockwise_kernels(args: argparse.Namespace):
    """The blockwise GEMMs' kernels the options name: DeepGEMM's (laying out the wgrad operands as --wgrad-flatten
    says) or torch's."""
    if args.kernels == "deepgemm":
        return deepgemm.DeepGemmKernels(wgrad_flatten=args.wgrad_flatten)
    return TorchBlockwiseKernels()


def _wgrad_layout(args: argparse.Namespace) -> str:
    """What lays out the wgrad operands, for the evidence's first line: DeepGEMM's kernels only take them laid out."""
    return f", wgrad operands laid out by {args.wgrad_flatten}" if args.kernels == "deepgemm" else ""


def wgrad_layout_parts(a: Fp8Tensor, b: Fp8Tensor, counts: tuple[int, ...]) -> dict:
    """DeepGEMM's wgrad operands (a [M, T], b [N, T], as k_grouped takes them) laid out K-grouped both ways
    grouped_fp8's wgrad_flatten offers, whatever the run's --wgrad-flatten: the choice timed in one run."""
    def both(flatten):
        return lambda: (flatten(a.data, counts), flatten(b.data, counts))

    return {"wgrad operands' layout: a copy per expert": both(deepgemm.flatten_k_grouped),
            "wgrad operands' layout: one compiled gather": both(deepgemm.flatten_k_grouped_compiled),
            "wgrad operands' layout: one Triton tile copy": both(deepgemm.flatten_k_grouped_triton)}


BF16_MAIN_GRAD_STEP = "bf16 step, wgrad into main_grad"
FP8_MAIN_GRAD_STEP = "fp8 step, wgrad into main_grad"
FP8_CACHED_WEIGHT_STEP = "fp8 step, wgrad into main_grad, FP8 weight cached"
BUSY_STEPS = ("bf16 step", "fp8 step", BF16_MAIN_GRAD_STEP, FP8_MAIN_GRAD_STEP, FP8_CACHED_WEIGHT_STEP)
"""The steps whose GPU time the evidence sets beside their wall time."""


def kernel_times(fn, grads_of: list[torch.Tensor], calls: int = 3) -> dict[str, tuple[float, int]]:
    """Each CUDA kernel's and copy's device ms and count per call of fn() (`grads_of` dropped before each call),
    over `calls` profiled calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for tensor in grads_of:
                tensor.grad = None
            fn()
        torch.cuda.synchronize()
    return per_call(prof.key_averages(), calls)


def per_call(averages, calls: int) -> dict[str, tuple[float, int]]:
    """{name: (device ms, count) per call} of the profiler's averages over `calls` calls: the ones that took device
    time (the host's runtime calls, also listed, take none)."""
    return {e.key: (e.device_time_total / calls / 1e3, e.count // calls) for e in averages if e.device_time_total > 0}


def w13_steps(x, w, offsets, grad, kernels, quantizer, main_grad) -> dict:
    """The timed forward + backward steps of one grouped GEMM: BF16 and blockwise FP8 (on aligned groups, and through
    the padding path's gathers), each returning the weight gradient as autograd's, and, as fp8stack's training runs
    them (master weights), adding it into the FP32 `main_grad` instead (GroupedMMIntoMainGrad; grouped_fp8's wgrad
    GEMM accumulating in place); the FP8 one into main_grad also with the weight's FP8 blocks and their transpose
    cached (WeightBlocks, made at its first call: no optimizer step comes between the calls, so every later call
    runs what a step's later micro-batches run under cache_fp8_weights)."""
    cached = WeightBlocks(cached=True)

    def fp8_step(aligned: bool, into=None, weight_blocks=UNCACHED):
        BlockwiseGroupedMM.apply(x, w, offsets, kernels, aligned, into, quantizer, weight_blocks).backward(grad)

    return {"bf16 step": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).backward(grad),
            "fp8 step": lambda: fp8_step(aligned=True),
            "fp8 step, groups padded by gathers": lambda: fp8_step(aligned=False),
            BF16_MAIN_GRAD_STEP: lambda: GroupedMMIntoMainGrad.apply(x, w, offsets, main_grad).backward(grad),
            FP8_MAIN_GRAD_STEP: lambda: fp8_step(aligned=True, into=main_grad),
            FP8_CACHED_WEIGHT_STEP: lambda: fp8_step(aligned=True, into=main_grad, weight_blocks=cached)}


def moe_breakdown(args: argparse.Namespace) -> int:
    stem = evidence_stem("moe-dispatch", args)
    claim_or_exit("fp8stack.bench.experts_breakdown", stem, args.out, args.force)
    e, top_k, d, f = args.experts, args.top_k, args.dim, args.out_features // 2
    tokens = e * args.tokens // top_k
    moe = _moe_layer(e, top_k, d, f)
    kernels, quantizer = blockwise_kernels(args), QUANTIZERS[args.quantizer]()
    dispatches = {"blockwise, BF16 dispatch": False, "blockwise, FP8 dispatch": True}
    variants = {"bf16 experts": moe.experts,
                **{name: Float8GroupedExperts.from_experts(moe.experts, BLOCKWISE, kernels, None, fp8_dispatch,
                                                           quantizer) for name, fp8_dispatch in dispatches.items()}}
    torch.manual_seed(1)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    rows = {}
    for name, experts in variants.items():
        moe.experts = experts
        torch._dynamo.reset()  # a compiled layer guards on its experts module: compile each variant afresh
        forward = torch.compile(moe) if args.compile else moe
        ms = median_ms(lambda: forward(x).backward(grad), [x, *moe.parameters()], args.iters)
        moe.zero_grad(set_to_none=True)
        x.grad = None
        rows[name] = {"ms": ms, **_memory_mib(lambda: forward(x), grad)}
    parts = {name: median_ms(fn, [], args.iters) for name, fn in _dispatch_parts(moe, x.detach(), kernels).items()}
    bf16_ms = rows["bf16 experts"]["ms"]
    table = [[name, round(r["ms"], 4), round(bf16_ms / r["ms"], 3), r["held_mib"], r["peak_mib"]]
             for name, r in rows.items()]
    fp8_over_bf16_dispatch = rows["blockwise, BF16 dispatch"]["ms"] / rows["blockwise, FP8 dispatch"]["ms"]
    markdown = (f"MoE layer, {tokens} tokens top-{top_k} of E={e} experts, D={d}, F={f}, kernels {kernels.name}, "
                f"quantizer {quantizer.name}{_wgrad_layout(args)}"
                f"{', compiled' if args.compile else ''}: forward + backward with the FP8 dispatch "
                f"{fp8_over_bf16_dispatch:.3f}x the BF16 dispatch's speed (blockwise experts both).\n\n"
                + markdown_table(["experts", "ms", "vs bf16", "MiB held for backward", "MiB peak"], table)
                + "\nThe dispatches' parts alone:\n\n"
                + markdown_table(["part", "ms"], [[name, round(ms, 4)] for name, ms in parts.items()]))
    payload = {"shape": {"experts": e, "top_k": top_k, "tokens": tokens, "dim": d, "expert_ffn": f},
               "kernels": kernels.name, "quantizer": quantizer.name, "wgrad_flatten": args.wgrad_flatten,
               "compiled": args.compile, "iters": args.iters, "variants": rows,
               "parts_ms": parts, "fp8_dispatch_over_bf16_dispatch": fp8_over_bf16_dispatch}
    _, md_path = write_evidence(stem, payload, markdown, args.out, replace=True)
    print(md_path.read_text())
    return 0


def evidence_stem(kind: str, args: argparse.Namespace) -> str:
    """'<kind>-<kernels>-<device>', marked with the options that differ from the defaults and the label."""
    compiled = "-compiled" if kind == "moe-dispatch" and args.compile else ""
    quantizer = "" if args.quantizer == "inductor" else f"-{args.quantizer}-quantizer"
    flatten = "" if args.wgrad_flatten == "copies" else f"-{args.wgrad_flatten}-wgrad-flatten"
    label = f"-{args.label}" if args.label else ""
    return f"{kind}-{args.kernels}-{device_slug()}{compiled}{quantizer}{flatten}{label}"


def _moe_layer(experts: int, top_k: int, dim: int, ffn: int) -> MoE:
    """A DeepSeek-style MoE layer in BF16 on the GPU (sigmoid router, top-k weights renormalised), no shared expert:
    the routed experts' share is what the dispatch changes."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_dim=ffn, score_func="sigmoid", route_norm=True)
    with torch.device("cuda"):
        moe = MoE(dim, config)
    moe.init_weights(0.02)
    return moe.to(torch.bfloat16)


def _memory_mib(forward, grad: torch.Tensor) -> dict[str, float]:
    """What a forward leaves allocated for its backward (saved tensors and output) and the step's peak above the
    memory before it, in MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward()
    held = torch.cuda.memory_allocated() - before
    out.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return {"held_mib": round(held / 2**20, 1), "peak_mib": round(peak / 2**20, 1)}


def _dispatch_parts(moe: MoE, x: torch.Tensor, kernels) -> dict:
    """Each dispatch's own work on this layer's routing: the BF16 row gather and the quantization of its rows (both
    forms, as BlockwiseGroupedMM's forward), against the tokens quantized once, their FP8 rows gathered, and the
    wgrad operand the FP8 dispatch quantizes in its backward from the tokens through the row index."""
    alignment = kernels.row_alignment
    with torch.no_grad():
        perm = permute(moe.router(x)[1], moe.config.num_experts, alignment)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    bf16_rows = padded[perm.row_token]
    source = fp8_quant.dispatch_source(perm.row_token, x.shape[0], alignment)
    tokens_fp8 = fp8_quant.quantize_rows_1x128(x)
    return {
        "BF16 dispatch: gather BF16 rows": lambda: padded[perm.row_token],
        "BF16 dispatch: quantize its rows both ways": lambda: fp8_quant.pad_quantize_both_1x128(bf16_rows, alignment),
        "FP8 dispatch: quantize the tokens once": lambda: fp8_quant.quantize_rows_1x128(x),
        "FP8 dispatch: gather FP8 rows and scales": lambda: fp8_quant.gather_fp8_rows(tokens_fp8, source),
        "FP8 dispatch: wgrad operand from the tokens": lambda: fp8_quant.gather_quantize_cols_1x128(x, source),
    }


if __name__ == "__main__":
    raise SystemExit(main())
