"""The A/B verdicts on synthetic runs: speed and memory against the measured noise, loss against its horizon and
tolerance, the overall verdict, the CPU reference's name, and the plot's error bars and labels."""

import pytest

from fp8stack.ab.run import _table
from fp8stack.ab.verdicts import (BF16_ON_TE_ARM, CPU_LOSS_TOLERANCE, GPU_LOSS_TOLERANCE, MIN_LOSS_WINDOW,
                                  REPEAT_ARM, arm_label, final_loss, judge, loss_horizon, memory_verdict,
                                  noise_band, verdict_cells)
from fp8stack.train.timing import relative_spread, steady_state

WARMUP = 4
"""LR warm-up steps of every synthetic run."""


def run(step_ms: float | list[float], loss: float = 2.0, *, fp8_share: float = 0.8, steps: int = 200,
        peak_gib: float | None = 10.0, rss_gib: float = 2.0, dtype: str = "bfloat16") -> dict:
    """A TrainResult dict as the worker writes it (with the harness's ran_between): `step_ms` every step or the
    step times themselves; `peak_gib` None for a CPU run, whose memory is `rss_gib`."""
    by_backend = {"bf16": 1 - fp8_share, **({"torchao": fp8_share} if fp8_share else {})}
    times = step_ms if isinstance(step_ms, list) else [step_ms] * steps
    return {"config": {"optimizer": {"warmup": WARMUP}}, "step_ms": times, "losses": [loss] * steps, "tokens_per_step": 1000,
            "peak_mem_gib": peak_gib, "max_rss_gib": rss_gib, "val_loss": loss, "dtype": dtype, "world_size": 1,
            "ran_between": [0.0, 1.0], "zero_fp8_weight_grads": [],
            "plan_summary": {"gemm_flops_per_token": 10**9, "flops_share_by_precision": {"fp8": fp8_share},
                             "flops_share_by_backend": by_backend}}


def cpu_run(step_ms: float | list[float], loss: float = 2.0, **kwargs) -> dict:
    """A CPU run: activations in FP32, memory the process's max RSS."""
    return run(step_ms, loss, peak_gib=None, dtype="float32", **kwargs)


def by_name(arms) -> dict:
    return {arm.recipe: arm for arm in arms}


def test_a_gap_within_the_noise_is_inconclusive_never_rollback():
    """At the CPU's 106% noise (a bf16 repeat 2.06x slower than the first run) an FP8 arm 2.1x slower or 1.3x faster
    than bf16 cannot be told apart from it: inconclusive, however long the run."""
    for steps in (40, 200):
        results = {"bf16": cpu_run(100.0, fp8_share=0.0, steps=steps), "tensorwise": cpu_run(208.0, steps=steps),
                   "rowwise": cpu_run(77.0, steps=steps)}
        repeats = {REPEAT_ARM: cpu_run(206.0, fp8_share=0.0, steps=steps)}
        arms, (repeat,) = judge(results, {"bf16": "bf16", "tensorwise": "torchao", "rowwise": "torchao"},
                                CPU_LOSS_TOLERANCE, None, repeats=repeats)
        assert repeat["run_to_run_noise"] == pytest.approx(1.06)
        arms = by_name(arms)
        for name in ("tensorwise", "rowwise"):
            assert arms[name].speed_noise == pytest.approx(1.06)
            assert (arms[name].speed_verdict, arms[name].verdict) == ("inconclusive", "inconclusive")
            assert arms[name].reason.startswith("within the noise of fp32 (no FP8): ")
            assert "x its tokens/s (noise 106.0%: 0.000x to 2.060x)" in arms[name].reason
        assert arms["tensorwise"].speed_ratio == pytest.approx(100 / 208)
    # the arm's own step-time spread is noise too: IQR / median 1.0 after warm-up
    spread = [100.0, 300.0] * 100
    arms, _ = judge({"bf16": run(200.0, fp8_share=0.0), "tensorwise": run(spread)},
                    {"bf16": "bf16", "tensorwise": "te"}, GPU_LOSS_TOLERANCE, None)
    assert relative_spread(steady_state(spread)) == 1.0
    assert (arms[1].speed_noise, arms[1].speed_verdict, arms[1].verdict) == (1.0, "inconclusive", "inconclusive")


