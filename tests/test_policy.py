"""One test (or a few) per policy rule in fp8stack/plan/policy.py, on small inline descriptions."""

import math
import re

import pytest

from fp8stack.plan import (Decision, ModelDescription, Override, PlanError, PolicyConfig, description_from_dict,
                           load_recipe_file, make_plan)
from fp8stack.plan.description import GEMM_KINDS
from fp8stack.plan.policy import HIGH_PRECISION_REASONS

BIG = {"n": 4096, "k": 4096}
"""A GEMM shape that passes every alignment and small-GEMM rule."""


def one_component(kind: str = "linear", n: int = 4096, k: int = 4096, **extra) -> ModelDescription:
    """A one-layer model holding a single component, 'layers.0.proj'."""
    return description_from_dict({
        "name": "one", "seq_len": 4096,
        "blocks": {"dense": [{"name": "proj", "kind": kind, "n": n, "k": k, **extra}]},
        "layers": [{"block": "dense"}],
    })


def decide(model: ModelDescription, **cfg) -> Decision:
    """The decision for the model's first component."""
    return make_plan(model, PolicyConfig(**cfg)).decisions[0]


def stack(num_layers: int) -> ModelDescription:
    """Embedding, `num_layers` dense layers of one big linear (layers.i.proj), head."""
    return description_from_dict({
        "name": "stack", "seq_len": 4096,
        "before_layers": [{"name": "tok_embeddings", "kind": "embedding", "n": 4096, "k": 32000}],
        "blocks": {"dense": [{"name": "proj", "kind": "linear", **BIG}]},
        "layers": [{"block": "dense", "repeat": num_layers}],
        "after_layers": [{"name": "output", "kind": "head", "n": 32000, "k": 4096}],
    })


def moe_model() -> ModelDescription:
    """A dense layer then two MoE layers, named like fp8stack.models (DeepSeek-V3-sized experts)."""
    attention = [
        {"name": "attention_norm", "kind": "norm", "n": 7168, "k": 7168},
        {"name": "attention.wqkv", "kind": "linear", "n": 9216, "k": 7168},
        {"name": "attention.core", "kind": "attn_core", "n": 4096, "k": 128, "active": 128},
        {"name": "attention.wo", "kind": "linear", "n": 7168, "k": 7168},
        {"name": "ffn_norm", "kind": "norm", "n": 7168, "k": 7168},
    ]
    return description_from_dict({
        "name": "moe", "seq_len": 4096,
        "before_layers": [{"name": "tok_embeddings", "kind": "embedding", "n": 7168, "k": 129280}],
        "blocks": {
            "dense": attention + [{"name": "feed_forward.w13", "kind": "linear", "n": 36864, "k": 7168},
                                  {"name": "feed_forward.w2", "kind": "linear", "n": 7168, "k": 18432}],
            "moe": attention + [
                {"name": "moe.router.gate", "kind": "router", "n": 256, "k": 7168},
                {"name": "moe.experts.w13", "kind": "expert", "n": 4096, "k": 7168, "experts": 256, "active": 8},
                {"name": "moe.experts.w2", "kind": "expert", "n": 7168, "k": 2048, "experts": 256, "active": 8},
                {"name": "moe.shared_experts.w13", "kind": "linear", "n": 4096, "k": 7168},
                {"name": "moe.shared_experts.w2", "kind": "linear", "n": 7168, "k": 2048},
            ],
        },
        "layers": [{"block": "dense"}, {"block": "moe", "repeat": 2}],
        "after_layers": [{"name": "norm", "kind": "norm", "n": 7168, "k": 7168},
                         {"name": "output", "kind": "head", "n": 129280, "k": 7168}],
    })


def write_recipe(tmp_path, text: str):
    path = tmp_path / "my-recipe.yaml"
    path.write_text(text)
    return path


def config_from_file(path, **extra) -> PolicyConfig:
    settings, overrides = load_recipe_file(path)
    return PolicyConfig(**{**settings, **extra}, overrides=overrides)


# --- high_precision_kinds -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(HIGH_PRECISION_REASONS))
def test_high_precision_kinds_stay_bf16_even_when_an_override_asks_for_fp8(kind):
    force_fp8 = Override(block="*", fqn="*", backend="te", recipe="tensorwise", reason="everything in FP8")
    d = decide(one_component(kind), recipe="tensorwise", small_gemm_filter="off", overrides=(force_fp8,))
    assert (d.backend, d.recipe, d.precision) == ("bf16", "bf16", "bf16")
    assert d.reason.startswith(HIGH_PRECISION_REASONS[kind])  # attention's adds that FP8 attention is opt-in


def test_high_precision_kinds_cover_the_documented_list():
    assert set(HIGH_PRECISION_REASONS) == {"embedding", "head", "router", "norm", "attn_core", "ssm_scan"}


