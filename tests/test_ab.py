"""The A/B harness: verdict rules on synthetic numbers, and a real two-arm run on the CPU."""

import argparse
import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp8stack.ab import add_ab_parser, arm_configs, final_loss, main, run_ab
from fp8stack.ab.run import (_as_they_end, _bf16_runs_from, _earlier_runs, _RunningArm, ab_config, arm_stem,
                             base_job)
from fp8stack.ab.plot import relative_gap
from fp8stack.ab.verdicts import (BF16_ON_TE_ARM, REPEAT_ARM, SINGLE_RUN_CAVEAT, LossGate, band_note, blended_peak,
                                  judge, loss_unresolved, loss_verdict, overall_verdict, peak_tflops, reference_arm,
                                  repeat_arms, speed_verdict)
from fp8stack.bench import loss_band
from fp8stack.evidence import run_folder
from fp8stack.config import ConfigError, parse_args
from fp8stack.train.timing import relative_spread, steady_state

ARM_KEYS = {"recipe", "backend", "step_ms", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "final_loss",
            "rel_loss_gap", "verdict", "reason"}


def _evidence(out_dir: Path, name: str) -> Path:
    """Where this process's run writes the evidence file `name` under out_dir: its run folder."""
    return run_folder(name.rsplit(".", 1)[0], out_dir) / name


def _ab_args(*flags: str) -> argparse.Namespace:
    """`fp8stack ab` flags as its parser reads them."""
    parser = argparse.ArgumentParser(prog="fp8stack")
    add_ab_parser(parser.add_subparsers(dest="command"))
    return parse_args(parser, ["ab", *flags])


def _arms(*flags: str, recipes: tuple[str, ...] = ("bf16", "delayed"), te_runs: bool = False) -> dict:
    """Arm name -> JobConfig of an A/B given these flags (arm_configs, as run_ab builds them)."""
    args = _ab_args(*flags)
    ab = ab_config(args)
    return arm_configs(ab, base_job(args, ab), list(recipes), te_runs)


def test_a_recipe_files_overrides_go_to_the_fp8_arms_and_the_bf16_arms_stay_without_fp8():
    arms = _arms("--model", "tiny-moe", "--recipe-file", "moe-only-fp8", recipes=("bf16", "delayed", "blockwise"),
                 te_runs=True)
    assert set(arms) == {"bf16", "bf16 on te", "delayed", "blockwise"}
    assert all(not arms[name].precision.overrides for name in ("bf16", "bf16 on te"))
    assert all(len(arms[name].precision.overrides) == 2 for name in ("delayed", "blockwise"))


TWO_ARMS = ["--model", "tiny", "--recipes", "tensorwise", "--steps", "4", "--micro-batch", "2", "--seq-len", "64",
            "--device", "cpu", "--recompute-modules", "mlp"]
"""The CPU A/B that the module fixtures below run one after another and side by side: the same arms, so the same
losses."""


def _run_ab(out_dir: Path, *flags: str) -> str:
    """`fp8stack ab` with these flags into out_dir (it must succeed); what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*flags, "--out-dir", str(out_dir)]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def one_after_another(tmp_path_factory) -> tuple[Path, str]:
    """TWO_ARMS with no --gpus: bf16, tensorwise and the bf16 repeat one after another (folder, what it printed)."""
    out_dir = tmp_path_factory.mktemp("one-after-another")
    return out_dir, _run_ab(out_dir, *TWO_ARMS)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory) -> Path:
    """TWO_ARMS on --gpus 0,1,2 with 3 bf16 runs: bf16, tensorwise and the first repeat at once, the second repeat
    when a GPU is free (on a CPU the list only sets CUDA_VISIBLE_DEVICES)."""
    out_dir = tmp_path_factory.mktemp("side-by-side")
    _run_ab(out_dir, *TWO_ARMS, "--gpus", "0,1,2", "--baseline-runs", "3")
    return out_dir


@pytest.fixture(scope="module")
def bf16_parameters_on_gpu_1(tmp_path_factory) -> Path:
    """bf16 and tensorwise with BF16 parameters (--param-dtypes bf16), each arm a fresh process on GPU 1 (--gpus 1)."""
    out_dir = tmp_path_factory.mktemp("bf16-params")
    _run_ab(out_dir, "--model", "tiny", "--recipes", "tensorwise", "--steps", "2", "--micro-batch", "2", "--seq-len",
            "64", "--device", "cpu", "--dtype", "bf16", "--baseline-runs", "1", "--param-dtypes", "bf16", "--gpus", "1")
    return out_dir


def test_ship_needs_speed_beyond_noise_and_loss_not_above_the_tolerance():
    assert speed_verdict(1.25, noise=0.05) == "faster"
    assert speed_verdict(1.03, noise=0.05) == speed_verdict(0.97, noise=0.05) == "inconclusive"
    assert speed_verdict(0.8, noise=0.05) == "slower"
    assert loss_verdict(0.001, tolerance=0.0025, steps=100, horizon=54) == "within"
    assert loss_verdict(0.004, tolerance=0.0025, steps=100, horizon=54) == "above"
    assert loss_verdict(-0.01, tolerance=0.0025, steps=100, horizon=54) == "below"
    assert overall_verdict("faster", "within") == overall_verdict("faster", "below") == "ship"  # the gate is one-sided
    assert overall_verdict("faster", "above") == "rollback"
    assert overall_verdict("slower", "within") == overall_verdict("slower", "not judged") == "rollback"
    assert overall_verdict("inconclusive", "within") == "inconclusive"


def test_loss_is_not_compared_where_it_cannot_resolve_the_tolerance():
    assert loss_unresolved(0.9, [], 0.0025) == ""
    assert "4.5 passes over the training text" in loss_unresolved(4.5, [], 0.0025)
    assert loss_unresolved(0.5, [-0.002], 0.0025) == ""
    assert "the two bf16 runs differ by -2.60%" in loss_unresolved(0.5, [-0.026], 0.0025)
    # each repeat within the tolerance of the first run, but +0.2% and -0.2% span 0.4%: the runs disagree
    assert "the 3 bf16 runs' final losses span 0.40%, more than" in loss_unresolved(0.5, [0.002, -0.002], 0.0025)
    assert loss_unresolved(0.5, [0.001, 0.002, -0.0005], 0.0025) == ""
    assert loss_verdict(0.04, tolerance=0.0025, steps=100, horizon=54, unresolved="why") == "inconclusive"
    assert overall_verdict("faster", "inconclusive") == "inconclusive"
    assert overall_verdict("slower", "inconclusive") == "rollback", "a slower arm is a rollback whatever the loss"


def test_judge_leaves_the_loss_unjudged_past_one_pass_or_when_bf16_runs_disagree():
    results = {"bf16": _result(100.0, 2.0, 0.0), "tensorwise": _result(80.0, 2.0, 0.8)}
    backends = {"bf16": "bf16", "tensorwise": "torchao"}
    many_passes, _ = judge(results, backends, tolerance=0.0025, peaks=None, passes=4.2)
    assert many_passes[1].verdict == "inconclusive" and "4.2 passes" in many_passes[1].reason
    spread, _ = judge(results, backends, tolerance=0.0025, peaks=None, repeats={REPEAT_ARM: _result(100.0, 2.05, 0.0)})
    assert spread[1].verdict == "inconclusive" and "differ by +2.50%" in spread[1].reason
    assert spread[1].reason.endswith("; its final loss lies between the 2 bf16 runs' (2.0000 to 2.0500)")
    assert band_note(2.1, [2.0, 2.05]) == "its final loss lies +2.44% above the 2 bf16 runs' (2.0000 to 2.0500)"
    assert band_note(1.9, [2.0, 2.05]) == "its final loss lies -5.00% below the 2 bf16 runs' (2.0000 to 2.0500)"


def test_with_three_bf16_runs_the_loss_meets_the_gate_loss_band_applies():
    """Three bf16 runs or more measure their spread: the arm is judged by the one-sided gate (their mean + max(the
    tolerance, 2 standard deviations)), not left unresolved by that spread, and the gate is loss_band's."""
    backends = {"bf16": "bf16", "tensorwise": "torchao"}
    three = {REPEAT_ARM: _result(100.0, 2.004, 0.0), "bf16 (repeat 2)": _result(100.0, 1.996, 0.0)}
    verdicts = {}
    for loss in (2.0079, 2.0081, 1.99):
        results = {"bf16": _result(100.0, 2.0, 0.0), "tensorwise": _result(80.0, loss, 0.8)}
        arms, records = judge(results, backends, tolerance=0.0025, peaks=None, repeats=three)
        verdicts[loss] = (arms[1].loss_verdict, arms[1].verdict)
        assert "the 3 bf16 runs' mean 2.0000 + max(0.25%, 2 standard deviations) = 2.0080" in arms[1].reason
    assert [r["run"] for r in records] == [REPEAT_ARM, "bf16 (repeat 2)"]
    assert verdicts == {2.0079: ("within", "ship"), 2.0081: ("above", "rollback"), 1.99: ("below", "ship")}
    assert loss_band.gate_limit(loss_band.band([2.0, 2.004, 1.996])) == LossGate.of([2.0, 2.004, 1.996], 0.0025).limit
    two = {REPEAT_ARM: _result(100.0, 2.004, 0.0)}  # two runs: the fixed tolerance, as before
    arms, _ = judge({"bf16": _result(100.0, 2.0, 0.0), "tensorwise": _result(80.0, 2.0079, 0.8)}, backends,
                    tolerance=0.0025, peaks=None, repeats=two)
    assert arms[1].loss_verdict == "above" and "outside the +-0.25% tolerance" in arms[1].reason


