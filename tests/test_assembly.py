"""assemble(): stages in order, stamps, OrderingError for every order or combination that would train
wrong, the precompute warning and the post-optimizer-step hook. CPU; FSDP and DTensor on a 1-rank
gloo group."""

import copy
import re
import logging
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torchao.float8.float8_linear import Float8Linear

from fp8stack.models import load_model_config
import fp8stack
from fp8stack import OrderingError, PolicyConfig, assemble, load_description, make_plan
from fp8stack.assembly import (AssemblyState, AssemblyWarning, _with_parallel_options, after_checkpoint_load, apply_ac,
                               apply_compile, apply_fp8, apply_fsdp, apply_tp, assembly_state, post_optimizer_step_hook)
from fp8stack.backends import Backend, BackendUnavailable
from fp8stack.backends.bf16 import BF16Backend
from fp8stack.models import Llama
from fp8stack.models.llama import tensor_parallel_plan
from fp8stack.plan import Component, Decision, Plan
from fp8stack.plan.parallel import TensorParallelPlan
from fp8stack.runtime import checkpoint_module
from fp8stack.runtime.recompute import CheckpointWrapper

FIX = re.escape("call assemble(model, plan, ...) on a freshly built model")


def tiny_plan(recipe: str = "tensorwise", model: str = "tiny"):
    return make_plan(load_description(model), PolicyConfig(recipe=recipe, small_gemm_filter="off"))


@pytest.fixture
def model() -> Llama:
    return Llama(load_model_config("tiny"))


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))


def test_exported_from_the_package():
    assert fp8stack.OrderingError is OrderingError and fp8stack.assemble is assemble
    assert fp8stack.after_checkpoint_load is after_checkpoint_load and "after_checkpoint_load" in fp8stack.__all__


# --- the stamps ----------------------------------------------------------------------------------

def test_assemble_runs_and_stamps_the_stages_in_order(model, mesh):
    out = assemble(model, tiny_plan(), recompute=[1, 3], compile=True, fsdp_mesh=mesh)
    state = assembly_state(out)
    assert out is model
    assert state.stages == ["convert_fp8", "recompute", "compile", "fully_shard"]
    assert [r.backend for r in state.conversions] == ["torchao", "bf16"]  # bf16 last: it names what the others left
    assert state.conversions[0].converted["layers.0.attention.wqkv"] == "Float8Linear"
    assert [isinstance(block, CheckpointWrapper) for block in out.layers] == [False, True, False, True]
    assert all(block._compiled_call_impl is not None and isinstance(block, FSDPModule) for block in out.layers)
    assert isinstance(out, FSDPModule)
    assert "layers.1.attention.wqkv.weight" in out.state_dict()  # recompute and compile keep the names


def test_each_stage_can_run_alone(model):
    model = apply_fp8(model, tiny_plan())
    apply_compile(model)
    assert assembly_state(model).stages == ["convert_fp8", "compile"]


def test_a_swapped_root_carries_the_stamps():
    root = nn.Linear(64, 32)
    decision = Decision(Component("", "linear", 32, 64), "torchao", "tensorwise", "test")
    out = assemble(root, Plan(model="linear", recipe="tensorwise", fp8_format="hybrid", arch=90, decisions=(decision,)))
    assert isinstance(out, Float8Linear) and out.weight is root.weight
    assert assembly_state(out).stages == ["convert_fp8"] and assembly_state(root).stages == []


def test_an_untouched_model_has_no_stamps(model):
    assert assembly_state(model) == AssemblyState()


def test_recompute_keeps_the_numbers_bit_exact(model, batch):
    """torchao's dynamic scales are recomputed from the same inputs: checkpointing changes nothing."""
    plain = apply_fp8(copy.deepcopy(model), tiny_plan())
    recomputed = assemble(model, tiny_plan(), recompute="all")
    for m in (plain, recomputed):
        Llama.loss(m(batch[:, :-1]), batch[:, 1:]).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_recompute_rejects_unknown_blocks(model):
    with pytest.raises(ValueError, match="recompute names block"):
        apply_ac(model, [7])


def test_checkpoint_module_uses_torch_checkpoint_without_te():
    wrapped = checkpoint_module(nn.Linear(4, 4), fp8_active=True)
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert isinstance(wrapped, CheckpointWrapper) and x.grad is not None


# --- OrderingError: stages out of order ----------------------------------------------------------

