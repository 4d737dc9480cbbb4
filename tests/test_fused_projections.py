"""LlamaConfig(fused_projections=False): separate wq/wk/wv and w1/w3, the same function as the fused
model for the same seed, described and planned per projection, chosen by the trainer's flag, and
the layout apply_tp needs (its refusals: tests/test_assembly.py; 2-rank numerics: tests/test_fsdp_gloo.py)."""

from dataclasses import replace

import pytest
import torch

from fp8stack.models import load_model_config
from fp8stack.models import Llama, LlamaConfig
from fp8stack.models.llama import Attention, rope_table
from fp8stack.plan import ModelDescription, PolicyConfig, load_description, make_plan
from fp8stack.plan.from_module import describe_module
from fp8stack.train.command import job_from_flags
from fp8stack.config import from_overrides
from fp8stack.train.model import build_model



def unfused(config: LlamaConfig) -> LlamaConfig:
    return replace(config, fused_projections=False)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_unfused_model_computes_what_the_fused_one_does(model):
    config = load_model_config(model)
    fused, split = Llama(config), Llama(unfused(config))
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in split.parameters())
    attention, parts = fused.layers[0].attention, split.layers[0].attention
    assert not hasattr(parts, "wqkv") and not hasattr(split.layers[0].feed_forward, "w13")
    assert torch.equal(attention.wqkv.weight, torch.cat([parts.wq.weight, parts.wk.weight, parts.wv.weight]))
    assert torch.equal(fused.layers[0].feed_forward.w13.weight,
                       torch.cat([split.layers[0].feed_forward.w1.weight, split.layers[0].feed_forward.w3.weight]))
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(split(tokens), fused(tokens))


def test_attention_takes_its_heads_from_the_projections():
    """What one tensor-parallel rank computes: half the q and kv heads of wq/wk/wv (rows) and wo
    (columns). The two halves' outputs add up to the whole attention's."""
    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=16, seq_len=8,
                         fused_projections=False)
    torch.manual_seed(0)
    whole = Attention(config)
    x = torch.randn(2, 8, 64)
    rope = rope_table(config.head_dim, 8, config.rope_theta)
    halves = []
    for rank in range(2):
        shard = Attention(config)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                weight = getattr(whole, name).weight.chunk(2)[rank]
                setattr(shard, name, torch.nn.Linear(64, weight.shape[0], bias=False))
                getattr(shard, name).weight.copy_(weight)
            shard.wo = torch.nn.Linear(32, 64, bias=False)
            shard.wo.weight.copy_(whole.wo.weight.chunk(2, dim=1)[rank])
        halves.append(shard(x, rope))
    torch.testing.assert_close(halves[0] + halves[1], whole(x, rope))


def split_description(fused: ModelDescription, config: LlamaConfig) -> ModelDescription:
    """`fused` with each wqkv / w13 replaced by its parts, in the unfused model's order."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    parts = {"wqkv": (("wq", q), ("wk", kv), ("wv", kv)), "w13": (("w1", None), ("w3", None))}
    components = []
    for c in fused.components:
        prefix, _, leaf = c.fqn.rpartition(".")
        if c.kind != "linear" or leaf not in parts:
            components.append(c)
            continue
        components += [replace(c, fqn=f"{prefix}.{name}", n=n or c.n // 2) for name, n in parts[leaf][:-1]]
        name, n = parts[leaf][-1]
        last = replace(c, fqn=f"{prefix}.{name}", n=n or c.n // 2)
        core = [x for x in components if x.fqn == f"{prefix}.core"]
        if core:  # the attention core follows all three input projections
            components.remove(core[0])
            components += [last, core[0]]
        else:
            components.append(last)
    return replace(fused, components=tuple(components))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_unfused_model_is_described_per_projection(model):
    config = unfused(load_model_config(model))
    built = describe_module(Llama(config), seq_len=config.seq_len, name=model)
    from_yaml = load_description(model)
    assert built.components == split_description(from_yaml, config).components
    assert [c.name for c in built.components if c.layer == 0][:7] == [
        "attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.core", "attention.wo", "ffn_norm"]
    policy = PolicyConfig(recipe="tensorwise", small_gemm_filter="off")
    split_plan, fused_plan = make_plan(built, policy), make_plan(from_yaml, policy)
    assert split_plan.summary()["gemm_flops_per_token"] == fused_plan.summary()["gemm_flops_per_token"]
    fused_choice = {d.fqn: (d.backend, d.recipe) for d in fused_plan.decisions}
    for d in split_plan.decisions:
        prefix, _, leaf = d.fqn.rpartition(".")
        fused_fqn = {"wq": "wqkv", "wk": "wqkv", "wv": "wqkv", "w1": "w13", "w3": "w13"}.get(leaf)
        if fused_fqn:
            assert (d.backend, d.recipe) == fused_choice[f"{prefix}.{fused_fqn}"] == ("torchao", "tensorwise")


def test_meta_device_llama_1b_like_unfused():
    config = unfused(load_model_config("llama-1b-like"))
    with torch.device("meta"):
        model = Llama(config)
    described = describe_module(model, seq_len=config.seq_len, name="llama-1b-like", trace=False)
    assert described.components == split_description(load_description("llama-1b-like"), config).components


def test_trainer_flag_builds_unfused_projections():
    assert job_from_flags([]).model.fused_projections is True
    cfg = job_from_flags(["--no-fused-projections", "--tensor-model-parallel-size", "2"])
    assert cfg == from_overrides({"model.fused_projections": False, "parallelism.tensor_parallel": 2})
    assert job_from_flags(["--no-model.fused-projections"]).model.fused_projections is False
    assert job_from_flags(["--fused-projections"]).model.fused_projections is True
    attention = build_model(from_overrides({"training.seq_len": 16}, cfg), torch.device("cpu")).layers[0].attention
    assert hasattr(attention, "wq") and not hasattr(attention, "wqkv")

