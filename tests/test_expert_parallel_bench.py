"""fp8stack.bench.expert_parallel on a CPU: every run's launch flags make a valid JobConfig at EP=1 and EP=2 (refused
at EP=2 on fewer processes), the judging and the evidence's Markdown from synthetic run records, and without two GPUs
the bench says so instead of running. The runs themselves need two GPUs (`python -m fp8stack.bench.expert_parallel`).
"""

import pytest
import torch

from fp8stack.bench import expert_parallel
from fp8stack.bench.launches import FIRST_LOSS_RTOL, LOSS_RTOL, Run, run_record
from fp8stack.train.command import job_from_flags
from fp8stack.train.command import main as train_main
from fp8stack.train.loop import resolve_job

STEPS = 8
EP = expert_parallel.EXPERT_PARALLEL


@pytest.mark.parametrize("degree", [1, EP])
@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "delayed"])
@pytest.mark.parametrize("model", list(expert_parallel.MODELS))
def test_every_runs_flags_make_a_valid_job_config(model, recipe, degree, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(degree))  # launches.start's NPROC
    cfg = resolve_job(job_from_flags(expert_parallel.train_flags(model, recipe, degree, 20, seed=3)))
    batch = expert_parallel.MODELS[model]
    assert (cfg.model.impl, cfg.model.name, cfg.precision.recipe, cfg.parallelism.expert_parallel) == (
        "megatron", model, recipe, degree)
    assert (cfg.training.seq_len, cfg.training.micro_batch, cfg.training.global_batch) == (
        batch.seq_len, batch.micro_batch, batch.global_batch)
    assert (cfg.training.steps, cfg.training.seed, cfg.optimizer.warmup, cfg.training.eval_batches) == (20, 3, 5, 0)
    assert cfg.logging.profile_collectives == expert_parallel.PROFILED_STEPS


def test_a_split_run_on_one_process_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train_main(expert_parallel.train_flags("tiny-moe", "bf16", EP, 20, seed=0)) == 2
    assert "must divide the 1 data-parallel rank(s)" in capsys.readouterr().err


def test_bad_steps_are_refused_before_anything_runs(capsys, tmp_path):
    with pytest.raises(SystemExit) as ended:
        expert_parallel.main(["--steps", "3", "--out-dir", str(tmp_path)])
    assert ended.value.code == 2 and "--steps 3: pass at least 8" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs are visible: the bench would really run")
def test_without_two_gpus_the_bench_fails_its_check_without_running(tmp_path):
    found = expert_parallel.run_expert_parallel(tmp_path, "tiny-moe", "blockwise", STEPS)
    assert found["checks"] == {"two GPUs visible": False} and "run on two" in found["error"]
    assert found["fp8_dispatch"] == expert_parallel.FP8_DISPATCH
    assert not any(tmp_path.iterdir())


def dispatching(calls: float, by_dtype: dict[str, float]) -> dict:
    """comm_stats' record of a run whose profiled steps issued `calls` all-to-alls per step sending `by_dtype`."""
    return {"steps": 2, "counts": {"all_reduce": 1.0, **({"all_to_all": calls} if calls else {})},
            "bytes": {"all_to_all": sum(by_dtype.values())} if calls else {}, "all_to_all_bytes_by_dtype": by_dtype}


def record(losses: list[float], world_size: int, fp8_gemms: int, collectives: dict | None,
           returncode: int = 0) -> dict:
    """launches.run_record of a run that wrote these figures (or failed, without them)."""
    result = {"losses": losses, "grad_norms": [2.0] * len(losses), "tokens_per_s": 1000.0 * world_size,
              "world_size": world_size, "device": "NVIDIA H200", "plan_summary": {"fp8_gemms": fp8_gemms},
              "step_ms": [10.0] * len(losses), "peak_mem_gib": 40.0 / world_size, "first_step": 0,
              "collectives": collectives}
    ok = returncode == 0
    return run_record(Run("run", f"NPROC={world_size} launch/train.sh ...", returncode, 1.0, result if ok else None,
                          [], "" if ok else "boom"))


BASE = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
BF16_TOKENS = {"c10::BFloat16": 3e6, "float": 1e5}
"""What an EP=2 run's all-to-alls send per step: its tokens in BF16, their routing weights in FP32."""


