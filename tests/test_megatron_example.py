"""examples/megatron on a CPU: Megatron-LM's own argument parser and config turn pretrain_gpt's flags into
fp8stack's plan, and the example's model_provider builds the GPTModel whose layers run it (megatron's local
modules: no TransformerEngine here, so BF16 plans); train.py's refusals come before any compute.
The FP8 run through megatron-core's loop is tests/gpu/test_megatron_example_gpu.py.

The GPTModels run on CPU through the two test-only shims of the conftest fixture cpu_megatron.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import megatron_cpu

from fp8stack.bench import peers
from fp8stack.evidence import run_folder
from fp8stack.megatron import layer_precisions
from fp8stack.models import Llama, load_model_config
from fp8stack.plan import PlanError
from fp8stack.train import megatron_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron"
sys.path.insert(0, str(EXAMPLE))
import fp8stack_model_provider as provider  # noqa: E402  (the example, as Megatron-LM would import it)
import train  # noqa: E402

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args  # noqa: E402
from megatron.training.global_vars import set_args  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:full scope is deprecated", "ignore:MLP requires ffn_hidden_size", "ignore:.*tp_group is None",
    "ignore:Apex is not installed", "ignore::DeprecationWarning", "ignore::UserWarning")

VOCAB, SEQ = 128, 32
PRETRAIN_GPT = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                "--group-query-attention", "--num-query-groups", "2", "--seq-length", str(SEQ),
                "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "2",
                "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights",
                # learned positions: megatron's RoPE moves its frequencies to torch.cuda.current_device() in forward
                "--position-embedding-type", "learned_absolute", "--use-cpu-initialization",
                "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer", "--lr", "1e-3", "--train-iters", "10"]
"""A pretrain_gpt.py launch of a tiny Llama-style model, as a user writes it."""
LOCAL = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]
"""megatron's local modules (no TE here): torch's norm has no persistent kernel, no apex for the fused wgrad."""


def megatron_args(monkeypatch, *flags: str):
    """Megatron-LM's parsed and validated arguments for `flags`, set as its global args as pretrain() sets them."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *PRETRAIN_GPT, *flags])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = VOCAB  # pretrain() sets it when it builds the tokenizer
    set_args(args)
    return args


@pytest.mark.parametrize("flags, layers", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], ["delayed"] * 4),
    # megatron refuses BF16 outer layers with delayed scaling
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"],
     [None, "tensorwise", "tensorwise", None]),
])
def test_pretrain_gpt_flags_become_the_plan(monkeypatch, flags, layers):
    args = megatron_args(monkeypatch, *flags)
    config = core_transformer_config_from_args(args)
    plan = provider.plan_for(args, config)
    assert (plan.recipe, plan.fp8_format) == (flags[3], flags[1])
    assert [p.recipe for p in layer_precisions(config, plan)] == layers
    for i, recipe in enumerate(layers):
        decision = plan.decision(f"decoder.layers.{i}.mlp.linear_fc1")
        assert (decision.backend, decision.recipe) == (("te", recipe) if recipe else ("bf16", "bf16"))


def test_model_provider_builds_the_gpt_the_plan_says_and_it_trains(cpu_megatron, monkeypatch):
    args = megatron_args(monkeypatch, *LOCAL, "--first-last-layers-bf16")
    torch.manual_seed(0)
    model = provider.model_provider(pre_process=True, post_process=True)  # config from args, as pretrain() leaves it
    config = model.config
    precisions = layer_precisions(config, provider.plan_for(args, config))
    assert [type(layer).plan_fp8_recipe for layer in model.decoder.layers] == [p.recipe for p in precisions]
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["BF16TransformerLayer"] * 4
    assert model.output_layer.weight.shape == (VOCAB, 64) and not model.share_embeddings_and_output_weights
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]  # megatron's default mask is made on CUDA
    loss = model(tokens, torch.arange(SEQ).expand(2, SEQ), causal, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_an_fp8_launch_without_transformer_engine_names_the_fix(cpu_megatron, monkeypatch):
    megatron_args(monkeypatch, *LOCAL, "--fp8-format", "hybrid", "--fp8-recipe", "delayed")
    with pytest.raises(PlanError, match=r"layers \[0, 1, 2, 3\] in FP8.*build on a GPU machine with TE"):
        provider.model_provider(pre_process=True, post_process=True)


@pytest.mark.parametrize("flags, message", [
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion"],
     "--mtp-num-layers: this model_provider builds no multi-token-prediction block"),
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "fp8stack's block_spec builds the layer specs; drop the flag"),
])
def test_flags_the_provider_cannot_honour_are_refused(cpu_megatron, monkeypatch, flags, message):
    megatron_args(monkeypatch, *LOCAL, *flags)
    with pytest.raises(PlanError, match=message):
        provider.model_provider(pre_process=True, post_process=True)


