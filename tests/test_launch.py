"""The torchrun wrappers in launch/: two gloo processes on the CPU, and the environment they export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8stack.train.command import job_from_flags
from fp8stack.train.launch import NO_MULTICAST_ENV, on_gpu
from fp8stack.train.loop import train

ROOT = Path(__file__).resolve().parents[1]


def launch_env(port: int) -> dict:
    # The fault handler prints each thread's Python stack if a worker dies of a signal.
    return {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "MASTER_PORT": str(port), "PYTHONFAULTHANDLER": "1"}


def workers_output(stderr: str) -> str:
    """What the workers printed last, without torchrun's own failure summary (which names no cause)."""
    summary = stderr.find("/distributed/elastic/multiprocessing/api.py")  # torchrun's first line after a death
    return stderr[:stderr.rfind("\n", 0, summary) if summary >= 0 else len(stderr)][-4000:]


@pytest.mark.slow
def test_train_sh_runs_two_processes_with_megatron_style_flags(tmp_path):
    done = subprocess.run(["launch/train.sh", "--model", "tiny", "--fp8-recipe", "tensorwise", "--fp8-format", "hybrid",
                           "--train-iters", "2", "--micro-batch-size", "2", "--tensorboard-dir", str(tmp_path)],
                          cwd=ROOT, env=launch_env(29613), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, workers_output(done.stderr)
    assert "step 2/2" in done.stdout
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 2  # rank 0 logs, once per step


TP_LOSS_RTOL = 1e-4
"""Tensor parallel vs one process, per step. torchao rowwise scales each rank's slice of a row on its
own, so FP8 rounds a little differently (observed 1e-5 after 3 steps at lr 2e-3 warmed up over 4 steps; 1.1e-4 at
the full 1.8e-3 from the second step); a wrong shard gives O(1)."""


@pytest.mark.slow
def test_train_sh_tensor_parallel_matches_one_process(tmp_path):
    """--tensor-model-parallel-size 2 over two gloo processes (--no-fused-projections) trains as one
    process does. FP8 here is rowwise: tensorwise layers get torchao's Float8 TP styles, whose float8
    all-gathers gloo refuses (tests/test_fsdp_gloo.py; their NCCL run: tests/gpu/test_tp_float8_gpu.py)."""
    flags = ["--model", "tiny", "--no-fused-projections", "--fp8-recipe", "rowwise", "--device", "cpu",
             "--train-iters", "3", "--micro-batch-size", "2", "--seq-length", "64", "--eval-iters", "0",
             "--lr", "2e-3", "--lr-warmup-iters", "4"]
    done = subprocess.run(["launch/train.sh", *flags, "--tensor-model-parallel-size", "2",
                           "--result-json", str(tmp_path / "tp.json")],
                          cwd=ROOT, env=launch_env(29615), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, workers_output(done.stderr)
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["world_size"] == 2 and tp["config"]["parallelism"]["tensor_parallel"] == 2
    one = train(job_from_flags(([*flags, "--no-progress"])))
    assert len(tp["losses"]) == len(one.losses) == 3
    for step, (a, b) in enumerate(zip(one.losses, tp["losses"])):
        assert abs(a - b) <= TP_LOSS_RTOL * abs(a), f"step {step}: 1 process {a:.6f} vs TP=2 {b:.6f}"


DDP_LOSS_RTOL = 2e-3
"""DDP on 2 ranks vs one process, per step, with BF16 parameters: the FP32 gradients of the same global batch agree up
to summation order, so the BF16 copies of the masters differ only where a value lies near a rounding boundary (as in
tests/test_train_data_parallel.py, whose docstring gives the observed gaps)."""


@pytest.mark.slow
def test_train_sh_ddp_with_bf16_parameters_matches_one_process(tmp_path):
    """--parallelism.data-parallel ddp with --param-dtype bf16 (FP32 masters whose main_grads are averaged over the
    replicas once per step) on two gloo processes trains as one process on the same global batch: 8 sequences, 2
    micro-batches per rank, 4 in one process."""
    flags = ["--model", "tiny", "--fp8-recipe", "bf16", "--device", "cpu", "--dtype", "bf16", "--param-dtype", "bf16",
             "--train-iters", "4", "--lr-warmup-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--seq-length", "32", "--eval-iters", "0", "--max-data-bytes", str(1 << 20)]
    done = subprocess.run(["launch/train.sh", *flags, "--parallelism.data-parallel", "ddp",
                           "--result-json", str(tmp_path / "ddp.json")],
                          cwd=ROOT, env=launch_env(29617), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, workers_output(done.stderr)
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    assert ddp["world_size"] == 2 and ddp["config"]["parallelism"]["data_parallel"] == "ddp"
    one = train(job_from_flags([*flags, "--no-progress"]))
    assert one.losses[-1] < one.losses[0]
    for what, ones, twos in (("loss", one.losses, ddp["losses"]), ("gradient norm", one.grad_norms, ddp["grad_norms"])):
        assert len(ones) == len(twos) == 4
        for step, (a, b) in enumerate(zip(ones, twos)):
            assert abs(a - b) <= DDP_LOSS_RTOL * abs(a), f"{what}, step {step}: 1 process {a:.6f} vs DDP {b:.6f}"


def test_launch_env_keeps_nvlink_multicast_off_as_the_tools_children_do():
    shown = subprocess.run(["bash", "-c", "source launch/env.sh && env"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert set(NO_MULTICAST_ENV) == {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"}
    for name, value in NO_MULTICAST_ENV.items():
        assert f"{name}={value}" in shown


def test_ab_sh_passes_its_flags_through():
    done = subprocess.run(["launch/ab.sh", "--help"], cwd=ROOT, env=launch_env(29614), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--recipes" in done.stdout


def test_a_child_s_gpu_counts_among_the_gpus_this_process_sees(monkeypatch):
    """on_gpu: with CUDA_VISIBLE_DEVICES inherited (a scheduler gave this process GPUs 2 and 3), GPU 1 is device 3 and
    GPU 2 does not exist; without it the number is the device; a UUID passes as it is."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert on_gpu(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert on_gpu("1") == {"CUDA_VISIBLE_DEVICES": "3"} and on_gpu(0) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert on_gpu("GPU-d4a16625") == {"CUDA_VISIBLE_DEVICES": "GPU-d4a16625"}
    with pytest.raises(ValueError, match="GPU 2: CUDA_VISIBLE_DEVICES=2,3 leaves 2 GPU"):
        on_gpu(2)
