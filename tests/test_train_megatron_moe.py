"""The Megatron path's MoE models on a CPU (megatron's local spec: SequentialMLP experts, the alltoall dispatcher,
through megatron_cpu's shims on torch's CUDA calls): the description's MoE shape and routing in megatron's
TransformerConfig, the plain MoE's weights computing the plain MoE's function, a few training steps with the expert
bias moving, checkpoints resuming bit-exactly (and only at the expert-parallel degree they were saved at), the plan's
grouped expert decisions, and the options refused. FP8 grouped GEMMs (TE GroupedLinear) train on GPUs:
tests/gpu/test_megatron_moe_gpu.py; experts split over two ranks: tests/test_megatron_expert_parallel_gloo.py."""

import dataclasses

import pytest
import torch

import megatron_cpu

from fp8stack.config import from_overrides
from fp8stack.config.job import MEGATRON_MOE_MODELS
from fp8stack.megatron import plan_from_megatron_args
from fp8stack.models import Llama
from fp8stack.train import checkpoint, megatron_model
from fp8stack.train.command import job_from_flags
from fp8stack.train.command import main as train_main
from fp8stack.train.loop import _adamw
from fp8stack.train.megatron_checkpoint import MegatronTensors
from fp8stack.train.model import build_model, model_config

pytestmark = pytest.mark.filterwarnings("ignore:GPTModel IS DEPRECATED", "ignore:.*tp_group is None",
                                        "ignore:Apex is not installed")

SEQ = 64
"""Tokens per test sequence."""


def moe_cfg(*flags: str, model: str = "tiny-moe"):
    return job_from_flags(["--model-impl", "megatron", "--model", model, "--lr", "1e-3", *flags])


@pytest.fixture
def megatron_moe_on_cpu(monkeypatch, cpu_megatron):
    """megatron's MoE layers on the CPU: megatron_cpu.megatron_moe_on_cpu's shims on torch (the CUDA device and
    streams megatron's router, RoPE and alltoall dispatcher ask for); megatron's own code runs unchanged."""
    megatron_cpu.megatron_moe_on_cpu(monkeypatch)


def build(cfg, seed: int = 0):
    """The GPTModel megatron_model.build makes, on megatron's local spec, from the plain Llama drawn for `seed`."""
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, megatron_model.fp8_format(cfg))
    plan = megatron_model.build_plan(config, cfg, shape, arch=90)
    llama = build_model(from_overrides({"training.seed": seed}, cfg), torch.device("cpu"))
    return megatron_model.gpt_model(config, plan, llama, use_te=False), llama


def batch(vocab_size: int, seed: int = 0):
    tokens = torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, tokens.roll(-1, 1)


def test_the_descriptions_moe_shape_and_routing_map_onto_megatrons_config():
    tiny = moe_cfg()
    shape = model_config(tiny)
    config = megatron_model.transformer_config(tiny, shape, "hybrid")
    assert (config.num_moe_experts, config.moe_router_topk) == (shape.moe.num_experts, shape.moe.top_k) == (8, 2)
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size) == (
        shape.ffn_dim, shape.moe.expert_ffn_dim, shape.moe.shared_ffn_dim)
    assert config.moe_layer_freq == [0, 1, 1, 1]  # layer 0 dense
    # softmax over all experts, then the top 2 as scored (no renormalisation), as the plain router; no balancing
    assert config.moe_router_score_function == "softmax" and config.moe_router_pre_softmax
    assert not config.moe_router_enable_expert_bias and config.moe_router_load_balancing_type == "none"
    assert config.moe_aux_loss_coeff == 0.0 and config.moe_router_dtype == "fp32"
    assert config.moe_grouped_gemm and config.moe_token_dispatcher_type == "alltoall"
    assert not config.moe_router_padding_for_quantization  # BF16: nothing to pad for

    deepseek = moe_cfg(model="deepseek-moe-small")
    shape = model_config(deepseek)
    config = megatron_model.transformer_config(deepseek, shape, "hybrid")
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.moe_shared_expert_intermediate_size, config.ffn_hidden_size) == (32, 8, 1536, 1536, 8192)
    assert config.moe_layer_freq == [0] + [1] * 7
    # sigmoid scores, the top 8 renormalised (megatron does for sigmoid at top_k > 1), DeepSeek's expert bias
    assert config.moe_router_score_function == "sigmoid" and not config.moe_router_pre_softmax
    assert shape.moe.route_norm
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 1e-3
    assert config.moe_aux_loss_coeff == 0.0 and config.moe_router_load_balancing_type == "none"
    # --model.expert-bias-rate reaches megatron's router as it does the plain MoE's: 0 turns the bias off
    for rate in (2e-3, 0.0):
        given = moe_cfg("--model.expert-bias-rate", str(rate), model="deepseek-moe-small")
        config = megatron_model.transformer_config(given, model_config(given), "hybrid")
        assert (config.moe_router_enable_expert_bias, config.moe_router_bias_update_rate) == (rate > 0, rate)


