"""fp8stack.megatron on CPU: per-layer precision from plans (dense, MoE, first/last BF16, MoE-only), megatron
flag mapping, block specs with megatron's local modules, and forward + backward of a tiny GPTModel built
from them. TE specs and FP8 layers run in tests/gpu/test_megatron_gpu.py.

The GPTModels run on CPU through the two test-only shims of the conftest fixture cpu_megatron.
"""

from types import SimpleNamespace

import pytest
import torch

from fp8stack.assembly import OrderingError
from fp8stack.megatron import apply_plan_to_megatron, block_spec, layer_precisions, plan_from_megatron_args
from fp8stack.megatron.precision import PlanPrecision, with_precision
from fp8stack.plan import PlanError, PolicyConfig, make_plan
from fp8stack.plan.from_megatron import describe_transformer_config

from megatron.core.enums import Fp8Recipe
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

pytestmark = pytest.mark.filterwarnings(
    "ignore:full scope is deprecated", "ignore:MLP requires ffn_hidden_size", "ignore:Using a large number of experts",
    "ignore:.*tp_group is None", "ignore:Apex is not installed")

VOCAB, SEQ = 128, 32
# Models built here use learned positions: megatron's RoPE moves its frequencies to torch.cuda.current_device().
SMALL = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, gated_linear_unit=True,
             normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, bf16=False)


def dense(**changes) -> TransformerConfig:
    return TransformerConfig(**{"num_layers": 4, **SMALL, **changes})


def moe(**changes) -> TransformerConfig:
    return TransformerConfig(**{"num_layers": 4, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64,
                                "moe_shared_expert_intermediate_size": 64, "moe_layer_freq": [0, 1, 1, 1],
                                **SMALL, **changes})


def plan_for(config, recipe="tensorwise", **policy):
    description = describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ)
    return make_plan(description, PolicyConfig(recipe=recipe, backend="te", small_gemm_filter="off", **policy))


# --- which layers (and GEMMs) enter FP8 -----------------------------------------------------------

def test_dense_plan_puts_every_layer_in_one_fp8_context():
    precisions = layer_precisions(dense(), plan_for(dense()))
    assert [(p.recipe, p.exceptions) for p in precisions] == [("tensorwise", ())] * 4


def test_first_last_layers_bf16_leave_the_outer_layers_out_of_fp8():
    config = dense(num_layers=5)
    precisions = layer_precisions(config, plan_for(config, first_last_layers_bf16=True,
                                                   num_layers_at_end_in_bf16=2))
    assert [p.recipe for p in precisions] == [None, "tensorwise", "tensorwise", None, None]


def test_moe_blockwise_experts_run_in_their_layers_context():
    config = moe(hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128)
    precisions = layer_precisions(config, plan_for(config, recipe="blockwise", expert_backend="te"))
    assert [p.recipe for p in precisions] == ["blockwise"] * 4
    assert all(p.exceptions == () for p in precisions)  # grouped_fp8 experts run on TE blockwise, like the rest


def with_flags(config, **flags) -> SimpleNamespace:
    """`config` with megatron FP8 flags set by attribute: megatron refuses an FP8 MoE TransformerConfig without TE."""
    return SimpleNamespace(**{**vars(config), **flags})


def test_moe_only_plan_keeps_attention_bf16_inside_fp8_moe_layers():
    config = with_flags(moe(), fp8="hybrid", fp8_recipe="tensorwise")
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, moe_only=True)
    precisions = layer_precisions(config, plan)
    assert precisions[0].recipe is None and precisions[0].exceptions == ()  # the dense layer: all BF16
    for p in precisions[1:]:
        assert p.recipe == "tensorwise"
        assert dict(p.exceptions) == {"self_attention.linear_qkv": None, "self_attention.linear_proj": None}


def test_torchao_decisions_are_refused_for_megatron():
    config = dense()
    plan = make_plan(describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ),
                     PolicyConfig(recipe="rowwise", small_gemm_filter="off"))
    with pytest.raises(PlanError, match="megatron-core runs FP8 through TransformerEngine only"):
        layer_precisions(config, plan)


def test_a_plan_for_another_config_is_refused():
    with pytest.raises(PlanError, match="does not describe this TransformerConfig"):
        layer_precisions(dense(ffn_hidden_size=256), plan_for(dense()))


# --- megatron flags -> plan -----------------------------------------------------------------------

def test_flags_are_read_off_the_config():
    config = with_flags(moe(hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=128,
                            moe_shared_expert_intermediate_size=128),
                        fp8="e4m3", fp8_recipe=Fp8Recipe.blockwise, first_last_layers_bf16=True, moe_grouped_gemm=True)
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ)
    assert (plan.recipe, plan.fp8_format) == ("blockwise", "e4m3")
    assert plan.decision("decoder.layers.0.self_attention.linear_qkv").backend == "bf16"
    expert = plan.decision("decoder.layers.1.mlp.experts.linear_fc1")
    assert (expert.backend, expert.recipe) == ("te", "blockwise")
    assert "TEGroupedMLP" in expert.reason
    assert plan.decision("decoder.layers.3.mlp.experts.linear_fc2").backend == "bf16"


