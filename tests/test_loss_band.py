"""The BF16 band tool on the committed A/B evidence of one setting (8 x 1024, LR 3e-4, 300 steps on an H200)."""

import json
import statistics
from pathlib import Path

import pytest

from fp8stack.evidence import run_folder
from fp8stack.bench.loss_band import band, drift, main, place, run_labels

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def committed(name: str) -> Path:
    """The committed evidence file `name`: in its run folder under profiles/runs/."""
    (path,) = PROFILES.glob(f"runs/*/{name}")
    return path


def written(out_dir: Path, name: str) -> Path:
    """Where this process's tool wrote the evidence file `name` under out_dir: its run folder."""
    return run_folder(name.rsplit(".", 1)[0], out_dir) / name


SEQ1024_LR3E4 = [committed(f"ab-llama-1b-like-loss-300steps-{name}-h200.json")
                 for name in ("seq1024", "seq1024-tensorwise", "seq1024-e4m3", "seq1024-margin1", "seq1024-margin2",
                              "seq1024-margin1-e4m3")]


def test_band_statistics():
    stats = band([1.0, 1.1, 1.2])
    assert stats["mean"] == pytest.approx(1.1) and (stats["min"], stats["max"]) == (1.0, 1.2)
    assert stats["span"] == pytest.approx(0.2 / 1.1) and stats["stdev"] == pytest.approx(0.1)
    above = place(1.3, stats)
    assert above["gap_to_mean"] == pytest.approx(0.2 / 1.1) and above["stdevs"] == pytest.approx(2.0)
    assert above["position"] == "above every BF16 run"
    assert place(1.05, stats)["position"] == "within the BF16 runs"
    assert place(0.9, stats)["position"] == "below every BF16 run"
    with pytest.raises(ValueError, match="at least 2 BF16 runs"):
        band([1.0])