@pytest.mark.parametrize("score_func, top_k, route_norm", [("sigmoid", 2, False), ("softmax", 1, True)])
def test_routing_megatron_cannot_express_is_refused(score_func, top_k, route_norm):
    shape = model_config(moe_cfg())
    odd = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, score_func=score_func, top_k=top_k,
                                                             route_norm=route_norm))
    with pytest.raises(Exception, match="has no megatron-core form") as raised:
        megatron_model.transformer_config(moe_cfg(), odd, "hybrid")
    assert type(raised.value).__name__ == "ConfigError" and "\n" not in str(raised.value)


def test_megatrons_moe_computes_the_plain_moes_function(megatron_moe_on_cpu):
    """The plain MoE's router, experts (each expert's [gate; up] rows) and shared expert in megatron's MoELayer:
    the same logits in FP32 (the top-k choice is the same, so agreement is to rounding)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = moe_cfg()
    megatron, plain = build(cfg)
    assert [type(layer.mlp).__name__ for layer in megatron.decoder.layers] == ["MLP"] + ["MoELayer"] * 3
    assert isinstance(megatron.decoder.layers[1].mlp.experts, SequentialMLP)
    assert sum(p.numel() for p in megatron.parameters()) == sum(p.numel() for p in plain.parameters())
    tokens, _ = batch(plain.config.vocab_size)
    positions = torch.arange(SEQ).expand_as(tokens)
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]
    torch.testing.assert_close(megatron(tokens, positions, causal), plain(tokens), rtol=1e-5, atol=1e-5)


def test_routers_get_bf16_activations_in_their_fp32_weights_dtype(megatron_moe_on_cpu):
    """TE's router GEMM refuses an FP32 weight with BF16 activations (FP32 parameters under autocast): every router
    of the built model casts its input to its weight's dtype first, and leaves matching input alone."""
    from megatron.core.transformer.moe.router import Router

    megatron, _ = build(moe_cfg())
    routers = [m for m in megatron.modules() if isinstance(m, Router)]
    assert len(routers) == 3 and all(r.weight.dtype == torch.float32 for r in routers)
    seen = []
    routers[0].register_forward_pre_hook(lambda router, args: seen.append(args[0].dtype))  # after the cast
    hidden = torch.randn(SEQ, 2, routers[0].weight.shape[1], dtype=torch.bfloat16)
    routers[0](hidden)
    assert seen == [torch.float32]
    assert megatron_model.input_in_weight_dtype(routers[0], (hidden.float(),)) is None