def test_a_clear_speedup_with_the_loss_within_tolerance_ships():
    results = {"bf16": run(100.0, fp8_share=0.0), "tensorwise": run(70.0, 2.001), "rowwise": run(130.0)}
    arms, _ = judge(results, {"bf16": "bf16", "tensorwise": "torchao", "rowwise": "torchao"}, GPU_LOSS_TOLERANCE,
                    None, repeats={REPEAT_ARM: run(101.0, fp8_share=0.0)})
    bf16, faster, slower = arms
    assert (bf16.verdict, bf16.speed_verdict, bf16.speed_noise) == ("baseline", None, pytest.approx(0.01))
    assert faster.speed_ratio == pytest.approx(100 / 70) and faster.speed_noise == pytest.approx(0.01)
    assert (faster.speed_verdict, faster.loss_verdict, faster.verdict) == ("faster", "within", "ship")
    assert faster.reason == ("faster than bf16 beyond the noise: 1.429x its tokens/s (noise 1.0%: 0.990x to 1.010x); "
                             "loss +0.05% within +-0.25%")
    assert (slower.speed_verdict, slower.verdict) == ("slower", "rollback")
    assert slower.reason.startswith("slower than bf16 beyond the noise: 0.769x its tokens/s")
    assert verdict_cells(faster) == ["faster (1.429x, noise 1.0%)", "same (1.000x, noise 0.0%)", "within (+0.05%)"]
    assert verdict_cells(bf16) == ["-", "-", "-"]


def test_a_short_run_leaves_the_loss_not_judged():
    """12 steps after 4 warm-up ones: a loss 2.5x the reference's says nothing yet, so a faster arm is inconclusive."""
    horizon = loss_horizon(WARMUP)
    assert horizon == WARMUP + 50
    assert final_loss([9.0] * (horizon - WARMUP - MIN_LOSS_WINDOW) + [1.0] * MIN_LOSS_WINDOW) == 1.0, (
        "past the warm-up, the horizon's last-fraction mean takes exactly MIN_LOSS_WINDOW steps")
    results = {"bf16": run(100.0, 11.0, fp8_share=0.0, steps=12), "tensorwise": run(70.0, 27.0, steps=12)}
    arms, _ = judge(results, {"bf16": "bf16", "tensorwise": "torchao"}, GPU_LOSS_TOLERANCE, None)
    arm = arms[1]
    assert (arm.steps, arm.loss_horizon, arm.loss_verdict, arm.verdict) == (12, horizon, "not judged", "inconclusive")
    assert arm.reason.endswith(f"loss not judged: 12 steps < {horizon} (the LR warm-up, then enough steps for a "
                               f"{MIN_LOSS_WINDOW}-step final-loss mean)")
    assert verdict_cells(arm)[2] == f"not judged (12 steps < {horizon})"
    for steps, judged in ((horizon - 1, "not judged"), (horizon, "above")):
        results = {"bf16": run(100.0, 11.0, fp8_share=0.0, steps=steps), "tensorwise": run(70.0, 27.0, steps=steps)}
        arms, _ = judge(results, {"bf16": "bf16", "tensorwise": "torchao"}, GPU_LOSS_TOLERANCE, None)
        assert arms[1].loss_verdict == judged


