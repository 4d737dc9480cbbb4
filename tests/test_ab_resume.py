"""fp8stack ab --arm-checkpoints: an A/B stopped by SIGTERM keeps each running arm's steps and checkpoint, and
--continue-from resumes the arm from that checkpoint, its losses those of an uninterrupted run; bad input is refused
before any arm runs."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from fp8stack.ab import AbConfig, main
from fp8stack.ab.run import _check_arm_checkpoints, _resume_points, stitched
from fp8stack.config import from_dict
from fp8stack.evidence import run_folder
from fp8stack.train import preflight
from fp8stack.train.loop import train
from fp8stack.train.model import model_shape

STEPS = 24
FLAGS = ["--model", "tiny", "--recipes", "tensorwise", "--steps", str(STEPS), "--micro-batch", "2", "--seq-len", "64",
         "--device", "cpu", "--baseline-runs", "1", "--save-interval", "4", "--label", "stopped"]
"""bf16 and tensorwise on the CPU, a checkpoint every 4 steps; the arms log every 6 steps."""


def _evidence(out_dir, suffix: str):
    return run_folder("ab-tiny-stopped-cpu", out_dir) / f"ab-tiny-stopped-cpu{suffix}"


def _stopped_in_its_first_arm(tmp_path, checkpoints) -> int:
    """Run the A/B in a process of its own and SIGTERM its process group, as `timeout` does, once the bf16 arm has
    logged its first steps; the A/B's exit code."""
    command = [sys.executable, "-m", "fp8stack.ab", *FLAGS, "--arm-checkpoints", str(checkpoints),
               "--out-dir", str(tmp_path)]
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "PYTHONUNBUFFERED": "1"}  # the arms' log lines too
    ab = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        logged = next((line for line in ab.stdout if line.startswith("step ")), None)
        assert logged, "the A/B ended before its first arm logged a step"
        os.killpg(ab.pid, signal.SIGTERM)
        ab.stdout.read()
        return ab.wait(timeout=120)
    finally:
        if ab.poll() is None:
            os.killpg(ab.pid, signal.SIGKILL)
            ab.wait()


def test_an_ab_stopped_by_sigterm_resumes_its_arm_from_its_checkpoint(tmp_path, capsys):
    """Stopped while bf16 runs, the A/B keeps bf16's steps (pending, not judged) and its checkpoint at the step it
    stopped after; continued, bf16 resumes there, and its losses are those of the arm run uninterrupted."""
    checkpoints = tmp_path / "checkpoints"
    assert _stopped_in_its_first_arm(tmp_path, checkpoints) == 128 + signal.SIGTERM
    record = json.loads(_evidence(tmp_path, ".json").read_text())
    cut = record["runs"]["bf16"]
    assert record["complete"] is False and record["pending_arms"] == ["bf16", "tensorwise"] and record["arms"] == []
    assert 6 <= cut["stopped_after"] < STEPS and len(cut["losses"]) == cut["stopped_after"], "stopped mid-run"
    assert (checkpoints / "bf16" / f"step-{cut['stopped_after']:08d}").is_dir()
    assert (f"pending: bf16 (stopped after step {cut['stopped_after']} of {STEPS}), tensorwise"
            in _evidence(tmp_path, ".md").read_text())

    partial = tmp_path / "partial.json"
    _evidence(tmp_path, ".json").rename(partial)
    # side by side (--gpus only sets CUDA_VISIBLE_DEVICES on a CPU), which a continuation may change
    assert main([*FLAGS, "--arm-checkpoints", str(checkpoints), "--out-dir", str(tmp_path),
                 "--continue-from", str(partial), "--gpus", "0,1"]) == 0
    assert f"bf16 (24 steps, fresh process, resumed from {checkpoints / 'bf16'}" in capsys.readouterr().out
    whole = json.loads(_evidence(tmp_path, ".json").read_text())
    assert whole["complete"] and [arm["recipe"] for arm in whole["arms"]] == ["bf16", "tensorwise"]
    bf16 = whole["runs"]["bf16"]
    assert bf16["first_step"] == 0 and bf16["resumed_at"] == [cut["stopped_after"]] and bf16["stopped_after"] is None
    assert bf16["losses"][:cut["stopped_after"]] == cut["losses"] and len(bf16["step_ms"]) == STEPS
    assert bf16["tokens_per_s"] > 0 and bf16["val_loss"] is not None
    assert [c["runs"] for c in whole["continued_from"]] == [[f"bf16 (to step {cut['stopped_after']})"]]
    assert f"Runs bf16 (to step {cut['stopped_after']}) from an earlier call" in _evidence(tmp_path, ".md").read_text()
    uninterrupted = train(from_dict({**bf16["config"], "checkpoint": {}}))
    assert bf16["losses"] == uninterrupted.losses, "resumed bit-identically"
    assert not (checkpoints / "bf16").exists(), "an arm that ran all its steps keeps no checkpoint"


def _cut_run(stopped_after: int) -> dict:
    """A TrainResult dict of a run a stop cut after `stopped_after` steps, each step's loss its index."""
    steps = list(range(stopped_after))
    return {"first_step": 0, "stopped_after": stopped_after, "losses": steps, "step_ms": [10.0] * stopped_after,
            "lrs": steps, "grad_norms": steps, "router": [], "zero_fp8_weight_grads": [], "tokens_per_step": 100,
            "tokens_per_s": 1.0, "peak_mem_gib": 2.0, "max_rss_gib": 1.0, "val_loss": None}