def test_ssm_scan_in_a_mamba_block_stays_bf16_while_its_projections_go_fp8():
    model = description_from_dict({
        "name": "hybrid", "seq_len": 4096,
        "blocks": {"mamba": [{"name": "mixer.in_proj", "kind": "linear", "n": 8192, "k": 4096},
                             {"name": "mixer.scan", "kind": "ssm_scan", "n": 4096, "k": 128},
                             {"name": "mixer.out_proj", "kind": "linear", "n": 4096, "k": 4096}]},
        "layers": [{"block": "mamba", "repeat": 2}],
    })
    plan = make_plan(model, PolicyConfig(recipe="tensorwise"))
    assert plan.decision("layers.1.mixer.scan").backend == "bf16"
    assert "SSM scan" in plan.decision("layers.1.mixer.scan").reason
    assert plan.decision("layers.1.mixer.in_proj").precision == "fp8"
    assert plan.decision("layers.1.mixer.out_proj").precision == "fp8"


# --- no_fp8_requested -----------------------------------------------------------------------------

def test_bf16_recipe_keeps_every_component_bf16():
    plan = make_plan(moe_model(), PolicyConfig(recipe="bf16"))
    assert {d.backend for d in plan.decisions} == {"bf16"}
    gemm = plan.decision("layers.1.attention.wqkv")
    assert gemm.reason == "recipe bf16: no FP8 requested"
    assert plan.summary()["fp8_gemms"] == 0


def test_bf16_recipe_on_te_puts_the_gemms_on_te_modules_without_fp8():
    plan = make_plan(moe_model(), PolicyConfig(recipe="bf16", backend="te"))
    wqkv = plan.decision("layers.1.attention.wqkv")
    assert (wqkv.backend, wqkv.recipe, wqkv.precision) == ("te", "bf16", "bf16")
    assert "TransformerEngine module without FP8" in wqkv.reason
    assert {(d.backend, d.recipe) for d in plan.decisions if d.component.kind == "expert"} == {("te", "bf16")}
    assert plan.decision("output").backend == "te"  # the head too (head_on_te: auto where the linears run on TE)
    assert plan.decision("tok_embeddings").backend == "bf16"  # the other high-precision kinds stay as they are
    assert plan.summary()["fp8_gemms"] == 0
    # A bf16 override inside an FP8 plan on te stays a plain BF16 module: only a whole bf16 plan moves to TE.
    override = Override(fqn="layers.*.attention.wo", recipe="bf16", reason="keep wo BF16")
    mixed = make_plan(moe_model(), PolicyConfig(recipe="tensorwise", backend="te", overrides=(override,)))
    assert mixed.decision("layers.2.attention.wo").backend == "bf16"


def test_bf16_recipe_with_an_fp8_override_puts_only_the_matching_components_in_fp8():
    override = Override(fqn="layers.*.attention.wo", recipe="tensorwise", reason="try wo in FP8")
    plan = make_plan(moe_model(), PolicyConfig(recipe="bf16", overrides=(override,)))
    assert plan.decision("layers.2.attention.wo").recipe == "tensorwise"
    assert plan.decision("layers.2.attention.wqkv").recipe == "bf16"


# --- first_last_layers ----------------------------------------------------------------------------

def _bf16_layers(plan) -> list[int]:
    return [d.component.layer for d in plan.decisions if d.component.layer is not None and d.backend == "bf16"]


def test_first_last_layers_off_by_default():
    assert _bf16_layers(make_plan(stack(6), PolicyConfig(recipe="tensorwise"))) == []


def test_first_last_layers_default_counts_are_one_and_one():
    plan = make_plan(stack(6), PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True))
    assert _bf16_layers(plan) == [0, 5]
    assert plan.decision("layers.0.proj").reason == "first 1 layer(s) kept BF16 (--first-last-layers-bf16)"
    assert plan.decision("layers.5.proj").reason == "last 1 layer(s) kept BF16 (--first-last-layers-bf16)"
    assert plan.decision("output").reason == HIGH_PRECISION_REASONS["head"]  # outside the layers: own rule


@pytest.mark.parametrize(("recipe", "backend"), [("delayed", "te"), ("delayed", "auto"), ("bf16", "te")])
def test_head_on_te_puts_the_head_beside_the_te_linears_without_fp8(recipe, backend):
    plan = make_plan(stack(2), PolicyConfig(recipe=recipe, backend=backend, head_on_te=True))
    head = plan.decision("output")
    assert (head.backend, head.recipe) == ("te", "bf16")
    assert head.reason.startswith(HIGH_PRECISION_REASONS["head"]) and "head_on_te" in head.reason
    assert plan.decision("tok_embeddings").backend == "bf16"  # the other high-precision kinds stay as they are
    assert plan.decision("output").backend == make_plan(stack(2), PolicyConfig(recipe=recipe, backend=backend)
                                                        ).decision("layers.0.proj").backend


