"""The torchrun wrappers in launch/: two gloo processes on the CPU, and the environment they export."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch_env(port: int) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "MASTER_PORT": str(port)}


@pytest.mark.slow
def test_train_sh_runs_two_processes_with_megatron_style_flags(tmp_path):
    done = subprocess.run(["launch/train.sh", "--model", "tiny", "--fp8-recipe", "tensorwise", "--fp8-format", "hybrid",
                           "--train-iters", "2", "--micro-batch-size", "2", "--tensorboard-dir", str(tmp_path)],
                          cwd=ROOT, env=launch_env(29613), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2/2" in done.stdout
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 2  # rank 0 logs, once per step


def test_launch_env_keeps_nvlink_multicast_off():
    shown = subprocess.run(["bash", "-c", "source launch/env.sh && env"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for setting in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert setting in shown


def test_ab_sh_passes_its_flags_through():
    done = subprocess.run(["launch/ab.sh", "--help"], cwd=ROOT, env=launch_env(29614), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--recipes" in done.stdout
