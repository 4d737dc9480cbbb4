"""Runtime evidence on one GPU: peak memory and step time of the llama-1b-like model (BF16 parameters,
TE tensorwise FP8) with recompute off, TE-checkpoint selective recompute (mlp, block) and FP8-compressed
saved activations; and whether a training step captures as a CUDA graph with each FP8 backend (tiny
models), or the exact reason it does not.

    python -m fp8stack.bench.runtime [--batch 1] [--seq 4096] [--steps 5] [--out profiles]

Every variant runs in its own try/except; an error is recorded in the evidence, never dropped.
"""

import argparse
import gc
import statistics
import sys
import traceback
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from fp8stack.assembly import assemble
from fp8stack.backends import backend_class
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.models import Llama, load_model_config
from fp8stack.plan import PolicyConfig, load_description, make_plan
from fp8stack.runtime import capture_check, compress_saved_activations
from fp8stack.plan.recipes import is_fp8

GIB = 2 ** 30


@dataclass(frozen=True)
class MemoryVariant:
    """One llama-1b-like training configuration whose memory and time are measured."""

    name: str
    """Row label."""
    recipe: str
    """Policy recipe (the backend is TE for FP8 recipes)."""
    recompute_modules: tuple[str, ...] = ()
    """RECOMPUTE_MODULES names checkpointed in every block; () for no recompute."""
    compress: bool = False
    """Store saved activations as FP8 (compress_saved_activations) around the forward."""


MEMORY_VARIANTS = (
    MemoryVariant("bf16, no recompute", "bf16"),
    MemoryVariant("te tensorwise, no recompute", "tensorwise"),
    MemoryVariant("te tensorwise, recompute mlp (TE checkpoint)", "tensorwise", ("mlp",)),
    MemoryVariant("te tensorwise, recompute block (TE checkpoint)", "tensorwise", ("block",)),
    MemoryVariant("te delayed, recompute block (TE checkpoint)", "delayed", ("block",)),
    MemoryVariant("te tensorwise, FP8-compressed saved activations", "tensorwise", compress=True),
)

CAPTURE_VARIANTS = {
    "bf16": ("tiny", PolicyConfig(recipe="bf16")),
    "torchao tensorwise": ("tiny", PolicyConfig(recipe="tensorwise", backend="torchao", small_gemm_filter="off")),
    "te tensorwise": ("tiny", PolicyConfig(recipe="tensorwise", backend="te", small_gemm_filter="off")),
    "te delayed": ("tiny", PolicyConfig(recipe="delayed", backend="te", small_gemm_filter="off")),
    "grouped_fp8 rowwise (tiny MoE)": ("tiny-moe", PolicyConfig(recipe="rowwise", small_gemm_filter="off")),
}
"""Capture check variant -> (model description, policy). The tiny models' GEMMs are all planned FP8."""

def build(model_name: str, policy: PolicyConfig, **assemble_kwargs) -> torch.nn.Module:
    """The fp8stack Llama for `model_name` on the GPU in BF16, assembled with `policy`'s plan."""
    with torch.device("cuda"):
        model = Llama(load_model_config(model_name)).to(torch.bfloat16)
    plan = make_plan(load_description(model_name), policy)
    return assemble(model, plan, **assemble_kwargs)


def token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return Llama.loss(model(tokens[:, :-1]), tokens[:, 1:])