def test_train_py_config_and_provider_agree_on_cpu(cpu_megatron):
    args = train.parse_args(["--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length",
                             "32"])
    config = train.transformer_config(args)
    config.use_cpu_initialization = True  # the example builds on the GPU; here megatron allocates on the CPU
    model = provider.build_gpt_model(args, config, use_te=False)
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["BF16TransformerLayer"] * 3
    assert model.vocab_size == train.VOCAB and model.position_embedding_type == "rope"


def test_train_py_builds_llama3s_vocabulary_rope_base_and_untied_head_and_recomputes_every_layer(cpu_megatron):
    """llama3-8b-16-layers' flags as fp8stack.bench.peers passes them, at a CPU width (2 layers of 256: two heads of
    Llama 3's 128, one KV group), with megatron's full recompute of every layer."""
    args = train.parse_args(["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "896",
                             "--num-attention-heads", "2", "--num-query-groups", "1", "--seq-length", "8192",
                             "--vocab-size", "128256", "--rotary-base", "500000", "--recompute-granularity", "full",
                             "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    config = train.transformer_config(args)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        ("full", "uniform", 1)
    config.use_cpu_initialization = True  # the example builds on the GPU; here megatron allocates on the CPU
    model = provider.build_gpt_model(args, config, use_te=False)
    assert model.embedding.word_embeddings.weight.shape == model.output_layer.weight.shape == (128256, 256)
    assert not model.share_embeddings_and_output_weights and model.max_sequence_length == 8192
    frequencies = 1 / 500000 ** (torch.arange(0, 128, 2).float() / 128)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(), frequencies)
    plain = train.transformer_config(train.parse_args([]))
    assert (plain.recompute_granularity, plain.recompute_method, plain.recompute_num_layers) == (None, None, None)


TE_ONLY = (*peers.MEGATRON_FUSIONS, "--apply-layernorm-1p")
"""The peers' flags megatron refuses without TE: its fusions, and zero-centred norm weights (torch's norm has none)."""


def peers_megatron_flags(model: str, arm: str, nproc: int = 1) -> list[str]:
    """The example's flags in fp8stack.bench.peers' command for `arm` at `model` on `nproc` ranks, less TE_ONLY and
    megatron's TE layer spec (no TE here: megatron refuses them on a CPU)."""
    argv = peers.command(peers.ARMS[arm], peers.Shape(model, 1, 2 * nproc, 5, nproc), Path("r.json"), cuda=True)
    flags = [str(part) for part in argv[argv.index(str(peers.MEGATRON_EXAMPLE)) + 1:]]
    spec = flags.index("--layer-spec")
    return [flag for flag in flags[:spec] + flags[spec + 2:] if flag not in TE_ONLY]


@pytest.mark.parametrize("model", ["tiny-moe", "deepseek-moe-medium"])
def test_peers_moe_flags_give_the_config_fp8stacks_megatron_path_builds(model):
    """pretrain_gpt's MoE flags as peers passes them become the TransformerConfig MoE fields fp8stack's Megatron path
    maps the description onto (BF16 here: megatron refuses an FP8 MoE config without TE); the FP8 arm's flags add
    the FP8 padding alone."""
    config = train.transformer_config(train.parse_args(peers_megatron_flags(model, "megatron-bf16")))
    expected = megatron_model.moe_fields(load_model_config(model), fp8=False)
    if not expected["moe_router_enable_expert_bias"]:
        del expected["moe_router_bias_update_rate"]  # megatron reads it with the bias on only; peers leaves it out
    assert {field: getattr(config, field) for field in expected} == expected
    bf16, fp8 = (vars(train.parse_args(peers_megatron_flags(model, arm)))
                 for arm in ("megatron-bf16", "megatron-blockwise"))
    assert {key for key in bf16 if bf16[key] != fp8[key]} == {"moe_router_padding_for_quantization", "fp8_format",
                                                               "fp8_recipe"}
    assert fp8["moe_router_padding_for_quantization"]


def test_train_py_builds_tiny_moe_as_peers_passes_it_and_computes_the_plain_moes_function(cpu_megatron, monkeypatch):
    """tiny-moe through the example's flags (fp8stack's block_spec: megatron's local MoE layers on a CPU) holding the
    plain MoE's weights: layer 0 dense, layers 1-3 MoE, the plain model's logits (FP32, to rounding)."""
    megatron_cpu.megatron_moe_on_cpu(monkeypatch)
    args = train.parse_args(peers_megatron_flags("tiny-moe", "megatron-bf16"))
    config = train.transformer_config(args)
    config.use_cpu_initialization = True  # the example builds on the GPU; here megatron allocates on the CPU
    config.bf16, config.params_dtype = False, torch.float32  # FP32, so that the two agree to rounding
    model = provider.build_gpt_model(args, config, use_te=False)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP"] + ["MoELayer"] * 3
    plain = Llama(load_model_config("tiny-moe"))
    plain.init_weights(seed=0)
    megatron_model.load_llama_weights(model, plain)
    megatron_model.route_in_the_weights_dtype(model)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]
    torch.testing.assert_close(model(tokens, torch.arange(SEQ).expand_as(tokens), causal), plain(tokens),
                               rtol=1e-5, atol=1e-5)


