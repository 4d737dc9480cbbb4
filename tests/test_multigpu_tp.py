"""fp8stack.bench.multigpu_tp on a CPU: every arm's launch flags make a valid JobConfig at TP=1 and TP=2 (alone and
data-parallel), a TP=2 x DP=2 run and its TP=1 twin read the same global batch in the same micro-batches, the gaps
are computed as documented, and without the GPUs it needs run_tp says so instead of running (the CLI refuses at
once). The runs themselves need two GPUs, four for DP=2 (`python -m fp8stack.bench.multigpu --parts tp`); the plain
path's TP=2 x DP=2 against its twin on gloo ranks: tests/test_multigpu_cpu.py."""

import inspect
from dataclasses import replace

import pytest
import torch

from fp8stack.bench import multigpu_tp
from fp8stack.bench.launches import LOSS_RTOL, Run, compare_losses, run_record
from fp8stack.bench.multigpu import main, render
from fp8stack.train.command import job_from_flags
from fp8stack.train.loop import _Distributed, _micro_batches, batches, resolve_job


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arm", multigpu_tp.ARMS, ids=lambda arm: arm.name)
def test_every_arms_flags_make_a_valid_job_config(arm, tp, dp):
    cfg = job_from_flags(multigpu_tp.train_flags(arm, tp, 20, dp=dp))
    assert (cfg.model.name, cfg.parallelism.tensor_parallel, cfg.training.steps, cfg.training.seq_len) == (
        multigpu_tp.MODEL, tp, 20, multigpu_tp.SEQ)
    assert cfg.precision.recipe in ("tensorwise", "delayed")
    assert cfg.model.impl == "megatron" or (not cfg.model.fused_projections and cfg.precision.backend == "torchao")
    assert cfg.training.micro_batch == multigpu_tp.MICRO_BATCH
    assert cfg.training.global_batch == (None if dp == 1 else dp * multigpu_tp.MICRO_BATCH)
    # The plain path's TP x DP run is FSDP2 over dp; its twin takes FSDP2 over one rank for the same precision policy.
    assert cfg.parallelism.data_parallel_one_rank == (dp > 1 and tp == 1 and cfg.model.impl == "torch")


def test_data_parallel_one_changes_no_flag_of_the_two_gpu_comparison():
    for arm in multigpu_tp.ARMS:
        for tp in (1, 2):
            flags = multigpu_tp.train_flags(arm, tp, 20, dp=1)
            assert "--global-batch-size" not in flags and "--data-parallel-one-rank" not in flags
    assert (multigpu_tp.processes(2, 1), multigpu_tp.processes(1, 1), multigpu_tp.label(1)) == (2, 1, "TP=2")
    assert (multigpu_tp.processes(2, 2), multigpu_tp.processes(1, 2), multigpu_tp.label(2)) == (4, 1, "TP=2 x DP=2")


