"""Model description YAMLs (configs/models) and example recipe files (configs/recipes): they load, have
the shapes their header comments promise, and plan sensibly; bad description input is a PlanError."""

from collections import Counter

import pytest
import yaml

from fp8stack.plan import PlanError, PolicyConfig, description_from_dict, load_description, load_recipe_file, make_plan
from fp8stack.plan.description import CONFIGS_DIR, Routing

MODEL_FILES = sorted((CONFIGS_DIR / "models").glob("*.yaml"))
RECIPE_FILES = sorted((CONFIGS_DIR / "recipes").glob("*.yaml"))
HIGH_PRECISION_KINDS = ("embedding", "head", "router", "norm", "attn_core", "ssm_scan")
MOE_MODELS = {"deepseek-v3-like-moe", "hybrid-mamba-moe", "tiny-moe", "deepseek-moe-small", "deepseek-moe-medium"}
RECIPE_TARGETS = {"moe-only-fp8": MOE_MODELS, "blockwise-experts-delayed-dense": MOE_MODELS,
                  "torchao-rowwise-gw-hp-dense": {"hybrid-mamba-moe"}}
"""The models a recipe file's overrides are written for (every model where not listed): on the others an
override matches no component, which make_plan refuses."""


def shapes(model, layer: int) -> dict[str, tuple[int, int]]:
    return {c.name: (c.n, c.k) for c in model.components if c.layer == layer}


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.stem)
def test_every_model_file_loads_with_unique_names(path):
    model = load_description(path)
    assert model.num_layers > 0
    fqns = [c.fqn for c in model.components]
    assert len(fqns) == len(set(fqns))
    assert [c.layer for c in model.components if c.layer is not None] == sorted(
        c.layer for c in model.components if c.layer is not None)


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.stem)
def test_blockwise_plan_keeps_the_sensitive_kinds_bf16_and_experts_fp8(path):
    # The experts' path named: where auto puts them follows the measured table (tests/test_expert_table.py).
    plan = make_plan(load_description(path), PolicyConfig(recipe="blockwise", small_gemm_filter="off",
                                                          expert_backend="te"))
    for d in plan.decisions:
        if d.component.kind in HIGH_PRECISION_KINDS:  # the head may run on a TE module, without FP8 (head_on_te)
            assert d.recipe == "bf16" and d.backend in ("bf16", "te" if d.component.kind == "head" else "bf16"), d.fqn
        if d.component.kind == "expert":  # TE's GroupedLinear, as named
            assert (d.backend, d.recipe) == ("te", "blockwise"), d.fqn


def test_llama3_8b_shapes():
    model = load_description("llama3-8b")
    assert (model.num_layers, model.seq_len) == (32, 8192)
    layer = shapes(model, 31)
    assert layer["attention.wqkv"] == ((32 + 2 * 8) * 128, 4096)
    assert layer["feed_forward.w13"] == (2 * 14336, 4096)
    assert layer["feed_forward.w2"] == (4096, 14336)
    assert shapes(model, None)["output"] == (128256, 4096)
    params = sum(c.n * c.k for c in model.components if c.kind in ("embedding", "linear", "head"))
    assert 8.0e9 < params < 8.1e9  # Llama-3-8B has 8.03B parameters


def test_deepseek_v3_layout_and_mla_shapes():
    model = load_description("deepseek-v3-like-moe")
    assert model.num_layers == 61
    blocks = {c.layer: c.block for c in model.components if c.layer is not None}
    assert [blocks[i] for i in range(61)] == ["dense"] * 3 + ["moe"] * 58
    layer = shapes(model, 3)
    assert layer["attention.wq_b"] == (128 * (128 + 64), 1536)
    assert layer["attention.wkv_a"] == (512 + 64, 7168)
    assert layer["attention.wkv_b"] == (128 * (128 + 128), 512)
    assert layer["attention.wo"] == (7168, 128 * 128)
    experts = {c.name: c for c in model.components if c.layer == 3 and c.kind == "expert"}
    assert {(c.experts, c.active) for c in experts.values()} == {(256, 8)}
    assert (experts["moe.experts.w13"].n, experts["moe.experts.w2"].k) == (2 * 2048, 2048)
    params = sum(c.n * c.k * c.experts for c in model.components if c.kind in ("embedding", "linear", "expert", "router", "head"))
    assert 670e9 < params < 672e9  # 671B without the multi-token-prediction module