def test_a_long_run_with_a_loss_above_the_tolerance_rolls_back_and_one_below_it_ships():
    """One-sided (issue 36's gate): an FP8 run ending above bf16 beyond the tolerance rolls back, one ending below it
    passes the loss."""
    results = {"bf16": run(100.0, 2.0, fp8_share=0.0), "tensorwise": run(70.0, 2.02), "rowwise": run(70.0, 1.98)}
    arms, _ = judge(results, {"bf16": "bf16", "tensorwise": "torchao", "rowwise": "torchao"}, GPU_LOSS_TOLERANCE, None,
                    repeats={REPEAT_ARM: run(100.0, 2.001, fp8_share=0.0)})
    above, below = arms[1:]
    assert (above.speed_verdict, above.loss_verdict, above.verdict) == ("faster", "above", "rollback")
    assert above.reason.endswith("; loss +1.00% vs bf16 is outside the +-0.25% tolerance")
    assert (below.loss_verdict, below.verdict) == ("below", "ship"), "one-sided: ending below bf16 passes"
    assert below.reason.endswith("; loss -1.00% vs bf16, below its -0.25% tolerance: the one-sided gate passes it (its "
                                 "validation loss says whether it learnt the same thing better)")


def test_memory_is_judged_against_its_own_noise():
    """CUDA's peak allocated memory is deterministic (noise 0 with one bf16 run); a CPU's max RSS is not, so its noise
    is the bf16 runs' difference, unmeasured with one."""
    backends = {"bf16": "bf16", "tensorwise": "te", "rowwise": "te"}
    gpu = {"bf16": run(100.0, fp8_share=0.0, peak_gib=10.0), "tensorwise": run(70.0, peak_gib=8.0),
           "rowwise": run(70.0, peak_gib=10.0)}
    _, less, same = judge(gpu, backends, GPU_LOSS_TOLERANCE, None)[0]
    assert (less.memory_ratio, less.memory_noise, less.memory_verdict) == (0.8, 0.0, "less")
    assert same.memory_verdict == "same"
    cpu = {"bf16": cpu_run(100.0, fp8_share=0.0, rss_gib=1.00), "tensorwise": cpu_run(70.0, rss_gib=1.12),
           "rowwise": cpu_run(70.0, rss_gib=1.005)}
    arms, _ = judge(cpu, backends, CPU_LOSS_TOLERANCE, None)
    assert [(a.memory_noise, a.memory_verdict) for a in arms[1:]] == [(None, "inconclusive")] * 2
    assert verdict_cells(arms[1])[1] == "inconclusive (1.120x, noise unmeasured)"
    arms, (repeat,) = judge(cpu, backends, CPU_LOSS_TOLERANCE, None,
                            repeats={REPEAT_ARM: cpu_run(100.0, fp8_share=0.0, rss_gib=0.99)})
    assert repeat["memory_run_to_run"] == pytest.approx(1 / 0.99 - 1)
    assert [a.memory_verdict for a in arms[1:]] == ["more", "inconclusive"]
    assert memory_verdict(1.02, noise=0.01) == "more" and memory_verdict(0.98, noise=0.01) == "less"
    assert noise_band(0.25) == (0.75, 1.25) and noise_band(1.06) == (0.0, 2.06)