def test_statistics():
    assert final_loss([5.0] * 90 + [2.0] * 10) == 2.0
    assert final_loss([3.0, 1.0]) == 1.0  # at least one step
    assert steady_state(list(range(30))) == list(range(3, 30))
    assert steady_state([9.0, 1.0, 1.0]) == [9.0, 1.0, 1.0]  # too short to drop anything
    assert relative_spread([10.0] * 8) == 0.0
    assert relative_spread([8.0, 9.0, 10.0, 11.0, 12.0]) == pytest.approx(0.3)


def test_peaks_and_mfu_basis():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == {"bf16": 989.4, "fp8": 1978.9}
    assert peak_tflops("NVIDIA H100 PCIe")["bf16"] == 756.0
    assert peak_tflops("NVIDIA H200")["fp8"] == 1978.9
    assert peak_tflops("cpu") is None
    peaks = {"bf16": 1000.0, "fp8": 2000.0}
    assert blended_peak(peaks, 0.0) == 1000.0 and blended_peak(peaks, 1.0) == 2000.0
    assert blended_peak(peaks, 0.5) == pytest.approx(1000.0 / 0.75)


def _result(step_ms: float, loss: float, fp8_share: float) -> dict:
    """A TrainResult dict as the worker writes it, with the harness's ran_between: 100 steps, long enough for the
    loss to be judged after 4 warm-up steps."""
    by_backend = {"bf16": 1 - fp8_share, **({"torchao": fp8_share} if fp8_share else {})}
    return {"config": {"optimizer": {"warmup": 4}}, "step_ms": [step_ms] * 100, "losses": [loss] * 100,
            "tokens_per_step": 1000, "peak_mem_gib": 10.0,
            "max_rss_gib": 2.0, "val_loss": loss, "dtype": "bfloat16", "world_size": 1, "ran_between": [0.0, 1.0],
            "zero_fp8_weight_grads": [[], [], []],
            "plan_summary": {"gemm_flops_per_token": 10**9, "flops_share_by_precision": {"fp8": fp8_share},
                             "flops_share_by_backend": by_backend}}


def test_judge_compares_every_arm_with_bf16():
    results = {"bf16": _result(100.0, 2.0, 0.0), "tensorwise": _result(70.0, 2.002, 0.8),
               "rowwise": _result(90.0, 2.1, 0.8), "blockwise": "TransformerEngine is not installed"}
    backends = {"bf16": "bf16", "tensorwise": "torchao", "rowwise": "torchao", "blockwise": "te"}
    judged, repeats = judge(results, backends, tolerance=0.0025, peaks=peak_tflops("H100"))
    arms = {a.recipe: a for a in judged}
    assert repeats == []
    assert arms["bf16"].verdict == "baseline" and arms["bf16"].rel_loss_gap == 0.0
    assert arms["tensorwise"].verdict == "ship" and arms["tensorwise"].rel_loss_gap == pytest.approx(0.001)
    assert arms["tensorwise"].reason.endswith(SINGLE_RUN_CAVEAT), "one bf16 run cannot vouch for the loss spread"
    assert arms["tensorwise"].tflops == pytest.approx(3 * 10**9 * 1000 / 0.07 / 1e12)
    assert arms["tensorwise"].mfu == pytest.approx(arms["tensorwise"].tflops / blended_peak(peak_tflops("H100"), 0.8))
    assert arms["rowwise"].verdict == "rollback" and "tolerance" in arms["rowwise"].reason
    assert arms["blockwise"].verdict == "rollback" and arms["blockwise"].reason == (
        "failed: TransformerEngine is not installed")
    assert arms["bf16"].peak_mem_gib == 10.0


def test_judge_without_a_baseline_ships_nothing():
    arms, _ = judge({"bf16": "out of memory", "tensorwise": _result(50.0, 2.0, 0.8)},
                     {"bf16": "bf16", "tensorwise": "torchao"}, tolerance=0.0025, peaks=None)
    assert [a.verdict for a in arms] == ["error", "rollback"]


