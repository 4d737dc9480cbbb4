"""The multi-GPU flows on gloo processes: the collective counts of FSDP2 with FP8 all-gather
(fp8stack.train.comm_stats), the fsdp and kill-a-rank / restart-from-checkpoint parts of fp8stack.bench.multigpu
end to end on the tiny model (two processes), and the plain path at TP=2 x DP=2 (four) against the TP=1 twin the
tensor-parallel part builds for it.

FP8 all-gather runs over gloo here because FSDP2 moves a parameter group of mixed dtypes (float8
weights, FP32 norms) as one uint8 buffer, and every transformer block holds norms. What differs on
GPUs (NCCL, BF16 parameters, timings) is measured by `python -m fp8stack.bench.multigpu`.
"""

import json

import pytest
from torch import nn

from fp8stack.models import load_model_config
from fp8stack.bench.launches import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, LR_WARMUP, compare_losses, launch,
                                     loss_checks)
from fp8stack.bench.multigpu import (ONE_RANK_TWINS, PROFILED_STEPS, RESTART_PATHS, earlier_parts, render,
                                     restart_plan, run_fsdp, run_restart)
from fp8stack.bench.multigpu_tp import Arm, label, processes, train_flags
from fp8stack.models import Llama
from fp8stack.train.command import job_from_flags
from fp8stack.train.loop import train

pytestmark = pytest.mark.slow

STEPS = 8
FP32_BYTES = 4


@pytest.fixture(scope="module")
def fsdp_part(tmp_path_factory) -> dict:
    """The fsdp part of fp8stack.bench.multigpu on the tiny model: its 2-rank arms count their collectives over
    PROFILED_STEPS steps, FP8 all-gather with precomputed scales (fp8_all_gather) and without
    (fp8_all_gather_no_precompute, a shorter run): the counts below are read from those arms."""
    return run_fsdp(tmp_path_factory.mktemp("fsdp"), STEPS, model="tiny", micro_batch=2, seq_len=32,
                    extra=("--device", "cpu"))


def _expected_all_gather_bytes() -> tuple[dict[str, int], int]:
    """Group -> bytes all-gathered per step, from the model's parameters: each block twice (forward, and
    again in backward after resharding), its Linear weights as 1-byte FP8 and its norms in FP32; the
    root (embeddings, final norm, head; not resharded after forward) once, in FP32."""
    model = Llama(load_model_config("tiny"))
    groups, fp8_weights = {}, 0
    for index, block in enumerate(model.layers):
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        fp8_weights += len(linears)
        fp8 = sum(m.weight.numel() for m in linears)
        groups[f"layers.{index}"] = 2 * (fp8 + FP32_BYTES * (sum(p.numel() for p in block.parameters()) - fp8))
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    groups["root"] = FP32_BYTES * (sum(p.numel() for p in model.parameters()) - in_blocks)
    return groups, fp8_weights


def test_fp8_all_gather_bytes_and_counts_match_the_parameters(fsdp_part):
    collectives = fsdp_part["arms"]["fp8_all_gather"]["collectives"]
    groups, _ = _expected_all_gather_bytes()
    assert collectives["steps"] == PROFILED_STEPS
    assert collectives["all_gather_bytes_by_group"] == groups
    assert collectives["bytes"]["all_gather"] == sum(groups.values())
    assert collectives["counts"]["all_gather"] == 2 * (len(groups) - 1) + 1  # the blocks twice, the root once
    assert collectives["counts"]["reduce_scatter"] == len(groups)  # one per group, in backward
    assert "unsigned char" in collectives["all_gather_dtypes"]  # the blocks: float8 weights + FP32 norms


def test_precompute_turns_per_weight_scale_all_reduces_into_one(fsdp_part):
    (with_, losses_with), (without, losses_without) = ((arm["collectives"], arm["losses"]) for arm in (
        fsdp_part["arms"]["fp8_all_gather"], fsdp_part["arms"]["fp8_all_gather_no_precompute"]))
    _, fp8_weights = _expected_all_gather_bytes()
    assert without["all_reduces_in_all_gather"] == 2 * fp8_weights  # every weight, every all-gather
    assert with_["all_reduces_in_all_gather"] == 0
    others = without["counts"]["all_reduce"] - without["all_reduces_in_all_gather"]  # loss mean, gradient norm
    assert with_["counts"]["all_reduce"] == others + 1
    # The same scales, computed in one all-reduce. The arms' lr is still warming up (LR_WARMUP > STEPS), so the shorter
    # run's steps take the lr of the longer run's first steps.
    assert LR_WARMUP > STEPS and losses_with[:len(losses_without)] == losses_without


def test_fsdp_part_runs_every_arm_and_judges_them(fsdp_part):
    part = fsdp_part
    failed = [name for name, ok in part["checks"].items() if not ok]
    assert not failed, (failed, {name: run.get("log_tail", "") for name, run in part["arms"].items()})
    assert set(part["loss_vs_one_rank"]) == set(ONE_RANK_TWINS)
    assert all(part["arms"][twin]["world_size"] == 1 for twin in ONE_RANK_TWINS.values())
    assert part["all_gather"]["ratio_blocks"] < 0.55 and part["precompute"]["precompute_all_reduces"] == 1
    text = render({"passed": True, "gpus": 0, "commands": part["commands"], "fsdp": part})
    assert "| fp8_all_gather |" in text and "one_rank_fp8_all_gather" in text


