"""The megatron peer of fp8stack.bench.peers on a GPU at tiny shapes: examples/megatron/train.py with megatron's own TE
layer spec, pretrain_gpt's fusions and two micro-batches per step trains (BF16, and delayed with FP8 weights gathered
from the distributed optimizer) and writes the result the bench reads; then the bench runs one arm per stack, and with
2 GPUs every arm as a torchrun job of 2 processes (megatron's DDP with overlap, torchtitan's FSDP2 with the FP8
all-gather and precomputed scales gloo cannot run, fp8stack's FSDP2 and DDP); and each stack with --recompute full.
Run with `pytest -m gpu tests/gpu/test_peers_gpu.py`."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_skips import require_te

from fp8stack.bench.peers import ARMS, FULL_RECOMPUTE

pytestmark = pytest.mark.gpu

require_te(["delayed"])

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
DESCENT = 0.8
"""The mean loss of the last tenth of the steps is below this share of the first step's (as the example's own GPU
test: byte tokens start near ln(256) = 5.5 and a tiny model trains well below 4.4 in 30 steps at this LR)."""


@pytest.mark.parametrize("flags", [[], ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-param-gather",
                                        "--use-distributed-optimizer"]])
def test_megatron_spec_trains_with_accumulation_and_writes_the_result(flags, tmp_path):
    result = tmp_path / "result.json"
    command = [sys.executable, "examples/megatron/train.py", "--layer-spec", "megatron", "--bias-swiglu-fusion",
               "--rope-fusion", "--bias-dropout-fusion", "--num-layers", "4", "--hidden-size", "256",
               "--ffn-hidden-size", "768", "--seq-length", "256", "--vocab-size", "512", "--rotary-base", "500000",
               "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", str(STEPS),
               "--lr-warmup-iters", "5", "--result-json", str(result), *flags]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    measured = json.loads(result.read_text())
    assert measured["layers"] == ["TransformerLayer"] * 4  # megatron's own, not fp8stack's plan-driven classes
    assert measured["tokens_per_step"] == 16 * 256
    assert len(measured["step_ms"]) == len(measured["losses"]) == STEPS and measured["peak_mem_gib"] > 0
    losses = measured["losses"]
    final = sum(losses[-STEPS // 10:]) / (STEPS // 10)
    assert final < DESCENT * losses[0], f"loss {losses[0]:.3f} -> {final:.3f} over {STEPS} steps: {losses}"


def test_the_bench_measures_one_arm_per_stack(tmp_path):
    arms = "megatron-delayed,torchtitan-tensorwise,fp8stack-delayed"
    command = [sys.executable, "-m", "fp8stack.bench.peers", "--model", "tiny", "--micro-batch", "8",
               "--global-batch", "16", "--steps", "8", "--arms", arms, "--out-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [evidence] = (tmp_path / "runs").glob("*/peers-tiny-*.json")
    record = json.loads(evidence.read_text())
    assert [a["arm"] for a in record["arms"]] == arms.split(",")
    for arm in record["arms"]:
        assert arm["status"] == "ok" and arm["tokens_per_s"] > 0 and arm["peak_mem_gib"] > arm["resident_mem_gib"] > 0
    speed, memory = record["checks"]
    assert speed["met"] is not None and memory["met"] is not None


def test_every_stack_trains_with_every_block_recomputed(tmp_path):
    """--recompute full: megatron's full recompute in FP8 (TE's checkpoint) and in BF16 (its
    tensor_parallel.checkpoint), torchtitan's checkpoint_wrapper around compiled tensorwise blocks, fp8stack's block
    recompute on TE."""
    arms = "megatron-delayed,megatron-bf16,torchtitan-tensorwise,fp8stack-delayed"
    command = [sys.executable, "-m", "fp8stack.bench.peers", "--model", "tiny", "--micro-batch", "8",
               "--global-batch", "16", "--steps", "8", "--recompute", "full", "--arms", arms,
               "--out-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [evidence] = (tmp_path / "runs").glob("*/peers-tiny-recompute-full-*.json")
    record = json.loads(evidence.read_text())
    assert record["shape"]["recompute"] == "full" and [a["arm"] for a in record["arms"]] == arms.split(",")
    for arm in record["arms"]:
        assert arm["status"] == "ok", f"{arm['arm']}: {arm.get('error') or arm.get('reason')}"
        flags = list(FULL_RECOMPUTE[arm["stack"]])
        assert arm["command"][-2 - len(flags):-2] == flags
        assert all(map(math.isfinite, arm["losses"])) and arm["peak_mem_gib"] > arm["resident_mem_gib"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: --nproc 2 runs each arm on 2 processes")
def test_the_bench_runs_every_arm_on_two_gpus(tmp_path):
    command = [sys.executable, "-m", "fp8stack.bench.peers", "--nproc", "2", "--model", "tiny", "--micro-batch", "4",
               "--global-batch", "16", "--steps", "8", "--out-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [evidence] = (tmp_path / "runs").glob("*/peers-tiny-2gpu-*.json")
    record = json.loads(evidence.read_text())
    assert record["shape"]["nproc"] == 2 and [a["arm"] for a in record["arms"]] == list(ARMS)
    for arm in record["arms"]:
        assert arm["status"] == "ok", f"{arm['arm']}: {arm.get('error') or arm.get('reason')}"
        assert arm["command"][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        assert arm["tokens_per_s_per_gpu"] == pytest.approx(arm["tokens_per_s"] / 2)
        assert arm["peak_mem_gib"] > arm["resident_mem_gib"] > 0
        assert len(arm["losses"]) == 8 and all(map(math.isfinite, arm["losses"]))
        assert arm["losses"][-1] < arm["losses"][0], f"{arm['arm']} did not train: {arm['losses']}"
    speed, memory = record["checks"]
    assert speed["met"] is not None and memory["met"] is not None