def test_judge_takes_the_faster_bf16_configuration_as_the_reference():
    """--fastest-bf16: the FP8 arms are judged against whichever BF16 configuration ran faster; the other is
    reported beside it, and a failed one leaves the other as the reference."""
    backends = {"bf16": "bf16", BF16_ON_TE_ARM: "te", "delayed": "te"}
    results = {"bf16": _result(100.0, 2.0, 0.0), BF16_ON_TE_ARM: _result(95.0, 2.004, 0.0),
               "delayed": _result(76.0, 2.004, 0.8)}
    plain, on_te, delayed = judge(results, backends, tolerance=0.0025, peaks=None)[0]
    assert (on_te.verdict, on_te.rel_loss_gap, on_te.reason) == (
        "baseline", 0.0, "the reference arm, the fastest BF16 configuration")
    assert plain.verdict == "alternative" and plain.reason == (
        "a BF16 configuration; bf16 on te, 5.3% faster, is the reference")
    assert plain.rel_loss_gap == pytest.approx(2.0 / 2.004 - 1)
    assert delayed.verdict == "ship" and delayed.rel_loss_gap == pytest.approx(0.0)
    assert delayed.reason.startswith("faster than bf16 on te beyond the noise: 1.250x its tokens/s (noise")
    _, (repeat,) = judge(results, backends, tolerance=0.0025, peaks=None, repeats={REPEAT_ARM: _result(96.9, 2.004, 0)})
    assert repeat["of"] == BF16_ON_TE_ARM and repeat["run_to_run_noise"] == pytest.approx(0.02)  # against 95 ms
    failed = {**results, BF16_ON_TE_ARM: "TransformerEngine needs CUDA"}
    plain, on_te, delayed = judge(failed, backends, tolerance=0.0025, peaks=None)[0]
    assert (plain.verdict, on_te.verdict) == ("baseline", "alternative")
    assert on_te.reason == "failed: TransformerEngine needs CUDA; bf16 is the reference"
    assert delayed.rel_loss_gap == pytest.approx(0.002) and "faster than bf16 beyond" in delayed.reason
    neither = {**failed, "bf16": "out of memory"}
    assert [a.verdict for a in judge(neither, backends, tolerance=0.0025, peaks=None)[0]] == [
        "error", "error", "rollback"]


def test_fastest_bf16_runs_both_configurations_on_cpu(tmp_path, capsys):
    """The 'bf16 on te' arm is the bf16 plan on TE modules: on a CPU it fails (TE needs CUDA) and the plain bf16
    run stays the reference, which the repeat reruns once both BF16 configurations have run, GPUs free or not."""
    common = ["--model", "tiny", "--recipes", "tensorwise", "--steps", "3", "--micro-batch", "2", "--seq-len", "64",
              "--device", "cpu", "--out-dir", str(tmp_path)]
    assert main([*common, "--fastest-bf16", "--bf16-on-te"]) == 2
    assert "the --bf16-on-te one included: drop --bf16-on-te" in capsys.readouterr().err
    assert main([*common, "--fastest-bf16", "--model-impl", "megatron"]) == 2
    assert "megatron's BF16 run is on TE already" in capsys.readouterr().err
    assert main([*common, "--fastest-bf16", "--gpus", "0,1,2,3"]) == 0
    record = json.loads(_evidence(tmp_path, "ab-tiny-cpu.json").read_text())
    assert [(a["recipe"], a["backend"], a["verdict"]) for a in record["arms"]][:2] == [
        ("bf16", "bf16", "baseline"), (BF16_ON_TE_ARM, "te", "alternative")]
    assert record["arms"][0]["reason"] == "the reference arm"
    assert "TransformerEngine" in record["arms"][1]["reason"], record["arms"][1]["reason"]
    assert record["arms"][2]["rel_loss_gap"] is not None and "fp32 (no FP8)" in record["arms"][2]["reason"]
    (repeat,) = record["baseline_repeats"]
    assert repeat["of"] == "bf16" and repeat["rel_loss_gap"] == 0.0  # the reference again: same seed, CPU kernels
    assert repeat["ran_between"][0] >= record["arms"][0]["ran_between"][1], "the repeat waited for the reference"
    assert record["train_config"]["ab"]["fastest_bf16"] is True
    markdown = _evidence(tmp_path, "ab-tiny-cpu.md").read_text()
    assert "the faster is the reference, which the bf16 repeats rerun" in markdown


def test_the_reference_is_the_fastest_bf16_configuration_that_ran():
    plain, on_te = _result(100.0, 2.0, 0.0), _result(95.0, 2.0, 0.0)
    assert reference_arm({"bf16": plain, BF16_ON_TE_ARM: on_te, "delayed": _result(70.0, 2.0, 0.8)}) == BF16_ON_TE_ARM
    assert reference_arm({"bf16": plain, BF16_ON_TE_ARM: "TransformerEngine needs CUDA"}) == "bf16"
    assert reference_arm({"bf16": "out of memory", "tensorwise": _result(70.0, 2.0, 0.8)}) is None


def test_second_bf16_run_sets_the_noise():
    results = {"bf16": _result(100.0, 2.0, 0.0), "tensorwise": _result(80.0, 2.0, 0.8)}
    backends = {"bf16": "bf16", "tensorwise": "torchao"}
    steady, _ = judge(results, backends, tolerance=0.0025, peaks=None, repeats={REPEAT_ARM: _result(101.0, 2.0, 0.0)})
    assert steady[1].verdict == "ship" and SINGLE_RUN_CAVEAT not in steady[1].reason
    drifting, (repeat,) = judge(results, backends, tolerance=0.0025, peaks=None,
                                 repeats={REPEAT_ARM: _result(130.0, 2.0, 0.0)})
    assert repeat["run_to_run_noise"] == pytest.approx(0.3) and repeat["rel_loss_gap"] == 0.0
    assert drifting[1].verdict == "inconclusive" and "within the noise of bf16: 1.250x its tokens/s (noise 30.0%" in (
        drifting[1].reason)
    failed = {REPEAT_ARM: _result(101.0, 2.0, 0.0), "bf16 (repeat 2)": "out of memory"}
    _, records = judge(results, backends, tolerance=0.0025, peaks=None, repeats=failed)
    assert records[1] == {"run": "bf16 (repeat 2)", "error": "out of memory"}


