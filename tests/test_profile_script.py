"""fp8stack.bench.profile_script on a CPU: a user's own training script (and a module) profiled between its optimizer
steps, unchanged; too few steps refused; and `fp8stack.bench.own_model --profile` giving each arm its breakdown
beside the timed run's tokens/s. Bad options: tests/test_bad_inputs.py."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from fp8stack.bench import own_model
from fp8stack.bench.profile_script import main
from fp8stack.evidence import markdown_table, run_folder
from fp8stack.profile import CATEGORIES, memory_at_peak, memory_table

TINY_TRAIN = '''"""A user's training script: two linears with biases, AdamW, --steps optimizer steps."""
import sys
import time

import torch

from helper import batch  # beside the script: the script's folder is on sys.path, as `python tiny_train.py` has it

assert __name__ == "__main__" and sys.argv[0].endswith("tiny_train.py"), (__name__, sys.argv)
# The wrapper imported fp8stack before torch, so the script's own `import fp8stack` would not load the backends'
# libraries (TE's cuDNN before torch's): the wrapper has loaded them before the script's first kernel.
assert "fp8stack.assembly" in sys.modules
steps = int(sys.argv[sys.argv.index("--steps") + 1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(steps):
    with torch.profiler.record_function("load_batch"):  # host time of its own: the Python a data loader runs
        time.sleep(0.005)
        x = batch()
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"trained {steps} steps")
'''


@pytest.fixture
def script(tmp_path) -> Path:
    (tmp_path / "helper.py").write_text("import torch\n\n\ndef batch():\n    return torch.randn(16, 32)\n")
    path = tmp_path / "tiny_train.py"
    path.write_text(TINY_TRAIN)
    return path


def _host_ops(profile: dict) -> dict[str, float]:
    return {op["name"]: op["calls_per_step"] for op in profile["host_ops"]}


def test_a_script_is_profiled_between_its_optimizer_steps_and_runs_to_its_end(script, tmp_path):
    out = tmp_path / "out" / "profile.json"
    run = subprocess.run([sys.executable, "-m", "fp8stack.bench.profile_script", "--warmup-steps", "2", "--steps", "5",
                          "--out", str(out), "--", script.name, "--steps", "8"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 8 steps" in run.stdout, "the script ran to its end"
    assert "Host: top ops by self CPU time per step" in run.stdout
    record = json.loads(out.read_text())
    assert (record["target"], record["steps"], record["optimizer_steps"]) == ([script.name, "--steps", "8"], 5, 8)
    profile = record["profile"]
    assert list(profile["categories"]) == list(CATEGORIES) and profile["categories"]["gemm"]["share"] > 0
    assert profile["wall_ms_per_step"] > 0 and profile["idle_ms_per_step"] is None  # no GPU: no idle time
    calls = _host_ops(profile)
    # exactly the profiled steps: each took one batch, two forward addmm and one optimizer step
    assert (calls["load_batch"], calls["aten::addmm"], calls["Optimizer.step#AdamW.step"]) == (1, 2, 1)
    selfs = [op["self_ms_per_step"] for op in profile["host_ops"]]
    assert selfs == sorted(selfs, reverse=True)


def test_a_module_is_profiled_as_python_m_runs_it(script, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "module.json"
    code = main(["--warmup-steps", "1", "--steps", "2", "--out", str(out), "--", "-m", "tiny_train", "--steps", "3"])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["target"] == ["-m", "tiny_train", "--steps", "3"] and record["profile"]["recipe"] == "-m tiny_train"
    assert _host_ops(record["profile"])["load_batch"] == 1
    assert "profiled 2 optimizer steps of -m tiny_train" in capsys.readouterr().out


def test_a_script_with_too_few_steps_is_refused_in_one_line_and_nothing_is_written(script, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["--warmup-steps", "3", "--steps", "5", "--out", str(out), "--", str(script), "--steps", "6"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1 and err.startswith("fp8stack: error: "), err
    assert "took 6 optimizer step(s), fewer than --warmup-steps 3 + --steps 5" in err


def test_a_failing_script_keeps_its_exit_status(tmp_path):
    failing = tmp_path / "fails.py"
    failing.write_text("raise SystemExit(3)\n")
    assert main(["--out", str(tmp_path / "profile.json"), "--", str(failing)]) == 3
    assert not (tmp_path / "profile.json").exists()


def test_each_arms_profiled_run_is_its_own_command_for_the_profiled_steps():
    steps = own_model.PROFILE_WARMUP_STEPS + own_model.PROFILED_STEPS
    trainer = own_model.profile_command("trainer delayed", Path("p.json"), Path("r.json"))
    wrapped = trainer[trainer.index("--") + 1:]
    assert trainer[1:3] == ["-m", "fp8stack.bench.profile_script"]
    assert wrapped == own_model.command("trainer delayed", steps, Path("r.json"))[1:]
    assert wrapped[:2] == ["-m", "fp8stack.train"] and wrapped[wrapped.index("--train-iters") + 1] == str(steps)
    script = own_model.profile_command("own fp8stack delayed", Path("p.json"), Path("r.json"))
    wrapped = script[script.index("--") + 1:]
    assert wrapped[0].endswith("train_fp8stack.py") and wrapped[wrapped.index("--steps") + 1] == str(steps)


def _tiny_cpu_command(arm: str, steps: int, result: Path) -> list[str]:
    """The arm's runner at the tiny size on a CPU: the trainer (BF16: its FP8 arms need TE) or the BF16 script."""
    if own_model.runner_and_recipe(arm)[0] == "trainer":
        return [sys.executable, "-m", "fp8stack.train", "--model", "tiny", "--device", "cpu", "--no-progress",
                "--train-iters", str(steps), "--micro-batch-size", "2", "--seq-length", "64", "--max-data-bytes",
                str(1 << 20), "--eval-iters", "0", "--result-json", str(result)]
    return [sys.executable, str(own_model.EXAMPLE / "train_bf16.py"), "--model", "tiny", "--no-compile",
            "--micro-batch", "2", "--accumulation", "1", "--seq-len", "64", "--steps", str(steps),
            "--result-json", str(result)]


def test_own_model_profile_gives_each_arm_its_breakdown_beside_the_timed_tokens_per_s(tmp_path, monkeypatch):
    monkeypatch.setattr(own_model, "command", _tiny_cpu_command)
    assert own_model.main(["--arms", "trainer delayed,own bf16", "--steps", "4", "--profile",
                           "--out-dir", str(tmp_path)]) == 0
    folder = run_folder("own-model-cpu", tmp_path)
    record = json.loads((folder / "own-model-cpu.json").read_text())
    assert record["profile"] == {"warmup_steps": own_model.PROFILE_WARMUP_STEPS, "steps": own_model.PROFILED_STEPS,
                                 "memory": False}
    for arm in record["arms"]:
        assert arm["tokens_per_s"] > 0 and len(arm["step_ms"]) == 4, "tokens/s from the timed run, unprofiled"
        assert "fp8stack.bench.profile_script" not in arm["command"]
        assert "profile_error" not in arm, arm.get("profile_error")
        assert list(arm["profile"]["categories"]) == list(CATEGORIES)
        assert _host_ops(arm["profile"])["aten::mm"] > 0  # the GEMMs: the most self CPU time on a CPU
    trainer = record["arms"][0]["profile_command"]
    assert trainer[trainer.index("--") + 1:][:2] == ["-m", "fp8stack.train"]
    markdown = (folder / "own-model-cpu.md").read_text()
    assert (folder / "own-model-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the arms' bars (save_figure)
    assert "## Where each arm's step goes (--profile)" in markdown
    assert "| category | trainer delayed ms/step | own bf16 ms/step |" in markdown
    for section in ("### trainer delayed", "### own bf16"):
        host = markdown.split(section)[1].split("###")[0]
        assert "Host: top ops by self CPU time per step" in host and "| aten::mm |" in host
    # --memory (a GPU's) adds each arm's first profiled step's memory peak: its section, from the arm's record
    assert "--memory" in own_model.profile_command("own bf16", tmp_path / "p.json", tmp_path / "r.json", memory=True)
    record["arms"][1]["memory"] = asdict(memory_at_peak([_event("alloc", 1, 2**30, "model.py")], 2**30))
    rendered = own_model.render(record)
    assert "### own bf16: memory of its first profiled step (--memory)" in rendered
    assert "| model.py:7 fn | 1.000 | 1 |" in rendered


def test_own_model_memory_needs_profile(capsys):
    with pytest.raises(SystemExit) as refused:
        own_model.main(["--memory"])
    assert refused.value.code == 2
    assert "--memory records the profiled runs' allocations: add --profile" in capsys.readouterr().err


def _event(action: str, addr: int, size: int, *files: str) -> dict:
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": f, "line": 7, "name": "fn"} for f in files]}


def test_memory_at_peak_replays_the_trace_and_names_the_first_frame_outside_torch():
    """The peak of baseline + allocations - frees, and what was live then by site: a free of an allocation made before
    the record comes out of the baseline; torch's own frames are skipped; later allocations do not count."""
    gib = 2**30
    te = "/venv/lib/python3.12/site-packages/transformer_engine/pytorch/module/linear.py"
    torch_frame = "/venv/lib/python3.12/site-packages/torch/nn/functional.py"
    events = [_event("alloc", 1, 2 * gib, torch_frame, te),
              _event("free_completed", 99, gib),  # allocated before the record
              _event("alloc", 2, gib, torch_frame),
              _event("segment_alloc", 5, 8 * gib),
              _event("alloc", 3, gib, te),
              _event("free_requested", 2, gib),
              _event("free_completed", 2, gib),
              _event("alloc", 4, gib // 2, te)]  # peak: baseline 10 - 1 + 2 + 1 + 1 = 13 GiB, before the last free
    peak = memory_at_peak(events, 10 * gib)
    assert (peak.peak_gib, peak.baseline_gib, peak.baseline_live_gib, peak.events) == (13, 10, 9, 8)
    assert [(s.site, s.gib, s.allocations) for s in peak.sites] == [
        ("transformer_engine/pytorch/module/linear.py:7 fn", 3, 2), ("torch: fn", 1, 1)]
    table = memory_table(peak, markdown_table)
    assert "Allocated at the peak: 13.00 GiB; 10.00 GiB were allocated when the record began" in table
    assert "| transformer_engine/pytorch/module/linear.py:7 fn | 3.000 | 2 |" in table
