"""Evidence for fp8stack.megatron: a megatron-core GPTModel built from fp8stack's block_spec against the
same model from megatron's own TE spec with the same --fp8 flags, per recipe; then MoE models with BF16
and FP8 grouped experts.

    python -m fp8stack.bench.megatron --steps 50 --window 5

Dense: llama-1b-like with 4 layers (hidden 4096, ffn 14336, 32 heads / 8 groups, SwiGLU, RMSNorm,
RoPE, vocab 32000, seq 4096, micro-batch 2). MoE: 4 layers, hidden 2048, 8 experts top-2, grouped
GEMM. Every arm starts from the same seed and trains on the same batches (fp8stack.train.data.TextData:
byte tokens of the stdlib sources). The arms of a group (one recipe's two specs; the MoE arms) are all
resident and train in interleaved windows (fp8stack.bench.megatron_verdicts), so each comparison has a
measured noise. Verdicts per recipe: factory tokens/s >= megatron tokens/s x (1 - noise), and the same
final loss within LOSS_TOLERANCE; each MoE arm trains with finite, decreasing loss, with its throughput
and loss next to the BF16 MoE arm's. Exit status 1 when a verdict fails or an arm errors.

Optimizer, the simplest correct path: BF16 parameters as megatron holds them, FP32 master copies updated
by torch.optim.AdamW (gradients cast to FP32) with a linear LR warm-up, copied back after each step; no
DDP (one GPU). Delayed scaling runs with fp8stack.patches.apply_all() applied (see patches/). Each arm's failure
is recorded with its error, never dropped.
"""

import argparse
import gc
import math
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fp8stack.ab import LAST_FRACTION, comma_separated, final_loss
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.bench.megatron_verdicts import (LOSS_TOLERANCE, MIN_WINDOWS, NOISE_METHOD, against, judge_pair,
                                              rounds_for, trains, window_order, window_summary)
from fp8stack.plan.recipes import is_fp8

DENSE = dict(num_layers=4, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8)
MOE = dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, num_query_groups=8,
           num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048, moe_grouped_gemm=True,
           moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall")
VOCAB, SEQ, MICRO_BATCH, SEED, LR = 32000, 4096, 2, 1234, 3e-4
WARMUP_STEPS = 10
"""Linear LR warm-up. Without it the first AdamW step moves every weight by the full LR at once and the
loss jumps (to ~27 from ~11 in an earlier run), so 50-step curves mostly show how each arm recovers."""
EMBEDDING_INIT_STD = 1.0
"""megatron's embedding_init_method_std, its documented guard against loss spikes; the output head is drawn
as the plain Llama's too (init_output_layer_like_llama). With megatron's defaults (both
N(0, 0.02)) the loss jumped from 10.9 to 14-17 within the first 10 steps, even with the warm-up, and the
spikes amplified the GPU's unordered reductions into a 1% final-loss gap between two runs of the same
computation (the bf16 pair, profiles/runs/2026-11-22-megatron-h200/ at commit d8f377a); with N(0, 1) embeddings
alone the bf16 pair agreed within 0.04% but the FP8 pairs, still spiking, parted by 0.5-1.6%."""
SPECS = ("megatron-spec", "fp8stack-spec")
"""The two specs compared per recipe: megatron's get_gpt_decoder_block_spec with TE, and fp8stack's block_spec."""
GIB = 2 ** 30


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
                             attention_dropout=0.0, fp8=fp8, fp8_recipe=recipe or "delayed",
                             embedding_init_method_std=EMBEDDING_INIT_STD)