def test_two_arm_ab_on_cpu_writes_the_evidence(one_after_another):
    tmp_path, printed = one_after_another
    record = json.loads(_evidence(tmp_path, "ab-tiny-cpu.json").read_text())
    checkpointed = [record["runs"][arm]["config"]["activation_checkpoint"] for arm in ("bf16", "tensorwise")]
    assert [(c["layers"], c["modules"]) for c in checkpointed] == [("all", ["mlp"]), ("all", ["mlp"])]
    assert record["train_config"]["job"]["activation_checkpoint"] == {"layers": "all", "modules": ["mlp"],
                                                                      "compress": False}
    assert record["train_config"]["job"]["precision"]["recipe"] == "bf16"
    markdown = _evidence(tmp_path, "ab-tiny-cpu.md").read_text()
    assert "Every arm recomputes mlp in every block in backward." in markdown
    assert "2 sequences per optimizer step in micro-batches of 2" in markdown
    assert {"device", "versions", "date", "command", "model", "steps", "arms"} <= set(record)
    # 4 steps x 2 sequences x 64 tokens over the training split read from the default 8 MiB of sources
    assert record["train_split_passes"] == pytest.approx(4 * 2 * 64 / record["train_split_bytes"])
    assert record["train_split_bytes"] > 4 << 20
    assert record["complete"] is True and record["pending_arms"] == []
    assert "Partial" not in _evidence(tmp_path, "ab-tiny-cpu.md").read_text()
    assert [arm["recipe"] for arm in record["arms"]] == ["bf16", "tensorwise"]  # bf16 added first
    for arm in record["arms"]:
        assert ARM_KEYS <= set(arm)
        assert arm["verdict"] in ("baseline", "inconclusive", "rollback") and arm["reason"]
        assert arm["mfu"] is None and arm["step_ms"] > 0 and arm["final_loss"] > 0
    assert record["arms"][1]["backend"] == "torchao" and record["arms"][1]["loss_verdict"] == "not judged"
    (repeat,) = record["baseline_repeats"]
    assert repeat["run"] == REPEAT_ARM and repeat["rel_loss_gap"] == 0.0  # same seed and data, deterministic CPU
    assert repeat["run_to_run_noise"] >= 0
    assert _evidence(tmp_path, "ab-tiny-cpu.md").read_text().count("| tensorwise |") == 1
    assert "| tensorwise |" in printed


def test_arms_side_by_side_train_as_one_after_another(one_after_another, side_by_side, bf16_parameters_on_gpu_1):
    """--gpus runs the arms at once, one per GPU (on a CPU the list only sets CUDA_VISIBLE_DEVICES): the same
    losses as arms run one after another, with the arms' processes running at the same time; one GPU runs them one
    after another there. The A/Bs are the module's fixtures, which other tests read too."""
    apart, together = (json.loads(_evidence(d, "ab-tiny-cpu.json").read_text())
                       for d in (one_after_another[0], side_by_side))
    assert together["gpus"] == ["0", "1", "2"] and apart["gpus"] is None
    assert [a["loss_curve"] for a in together["arms"]] == [a["loss_curve"] for a in apart["arms"]]
    (start_a, end_a), (start_b, end_b) = (arm["ran_between"] for arm in apart["arms"])
    assert end_a <= start_b, "one after another: the second arm starts after the first"
    (start_a, end_a), (start_b, end_b) = (arm["ran_between"] for arm in together["arms"])
    assert start_b < end_a and start_a < end_b, "side by side: the arms run at the same time"
    assert "arms side by side on GPUs 0,1,2" in _evidence(side_by_side, "ab-tiny-cpu.md").read_text()
    assert "each arm a fresh process (on GPU 1);" in _evidence(bf16_parameters_on_gpu_1, "ab-tiny-cpu.md").read_text()
    assert main([*TWO_ARMS, "--gpus", "0,1", "--nproc", "2", "--out-dir", "unused"]) == 2


@pytest.mark.slow
def test_arms_run_on_nproc_processes_under_the_data_parallel_wrapper_asked(tmp_path):
    """--nproc 2 runs each arm under torchrun on two gloo processes, with the configuration's DDP and the BF16
    parameters it resolves to (FP32 masters averaged over the replicas)."""
    assert main(["--model", "tiny", "--recipes", "tensorwise", "--steps", "2", "--micro-batch", "2", "--seq-len", "32",
                 "--device", "cpu", "--dtype", "bf16", "--baseline-runs", "1", "--nproc", "2",
                 "--parallelism.data-parallel", "ddp", "--out-dir", str(tmp_path)]) == 0
    record = json.loads(_evidence(tmp_path, "ab-tiny-cpu.json").read_text())
    assert record["nproc"] == 2 and set(record["runs"]) == {"bf16", "tensorwise"}
    for run in record["runs"].values():
        assert run["world_size"] == 2 and run["tokens_per_step"] == 2 * 2 * 32  # micro-batch 2 on each rank
        assert run["config"]["parallelism"]["data_parallel"] == "ddp"
        assert run["config"]["training"]["param_dtype"] == "bf16"


def test_the_bf16_repeat_takes_a_free_gpu_of_the_last_wave(side_by_side):
    """With a GPU to spare, the second bf16 run starts with the arms instead of after them."""
    record = json.loads(_evidence(side_by_side, "ab-tiny-cpu.json").read_text())
    assert record["complete"] and [r["run"] for r in record["baseline_repeats"]] == [REPEAT_ARM, "bf16 (repeat 2)"]
    (start_bf16, end_bf16), _ = (arm["ran_between"] for arm in record["arms"])
    for repeat in record["baseline_repeats"]:
        assert repeat["rel_loss_gap"] == 0.0
        assert repeat["loss_curve"] == record["arms"][0]["loss_curve"]  # kept to compare per step
    start_repeat, end_repeat = record["baseline_repeats"][0]["ran_between"]
    assert start_repeat < end_bf16 and start_bf16 < end_repeat, "the first repeat ran alongside the first bf16 run"
    assert record["baseline_repeats"][1]["ran_between"][0] >= end_bf16, "the second repeat waited for a free GPU"
    markdown = _evidence(side_by_side, "ab-tiny-cpu.md").read_text()
    assert "bf16 run-to-run over 3 runs" in markdown
    assert "with 3 bf16 runs or more, the one-sided gate instead: their mean + max(2.00%, 2 standard deviations)" in \
        markdown  # the loss rule three bf16 runs judge by