@pytest.mark.parametrize(("recipe", "backend"), [("tensorwise", "torchao"), ("rowwise", "auto"), ("bf16", "auto")])
def test_head_on_te_is_refused_without_te_linears(recipe, backend):
    with pytest.raises(PlanError, match=f"recipe {recipe} with backend {backend} has none: use backend te or drop "
                                        "head_on_te"):
        PolicyConfig(recipe=recipe, backend=backend, head_on_te=True)


def test_first_last_layers_custom_counts():
    cfg = PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True,
                       num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=3)
    plan = make_plan(stack(8), cfg)
    assert _bf16_layers(plan) == [0, 1, 5, 6, 7]
    assert "first 2 layer(s)" in plan.decision("layers.1.proj").reason
    assert "last 3 layer(s)" in plan.decision("layers.5.proj").reason


@pytest.mark.parametrize(("start", "end", "expected"), [(0, 0, []), (0, 1, [5]), (2, 0, [0, 1])])
def test_first_last_layers_zero_counts(start, end, expected):
    cfg = PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True,
                       num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    assert _bf16_layers(make_plan(stack(6), cfg)) == expected


def test_first_last_layers_yield_to_an_override_that_names_the_layer():
    override = Override(fqn="layers.0.proj", recipe="tensorwise", reason="layer 0 measured fine")
    plan = make_plan(stack(4), PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True, overrides=(override,)))
    assert plan.decision("layers.0.proj").precision == "fp8"
    assert plan.decision("layers.3.proj").precision == "bf16"


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_first_last_layer_counts_must_be_non_negative_integers(bad):
    with pytest.raises(PlanError, match="--num-layers-at-start-in-bf16 must be a non-negative integer"):
        PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=bad)


# --- alignment ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "k", "dim"), [(4104, 4096, "n=4104"), (4096, 4100, "k=4100")])
def test_dims_not_divisible_by_16_stay_bf16_naming_the_dim(n, k, dim):
    d = decide(one_component(n=n, k=k), recipe="tensorwise", small_gemm_filter="off")
    assert d.backend == "bf16"
    assert d.reason.startswith(f"{dim} is not divisible by 16")
    assert "tensorwise on torchao" in d.reason


def test_multiples_of_16_pass_for_per_tensor_and_rowwise_recipes():
    for recipe in ("tensorwise", "rowwise", "rowwise_gw_hp", "delayed"):
        assert decide(one_component(n=4112, k=4112), recipe=recipe, small_gemm_filter="off").precision == "fp8"


@pytest.mark.parametrize(("n", "k", "dim"), [(4160, 4096, "n=4160"), (4096, 4112, "k=4112")])
def test_blockwise_needs_multiples_of_128(n, k, dim):
    d = decide(one_component(n=n, k=k), recipe="blockwise", small_gemm_filter="off")
    assert d.backend == "bf16"
    assert d.reason.startswith(f"{dim} is not divisible by 128 (blockwise on te")
    assert decide(one_component(n=4224, k=4096), recipe="blockwise", small_gemm_filter="off").recipe == "blockwise"


def test_grouped_fp8_experts_need_multiples_of_128_even_under_a_16_aligned_recipe():
    expert = one_component("expert", n=4096, k=2064, experts=8, active=2)  # 2064 = 129 * 16
    d = decide(expert, recipe="tensorwise", small_gemm_filter="off", expert_backend="grouped_fp8")
    assert d.backend == "bf16"
    assert d.reason.startswith("k=2064 is not divisible by 128") and "grouped_fp8" in d.reason


def test_mxfp8_needs_multiples_of_32():
    d = decide(one_component(n=4096, k=4112), recipe="mxfp8", arch=100, small_gemm_filter="off")
    assert d.reason.startswith("k=4112 is not divisible by 32")


# --- small_gemm -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "k", "small"), [
    (2048, 8192, True),    # n <= 2048
    (8192, 1024, True),    # k <= 1024
    (4096, 2048, True),    # n <= 4096 and k <= 2048
    (4096, 4096, False),
    (8192, 2048, False),
    (2064, 2064, False),
])
def test_small_gemm_rowwise_filter(n, k, small):
    d = decide(one_component(n=n, k=k), recipe="rowwise", small_gemm_filter="rowwise")
    assert (d.backend == "bf16") is small
    if small:
        assert d.reason.startswith("small GEMM (") and "torchao rowwise auto-filter" in d.reason


@pytest.mark.parametrize(("n", "k", "small"), [
    (1024, 4096, True),
    (1024, 4112, False),
    (1040, 1024, False),
    (2048, 1024, False),   # small for the rowwise filter, not for tensorwise
])
def test_small_gemm_tensorwise_filter(n, k, small):
    d = decide(one_component(n=n, k=k), recipe="tensorwise", small_gemm_filter="tensorwise")
    assert (d.backend == "bf16") is small
    if small:
        assert d.reason.startswith("small GEMM (n=1024 <= 1024 and k=4096 <= 4096, torchao tensorwise auto-filter)")