def _step_batches(flags: list[str], world_size: int, steps: int, monkeypatch) -> dict[int, list[list[torch.Tensor]]]:
    """Rank -> per step, the micro-batches of tokens the trainer feeds that rank for a run of `flags` on world_size
    processes (loop.session's data and micro-batch split), on 1 MiB of text to stay quick."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    cfg = resolve_job(job_from_flags(flags))
    cfg = replace(cfg, data=replace(cfg.data, max_bytes=1 << 20))
    found = {}
    for rank in range(world_size):
        monkeypatch.setenv("RANK", str(rank))
        env = _Distributed(cfg)  # ranks and degrees only: no process group until entered
        micro_batches = _micro_batches(cfg, env.dp_size)
        data = batches(cfg, "train", cfg.training.micro_batch * micro_batches, env)
        found[rank] = [list(data.batch(step)[0].chunk(micro_batches)) for step in range(steps)]
    return found


@pytest.mark.parametrize("arm", multigpu_tp.ARMS, ids=lambda arm: arm.name)
def test_the_twin_accumulates_the_data_parallel_ranks_micro_batches(arm, monkeypatch):
    """At TP=2 x DP=2 each rank trains on one micro-batch; the ranks of a TP pair (consecutive ranks) on the same one,
    the two pairs on the two halves of the global batch; the TP=1 twin accumulates those halves, in that order."""
    dp, steps = 2, 2
    parallel = _step_batches(multigpu_tp.train_flags(arm, 2, steps, dp=dp), multigpu_tp.processes(2, dp), steps,
                             monkeypatch)
    twin = _step_batches(multigpu_tp.train_flags(arm, 1, steps, dp=dp), 1, steps, monkeypatch)[0]
    for step in range(steps):
        assert len(twin[step]) == dp and all(len(parallel[rank][step]) == 1 for rank in parallel)
        for rank, micro_batches in parallel.items():
            assert micro_batches[step][0].shape == (multigpu_tp.MICRO_BATCH, multigpu_tp.SEQ)
            assert torch.equal(micro_batches[step][0], twin[step][rank // 2])
        assert not torch.equal(twin[step][0], twin[step][1])


def test_megatrons_data_parallel_groups_pair_the_ranks_the_trainer_feeds_alike():
    """Megatron's DDP averages over its data-parallel groups (its default rank order, which megatron_model.build
    keeps): each holds one rank of every TP pair, so its members read the two halves of the global batch."""
    from megatron.core import parallel_state

    order = inspect.signature(parallel_state.initialize_model_parallel).parameters["order"].default
    ranks = parallel_state.RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order=order)
    assert ranks.get_ranks("tp") == [[0, 1], [2, 3]]
    assert [[rank // 2 for rank in group] for group in ranks.get_ranks("dp")] == [[0, 1], [0, 1]]


def test_compare_losses_gives_the_documented_gaps():
    reference = {"losses": [10.0, 8.0, 6.0, 4.0], "grad_norms": [2.0, 1.0, 1.0, 1.0]}
    run = {"losses": [10.01, 8.4, 6.0, 4.2], "grad_norms": [2.1, 1.0, 1.0, 1.0]}
    gaps = compare_losses(reference, run)
    assert gaps["first_loss_rel_gap"] == pytest.approx(0.001) and gaps["max_step_rel_gap"] == pytest.approx(0.05)
    assert gaps["final_window"] == 1 and gaps["final_rel_gap"] == pytest.approx(0.05)
    assert gaps["first_grad_norm_rel_gap"] == pytest.approx(0.05)
    assert (gaps["loss_final_mean_reference"], gaps["loss_final_mean"]) == (4.0, 4.2)


@pytest.mark.parametrize("dp", [1, 2])
def test_run_tp_without_the_gpus_it_needs_fails_its_check_without_running(tmp_path, dp):
    needed = multigpu_tp.processes(2, dp)
    if torch.cuda.device_count() >= needed:
        pytest.skip(f"{needed} GPUs are visible: run_tp would really run")
    found = multigpu_tp.run_tp(tmp_path, 20, dp=dp)
    assert found["checks"] == {f"{needed} GPUs visible": False} and f"run on {needed}" in found["error"]
    assert (found["data_parallel"], found["gpus_per_run"], found["global_batch"]) == (dp, needed, dp * 4)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, problem", [
    (["--parts", "tp", "--tp-dp", "0"], "--tp-dp 0: pass a data-parallel degree of 1 or more"),
    (["--parts", "fsdp,tp", "--tp-dp", "2"], "--tp-dp 2 runs TP=2 x DP=2 on 4 GPUs and {gpus} are visible: run on 4 "
                                             "GPUs or lower --tp-dp"),
])
def test_a_data_parallel_degree_it_cannot_run_is_refused_in_one_line_before_any_run(argv, problem, tmp_path, capsys):
    if torch.cuda.device_count() >= 4:
        pytest.skip("four GPUs are visible: --tp-dp 2 would run")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "work")])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"python -m fp8stack.bench.multigpu: error: {problem.format(gpus=torch.cuda.device_count())}"
    assert not any(tmp_path.iterdir())  # no evidence claimed, no run started


def _run(losses: list[float], world_size: int, returncode: int = 0) -> Run:
    result = {"losses": losses, "grad_norms": [2.0] * len(losses), "tokens_per_s": 1.0, "world_size": world_size,
              "device": "cpu", "plan_summary": {"fp8_gemms": 4}, "step_ms": [1.0] * len(losses),
              "peak_mem_gib": None, "first_step": 0}
    ok = returncode == 0
    return Run("arm", "launch/train.sh ...", returncode, 1.0, result if ok else None, [], "" if ok else "boom")


@pytest.mark.parametrize("dp", [1, 2])
def test_judge_passes_matching_runs_and_fails_a_parted_or_missing_one(dp):
    steps, base, ranks, parallel = 8, [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0], 2 * dp, multigpu_tp.label(dp)
    runs = {(arm.name, tp): run_record(_run(base, ranks if tp == 2 else 1)) for arm in multigpu_tp.ARMS
            for tp in (1, 2)}
    parted, missing, wrong = (arm.name for arm in multigpu_tp.ARMS)
    runs[parted, 2] = run_record(_run(base[:-2] + [4.5, 3.5], ranks))
    runs[missing, 2] = run_record(_run([], ranks, returncode=1))
    runs[wrong, 2] = run_record(_run(base, 2 if dp > 1 else 1))  # fewer ranks than the comparison's
    arms, checks = multigpu_tp.judge(runs, steps, dp)
    failed = {name for name, ok in checks.items() if not ok}
    assert failed == {f"{parted}, {parallel} vs TP=1: mean loss of the last 2 steps within {LOSS_RTOL:.0%}",
                      f"{missing}: TP=1 and {parallel} ran {steps} steps",
                      f"{wrong}: {parallel} ran on {ranks} ranks with FP8 GEMMs"}
    assert arms[missing]["tp2"]["log_tail"] == "boom" and "comparison" not in arms[missing]
    assert arms[wrong]["comparison"]["final_rel_gap"] == 0.0
    part = {"model": "m", "seq_len": 8, "micro_batch": 1, "steps": steps, "arms": arms, "checks": checks,
            "data_parallel": dp, "global_batch": dp}
    text = render({"passed": False, "gpus": ranks, "commands": [], "tensor_parallel": part})
    assert f"| {parted} | 3.5000 | 4.0000 | 14.29% | 0.000% |" in text and f"| {missing} |" not in text
    assert f"TP=2 x DP={dp} on {ranks} GPUs" in text and f"| arm ({parallel} vs TP=1) |" in text
    assert ("Data parallel 2: each step's global batch of 2 sequences" in text) == (dp > 1)


def test_evidence_from_before_data_parallelism_renders_as_dp_1():
    part = {"model": "m", "seq_len": 8, "micro_batch": 1, "steps": 8, "arms": {}, "checks": {}}
    assert "TP=2 x DP=1 on 2 GPUs" in render({"passed": True, "gpus": 2, "commands": [], "tensor_parallel": part})
