"""examples/megatron/train.py on a GPU as a user runs it: the model_provider's GPTModel, FP8 delayed scaling
(--fp8-format hybrid --fp8-recipe delayed, read into fp8stack's plan), trained 50 steps by megatron-core's
schedule, DDP and optimizer on tiny shapes; every layer runs the plan's FP8 class and the loss descends.
Run with `pytest -m gpu tests/gpu/test_megatron_example_gpu.py`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

REPO = Path(__file__).resolve().parents[2]
STEPS = 50
DESCENT = 0.8
"""The mean loss of the last tenth of the steps is below this share of the first step's. Byte tokens start near
ln(256) = 5.5; the stdlib's sources take a tiny model well under 4.4 within 50 steps at this learning rate, while a
model whose FP8 weights never update (a missed set_is_first_microbatch) or whose gradients are dropped stays flat."""


def test_train_py_trains_fp8_delayed_with_megatrons_loop(tmp_path):
    command = [sys.executable, "examples/megatron/train.py", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
               "--train-iters", str(STEPS), "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "768",
               "--seq-length", "256", "--micro-batch-size", "8", "--out-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [evidence] = (tmp_path / "runs").glob("*/example-megatron-delayed-hybrid-*.json")
    record = json.loads(evidence.read_text())
    assert record["layers"] == ["FP8DelayedTransformerLayer"] * 4
    assert record["recipe"] == "delayed" and record["plan"]["fp8_gemms"] == 4 * 4  # qkv, proj, fc1, fc2 per layer
    assert {"commit", "dirty"} <= set(record)
    losses = record["losses"]
    assert len(losses) == STEPS and all(loss == loss for loss in losses)
    final = sum(losses[-STEPS // 10:]) / (STEPS // 10)
    assert final < DESCENT * losses[0], f"loss {losses[0]:.3f} -> {final:.3f} over {STEPS} steps: {losses}"
