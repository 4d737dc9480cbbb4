"""Every model description the plan reads either builds as the trainer's Llama or is refused naming its block."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from fp8stack.models import (Llama, LlamaConfig, ModelBuildError, MoEConfig, load_model_config,
                             model_config_from_description)
from fp8stack.plan import PlanError, description_from_dict, load_description
from fp8stack.plan.description import CONFIGS_DIR
from fp8stack.plan.from_module import describe_module

MODEL_FILES = sorted((CONFIGS_DIR / "models").glob("*.yaml"))
REFUSED = {
    "deepseek-v3-like-moe": "block 'dense' (multi-head latent attention (MLA): attention.wq_a) cannot be built yet",
    "hybrid-mamba-moe": "block 'mamba' (ssm_scan: mixer.scan) cannot be built yet",
}
"""Descriptions fp8stack plans but cannot build, and what the refusal names."""
BUILT = ("tiny", "tiny-moe", "llama-1b-like", "llama-70b-layers", "llama3-8b", "llama3-8b-16-layers",
         "deepseek-moe-small", "deepseek-moe-medium")
"""Descriptions fp8stack builds."""

# The named shapes as the LlamaConfig factories wrote them before they read their YAML files.
TINY = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256, seq_len=256)
NAMED = {
    "tiny": TINY,
    "tiny-moe": replace(TINY, moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=256, shared_ffn_dim=256),
                        first_moe_layer=1),
    "llama-1b-like": LlamaConfig(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                                 seq_len=4096),
}


def test_every_model_file_is_built_or_refused_here():
    assert sorted(p.stem for p in MODEL_FILES) == sorted([*BUILT, *REFUSED])


@pytest.mark.parametrize("name", BUILT)
def test_built_model_has_the_description_s_components(name):
    config = load_model_config(name)
    with torch.device("meta"):
        model = Llama(config)
    built = describe_module(model, seq_len=config.seq_len, name=name, trace=False)
    assert [(c.fqn, c.kind, c.n, c.k, c.experts, c.active) for c in built.components] == \
        [(c.fqn, c.kind, c.n, c.k, c.experts, c.active) for c in load_description(name).components]
    assert config.seq_len == load_description(name).seq_len


@pytest.mark.parametrize("name", REFUSED)
def test_unbuildable_model_is_refused_naming_its_block(name):
    with pytest.raises(ModelBuildError) as err:
        load_model_config(name)
    message = str(err.value)
    assert REFUSED[name] in message
    assert f"{name}.yaml" in message
    assert "--model-factory" in message and "fp8stack plan" in message and "\n" not in message
    assert isinstance(err.value, PlanError)  # what the tools already report as bad input


@pytest.mark.parametrize("name", NAMED)
def test_named_models_are_the_shapes_the_factories_had(name):
    assert load_model_config(name) == NAMED[name]


def test_a_yaml_path_loads_as_its_name_does():
    assert load_model_config(str(CONFIGS_DIR / "models" / "tiny.yaml")) == load_model_config("tiny")


def shape_and_parameters(name: str) -> tuple[tuple, int]:
    """A named model's (dim, layers, heads, KV heads, FFN width, vocabulary, sequence) and its parameter count."""
    config = load_model_config(name)
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(config).parameters())
    return (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim, config.vocab_size,
            config.seq_len), params


def test_llama3_8b_is_an_8b_model():
    shape, params = shape_and_parameters("llama3-8b")
    assert shape == (4096, 32, 32, 8, 14336, 128256, 8192)
    assert 8.0e9 < params < 8.1e9  # Meta's Llama 3 8B: 8.03B parameters


def test_llama3_8b_16_layers_is_llama3_8b_at_half_its_depth_and_its_replica_fits_one_h200():
    shape, params = shape_and_parameters("llama3-8b-16-layers")
    full, _ = shape_and_parameters("llama3-8b")
    assert shape == (*full[:1], 16, *full[2:])
    # BF16 parameters, FP32 masters, main_grads and AdamW moments (18 bytes each) within an H200's 141 GB, with room
    # for activations (llama3-8b's 8.03 B parameters take 145 GB).
    assert 4.5e9 < params < 4.6e9 and params * 18 < 85e9


def test_llama_70b_layers_has_llama3_70b_layer_widths_and_fits_one_h200_with_fp32_masters():
    shape, params = shape_and_parameters("llama-70b-layers")
    assert shape == (8192, 4, 64, 8, 28672, 32000, 4096)
    # FP32 masters and two FP32 Adam moments (12 bytes each) leave an H200's 141 GB room for activations.
    assert 3.9e9 < params < 4.0e9 and params * 12 < 50e9


ROUND_TRIPS = {
    "tiny-unfused": replace(TINY, fused_projections=False),
    "moe-unfused": replace(NAMED["tiny-moe"], fused_projections=False),
    # Every layer MoE: no dense MLP is built, and ffn_dim (unused) reads as the experts' width.
    "all-moe-no-shared-expert": replace(TINY, n_layers=2, ffn_dim=128,
                                        moe=MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=128)),
    "multi-head": replace(TINY, n_kv_heads=8, ffn_dim=512, vocab_size=1000, seq_len=64),
}