def test_megatrons_moe_trains_and_moves_the_expert_bias(megatron_moe_on_cpu):
    """A few steps of the trainer's AdamW through MegatronModel's clip (which updates sigmoid routers' expert bias
    from the step's token counts, as finalize_model_grads does): finite, falling losses; every MoE layer's bias moved
    by the update rate towards balance; the counts zero again after the step."""
    cfg = from_overrides({"training.seq_len": SEQ}, moe_cfg())
    shape = model_config(cfg)
    sigmoid = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, score_func="sigmoid", route_norm=True))
    config = megatron_model.transformer_config(cfg, sigmoid, "hybrid")
    plain = Llama(sigmoid)
    plain.init_weights(seed=0)
    plan = megatron_model.build_plan(config, cfg, sigmoid, arch=90)
    gpt = megatron_model.gpt_model(config, plan, plain, use_te=False)
    from megatron.core import parallel_state

    built = megatron_model.MegatronModel(model=gpt, gpt=gpt, plan=plan, seq_len=SEQ,
                                         tp_group=parallel_state.get_tensor_model_parallel_group())
    routers = [layer.mlp.router for layer in gpt.decoder.layers[1:]]
    assert all(torch.equal(r.expert_bias, torch.zeros(8)) for r in routers)
    optimizer = _adamw(gpt, cfg)
    tokens, targets = batch(shape.vocab_size)
    losses = []
    for step in range(6):
        loss = megatron_cpu.causal_loss(gpt, tokens, targets)
        loss.backward()
        counts = [r.local_tokens_per_expert.clone() for r in routers]
        assert all(int(c.sum()) == tokens.numel() * shape.moe.top_k for c in counts)
        norm = built.clip(1.0)
        assert torch.isfinite(norm)
        if step == 0:
            for router, count in zip(routers, counts):
                expected = torch.sign(count.mean() - count) * sigmoid.moe.expert_bias_rate
                assert torch.equal(router.expert_bias, expected)
        assert all(not r.local_tokens_per_expert.any() for r in routers)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        built.after_optimizer_step()
        losses.append(loss.item())
    assert all(x == x for x in losses) and losses[-1] < losses[0] - 0.1, losses


def test_moe_checkpoints_resume_the_model_expert_bias_and_adamw_exactly(tmp_path, megatron_moe_on_cpu):
    """megatron's sharded state dict of the MoE model (each expert's weights under the experts' global key, the
    routers' expert bias) and AdamW's moments through fp8stack's checkpoint writer: a model drawn from another seed
    resumes to the same tensors, and the next step gives the same loss, bit for bit."""
    import json

    cfg = moe_cfg(model="deepseek-moe-small")
    cfg = from_overrides({"training.seq_len": SEQ}, cfg)
    small = megatron_cpu.small_deepseek(model_config(cfg))
    model = megatron_cpu.drawn_gpt(cfg, small, seed=0)
    optimizer = _adamw(model, cfg)
    tokens, targets = batch(small.vocab_size)
    megatron_cpu.causal_loss(model, tokens, targets).backward()
    optimizer.step()
    for layer in model.decoder.layers[1:]:  # as a balancing step leaves it
        layer.mlp.router.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)) * 1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = checkpoint.save(tmp_path / "ckpt", 1, model, optimizer, scheduler, 5,
                           layout=MegatronTensors(model, optimizer))
    tensors = json.loads((path / "metadata.json").read_text())["tensors"]
    experts = [key for key in tensors if "experts.experts.linear_fc1" in key and "optimizer" not in key]
    assert experts and tensors[experts[0]]["size"][-2:] == [2 * 128, 256], (experts, tensors.get(experts[0]))
    assert any(key.endswith("router.expert_bias") for key in tensors), sorted(tensors)

    other = megatron_cpu.drawn_gpt(cfg, small, seed=1)
    fresh = _adamw(other, cfg)
    checkpoint.load(path, other, fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1.0),
                    layout=MegatronTensors(other, fresh))
    for (name, mine), theirs in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs), name
    saved, loaded = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    next_losses = []
    for net, opt in ((model, optimizer), (other, fresh)):
        opt.zero_grad(set_to_none=True)
        megatron_cpu.causal_loss(net, tokens, targets).backward()
        opt.step()
        with torch.no_grad():
            next_losses.append(megatron_cpu.causal_loss(net, tokens, targets).item())
    assert next_losses[0] == next_losses[1]


