"""Backend micro-benchmark: every GEMM shape of a model description under every backend x recipe
this GPU runs, forward + backward (input and weight gradients), against BF16.

    python -m fp8stack.bench.backends [--shapes llama-1b-like,deepseek-v3-like-moe] [--tokens 8192]
                                      [--local-experts 32] [--iters 20] [--compile] [--grouped-only]
                                      [--out profiles] [--label L]

Each variant is a one-component model converted by the backend the policy names, exactly as the
assembly would convert it; expert blocks then train as fp8stack's training runs them (MasterWeights: BF16
parameters, weight gradients into FP32 main_grads), BF16's alike. Each timed step is one micro-batch and no
optimizer steps: TE's modules and grouped_fp8's blockwise experts run without their FP8 weight cache
(NO_WEIGHT_CACHE), which would hit at every step. Writes profiles/runs/<date>-backends-<device>/
(.json: every raw timing; .md).
A variant that cannot run records its error instead of a number.
"""

import argparse
import gc
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fp8stack.ab import comma_separated
from fp8stack.assembly import apply_fp8, assembly_state
from fp8stack.backends import BackendUnavailable, get_backend
from fp8stack.evidence import add_force_option, claim_or_exit, device_slug, markdown_table, write_evidence
from fp8stack.models.moe import GroupedExperts
from fp8stack.plan import Decision, Plan, PlanError, PolicyConfig, description_from_dict, load_description, make_plan
from fp8stack.plan.recipes import BF16, is_fp8
from fp8stack.precision import MasterWeights

DENSE_VARIANTS: tuple[tuple[str, str], ...] = (
    ("auto", BF16),
    ("torchao", "tensorwise"), ("torchao", "rowwise"), ("torchao", "rowwise_gw_hp"),
    ("te", "delayed"), ("te", "tensorwise"), ("te", "blockwise"), ("te", "mxfp8"),
)
"""(dense backend preference, recipe) for nn.Linear shapes; bf16 first, it is the baseline."""

NO_WEIGHT_CACHE = {"cache_fp8_weights": False}
"""TE's modules and grouped_fp8's blockwise experts cast their weights to FP8 at every timed step: each step here is
one micro-batch and no optimizer steps between them, so a weight cache would be made once and hit ever after, timing
no weight cast, whereas training with one micro-batch per step runs without it (fp8stack.bench.experts_breakdown
times grouped_fp8's cache)."""

EXPERT_VARIANTS: tuple[tuple[str, str, dict], ...] = (
    ("auto", BF16, {}),
    ("auto", "blockwise", {"kernels": "torch", **NO_WEIGHT_CACHE}),
    ("auto", "blockwise", {"kernels": "deepgemm", "quantizer": "inductor", **NO_WEIGHT_CACHE}),
    ("auto", "blockwise", {"kernels": "deepgemm", "quantizer": "te", **NO_WEIGHT_CACHE}),
    ("auto", "rowwise", {}),
    ("auto", "rowwise_gw_hp", {}),
    ("te", "tensorwise", NO_WEIGHT_CACHE),
    ("te", "delayed", NO_WEIGHT_CACHE),
    ("te", "blockwise", NO_WEIGHT_CACHE),
)
"""(dense backend preference, recipe, expert backend options) for GroupedExperts; the preference
decides the expert backend as in a real plan (te -> TE GroupedLinear, auto -> grouped_fp8)."""

ISSUE7_EXPERTS = {"experts": 8, "dim": 7168, "hidden": 2048, "tokens_per_expert": 4096}
"""The MoE target's grouped shape: 8 experts x 4096 tokens, K=7168 -> N=4096 for w13 (F=2048)."""

ROTATE = 3
"""Input sets cycled through, so no iteration reads its operands from a warm L2."""
DEVICE = "cuda"
"""Where models and inputs live (a module constant so the harness can be exercised on CPU)."""


def linear_plan(n: int, k: int, recipe: str, backend: str, arch: int = 90) -> tuple[Plan, list[Decision]]:
    """The plan of a one-linear model (fqn layers.0.linear) and its single decision, which must be on
    the backend the policy gives `backend`/`recipe`; a PlanError says why when the policy refuses."""
    spec = [{"name": "linear", "kind": "linear", "n": n, "k": k}]
    return _plan(spec, "dense", recipe, backend, arch)


