"""The te backend on a machine without TransformerEngine (or without CUDA): it imports, says why it
cannot run, refuses plans that need it with the fix, and checks plans before looking for TE."""

import importlib.util

import pytest
import torch

from fp8stack.models import load_model_config
from fp8stack.backends import BackendUnavailable, get_backend
from fp8stack.backends.te import INSTALL_HINT, TEBackend, te_recipe
from fp8stack.models import Llama, LlamaConfig
from fp8stack.plan import Override, PlanError, PolicyConfig, load_description, make_plan

TE_RUNS_HERE = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
needs_no_te = pytest.mark.skipif(TE_RUNS_HERE, reason="TransformerEngine runs here; tests/gpu covers this machine")


def te_plan(model: str = "tiny", **policy):
    settings = {"recipe": "delayed", "small_gemm_filter": "off", **policy}
    return make_plan(load_description(model), PolicyConfig(**settings))


def meta_llama(config: LlamaConfig) -> Llama:
    with torch.device("meta"):
        return Llama(config)


@needs_no_te
def test_unavailable_with_reason():
    ok, reason = TEBackend().available()
    assert not ok
    assert "TransformerEngine" in reason
    if importlib.util.find_spec("transformer_engine") is None:
        assert INSTALL_HINT in reason
    else:
        assert "CUDA" in reason


@needs_no_te
def test_te_recipe_without_te_names_the_fix():
    with pytest.raises(BackendUnavailable, match="fp8stack\\[gpu\\]|CUDA"):
        te_recipe("delayed", "hybrid")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "nope"])
def test_te_recipe_rejects_recipes_te_does_not_have(recipe):
    with pytest.raises(PlanError, match="no TransformerEngine implementation.*--backend torchao"):
        te_recipe(recipe, "hybrid")


def test_a_bf16_plan_on_te_has_no_te_recipe():
    assert te_recipe("bf16", "hybrid") is None  # its modules run with TE's FP8 autocast off


def test_only_fp8_recipes_ask_te_for_fp8_support():
    from fp8stack.backends.te import _support_checks

    plan = te_plan(recipe="bf16", backend="te")
    recipes = sorted({d.recipe for d in plan.for_backend("te")})
    assert recipes == ["bf16"]
    assert _support_checks(recipes) == {}  # a bf16 plan on te runs on a GPU without FP8 (Ampere)
    assert _support_checks(()) == {}  # no recipe named: only that TE imports with CUDA
    assert _support_checks(["bf16", "delayed", "blockwise"]) == {
        "delayed": "is_fp8_available", "blockwise": "is_fp8_block_scaling_available"}
    with pytest.raises(PlanError, match="'rowwise' has no TransformerEngine implementation"):
        _support_checks(["rowwise"])


def test_te_recipe_rejects_formats_te_does_not_train_with():
    with pytest.raises(PlanError, match="e5m2.*use e4m3 or hybrid"):
        te_recipe("tensorwise", "e5m2")


@needs_no_te
def test_convert_refuses_te_decisions_with_the_fix():
    plan = te_plan()
    decisions = plan.for_backend("te")
    assert decisions, "the tiny delayed plan should put its linears on te"
    model = meta_llama(load_model_config("tiny"))
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(BackendUnavailable, match=f"runs {len(decisions)} component\\(s\\) on TransformerEngine"):
        get_backend("te").convert(model, decisions, plan)
    assert {name: type(m) for name, m in model.named_modules()} == before


def test_convert_without_decisions_needs_nothing():
    model = meta_llama(load_model_config("tiny"))
    plan = make_plan(load_description("tiny"), PolicyConfig(recipe="bf16"))
    converted, record = TEBackend().convert(model, plan.for_backend("te"), plan)
    assert converted is model
    assert record.backend == "te" and record.converted == {}


