"""examples/megatron on a CPU: Megatron-LM's own argument parser and config turn pretrain_gpt's flags into
fp8stack's plan, and the example's model_provider builds the GPTModel whose layers run it (megatron's local
modules: no TransformerEngine here, so BF16 plans); train.py's refusals come before any compute.
The FP8 run through megatron-core's loop is tests/gpu/test_megatron_example_gpu.py.

The GPTModels run on CPU through the two test-only shims of the conftest fixture cpu_megatron.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from fp8stack.evidence import run_folder
from fp8stack.megatron import layer_precisions
from fp8stack.plan import PlanError

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


@pytest.mark.parametrize("flags, message", [
    (["--lr-warmup-iters", "50", "--train-iters", "50"], "leaves no step after the warm-up"),
    (["--clip-grad", "0"], "--clip-grad 0.0: give a positive norm"),
    (["--hidden-size", "0"], "--hidden-size 0: give a positive number"),
    (["--fp8-recipe", "rowwise"], "invalid choice: 'rowwise'"),
    ([], "needs a CUDA GPU"),
])
def test_train_py_refuses_before_any_compute(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        train.main(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_train_py_refuses_to_overwrite_evidence_before_any_compute(tmp_path, capsys, monkeypatch):
    args = train.parse_args(["--out-dir", str(tmp_path)])
    existing = run_folder(train.evidence_stem(args), tmp_path) / f"{train.evidence_stem(args)}.json"
    existing.parent.mkdir(parents=True)
    existing.write_text(json.dumps({"kept": True}))
    with pytest.raises(SystemExit) as exit_:
        train.main(["--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "pass --force" in capsys.readouterr().err
    assert json.loads(existing.read_text()) == {"kept": True}