def test_small_gemm_reason_names_only_the_bounds_that_apply():
    d = decide(one_component(n=8192, k=512), recipe="rowwise")
    assert d.reason.startswith("small GEMM (k=512 <= 1024, torchao rowwise auto-filter)")


def test_small_gemm_filter_off_keeps_tiny_gemms_in_fp8():
    d = decide(one_component(n=256, k=256), recipe="tensorwise", small_gemm_filter="off")
    assert (d.backend, d.recipe) == ("torchao", "tensorwise")


def test_small_gemm_filter_is_the_recipes_own_by_default():
    assert decide(one_component(n=2048, k=8192), recipe="rowwise").backend == "bf16"
    assert decide(one_component(n=2048, k=8192), recipe="tensorwise").backend == "torchao"  # over tensorwise's 1024
    assert decide(one_component(n=1024, k=4096), recipe="tensorwise").backend == "bf16"


def test_unknown_small_gemm_filter_is_refused():
    with pytest.raises(PlanError, match="unknown small-GEMM filter 'tiny'"):
        PolicyConfig(recipe="tensorwise", small_gemm_filter="tiny")


# --- arch -----------------------------------------------------------------------------------------

def test_mxfp8_is_refused_before_sm100():
    with pytest.raises(PlanError, match=r"recipe 'mxfp8' needs sm100\+ but the target is sm90: .*--arch sm100"):
        PolicyConfig(recipe="mxfp8", arch=90)


def test_mxfp8_on_sm100_runs_on_te():
    d = decide(one_component(**BIG), recipe="mxfp8", arch=100)
    assert (d.backend, d.recipe) == ("te", "mxfp8")
    assert "MXFP8" in d.reason and "TransformerEngine" in d.reason


def test_blockwise_needs_hopper():
    with pytest.raises(PlanError, match=r"needs sm90\+ but the target is sm89"):
        PolicyConfig(recipe="blockwise", arch=89)


def test_an_override_recipe_is_checked_against_the_arch_too():
    with pytest.raises(PlanError, match=r"override for block '\*', fqn '\*wo'.*needs sm100\+"):
        PolicyConfig(recipe="tensorwise", arch=90, overrides=(Override(fqn="*wo", recipe="mxfp8"),))


# --- recipes and backends -------------------------------------------------------------------------

@pytest.mark.parametrize(("recipe", "backend"), [
    ("rowwise", "te"), ("rowwise_gw_hp", "te"), ("delayed", "torchao"), ("blockwise", "torchao"), ("mxfp8", "torchao"),
])
def test_recipe_without_an_implementation_on_the_requested_backend_is_refused(recipe, backend):
    with pytest.raises(PlanError, match=f"recipe '{recipe}' has no {backend} implementation: use --backend"):
        PolicyConfig(recipe=recipe, backend=backend, arch=100)


@pytest.mark.parametrize(("recipe", "backend", "expected"), [
    ("tensorwise", "auto", "torchao"), ("tensorwise", "te", "te"), ("tensorwise", "torchao", "torchao"),
    ("rowwise", "auto", "torchao"), ("delayed", "auto", "te"), ("blockwise", "auto", "te"),
])
def test_dense_backend_follows_the_preference(recipe, backend, expected):
    d = decide(one_component(**BIG), recipe=recipe, backend=backend)
    assert (d.backend, d.recipe) == (expected, recipe)


def test_unknown_recipe_format_and_backend_are_refused():
    with pytest.raises(PlanError, match="unknown FP8 recipe 'fp4': use one of bf16, delayed"):
        PolicyConfig(recipe="fp4")
    with pytest.raises(PlanError, match="unknown FP8 format 'e5m2': use e4m3 or hybrid"):
        PolicyConfig(recipe="tensorwise", fp8_format="e5m2")
    with pytest.raises(PlanError, match="unknown backend 'cutlass'"):
        PolicyConfig(recipe="tensorwise", backend="cutlass")


def test_yaml_booleans_where_a_name_belongs_are_refused_with_a_hint():
    with pytest.raises(PlanError, match="small_gemm_filter must be a name, got False .*quote the word"):
        PolicyConfig(recipe="tensorwise", small_gemm_filter=False)
    with pytest.raises(PlanError, match=r"recipe must be a name, got \['rowwise'\]"):
        PolicyConfig(recipe=["rowwise"])
    with pytest.raises(PlanError, match="first_last_layers_bf16 must be true or false"):
        PolicyConfig(recipe="tensorwise", first_last_layers_bf16="yes")