def test_the_plan_of_megatrons_moe_lists_the_grouped_experts():
    """Each MoE layer's experts are grouped expert components (fc1 and fc2 over all experts, each token running
    top_k), planned on TE as megatron runs them: GroupedLinear with moe_grouped_gemm, blockwise included."""
    cfg = moe_cfg(model="deepseek-moe-small")
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, "hybrid")
    # megatron refuses an FP8 MoE TransformerConfig without TE: the FP8 flags are given to the plan directly
    for recipe in ("blockwise", "delayed"):
        plan = plan_from_megatron_args(config, vocab_size=shape.vocab_size, seq_len=shape.seq_len, fp8="e4m3",
                                       fp8_recipe=recipe, name=cfg.model.name)
        experts = [d for d in plan.decisions if d.component.kind == "expert"]
        assert len(experts) == 2 * 7
        assert {(d.component.experts, d.component.active) for d in experts} == {(32, 8)}
        assert {(d.backend, d.recipe) for d in experts} == {("te", recipe)}
        assert all("megatron runs the experts as TE GroupedLinear (TEGroupedMLP, --moe-grouped-gemm)" in d.reason
                   for d in experts)
        fc1 = plan.decision("decoder.layers.1.mlp.experts.linear_fc1").component
        assert (fc1.n, fc1.k) == (2 * 1536, 2048)
        assert plan.decision("decoder.layers.1.mlp.router").recipe == "bf16"


def test_deepseek_moe_medium_maps_onto_megatrons_config_and_plans_its_experts_on_te():
    """Its full shape in megatron's TransformerConfig (16 experts top-4 of width 4096, a shared expert as wide, layer
    0 dense with SwiGLU 14336, 32 heads over 8 KV groups, sigmoid scores with the expert bias) and in the plan
    megatron's FP8 flags give: each MoE layer's fc1 and fc2 grouped over the 16 experts on TE GroupedLinear."""
    cfg = moe_cfg(model="deepseek-moe-medium")
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, "hybrid")
    assert (config.hidden_size, config.num_attention_heads, config.num_query_groups) == (4096, 32, 8)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.moe_shared_expert_intermediate_size, config.ffn_hidden_size) == (16, 4, 4096, 4096, 14336)
    assert config.moe_layer_freq == [0] + [1] * 5
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    plan = plan_from_megatron_args(config, vocab_size=shape.vocab_size, seq_len=shape.seq_len, fp8="e4m3",
                                   fp8_recipe="blockwise", name=cfg.model.name)
    experts = [d for d in plan.decisions if d.component.kind == "expert"]
    assert len(experts) == 2 * 5 and {(d.backend, d.recipe) for d in experts} == {("te", "blockwise")}
    fc1, fc2 = (plan.decision(f"decoder.layers.1.mlp.experts.linear_fc{i}").component for i in (1, 2))
    assert ((fc1.n, fc1.k), (fc2.n, fc2.k), (fc1.experts, fc1.active)) == ((2 * 4096, 4096), (4096, 4096), (16, 4))


