"""training_defaults: lr by width and warm-up by run length, and a 300-step BF16 run on them that never spikes."""

import pytest

from fp8stack.models import load_model_config
from fp8stack.models.training_defaults import training_defaults
from fp8stack.plan import load_description
from fp8stack.config import from_overrides
from fp8stack.train.loop import train


def test_lr_falls_as_one_over_width_through_gpt3_small_s():
    tiny, wide = load_model_config("tiny"), load_model_config("llama-1b-like")
    assert training_defaults(tiny, 300).lr * tiny.dim == pytest.approx(6e-4 * 768)
    assert training_defaults(wide, 300).lr * wide.dim == pytest.approx(6e-4 * 768)
    # GPT-3 6.7B (width 4096) trained at 1.2e-4: the rule lands within 10% of it.
    assert training_defaults(wide, 300).lr == pytest.approx(1.2e-4, rel=0.1)
    assert training_defaults(wide, 300).min_lr == pytest.approx(training_defaults(wide, 300).lr / 10)


@pytest.mark.parametrize("steps, warmup", [(3000, 300), (300, 30), (100, 20), (40, 20), (12, 6), (1, 0)])
def test_warmup_is_a_tenth_of_the_run_at_least_20_steps_at_most_half(steps, warmup):
    assert training_defaults(load_model_config("tiny"), steps).warmup == warmup


def test_a_description_gives_the_defaults_of_its_config():
    assert training_defaults(load_description("llama3-8b"), 40) == training_defaults(load_model_config("llama3-8b"), 40)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        training_defaults(load_model_config("tiny"), 0)
    no_embedding = load_description("tiny")
    no_embedding = type(no_embedding)(name="x", seq_len=8, components=no_embedding.components[1:])
    with pytest.raises(ValueError, match="x has no embedding component to read its width from"):
        training_defaults(no_embedding, 10)


@pytest.mark.slow
def test_300_bf16_steps_of_tiny_on_the_defaults_descend_without_a_spike():
    """The CPU runs the bf16 arm in FP32 activations; a smaller micro-batch than the trainer's (noisier steps) keeps
    the run short."""
    defaults = training_defaults(load_model_config("tiny"), 300)
    result = train(from_overrides({"model.name": "tiny", "precision.recipe": "bf16", "training.device": "cpu",
                                   "training.steps": 300, "training.micro_batch": 4, "training.eval_batches": 0,
                                   "logging.progress": False}))
    assert (result.config["optimizer"]["lr"], result.config["optimizer"]["warmup"]) == (defaults.lr, defaults.warmup)
    losses = result.losses
    assert max(losses[1:]) < losses[0], f"step {losses.index(max(losses[1:]))} spiked above the first loss"
    assert losses[-1] < losses[0] / 2