def _free() -> None:
    """Release what a variant left: Python objects, cached CUDA blocks, TE's global FP8 buffers."""
    gc.collect()
    torch.cuda.empty_cache()
    if "transformer_engine.pytorch" in sys.modules:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def measure(variant: MemoryVariant, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """Peak memory (whole step, and above the memory held before it) and median step time."""
    policy = PolicyConfig(recipe=variant.recipe, backend="te" if is_fp8(variant.recipe) else "auto")
    model = optimizer = None
    try:
        model = build("llama-1b-like", policy, recompute="all" if variant.recompute_modules else None,
                      recompute_modules=variant.recompute_modules or ("block",))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        vocab = model.config.vocab_size
        generator = torch.Generator("cuda").manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=generator)
        saved = None

        def step() -> torch.Tensor:
            nonlocal saved
            context = compress_saved_activations(model) if variant.compress else nullcontext()
            with context as saved:
                loss = token_loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated()
        result = {"peak_gib": round(peak / GIB, 2), "activation_peak_gib": round((peak - held) / GIB, 2),
                  "held_gib": round(held / GIB, 2), "median_ms": round(statistics.median(times), 1),
                  "loss": round(float(losses[-1]), 4)}
        if saved is not None:
            result["compressed"] = {"tensors": saved.compressed, "gib_saved": round(saved.bytes_saved / GIB, 2),
                                    "skipped": dict(saved.skipped)}
        return result
    except Exception as err:  # recorded, never dropped
        return {"error": _error(err), "traceback": traceback.format_exc(limit=4)}
    finally:
        del model, optimizer
        _free()


def capture(name: str, batch: int = 2, seq: int = 128) -> dict:
    """Capture one training step (forward, backward, AdamW step) of a tiny model with this backend."""
    model_name, policy = CAPTURE_VARIANTS[name]
    model = None
    try:
        model = build(model_name, policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device="cuda")
        report = capture_check(model, tokens, token_loss, optimizer)
        return {"captured": report.captured, "summary": report.summary(), "phase": report.phase,
                "module": report.module, "reason": report.reason}
    except Exception as err:  # building failed: recorded as the reason
        return {"captured": False, "summary": f"not built: {_error(err)}", "reason": _error(err), "phase": "build",
                "module": None}
    finally:
        del model
        _free()


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("fp8stack.bench.runtime needs a CUDA GPU (torch.cuda.is_available() is False): nothing was run or "
              "written.", file=sys.stderr)
        return 2
    stem = f"runtime-{device_slug()}"
    claim_or_exit("fp8stack.bench.runtime", stem, args.out, args.force)
    memory = []
    for variant in MEMORY_VARIANTS:
        r = {"variant": variant.name, **measure(variant, args.batch, args.seq, args.steps, args.warmup)}
        memory.append(r)
        outcome = r["error"] if "error" in r else f"{r['peak_gib']} GiB peak, {r['median_ms']} ms"
        print(f"{variant.name}: {outcome}", flush=True)
    captures = []
    for name in CAPTURE_VARIANTS:
        r = {"backend": name, **capture(name)}
        captures.append(r)
        print(f"capture {name}: {r['summary']}", flush=True)

    def cell(r: dict, key: str) -> str:
        return str(r[key]) if key in r else "error"

    memory_rows = [[r["variant"], cell(r, "peak_gib"), cell(r, "activation_peak_gib"), cell(r, "median_ms"),
                    cell(r, "loss"), (r.get("error") or "").replace("|", "/")[:160]] for r in memory]
    capture_rows = [[r["backend"], "yes" if r["captured"] else "no",
                     (r["summary"] or "").replace("|", "/")[:200]] for r in captures]
    markdown = (f"llama-1b-like (4 Llama-3-8B layers), BF16 parameters, micro-batch {args.batch} x {args.seq} tokens, "
                f"fused AdamW; median of {args.steps} steps after {args.warmup} warm-up. 'activation peak' is the "
                "peak above the memory held between steps (weights, gradients, optimizer state).\n\n"
                + markdown_table(["variant", "peak GiB", "activation peak GiB", "step ms", "loss", "error"],
                                 memory_rows)
                + "\nCUDA-graph capture of one training step (forward, backward, capturable AdamW) of the tiny "
                  "model, 2 x 128 tokens:\n\n"
                + markdown_table(["backend", "captured", "result"], capture_rows))
    settings = {k: v for k, v in vars(args).items() if k != "force"}
    payload = {"settings": settings, "memory": memory, "capture": captures}
    json_path, md_path = write_evidence(stem, payload, markdown, args.out, replace=True)
    print(markdown)
    print(f"evidence: {json_path}, {md_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--out", default="profiles", help="folder for the evidence files")
    add_force_option(parser)
    args = parser.parse_args(argv)
    backend_class("te").prepare_process()  # the BF16 variant runs SDPA before the TE variants
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