LLAMA3_AT_CPU_WIDTH = {"dim": 256, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 896, "n_layers": 2}
"""Llama 3's blocks at a width a CPU runs in seconds: two heads of its 128, one KV group."""


def test_train_py_builds_llama3_8b_as_peers_passes_it_on_two_ranks_and_computes_the_plain_llamas_function(
        cpu_megatron, monkeypatch):
    """llama3-8b's flags as peers passes them on 2 ranks (the distributed optimizer and its overlap), the width then
    narrowed to LLAMA3_AT_CPU_WIDTH, its 128256-token vocabulary, 8192 positions and RoPE base 500000 kept: the GPTModel
    holding the plain Llama's weights computes its logits (FP32, to rounding)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # where megatron's RoPE goes
    width = LLAMA3_AT_CPU_WIDTH
    args = train.parse_args([*peers_megatron_flags("llama3-8b", "megatron-bf16", nproc=2),
                             "--num-layers", str(width["n_layers"]), "--hidden-size", str(width["dim"]),
                             "--ffn-hidden-size", str(width["ffn_dim"]), "--num-attention-heads", str(width["n_heads"]),
                             "--num-query-groups", str(width["n_kv_heads"])])
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    config = train.transformer_config(args)
    config.use_cpu_initialization = True  # the example builds on the GPU; here megatron allocates on the CPU
    config.bf16, config.params_dtype = False, torch.float32  # FP32, so that the two agree to rounding
    model = provider.build_gpt_model(args, config, use_te=False)
    assert model.embedding.word_embeddings.weight.shape == model.output_layer.weight.shape == (128256, 256)
    assert not model.share_embeddings_and_output_weights and model.max_sequence_length == 8192
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(),
                               1 / 500000 ** (torch.arange(0, 128, 2).float() / 128))
    plain = Llama(replace(load_model_config("llama3-8b"), **width))
    plain.init_weights(seed=0)
    megatron_model.load_llama_weights(model, plain)
    tokens = torch.randint(0, train.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(SEQ, SEQ).triu(1).bool()[None, None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(SEQ).expand_as(tokens), causal), plain(tokens),
                                   rtol=1e-5, atol=1e-5)


def test_train_py_draws_llama3_8b_as_peers_passes_it_with_the_llama3_recipes_init_and_an_n01_embedding(
        cpu_megatron, monkeypatch):
    """megatron's own init from the peers' llama3-8b flags, its 32 layers at LLAMA3_AT_CPU_WIDTH's width and a
    4096-token vocabulary: the embedding N(0, 1), every other weight N(0, 0.0134), the blocks' output projections
    over sqrt(2 x 32 layers), the head 0.0134; the norms zero-centred (TE's norms only: the config carries it, torch's
    norm refuses it on this CPU)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # where megatron's RoPE goes
    flags = peers_megatron_flags("llama3-8b", "megatron-bf16", nproc=2)
    args = train.parse_args([*flags, "--apply-layernorm-1p"])
    assert train.transformer_config(args).layernorm_zero_centered_gamma
    width = LLAMA3_AT_CPU_WIDTH
    args = train.parse_args([*flags, "--hidden-size", str(width["dim"]), "--ffn-hidden-size", str(width["ffn_dim"]),
                             "--num-attention-heads", str(width["n_heads"]),
                             "--num-query-groups", str(width["n_kv_heads"]), "--vocab-size", "4096"])
    config = train.transformer_config(args)
    config.use_cpu_initialization = True  # the example builds on the GPU; here megatron allocates on the CPU
    torch.manual_seed(0)
    model = provider.build_gpt_model(args, config, use_te=False)
    block = model.decoder.layers[0]
    stds = [weight.float().std().item() for weight in (
        model.embedding.word_embeddings.weight, block.self_attention.linear_qkv.weight, block.mlp.linear_fc1.weight,
        block.self_attention.linear_proj.weight, block.mlp.linear_fc2.weight, model.output_layer.weight)]
    assert stds == pytest.approx([1.0, 0.0134, 0.0134, 0.0134 / 8, 0.0134 / 8, 0.0134], rel=0.05)