def expert_plan(experts: int, dim: int, hidden: int, recipe: str, backend: str,
                arch: int = 90) -> tuple[Plan, list[Decision]]:
    """The plan of a GroupedExperts at layers.0.experts (w13 [E, 2F, D], w2 [E, D, F]): its two decisions."""
    spec = [{"name": "experts.w13", "kind": "expert", "n": 2 * hidden, "k": dim, "experts": experts},
            {"name": "experts.w2", "kind": "expert", "n": dim, "k": hidden, "experts": experts}]
    return _plan(spec, "moe", recipe, backend, arch)


def _plan(spec: list[dict], block: str, recipe: str, backend: str, arch: int) -> tuple[Plan, list[Decision]]:
    description = description_from_dict({"name": "bench", "seq_len": 1, "blocks": {block: spec},
                                         "layers": [{"block": block}]})
    plan = make_plan(description, PolicyConfig(recipe=recipe, backend=backend, arch=arch, small_gemm_filter="off",
                                               expert_backend="te" if backend == "te" else "grouped_fp8"))
    backends = {d.backend for d in plan.decisions}
    if len(backends) != 1 or (is_fp8(recipe) and BF16 in backends):
        raise PlanError("the policy does not run this shape as asked: " + "; ".join(d.reason for d in plan.decisions))
    return plan, list(plan.decisions)


class OneBlock(nn.Module):
    """The smallest model a backend converts: the module under test at layers.0.<name>."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].add_module(name, module)
        self.name = name

    @property
    def inner(self) -> nn.Module:
        return getattr(self.layers[0], self.name)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)


def convert(model: nn.Module, plan: Plan, decisions: list[Decision], options: dict,
            entry: dict) -> nn.Module:
    """Convert through the planned backend, as the assembly does; note in `entry` what now runs the GEMM."""
    backend = get_backend(decisions[0].backend, **options)
    ok, reason = backend.available(sorted({d.recipe for d in decisions}))
    if not ok:
        raise BackendUnavailable(reason)
    model, record = backend.convert(model, decisions, plan)
    entry["module"] = record.converted.get(decisions[0].fqn, "")
    if record.notes:
        entry["notes"] = list(record.notes)
    return model


def convert_as_trained(model: nn.Module, plan: Plan, decisions: list[Decision], options: dict,
                       entry: dict) -> nn.Module:
    """An FP32 model converted as fp8stack's training converts it: apply_fp8, then MasterWeights, whose BF16
    parameters hand their weight gradients to FP32 main_grads (each backend's GEMMs adding into them where they can,
    a hook elsewhere); note in `entry` what now runs the GEMMs."""
    backend = decisions[0].backend
    model = apply_fp8(model, plan, backend_options={backend: options} if options else None)
    record = assembly_state(model).conversions[0]
    entry["module"] = record.converted.get(decisions[0].fqn, "")
    if record.notes:
        entry["notes"] = list(record.notes)
    entry["weight_gradients"] = "into FP32 main_grad (MasterWeights)"
    MasterWeights(model)  # its hooks keep it alive as long as the model
    return model


def time_steps(step: Callable[[int], None], grads_of: list[torch.Tensor], iters: int, warmup: int) -> list[float]:
    """Milliseconds of each of `iters` calls of step(i), timed with CUDA events after `warmup` calls.
    Gradients are dropped before each call, so the weight gradient is written, not accumulated."""
    def clear() -> None:
        for t in grads_of:
            t.grad = None

    for i in range(warmup):
        clear()
        step(i)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        clear()
        start.record()
        step(warmup + i)
        end.record()
    torch.cuda.synchronize()
    return [round(start.elapsed_time(end), 4) for start, end in events]


@dataclass
class Settings:
    """What every measurement shares."""

    tokens: int
    """Rows of the dense GEMMs (M)."""
    iters: int
    """Timed iterations per variant."""
    warmup: int
    """Untimed iterations first (TE delayed scaling needs a few to settle its scales)."""
    arch: int
    """This GPU's SM version, for the policy."""
    compile: bool
    """Also time torch.compile'd bf16 and torchao variants."""