# On sm90 (the table measured by fp8stack.bench.backends), read at these DeepSeek-V3-sized experts' nearest measured
# shape: TE's blockwise GroupedLinear is faster than BF16 (measured at 8 experts only); at 32 experts of 256 tokens
# TE's tensorwise and delayed ones and the grouped_fp8 paths are slower, so auto keeps those experts BF16.
@pytest.mark.parametrize(("recipe", "backend", "asked", "expert_backend", "expert_recipe"), [
    ("blockwise", "auto", "auto", "te", "blockwise"),
    ("blockwise", "auto", "grouped_fp8", "grouped_fp8", "blockwise"),
    ("tensorwise", "auto", "auto", "bf16", "bf16"),
    ("tensorwise", "auto", "grouped_fp8", "grouped_fp8", "rowwise"),
    ("rowwise", "auto", "auto", "bf16", "bf16"),
    ("rowwise", "auto", "grouped_fp8", "grouped_fp8", "rowwise"),
    ("rowwise_gw_hp", "auto", "grouped_fp8", "grouped_fp8", "rowwise_gw_hp"),
    ("tensorwise", "te", "auto", "bf16", "bf16"),
    ("tensorwise", "te", "te", "te", "tensorwise"),
    ("delayed", "auto", "auto", "bf16", "bf16"),
    ("delayed", "auto", "te", "te", "delayed"),
])
def test_expert_gemms_backend_and_recipe(recipe, backend, asked, expert_backend, expert_recipe):
    plan = make_plan(moe_model(), PolicyConfig(recipe=recipe, backend=backend, expert_backend=asked))
    for fqn in ("layers.1.moe.experts.w13", "layers.2.moe.experts.w2"):
        d = plan.decision(fqn)
        assert (d.backend, d.recipe) == (expert_backend, expert_recipe)


def test_expert_backend_names_a_backend_the_recipe_has():
    with pytest.raises(PlanError, match="expert_backend='deepgemm': use auto, grouped_fp8 or te"):
        PolicyConfig(recipe="blockwise", expert_backend="deepgemm")
    with pytest.raises(PlanError, match="expert_backend=te: recipe rowwise with its linears on torchao has no te "
                                        "expert path: use expert_backend auto or grouped_fp8"):
        make_plan(moe_model(), PolicyConfig(recipe="rowwise", expert_backend="te"))


def test_expert_reason_says_why_the_recipe_differs_from_the_requested_one():
    d = make_plan(moe_model(), PolicyConfig(recipe="tensorwise", expert_backend="grouped_fp8")).decision(
        "layers.1.moe.experts.w13")
    assert "; grouped expert GEMMs have no tensorwise kernel, so they use rowwise; " in d.reason


def test_moe_blockwise_plan_keeps_router_embeddings_head_and_norms_bf16():
    plan = make_plan(moe_model(), PolicyConfig(recipe="blockwise"))
    for d in plan.decisions:
        kind = d.component.kind
        if kind in ("router", "embedding", "head", "norm", "attn_core"):
            assert d.recipe == "bf16" and d.backend == ("te" if kind == "head" else "bf16"), d.fqn  # head_on_te
        if kind == "expert":
            assert (d.backend, d.recipe) == ("te", "blockwise"), d.fqn
    assert plan.decision("layers.1.moe.shared_experts.w13").backend == "te"


# --- overrides from a recipe file -----------------------------------------------------------------

def test_per_block_override_from_a_recipe_file(tmp_path):
    path = write_recipe(tmp_path, """
recipe: blockwise
overrides:
  - {block: dense, backend: bf16, reason: dense blocks measured no gain}
""")
    plan = make_plan(moe_model(), config_from_file(path))
    dense = plan.decision("layers.0.attention.wqkv")
    assert dense.backend == "bf16"
    assert dense.reason == "my-recipe.yaml: dense blocks measured no gain"
    assert plan.decision("layers.1.attention.wqkv").recipe == "blockwise"


def test_per_fqn_glob_override_from_a_recipe_file(tmp_path):
    path = write_recipe(tmp_path, """
recipe: blockwise
overrides:
  - {fqn: "layers.*.attention.wo", backend: torchao, recipe: rowwise, reason: wo on torchao rowwise}
""")
    plan = make_plan(moe_model(), config_from_file(path))
    for layer in (0, 1, 2):
        wo = plan.decision(f"layers.{layer}.attention.wo")
        assert (wo.backend, wo.recipe) == ("torchao", "rowwise")
        assert wo.reason.startswith("my-recipe.yaml: wo on torchao rowwise: rowwise FP8")
    assert plan.decision("layers.1.attention.wqkv").recipe == "blockwise"


def test_an_override_may_pair_a_recipe_with_its_own_backend_against_the_global_one(tmp_path):
    path = write_recipe(tmp_path, """
recipe: blockwise
backend: te
overrides:
  - {fqn: "*.attention.wo", backend: torchao, recipe: rowwise}
""")
    wo = make_plan(moe_model(), config_from_file(path)).decision("layers.1.attention.wo")
    assert (wo.backend, wo.recipe) == ("torchao", "rowwise")