def _stage_calls(mesh):
    plan = tiny_plan()
    return {
        "convert_fp8": lambda m: apply_fp8(m, plan),
        "tensor_parallel": lambda m: apply_tp(m, mesh, TensorParallelPlan(outside={}, block={})),
        "recompute": lambda m: apply_ac(m, "all"),
        "compile": apply_compile,
        "fully_shard": lambda m: apply_fsdp(m, mesh),
    }


@pytest.mark.parametrize(("first", "then"), [
    ("recompute", "convert_fp8"),
    ("compile", "convert_fp8"),
    ("fully_shard", "convert_fp8"),
    ("compile", "recompute"),
    ("fully_shard", "recompute"),
    ("fully_shard", "compile"),
    ("compile", "tensor_parallel"),
    ("fully_shard", "tensor_parallel"),
])
def test_a_stage_after_a_later_one_raises(first, then, model, mesh):
    calls = _stage_calls(mesh)
    calls[first](model)
    with pytest.raises(OrderingError, match=f"{then} must run before {first}, but {first} has already been applied"
                                            f".*{FIX}"):
        calls[then](model)


@pytest.mark.parametrize("stage", ["convert_fp8", "recompute", "compile", "fully_shard"])
def test_a_stage_twice_raises(stage, model, mesh):
    call = _stage_calls(mesh)[stage]
    call(model)
    with pytest.raises(OrderingError, match=f"{stage} has already been applied to this model.*each stage runs once"):
        call(model)


def test_assemble_twice_raises(model):
    model = assemble(model, tiny_plan())
    with pytest.raises(OrderingError, match="convert_fp8 has already been applied"):
        assemble(model, tiny_plan())


# --- OrderingError: conversion meets a model changed by hand (no stamps) -------------------------

def _compile_in_place(model):
    model.layers[0].compile()


def _compile_wrapped(model):
    model.layers.register_module("0", torch.compile(model.layers[0]))


def _checkpoint_by_hand(model):
    model.layers.register_module("2", checkpoint_module(model.layers[2], fp8_active=False))


@pytest.mark.parametrize(("change", "stage", "evidence"), [
    (_compile_in_place, "compile", "'layers.0' is compiled"),
    (_compile_wrapped, "compile", "'layers.0' is compiled"),
    (_checkpoint_by_hand, "recompute", "'layers.2' is wrapped for activation checkpointing"),
])
def test_conversion_after_hand_made_changes_raises(change, stage, evidence, model):
    change(model)
    with pytest.raises(OrderingError, match=f"convert_fp8 must run before {stage}.*{evidence}"):
        apply_fp8(model, tiny_plan())


def test_conversion_after_fully_shard_by_hand_raises(model, mesh):
    fully_shard(model, mesh=mesh)
    with pytest.raises(OrderingError, match="convert_fp8 must run before fully_shard.*FSDPModule"):
        apply_fp8(model, tiny_plan())


def test_conversion_after_tensor_parallel_by_hand_raises(model, mesh):
    parallelize_module(model, mesh, {"layers.0.attention.wqkv": ColwiseParallel()})
    with pytest.raises(OrderingError, match="convert_fp8 must run before tensor_parallel.*"
                                            "'layers.0.attention.wqkv.weight' is already a DTensor"):
        apply_fp8(model, tiny_plan())


# --- OrderingError: combinations no order makes right --------------------------------------------

def test_fp8_all_gather_with_rowwise_raises(model, mesh):
    with pytest.raises(OrderingError, match="needs tensorwise weight scales.*rowwise.*--fp8-recipe tensorwise"):
        assemble(model, tiny_plan("rowwise"), fsdp_mesh=mesh, fsdp_float8_all_gather=True)
    assert assembly_state(model).stages == []


def test_fused_wgrad_accumulation_with_fsdp_raises_naming_te_and_the_fixes(model, mesh):
    options = {"te": {"fuse_wgrad_accumulation": True}}
    with pytest.raises(OrderingError, match=r"outside autograd, and fully_shard \(FSDP2\) reduce-scatters autograd's "
                                            r"gradients.*pass fsdp_reshard_after_forward=False.*use DDP \(fp8stack."
                                            r"precision.MasterWeights\(model, data_parallel=...\)\) or model_impl "
                                            r"megatron, or turn"):
        assemble(model, tiny_plan("delayed"), fsdp_mesh=mesh, backend_options=options)
    assert assembly_state(model).stages == []