def test_deepseek_v3_plan_under_the_default_blockwise_policy():
    plan = make_plan(load_description("deepseek-v3-like-moe"), PolicyConfig(recipe="blockwise"))
    assert plan.decision("layers.3.moe.router.gate").backend == "bf16"
    assert plan.decision("layers.3.moe.experts.w13").backend == "te"  # the fastest measured on sm90
    assert plan.decision("layers.3.moe.experts.w2").backend == "te"
    assert plan.decision("layers.3.attention.wkv_a").reason.startswith("n=576 is not divisible by 128")
    assert {plan.decision(f).backend for f in ("tok_embeddings", "norm")} == {"bf16"}
    assert (plan.decision("output").backend, plan.decision("output").recipe) == ("te", "bf16")  # head_on_te


def test_deepseek_moe_medium_shapes_are_its_header_s():
    """Hidden 4096, 32 heads over 8 KV groups, layer 0 dense, then 16 experts top-4 of SwiGLU 4096 with one shared
    expert as wide, sigmoid routing renormalised; every expert and dense dim a multiple of 128 (FP8 block scales)."""
    model = load_description("deepseek-moe-medium")
    assert (model.num_layers, model.seq_len) == (6, 4096)
    blocks = {c.layer: c.block for c in model.components if c.layer is not None}
    assert [blocks[i] for i in range(6)] == ["dense"] + ["moe"] * 5
    layer = shapes(model, 1)
    assert layer["attention.wqkv"] == ((32 + 2 * 8) * 128, 4096)
    assert (layer["moe.experts.w13"], layer["moe.experts.w2"]) == ((2 * 4096, 4096), (4096, 4096))
    assert (layer["moe.shared_experts.w13"], layer["moe.router.gate"]) == ((2 * 4096, 4096), (16, 4096))
    assert shapes(model, 0)["feed_forward.w13"] == (2 * 14336, 4096)
    assert {(c.experts, c.active) for c in model.components if c.kind == "expert"} == {(16, 4)}
    assert all(d % 128 == 0 for c in model.components if c.kind in ("linear", "expert") for d in (c.n, c.k))
    assert model.router == Routing(score_func="sigmoid", route_norm=True)


def test_deepseek_moe_medium_runs_most_of_its_gemm_flops_in_fp8_with_its_experts_on_te():
    """The header's Amdahl bound rests on the plan's FP8 share f of the weight GEMMs: 92.8% with the experts on TE
    (all but the head and the routers); expert_backend auto takes them too, as the table measured TE's blockwise
    experts the fastest path at this model's expert block (with main_grad, as training runs them)."""
    from fp8stack.profile import amdahl_bound, fp8_matmul_share

    model = load_description("deepseek-moe-medium")
    on_te = make_plan(model, PolicyConfig(recipe="blockwise", expert_backend="te"))
    assert fp8_matmul_share(on_te) == pytest.approx(0.928, abs=1e-3)
    assert {d.fqn for d in on_te.decisions if d.component.kind in ("linear", "expert") and d.recipe == "bf16"} == set()
    assert amdahl_bound(0.677, fp8_matmul_share(on_te), 2.0) > 1.35  # at the header's estimated GEMM share
    auto = make_plan(model, PolicyConfig(recipe="blockwise"))
    assert fp8_matmul_share(auto) == fp8_matmul_share(on_te)
    assert {d.backend for d in auto.decisions if d.component.kind == "expert"} == {"te"}