def test_last_matching_override_wins(tmp_path):
    path = write_recipe(tmp_path, """
recipe: tensorwise
overrides:
  - {block: moe, backend: bf16, reason: MoE layers high precision}
  - {block: moe, fqn: "layers.2.*", backend: te, reason: but layer 2 on TE}
""")
    plan = make_plan(moe_model(), config_from_file(path))
    assert plan.decision("layers.1.attention.wo").backend == "bf16"
    assert plan.decision("layers.1.attention.wo").reason == "my-recipe.yaml: MoE layers high precision"
    two = plan.decision("layers.2.attention.wo")
    assert (two.backend, two.recipe) == ("te", "tensorwise")
    assert two.reason.startswith("my-recipe.yaml: but layer 2 on TE: tensorwise FP8")
    assert plan.decision("layers.0.attention.wo").backend == "torchao"  # dense: no override matches


def test_override_does_not_lift_safety_rules(tmp_path):
    path = write_recipe(tmp_path, """
recipe: blockwise
overrides:
  - {fqn: "*", backend: te, reason: all of it}
""")
    cfg = config_from_file(path)
    assert make_plan(moe_model(), cfg).decision("layers.1.moe.router.gate").backend == "bf16"
    assert decide(one_component(n=4096, k=4104), **vars(cfg)).reason.startswith("k=4104 is not divisible by 128")
    assert decide(one_component(n=256, k=256), **vars(cfg)).reason.startswith("small GEMM")


def test_recipe_file_settings_reach_the_config(tmp_path):
    path = write_recipe(tmp_path, """
recipe: rowwise
fp8_format: e4m3
first_last_layers_bf16: true
num_layers_at_start_in_bf16: 2
num_layers_at_end_in_bf16: 0
small_gemm_filter: "off"
""")
    cfg = config_from_file(path)
    assert (cfg.recipe, cfg.fp8_format, cfg.first_last_layers_bf16) == ("rowwise", "e4m3", True)
    assert (cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16, cfg.small_gemm_filter) == (2, 0, "off")


@pytest.mark.parametrize(("text", "message"), [
    ("recipe: tensorwise\nstrategy: fast\n", r"unknown key\(s\) \['strategy'\]"),
    ("recipe: tensorwise\noverrides: {block: moe}\n", "'overrides' must be a list"),
    ("recipe: tensorwise\noverrides:\n  - {block: moe, reason: x}\n", "sets neither 'backend' nor 'recipe'"),
    ("recipe: tensorwise\noverrides:\n  - {blocks: moe, backend: bf16}\n", "override #1 must be a mapping with keys"),
    ("recipe: tensorwise\noverrides:\n  - {block: moe, backend: cuda}\n", "override backend 'cuda'"),
    ("recipe: tensorwise\nsmall_gemm_filter: off\n", "small_gemm_filter must be a name, got False"),
    ("recipe: [tensorwise\n", "is not valid YAML at line"),
    ("- recipe: tensorwise\n", "must be a YAML mapping"),
])
def test_bad_recipe_files_raise_plan_errors(tmp_path, text, message):
    path = write_recipe(tmp_path, text)
    with pytest.raises(PlanError, match=message):
        config_from_file(path)


# --- FP32 state and summary -----------------------------------------------------------------------

def test_fp32_list_names_the_state_that_never_leaves_fp32():
    plan = make_plan(moe_model(), PolicyConfig(recipe="blockwise"))
    what = " | ".join(w for w, _ in plan.fp32)
    for item in ("master weights", "optimizer states", "loss", "gradient norm", "softmax and norm reductions"):
        assert item in what
    assert all(reason for _, reason in plan.fp32)
    assert plan.as_dict()["fp32"][0] == {"what": plan.fp32[0][0], "reason": plan.fp32[0][1]}


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise", "blockwise", "delayed"])
def test_summary_shares_add_up_to_one(recipe):
    summary = make_plan(moe_model(), PolicyConfig(recipe=recipe, first_last_layers_bf16=True)).summary()
    assert math.isclose(sum(summary["flops_share_by_backend"].values()), 1.0, abs_tol=1e-3)
    assert math.isclose(sum(summary["flops_share_by_precision"].values()), 1.0, abs_tol=1e-3)
    assert summary["fp8_gemms"] + summary["high_precision_gemms"] == sum(
        c.kind in GEMM_KINDS for c in moe_model().components)


def test_summary_weighs_shares_by_flops():
    plan = make_plan(moe_model(), PolicyConfig(recipe="blockwise", expert_backend="grouped_fp8"))
    by_backend = plan.summary()["flops_share_by_backend"]
    total = sum(d.component.flops_per_token for d in plan.decisions)
    grouped = sum(d.component.flops_per_token for d in plan.for_backend("grouped_fp8"))
    assert by_backend["grouped_fp8"] == pytest.approx(grouped / total, abs=1e-4)


def test_every_component_gets_exactly_one_decision_in_order():
    model = moe_model()
    plan = make_plan(model, PolicyConfig(recipe="blockwise"))
    assert [d.component for d in plan.decisions] == list(model.components)
    assert all(d.reason for d in plan.decisions)