def test_the_cpu_reference_is_named_fp32_not_bf16():
    """On a CPU the 'bf16' arm runs its activations in FP32: the table and the plot call it what it is, the JSON keeps
    its key."""
    assert arm_label("bf16", "float32") == "fp32 (no FP8)"
    assert arm_label(BF16_ON_TE_ARM, "float32") == "fp32 on te (no FP8)"
    assert arm_label("bf16 (repeat 2)", "float32") == "fp32 (no FP8) (repeat 2)"
    assert arm_label("tensorwise", "float32") == "tensorwise"
    assert arm_label("bf16", "bfloat16") == "bf16" and arm_label("bf16, bf16 params", "bfloat16") == "bf16, bf16 params"
    results = {"bf16": cpu_run(100.0, fp8_share=0.0), BF16_ON_TE_ARM: "TransformerEngine needs CUDA",
               "tensorwise": cpu_run(70.0)}
    arms, (repeat,) = judge(results, {"bf16": "bf16", BF16_ON_TE_ARM: "te", "tensorwise": "torchao"},
                            CPU_LOSS_TOLERANCE, None, repeats={REPEAT_ARM: cpu_run(100.0, fp8_share=0.0)})
    reference, failed, fp8 = arms
    assert (reference.recipe, reference.label, reference.activation_dtype) == ("bf16", "fp32 (no FP8)", "float32")
    assert failed.label == "fp32 on te (no FP8)" and failed.reason.endswith("; fp32 (no FP8) is the reference")
    assert fp8.reason.startswith("faster than fp32 (no FP8) beyond the noise: ")
    assert (repeat["run"], repeat["label"], repeat["of"]) == (REPEAT_ARM, "fp32 (no FP8) (repeat)", "bf16")
    header, rows = _table(arms)
    assert header == ["arm", "backend", "step ms", "tokens/s", "TFLOP/s", "MFU", "mem GiB", "final loss", "speed",
                      "memory", "loss", "verdict", "reason"]
    assert [row[0] for row in rows] == ["fp32 (no FP8)", "fp32 on te (no FP8)", "tensorwise"]
    assert rows[2][8:12] == [*verdict_cells(fp8), "ship"]


LONG_NAMES = ("bf16, bf16 params", "bf16 on te, bf16 params", "delayed, bf16 params", "blockwise, bf16 params",
              "blockwise on deepgemm, bf16 params", "blockwise on deepgemm, fp8 params", "mxfp8, bf16 params")


def test_the_throughput_plot_has_error_bars_and_labels_that_do_not_overlap(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.container import BarContainer

    from fp8stack.ab.plot import figure, plot

    times = {"bf16, bf16 params": 100.0, "bf16 on te, bf16 params": 97.0}
    results = {name: run(times.get(name, 80.0 + 3 * index), fp8_share=0.0 if name in times else 0.8)
               for index, name in enumerate(LONG_NAMES)}
    backends = {name: "te" for name in LONG_NAMES}
    arms, records = judge(results, backends, GPU_LOSS_TOLERANCE, None,
                          repeats={REPEAT_ARM: run(100.0, fp8_share=0.0)})
    assert {a.verdict for a in arms} >= {"baseline", "alternative", "ship"}
    fig = figure(arms, records, "long names")
    speed = fig.axes[2]
    (bars,) = [c for c in speed.containers if isinstance(c, BarContainer)]
    assert bars.errorbar is not None, "the throughput bars carry error bars"
    _, _, (whiskers,) = bars.errorbar.lines
    reference = next(arm for arm in arms if arm.verdict == "baseline")
    for arm, segment in zip(arms, whiskers.get_segments()):
        noise = reference.tokens_per_s * arm.speed_noise
        assert segment[:, 0] == pytest.approx([max(0.0, arm.tokens_per_s - noise), arm.tokens_per_s + noise])
        clears = segment[:, 0].min() > reference.tokens_per_s or segment[:, 0].max() < reference.tokens_per_s
        assert clears == (arm.speed_verdict in ("faster", "slower")), "the error bar clears the reference's line"
    assert all(arm.speed_noise > 0 for arm in arms), "the repeat's 3% makes every error bar visible"
    labels = speed.get_yticklabels()
    assert [label.get_text() for label in labels] == [a.label for a in arms]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    for upper, lower in zip(boxes, boxes[1:]):
        assert not upper.overlaps(lower), "tick labels overlap"
    page = fig.bbox
    assert all(page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1 for box in boxes)
    legend = speed.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(bar.get_window_extent(renderer)) for bar in bars), "the legend hides a bar"
    assert plot(arms, records, tmp_path / "ab.png", "long names") == tmp_path / "ab.png"
    assert (tmp_path / "ab.png").stat().st_size > 0