def runs(**changed: dict) -> dict:
    """Every arm's EP=1 and EP=2 records, matching, except the ones named (recipe_ep -> record)."""
    found = {("bf16", 1): record(BASE, 1, 0, dispatching(0, {})),
             ("bf16", EP): record(BASE, EP, 0, dispatching(12, BF16_TOKENS)),
             ("blockwise", 1): record(BASE, 1, 46, dispatching(0, {})),
             ("blockwise", EP): record(BASE, EP, 46, dispatching(12, {"c10::BFloat16": 3.3e6, "float": 1.1e5}))}
    for key, value in changed.items():
        recipe, _, degree = key.rpartition("_ep")
        found[recipe, int(degree)] = value
    return found


def test_matching_runs_pass_every_check_and_report_the_dispatch():
    judged = expert_parallel.judge(runs(), ["bf16", "blockwise"], STEPS)
    assert all(judged["checks"].values()), judged["checks"]
    assert len(judged["checks"]) == 2 * 8
    arm = judged["arms"]["blockwise"]
    assert arm["dispatch"] == {"calls_per_step": 12, "bytes_per_step": 3.41e6,
                               "bytes_by_dtype": {"c10::BFloat16": 3.3e6, "float": 1.1e5}}
    assert arm["tokens_per_s_ratio"] == EP and arm["comparison"]["final_rel_gap"] == 0.0
    assert judged["figures"]["fp8_over_bf16_dispatch_bytes"] == pytest.approx(3.41 / 3.1)


def test_a_parted_loss_an_fp8_dispatch_a_dispatch_at_ep1_and_a_failed_run_fail_their_checks():
    first_off = [10.0 * (1 + 2 * FIRST_LOSS_RTOL), *BASE[1:]]
    judged = expert_parallel.judge(runs(
        bf16_ep2=record(first_off, EP, 0, dispatching(12, {"c10::Float8_e4m3fn": 1.5e6, "float": 1e5})),
        blockwise_ep1=record(BASE, 1, 46, dispatching(12, BF16_TOKENS)),
        bf16_ep1=record(BASE, 1, 0, dispatching(0, {}))), ["bf16", "blockwise"], STEPS)
    failed = {name for name, ok in judged["checks"].items() if not ok}
    assert failed == {f"bf16, EP={EP} vs EP=1: first step's loss within {FIRST_LOSS_RTOL:.1%}",
                      f"bf16: EP={EP} dispatches its tokens in BF16 (no FP8 dispatch)",
                      "blockwise: EP=1 issues no all-to-all"}
    parted = expert_parallel.judge(runs(blockwise_ep2=record([*BASE[:-2], 4.5, 3.5], EP, 46, None)),
                                   ["bf16", "blockwise"], STEPS)
    failed = {name for name, ok in parted["checks"].items() if not ok}
    assert failed == {f"blockwise, EP={EP} vs EP=1: mean loss of the last 2 steps within {LOSS_RTOL:.0%}",
                      f"blockwise: EP={EP} dispatches its tokens in BF16 (no FP8 dispatch)"}
    assert "fp8_over_bf16_dispatch_bytes" not in parted["figures"]  # no collectives counted in the FP8 arm
    missing = expert_parallel.judge(runs(blockwise_ep2=record([], EP, 46, None, returncode=1)),
                                    ["bf16", "blockwise"], STEPS)
    assert not missing["checks"][f"blockwise: EP=1 and EP={EP} ran {STEPS} steps"]
    assert "comparison" not in missing["arms"]["blockwise"]


def test_the_evidence_states_the_dispatch_precision_and_every_command():
    judged = expert_parallel.judge(runs(blockwise_ep2=record([], EP, 46, None, returncode=1)), ["bf16", "blockwise"],
                                   STEPS)
    commands = [f"command {n}" for n in range(4)]
    payload = {"model": "tiny-moe", "seq_len": 256, "micro_batch": 8, "global_batch": 16, "steps": STEPS, "lr": 1e-4,
               "lr_warmup": 2, "seed": 0, "profiled_steps": 2, "fp8_dispatch": expert_parallel.FP8_DISPATCH,
               "commands": commands, "passed": False, **judged}
    text = expert_parallel.render(payload)
    assert "FP8 dispatch: not provided (issue 37): tokens travel in BF16." in text and "Overall: **FAIL**" in text
    assert "| bf16 | 2 | 2 | 2,000 | 10.0 | 20.00 | 12 | 3.1 | c10::BFloat16 3.0, float 0.1 |" in text
    assert "| blockwise | 2 | - | - | - | - | - | - | exit 1 |" in text
    assert f"| bf16 | {EP:.3f}x | 3.5000 | 3.5000 | 0.00% |" in text
    assert all(command in text for command in commands)
