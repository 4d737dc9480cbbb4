"""describe_transformer_config against GPTModels megatron-core really builds on CPU (local spec), and
against the hand-written YAML descriptions of the same architectures."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fp8stack.plan import PlanError, PolicyConfig, load_description, load_recipe_file, make_plan
from fp8stack.plan.from_megatron import describe_transformer_config

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

pytestmark = pytest.mark.filterwarnings(  # megatron's construction-time notices about the tiny configs
    "ignore:full scope is deprecated", "ignore:MLP requires ffn_hidden_size", "ignore:Using a large number of experts",
    "ignore:.*tp_group is None")

VOCAB, SEQ = 96, 32
SMALL = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, gated_linear_unit=True,
             normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True)


def build_gpt(config, monkeypatch) -> torch.nn.Module:
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:
        # megatron-core 0.19 cannot build MLA from the local spec: its DotProductAttention takes no
        # k_channels (MLA needs TE's attention); and MLA's rotary embedding asks CUDA for a device.
        # The attention core has no weights; swap in megatron's own IdentityOp and send the device
        # query to CPU. Every linear and norm is built by megatron as usual.
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = IdentityOp
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def assert_describes(description, model) -> None:
    """Every component names a module of `model` with its shape, and every module with weights is named."""
    modules = dict(model.named_modules())
    covered = set()
    for c in description.components:
        if c.kind == "attn_core":
            assert c.fqn in modules, c.fqn
            continue
        if c.kind == "expert":  # SequentialMLP: one MLP per expert under local_experts
            parent, gemm = c.fqn.rsplit(".", 1)
            experts = modules[parent].local_experts
            assert len(experts) == c.experts, c.fqn
            assert modules[parent.removesuffix("experts") + "router"].topk == c.active, c.fqn
            for j, expert in enumerate(experts):
                assert tuple(getattr(expert, gemm).weight.shape) == (c.n, c.k), c.fqn
                covered.add(f"{parent}.local_experts.{j}.{gemm}")
            continue
        expected = {"embedding": (c.k, c.n), "norm": (c.n,)}.get(c.kind, (c.n, c.k))
        assert tuple(modules[c.fqn].weight.shape) == expected, c.fqn
        covered.add(c.fqn)
    with_weights = {name for name, m in modules.items() if any(True for _ in m.parameters(recurse=False))}
    assert with_weights - covered == set()


def test_dense_gqa_with_qk_norm(model_parallel, monkeypatch):
    config = TransformerConfig(num_layers=2, num_query_groups=2, qk_layernorm=True, **SMALL)
    description = describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ, name="gqa")
    assert_describes(description, build_gpt(config, monkeypatch))
    assert {c.block for c in description.components if c.layer is not None} == {"dense"}
    core = next(c for c in description.components if c.kind == "attn_core")
    assert (core.n, core.k, core.active) == (SEQ, 16, 8)
    assert description.components[1].fqn == "decoder.layers.0.input_layernorm"


def test_moe_every_second_layer_with_shared_experts(model_parallel, monkeypatch):
    config = TransformerConfig(num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                               moe_shared_expert_intermediate_size=48, moe_layer_freq=2, **SMALL)
    description = describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ)
    assert_describes(description, build_gpt(config, monkeypatch))
    blocks = {c.layer: c.block for c in description.components if c.layer is not None}
    assert blocks == {0: "moe", 1: "dense", 2: "moe", 3: "dense"}
    fc1 = next(c for c in description.components if c.fqn == "decoder.layers.2.mlp.experts.linear_fc1")
    assert (fc1.kind, fc1.experts, fc1.active, fc1.n, fc1.k) == ("expert", 4, 2, 64, 64)


def mla_config(**changes) -> MLATransformerConfig:
    fields = dict(num_layers=3, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                  v_head_dim=16, qk_layernorm=True, rope_type="rope", num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1])
    return MLATransformerConfig(**{**SMALL, **fields, **changes})


def test_mla_with_dense_first_layer(model_parallel, monkeypatch):
    config = mla_config()
    description = describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ)
    assert_describes(description, build_gpt(config, monkeypatch))
    names = [c.name for c in description.components if c.layer == 1]
    assert names[:8] == ["input_layernorm", "self_attention.linear_q_down_proj", "self_attention.q_layernorm",
                         "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
                         "self_attention.kv_layernorm", "self_attention.linear_kv_up_proj",
                         "self_attention.core_attention"]
    core = next(c for c in description.components if c.kind == "attn_core")
    assert (core.k, core.active) == (16 + 8, 8)


def test_mla_without_query_compression(model_parallel, monkeypatch):
    config = mla_config(q_lora_rank=None, qk_layernorm=False, num_moe_experts=None, moe_ffn_hidden_size=None,
                        moe_shared_expert_intermediate_size=None, moe_layer_freq=1)
    description = describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ)
    assert_describes(description, build_gpt(config, monkeypatch))
    assert "decoder.layers.0.self_attention.linear_q_proj" in {c.fqn for c in description.components}


def same_layers(a, b) -> bool:
    """Equal up to names: kind, shape, experts, block and layer of every component, in order."""
    def key(c):
        return (c.kind, c.n, c.k, c.experts, c.active, c.block, c.layer)
    return a.seq_len == b.seq_len and [key(c) for c in a.components] == [key(c) for c in b.components]


def test_full_size_configs_match_the_yaml_descriptions():
    llama = TransformerConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                              num_query_groups=8, gated_linear_unit=True, normalization="RMSNorm")
    assert same_layers(describe_transformer_config(llama, vocab_size=128256, seq_len=8192),
                       load_description("llama3-8b"))
    deepseek = MLATransformerConfig(
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, gated_linear_unit=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        qk_layernorm=True, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58)
    described = describe_transformer_config(deepseek, vocab_size=129280, seq_len=4096, name="deepseek-v3")
    assert same_layers(described, load_description("deepseek-v3-like-moe"))
    plan = make_plan(described, PolicyConfig(recipe="blockwise"))
    assert plan.decision("decoder.layers.3.mlp.router").backend == "bf16"
    assert plan.decision("decoder.layers.3.mlp.experts.linear_fc1").backend == "te"  # the fastest measured on sm90
    assert {plan.decision(f).backend for f in ("embedding.word_embeddings", "output_layer")} == {"bf16"}


def duck(**changes) -> SimpleNamespace:
    """A config by attribute only: megatron's defaults fill what is unset."""
    return SimpleNamespace(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, **changes})