CPU_FP8 = ("--backend", "torchao", "--fp8-recipe", "tensorwise")
"""What stands in for TE's delayed scaling on a CPU: the fast path's DDP, masters and checkpoint flow stay as they are."""


@pytest.mark.parametrize("path, cpu", [("fsdp_fp8_all_gather", ()), ("fast", CPU_FP8)])
def test_killed_rank_restarts_from_the_checkpoint_with_identical_losses(path, cpu, tmp_path):
    steps = 6
    interval, kill_step = restart_plan(steps)
    part = run_restart(tmp_path, steps, path, micro_batch=2, extra=("--device", "cpu", "--seq-length", "32", *cpu))
    failed = [name for name, ok in part["checks"].items() if not ok]
    assert not failed, (failed, {name: run.get("log_tail", "") for name, run in part["runs"].items()})
    assert part["checkpoints_after_kill"] == [f"step-{interval:08d}"] and part["kill_at_step"] == kill_step
    assert part["bit_identical"] and part["tolerance"] == 0.0  # CPU kernels and gloo sums are deterministic
    assert len(part["losses"]["restarted"]) == steps - interval
    assert RESTART_PATHS[path][0] in render({"passed": True, "gpus": 0, "commands": part["commands"],
                                             "restart": {"paths": {path: part}, "checks": part["checks"]}})


def test_the_fast_restart_path_is_the_one_gpu_fast_path_under_ddp():
    from fp8stack.train.command import job_from_flags

    job = job_from_flags(RESTART_PATHS["fast"][1])
    assert (job.precision.recipe, job.precision.backend, job.parallelism.data_parallel) == ("delayed", "te", "ddp")
    assert job.checkpoint.trust and job.training.param_dtype is None  # BF16 parameters with masters: resolved default


def test_keep_other_parts_takes_the_parts_not_rerun_from_the_same_environments_evidence(tmp_path):
    from fp8stack.evidence import device_slug, environment

    path = tmp_path / f"multigpu-{device_slug()}.json"
    path.write_text(json.dumps({"environment": environment(), "fsdp": {"checks": {}}, "restart": {"checks": {}}}))
    assert set(earlier_parts(["tp", "restart"], str(tmp_path))) == {"fsdp"}
    assert earlier_parts(["fsdp"], str(tmp_path / "none")) == {}
    path.write_text(json.dumps({"environment": {**environment(), "torch": "0.0"}, "fsdp": {}}))
    with pytest.raises(SystemExit, match="rerun every part"):
        earlier_parts(["tp"], str(tmp_path))


def test_an_unknown_restart_path_is_refused_in_one_line_before_any_run(capsys):
    from fp8stack.bench.multigpu import main

    with pytest.raises(SystemExit) as exit_:
        main(["--parts", "restart", "--restart-paths", "fast,zero"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --restart-paths 'fast,zero': name some of fast,fsdp_fp8_all_gather")


CPU_TP_ARM = Arm("torchao-rowwise", ("--no-fused-projections", "--fp8-recipe", "rowwise", "--device", "cpu",
                                     "--max-data-bytes", str(1 << 20)), twin_flags=("--data-parallel-one-rank",))
"""The bench's torchao arm as gloo can run it: rowwise, since tensorwise layers get torchao's Float8 TP styles,
whose float8 all-gathers gloo refuses (tests/test_launch.py); the Megatron arms need CUDA."""


def test_tensor_parallel_with_data_parallel_trains_on_the_twins_global_batch(tmp_path):
    """The plain path at TP=2 x DP=2 (FSDP2 over the data-parallel dimension of a 2-D mesh) on four gloo ranks passes
    the tensor-parallel part's loss checks against its TP=1 twin (one process, the global batch in two accumulated
    micro-batches, FSDP2 over one rank); one process reading one micro-batch a step, not the global batch, fails the
    first step's: so the checks see whether the batches coincide."""
    dp, steps, shape = 2, 2, {"model": "tiny", "seq_len": 32, "micro_batch": 2}
    parallel = launch("tp2-dp2", tmp_path, processes(2, dp), train_flags(CPU_TP_ARM, 2, steps, dp=dp, **shape))
    assert parallel.returncode == 0, parallel.log_tail
    config = parallel.result["config"]
    assert parallel.result["world_size"] == 4 and config["parallelism"]["tensor_parallel"] == 2
    assert config["parallelism"]["data_parallel"] == "fsdp" and config["training"]["global_batch"] == 4
    twin, other_batch = (train(job_from_flags([*train_flags(CPU_TP_ARM, 1, steps, dp=degree, **shape),
                                               "--no-progress"])) for degree in (dp, 1))
    assert twin.config["parallelism"]["data_parallel_one_rank"] and twin.tokens_per_step == 4 * 32
    gaps = compare_losses(vars(twin), parallel.result)
    checks = loss_checks(f"{label(dp)} vs TP=1", gaps)
    assert all(checks.values()), (checks, gaps)
    wrong = compare_losses(vars(twin), vars(other_batch))
    assert wrong["first_loss_rel_gap"] > FIRST_LOSS_RTOL and wrong["first_grad_norm_rel_gap"] > GRAD_NORM_RTOL
