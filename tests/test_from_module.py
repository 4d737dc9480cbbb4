"""describe_module: the plan of a built model equals the plan of its YAML description."""

import pytest
import torch
from torch import nn

from fp8stack.models import load_model_config
from fp8stack.models import Llama
from fp8stack.plan import PlanError, PolicyConfig, load_description, make_plan
from fp8stack.plan.from_module import describe_module

POLICIES = {
    "tensorwise": PolicyConfig(recipe="tensorwise"),
    "rowwise": PolicyConfig(recipe="rowwise"),
    "rowwise-no-filter": PolicyConfig(recipe="rowwise", small_gemm_filter="off"),
    "blockwise-no-filter": PolicyConfig(recipe="blockwise", small_gemm_filter="off"),
    "tensorwise-te-first-last-bf16": PolicyConfig(recipe="tensorwise", backend="te", first_last_layers_bf16=True,
                                                  small_gemm_filter="off"),
    "bf16": PolicyConfig(recipe="bf16"),
}


def plan_dict(description, policy):
    """The plan as JSON, less its model name and the norms left unfused: only a traced module can say why."""
    plan = make_plan(description, policy).as_dict()
    del plan["model"], plan["not_fused"]
    return plan


@pytest.fixture(scope="module")
def built():
    return {name: describe_module(Llama(load_model_config(name)), seq_len=256, name=f"{name}-built")
            for name in ("tiny", "tiny-moe")}


@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_plan_from_module_equals_plan_from_yaml(built, model, policy):
    from_yaml = load_description(model)
    assert built[model].components == from_yaml.components
    assert plan_dict(built[model], POLICIES[policy]) == plan_dict(from_yaml, POLICIES[policy])


def test_meta_device_llama_1b_like():
    with torch.device("meta"):
        model = Llama(load_model_config("llama-1b-like"))
    # fp8stack's Llama asks autocast about its device, which 'meta' is not: its feeds need a built model
    assert describe_module(model, seq_len=4096, name="llama-1b-like").components == \
        load_description("llama-1b-like").components


def test_torchao_float8_linears_are_still_linears():
    from torchao.float8 import convert_to_float8_training

    model = Llama(load_model_config("tiny-moe"))
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "output")
    assert type(model.layers[1].moe.shared_experts.w13).__name__ == "Float8Linear"
    assert describe_module(model, seq_len=256, name="tiny-moe").components == load_description("tiny-moe").components


class Scaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))


class Block(nn.Module):
    def __init__(self, extra: nn.Module):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.extra = extra
        self.down = nn.Linear(16, 8)


class Stack(nn.Module):
    def __init__(self, *blocks: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32)


def test_unknown_module_with_parameters_raises():
    with pytest.raises(PlanError, match=r"blocks\.0\.extra \(Scaler\)"):
        describe_module(Stack(Block(Scaler())), seq_len=16, name="x", layers_attr="blocks")


def test_parameterless_modules_are_skipped_and_names_classified():
    description = describe_module(Stack(Block(nn.Identity())), seq_len=16, name="x", layers_attr="blocks")
    kinds = [(c.fqn, c.kind, c.block) for c in description.components]
    assert kinds == [("embed", "embedding", "model"), ("blocks.0.up", "linear", "mlp"),
                     ("blocks.0.down", "linear", "mlp"), ("final_norm", "norm", "model"),
                     ("lm_head", "head", "model")]


class Mixer(nn.Module):
    """Shaped like a Mamba mixer: in_proj, conv1d, A_log, gated norm, out_proj."""

    def __init__(self):
        super().__init__()
        self.d_inner, self.d_state = 32, 16
        self.in_proj = nn.Linear(8, 64)
        self.conv1d = nn.Conv1d(32, 32, 4, groups=32)
        self.A_log = nn.Parameter(torch.zeros(32))
        self.gated_norm = nn.RMSNorm(32)
        self.out_proj = nn.Linear(32, 8)


class MambaMixer(Mixer):
    pass


class MambaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.mixer = MambaMixer()


def test_mamba_mixer_becomes_a_scan():
    description = describe_module(Stack(MambaLayer()), seq_len=16, name="x", layers_attr="blocks")
    layer = [(c.name, c.kind, c.n, c.k) for c in description.components if c.layer == 0]
    assert layer == [("norm", "norm", 8, 8), ("mixer.in_proj", "linear", 64, 8),
                     ("mixer.scan", "ssm_scan", 32, 16), ("mixer.out_proj", "linear", 8, 32)]
    assert {c.block for c in description.components if c.layer == 0} == {"mamba"}


def test_mixer_without_mamba_in_its_name_is_not_guessed():
    with pytest.raises(PlanError, match="Mixer"):
        describe_module(Stack(Mixer()), seq_len=16, name="x", layers_attr="blocks")


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(4, 16, 8))


class SparseBlock(nn.Module):
    def __init__(self, top_k: int | None):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = Experts()
        if top_k is not None:
            self.top_k = top_k


def test_experts_and_hf_style_router():
    description = describe_module(Stack(SparseBlock(top_k=2)), seq_len=16, name="x", layers_attr="blocks")
    layer = [(c.name, c.kind, c.n, c.k, c.experts, c.active, c.block) for c in description.components if c.layer == 0]
    assert layer == [("gate", "router", 4, 8, 1, 1, "moe"), ("experts.w1", "expert", 16, 8, 4, 2, "moe")]


def test_experts_without_top_k_raise():
    with pytest.raises(PlanError, match="top_k"):
        describe_module(Stack(SparseBlock(top_k=None)), seq_len=16, name="x", layers_attr="blocks")


def test_missing_layers_attr_raises():
    with pytest.raises(PlanError, match="layers_attr"):
        describe_module(Stack(Block(nn.Identity())), seq_len=16, name="x")