@pytest.mark.parametrize("config", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_any_llama_s_description_gives_back_its_config(config):
    description = describe_module(Llama(config), seq_len=config.seq_len, name="built")
    assert model_config_from_description(description) == config


def test_rope_theta_and_norm_eps_come_from_the_description():
    data = _tiny_yaml()
    data["rope_theta"] = 10000
    data["blocks"]["dense"][0]["eps"] = 1e-6
    data["blocks"]["dense"][4]["eps"] = 1e-6
    data["after_layers"][0]["eps"] = 1e-6
    config = model_config_from_description(description_from_dict(data, source="t.yaml"))
    assert (config.rope_theta, config.norm_eps) == (10000.0, 1e-6)


def _tiny_yaml() -> dict:
    return yaml.safe_load((CONFIGS_DIR / "models" / "tiny.yaml").read_text())


def _tiny_moe_yaml() -> dict:
    return yaml.safe_load((CONFIGS_DIR / "models" / "tiny-moe.yaml").read_text())


def _renamed(data: dict, old: str, new: str) -> dict:
    for block in data["blocks"].values():
        for spec in block:
            if spec["name"] == old:
                spec["name"] = new
            spec.pop("feeds", None)
            spec.pop("swiglu", None)
    return data


def _with_component(data: dict, index: int, **change) -> dict:
    data["blocks"]["dense"][index].update(change)
    return data


BAD = {
    "megatron names": (_renamed(_tiny_yaml(), "attention.wqkv", "self_attention.linear_qkv"),
                       "block 'dense' (self_attention.linear_qkv, linear) cannot be built yet"),
    "no attention": ({**_tiny_yaml(), "blocks": {"dense": [c for c in _tiny_yaml()["blocks"]["dense"]
                                                           if not c["name"].startswith("attention")]}},
                     "block 'dense' (no attention: attention.core) cannot be built yet"),
    "no mlp": ({**_tiny_yaml(), "blocks": {"dense": [c for c in _tiny_yaml()["blocks"]["dense"]
                                                     if c["name"].startswith("attention")]}},
               "block 'dense' (no MLP: feed_forward or moe) cannot be built yet"),
    "dense after moe": ({**_tiny_moe_yaml(), "layers": [{"block": "moe"}, {"block": "dense", "repeat": 3}]},
                        "layer 1 has a dense MLP after the MoE layer 0: fp8stack's Llama keeps its dense layers first"),
    "no wo": ({**_tiny_yaml(), "blocks": {"dense": [c for c in _tiny_yaml()["blocks"]["dense"]
                                                    if c["name"] != "attention.wo"]}},
              "block 'dense' (no attention.wo) cannot be built yet"),
    "router without experts": ({**_tiny_moe_yaml(), "blocks": {
        **_tiny_moe_yaml()["blocks"], "moe": [c for c in _tiny_moe_yaml()["blocks"]["moe"]
                                              if not c["name"].startswith("moe.experts")]}},
        "block 'moe' (no moe.experts.w13) cannot be built yet"),
    "dense and moe in one block": ({**_tiny_moe_yaml(), "blocks": {
        **_tiny_moe_yaml()["blocks"], "moe": [*_tiny_moe_yaml()["blocks"]["moe"], _tiny_yaml()["blocks"]["dense"][-1]]}},
        "block 'moe' (feed_forward.w2, linear) cannot be built yet"),
    "no layers": ({**_tiny_yaml(), "layers": []}, "no layers: fp8stack builds a stack of attention + MLP blocks"),
    "extra outside": ({**_tiny_yaml(), "before_layers": [*_tiny_yaml()["before_layers"],
                                                         {"name": "pos_embeddings", "kind": "embedding", "n": 256,
                                                          "k": 256}]},
                      "pos_embeddings (embedding) outside the layers cannot be built yet"),
    "no embedding": ({**_tiny_yaml(), "before_layers": []}, "no tok_embeddings (embedding)"),
    "odd heads": (_with_component(_tiny_yaml(), 2, active=15),
                  "attention.core's active (2 x heads) (15) is not a positive multiple of 2"),
    "wqkv not whole heads": (_with_component(_tiny_yaml(), 1, n=500),
                             "attention.wqkv's outputs (500) is not a positive multiple of 32"),
    "wrong wo": (_with_component(_tiny_yaml(), 3, k=512),
                 "component 4 is layers.0.attention.wo (linear n=256 k=512, active=1), where the Llama read from "
                 "the description (dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768) has "
                 "layers.0.attention.wo (linear n=256 k=256, active=1)"),
    "two norm eps": (_with_component(_tiny_yaml(), 0, eps=1e-6), "the norms give different eps [1e-06, 1e-05]"),
    "heads x head dim is not dim": (_with_component(_with_component(_tiny_yaml(), 2, k=24), 1, n=384),
                                    "attention.core's 8 heads x head dim 24 = 192 differ from the hidden size 256"),
    "odd head dim": (_with_component(_with_component(_tiny_yaml(), 2, k=1, active=512), 1, n=768),
                     "the shapes give no Llama (LlamaConfig: head_dim=1 must be even for RoPE)"),
}


@pytest.mark.parametrize("data, message", BAD.values(), ids=list(BAD))
def test_unbuildable_description_is_refused_naming_the_fix(data, message):
    description = description_from_dict(data, source="bad.yaml")
    with pytest.raises(ModelBuildError) as err:
        model_config_from_description(description, source="bad.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("bad.yaml: ") and "\n" not in str(err.value)


def test_missing_model_file_names_the_known_models(tmp_path):
    with pytest.raises(PlanError, match="not found: give a YAML path or one of .*llama3-8b"):
        load_model_config(str(tmp_path / "nothing.yaml"))


def test_refusal_names_the_path_as_given_relative_to_the_working_folder(tmp_path, monkeypatch):
    path = tmp_path / "mine.yaml"
    path.write_text((CONFIGS_DIR / "models" / "hybrid-mamba-moe.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelBuildError, match=r"^mine\.yaml: block 'mamba'"):
        load_model_config("mine.yaml")
    assert Path("mine.yaml").is_file()