def _measure(entry: dict, run: Callable[[], list[float]], flops: int) -> dict:
    """Fill `entry` with timings, or with the error that stopped it."""
    try:
        times = run()
    except BackendUnavailable as err:
        entry["unavailable"] = str(err)
    except Exception as err:  # every failure is a result: recorded, never dropped
        entry["error"] = f"{type(err).__name__}: {err}".strip()[:2000]
    else:
        median = statistics.median(times)
        entry.update(times_ms=times, median_ms=round(median, 4), tflops=round(flops / (median * 1e-3) / 1e12, 1))
    finally:
        # A converted model and its MasterWeights hold each other through hooks: a cycle that only the collector
        # frees, and which kept every earlier variant's weights and main_grads on the GPU (an H200 ran out at the
        # 30th variant).
        gc.collect()
        torch.cuda.empty_cache()
    return entry


def bench_linear(n: int, k: int, backend: str, recipe: str, compiled: bool, s: Settings) -> dict:
    """Forward + backward of one [tokens, k] x [k, n] linear."""
    entry = {"n": n, "k": k, "m": s.tokens, "backend": backend, "recipe": recipe, "compiled": compiled}
    try:
        plan, decisions = linear_plan(n, k, recipe, backend, s.arch)
    except PlanError as err:
        entry["skipped"] = str(err)
        return entry
    entry["backend"] = decisions[0].backend

    def run() -> list[float]:
        model = OneBlock("linear", nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16))
        model = convert(model, plan, decisions, NO_WEIGHT_CACHE if decisions[0].backend == "te" else {}, entry)
        if compiled:
            torch._dynamo.reset()  # past its recompile limit dynamo would quietly run eager
        forward = torch.compile(model) if compiled else model
        inputs = [torch.randn(s.tokens, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(ROTATE)]
        grad_out = torch.randn(s.tokens, n, device=DEVICE, dtype=torch.bfloat16)

        def step(i: int) -> None:
            forward(inputs[i % ROTATE]).backward(grad_out)

        return time_steps(step, [*model.parameters(), *inputs], s.iters, s.warmup)

    return _measure(entry, run, 6 * s.tokens * n * k)


def bench_experts(shape: dict, backend: str, recipe: str, options: dict, gemm: str, s: Settings) -> dict:
    """Forward + backward of the experts' w13 grouped GEMM alone (gemm='w13') or of the whole
    SwiGLU experts (gemm='experts'), balanced routing: every expert gets tokens_per_expert rows."""
    e, d, f, tpe = shape["experts"], shape["dim"], shape["hidden"], shape["tokens_per_expert"]
    entry = {**shape, "gemm": gemm, "backend": backend, "recipe": recipe, "options": options, "compiled": False}
    try:
        plan, decisions = expert_plan(e, d, f, recipe, backend, s.arch)
    except PlanError as err:
        entry["skipped"] = str(err)
        return entry
    entry["backend"] = decisions[0].backend
    rows = e * tpe
    flops = 6 * rows * (2 * f) * d if gemm == "w13" else 6 * rows * 3 * f * d

    def run() -> list[float]:
        experts = GroupedExperts(d, f, e).to(device=DEVICE)
        experts.init_weights(0.02)
        model = convert_as_trained(OneBlock("experts", experts), plan, decisions, options, entry)
        offsets = torch.arange(1, e + 1, device=DEVICE, dtype=torch.int32) * tpe
        inputs = [torch.randn(rows, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(ROTATE)]
        forward = _w13_gemm(model.inner, tpe) if gemm == "w13" else model
        grad_out = torch.randn(rows, 2 * f if gemm == "w13" else d, device=DEVICE, dtype=torch.bfloat16)

        def step(i: int) -> None:
            forward(inputs[i % ROTATE], offsets).backward(grad_out)

        return time_steps(step, [*model.parameters(), *inputs], s.iters, s.warmup)

    return _measure(entry, run, flops)


def _w13_gemm(module: nn.Module, tokens_per_expert: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The converted experts' first grouped GEMM on its own, as its forward runs it."""
    if isinstance(module, GroupedExperts):
        if type(module) is not GroupedExperts and type(module).grouped_mm is GroupedExperts.grouped_mm:
            raise TypeError(f"{type(module).__name__} does not override grouped_mm: its w13 GEMM alone cannot be timed")
        return lambda x, offsets: module.grouped_mm(x, module.w13, offsets)
    fc1 = getattr(module, "fc1", None)
    if fc1 is not None and hasattr(module, "autocast_recipe"):  # TEGroupedExperts: te.GroupedLinear fc1
        import transformer_engine.pytorch as te

        splits = [tokens_per_expert] * fc1.num_gemms

        def te_w13(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            with te.autocast(enabled=True, recipe=module.autocast_recipe):
                return fc1(x, splits)

        return te_w13
    raise TypeError(f"no known way to run the w13 GEMM of {type(module).__name__} alone")


def expert_shapes(names: list[str], tokens: int, local_experts: int) -> list[dict]:
    """Grouped shapes: each model's expert GEMMs with its routed rows spread evenly over the experts
    one GPU holds (at most `local_experts`, as under expert parallelism), plus the MoE target's shape."""
    shapes = []
    for name in names:
        description = load_description(name)
        w13 = [c for c in description.components if c.kind == "expert" and c.fqn.endswith(".w13")]
        for c in {(c.experts, c.k, c.n // 2, c.active): c for c in w13}.values():
            per_expert = math.ceil(tokens * c.active / c.experts / 128) * 128
            shapes.append({"source": name, "experts": min(c.experts, local_experts), "model_experts": c.experts,
                           "top_k": c.active, "dim": c.k, "hidden": c.n // 2, "tokens_per_expert": per_expert})
    return shapes + [{"source": "issue-7", **ISSUE7_EXPERTS}]


def linear_shapes(names: list[str]) -> list[dict]:
    """Each model's distinct (n, k) linear GEMMs, with the components that have them."""
    shapes: dict[tuple[int, int], dict] = {}
    for name in names:
        for c in load_description(name).components:
            if c.kind == "linear":
                shape = shapes.setdefault((c.n, c.k), {"source": name, "n": c.n, "k": c.k, "names": []})
                if c.name not in shape["names"]:
                    shape["names"].append(c.name)
    return list(shapes.values())


def _speedups(results: list[dict], key: Callable[[dict], tuple]) -> None:
    """speedup_vs_bf16 on every timed entry: the bf16 median of the same key over its own."""
    base = {key(r): r["median_ms"] for r in results if not is_fp8(r["recipe"]) and "median_ms" in r}
    for r in results:
        if "median_ms" in r and key(r) in base:
            r["speedup_vs_bf16"] = round(base[key(r)] / r["median_ms"], 3)


OUTCOMES = ("skipped", "unavailable", "error")
"""Keys an entry holds instead of timings: the policy refused the shape, the backend cannot run
here, or it ran and failed."""


def _cell(r: dict, field: str) -> str:
    """A timing field, or for the ms column of an untimed entry why it has none."""
    if "median_ms" in r:
        return str(r.get(field, ""))
    if field != "median_ms":
        return ""
    outcome = next(k for k in OUTCOMES if k in r)
    return f"{outcome}: {r[outcome]}".replace("|", "/").replace("\n", " ")[:160]


def dense_runs(args: argparse.Namespace) -> list[tuple[dict, str, str, bool]]:
    """(linear shape, backend, recipe, compiled) of each dense variant the run times; none under --grouped-only."""
    if args.grouped_only:
        return []
    return [(shape, backend, recipe, compiled) for shape in linear_shapes(list(comma_separated(args.shapes)))
            for backend, recipe in DENSE_VARIANTS
            for compiled in ((False, True) if args.compile and (not is_fp8(recipe) or backend == "torchao")
                             else (False,))]


def grouped_runs(args: argparse.Namespace) -> list[tuple[dict, str, str, str, dict]]:
    """(expert shape, gemm, backend, recipe, options) of each grouped variant the run times."""
    return [(shape, gemm, backend, recipe, options)
            for shape in expert_shapes(list(comma_separated(args.shapes)), args.tokens, args.local_experts)
            for gemm in ("w13", "experts") for backend, recipe, options in EXPERT_VARIANTS]


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("fp8stack.bench.backends needs a CUDA GPU (torch.cuda.is_available() is False): run it on the GPU "
              "machine; no benchmark runs on CPU and nothing was written.", file=sys.stderr)
        return 2
    stem = "-".join(filter(None, ("backends", args.label, device_slug())))
    claim_or_exit("fp8stack.bench.backends", stem, args.out, args.force)
    major, minor = torch.cuda.get_device_capability()
    s = Settings(tokens=args.tokens, iters=args.iters, warmup=args.warmup, arch=10 * major + minor,
                 compile=args.compile)
    dense = []
    for shape, backend, recipe, compiled in dense_runs(args):
        r = bench_linear(shape["n"], shape["k"], backend, recipe, compiled, s)
        dense.append({"source": shape["source"], "names": shape["names"], **r})
        print(f"linear {shape['n']}x{shape['k']} {r['backend']}/{recipe}{' compiled' if compiled else ''}: "
              f"{_cell(r, 'median_ms')} ms", flush=True)
    _speedups(dense, lambda r: (r["n"], r["k"], r["compiled"]))
    grouped = []
    for shape, gemm, backend, recipe, options in grouped_runs(args):
        r = bench_experts(shape, backend, recipe, options, gemm, s)
        grouped.append(r)
        print(f"{gemm} {shape['source']} E={shape['experts']} {r['backend']}/{recipe} {options or ''}: "
              f"{_cell(r, 'median_ms')} ms", flush=True)
    _speedups(grouped, lambda r: (r["source"], r["experts"], r["tokens_per_expert"], r["gemm"]))

    dense_rows = [[f"{r['n']}x{r['k']}", r["backend"], r["recipe"] + (" (compiled)" if r["compiled"] else ""),
                   r.get("module", ""), _cell(r, "median_ms"), _cell(r, "tflops"), _cell(r, "speedup_vs_bf16")]
                  for r in dense]
    grouped_rows = [[r["source"], f"{r['experts']}x{r['tokens_per_expert']}, D={r['dim']}, F={r['hidden']}", r["gemm"],
                     r["backend"], r["recipe"] + "".join(f" {k}={v}" for k, v in r["options"].items()),
                     r.get("module", ""), _cell(r, "median_ms"), _cell(r, "tflops"), _cell(r, "speedup_vs_bf16")]
                    for r in grouped]
    markdown = (f"Forward + backward (input and weight gradients), median of {s.iters} iterations after {s.warmup} "
                f"warm-up, M = {s.tokens} tokens for linears; TF/s counts 6*M*N*K; 'vs bf16' divides the bf16 "
                f"median of the same shape (compiled alike) by the variant's.\n\n"
                + markdown_table(["n x k", "backend", "recipe", "module", "ms", "TF/s", "vs bf16"], dense_rows)
                + "\nGrouped experts (balanced routing; 'w13' is the first grouped GEMM alone, 'experts' the whole "
                  "SwiGLU experts; BF16 parameters whose weight gradients go into FP32 main_grads, MasterWeights, as "
                  "fp8stack's training runs them; TE's and grouped_fp8's blockwise weights cast to FP8 at every "
                  "step, cache_fp8_weights=False, as no optimizer step comes between the timed steps):\n\n"
                + markdown_table(["shape from", "E x rows, D, F", "GEMM", "backend", "recipe", "module", "ms", "TF/s",
                                  "vs bf16"], grouped_rows))
    settings = {k: v for k, v in vars(args).items() if k != "force"}
    payload = {"settings": {**settings, "sm": s.arch, "rotated_inputs": ROTATE}, "dense": dense, "grouped": grouped}
    json_path, md_path = write_evidence(stem, payload, markdown, args.out, replace=True)
    print(markdown)
    print(f"evidence: {json_path}, {md_path}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.bench.backends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-1b-like,deepseek-v3-like-moe",
                        help="comma-separated model descriptions whose GEMM shapes are timed")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (M of the dense GEMMs)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    parser.add_argument("--local-experts", type=int, default=32,
                        help="experts one GPU holds for a model's grouped GEMMs (DeepSeek-V3's 256 over EP 8)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd bf16 and torchao linears")
    parser.add_argument("--grouped-only", action="store_true",
                        help="time the grouped expert GEMMs alone, not the models' dense linears (what the plan's "
                             "expert table, fp8stack.bench.expert_table, reads)")
    parser.add_argument("--out", default="profiles", help="folder for the evidence files")
    parser.add_argument("--label", help="added to the evidence's name, backends-<label>-<gpu>, so a partial run "
                                        "(e.g. --shapes '' times the MoE target's expert shape alone) keeps the "
                                        "full one")
    add_force_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