def test_small_gemm_filter_leaves_expert_gemms_alone():
    from fp8stack.plan import description_from_dict
    desc = description_from_dict({
        "name": "m", "seq_len": 128,
        "blocks": {"moe": [{"name": "moe.experts.w2", "kind": "expert", "n": 1024, "k": 512, "experts": 8, "active": 2},
                           {"name": "moe.shared_experts.w2", "kind": "linear", "n": 1024, "k": 512}]},
        "layers": [{"block": "moe"}]})
    plan = make_plan(desc, PolicyConfig(recipe="blockwise"))
    assert plan.decision("layers.0.moe.experts.w2").recipe == "blockwise"
    assert "small GEMM" in plan.decision("layers.0.moe.shared_experts.w2").reason


def test_block_wide_override_does_not_lift_first_last_layers(tmp_path):
    from fp8stack.plan import Override, description_from_dict
    desc = description_from_dict({
        "name": "m", "seq_len": 128, "blocks": {"dense": [{"name": "w", "kind": "linear", "n": 4096, "k": 4096}]},
        "layers": [{"block": "dense", "repeat": 3}]})
    block_wide = Override(block="dense", recipe="rowwise", source="r.yaml")
    by_fqn = Override(fqn="layers.0.w", recipe="rowwise", source="r.yaml")
    plan = make_plan(desc, PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True, overrides=(block_wide,)))
    assert [d.backend for d in plan.decisions] == ["bf16", "torchao", "bf16"]
    plan = make_plan(desc, PolicyConfig(recipe="tensorwise", first_last_layers_bf16=True, overrides=(by_fqn,)))
    assert [(d.backend, d.recipe) for d in plan.decisions] == [("torchao", "rowwise"), ("torchao", "tensorwise"), ("bf16", "bf16")]


def test_expert_only_override_with_torchao_backend():
    from fp8stack.plan import Override, description_from_dict
    desc = description_from_dict({
        "name": "m", "seq_len": 128,
        "blocks": {"moe": [{"name": "wo", "kind": "linear", "n": 4096, "k": 4096},
                           {"name": "moe.experts.w13", "kind": "expert", "n": 4096, "k": 7168, "experts": 8,
                            "active": 2}]},
        "layers": [{"block": "moe"}]})
    experts_blockwise = Override(fqn="*.experts.*", recipe="blockwise", source="r.yaml")
    plan = make_plan(desc, PolicyConfig(recipe="rowwise", backend="torchao", overrides=(experts_blockwise,)))
    # blockwise experts take TE's GroupedLinear, measured the fastest blockwise expert path on sm90 at this shape
    assert (plan.decision("layers.0.moe.experts.w13").backend, plan.decision("layers.0.moe.experts.w13").recipe) == ("te", "blockwise")
    assert plan.decision("layers.0.wo").backend == "torchao"
    everything_blockwise = Override(recipe="blockwise", source="r.yaml")
    with pytest.raises(PlanError, match="layers.0.wo.*blockwise.*te"):
        make_plan(desc, PolicyConfig(recipe="rowwise", backend="torchao", overrides=(everything_blockwise,)))


@pytest.mark.parametrize("recipe,expected", [("delayed", "hybrid"), ("tensorwise", "hybrid"), ("rowwise", "e4m3"),
                                             ("rowwise_gw_hp", "e4m3"), ("blockwise", "e4m3")])
def test_unset_fp8_format_takes_the_recipes_library_default(recipe, expected):
    from fp8stack.plan import description_from_dict
    desc = description_from_dict({"name": "m", "seq_len": 128, "layers": [{"block": "d"}],
                                  "blocks": {"d": [{"name": "w", "kind": "linear", "n": 4096, "k": 4096}]}})
    assert make_plan(desc, PolicyConfig(recipe=recipe)).fp8_format == expected
    assert make_plan(desc, PolicyConfig(recipe=recipe, fp8_format="hybrid")).fp8_format == "hybrid"


def attention_model(head_dim: int = 128, num_layers: int = 3) -> ModelDescription:
    """`num_layers` dense layers of wqkv, an attention core of `head_dim`, wo."""
    return description_from_dict({
        "name": "attn", "seq_len": 4096,
        "blocks": {"dense": [{"name": "attention.wqkv", "kind": "linear", **BIG},
                             {"name": "attention.core", "kind": "attn_core", "n": 4096, "k": head_dim, "active": 64},
                             {"name": "attention.wo", "kind": "linear", **BIG}]},
        "layers": [{"block": "dense", "repeat": num_layers}],
    })


def test_attention_stays_bf16_by_default_saying_fp8_attention_is_opt_in():
    core = make_plan(attention_model(), PolicyConfig(recipe="delayed")).decision("layers.0.attention.core")
    assert (core.backend, core.recipe) == ("bf16", "bf16")
    assert core.reason.startswith(HIGH_PRECISION_REASONS["attn_core"])
    assert "opt-in, not default, until its 2000-step loss gate passes: --fp8-dot-product-attention" in core.reason
    bf16 = make_plan(attention_model(), PolicyConfig(recipe="bf16")).decision("layers.0.attention.core")
    assert bf16.reason == HIGH_PRECISION_REASONS["attn_core"]  # nothing to opt into without FP8


