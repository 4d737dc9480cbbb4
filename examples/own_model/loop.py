"""The user's own training loop, shared by the three scripts beside it and untouched by fp8stack: next-token
cross-entropy on byte-level text (the interpreter's standard library sources), AdamW with gradient accumulation and
an optional linear LR warm-up, BF16 autocast, gradients clipped over the parameters the optimizer holds, one host sync
per step.

Under torchrun with several processes it is torchtitan's multi-GPU recipe: every rank reads its rows of each global
batch, and parallelize() shards the model with FSDP2 as torchtitan's apply_fsdp does by default (FP32 parameters
sharded, gathered in BF16 for compute, gradients reduce-scattered in FP32; no autocast, as torchtitan under FSDP).
Losses are averaged over the ranks, memory is the largest of any rank's, and rank 0 prints and writes the result.
--activation-checkpoint full recomputes each block in the backward, as torchtitan's activation_checkpoint.mode full."""

import argparse
import json
import os
import sys
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from model import SIZES, Transformer

AC_MODES = ("none", "full")
"""torchtitan's activation_checkpoint.mode values this loop applies; its selective modes (per-op or every Nth block)
are not wired here."""


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
    parser.add_argument("--activation-checkpoint", choices=AC_MODES, default="none",
                        help="torchtitan's activation_checkpoint.mode: full recomputes each block whole in the "
                             "backward (bf16 and torchao scripts)")
    parser.add_argument("--recipe", default="delayed", help="the FP8 recipe (fp8stack and torchao scripts)")
    parser.add_argument("--small-gemm-filter", default="auto", help="fp8stack: off plans even tiny GEMMs in FP8")
    parser.add_argument("--result-json", type=Path, help="write losses and step times here")
    args = parser.parse_args()
    args.seq_len = args.seq_len or SIZES[args.model].max_seq_len
    args.rank, args.ranks = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
                   else torch.device("cpu"))
    # torchtitan's AdamW (its job_config Optimizer defaults: beta2 0.95, not torch's 0.999), fused on a GPU
    args.adamw = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                  "fused": args.device.type == "cuda"}
    args.sdpa_backend = "cudnn" if args.device.type == "cuda" else None  # fp8stack: the attention kernel to run
    args.mesh = data_parallel_mesh(args)
    return args


def data_parallel_mesh(args: argparse.Namespace) -> DeviceMesh | None:
    """torchrun's processes as one data-parallel mesh (NCCL on GPUs, gloo on a CPU); None for a single process."""
    if args.ranks == 1:
        return None
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo")
    return init_device_mesh(args.device.type, (args.ranks,))


def build_model(args: argparse.Namespace) -> Transformer:
    torch.manual_seed(0)
    with args.device:
        model = Transformer(SIZES[args.model])
    model.init_weights()
    return model


def parallelize(model: Transformer, args: argparse.Namespace) -> Transformer:
    """torchtitan's order (parallelize_llama): activation checkpointing (with --activation-checkpoint full), each block
    compiled (with --compile), then, with several ranks, FSDP2 (shard)."""
    if args.activation_checkpoint == "full":
        checkpoint_blocks(model)
    if args.compile:
        for block in model.layers.values():
            block.compile()
    if args.mesh is not None:
        shard(model, args.mesh)
    return model


def checkpoint_blocks(model: Transformer) -> None:
    """torchtitan's full activation checkpointing: each block in checkpoint_wrapper, which keeps only the block's input
    and reruns its forward in the backward; RNG state not preserved, torchtitan's default (the blocks draw nothing)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def shard(model: Transformer, mesh: DeviceMesh) -> None:
    """torchtitan's apply_fsdp at its defaults: the embedding and each block sharded and resharded after their
    forward, the final norm and head as one unit kept gathered from forward to backward (FSDP would gather them again
    at once), then the root; FP32 parameters gathered in BF16, gradients reduced in FP32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def text_batches(args: argparse.Namespace):
    """Endless (tokens, targets) micro-batches of random windows of the standard library's source bytes: this rank's
    rows of a global micro-batch of micro_batch x ranks windows."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)[: 1 << 24]), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    while True:
        starts = torch.randint(len(data) - args.seq_len - 1, (args.micro_batch * args.ranks,), generator=generator)
        mine = starts[args.rank * args.micro_batch:(args.rank + 1) * args.micro_batch]
        window = torch.stack([data[s:s + args.seq_len + 1] for s in mine.tolist()]).long()
        # non_blocking: a plain .to(cuda) waits for the GPU to drain its queue, a host sync per micro-batch
        window = window.to(args.device, non_blocking=True)
        yield window[:, :-1], window[:, 1:]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> dict:
    if args.mesh is not None and not isinstance(model, FSDPModule):
        print(f"{sys.argv[0]}: error: {args.ranks} processes would each train their own copy of an unsharded model: "
              "run this script as one process (fp8stack's multi-GPU training: python -m fp8stack.train under torchrun)",
              file=sys.stderr)
        raise SystemExit(2)
    if args.activation_checkpoint == "full" and not all(isinstance(block, CheckpointWrapper)
                                                        for block in model.layers.values()):
        print(f"{sys.argv[0]}: error: --activation-checkpoint full: this script's blocks are not wrapped by "
              "loop.parallelize: drop the flag, or recompute through fp8stack.assemble(..., recompute=\"all\")",
              file=sys.stderr)
        raise SystemExit(2)
    loss_fn = torch.compile(cross_entropy) if args.compile else cross_entropy
    params = [p for group in optimizer.param_groups for p in group["params"]]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0)
    # Under FSDP2 its mixed-precision policy computes in BF16, and torchtitan autocasts only without it.
    autocast = torch.autocast(args.device.type, dtype=torch.bfloat16) if args.mesh is None else nullcontext()
    batches = text_batches(args)
    losses, step_ms = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        total = torch.zeros((), device=args.device)
        for _ in range(args.accumulation):
            tokens, targets = next(batches)
            with autocast:
                loss = loss_fn(model(tokens), targets)
            (loss / args.accumulation).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(mean_over_ranks(total, args) / args.accumulation)
        step_ms.append((time.perf_counter() - start) * 1000)
        if args.rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  {step_ms[-1]:.0f} ms", flush=True)
    on_gpu = args.device.type == "cuda"
    result = {"losses": losses, "step_ms": step_ms,
              "tokens_per_step": args.micro_batch * args.accumulation * args.seq_len * args.ranks,
              "peak_mem_gib": max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, args) if on_gpu else None,
              # what stays allocated between steps: parameters, optimizer state, gradient buffers, weight caches
              "resident_mem_gib": max_over_ranks(torch.cuda.memory_allocated() / 2**30, args) if on_gpu else None}
    if args.result_json and args.rank == 0:
        args.result_json.write_text(json.dumps(result))
    if args.mesh is not None:
        dist.barrier()  # no rank closes its connections while another still has a collective in flight
        dist.destroy_process_group()
    return result


def mean_over_ranks(value: torch.Tensor, args: argparse.Namespace) -> float:
    """A scalar averaged over the ranks (gloo has no AVG, hence SUM / ranks)."""
    if args.mesh is not None:
        dist.all_reduce(value)
        value = value / args.ranks
    return float(value)


def max_over_ranks(value: float, args: argparse.Namespace) -> float:
    """The largest of a number over the ranks (a rank's memory)."""
    if args.mesh is None:
        return value
    largest = torch.tensor(value, dtype=torch.float64, device=args.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()