def test_a_killed_ab_keeps_the_arms_it_measured_and_continues(tmp_path, capsys):
    """Killed while its second arm runs (as a GPU call's time limit kills it), the A/B has already
    written the first arm's evidence, marked partial, with the arms still to run; --continue-from runs
    those (a second call) and writes the whole A/B, refusing a file of another configuration."""
    command = [sys.executable, "-m", "fp8stack.ab", "--model", "tiny", "--recipes", "tensorwise", "--steps", "3",
               "--micro-batch", "2", "--seq-len", "64", "--device", "cpu", "--label", "killed",
               "--out-dir", str(tmp_path)]
    ab = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True,
                          env={k: v for k, v in os.environ.items() if k != "OUT"})
    try:
        # "[2/2] ..." is printed when the second arm starts, after the first arm's evidence is written.
        started = next((line for line in ab.stdout if line.startswith("[2/")), None)
    finally:
        os.killpg(ab.pid, signal.SIGKILL)  # the harness and the arm's training process with it
        ab.wait()
    assert started, "the A/B ended before its second arm started"
    record = json.loads(_evidence(tmp_path, "ab-tiny-killed-cpu.json").read_text())  # --label names the evidence
    assert record["complete"] is False and record["pending_arms"] == ["tensorwise", "bf16 (repeat)"]
    assert [arm["recipe"] for arm in record["arms"]] == ["bf16"]
    assert record["arms"][0]["verdict"] == "baseline" and len(record["arms"][0]["loss_curve"]) == 3
    markdown = _evidence(tmp_path, "ab-tiny-killed-cpu.md").read_text()
    assert "**Partial: the run has not finished.** Measured: bf16; pending: tensorwise, bf16 (repeat)." in markdown

    partial = tmp_path / "partial.json"
    _evidence(tmp_path, "ab-tiny-killed-cpu.json").rename(partial)
    assert main([*command[3:], "--steps", "4", "--continue-from", str(partial)]) == 2
    err = capsys.readouterr().err
    assert "is another A/B (train_config differs in " in err and "job.training.steps" in err, err
    assert main([*command[3:], "--continue-from", str(partial)]) == 0
    whole = json.loads(_evidence(tmp_path, "ab-tiny-killed-cpu.json").read_text())
    assert whole["complete"] and [arm["recipe"] for arm in whole["arms"]] == ["bf16", "tensorwise"]
    assert whole["runs"]["bf16"] == record["runs"]["bf16"], "the earlier call's bf16 run is kept, not rerun"
    assert whole["baseline_repeats"][0]["rel_loss_gap"] == 0.0  # the new repeat matches it: same seed, CPU kernels
    assert [c["runs"] for c in whole["continued_from"]] == [["bf16"]]
    assert "Runs bf16 from an earlier call" in _evidence(tmp_path, "ab-tiny-killed-cpu.md").read_text()


def test_bf16_runs_taken_from_an_earlier_a_b_judge_the_fp8_arms_that_run_alone(one_after_another, tmp_path, capsys):
    """--bf16-from: TWO_ARMS' bf16 run and its repeat, taken as they were recorded, judge the FP8 arm, the one arm
    this A/B runs; the Markdown says where they came from. Refused in one line, exit 2, before any arm and without
    evidence: a file whose bf16 runs trained other steps, one that ran on another device, one without a bf16 run."""
    source = _evidence(one_after_another[0], "ab-tiny-cpu.json")
    printed = _run_ab(tmp_path, *TWO_ARMS, "--bf16-from", str(source), "--label", "taken")
    assert "[1/1] tiny tensorwise" in printed and "bf16 (repeat)" not in printed.split("[1/1]")[1].splitlines()[0]
    taken, earlier = (json.loads(path.read_text()) for path in (_evidence(tmp_path, "ab-tiny-taken-cpu.json"), source))
    assert taken["complete"] and taken["runs"]["bf16"] == earlier["runs"]["bf16"]
    assert taken["runs"]["bf16 (repeat)"] == earlier["runs"]["bf16 (repeat)"]
    assert [arm["recipe"] for arm in taken["arms"]] == ["bf16", "tensorwise"]
    assert [c["runs"] for c in taken["continued_from"]] == [["bf16", "bf16 (repeat)"]]
    assert "Runs bf16, bf16 (repeat) from an earlier call" in _evidence(tmp_path, "ab-tiny-taken-cpu.md").read_text()
    elsewhere, without = tmp_path / "elsewhere.json", tmp_path / "without.json"
    elsewhere.write_text(json.dumps({**earlier, "device": "NVIDIA H200"}))
    without.write_text(json.dumps({**earlier, "runs": {"tensorwise": earlier["runs"]["tensorwise"]}}))
    refusals = ((["--steps", "3", "--bf16-from", str(source)], "job.training.steps than this A/B's bf16 arm"),
                (["--bf16-from", str(elsewhere)], "ran on NVIDIA H200, and this A/B runs on"),
                (["--bf16-from", str(without)], "holds no finished bf16 run"))
    for flags, problem in refusals:
        assert main([*TWO_ARMS, *flags, "--label", "refused", "--out-dir", str(tmp_path)]) == 2
        error = capsys.readouterr().err.strip()
        assert problem in error and error.count("\n") == 0, error
    assert not list(tmp_path.rglob("*refused*"))


def test_bf16_runs_from_several_files_fill_the_baseline_runs_in_order_each_run_once(one_after_another, tmp_path):
    """--bf16-from a,b with --baseline-runs 3: a's bf16 run and repeat, then b's one run that a does not hold (b's
    other is a's bf16 run again, as a file that took it would hold it) as 'bf16 (repeat 2)'; no BF16 run runs."""
    source = _evidence(one_after_another[0], "ab-tiny-cpu.json")
    earlier = json.loads(source.read_text())
    another_run = {**earlier["runs"]["bf16"], "losses": [loss * 1.001 for loss in earlier["runs"]["bf16"]["losses"]]}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**earlier, "runs": {"bf16": earlier["runs"]["bf16"], "bf16 (repeat)": another_run}}))
    printed = _run_ab(tmp_path, *TWO_ARMS, "--baseline-runs", "3", "--bf16-from", f"{source},{other}",
                      "--label", "pooled")
    assert "[1/1] tiny tensorwise" in printed
    pooled = json.loads(_evidence(tmp_path, "ab-tiny-pooled-cpu.json").read_text())
    assert pooled["runs"]["bf16 (repeat 2)"]["losses"] == another_run["losses"]
    assert [(c["file"], c["runs"]) for c in pooled["continued_from"]] == [
        (str(source), ["bf16", "bf16 (repeat)"]), (str(other), ["bf16 (repeat 2)"])]
    assert len(pooled["baseline_repeats"]) == 2


def test_bf16_runs_are_taken_only_for_the_plain_bf16_arm_from_a_readable_file(tmp_path):
    """With a BF16 arm on TE beside the plain one (--fastest-bf16), in this A/B or in the file's, the repeats rerun
    the faster: no file's runs stand in for them. A file that cannot be read is named."""
    with pytest.raises(ValueError, match="also runs bf16 on te: pass --no-fastest-bf16"):
        _bf16_runs_from(tmp_path / "unread.json", {"bf16": None, "bf16 on te": None}, "cpu")
    fastest = tmp_path / "fastest.json"
    fastest.write_text(json.dumps({"runs": {"bf16": {}, "bf16 on te": {}}}))
    with pytest.raises(ValueError, match="ran several BF16 arms, whose repeats rerun the faster: give an A/B run with "
                                         "--no-fastest-bf16"):
        _bf16_runs_from(fastest, {"bf16": None}, "cpu")
    with pytest.raises(ValueError, match="cannot read --bf16-from .*missing.json"):
        _bf16_runs_from(tmp_path / "missing.json", {"bf16": None}, "cpu")