def test_fused_wgrad_accumulation_with_tensor_parallelism_raises(model, mesh):
    options = {"te": {"fuse_wgrad_accumulation": True}}
    with pytest.raises(OrderingError, match="main_grad buffers, which tensor parallelism does not shard or reduce"):
        assemble(model, tiny_plan("delayed"), tp_mesh=mesh, tp_plan=TensorParallelPlan(outside={}, block={}),
                 backend_options=options)
    assert assembly_state(model).stages == []


@pytest.mark.parametrize("asked", [{}, {"fuse_wgrad_accumulation": None}], ids=["unset", "none"])
def test_fused_wgrad_accumulation_left_to_auto_is_off_when_distributed(asked):
    options = _with_parallel_options(tiny_plan("delayed"), {"te": asked}, distributed=True, fully_sharded=False,
                                     precompute_fp8_scales=False)
    assert options["te"]["fuse_wgrad_accumulation"] is False


def test_delayed_amaxes_stay_local_where_ranks_quantize_whole_weights_and_are_reduced_for_sharded_fp8_weights():
    """te local_amax left unset: local in one process, under DDP and under FSDP2 with BF16 parameters (each rank
    quantizes whole weights: no all-reduce per module and pass), reduced over the ranks for FP8 weights under FSDP2
    (their shards share one scale); asked for, as asked."""
    from fp8stack.backends.te import TEBackend

    def local(fully_sharded: bool, **te) -> bool:
        options = _with_parallel_options(tiny_plan("delayed"), {"te": te}, distributed=fully_sharded,
                                         fully_sharded=fully_sharded, precompute_fp8_scales=False)
        return TEBackend(**options["te"]).keeps_amax_local

    assert local(False) and local(True) and local(False, fp8_weights=True)
    assert not local(True, fp8_weights=True)
    assert not local(False, local_amax=False) and local(True, local_amax=True)


def test_fp8_all_gather_without_fsdp_raises(model):
    with pytest.raises(OrderingError, match="fsdp_float8_all_gather=True needs fully_shard: pass fsdp_mesh"):
        assemble(model, tiny_plan(), fsdp_float8_all_gather=True)


def test_fp8_all_gather_without_float8_layers_raises(model, mesh):
    with pytest.raises(OrderingError, match="no torchao Float8Linear layers"):
        assemble(model, tiny_plan("bf16"), fsdp_mesh=mesh, fsdp_float8_all_gather=True)


def test_the_llama_tp_plan_refuses_fused_projections_naming_the_fix(model):
    with pytest.raises(NotImplementedError, match=r"layers\.0\.attention\.wqkv \(fused q, k and v\).*Fix: build the "
                                                  r"model with separate projections: LlamaConfig\(fused_projections="
                                                  r"False\), or --no-fused-projections"):
        tensor_parallel_plan(model, 1)


def test_the_llama_tp_plan_refuses_experts():
    model = Llama(replace(load_model_config("tiny-moe"), fused_projections=False))
    with pytest.raises(NotImplementedError, match=r"layers\.1\.moe: experts need expert parallelism"):
        tensor_parallel_plan(model, 1)


def test_tp_needs_the_models_plan_with_the_mesh(model, mesh):
    with pytest.raises(ValueError, match="needs both tp_mesh and tp_plan"):
        assemble(model, tiny_plan(), tp_mesh=mesh)
    assert assembly_state(model).stages == []


# --- conversion stage: backends ------------------------------------------------------------------

def test_conversion_never_falls_back_to_bf16(model):
    with pytest.raises(BackendUnavailable, match="on te: TransformerEngine"):
        apply_fp8(model, tiny_plan("delayed"))
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_options_for_a_backend_the_plan_does_not_use_raise(model):
    with pytest.raises(ValueError, match="backend options for te, which the plan does not use"):
        apply_fp8(model, tiny_plan(), backend_options={"te": {"delayed_margin": 1}})


def test_bf16_backend_changes_nothing_and_records_every_component():
    model = Llama(load_model_config("tiny-moe"))
    plan = tiny_plan("bf16", model="tiny-moe")
    before = dict(model.named_modules())
    out, record = BF16Backend().convert(model, list(plan.decisions), plan)
    assert out is model and dict(model.named_modules()) == before
    assert record.converted.keys() == {d.fqn for d in plan.decisions}
    assert record.converted["layers.0.attention.core"] == "AttentionCore"
    assert record.converted["layers.1.moe.experts.w13"] == "GroupedExperts.w13"
    assert record.converted["output"] == "Linear"