def test_get_backend_passes_options():
    backend = get_backend("te", delayed_margin=2)
    assert isinstance(backend, TEBackend) and backend.delayed_margin == 2 and backend.name == "te"
    assert TEBackend().cache_fp8_weights, "cast once per step: safe by default, recast after any optimizer step"
    assert TEBackend().fuse_wgrad_accumulation is None, "auto: on where it can be"
    # A user's own DDP loop gets per-process amaxes (no all-reduce per module and pass) without asking; weights held
    # in FP8 keep TE's reduction, as fully_shard may gather their shards under one scale.
    assert TEBackend().keeps_amax_local and not TEBackend(fp8_weights=True).keeps_amax_local
    assert not TEBackend(local_amax=False).keeps_amax_local
    assert TEBackend(local_amax=True, fp8_weights=True).keeps_amax_local


def test_experts_split_across_backends_are_refused_before_looking_for_te():
    override = Override(fqn="layers.*.moe.experts.w2", backend="bf16", reason="test")
    plan = te_plan("tiny-moe", overrides=(override,))
    decisions = plan.for_backend("te")
    assert any(d.fqn.endswith("experts.w13") for d in decisions)
    with pytest.raises(PlanError, match="w13 runs on te/delayed but w2 on bf16/bf16.*experts\\.\\*"):
        TEBackend().convert(meta_llama(load_model_config("tiny-moe")), decisions, plan)


def test_fp8_weights_refuse_te_experts_before_looking_for_te():
    plan = te_plan("tiny-moe")
    with pytest.raises(PlanError, match="fp8_weights holds dense TE linears' weights in FP8.*param_dtype bf16"):
        TEBackend(fp8_weights=True).convert(meta_llama(load_model_config("tiny-moe")), plan.for_backend("te"), plan)


def test_decisions_for_another_backend_are_a_caller_error():
    plan = te_plan()
    with pytest.raises(ValueError, match="other backends"):
        TEBackend().convert(meta_llama(load_model_config("tiny")), plan.for_backend("bf16"), plan)


def test_a_delayed_margin_needs_a_delayed_plan_before_looking_for_te():
    plan = te_plan(recipe="tensorwise", backend="te")
    with pytest.raises(PlanError, match="delayed_margin=1 applies to delayed scaling.*recipes are bf16, tensorwise"):
        TEBackend(delayed_margin=1).convert(meta_llama(load_model_config("tiny")), plan.for_backend("te"), plan)


def test_te_recipe_refuses_fp8_attention_under_a_recipe_te_has_none_for():
    with pytest.raises(PlanError, match=r"'blockwise' has no FP8 attention in TransformerEngine.*delayed \(sm90"):
        te_recipe("blockwise", "e4m3", fp8_dpa=True)


def test_fp8_attention_cores_are_te_decisions_the_backend_takes():
    from fp8stack.backends.te import _validated

    plan = te_plan("llama-1b-like", fp8_attention=True)
    linears, experts, cores, recipes = _validated(plan.for_backend("te"), plan)
    assert [d.fqn for d in cores] == [f"layers.{i}.attention.core" for i in range(4)]
    assert recipes == ["bf16", "delayed"] and not experts and all(d.component.kind != "attn_core" for d in linears)
    kept = te_plan("llama-1b-like")
    assert all(d.component.kind != "attn_core" for d in kept.for_backend("te"))  # BF16 attention: the bf16 backend's
    alone = te_plan("llama-1b-like", fp8_attention=True, overrides=(
        Override(fqn="layers.*.attention.w*", backend="bf16"), Override(fqn="layers.*.feed_forward.*", backend="bf16")))
    with pytest.raises(PlanError, match="attention in delayed FP8 with no delayed linear on TE.*scales would stay 1"):
        _validated(alone.for_backend("te"), alone)


@needs_no_te
def test_fp8_attention_on_a_machine_without_te_is_refused_before_touching_the_model():
    config = LlamaConfig(dim=512, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=1024, vocab_size=256, seq_len=128)
    model = meta_llama(config)
    plan = make_plan(model, PolicyConfig(recipe="delayed", fp8_attention=True, small_gemm_filter="off"), seq_len=128)
    assert plan.decision("layers.0.attention.core").backend == "te"
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(BackendUnavailable, match="on TransformerEngine"):
        TEBackend().convert(model, plan.for_backend("te"), plan)
    assert {name: type(m) for name, m in model.named_modules()} == before
