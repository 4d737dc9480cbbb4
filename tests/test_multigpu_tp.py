"""fp8stack.bench.multigpu_tp on a CPU: every arm's launch flags make a valid JobConfig at TP=1 and TP=2, the
gaps are computed as documented, and without two GPUs run_tp says so instead of running. The runs themselves
need two GPUs (`python -m fp8stack.bench.multigpu_tp`)."""

import pytest
import torch

from fp8stack.bench import multigpu_tp
from fp8stack.bench.launches import LOSS_RTOL, Run, compare_losses, run_record
from fp8stack.bench.multigpu import render
from fp8stack.train.command import job_from_flags


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arm", multigpu_tp.ARMS, ids=lambda arm: arm.name)
def test_every_arms_flags_make_a_valid_job_config(arm, tp):
    cfg = job_from_flags(multigpu_tp.train_flags(arm, tp, 20))
    assert (cfg.model.name, cfg.parallelism.tensor_parallel, cfg.training.steps, cfg.training.seq_len) == (
        multigpu_tp.MODEL, tp, 20, multigpu_tp.SEQ)
    assert cfg.precision.recipe in ("tensorwise", "delayed")
    assert cfg.model.impl == "megatron" or (not cfg.model.fused_projections and cfg.precision.backend == "torchao")


def test_compare_losses_gives_the_documented_gaps():
    reference = {"losses": [10.0, 8.0, 6.0, 4.0], "grad_norms": [2.0, 1.0, 1.0, 1.0]}
    run = {"losses": [10.01, 8.4, 6.0, 4.2], "grad_norms": [2.1, 1.0, 1.0, 1.0]}
    gaps = compare_losses(reference, run)
    assert gaps["first_loss_rel_gap"] == pytest.approx(0.001) and gaps["max_step_rel_gap"] == pytest.approx(0.05)
    assert gaps["final_window"] == 1 and gaps["final_rel_gap"] == pytest.approx(0.05)
    assert gaps["first_grad_norm_rel_gap"] == pytest.approx(0.05)
    assert (gaps["loss_final_mean_reference"], gaps["loss_final_mean"]) == (4.0, 4.2)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs are visible: run_tp would really run")
def test_run_tp_without_two_gpus_fails_its_check_without_running(tmp_path):
    found = multigpu_tp.run_tp(tmp_path, 20)
    assert found["checks"] == {"two GPUs visible": False} and "run on two" in found["error"]
    assert not any(tmp_path.iterdir())


def _run(losses: list[float], world_size: int, returncode: int = 0) -> Run:
    result = {"losses": losses, "grad_norms": [2.0] * len(losses), "tokens_per_s": 1.0, "world_size": world_size,
              "device": "cpu", "plan_summary": {"fp8_gemms": 4}, "step_ms": [1.0] * len(losses),
              "peak_mem_gib": None, "first_step": 0}
    ok = returncode == 0
    return Run("arm", "launch/train.sh ...", returncode, 1.0, result if ok else None, [], "" if ok else "boom")


def test_judge_passes_matching_runs_and_fails_a_parted_or_missing_one():
    steps, base = 8, [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    runs = {(arm.name, tp): run_record(_run(base, tp)) for arm in multigpu_tp.ARMS for tp in (1, 2)}
    parted, missing = multigpu_tp.ARMS[0].name, multigpu_tp.ARMS[1].name
    runs[parted, 2] = run_record(_run(base[:-2] + [4.5, 3.5], 2))
    runs[missing, 2] = run_record(_run([], 2, returncode=1))
    arms, checks = multigpu_tp.judge(runs, steps)
    failed = {name for name, ok in checks.items() if not ok}
    assert failed == {f"{parted}, TP=2 vs TP=1: mean loss of the last 2 steps within {LOSS_RTOL:.0%}",
                      f"{missing}: TP=1 and TP=2 ran {steps} steps"}
    assert arms[missing]["tp2"]["log_tail"] == "boom" and "comparison" not in arms[missing]
    assert arms[multigpu_tp.ARMS[2].name]["comparison"]["final_rel_gap"] == 0.0
    part = {"model": "m", "seq_len": 8, "micro_batch": 1, "steps": steps, "arms": arms, "checks": checks}
    text = render({"passed": False, "gpus": 2, "commands": [], "tensor_parallel": part})
    assert f"| {parted} | 3.5000 | 4.0000 | 14.29% | 0.000% |" in text and f"| {missing} |" not in text
