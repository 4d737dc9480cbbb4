"""fp8stack.bench.profile_script --memory on a GPU: a script's first profiled step's allocations recorded, their peak
and the place in the script that held the most of it named (the CPU tests replay a made-up trace:
tests/test_profile_script.py). Run with `pytest -m gpu tests/gpu/test_profile_script_gpu.py`."""

import json
import subprocess
import sys

import pytest

from gpu_skips import require_cuda

pytestmark = pytest.mark.gpu

require_cuda()

CUDA_TRAIN = '''"""Two GPU linears, AdamW, 6 steps; each step keeps 256 MiB of activation alive to its backward."""
import torch

model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    wide = torch.randn(16384, 4096, device="cuda", requires_grad=True)  # 256 MiB in FP32, live until backward
    model(wide).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
'''


def test_memory_names_the_scripts_line_holding_the_peak(tmp_path):
    (tmp_path / "cuda_train.py").write_text(CUDA_TRAIN)
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, "-m", "fp8stack.bench.profile_script", "--warmup-steps", "2", "--steps", "2",
                          "--memory", "--out", str(out), "--", "cuda_train.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    memory = json.loads(out.read_text())["memory"]
    assert memory["baseline_gib"] > 0.25, "parameters, gradients and AdamW's moments were allocated before the window"
    assert memory["peak_gib"] >= memory["baseline_live_gib"] + 0.25
    sites = {site["site"]: site["gib"] for site in memory["sites"]}
    assert any(site.startswith("cuda_train.py:") for site in sites), sites
    assert "Memory of the first profiled step" in run.stdout and "| cuda_train.py:" in run.stdout