def test_hybrid_layout_and_its_one_unaligned_dim():
    model = load_description("hybrid-mamba-moe")
    assert model.num_layers == 52
    blocks = Counter(c.block for c in model.components if c.name == "norm" and c.layer is not None)
    assert blocks == {"mamba": 28, "moe": 20, "attention": 4}
    gemm_dims = {(c.name, d) for c in model.components if c.kind in ("linear", "expert") for d in (c.n, c.k) if d % 128}
    assert gemm_dims == {("mixer.in_proj", 16496)}
    assert 16496 % 16 == 0
    rowwise = make_plan(model, PolicyConfig(recipe="rowwise"))
    blockwise = make_plan(model, PolicyConfig(recipe="blockwise"))
    assert rowwise.decision("layers.0.mixer.in_proj").backend == "torchao"
    assert blockwise.decision("layers.0.mixer.in_proj").backend == "bf16"
    assert blockwise.decision("layers.0.mixer.scan").backend == "bf16"


@pytest.mark.parametrize("recipe_path", RECIPE_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("model_path", MODEL_FILES, ids=lambda p: p.stem)
def test_every_recipe_file_plans_the_models_it_targets_and_refuses_the_others(recipe_path, model_path):
    settings, overrides = load_recipe_file(recipe_path)
    if model_path.stem not in RECIPE_TARGETS.get(recipe_path.stem, {model_path.stem}):
        with pytest.raises(PlanError, match=f"{recipe_path.name}: the override for block .* matches no component"):
            make_plan(load_description(model_path), PolicyConfig(**settings, overrides=overrides))
        return
    plan = make_plan(load_description(model_path), PolicyConfig(**settings, overrides=overrides))
    assert len(plan.decisions) == len(load_description(model_path).components)
    assert all(d.recipe == "bf16" and (d.backend == "bf16" or d.component.kind == "head")
               for d in plan.decisions if d.component.kind in HIGH_PRECISION_KINDS)


def plan_with(recipe_file: str, model: str, **policy):
    settings, overrides = load_recipe_file(recipe_file)
    return make_plan(load_description(model), PolicyConfig(**settings, **policy, overrides=overrides))


def test_moe_only_fp8_keeps_everything_outside_the_moe_ffn_bf16():
    for model in ("deepseek-v3-like-moe", "hybrid-mamba-moe"):
        plan = plan_with("moe-only-fp8", model, expert_backend="te")  # auto follows the table at each shape
        fp8 = {d.component.name for d in plan.decisions if d.precision == "fp8"}
        assert fp8 == {"moe.experts.w13", "moe.experts.w2", "moe.shared_experts.w13", "moe.shared_experts.w2"}
        assert plan.decision("layers.3.moe.experts.w2").backend == "te"


def test_deepseek_v3_recipe_runs_the_small_mla_projections_in_fp8():
    plan = plan_with("deepseek-v3", "deepseek-v3-like-moe")
    assert plan.fp8_format == "e4m3"
    for name in ("wq_a", "wq_b", "wkv_b", "wo"):
        assert (plan.decision(f"layers.0.attention.{name}").backend, plan.decision(f"layers.60.attention.{name}").recipe) == ("te", "blockwise")
    assert plan.decision("layers.0.attention.wkv_a").backend == "bf16"  # 576 outputs: the alignment rule


def test_torchao_rowwise_gw_hp_recipe_matches_the_shipped_split():
    plan = plan_with("torchao-rowwise-gw-hp-dense", "hybrid-mamba-moe")
    assert (plan.decision("layers.5.attention.wqkv").backend, plan.decision("layers.5.attention.wqkv").recipe) == ("torchao", "rowwise_gw_hp")
    assert (plan.decision("layers.1.moe.experts.w13").backend, plan.decision("layers.1.moe.experts.w13").recipe) == ("grouped_fp8", "blockwise")
    assert "expert_backend=grouped_fp8, as asked: measured " in plan.decision("layers.1.moe.experts.w13").reason
    assert plan.decision("layers.1.moe.shared_experts.w13").backend == "torchao"
    assert {plan.decision(f"layers.0.mixer.{n}").backend for n in ("in_proj", "out_proj")} == {"bf16"}


GOOD = {
    "name": "m", "seq_len": 16,
    "blocks": {"dense": [{"name": "w", "kind": "linear", "n": 32, "k": 32}]},
    "layers": [{"block": "dense", "repeat": 2}],
}


@pytest.mark.parametrize("change, message", [
    ({"shape": 3}, "unknown key(s) ['shape']"),
    ({"layers": "dense"}, "layers must be a list"),
    ({"seq_len": 0}, "seq_len must be a positive integer"),
    ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    ({"rope_theta": "1e4"}, "rope_theta must be a positive number, got '1e4'"),
    ({"rope_theta": float("inf")}, "rope_theta must be a positive number, got inf"),
    ({"router": "sigmoid"}, "router must be a mapping of score_func (softmax or sigmoid) and route_norm"),
    ({"router": {"score": "sigmoid"}}, "router must be a mapping of score_func"),
    ({"router": {"score_func": "relu"}}, "router: score_func must be one of softmax, sigmoid"),
    ({"router": {"route_norm": "yes"}}, "router: score_func must be one of softmax, sigmoid and route_norm true or "
                                        "false, got {'route_norm': 'yes'}"),
    ({"blocks": {}}, "'blocks' must map block type names"),
    ({"layers": [{"block": "moe"}]}, "layers use block 'moe', not defined under 'blocks'"),
    ({"layers": [{"repeat": 2}]}, "each 'layers' entry needs 'block'"),
    ({"layers": [{"block": "dense", "repeat": -1}]}, "repeat of dense must be a positive integer"),
    ({"blocks": {"dense": [{"name": "w", "kind": "conv", "n": 1, "k": 1}]}}, "has kind 'conv'; use one of linear"),
    ({"blocks": {"dense": [{"name": "w", "kind": "linear", "n": 0, "k": 1}]}}, "layers.0.w n must be a positive integer"),
    ({"blocks": {"dense": [{"name": "w", "kind": "linear", "k": 1}]}}, "n must be a positive integer, got None"),
    ({"blocks": {"dense": [{"kind": "linear", "n": 1, "k": 1}]}}, "every component needs a 'name'"),
    ({"blocks": {"dense": [{"name": "w", "kind": "linear", "n": 1, "k": 1, "width": 2}]}}, "has unknown key(s) ['width']"),
])
def test_bad_description_raises_plan_error_naming_the_fix(change, message):
    with pytest.raises(PlanError) as err:
        description_from_dict({**GOOD, **change}, source="bad.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("bad.yaml")


def test_rope_theta_is_read_and_optional():
    assert load_description("llama3-8b").rope_theta == 500000.0
    assert load_description("hybrid-mamba-moe").rope_theta is None
    assert description_from_dict({**GOOD, "rope_theta": 10000}).rope_theta == 10000.0


def test_router_scoring_is_read_and_reaches_the_built_moe():
    from fp8stack.models.from_description import load_model_config

    assert load_description("deepseek-moe-small").router == Routing(score_func="sigmoid", route_norm=True)
    assert load_description("tiny-moe").router is None
    moe = load_model_config("deepseek-moe-small").moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_dim, moe.shared_ffn_dim) == (32, 8, 1536, 1536)
    assert (moe.score_func, moe.route_norm) == ("sigmoid", True)
    assert load_model_config("tiny-moe").moe.score_func == "softmax"


def test_missing_required_key():
    with pytest.raises(PlanError, match="missing required key 'layers'"):
        description_from_dict({k: v for k, v in GOOD.items() if k != "layers"})


def test_unreadable_description_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: m\nblocks: [unclosed\n")
    with pytest.raises(PlanError, match="not valid YAML at line"):
        load_description(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(PlanError, match="must be a YAML mapping"):
        load_description(listing)
    with pytest.raises(PlanError, match="not found: give a YAML path or one of .*llama3-8b"):
        load_description("no-such-model")