def test_explicit_flags_override_the_config_and_no_fp8_is_a_bf16_plan():
    config = dense()
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, fp8="hybrid", fp8_recipe="delayed")
    assert plan.recipe == "delayed"
    assert {d.backend for d in plan.decisions if d.component.kind == "linear"} == {"te"}
    bf16 = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ)
    assert bf16.recipe == "bf16" and {d.backend for d in bf16.decisions} == {"bf16"}


def test_megatron_converts_small_linears_too():
    config = dense(hidden_size=32, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2)
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, fp8="hybrid", fp8_recipe="tensorwise")
    assert plan.decision("decoder.layers.1.mlp.linear_fc2").backend == "te"  # no size filter, as megatron


@pytest.mark.parametrize("flags, message", [
    (dict(fp8="hybrid", fp8_recipe="custom"), "--fp8-recipe 'custom'"),
    (dict(fp8="e5m2"), "--fp8-format 'e5m2'"),
    (dict(fp8="hybrid", fp8_format="e4m3"), "name one flag"),
])
def test_bad_flags(flags, message):
    with pytest.raises(PlanError, match=message):
        plan_from_megatron_args(dense(), vocab_size=VOCAB, seq_len=SEQ, **flags)


# --- specs and models on CPU (megatron's local modules, BF16 plans) ----------------------------------

def test_cpu_falls_back_to_local_modules_and_refuses_fp8_plans(model_parallel):
    config = dense(fp8="hybrid", fp8_recipe="tensorwise")
    with pytest.raises(PlanError, match=r"layers \[0, 1, 2, 3\] in FP8, but TransformerEngine with CUDA is not avail"):
        block_spec(config, plan_for(config))
    with pytest.raises(PlanError, match="use_te=False asks for megatron's local modules"):
        block_spec(config, plan_for(config), use_te=False)


def test_fp8_plan_needs_config_fp8(model_parallel):
    config = dense()
    with pytest.raises(PlanError, match="config.fp8 is unset: set config.fp8='hybrid'"):
        block_spec(config, plan_for(config), use_te=True)


def test_a_plan_with_the_head_on_te_is_refused(model_parallel):
    config = dense(fp8="hybrid", fp8_recipe="tensorwise")
    with pytest.raises(PlanError, match="megatron's output layer stays its own ColumnParallelLinear.*drop head_on_te"):
        block_spec(config, plan_for(config, head_on_te=True), use_te=True)


def test_bf16_spec_for_moe_uses_megatron_local_modules(model_parallel):
    config = moe()
    spec = block_spec(config, plan_for(config, recipe="bf16"))
    assert len(spec.layer_specs) == 4
    for layer in spec.layer_specs:
        assert issubclass(layer.module, TransformerLayer) and layer.module.plan_fp8_recipe is None
        assert layer.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert spec.layer_specs[1].submodules.mlp.keywords["submodules"].experts.func is SequentialMLP


def train_step(model, seed=0):
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]  # True = masked; megatron's default mask is made on CUDA
    loss = model(tokens, position_ids, causal, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    return loss


def build(config, plan):
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=block_spec(config, plan), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="learned_absolute")


def test_factory_spec_dense_gpt_trains_on_cpu(cpu_megatron):
    config = dense()
    model = build(config, plan_for(config, recipe="bf16"))
    assert all(isinstance(layer, PlanPrecision) for layer in model.decoder.layers)
    loss = train_step(model)
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_factory_spec_moe_gpt_builds_on_cpu(cpu_megatron):
    # Built only: megatron's TopKRouter.gating moves its weight to CUDA on every forward (no third shim here);
    # tests/gpu/test_megatron_gpu.py trains MoE models.
    model = build(moe(), plan_for(moe(), recipe="bf16"))
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["BF16TransformerLayer"] * 4
    assert isinstance(model.decoder.layers[1].mlp.experts, SequentialMLP)


def test_apply_plan_to_built_model_matches_the_factory(cpu_megatron):
    config = dense(num_layers=2)
    plan = plan_for(config, recipe="bf16")
    torch.manual_seed(0)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"), vocab_size=VOCAB,
        max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    before = train_step(model).item()
    model.zero_grad()
    assert apply_plan_to_megatron(model, plan) is model
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["BF16TransformerLayer"] * 2
    assert train_step(model).item() == before  # same modules, same parameters
    with pytest.raises(OrderingError, match="already runs a plan"):
        apply_plan_to_megatron(model, plan)


def test_apply_refuses_wrapped_models(cpu_megatron):
    config = dense(num_layers=2)
    spec = block_spec(config, plan_for(config, recipe="bf16"))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(model))
    with pytest.raises(OrderingError, match="already wrapped"):
        apply_plan_to_megatron(wrapped, plan_for(config, recipe="bf16"))


def test_with_precision_is_one_class_per_choice():
    a = with_precision(ColumnParallelLinear, "blockwise", "e4m3")
    assert a is with_precision(ColumnParallelLinear, "blockwise", "e4m3")
    assert a.__name__ == "FP8BlockwiseColumnParallelLinear" and issubclass(a, ColumnParallelLinear)
    with pytest.raises(PlanError, match="no megatron-core/TransformerEngine implementation"):
        with_precision(ColumnParallelLinear, "rowwise", "e4m3")