def test_a_wave_s_arms_are_taken_as_their_processes_end(tmp_path):
    """Arms side by side are collected (and their evidence recorded) as each process ends, not in their order: a
    wave cut by a time limit keeps the arms that had ended. An arm that never started comes first."""
    def arm(seconds: float) -> _RunningArm:
        running = _RunningArm.__new__(_RunningArm)
        running.process = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
        return running

    outcomes = {"bf16": arm(3.0), "tensorwise": arm(0.0), "rowwise": "planned on no backend"}
    assert [name for name, _ in _as_they_end(outcomes, poll_s=0.05)] == ["rowwise", "tensorwise", "bf16"]


def test_gpus_past_those_cuda_visible_devices_leaves_are_refused_before_any_arm(tmp_path, monkeypatch, capsys):
    """--gpus counts the GPUs this process sees: under CUDA_VISIBLE_DEVICES=4,5 (a scheduler's or a lane's) GPU 1 is
    the device 5, and GPU 2 is refused with one line, exit 2, and no evidence."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert main([*TWO_ARMS, "--gpus", "0,2", "--out-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "GPU 2: CUDA_VISIBLE_DEVICES=4,5 leaves 2 GPU(s) visible" in error
    assert not list(tmp_path.rglob("*.json"))


def test_a_continued_ab_may_run_its_arms_on_other_gpus_but_not_with_other_settings(tmp_path):
    """Where and how many arms run at once (--gpus) is not the A/B: a killed run of four arms side by side may be
    continued one at a time; its steps may not change."""
    config = {"job": {"training": {"steps": 2000}}, "ab": {"baseline_runs": 3}}
    record = {"train_config": {"job": config["job"], "ab": {**config["ab"], "gpus": ["0", "0", "0", "0"]}},
              "recipes": ["bf16", "delayed"], "nproc": 1, "runs": {"bf16": {"losses": [1.0]}}, "continued_from": [],
              "date": "today", "command": "fp8stack ab ..."}
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(record))
    runs, earlier = _earlier_runs(partial, config, ["bf16", "delayed"], 1)
    assert runs == record["runs"] and earlier[0]["runs"] == ["bf16"]
    other = {"job": {"training": {"steps": 1000}}, "ab": config["ab"]}
    with pytest.raises(ValueError, match="train_config differs in job.training.steps"):
        _earlier_runs(partial, other, ["bf16", "delayed"], 1)


def test_blockwise_runs_once_per_gemm_library(capsys):
    """--blockwise-gemms te,deepgemm: the blockwise recipe twice in one A/B, on cuBLAS and on DeepGEMM, beside the
    other arms (which take no GEMM library); refused where no blockwise run would take it."""
    configs = _arms("--model", "tiny", "--backend", "te", "--blockwise-gemms", "te,deepgemm", "--fastest-bf16",
                    recipes=("bf16", "delayed", "blockwise"))
    assert {name: (cfg.precision.recipe, cfg.te.blockwise_gemms) for name, cfg in configs.items()} == {
        "bf16": ("bf16", "te"), "bf16 on te": ("bf16", "te"), "delayed": ("delayed", "te"),
        "blockwise": ("blockwise", "te"), "blockwise on deepgemm": ("blockwise", "deepgemm")}
    with pytest.raises(ConfigError, match="add blockwise to --recipes or drop --blockwise-gemms"):
        _arms("--blockwise-gemms", "deepgemm")
    assert main(["--blockwise-gemms", "te,cutlass", "--out-dir", "unused"]) == 2
    assert "unknown cutlass in --param-dtypes/--blockwise-gemms" in capsys.readouterr().err


def test_every_arm_runs_once_per_param_dtype_and_bf16_parameters_can_be_the_reference(bf16_parameters_on_gpu_1,
                                                                                      capsys):
    """--param-dtypes fp32,bf16: each arm with FP32 parameters and with BF16 ones (FP32 masters), the latter named
    '<arm>, bf16 params'; a BF16 configuration either way, so the faster BF16 run is the reference."""
    configs = _arms("--model", "tiny", "--steps", "4", "--backend", "te", "--fastest-bf16", "--param-dtypes",
                    "fp32,bf16", "--dtype", "bf16")
    assert {name: (c.precision.recipe, c.precision.backend, c.training.param_dtype) for name, c in configs.items()} == {
        "bf16": ("bf16", "auto", "fp32"), "bf16, bf16 params": ("bf16", "auto", "bf16"),
        "bf16 on te": ("bf16", "te", "fp32"), "bf16 on te, bf16 params": ("bf16", "te", "bf16"),
        "delayed": ("delayed", "te", "fp32"), "delayed, bf16 params": ("delayed", "te", "bf16")}
    results = {"bf16": _result(100.0, 2.0, 0.0), "bf16, bf16 params": _result(97.0, 2.0, 0.0),
               "delayed": _result(70.0, 2.0, 0.8)}
    assert reference_arm(results) == "bf16, bf16 params"
    arms, _ = judge(results, {"bf16": "bf16", "bf16, bf16 params": "bf16", "delayed": "te"}, tolerance=0.0025,
                    peaks=None)
    assert [a.verdict for a in arms] == ["alternative", "baseline", "ship"]
    assert "faster than bf16, bf16 params beyond the noise" in arms[2].reason
    assert main(["--param-dtypes", "fp16", "--out-dir", "unused"]) == 2
    assert "unknown fp16 in --param-dtypes/--blockwise-gemms/--attention: use fp32, bf16, fp8" in (
        capsys.readouterr().err)
    record = json.loads(_evidence(bf16_parameters_on_gpu_1, "ab-tiny-cpu.json").read_text())
    assert [a["recipe"] for a in record["arms"]] == ["bf16, bf16 params", "tensorwise, bf16 params"]
    assert record["arms"][0]["verdict"] == "baseline" and record["arms"][1]["rel_loss_gap"] is not None
    assert record["train_config"]["ab"]["param_dtypes"] == ["bf16"]
    markdown = _evidence(bf16_parameters_on_gpu_1, "ab-tiny-cpu.md").read_text()
    assert "keep BF16 parameters with FP32 masters" in markdown


def test_fp8_parameters_are_an_arm_of_each_fp8_recipe_only():
    """--param-dtypes bf16,fp8: the FP8 arms once more with their TE weights in FP8 only ('<arm>, fp8 params'); the
    BF16 arms have no FP8 weights, so they run with BF16 parameters alone."""
    configs = _arms("--model", "tiny", "--steps", "4", "--backend", "te", "--fastest-bf16", "--param-dtypes",
                    "bf16,fp8", "--dtype", "bf16")
    assert {name: (cfg.precision.recipe, cfg.training.param_dtype) for name, cfg in configs.items()} == {
        "bf16, bf16 params": ("bf16", "bf16"), "bf16 on te, bf16 params": ("bf16", "bf16"),
        "delayed, bf16 params": ("delayed", "bf16"), "delayed, fp8 params": ("delayed", "fp8")}


def test_fp8_attention_is_an_arm_of_each_recipe_that_has_it():
    """--attention bf16,fp8: each FP8 arm whose recipe has TE's FP8 attention once more with it ('<arm>, fp8
    attention'), so delayed is measured with and without; the others and the BF16 arms keep BF16 attention.
    --fp8-dot-product-attention alone gives it to the arms that take it, as a margin goes to delayed arms."""
    configs = _arms("--model", "llama-1b-like", "--attention", "bf16,fp8", "--fastest-bf16",
                    recipes=("bf16", "delayed", "blockwise"))
    assert {name: (c.precision.recipe, c.precision.fp8_attention) for name, c in configs.items()} == {
        "bf16": ("bf16", False), "bf16 on te": ("bf16", False), "delayed": ("delayed", False),
        "delayed, fp8 attention": ("delayed", True), "blockwise": ("blockwise", False)}
    configs = _arms("--model", "llama-1b-like", "--fp8-dot-product-attention", "--param-dtypes", "bf16",
                    recipes=("bf16", "delayed", "blockwise"))
    assert {name: c.precision.fp8_attention for name, c in configs.items()} == {
        "bf16, bf16 params": False, "delayed, fp8 attention, bf16 params": True, "blockwise, bf16 params": False}
    with pytest.raises(ConfigError, match="--attention fp8 runs TE's FP8 dot-product attention, which none of "
                                          "--recipes blockwise has here"):
        _arms("--attention", "fp8", recipes=("bf16", "blockwise"))
    assert ab_config(_ab_args("--attention", "bf16", "fp8")).attention == ("bf16", "fp8")


def test_a_lever_runs_each_fp8_arm_again_with_it_set():
    """--levers FIELD=VALUE: each FP8 arm once more with the option set, named '<arm> +FIELD=VALUE', so a lever's
    delta is measured in the same A/B against the same BF16 runs; the BF16 arms run once, as they were."""
    configs = _arms("--model", "llama-1b-like", "--levers", "te.one_autocast_per_forward=true,optimizer.warmup=3",
                    recipes=("bf16", "delayed", "tensorwise"))
    assert {name: (c.precision.recipe, c.te.one_autocast_per_forward, c.optimizer.warmup)
            for name, c in configs.items()} == {
        "bf16": ("bf16", False, None), "delayed": ("delayed", False, None), "tensorwise": ("tensorwise", False, None),
        "delayed +te.one_autocast_per_forward=true": ("delayed", True, None),
        "tensorwise +te.one_autocast_per_forward=true": ("tensorwise", True, None),
        "delayed +optimizer.warmup=3": ("delayed", False, 3), "tensorwise +optimizer.warmup=3": ("tensorwise", False, 3)}
    assert _arms("--levers", "grouped_fp8.wgrad_flatten=compiled")[
        "delayed +grouped_fp8.wgrad_flatten=compiled"].grouped_fp8.wgrad_flatten == "compiled"  # text, not JSON
    path_lever = "delayed +data.factory=/home/me/data.py:batches"  # a value with a path: one file name all the same
    assert arm_stem(path_lever) == "delayed_+data.factory=_home_me_data.py_batches"
    assert arm_stem("bf16 (repeat 2)") == "bf16_(repeat_2)"  # the folders of earlier calls' arms keep their names
    joined = "precision.expert_backend=te+training.allow_little_fp8=true+optimizer.lr=1e+3"  # one arm, 3 settings
    lever = _arms("--levers", joined)[f"delayed +{joined}"]
    assert (lever.precision.expert_backend, lever.training.allow_little_fp8, lever.optimizer.lr) == ("te", True, 1e3)


@pytest.mark.parametrize("lever, problem", [
    ("te.one_autocast_per_forward", "give FIELD=VALUE"),
    ("te.no_such_option=true", "unknown option 'te.no_such_option'"),
    ("optimizer.warmup=soon", "optimizer.warmup"),
])
def test_a_bad_lever_is_refused_before_any_arm_runs(lever, problem, tmp_path, capsys):
    assert main(["--model", "tiny", "--recipes", "tensorwise", "--steps", "3", "--device", "cpu", "--out-dir",
                 str(tmp_path), "--levers", lever]) == 2
    error = capsys.readouterr().err
    assert problem in error and len(error.strip().splitlines()) == 1, error
    assert not any(tmp_path.iterdir())


def test_ab_subcommand_plugs_into_a_parser():
    args = _ab_args("--model", "tiny", "--recipes", "bf16,rowwise", "--steps", "7")
    ab, base = ab_config(args), base_job(args, ab_config(args))
    assert (args.run, ab.recipes, base.training.steps, base.precision.backend, ab.nproc) == (
        run_ab, ("bf16", "rowwise"), 7, "auto", 1)
    assert ab.baseline_runs == 2 and ab_config(_ab_args("--baseline-runs", "4")).baseline_runs == 4


def test_options_apply_to_every_arm_whose_plan_uses_them():
    """A delayed-scaling margin goes to the recipes scaled from an amax history, the FP8 dispatch, the compiled wgrad
    layout and TE's expert quantizer to those whose grouped experts run blockwise, TE weight-gradient fusion to the arms with TE layers (all of
    megatron's); recompute and the plan's fusions go to every arm, the BF16 ones included."""
    margins = _arms("--fp8-margin", "1", recipes=("bf16", "tensorwise", "delayed"))
    assert [cfg.te.delayed_margin for cfg in margins.values()] == [0, 0, 1]
    dispatch = _arms("--grouped-fp8.fp8-dispatch", "--expert-backend", "grouped_fp8",
                     recipes=("bf16", "rowwise", "blockwise"))
    assert [cfg.grouped_fp8.fp8_dispatch for cfg in dispatch.values()] == [False, False, True]
    mixed = _arms("--grouped-fp8.fp8-dispatch", "--model", "tiny-moe", "--recipe-file",
                  "blockwise-experts-delayed-dense", recipes=("bf16", "delayed"))  # experts blockwise by override
    assert [cfg.grouped_fp8.fp8_dispatch for cfg in mixed.values()] == [False, True]
    flatten = _arms("--grouped-fp8.wgrad-flatten", "compiled", "--expert-backend", "grouped_fp8",
                    recipes=("bf16", "rowwise", "blockwise"))
    assert [cfg.grouped_fp8.wgrad_flatten for cfg in flatten.values()] == ["auto", "auto", "compiled"]
    mixed = _arms("--grouped-fp8.wgrad-flatten", "compiled", "--model", "tiny-moe", "--recipe-file",
                  "blockwise-experts-delayed-dense", recipes=("bf16", "delayed"))
    assert [cfg.grouped_fp8.wgrad_flatten for cfg in mixed.values()] == ["auto", "compiled"]
    quantizer = _arms("--grouped-fp8.quantizer", "te", "--expert-backend", "grouped_fp8",
                      recipes=("bf16", "rowwise", "blockwise"))
    assert [cfg.grouped_fp8.quantizer for cfg in quantizer.values()] == ["auto", "auto", "te"]
    for impl, in_bf16 in (("torch", None), ("megatron", True)):  # the plain BF16 run has no TE layers to fuse
        arms = _arms("--gradient-accumulation-fusion", "--model-impl", impl, "--backend", "te")
        assert [cfg.te.gradient_accumulation_fusion for cfg in arms.values()] == [in_bf16, True]
        assert [cfg.precision.backend for cfg in arms.values()] == ["auto", "te"]
    (on_te,) = _arms("--bf16-on-te", "--no-fuse-mlp", "--gradient-accumulation-fusion", "--backend", "te",
                     recipes=("bf16",)).values()
    assert (on_te.precision.backend, on_te.precision.fuse_mlp, on_te.te.gradient_accumulation_fusion) == (
        "te", False, True)
    arms = _arms("--recompute-modules", "mlp", "core_attn", "--backend", "te")
    assert {name: (cfg.activation_checkpoint.layers, cfg.activation_checkpoint.modules) for name, cfg in arms.items()
            } == {"bf16": ("all", ("mlp", "core_attn")), "delayed": ("all", ("mlp", "core_attn"))}
    assert {cfg.logging.interval for cfg in _arms("--steps", "40").values()} == {10}
    with pytest.raises(ConfigError, match="megatron's BF16 run is on TE already"):
        _arms("--bf16-on-te", "--model-impl", "megatron")


def test_every_arm_takes_the_optimizers_moments(monkeypatch):
    find_spec = importlib.util.find_spec  # as where TE is installed (the check looks for it; nothing imports it)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "transformer_engine" else find_spec(name, *args))
    arms = _arms("--optimizer.moments", "bf16", recipes=("bf16", "tensorwise", "delayed"))
    assert len(arms) == 3 and {cfg.optimizer.moments for cfg in arms.values()} == {"bf16"}


def test_an_option_of_some_recipes_is_checked_under_the_arms_that_take_it(capsys):
    """Without --fp8-recipe the options are checked under an arm's recipe, not the configuration's default bf16: a
    margin is taken when a delayed arm runs, refused when none does."""
    args = _ab_args("--recipes", "bf16,delayed", "--fp8-margin", "2")
    assert base_job(args, ab_config(args)).te.delayed_margin == 2
    assert main(["--recipes", "bf16,tensorwise", "--fp8-margin", "1", "--device", "cpu", "--out-dir", "unused"]) == 2
    assert "te.delayed_margin sets the headroom of scales taken from an amax history" in capsys.readouterr().err


def test_bf16_repeats_are_named_in_order(capsys):
    assert repeat_arms(1) == [] and repeat_arms(2) == [REPEAT_ARM]
    assert repeat_arms(4) == [REPEAT_ARM, "bf16 (repeat 2)", "bf16 (repeat 3)"]
    assert main(["--baseline-runs", "0", "--out-dir", "unused"]) == 2
    assert "--baseline-runs 0: the bf16 arm runs at least once" in capsys.readouterr().err


def test_ab_rejects_unknown_recipes(capsys):
    assert main(["--recipes", "bf16,fp4", "--out-dir", "unused"]) == 2
    assert "unknown FP8 recipe 'fp4': use one of bf16, delayed," in capsys.readouterr().err
    assert main(["--data-source", "pypi", "--out-dir", "unused"]) == 2
    assert "--data-source: invalid choice: 'pypi' (choose from 'stdlib', 'python')" in capsys.readouterr().err


def test_relative_gap_is_a_trailing_mean_of_the_per_step_gap():
    base = [2.0, 2.0, 2.0, 2.0]
    assert relative_gap([2.0, 2.2, 1.8, 2.0], base, window=1) == pytest.approx([0.0, 10.0, -10.0, 0.0])
    assert relative_gap([2.0, 2.2, 1.8, 2.0], base, window=2) == pytest.approx([0.0, 5.0, 0.0, -5.0])


def test_an_ab_past_one_pass_over_its_text_is_told_before_it_runs():
    """The 2 000-step runs at 4 x 1024 on the default 7.9 MB text read it 1.03 times: said before any run, with the
    data size that gives a loss verdict."""
    from fp8stack.ab.run import repeated_text

    message = repeated_text(2000 * 4 * 1024, 7_948_986)
    assert message.startswith("8,192,000 training tokens per arm read the training text (7.9 MB) 1.03 times")
    assert message.endswith("pass --max-data-bytes 8192000 or more (or train fewer tokens)")


@pytest.mark.parametrize(("ending", "reason"), [
    ("os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV, without its result"),
    ("sys.exit(3)", "exit code 3, without its result"),
    ("raise RuntimeError('the arm broke')", "RuntimeError: the arm broke")])
def test_a_failed_arm_is_named_by_its_error_else_by_how_it_ended(ending, reason, tmp_path, monkeypatch, capsys):
    """An arm's process that dies without an error line (a signal, an exit code) is not named by its last warning."""
    from fp8stack.ab import run as ab_run
    from fp8stack.config import JobConfig

    script = f"import os, signal, sys, warnings; warnings.warn('a late warning'); {ending}"
    monkeypatch.setattr(ab_run, "launcher", lambda nproc: [sys.executable, "-c", script])
    assert ab_run._RunningArm(JobConfig(), tmp_path, 1).result() == reason
    assert "UserWarning: a late warning" in capsys.readouterr().out  # the tail of its standard error, shown