@pytest.mark.parametrize("recipe, arch", [("delayed", 90), ("delayed", 100), ("tensorwise", 100), ("mxfp8", 100)])
def test_fp8_attention_puts_attention_cores_on_te_in_the_plans_recipe(recipe, arch):
    plan = make_plan(attention_model(), PolicyConfig(recipe=recipe, backend="te", arch=arch, fp8_attention=True))
    cores = [d for d in plan.decisions if d.component.kind == "attn_core"]
    assert {(d.backend, d.recipe, d.precision) for d in cores} == {("te", recipe, "fp8")}
    assert "TE's FP8 dot-product attention" in cores[0].reason and "fp8_dpa" in cores[0].reason
    assert "opt-in" in cores[0].reason and recipe in cores[0].reason
    summary = plan.summary()  # every GEMM, the cores included, runs in FP8 now
    assert summary["flops_share_by_precision"] == {"fp8": 1.0} and summary["fp8_gemms"] == 9


def test_fp8_attention_keeps_the_first_and_last_layers_attention_bf16():
    plan = make_plan(attention_model(), PolicyConfig(recipe="delayed", fp8_attention=True, first_last_layers_bf16=True))
    assert [plan.decision(f"layers.{i}.attention.core").recipe for i in range(3)] == ["bf16", "delayed", "bf16"]


@pytest.mark.parametrize("cfg, message", [
    ({"recipe": "bf16"}, "fp8_attention runs attention in FP8 under an FP8 recipe, and the recipe is bf16: pass "
                         "--fp8-recipe with one of delayed (sm90+), tensorwise (sm100+), mxfp8 (sm100+), or drop"),
    ({"recipe": "blockwise"}, "recipe blockwise has no FP8 attention (TE's FP8 dot-product attention runs under "
                              "delayed (sm90+), tensorwise (sm100+), mxfp8 (sm100+)): pick one of those or drop"),
    ({"recipe": "rowwise"}, "recipe rowwise has no FP8 attention"),
    ({"recipe": "rowwise_gw_hp"}, "recipe rowwise_gw_hp has no FP8 attention"),
    ({"recipe": "tensorwise", "backend": "te"}, "TE's FP8 attention under recipe tensorwise needs sm100+ (its fused "
                                                "cuDNN kernel) and the target is sm90"),
    ({"recipe": "delayed", "arch": 89}, "TE's FP8 attention under recipe delayed needs sm90+"),
    ({"recipe": "tensorwise", "arch": 100}, "fp8_attention is TransformerEngine's FP8 dot-product attention (torchao "
                                            "has none), and recipe tensorwise with backend auto runs the linears on "
                                            "torchao: pass --backend te"),
    ({"recipe": "delayed", "fp8_attention": 1}, "fp8_attention must be true or false, got 1"),
])
def test_fp8_attention_is_refused_where_te_has_none_naming_the_recipes_that_do(cfg, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        PolicyConfig(**{"fp8_attention": True, **cfg})


@pytest.mark.parametrize("head_dim, arch, message", [
    (64, 90, "layers.0.attention.core: on sm90 TE's fused FP8 attention trains head dim 128 only, and this model's is "
             "64: drop --fp8-dot-product-attention for attn"),
    (256, 100, "on sm100 TE's fused FP8 attention trains head dims that are multiples of 16 up to 128, not 256"),
    (72, 100, "multiples of 16 up to 128, not 72"),
])
def test_fp8_attention_refuses_head_dims_tes_fused_kernel_does_not_train(head_dim, arch, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        make_plan(attention_model(head_dim), PolicyConfig(recipe="delayed", arch=arch, fp8_attention=True))
    assert make_plan(attention_model(64), PolicyConfig(recipe="delayed", arch=100, fp8_attention=True)).decision(
        "layers.0.attention.core").recipe == "delayed"


def test_overrides_on_fp8_attention_cores_keep_them_bf16_or_are_refused():
    keep = Override(fqn="layers.1.attention.core", backend="bf16", reason="watch layer 1")
    plan = make_plan(attention_model(), PolicyConfig(recipe="delayed", fp8_attention=True, overrides=(keep,)))
    assert [plan.decision(f"layers.{i}.attention.core").recipe for i in range(3)] == ["delayed", "bf16", "delayed"]
    assert "watch layer 1" in plan.decision("layers.1.attention.core").reason
    blockwise = Override(fqn="layers.*.attention.core", recipe="blockwise", reason="blockwise cores")
    with pytest.raises(PlanError, match=re.escape("override: blockwise cores on layers.0.attention.core: FP8 attention "
                                                  "runs on TE under delayed (sm90+)")):
        make_plan(attention_model(), PolicyConfig(recipe="delayed", fp8_attention=True, overrides=(blockwise,)))