def build_gpt(config, spec, seed: int = SEED):
    """GPTModel on the current GPU, initialised from `seed`."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    init_output_layer_like_llama(model, config.hidden_size)
    return model.cuda()


def init_output_layer_like_llama(model, dim: int) -> None:
    """Redraw the output head of a GPTModel megatron initialised (one rank: the bench runs TP=1) as the
    plain Llama draws it: truncated N(0, dim^-0.5) at +-3 std, from the CPU generator. From megatron's
    init (N(0, 0.02)), measured on CPU (2 layers of llama-1b-like, seq 256, the trainer's AdamW at lr 3e-4
    warm-up 5), the loss rose 10.9 -> 13.1 -> 16.1 within three steps where this init moved 10.9 -> 11.3
    -> 11.5."""
    std = dim ** -0.5
    with torch.no_grad():
        model.output_layer.weight.copy_(torch.nn.init.trunc_normal_(torch.empty(model.vocab_size, dim), std=std,
                                                                    a=-3 * std, b=3 * std))


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


class Trainer:
    """One megatron GPTModel with FP32 master weights and AdamW, stepped as megatron's schedule steps it
    (one micro-batch per step); records losses, timed windows and memory."""

    def __init__(self, model, lr: float = LR, warmup_steps: int = WARMUP_STEPS):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0)
        self.losses: list[float] = []
        self.window_step_s: list[float] = []
        """Mean step seconds of each timed window, in run order."""
        self.window_extra_gib: list[float | None] = []
        """CUDA memory a window allocated at its peak on top of what was resident when it began."""

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """One training step; returns its loss."""
        # Megatron's TE linears quantize their weights on the first forward after this call and reuse that
        # FP8 copy until the next one (schedules.forward_step makes it for each step's first micro-batch):
        # without it every FP8 GEMM keeps running the initial weights.
        self.model.set_is_first_microbatch()
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        loss = self.model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        self.losses.append(loss.item())
        return self.losses[-1]

    def window(self, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Train on `data`, timing the whole window (synchronised at both ends)."""
        cuda = data[0][0].is_cuda
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for tokens, labels in data:
            self.step(tokens, labels)
        if cuda:
            torch.cuda.synchronize()
        self.window_step_s.append((time.perf_counter() - start) / len(data))
        self.window_extra_gib.append((torch.cuda.max_memory_allocated() - resident) / GIB if cuda else None)


@dataclass
class Arm:
    """One model of the bench: how to build it, and what it measured."""

    name: str
    """Row label, e.g. 'tensorwise fp8stack-spec'."""
    recipe: str
    """bf16, or the --fp8-recipe the config carries."""
    build: Callable[[], torch.nn.Module]
    """Makes the model from the bench's seed (every arm of a group starts from the same weights)."""
    record: dict = field(default_factory=dict)
    """What goes into the evidence: status, layers, losses, window times, throughput, noise, errors."""


def run_group(arms: list[Arm], data: Sequence[tuple[torch.Tensor, torch.Tensor]], window: int) -> float | None:
    """Build every arm, then train them all on `data` in windows of `window` steps taken in turns
    (window_order); fills each arm's record. An arm that fails keeps its error and leaves the rotation.
    Returns the group's peak CUDA memory in GiB (None on a CPU)."""
    trainers: dict[int, Trainer] = {}
    for index, arm in enumerate(arms):
        arm.record.update(arm=arm.name, recipe=arm.recipe, status="ok")
        try:
            trainers[index] = Trainer(arm.build())
            arm.record["layers"] = [type(layer).__name__ for layer in trainers[index].model.decoder.layers]
        except Exception as err:  # noqa: BLE001 - every failure is recorded, never dropped
            _record_error(arm, err)
    peak = 0.0
    for round_, index in window_order(len(arms), rounds_for(len(data), window)):
        if index not in trainers:
            continue
        try:
            trainers[index].window(data[round_ * window:(round_ + 1) * window])
        except Exception as err:  # noqa: BLE001 - recorded; the other arms go on
            _record_error(arms[index], err)
            del trainers[index]
        if index not in trainers:
            _free()  # outside the except block: its traceback no longer holds the failed step's tensors
        if data[0][0].is_cuda:
            peak = max(peak, torch.cuda.max_memory_allocated() / GIB)
    tokens_per_step = data[0][0].numel()
    for index, trainer in trainers.items():
        record = arms[index].record
        steady_extra = [g for g in trainer.window_extra_gib[1:] if g is not None]  # the first allocates AdamW state
        record.update(losses=[round(x, 4) for x in trainer.losses],
                      window_step_s=[round(s, 5) for s in trainer.window_step_s],
                      step_extra_gib=round(max(steady_extra), 2) if steady_extra else None,
                      **window_summary(trainer.window_step_s, tokens_per_step))
        if not all(map(math.isfinite, trainer.losses)):
            record["status"] = "non-finite loss"
    trainers.clear()
    _free()
    for arm in arms:
        print(f"{arm.name}: {arm.record['status']} {arm.record.get('error', '')}", flush=True)
    return round(peak, 2) if data[0][0].is_cuda else None


