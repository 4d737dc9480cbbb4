"""Learning rate and warm-up for a model's width and a run's length, so that a BF16 run descends without spikes.

The rule (AdamW, betas (0.9, 0.95), as the trainer steps):
- peak lr = 6e-4 x 768 / width. AdamW moves every weight by about lr per step, whatever its gradient's scale, so a
  hidden projection's output moves by about lr x width per step: holding lr x width fixed holds that relative
  change at every width (muP's rule for Adam on hidden matrices). The constant is GPT-3 Small's (width 768,
  lr 6e-4; Brown et al. 2020, table 2.1), whose table the rule follows: 1.1e-4 at width 4096 where GPT-3 6.7B took
  1.2e-4, 3.8e-5 at 12288 where GPT-3 175B took 6e-5.
- warm-up = 10% of the steps, at least 20 (the steps AdamW's second-moment average spans with beta2 = 0.95: until
  then a step's size is set by a few gradients), at most half the run (a short run still reaches its peak).
- min lr = lr / 10 at the end of the cosine decay.
"""

from dataclasses import dataclass

from fp8stack.models.llama import LlamaConfig
from fp8stack.plan.description import ModelDescription

REFERENCE_WIDTH = 768
"""GPT-3 Small's hidden size."""
REFERENCE_LR = 6e-4
"""GPT-3 Small's peak learning rate."""
WARMUP_FRACTION = 0.1
"""Share of the run spent warming up."""
MIN_WARMUP = 20
"""Fewest warm-up steps: 1 / (1 - beta2) with AdamW's beta2 = 0.95."""
MIN_LR_RATIO = 0.1
"""End of the cosine decay as a share of the peak."""


@dataclass(frozen=True)
class TrainingDefaults:
    """The learning-rate schedule a model of this width gets for a run of this length."""

    lr: float
    """Peak learning rate."""
    warmup: int
    """Steps of linear warm-up from 0 to lr."""
    min_lr: float
    """Learning rate at the end of the cosine decay."""
    rule: str
    """How these numbers were chosen, in words (for the run's record)."""


def training_defaults(model: LlamaConfig | ModelDescription, steps: int) -> TrainingDefaults:
    """The peak lr for the model's hidden width (its embedding's width for a description) and the warm-up for a run
    of `steps` optimizer steps, by the rule in this module's docstring."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    width = model.dim if isinstance(model, LlamaConfig) else _embedding_width(model)
    lr = REFERENCE_LR * REFERENCE_WIDTH / width
    warmup = min(max(round(WARMUP_FRACTION * steps), MIN_WARMUP), steps // 2)
    rule = (f"lr {lr:.3g} = {REFERENCE_LR:g} x {REFERENCE_WIDTH} / width {width} (GPT-3 Small's lr, scaled by 1 / "
            f"width); warm-up {warmup} = {WARMUP_FRACTION:.0%} of {steps} steps, at least {MIN_WARMUP}, at most half "
            f"the run; min lr = lr x {MIN_LR_RATIO:g}")
    return TrainingDefaults(lr=lr, warmup=warmup, min_lr=lr * MIN_LR_RATIO, rule=rule)


def _embedding_width(description: ModelDescription) -> int:
    """The hidden width of a described model: its token embedding's output features."""
    widths = [c.n for c in description.components if c.kind == "embedding"]
    if not widths:
        raise ValueError(f"{description.name} has no embedding component to read its width from: pass the LlamaConfig "
                         "or set lr and warm-up by hand")
    return widths[0]