def test_band_of_the_committed_seq1024_runs(tmp_path):
    assert main(["--label", "seq1024-lr3e-4", "--out-dir", str(tmp_path), *map(str, SEQ1024_LR3E4)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-seq1024-lr3e-4-h200.json").read_text())
    assert record["bf16_band"]["runs"] == 7  # six files' bf16 arms and the first file's repeat
    assert [r["file"] for r in record["sources"]] == list(map(str, SEQ1024_LR3E4))
    positions = {r["run"]: r["position"] for r in record["fp8_runs"]}
    assert positions["delayed (recipe default format, margin 0)"] == "above every BF16 run"
    assert positions["tensorwise (e4m3)"] == "above every BF16 run"
    assert positions["delayed (recipe default format, margin 1)"] == "within the BF16 runs"
    assert record["settings"]["device"] == "NVIDIA H200"


def test_runs_of_another_setting_are_refused(tmp_path, capsys):
    other = committed("ab-llama-1b-like-loss-300steps-gb4-lr3e-4-h200.json")
    assert main(["--label", "mixed", "--out-dir", str(tmp_path), str(SEQ1024_LR3E4[0]), str(other)]) == 2
    err = capsys.readouterr().err
    assert "is of another setting" in err and "global_batch, micro_batch, seq_len differ" in err
    assert not list(tmp_path.iterdir())


def test_band_of_the_committed_2000_step_runs_names_fused_accumulation(tmp_path):
    """The two 2000-step A/Bs at 4 x 4096, LR 1e-4 (each a bf16 run and its repeat): four BF16 runs; the delayed
    runs differ by fused weight-gradient accumulation, which their names say."""
    files = [committed(f"ab-llama-1b-like-loss-2000steps{suffix}-h200.json") for suffix in ("", "-wgradfusion")]
    assert main(["--label", "2000steps", "--out-dir", str(tmp_path), *map(str, files)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-2000steps-h200.json").read_text())
    assert record["bf16_band"]["runs"] == 4
    assert [r["run"] for r in record["fp8_runs"]] == [
        "delayed (recipe default format, margin 0)",
        "delayed (recipe default format, margin 0, fused wgrad accumulation)"]


def test_a_recipe_files_per_module_recipes_are_in_the_runs_name(tmp_path):
    """The MoE gate's FP8 arm ran delayed dense linears with blockwise experts (a recipe file's override): its name
    says both, not 'delayed' alone."""
    gate = committed("ab-deepseek-moe-small-loss-gate-mixed-b-h200.json")
    assert main(["--label", "gate", "--out-dir", str(tmp_path), str(gate)]) == 0
    record = json.loads(written(tmp_path, "loss-band-deepseek-moe-small-gate-h200.json").read_text())
    assert record["bf16_band"]["runs"] == 3
    assert [r["run"] for r in record["fp8_runs"]] == [
        "delayed, *.experts.* blockwise (recipe default format, margin 0, fused wgrad accumulation)"]


def test_evidence_of_the_same_name_is_replaced_only_with_force(tmp_path, capsys):
    argv = ["--label", "seq1024-lr3e-4", "--out-dir", str(tmp_path), *map(str, SEQ1024_LR3E4)]
    assert main(argv) == 0
    recorded = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "exist: pass --force to replace that evidence" in err
    assert {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == recorded
    assert main([*argv, "--force"]) == 0


def test_arms_named_by_their_parameter_dtype_are_placed_by_their_recipe(tmp_path):
    ab = committed("ab-llama-1b-like-loss-2000steps-wgradfusion-bf16-params-head-on-te-h100.json")
    assert main(["--label", "bf16-params", "--out-dir", str(tmp_path), str(ab)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-bf16-params-h100.json").read_text())
    runs = [r["run"] for r in record["fp8_runs"]]
    assert "delayed, bf16 params (recipe default format, margin 0, fused wgrad accumulation)" in runs, runs


def test_the_one_sided_gate_passes_up_to_the_mean_plus_the_larger_of_the_floor_and_two_stdevs():
    wide = band([1.0, 1.1, 1.2])  # 2 standard deviations (0.2) beyond the 0.25 % floor
    assert place(1.3, wide)["gate_limit"] == pytest.approx(1.3)
    assert place(1.29, wide)["gate"] == "pass" and place(1.31, wide)["gate"] == "fail"
    assert place(0.5, wide)["gate"] == "pass"  # ending below BF16 passes
    narrow = band([1.0, 1.0001, 1.0002])  # the floor, 0.25 % of the mean, beyond 2 standard deviations
    assert place(1.0, narrow)["gate_limit"] == pytest.approx(1.0001 * 1.0025)
    assert place(1.0, band([1.0, 1.1]))["gate"] is None  # fewer than 3 BF16 runs: no gate


def test_runs_past_one_pass_over_the_text_are_no_gate(tmp_path):
    """The 2 000-step runs at 4 x 1024 on the default text read it 1.03 times: the band says it is not a gate."""
    files = [committed(f"ab-llama-1b-like-loss-2000steps-seq1024-gb4-{name}-h200.json")
             for name in ("bf16-delayed", "recipes")]
    assert main(["--label", "seq1024-gb4", "--out-dir", str(tmp_path), *map(str, files)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-seq1024-gb4-h200.json").read_text())
    assert record["memorised"] == [f.name for f in files] and record["bf16_band"]["runs"] == 4
    markdown = written(tmp_path, "loss-band-llama-1b-like-seq1024-gb4-h200.md").read_text()
    assert "NOT A GATE" in markdown and "(not a gate)" in markdown


def test_the_validation_losses_stand_beside_the_gate(tmp_path):
    """The completed 2000-step gate of 2026-11-28: each run's held-out loss at the end (the A/B's runs hold it, the
    BF16 repeats' included) beside the training-loss gate, with the FP8 runs' gap to the BF16 runs' mean."""
    gate = committed("ab-llama-1b-like-loss-gate-2000steps-h200.json")
    assert main(["--label", "gate", "--out-dir", str(tmp_path), str(gate)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-gate-h200.json").read_text())
    runs = json.loads(gate.read_text())["runs"]
    val = record["bf16_validation_band"]
    assert val["runs"] == 3 and val["mean"] == pytest.approx(
        sum(runs[name]["val_loss"] for name in ("bf16", "bf16 (repeat)", "bf16 (repeat 2)")) / 3)
    blockwise = next(r for r in record["fp8_runs"] if r["run"].startswith("blockwise"))
    assert blockwise["val_gap_to_mean"] == pytest.approx(runs["blockwise"]["val_loss"] / val["mean"] - 1)
    markdown = written(tmp_path, "loss-band-llama-1b-like-gate-h200.md").read_text()
    assert "Validation loss (the held-out split at the end; beside the gate, not in it)" in markdown
    assert f"{runs['blockwise']['val_loss']:.4f} ({blockwise['val_gap_to_mean']:+.2%})" in markdown


def test_without_every_bf16_run_s_validation_loss_there_is_no_validation_band(tmp_path):
    """The seq1024 file predates the runs' records: its BF16 run has no validation loss, so no band (the e4m3 file's
    FP8 runs keep theirs, without a gap)."""
    assert main(["--label", "seq1024-lr3e-4", "--out-dir", str(tmp_path), *map(str, SEQ1024_LR3E4)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-seq1024-lr3e-4-h200.json").read_text())
    assert None in [r["val_loss"] for r in record["bf16_runs"]] and record["bf16_validation_band"] is None
    e4m3 = [r for r in record["fp8_runs"] if r["file"] == SEQ1024_LR3E4[2].name]
    assert e4m3 and all(r["val_loss"] is not None and r["val_gap_to_mean"] is None for r in e4m3)


def test_each_runs_gradient_norms_stand_against_the_clip(tmp_path):
    """The 2000-step gate's runs: the share of steps whose norm the clip (1.0) shortened, from each run's recorded
    norms, and the median norm of the last quarter of the steps, the FP8 runs' against the BF16 runs' mean."""
    gate = committed("ab-llama-1b-like-loss-gate-2000steps-h200.json")
    assert main(["--label", "gate", "--out-dir", str(tmp_path), str(gate)]) == 0
    record = json.loads(written(tmp_path, "loss-band-llama-1b-like-gate-h200.json").read_text())
    runs = json.loads(gate.read_text())["runs"]
    norms = runs["blockwise"]["grad_norms"]
    blockwise = next(r for r in record["fp8_runs"] if r["run"].startswith("blockwise"))
    assert blockwise["clipped_share"] == pytest.approx(sum(n > 1.0 for n in norms) / len(norms))
    assert len(norms) == 2000 and blockwise["late_grad_norm"] == pytest.approx(statistics.median(norms[1500:]))
    bf16_late = [r["late_grad_norm"] for r in record["bf16_runs"]]
    assert len(bf16_late) == 3 and record["bf16_late_grad_norm"] == pytest.approx(sum(bf16_late) / 3)
    assert blockwise["late_norm_gap"] == pytest.approx(blockwise["late_grad_norm"] / record["bf16_late_grad_norm"] - 1)
    markdown = written(tmp_path, "loss-band-llama-1b-like-gate-h200.md").read_text()
    assert "The clip (1) shortened" in markdown and "Median gradient norm over the last quarter" in markdown


def test_the_figure_draws_each_runs_window_means_against_the_bf16_band(tmp_path):
    """The 2000-step A/Bs without clipping (two files, four BF16 runs): each run's loss as 50 window means of 40
    steps, the last ending at step 2000, and the figure beside the JSON."""
    pytest.importorskip("matplotlib")
    files = [committed(f"ab-llama-1b-like-loss-probe-clip0{suffix}-h200.json") for suffix in ("", "-b")]
    assert main(["--label", "clip0", "--out-dir", str(tmp_path), *map(str, files)]) == 0
    json_path = written(tmp_path, "loss-band-llama-1b-like-clip0-h200.json")
    record = json.loads(json_path.read_text())
    for run in record["bf16_runs"] + record["fp8_runs"]:
        windows = run["window_losses"]
        assert len(windows) == 50 and [end for end, _ in windows[:2]] == [40, 80] and windows[-1][0] == 2000
    first = record["bf16_runs"][0]
    (source,) = [f for f in files if f.name == first["file"]]
    losses = json.loads(source.read_text())["runs"][first["run"]]["losses"]
    assert first["window_losses"][0][1] == pytest.approx(statistics.fmean(losses[:40]))
    assert json_path.with_suffix(".png").stat().st_size > 10_000
    labels = run_labels(record)  # each run named with its file's number: both files' first BF16 runs are 'bf16'
    assert sorted(label for label in labels if label.startswith("bf16 [")) == ["bf16 [1]", "bf16 [2]"]
    assert all(label.endswith(("[1]", "[2]")) for label in labels)


def _windowed(run: str, losses: list[float]) -> dict:
    return {"run": run, "file": "ab.json", "window_losses": [[10 * (i + 1), loss] for i, loss in enumerate(losses)]}


def test_the_drift_places_each_fp8_run_along_the_run_and_finds_where_it_stays_above_every_bf16_run():
    """20 windows of 10 steps in 10 stretches of two: per stretch the BF16 mean, the spread of the BF16 runs'
    stretch means around it and each FP8 run's gap; an FP8 run above both BF16 runs from window 6 on is behind from
    step 51 (the window after the last one it did not stay above), one that ends inside is not behind."""
    low, high = [1.0] * 20, [1.2] * 20
    behind = _windowed("behind", [1.1] * 5 + [1.3] * 15)
    back = _windowed("back", [1.3] * 19 + [1.1])
    rows, placed = drift([_windowed("a", low), _windowed("b", high)], [behind, back])
    assert len(rows) == 10 and [row["to_step"] for row in rows[:2]] == [20, 40] and rows[-1]["to_step"] == 200
    assert rows[0]["bf16_mean"] == pytest.approx(1.1)
    assert (rows[0]["bf16_low"], rows[0]["bf16_high"]) == (pytest.approx(-1 / 11), pytest.approx(1 / 11))
    assert rows[0]["fp8_gaps"] == [pytest.approx(0.0), pytest.approx(0.2 / 1.1)]
    assert rows[2]["fp8_gaps"][0] == pytest.approx((1.1 + 1.3) / 2 / 1.1 - 1)  # windows 5 and 6
    assert [r["behind_from_step"] for r in placed] == [51, None]
    always = _windowed("always", [1.3] * 20)
    assert drift([_windowed("a", low)], [always])[1][0]["behind_from_step"] == 1
    shorter = _windowed("short", [1.3] * 10)
    assert drift([_windowed("a", low)], [shorter]) == ([], [shorter])  # windows of other steps: no drift


def test_the_moe_gate_band_says_from_which_step_each_fp8_run_stayed_above_the_bf16_runs(tmp_path):
    """The MoE gate files (2000 steps): the mixed, all-blockwise, MoE-only and dense-only FP8 runs against four BF16
    runs, the three that later files took by --bf16-from or --continue-from counted once; the drift table's ten
    stretches in the Markdown, and the step from which the failing FP8 runs stayed above every BF16 run."""
    files = [committed(f"ab-deepseek-moe-small-loss-gate-{name}-h200.json")
             for name in ("mixed", "mixed-b", "blockwise", "moe-only", "dense-only")]
    assert main(["--label", "gate", "--out-dir", str(tmp_path), *map(str, files)]) == 0
    record = json.loads(written(tmp_path, "loss-band-deepseek-moe-small-gate-h200.json").read_text())
    assert record["bf16_band"]["runs"] == 4
    assert [r["file"] for r in record["bf16_runs"]].count(files[0].name) == 3
    assert [row["to_step"] for row in record["drift"]] == list(range(200, 2001, 200))
    gates = {r["file"]: r["gate"] for r in record["fp8_runs"]}
    assert list(gates.values()) == ["fail", "fail", "pass", "pass"]  # mixed, blockwise | MoE-only, dense-only
    shares = [r["fp8_flop_share"] for r in record["fp8_runs"]]  # what each plan ran in FP8, not in the names
    assert shares[0] == shares[1] > shares[2] > 0.5 > 0.25 < shares[3] < 0.3
    assert all(isinstance(r["behind_from_step"], int) for r in record["fp8_runs"] if r["gate"] == "fail")
    markdown = written(tmp_path, "loss-band-deepseek-moe-small-gate-h200.md").read_text()
    assert "| steps to | BF16 mean | BF16 runs | FP8 1 | FP8 2 | FP8 3 | FP8 4 |" in markdown
    assert "| file | FP8 run | FP8 share of GEMM FLOPs | final loss |" in markdown and "| 70% | 0.8549 |" in markdown
    assert "above every BF16 run from step" in markdown


def test_a_plan_run_more_than_once_is_judged_by_the_mean_of_its_runs(tmp_path):
    """The MoE gate's repeats: the mix's two runs (one passing, one failing) lie above the gate on their mean; both of
    MoE-only FP8's runs pass and so does their mean; the plans run once stay out of the table."""
    files = [committed(f"ab-deepseek-moe-small-loss-gate-{name}-h200.json")
             for name in ("mixed", "mixed-b", "blockwise", "moe-only", "dense-only", "mixed-c", "moe-only-b")]
    assert main(["--label", "repeats", "--out-dir", str(tmp_path), *map(str, files)]) == 0
    record = json.loads(written(tmp_path, "loss-band-deepseek-moe-small-repeats-h200.json").read_text())
    mix, moe_only = record["repeated_plans"]
    assert mix["run"].startswith("delayed, *.experts.* blockwise") and moe_only["run"].startswith("blockwise (e4m3")
    assert (mix["passed_runs"], mix["gate"], moe_only["passed_runs"], moe_only["gate"]) == (1, "fail", 2, "pass")
    assert mix["mean"] == pytest.approx(statistics.fmean(mix["final_losses"])) and len(mix["final_losses"]) == 2
    assert mix["gap_to_mean"] > record["gate_limit"] / record["bf16_band"]["mean"] - 1 > moe_only["gap_to_mean"]
    markdown = written(tmp_path, "loss-band-deepseek-moe-small-repeats-h200.md").read_text()
    assert "| 1 of 2 | fail |" in markdown and "| 2 of 2 | pass |" in markdown


def test_runs_of_one_file_with_the_same_losses_are_each_a_run(tmp_path):
    """Only a run an earlier file holds counts once: two runs of one A/B whose losses match step for step (a CPU's
    deterministic kernels) are two runs of the band."""
    record = json.loads(committed("ab-deepseek-moe-small-loss-gate-mixed-h200.json").read_text())
    for repeat in ("bf16 (repeat)", "bf16 (repeat 2)"):
        record["runs"][repeat]["losses"] = record["runs"]["bf16"]["losses"]
    same = tmp_path / "same.json"
    same.write_text(json.dumps(record))
    assert main(["--label", "same", "--out-dir", str(tmp_path), str(same), str(same)]) == 0
    band_record = json.loads(written(tmp_path, "loss-band-deepseek-moe-small-same-h200.json").read_text())
    assert band_record["bf16_band"]["runs"] == 3 and {r["file"] for r in band_record["bf16_runs"]} == {"same.json"}


def test_plot_only_redraws_a_bands_figure_and_the_band_needs_its_files(tmp_path, capsys):
    """--plot-only draws a band's figure again from its JSON, measuring nothing, and refuses other options beside it;
    without --plot-only the files and --label are required, one line naming them."""
    pytest.importorskip("matplotlib")
    band_json = tmp_path / "loss-band-deepseek-moe-small-gate-blockwise-2000steps-h200.json"
    band_json.write_text(committed(band_json.name).read_text())
    assert main(["--plot-only", str(band_json)]) == 0
    assert band_json.with_suffix(".png").stat().st_size > 10_000
    for argv, message in ((["--plot-only", str(band_json), "--label", "x"], "drop --label"),
                          (["--label", "x"], "give the A/B evidence files of one setting and --label NAME")):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert main(["--plot-only", str(tmp_path / "missing.json")]) == 2
    before_the_gate = json.loads(band_json.read_text())
    del before_the_gate["gate_limit"]  # bands written before the gate hold none: drawn without its line
    band_json.write_text(json.dumps(before_the_gate))
    assert main(["--plot-only", str(band_json)]) == 0