def _record_error(arm: Arm, err: Exception) -> None:
    arm.record.update(status="error", error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dense_group(recipe: str) -> list[Arm]:
    """The recipe's two arms: megatron's TE spec and fp8stack's factory spec, same config and flags."""
    return [Arm(f"{recipe} {name}", recipe, _builder(DENSE, recipe, spec_fn))
            for name, spec_fn in zip(SPECS, (megatron_spec, fp8stack_spec))]


def moe_group(recipes: Sequence[str]) -> list[Arm]:
    """MoE arms on fp8stack's factory spec, BF16 (config without --fp8) and FP8 grouped experts alike."""
    return [Arm(f"moe {recipe} fp8stack-spec", recipe, _builder(MOE, recipe, fp8stack_spec)) for recipe in recipes]


def _builder(shape: dict, recipe: str, spec_fn) -> Callable[[], torch.nn.Module]:
    """Builds the arm's config and model when called, so that a config megatron refuses is that arm's error."""
    def build():
        fp8 = is_fp8(recipe)
        config = make_config(shape, "hybrid" if fp8 else None, recipe if fp8 else None)
        return build_gpt(config, spec_fn(config))
    return build


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict_cell(passed: bool, reason: str) -> str:
    return f"{'pass' if passed else 'FAIL'}: {reason}"


def report(dense: dict[str, list[Arm]], moe: list[Arm], args, data_source: str, patch_report: dict,
           peaks: dict[str, float | None], determinism: dict | None) -> tuple[dict, str, bool]:
    """(payload, markdown, every verdict passed) of the finished groups."""
    verdicts = [judge_pair(recipe, arms[0].record, arms[1].record) for recipe, arms in dense.items()]
    dense_bf16 = dense["bf16"][0].record if "bf16" in dense else None
    moe_bf16 = next((a.record for a in moe if not is_fp8(a.recipe)), None)
    for arm in [a for arms in dense.values() for a in arms]:
        arm.record.update(against(dense_bf16, arm.record))
    for arm in moe:
        arm.record.update(against(moe_bf16, arm.record))
        passed, reason = trains(arm.record.get("losses") or []) if arm.record["status"] == "ok" else \
            (False, arm.record["status"])
        arm.record.update(trains_passed=passed, trains=reason)
    passed = all(v["passed"] for v in verdicts) and all(a.record["trains_passed"] for a in moe)

    verdict_table = markdown_table(
        ["recipe", "megatron tokens/s", "fp8stack tokens/s", "throughput", "megatron final loss",
         "fp8stack final loss", "loss"],
        [[v["recipe"], _fmt(v["megatron_tokens_per_s"], ",.0f"), _fmt(v["factory_tokens_per_s"], ",.0f"),
          _verdict_cell(v["throughput_passed"], v["throughput"]), _fmt(v["megatron_final_loss"], ".4f"),
          _fmt(v["factory_final_loss"], ".4f"), _verdict_cell(v["loss_passed"], v["loss"])] for v in verdicts])
    arm_rows = []
    for arm in [a for arms in dense.values() for a in arms] + moe:
        r = arm.record
        check = _verdict_cell(r["trains_passed"], r["trains"]) if "trains" in r else ""
        arm_rows.append([arm.name, r["status"], _fmt((r.get("losses") or [None])[0], ".4f"),
                         _fmt(final_loss(r["losses"]) if r.get("losses") else None, ".4f"),
                         _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("noise"), ".2%"),
                         _fmt(r.get("vs_bf16_speedup"), ".3f"), _fmt(r.get("vs_bf16_loss_gap"), "+.2%"),
                         _fmt(r.get("step_extra_gib"), ".2f"), check, r.get("error", "")[:120]])
    arms_table = markdown_table(["arm", "status", "loss[0]", "final loss", "tokens/s", "noise", "x bf16 tokens/s",
                                 "loss vs bf16", "step GiB", "MoE check", "error"], arm_rows)
    notes = (
        f"- data: {data_source}; every arm from seed {SEED}, the same {args.steps} batches\n"
        f"- optimizer: BF16 params, FP32 master + torch AdamW (lr {LR}, linear warm-up over {WARMUP_STEPS} "
        f"steps), grad clip 1.0; embeddings drawn N(0, {EMBEDDING_INIT_STD}) (embedding_init_method_std), the "
        f"output head truncated N(0, hidden^-0.5) as the plain Llama's; each step calls set_is_first_microbatch() "
        f"as megatron's schedule does, so TE "
        f"re-quantizes the updated weights\n"
        f"- patches: {patch_report}\n"
        f"- determinism: {'megatron deterministic mode, ' + str(determinism) if determinism else 'off'}\n"
        f"- timing: {NOISE_METHOD}\n"
        f"- loss: final loss = mean of the last {LAST_FRACTION:.0%} of steps; the two specs of a recipe must agree "
        f"within {LOSS_TOLERANCE:.2%} (relative): the same computation from the same weights and batches, which "
        f"in deterministic mode agrees to the bit unless the specs differ (see LOSS_TOLERANCE in "
        f"fp8stack/bench/megatron_verdicts.py)\n"
        f"- x bf16 / loss vs bf16: against `bf16 megatron-spec` (dense; another group, so not interleaved) or "
        f"`moe bf16 fp8stack-spec` (MoE; same group, interleaved); reported, not judged\n"
        f"- step GiB: CUDA memory a timed window allocated above what was resident; group peaks (all arms of "
        f"a group resident): {peaks}\n"
        f"- result: {'every verdict passed' if passed else 'FAILED: see the FAIL cells'}\n")
    markdown = (f"{notes}\n## Factory spec against megatron's TE spec\n\n{verdict_table}\n"
                f"## Arms\n\n{arms_table}")
    payload = {"steps": args.steps, "window": args.window, "data": data_source, "patches": patch_report,
               "dense_shape": DENSE, "moe_shape": MOE, "lr": LR, "warmup_steps": WARMUP_STEPS,
               "embedding_init_method_std": EMBEDDING_INIT_STD, "deterministic": determinism,
               "loss_tolerance": LOSS_TOLERANCE, "noise_method": NOISE_METHOD, "final_loss": (
                   f"mean of the last {LAST_FRACTION:.0%} of steps"), "group_peak_mem_gib": peaks,
               "verdicts": verdicts, "passed": passed,
               "arms": [a.record for arms in dense.values() for a in arms], "moe_arms": [a.record for a in moe]}
    return payload, markdown, passed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per arm (default: 50)")
    parser.add_argument("--window", type=int, default=5, help="steps per timed window (default: 5)")
    parser.add_argument("--recipes", default="bf16,delayed,tensorwise,blockwise",
                        help="dense recipes, each run on both specs (default: bf16,delayed,tensorwise,blockwise)")
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                        help="let GPU reductions run in no fixed order (faster attention backward; the two specs' "
                             "losses then part by chance, see deterministic_mode)")
    parser.add_argument("--moe-recipes", default="bf16,tensorwise,blockwise",
                        help="MoE arms, all in one interleaved group (default: bf16,tensorwise,blockwise)")
    add_force_option(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.window < 1:
        parser.error(f"--steps and --window must be positive, got {args.steps} and {args.window}")
    windows = rounds_for(args.steps, args.window)
    if windows < MIN_WINDOWS:
        parser.error(f"--steps {args.steps} / --window {args.window} gives {windows} timed windows per arm; the "
                     f"noise needs at least {MIN_WINDOWS}: raise --steps or lower --window")
    args.recipes, args.moe_recipes = comma_separated(args.recipes), comma_separated(args.moe_recipes)
    return args


def deterministic_mode() -> dict:
    """megatron's --deterministic-mode for this process, before the first cuBLAS or TE kernel: its environment
    (TE's deterministic attention, a fixed cuBLAS workspace) and torch's deterministic algorithms. Both specs of a
    recipe are the same computation, so their losses must then agree to the bit and the loss verdict tests the
    specs, not how far GPU reductions in no fixed order part two runs (at 50 steps the same bf16 computation had
    parted by 0.04% in one run and by 3.1% in the next). Returns what it set, for the evidence."""
    from megatron.training.determinism import apply_determinism_env

    apply_determinism_env(os.environ)
    torch.use_deterministic_algorithms(True)
    return {name: os.environ[name] for name in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG")}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8stack.bench.megatron needs a CUDA GPU with TransformerEngine")
    stem = f"megatron-{device_slug()}"
    claim_or_exit("fp8stack.bench.megatron", stem, "profiles", args.force)
    determinism = deterministic_mode() if args.deterministic else None
    from fp8stack import patches

    patch_report = patches.apply_all()
    init_megatron()
    data, data_source = batches(args.steps)
    dense = {recipe: dense_group(recipe) for recipe in args.recipes}
    moe = moe_group(args.moe_recipes)
    peaks = {recipe: run_group(arms, data, args.window) for recipe, arms in dense.items()}
    if moe:
        peaks["moe"] = run_group(moe, data, args.window)
    payload, markdown, passed = report(dense, moe, args, data_source, patch_report, peaks, determinism)
    print(markdown)
    write_evidence(stem, payload, markdown, replace=True)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
