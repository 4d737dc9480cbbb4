"""Evidence for fp8stack.megatron: a megatron-core GPTModel built from fp8stack's block_spec against the
same model from megatron's own TE spec with the same --fp8 flags, then an FP8 MoE model.

    python -m fp8stack.bench.megatron --steps 50

Dense: llama-1b-like with 4 layers (hidden 4096, ffn 14336, 32 heads / 8 groups, SwiGLU, RMSNorm,
RoPE, vocab 32000, seq 4096, micro-batch 2), one arm per (spec, recipe), same seed and batches
(fp8stack.train.data.TextData: byte tokens of the stdlib sources). MoE: 4 layers, hidden 2048,
8 experts top-2, grouped GEMM, FP8 experts; it must train with finite, decreasing loss.

Optimizer, the simplest correct path: BF16 parameters as megatron's Float16Module holds them, FP32
master copies updated by torch.optim.AdamW (gradients cast to FP32), copied back after each step;
no DDP (one GPU). Delayed scaling runs with patches.apply_all() applied (see patches/). Each arm is
run in try/except: a failure is recorded with its error, never dropped.
"""

import argparse
import os
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from fp8stack.bench.evidence import device_slug, markdown_table, write_evidence

DENSE = dict(num_layers=4, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8)
MOE = dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, num_query_groups=8,
           num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048, moe_grouped_gemm=True,
           moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall")
VOCAB, SEQ, MICRO_BATCH, SEED, LR, WARMUP = 32000, 4096, 2, 1234, 3e-4, 5


def init_megatron(seed: int = SEED) -> None:
    """One-rank NCCL group, megatron's model-parallel state and its CUDA RNG tracker (TE's)."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True)


def make_config(shape: dict, fp8: str | None, recipe: str | None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**shape, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                             add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                             attention_dropout=0.0, fp8=fp8, fp8_recipe=recipe or "delayed")


def build_gpt(config, spec, seed: int = SEED):
    """GPTModel on the current GPU, initialised from `seed`."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope").cuda()


def megatron_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")


def fp8stack_spec(config):
    from fp8stack.megatron import block_spec, plan_from_megatron_args

    return block_spec(config, plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ), use_te=True)


def batches(steps: int):
    """(tokens, labels) on the GPU for `steps` steps, and where they came from."""
    try:
        from fp8stack.train.data import TextData

        data = TextData(SEQ, MICRO_BATCH, SEED)
        return [tuple(t.cuda() for t in data.batch(i)) for i in range(steps)], "TextData (stdlib source bytes)"
    except Exception as err:  # noqa: BLE001 - reported in the evidence, with the fallback
        g = torch.Generator().manual_seed(SEED)
        tokens = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(steps)]
        return ([(t[:, :-1].cuda(), t[:, 1:].cuda()) for t in tokens],
                f"FALLBACK deterministic random tokens (TextData failed: {type(err).__name__}: {err})")


def train(model, data) -> dict:
    """Losses, median step time after warm-up, tokens/s and peak memory of len(data) AdamW steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(master, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    position_ids = torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, SEQ)
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for tokens, labels in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step = statistics.median(times[WARMUP:] or times)
    return {"losses": [round(x, 4) for x in losses], "median_step_s": round(step, 4),
            "tokens_per_s": round(MICRO_BATCH * SEQ / step), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def run_arm(name: str, shape: dict, recipe: str | None, spec_fn, data) -> dict:
    record = {"arm": name, "recipe": recipe or "bf16", "spec": spec_fn.__name__}
    model = None
    try:
        config = make_config(shape, "hybrid" if recipe else None, recipe)
        model = build_gpt(config, spec_fn(config))
        record["layers"] = [type(layer).__name__ for layer in model.decoder.layers]
        record.update(train(model, data))
        record["status"] = "ok" if all(map(_finite, record["losses"])) else "non-finite loss"
    except Exception as err:  # noqa: BLE001 - every failure is recorded, never dropped
        record.update(status="error", error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])
    finally:
        del model
        torch.cuda.empty_cache()
    print(f"{name}: {record['status']} {record.get('error', '')}", flush=True)
    return record


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--recipes", default="delayed,tensorwise,blockwise")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8stack.bench.megatron needs a CUDA GPU with TransformerEngine")
    import patches

    patch_report = patches.apply_all()
    init_megatron()
    data, data_source = batches(args.steps)
    arms = [run_arm("bf16 megatron-spec", DENSE, None, megatron_spec, data)]
    for recipe in args.recipes.split(","):
        for spec_fn in (megatron_spec, fp8stack_spec):
            arms.append(run_arm(f"{recipe} {spec_fn.__name__.replace('_', '-')}", DENSE, recipe, spec_fn, data))
    moe_arms = [run_arm(f"moe {recipe} fp8stack-spec", MOE, recipe, fp8stack_spec, data)
                for recipe in ("tensorwise", "blockwise")]
    for arm in moe_arms:
        losses = arm.get("losses") or []
        if arm["status"] == "ok":
            head, tail = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
            arm["decreasing"] = tail < head
            arm["status"] = "ok" if tail < head else f"loss not decreasing ({head:.3f} -> {tail:.3f})"
    rows = [[a["arm"], a["status"], a.get("losses", [None])[0], a.get("losses", [None])[-1], a.get("tokens_per_s"),
             a.get("median_step_s"), a.get("peak_mem_gib"), a.get("error", "")[:120]] for a in arms + moe_arms]
    table = markdown_table(["arm", "status", "loss[0]", f"loss[{args.steps - 1}]", "tokens/s", "median step s",
                            "peak GiB", "error"], rows)
    notes = (f"- data: {data_source}\n- patches: {patch_report}\n- optimizer: BF16 params, FP32 master + "
             f"torch AdamW (lr {LR}), grad clip 1.0, {args.steps} steps, timing = median after {WARMUP} warm-up\n")
    print(table)
    write_evidence(f"megatron-{device_slug()}", {"steps": args.steps, "data": data_source, "patches": patch_report,
                                                "dense_shape": DENSE, "moe_shape": MOE, "arms": arms,
                                                "moe_arms": moe_arms}, notes + "\n" + table)


if __name__ == "__main__":
    main()