def test_duck_typed_config_takes_megatron_defaults():
    description = describe_transformer_config(duck(), vocab_size=VOCAB, seq_len=SEQ)
    shapes = {c.name: (c.n, c.k) for c in description.components if c.layer == 0}
    assert shapes["self_attention.linear_qkv"] == (3 * 64, 64)
    assert shapes["mlp.linear_fc1"] == (4 * 64, 64)


def test_moe_only_recipe_file_reads_megatron_names():
    config = duck(hidden_size=1024, num_attention_heads=8, num_layers=3, num_moe_experts=8, moe_ffn_hidden_size=1024,
                  moe_shared_expert_intermediate_size=1024, moe_layer_freq=[0, 1, 1])
    settings, overrides = load_recipe_file("moe-only-fp8")
    plan = make_plan(describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ),
                     PolicyConfig(**settings, overrides=overrides))
    fp8 = {d.component.name for d in plan.decisions if d.precision == "fp8"}
    assert fp8 == {"mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
                   "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"}


@pytest.mark.parametrize("config, message", [
    (duck(hidden_size=None), "hidden_size must be a positive integer, got None"),
    (duck(num_moe_experts=4, moe_layer_freq=[1, 0, 1]), "moe_layer_freq=[1, 0, 1] must be a positive integer N"),
    (duck(num_moe_experts=4, moe_layer_freq=0), "or a list of 2 zeros (dense) and ones (MoE)"),
    (duck(mtp_num_layers=1), "mtp_num_layers=1 (multi-token-prediction layers) is not described"),
    (duck(multi_latent_attention=True, kv_lora_rank=16), "qk_head_dim must be a positive integer"),
])
def test_unsupported_or_broken_configs_raise_plan_error(config, message):
    with pytest.raises(PlanError) as err:
        describe_transformer_config(config, vocab_size=VOCAB, seq_len=SEQ, name="bad")
    assert message in str(err.value)
    assert str(err.value).startswith("TransformerConfig 'bad'")


def test_vocab_and_seq_len_are_checked():
    with pytest.raises(PlanError, match="embedding.word_embeddings k must be a positive integer"):
        describe_transformer_config(duck(), vocab_size=0, seq_len=SEQ)
    with pytest.raises(PlanError, match="seq_len must be a positive integer"):
        describe_transformer_config(duck(), vocab_size=VOCAB, seq_len=None)


def test_the_plan_room_imports_without_megatron():
    code = "import sys, fp8stack.plan.from_megatron; print(any(m.startswith('megatron') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
