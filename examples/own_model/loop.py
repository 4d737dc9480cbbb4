"""The user's own training loop, shared by the three scripts beside it and untouched by fp8stack: next-token
cross-entropy on byte-level text (the interpreter's standard library sources), AdamW with gradient accumulation and
an optional linear LR warm-up, BF16 autocast, gradients clipped over the parameters the optimizer holds, one host sync
per step."""

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model import SIZES, Transformer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    parser.add_argument("--model", choices=SIZES, default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=0, help="steps of linear LR warm-up from 0 to --lr")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--recipe", default="delayed", help="the FP8 recipe (fp8stack and torchao scripts)")
    parser.add_argument("--small-gemm-filter", default="auto", help="fp8stack: off plans even tiny GEMMs in FP8")
    parser.add_argument("--result-json", type=Path, help="write losses and step times here")
    args = parser.parse_args()
    args.seq_len = args.seq_len or SIZES[args.model].max_seq_len
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.fused = args.device.type == "cuda"  # AdamW's fused kernel
    args.sdpa_backend = "cudnn" if args.device.type == "cuda" else None  # fp8stack: the attention kernel to run
    return args


def build_model(args: argparse.Namespace) -> Transformer:
    torch.manual_seed(0)
    with args.device:
        model = Transformer(SIZES[args.model])
    model.init_weights()
    return model


def text_batches(args: argparse.Namespace):
    """Endless (tokens, targets) micro-batches of random windows of the standard library's source bytes."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)[: 1 << 24]), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    while True:
        starts = torch.randint(len(data) - args.seq_len - 1, (args.micro_batch,), generator=generator)
        window = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()]).long().to(args.device)
        yield window[:, :-1], window[:, 1:]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> dict:
    loss_fn = torch.compile(cross_entropy) if args.compile else cross_entropy
    params = [p for group in optimizer.param_groups for p in group["params"]]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0)
    batches = text_batches(args)
    losses, step_ms = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        total = torch.zeros((), device=args.device)
        for _ in range(args.accumulation):
            tokens, targets = next(batches)
            with torch.autocast(args.device.type, dtype=torch.bfloat16):
                loss = loss_fn(model(tokens), targets)
            (loss / args.accumulation).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(float(total) / args.accumulation)
        step_ms.append((time.perf_counter() - start) * 1000)
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  {step_ms[-1]:.0f} ms", flush=True)
    result = {"losses": losses, "step_ms": step_ms,
              "tokens_per_step": args.micro_batch * args.accumulation * args.seq_len,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device.type == "cuda" else None,
              # what stays allocated between steps: parameters, optimizer state, gradient buffers, weight caches
              "resident_mem_gib": torch.cuda.memory_allocated() / 2**30 if args.device.type == "cuda" else None}
    if args.result_json:
        args.result_json.write_text(json.dumps(result))
    return result
