"""A user's own model through the public API on a CPU: fusions found by tracing (torchtitan's layout and fp8stack's,
found or refused with the reason), the head found by structure under any name, the merged-projection and state-dict
pieces the TE backend fuses with, the little-FP8 warning and refusal, the plan's table, the master weights with the
user's own optimizer, and examples/own_model run as a user runs it. TE itself: tests/gpu/test_own_model_gpu.py."""

import difflib
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8stack.models import load_model_config
import fp8stack
from fp8stack.backends.fused import FoldedNorm, Part, StateKeys, merged_projections, unfused_state_dict
from fp8stack.models import Llama
from fp8stack.plan import PlanError, PlanWarning, PolicyConfig, make_plan
from fp8stack.plan.description import NormFeed, Rows, SwiGLUFeed
from fp8stack.plan.from_module import describe_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "own_model"
sys.path.insert(0, str(EXAMPLE))
from model import SIZES, Transformer  # noqa: E402  (examples/own_model: the user's torchtitan-layout model)

DELAYED_ON_TE = PolicyConfig(recipe="delayed", small_gemm_filter="off")


def torchtitan_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(SIZES["tiny"])
    model.init_weights()
    return model


# --- fusions found by tracing ---------------------------------------------------------------------------------

def test_torchtitan_layout_feeds_are_found():
    feeds = describe_module(torchtitan_model(), seq_len=256, name="tt").feeds
    layer0 = [f for f in feeds if f.norm.startswith("layers.0.")]
    assert layer0 == [
        NormFeed("layers.0.attention_norm", "RMSNorm", 1e-5,
                 ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv")),
        NormFeed("layers.0.ffn_norm", "RMSNorm", 1e-5, ("layers.0.feed_forward.w1", "layers.0.feed_forward.w3")),
        SwiGLUFeed("layers.0.ffn_norm", "RMSNorm", 1e-5, "layers.0.feed_forward",
                   Rows("layers.0.feed_forward.w1", 0, 768), Rows("layers.0.feed_forward.w3", 0, 768),
                   "layers.0.feed_forward.w2")]
    assert feeds[-1] == NormFeed("norm", "RMSNorm", 1e-5, ("output",))
    assert len(feeds) == 4 * 3 + 1


def test_fp8stack_layout_feeds_are_found_with_the_halves_of_the_fused_gate_up():
    feeds = describe_module(Llama(load_model_config("tiny")), seq_len=256, name="tiny").feeds
    assert SwiGLUFeed("layers.2.ffn_norm", "RMSNorm", 1e-5, "layers.2.feed_forward",
                      Rows("layers.2.feed_forward.w13", 0, 768), Rows("layers.2.feed_forward.w13", 768, 1536),
                      "layers.2.feed_forward.w2") in feeds
    assert NormFeed("layers.2.attention_norm", "RMSNorm", 1e-5, ("layers.2.attention.wqkv",)) in feeds


class ResidualFromNorm(nn.Module):
    """x = norm(x); x + mlp(x): the norm's output also feeds the residual, which no fused module computes."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(100, dim)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].norm = nn.RMSNorm(dim)
        self.layers[0].up = nn.Linear(dim, 4 * dim, bias=False)
        self.layers[0].down = nn.Linear(4 * dim, dim, bias=False)
        self.head = nn.Linear(dim, 100, bias=False)

    def forward(self, tokens):
        block = self.layers[0]
        x = block.norm(self.embed(tokens))
        return self.head(x + block.down(F.gelu(block.up(x))))


def test_a_norm_feeding_the_residual_too_is_refused_with_the_reader_named():
    description = describe_module(ResidualFromNorm(), seq_len=16, name="residual")
    assert [u.norm for u in description.unfusable] == ["layers.0.norm"]
    assert "also read by add" in description.unfusable[0].why
    plan = make_plan(description, DELAYED_ON_TE)
    assert ("layers.0.norm", description.unfusable[0].why) in plan.not_fused
    assert "not fused: norm (layers 0): its output is also read by add" in str(plan)


class DoubledNorm(nn.RMSNorm):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_norm_computing_something_else_is_not_folded():
    model = ResidualFromNorm()
    model.layers[0].norm = DoubledNorm(64)
    unfusable = describe_module(model, seq_len=16, name="doubled").unfusable
    assert unfusable[0].why == "DoubledNorm computes neither RMSNorm nor LayerNorm of its input"


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64)])

    def forward(self, x, mask):
        return self.layers[0](x) * mask


def test_a_model_the_default_input_cannot_run_says_how_to_pass_one():
    unfusable = describe_module(TwoInputs(), seq_len=4, name="two").unfusable
    assert unfusable[0].norm == "" and "pass describe_module(..., example_input=...)" in unfusable[0].why
    traced = describe_module(TwoInputs(), seq_len=4, name="two", example_input=(torch.ones(2, 64), torch.ones(2, 64)))
    assert traced.unfusable == ()


def test_a_gelu_mlp_is_a_norm_feed_but_no_swiglu():
    model = ResidualFromNorm()
    block = model.layers[0]
    model.forward = lambda tokens: model.head(model.embed(tokens) + block.down(F.gelu(block.up(block.norm(
        model.embed(tokens))))))
    feeds = describe_module(model, seq_len=16, name="gelu").feeds
    assert feeds[0] == NormFeed("layers.0.norm", "RMSNorm", pytest.approx(torch.finfo(torch.float32).eps),
                                ("layers.0.up",))
    assert not any(isinstance(f, SwiGLUFeed) for f in feeds)


def test_the_trace_leaves_the_model_as_it_was():
    model = torchtitan_model().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.random.get_rng_state()
    describe_module(model, seq_len=256, name="tt")
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), generator)


# --- the plan's fusions ---------------------------------------------------------------------------------------

def test_the_plan_fuses_on_te_and_says_so_per_gemm():
    plan = make_plan(describe_module(torchtitan_model(), seq_len=256, name="tt"), DELAYED_ON_TE)
    kinds = [f.as_dict()["kind"] for f in plan.fusions]
    assert kinds.count("layernorm_mlp") == 4 and kinds.count("layernorm_linear") == 5  # 4 attention norms + final
    wk = plan.decision("layers.1.attention.wk")
    assert wk.reason.endswith("fused with attention_norm into one TE LayerNormLinear, attention.wq, attention.wk, "
                              "attention.wv merged into one GEMM")
    head = plan.decision("output")
    assert (head.backend, head.recipe) == ("te", "bf16") and "fused with norm" in head.reason
    assert plan.summary()["fused_norms"] == 9


def test_fusion_is_off_when_asked_and_for_linears_not_on_te():
    description = describe_module(torchtitan_model(), seq_len=256, name="tt")
    assert make_plan(description, replace(DELAYED_ON_TE, fuse_norm=False, fuse_mlp=False)).fusions == ()
    on_torchao = make_plan(description, PolicyConfig(recipe="tensorwise", backend="torchao", small_gemm_filter="off"))
    assert on_torchao.fusions == () and on_torchao.not_fused == ()
    only_norms = make_plan(description, replace(DELAYED_ON_TE, fuse_mlp=False))
    assert {f.as_dict()["kind"] for f in only_norms.fusions} == {"layernorm_linear"}
    assert len(only_norms.fusions) == 9  # the MLPs' gate and up merged under their norm instead


def test_projections_on_two_recipes_are_not_merged_and_the_plan_says_why():
    from fp8stack.plan import Override

    policy = replace(DELAYED_ON_TE, overrides=(Override(fqn="layers.0.attention.wk", backend="bf16", reason="t"),))
    plan = make_plan(describe_module(torchtitan_model(), seq_len=256, name="tt"), policy)
    assert "layers.0.attention_norm" not in {f.feed.norm for f in plan.fusions}
    (why,) = [why for norm, why in plan.not_fused if norm == "layers.0.attention_norm"]
    assert why == "not one TE LayerNormLinear: its linears run on bf16/bf16, te/delayed"


def test_the_small_gemm_filter_judges_merged_projections_by_the_merged_gemm():
    """llama-1b-like's wk and wv (1024 x 4096) are small alone; merged with wq they are one 6144 x 4096 GEMM."""
    with torch.device("meta"):
        model = Transformer(SIZES["llama-1b-like"])
    description = describe_module(model, seq_len=4096, name="big", trace=False)
    wq, wk, wv = (f"layers.0.attention.{n}" for n in ("wq", "wk", "wv"))
    feed = NormFeed("layers.0.attention_norm", "RMSNorm", 1e-5, (wq, wk, wv))
    alone = make_plan(description, PolicyConfig(recipe="delayed"))
    merged = make_plan(replace(description, feeds=(feed,)), PolicyConfig(recipe="delayed"))
    assert alone.decision(wk).recipe == "bf16" and "small GEMM (n=1024" in alone.decision(wk).reason
    assert {merged.decision(fqn).recipe for fqn in (wq, wk, wv)} == {"delayed"}
    assert len(merged.fusions) == 1


def test_yaml_descriptions_declare_what_the_trace_finds():
    built = describe_module(Llama(load_model_config("tiny")), seq_len=256, name="tiny")
    assert fp8stack.load_description("tiny").feeds == built.feeds


# --- the head by structure ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["output", "lm_head", "proj", "out"])
def test_the_head_is_found_under_any_name(name):
    model = torchtitan_model()
    setattr(model, name, model.__dict__["_modules"].pop("output"))
    model.forward = lambda tokens: getattr(model, name)(model.norm(model.tok_embeddings(tokens)))
    kinds = {c.fqn: c.kind for c in describe_module(model, seq_len=256, name="renamed", trace=False).components}
    assert kinds[name] == "head"
    assert [fqn for fqn, kind in kinds.items() if kind == "head"] == [name]


def test_a_tied_head_is_the_head():
    model = ResidualFromNorm()
    model.head.weight = model.embed.weight
    kinds = {c.fqn: c.kind for c in describe_module(model, seq_len=16, name="tied", trace=False).components}
    assert kinds["head"] == "head" and kinds["layers.0.up"] == "linear"


def test_without_embeddings_the_last_linear_after_the_blocks_is_the_head():
    model = nn.Module()
    model.proj_in = nn.Linear(8, 8)
    model.layers = nn.ModuleList([nn.Linear(8, 8)])
    model.readout = nn.Linear(8, 3)
    kinds = {c.fqn: c.kind for c in describe_module(model, seq_len=4, name="x", trace=False).components}
    assert (kinds["proj_in"], kinds["readout"]) == ("linear", "head")


def test_a_router_is_found_by_its_width_not_its_name():
    model = Llama(load_model_config("tiny-moe"))
    moe = model.layers[1].moe
    moe.router.scorer = moe.router.__dict__["_modules"].pop("gate")
    kinds = {c.fqn: c.kind for c in describe_module(model, seq_len=256, name="x", trace=False).components}
    assert kinds["layers.1.moe.router.scorer"] == "router"


# --- the little-FP8 warning and refusal; the plan's table; verbose assembly ------------------------------------

def test_an_fp8_plan_with_little_fp8_warns_and_assemble_refuses_it():
    model = torchtitan_model()
    with pytest.warns(PlanWarning, match="runs 0% of its GEMM FLOPs in FP8.*small GEMM"):
        plan = make_plan(model, PolicyConfig(recipe="tensorwise"), seq_len=256)
    with pytest.raises(PlanError, match="pass allow_little_fp8=True if that is intended"):
        fp8stack.assemble(model, plan)
    assert isinstance(fp8stack.assemble(model, plan, allow_little_fp8=True), Transformer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plan(model, PolicyConfig(recipe="bf16"), seq_len=256)  # no FP8 asked for: nothing to warn about
    assert "WARNING: recipe tensorwise asks for FP8" in str(plan)


def test_the_small_gemm_filter_defaults_to_the_recipes_own():
    assert PolicyConfig(recipe="tensorwise").small_gemm_filter_name == "tensorwise"
    assert PolicyConfig(recipe="rowwise").small_gemm_filter_name == "rowwise"
    assert PolicyConfig(recipe="tensorwise", small_gemm_filter="off").small_gemm_filter_name == "off"


def test_print_plan_renders_the_table_and_verbose_assembly_says_what_it_did(capsys):
    model = torchtitan_model()
    plan = make_plan(model, PolicyConfig(recipe="tensorwise", small_gemm_filter="off"), seq_len=256)
    print(plan)
    fp8stack.assemble(model, plan, verbose=True)
    out = capsys.readouterr().out
    assert "Transformer - recipe tensorwise (hybrid), target sm90" in out and "GEMMs in FP8: 28" in out
    assert "fp8stack assembled Transformer: convert_fp8" in out
    assert "torchao (tensorwise): 28 component(s) on 28 Float8Linear" in out


# --- the pieces the TE backend fuses with ---------------------------------------------------------------------

def test_merged_projections_compute_what_the_linears_did_with_their_weights_copied_exactly():
    torch.manual_seed(0)
    linears = [nn.Linear(32, n) for n in (64, 16, 16)]
    fused = nn.Linear(32, 96)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
        fused.bias.copy_(torch.cat([linear.bias for linear in linears]))
    assert torch.equal(fused.weight[64:80], linears[1].weight)
    slices = merged_projections(fused, linears)
    x = torch.randn(4, 32, requires_grad=True)
    calls = []
    fused.register_forward_hook(lambda *_: calls.append(1))
    outs = [piece(x) for piece in slices]
    assert len(calls) == 1, "one GEMM for the group"
    for out, linear in zip(outs, linears, strict=True):
        torch.testing.assert_close(out, linear(x))
    sum(o.sum() for o in outs).backward()
    assert fused.weight.grad.shape == (96, 32) and x.grad is not None
    [piece(x) for piece in slices]
    assert len(calls) == 2, "a new forward runs the GEMM again"
    assert [n for n, _ in nn.ModuleList(slices).named_parameters()] == ["0.fused.weight", "0.fused.bias"]


def _merged_block() -> tuple[list[nn.Linear], nn.Linear, nn.Module]:
    """Three 16 -> 16 linears, the 16 -> 48 linear they merge into (weights copied), and a block whose forward reads
    the three slices: (linears, fused, block)."""
    torch.manual_seed(0)
    linears = [nn.Linear(16, 16, bias=False) for _ in range(3)]
    fused = nn.Linear(16, 48, bias=False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
    block = nn.Module()
    block.q, block.k, block.v = merged_projections(fused, linears)
    block.forward = lambda x: block.q(x) * 2 + block.k(x) - block.v(x)
    return linears, fused, block


def test_merged_projections_under_compile_run_the_gemm_once_per_forward():
    linears, fused, block = _merged_block()
    calls = []
    fused.register_forward_hook(lambda *_: calls.append(1))
    compiled = torch.compile(block.forward)
    x = torch.randn(2, 16)
    torch.testing.assert_close(compiled(x), linears[0](x) * 2 + linears[1](x) - linears[2](x))
    compiled(x)
    assert len(calls) == 2


def test_a_compiled_block_gets_the_merged_gradient_written_by_one_concatenation():
    """The fused module's call breaks the compiled graph before each projection: pieces taken in traced code would
    each give the merged output a zero-filled gradient (slice_backward) that autograd then adds up. Split once outside
    the graphs, the merged gradient is one concatenation of the pieces' gradients, and the gradients are eager's."""
    linears, fused, block = _merged_block()
    compiled = torch.compile(block.forward, backend="aot_eager")  # the graphs' own ops show in the profile
    x = torch.randn(2, 16)
    compiled(x).sum().backward()
    fused.weight.grad = None
    with torch.profiler.profile() as profiled:
        compiled(x).sum().backward()
    ops = Counter(event.name for event in profiled.events())
    assert ops["aten::slice_backward"] == 0 and ops["aten::cat"] == 1, ops
    (linears[0](x) * 2 + linears[1](x) - linears[2](x)).sum().backward()
    torch.testing.assert_close(fused.weight.grad, torch.cat([linear.weight.grad for linear in linears]))


def test_state_keys_load_the_users_keys_and_write_them_back():
    model = torchtitan_model()
    user = {k: v.clone() for k, v in model.state_dict().items()}
    block = model.layers["0"]
    wq, wk, wv = block.attention.wq, block.attention.wk, block.attention.wv
    fused = nn.Linear(256, 512, bias=False)
    fused.layer_norm_weight = nn.Parameter(torch.zeros(256))
    slices = merged_projections(fused, [wq, wk, wv])
    block.attention.wq, block.attention.wk, block.attention.wv = slices
    block.attention_norm = FoldedNorm("layers.0.attention.wq")
    keys = StateKeys.of(model)
    prefix = "layers.0.attention"
    keys.add(f"{prefix}.wq.fused.weight", [Part(f"{prefix}.{n}.weight", 0, rows)
                                            for n, rows in (("wq", 256), ("wk", 128), ("wv", 128))])
    keys.add(f"{prefix}.wq.fused.layer_norm_weight", [Part("layers.0.attention_norm.weight", 0, 256)])
    model.load_state_dict(user)  # strict: every user key lands somewhere
    assert torch.equal(fused.weight, torch.cat([user[f"{prefix}.{n}.weight"] for n in ("wq", "wk", "wv")]))
    assert torch.equal(fused.layer_norm_weight, user["layers.0.attention_norm.weight"])
    back = unfused_state_dict(model)
    assert back.keys() == user.keys() and all(torch.equal(back[k], user[k]) for k in user)
    model.load_state_dict(model.state_dict())  # its own keys load too


def test_a_fused_gate_up_is_written_back_as_one_tensor():
    model = Llama(load_model_config("tiny"))
    keys = StateKeys.of(model)
    w13 = model.layers[0].feed_forward.w13.weight.detach().clone()
    keys.fused = {"fc1": (Part("layers.0.feed_forward.w13.weight", 768, 1536),
                          Part("layers.0.feed_forward.w13.weight", 0, 768))}
    swapped = torch.cat([w13[768:], w13[:768]])
    back = keys.to_user_keys({"fc1": swapped})
    assert torch.equal(back["layers.0.feed_forward.w13.weight"], w13)


# --- master weights with the user's own optimizer; the trainer on the public API --------------------------------

def test_master_weights_with_the_users_optimizer_and_loop():
    model = fp8stack.assemble(torchtitan_model(), make_plan(torchtitan_model(), PolicyConfig(recipe="bf16"),
                                                            seq_len=256))
    masters = fp8stack.MasterWeights(model)
    with pytest.raises(ValueError, match="masters.parameters\\(\\), not model.parameters\\(\\)"):
        masters.track(torch.optim.AdamW(model.parameters()))
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = torch.randint(0, 256, (2, 33))
    for _ in range(2):
        for _ in range(2):  # two micro-batches
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        assert norm > 0, "clipping reads the FP32 main_grads through the masters"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for param, master in zip(masters.params, masters.masters, strict=True):
            assert torch.equal(param, master.to(torch.bfloat16)) and not param.main_grad.any()


def test_the_trainer_reaches_backends_only_through_their_public_api():
    import ast

    for path in (REPO / "fp8stack" / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("fp8stack.backends."), f"{path.name} imports {node.module}"


def test_the_example_changes_five_lines_and_trains_on_a_cpu(tmp_path):
    before, after = ((EXAMPLE / f"train_{name}.py").read_text().split('"""')[2] for name in ("bf16", "fp8stack"))
    added = [line for line in difflib.ndiff(before.splitlines(), after.splitlines())
             if line.startswith("+ ") and line[2:].strip()]
    assert len(added) <= 5, added
    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "train_fp8stack.py", "--model", "tiny", "--recipe", "tensorwise",
                          "--small-gemm-filter", "off", "--steps", "3", "--no-compile", "--result-json", str(result)],
                         cwd=EXAMPLE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torchao (tensorwise): 28 component(s) on 28 Float8Linear" in run.stdout
    import json

    losses = json.loads(result.read_text())["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_the_trace_runs_in_a_process_limited_to_one_attention_kernel():
    """The trainer keeps cuDNN's attention only for a whole run, which cannot take the trace's FP32 inputs: the trace
    allows every kernel while it runs (it once found nothing there, and the trainer lost every fusion unnoticed)."""
    from fp8stack.runtime.attention import sdpa_backend

    with sdpa_backend("cudnn", torch.device("cuda")):  # the flags only: CPU attention reads them too
        feeds = describe_module(Llama(load_model_config("tiny")), seq_len=256, name="tiny").feeds
        assert not torch.backends.cuda.math_sdp_enabled(), "the process's own choice is back after the trace"
    assert len(feeds) == 4 * 3 + 1


def test_a_model_that_cannot_be_traced_warns_that_nothing_is_fused():
    with pytest.warns(PlanWarning, match="no norm of two is fused with what it feeds: one forward"):
        make_plan(describe_module(TwoInputs(), seq_len=4, name="two"), DELAYED_ON_TE)