def test_the_evidence_keeps_each_layers_routing_every_fiftieth_step_and_the_statistics_over_layers_at_every_step():
    from fp8stack.ab.run import LAYER_ROUTING_EVERY, PER_STEP_DIGITS, recorded_run

    steps = [{"imbalance": 1.0 + i, "cv": 0.5, "layers.1.moe/imbalance": 2.0 + i, "layers.1.moe/cv": 0.1}
             for i in range(120)]
    run = {"losses": list(range(120)), "router": steps}
    kept = recorded_run(run)
    assert [step["imbalance"] for step in kept["router"]] == [1.0 + i for i in range(120)]
    assert [i for i, step in enumerate(kept["router"]) if "layers.1.moe/imbalance" in step] == [0, 50, 100, 119]
    assert LAYER_ROUTING_EVERY == 50 and kept["losses"] == run["losses"] and run["router"] == steps  # not changed
    assert recorded_run("failed: out of memory") == "failed: out of memory"
    assert recorded_run({"router": []}) == {"router": []}
    figures = {"losses": [2.718281828459045, 10.0], "step_ms": [279.31234567], "lrs": [0.00021889387785457322],
               "grad_norms": [None, 0.7639141], "router": [{"cv": 0.6073360443115234}], "val_loss": 1.2345678912}
    assert PER_STEP_DIGITS == 7 and recorded_run(figures) == {  # to 7 significant digits; losses as measured
        "losses": [2.718281828459045, 10.0], "step_ms": [279.3123], "lrs": [0.0002188939],
        "grad_norms": [None, 0.7639141], "router": [{"cv": 0.607336}], "val_loss": 1.2345678912}