MOE = ["--num-experts", "8"]
"""The least MoE launch."""


@pytest.mark.parametrize("flags, message", [
    (["--moe-router-topk", "4", "--moe-grouped-gemm"],
     "--moe-router-topk --moe-grouped-gemm shape MoE layers: add --num-experts N, or drop them"),
    ([*MOE, "--moe-router-topk", "9"], "--moe-router-topk 9: give 1 to --num-experts 8"),
    ([*MOE, "--moe-layer-freq", "[0,1,1]"], "give one 0 (dense) or 1 (MoE) per layer of --num-layers 4"),
    ([*MOE, "--moe-layer-freq", "5"], "--moe-layer-freq 5: give 1 to --num-layers 4"),
    ([*MOE, "--moe-router-enable-expert-bias"], "biases sigmoid scores (megatron refuses it on softmax)"),
    ([*MOE, "--moe-router-bias-update-rate", "0.01"], "add --moe-router-enable-expert-bias, or drop it"),
    ([*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"], "orders softmax scores"),
    ([*MOE, "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-load-balancing-type none leaves out"),
    ([*MOE, "--moe-router-padding-for-quantization"],
     "after an alltoall or flex dispatch: add --fp8-format --moe-token-dispatcher-type alltoall"),
    ([*MOE, "--moe-shared-expert-intermediate-size", "0"], "--moe-shared-expert-intermediate-size 0: give a positive"),
    ([*MOE, "--moe-layer-freq", "[0]+__import__"], "argument --moe-layer-freq: invalid moe_freq_type value"),
    (["--lr-warmup-iters", "50", "--train-iters", "50"], "leaves no step after the warm-up"),
    (["--clip-grad", "0"], "--clip-grad 0.0: give a positive norm"),
    (["--embedding-init-method-std", "0"], "--embedding-init-method-std: give a positive standard deviation"),
    (["--lr-warmup-init", "0.01"], "--lr-warmup-init 0.01: give 0 to --lr 0.001"),
    (["--hidden-size", "0"], "--hidden-size 0: give a positive number"),
    (["--fp8-recipe", "rowwise"], "invalid choice: 'rowwise'"),
    ([], "needs a CUDA GPU"),
])
def test_train_py_refuses_before_any_compute(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        train.main(flags)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.strip().splitlines()[-1].startswith(f"{train.PROG}: error:")


def test_train_py_refuses_to_overwrite_evidence_before_any_compute(tmp_path, capsys, monkeypatch):
    args = train.parse_args(["--out-dir", str(tmp_path)])
    existing = run_folder(train.evidence_stem(args), tmp_path) / f"{train.evidence_stem(args)}.json"
    existing.parent.mkdir(parents=True)
    existing.write_text(json.dumps({"kept": True}))
    with pytest.raises(SystemExit) as exit_:
        train.main(["--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "pass --force" in capsys.readouterr().err
    assert json.loads(existing.read_text()) == {"kept": True}