def test_bf16_backend_refuses_a_plan_for_another_model():
    plan = tiny_plan("bf16")
    with pytest.raises(ValueError, match="the plan names 'tok_embeddings' but Sequential has no such module"):
        BF16Backend().convert(nn.Sequential(nn.Linear(4, 4)), list(plan.decisions), plan)


# --- precompute warning and the post-optimizer-step hook -----------------------------------------

def test_precompute_without_fsdp_warns_loudly(model, caplog):
    with pytest.warns(AssemblyWarning, match="precompute_fp8_scales=True has no effect"):
        with caplog.at_level(logging.WARNING, logger="fp8stack.assembly"):
            model = assemble(model, tiny_plan(), precompute_fp8_scales=True)
    assert "precompute_fp8_scales=True has no effect" in caplog.text
    assert post_optimizer_step_hook(model).__name__ == "_do_nothing"


def test_precompute_without_fp8_all_gather_warns(model, mesh):
    with pytest.warns(AssemblyWarning, match="fsdp_float8_all_gather=True"):
        assemble(model, tiny_plan(), fsdp_mesh=mesh, precompute_fp8_scales=True)


def _float8_weights(model):
    return [m.weight._local_tensor for m in model.modules() if isinstance(m, Float8Linear)]


def test_the_hook_precomputes_scales_when_it_applies(model, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error", AssemblyWarning)
        model = assemble(model, tiny_plan(), fsdp_mesh=mesh, fsdp_float8_all_gather=True, precompute_fp8_scales=True)
    weights = _float8_weights(model)
    assert len(weights) == 16 and all(w._precomputed_scale is None for w in weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(post_optimizer_step_hook(model))
    optimizer.step()
    for w in weights:
        expected = torch.finfo(torch.float8_e4m3fn).max / w._tensor.abs().max().double()
        torch.testing.assert_close(w._precomputed_scale, expected.float())


def test_the_hook_does_nothing_when_precompute_is_not_asked(model, mesh):
    model = assemble(model, tiny_plan(), fsdp_mesh=mesh, fsdp_float8_all_gather=True)
    hook = post_optimizer_step_hook(model)
    hook()
    assert hook.__name__ == "_do_nothing"
    assert all(w._precomputed_scale is None for w in _float8_weights(model))


# --- after a checkpoint load --------------------------------------------------------------------

def test_after_checkpoint_load_asks_each_backend_of_the_assembly_once(model, mesh, monkeypatch):
    model = assemble(model, tiny_plan(), compile=True, fsdp_mesh=mesh)  # the state is found on the sharded root
    asked = []
    monkeypatch.setattr(Backend, "after_checkpoint_load", lambda backend, m: asked.append((backend.name, m)))
    after_checkpoint_load(model)
    assert asked == [("torchao", model), ("bf16", model)]


def test_after_checkpoint_load_asks_no_backend_of_a_model_fp8stack_did_not_assemble(model, monkeypatch):
    asked = []
    monkeypatch.setattr(Backend, "after_checkpoint_load", lambda backend, m: asked.append(backend.name))
    after_checkpoint_load(model)
    assert asked == [] and assembly_state(model).stages == []


def test_a_plan_made_for_other_shapes_is_refused_before_any_module_changes():
    other = Llama(replace(load_model_config("tiny"), ffn_dim=512))
    with pytest.raises(fp8stack.PlanError, match=r"sizes layers.0.feed_forward.w13 as 1536 x 256, but this Llama's "
                                                 r"is 1024 x 256: make the plan from this model"):
        apply_fp8(other, tiny_plan())
    assert assembly_state(other).stages == [] and not any(isinstance(m, Float8Linear) for m in other.modules())


def test_weights_prepared_for_fp8_all_gather_refuse_to_run_without_fully_shard(model, mesh):
    model = apply_fp8(model, tiny_plan(), fsdp_float8_all_gather=True)
    apply_compile(model)
    tokens = torch.randint(0, 256, (1, 8))
    with pytest.raises(OrderingError, match="runs without fully_shard: apply_fsdp \\(after compile\\)"):
        model(tokens)
    apply_fsdp(model, mesh)
    model(tokens)  # sharded: runs, and the check is gone
    assert "_fp8stack_needs_fsdp" not in model.__dict__