def test_deepseek_moe_medium_builds_as_megatrons_moe_computing_the_plain_moes_function(megatron_moe_on_cpu):
    """Its layout and routing at a CPU width (256; 16 experts top-4, sigmoid scores renormalised, a shared expert,
    layer 0 dense): megatron's GPTModel holding the plain Llama's weights computes the plain Llama's function."""
    cfg = from_overrides({"training.seq_len": SEQ}, moe_cfg(model="deepseek-moe-medium"))
    shape = model_config(cfg)
    small = dataclasses.replace(shape, dim=256, n_heads=8, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                                moe=dataclasses.replace(shape.moe, expert_ffn_dim=256, shared_ffn_dim=256))
    megatron = megatron_cpu.drawn_gpt(cfg, small, seed=0)
    plain = Llama(small)
    plain.init_weights(seed=0)
    assert [type(layer.mlp).__name__ for layer in megatron.decoder.layers] == ["MLP"] + ["MoELayer"] * 5
    assert all(layer.mlp.router.expert_bias is not None for layer in megatron.decoder.layers[1:])
    assert sum(p.numel() for p in megatron.parameters()) == sum(p.numel() for p in plain.parameters())
    tokens, _ = batch(small.vocab_size)
    positions = torch.arange(SEQ).expand_as(tokens)
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]
    torch.testing.assert_close(megatron(tokens, positions, causal), plain(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, processes, names", [
    (["--tensor-model-parallel-size", "2"], 2, "tensor parallelism of MoE layers is not wired): drop "
                                               "--tensor-model-parallel-size and split the experts with "
                                               "--expert-model-parallel-size"),
    (["--use-distributed-optimizer"], 1, "keeps tiny-moe's experts in a second optimizer"),
    (["--param-dtype", "bf16", "--dtype", "bf16"], 1, "keeps tiny-moe's experts in a second optimizer"),
    (["--expert-model-parallel-size", "2"], 1, "parallelism.expert_parallel=2 must divide the 1 data-parallel "
                                               "rank(s) (1 processes / tensor_parallel 1): launch a multiple of 2"),
    (["--expert-model-parallel-size", "2"], 3, "must divide the 3 data-parallel rank(s)"),
    (["--expert-model-parallel-size", "3"], 3, "parallelism.expert_parallel=3 must divide tiny-moe's 8 routed "
                                               "experts (each rank holds as many): pick a divisor of 8"),
])
def test_moe_options_the_megatron_path_cannot_honour_are_refused(flags, processes, names, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(processes))  # refused before any process group is set up
    assert train_main(["--model-impl", "megatron", "--model", "tiny-moe", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fp8stack train: error: ") and names in error, error
    assert len(error.splitlines()) == 1 and "needs CUDA" not in error


def test_the_moe_models_are_accepted_on_the_megatron_path():
    for name in MEGATRON_MOE_MODELS:
        cfg = moe_cfg("--fp8-recipe", "blockwise", model=name)
        assert (cfg.model.impl, cfg.model.name) == ("megatron", name)


@pytest.mark.parametrize("key, extra", [
    ("decoder.layers.1.mlp.experts.linear_fc1._extra_state", True),
    ("decoder.layers.1.mlp.experts.linear_fc1._extra_state7", True),  # TE GroupedLinear's GEMM 7, on dist-ckpt
    ("decoder.layers.0.self_attention.linear_qkv._extra_state", True),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight7", False),
    ("decoder.layers.1.mlp.router.expert_bias", False),
    ("decoder.layers.1.mlp.experts.linear_fc1._extra_state_copy", False),
])
def test_extra_states_of_every_gemm_stay_in_the_rank_files(key, extra):
    """The sharded checkpoint leaves all extra states to the rank files, GroupedLinear's per-GEMM ones included: a
    checkpoint keeping GEMMs 1..n-1 without GEMM 0 fails megatron's sharding validation on load."""
    from fp8stack.train.megatron_checkpoint import is_extra_state

    assert is_extra_state(key) is extra


def test_a_checkpoint_resumes_only_at_the_expert_parallel_degree_it_was_saved_at(tmp_path, monkeypatch, capsys):
    """The same processes split the experts differently: refused before any model is built (each rank's file holds
    the FP8 scaling state of its own experts' GEMMs), naming the degree it was saved at."""
    import json

    from fp8stack.train.loop import resolve_job
    from fp8stack.train.preflight import run_settings

    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = ["--model-impl", "megatron", "--model", "tiny-moe", "--device", "cpu", "--eval-iters", "0"]
    saved = resolve_job(job_from_flags([*flags, "--expert-model-parallel-size", "2"]))
    (tmp_path / checkpoint.RUN_FILE).write_text(json.dumps(run_settings(saved, model_config(saved), 2)))
    assert train_main([*flags, "--load", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "was saved under other settings (parallelism.expert_parallel: 2 -> 1)" in error, error