def test_a_cut_run_resumes_from_its_newest_checkpoint_at_or_before_where_it_stopped(tmp_path, capsys):
    """A run cut after step 7 whose last checkpoint is at step 4 (a save cut short) resumes from step 4, and a
    checkpoint past step 7 (a later call killed hard) is not its; a cut run without one reruns from step 0."""
    for step in (4, 8):
        (tmp_path / "bf16" / f"step-{step:08d}").mkdir(parents=True)
    ab = AbConfig(arm_checkpoints=str(tmp_path), continue_from="partial.json")
    runs = {"bf16": _cut_run(7), "tensorwise": _cut_run(3)}
    assert _resume_points(ab, ["bf16", "tensorwise"], runs) == {"bf16": tmp_path / "bf16" / "step-00000004"}
    assert (f"tensorwise: its run in partial.json stopped after step 3, and no checkpoint at or before step 3 in "
            f"{tmp_path / 'tensorwise'}: it reruns from step 0") in capsys.readouterr().out
    resumed = {**_cut_run(6), "first_step": 4, "losses": [40, 50, 60, 70, 80, 90], "step_ms": [20.0] * 6,
               "stopped_after": None, "peak_mem_gib": 3.0, "max_rss_gib": None, "val_loss": 1.5}
    run = stitched(runs["bf16"], resumed)
    assert run["losses"] == [0, 1, 2, 3, 40, 50, 60, 70, 80, 90] and run["lrs"] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert run["first_step"] == 0 and run["resumed_at"] == [4] and run["stopped_after"] is None
    assert run["val_loss"] == 1.5 and run["peak_mem_gib"] == 3.0 and run["max_rss_gib"] == 1.0
    assert run["tokens_per_s"] == pytest.approx(100 / 20.0 * 1000)  # the median of the steady-state steps: 20 ms


def _refused(capsys, *flags: str) -> str:
    """The one line `fp8stack ab` with these flags exits 2 with."""
    assert main([*FLAGS, *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0, error
    return error


def test_bad_arm_checkpoints_are_refused_before_any_arm_runs(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = ["--out-dir", str(tmp_path / "out")]
    assert f"--arm-checkpoints {a_file} is a file, not a folder: pass a folder" in _refused(
        capsys, "--arm-checkpoints", str(a_file), *out)
    assert "drop --save and --load" in _refused(capsys, "--arm-checkpoints", str(tmp_path / "c"), "--save",
                                                 str(tmp_path / "s"), *out)
    (tmp_path / "earlier" / "tensorwise" / "step-00000004").mkdir(parents=True)
    assert (f"{tmp_path / 'earlier' / 'tensorwise'} holds checkpoints of an earlier run: pass an empty folder, or "
            "continue the A/B that wrote them with --continue-from its evidence") in _refused(
        capsys, "--arm-checkpoints", str(tmp_path / "earlier"), *out)
    assert not (tmp_path / "out").exists()


def test_arm_checkpoints_on_a_disk_without_room_for_the_arms_at_once_are_refused(tmp_path, capsys, monkeypatch):
    """A stop saves every running arm's checkpoint at once: a disk with room for one checkpoint is refused for two
    arms side by side (an arm whose save fails is lost), and taken for one arm at a time."""
    cfg = from_dict({"model": {"name": "tiny"}})
    one = preflight.checkpoint_bytes(cfg, model_shape(cfg))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * one, 9 * one,
                                                                                               one + 1))
    out = ["--out-dir", str(tmp_path / "out")]
    assert "and 2 checkpoints at once of tiny take about" in _refused(
        capsys, "--arm-checkpoints", str(tmp_path / "c"), "--gpus", "0,1", *out)
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()
    _check_arm_checkpoints(AbConfig(arm_checkpoints=str(tmp_path / "c")), cfg, model_shape(cfg))


def test_an_arm_saves_no_checkpoint_after_its_last_step():
    """The A/B's arms keep checkpoints only to resume a cut run: save_last off, the interval's saves made and kept;
    without them, only the newest stop's."""
    from fp8stack.ab.run import _checkpointed
    from fp8stack.train.loop import _checkpoint_due

    arm = _checkpointed(from_dict({"training": {"steps": 8}, "checkpoint": {"interval": 4}}), "folder", None)
    assert [step for step in range(1, 9) if _checkpoint_due(step, arm)] == [4, 8]  # 8: the interval's
    assert arm.checkpoint.keep_latest == 0, "interval saves are kept, as asked"
    arm = _checkpointed(from_dict({"training": {"steps": 8}}), "folder", None)
    assert arm.checkpoint.keep_latest == 1, "saving only at stops, a resumed arm cut again keeps only its newest"
    arm = _checkpointed(from_dict({"training": {"steps": 6}, "checkpoint": {"interval": 4}}), "folder", None)
    assert [step for step in range(1, 7) if _checkpoint_due(step, arm)] == [4]
    assert _checkpoint_due(6, from_dict({"training": {"steps": 6}})), "a plain run saves after its last step"
