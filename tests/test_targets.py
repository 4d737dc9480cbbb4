"""fp8stack.bench.targets on synthetic evidence files: which arm each target reads, the ratios, the statuses."""

import json
from pathlib import Path

import pytest

from fp8stack.ab.run import AbConfig, to_plain
from fp8stack.bench import targets
from fp8stack.evidence import run_folder
from fp8stack.config import from_overrides, to_dict


def written(out_dir: Path, name: str) -> Path:
    """Where this process's tool wrote the evidence file `name` under out_dir: its run folder."""
    return run_folder(name.rsplit(".", 1)[0], out_dir) / name


def ab_file(tmp_path, name, arms, fastest_bf16=True, fp8_recompute=None, device="NVIDIA H200",
            param_dtypes=("fp32", "bf16"), **train_config):
    """An A/B evidence file with the fields targets reads: (recipe, verdict, tokens/s, peak GiB) per arm."""
    record = {"device": device, "model": "llama-1b-like",
              "train_config": {"fastest_bf16": fastest_bf16, "fp8_recompute": fp8_recompute,
                               "param_dtypes": list(param_dtypes), **train_config},
              "arms": [{"recipe": r, "verdict": v, "tokens_per_s": t, "peak_mem_gib": m} for r, v, t, m in arms]}
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def by_target(rows):
    return {r["target"]: r for r in rows}


def test_speed_memory_and_blockwise_rows_read_the_right_arms(tmp_path):
    fast = ab_file(tmp_path, "fast.json", [("bf16", "alternative", 98.0, 25.0), ("bf16 on te", "baseline", 100.0, 24.0),
                                           ("delayed", "rollback", 146.0, 23.0)])
    lean = ab_file(tmp_path, "lean.json", [("bf16 on te", "baseline", 100.0, 24.0), ("delayed", "ship", 120.0, 21.0)],
                   fp8_recompute=["mlp"])
    block = ab_file(tmp_path, "block.json", [("bf16", "baseline", 100.0, 20.0), ("blockwise", "ship", 125.0, 19.0),
                                             ("delayed", "ship", 130.0, 19.0)],
                    fastest_bf16=False, blockwise_gemms="deepgemm")
    rows = by_target(targets.ab_rows([a for p in (fast, lean, block) for a in targets.ab_arms(p)]))
    speed = rows["speed"]
    assert (speed["file"], speed["arm"], speed["reference"], speed["status"]) == ("fast.json", "delayed",
                                                                                  "bf16 on te", "met")
    assert speed["value"] == pytest.approx(1.46)
    # memory is judged on the fastest arm itself, against its own file's reference (23 / 24), not the leanest arm
    assert rows["memory"]["value"] == pytest.approx(23 / 24) and rows["memory"]["status"] == "not met"
    lean_row = rows["memory-lean"]
    assert (lean_row["file"], lean_row["arm"], lean_row["status"]) == ("lean.json", "delayed, recompute mlp", "met")
    assert lean_row["value"] == pytest.approx(21 / 24) and lean_row["note"].startswith("1.200x tokens/s")
    blockwise = rows["blockwise"]
    assert blockwise["value"] == pytest.approx(1.25) and blockwise["status"] == "not met"
    assert blockwise["note"].endswith("run without --fastest-bf16")
    # --blockwise-gemms deepgemm alone: a file whose one blockwise run is named blockwise
    assert blockwise["arm"] == "blockwise, GEMMs on DeepGEMM"
    assert {a["arm"] for a in targets.ab_arms(block)} == {"blockwise, GEMMs on DeepGEMM", "delayed"}
    # --blockwise-gemms te,deepgemm: one run per library, each a blockwise arm
    both = ab_file(tmp_path, "both.json", [("bf16 on te", "baseline", 100.0, 20.0), ("blockwise", "ship", 126.0, 19.0),
                                           ("blockwise on deepgemm", "ship", 131.0, 19.0)],
                   blockwise_gemms=["te", "deepgemm"])
    rows = by_target(targets.ab_rows(targets.ab_arms(both)))
    assert (rows["blockwise"]["arm"], rows["blockwise"]["status"]) == ("blockwise on deepgemm", "met")


def test_a_target_met_in_one_run_of_an_arm_and_missed_in_its_repeat_says_so(tmp_path):
    first = ab_file(tmp_path, "first.json", [("bf16 on te", "baseline", 100.0, 20.0),
                                             ("blockwise", "ship", 124.0, 19.0),
                                             ("blockwise on deepgemm", "ship", 130.5, 19.0)],
                    blockwise_gemms=["te", "deepgemm"])
    repeat = ab_file(tmp_path, "repeat.json", [("bf16 on te", "baseline", 100.0, 20.0),
                                               ("blockwise on deepgemm", "ship", 129.9, 19.0)],
                     blockwise_gemms=["deepgemm"])
    other = ab_file(tmp_path, "other.json", [("bf16 on te", "baseline", 100.0, 20.0),
                                             ("blockwise on deepgemm", "ship", 120.0, 19.0)],
                    blockwise_gemms=["deepgemm"], compile=False)  # other settings: not a repeat
    rows = by_target(targets.ab_rows([a for p in (first, repeat, other) for a in targets.ab_arms(p)]))
    blockwise = rows["blockwise"]
    assert (blockwise["file"], blockwise["status"]) == ("first.json", "met in 1 of 2 runs")
    assert blockwise["value"] == pytest.approx(1.305)
    assert "Repeats: 1.299x (repeat.json)." in blockwise["note"] and "other.json" not in blockwise["note"]
    # both runs met: plain met, the repeat named
    rows = by_target(targets.ab_rows([*targets.ab_arms(first), *targets.ab_arms(first)]))
    assert rows["blockwise"]["status"] == "met"


def test_a_target_met_only_against_plain_bf16_is_not_judged(tmp_path):
    plain = ab_file(tmp_path, "plain.json", [("bf16", "baseline", 100.0, 20.0), ("delayed", "ship", 150.0, 17.0)],
                    fastest_bf16=False)
    rows = by_target(targets.ab_rows(targets.ab_arms(plain)))
    assert rows["speed"]["status"] == rows["memory"]["status"] == "not judged"
    assert rows["speed"]["value"] == pytest.approx(1.5)
    # beside an arm judged against the fastest BF16 configuration, the judged one is reported
    fastest = ab_file(tmp_path, "fastest.json", [("bf16 on te", "baseline", 100.0, 20.0), ("delayed", "ship", 140.0,
                                                                                            19.0)])
    rows = by_target(targets.ab_rows([*targets.ab_arms(plain), *targets.ab_arms(fastest)]))
    assert (rows["speed"]["file"], rows["speed"]["status"]) == ("fastest.json", "not met")
    assert rows["memory-lean"]["file"] == "fastest.json"


def test_a_target_met_against_fp32_parameter_bf16_runs_only_is_not_judged(tmp_path):
    """BF16 parameters with FP32 masters make the BF16 runs faster (by 1-2%): a file whose BF16 runs
    all had FP32 parameters (files before --param-dtypes hold no param_dtypes) judges against a slower reference."""
    older = ab_file(tmp_path, "older.json", [("bf16 on te", "baseline", 100.0, 20.0), ("delayed", "ship", 146.0, 17.0)],
                    param_dtypes=())
    rows = by_target(targets.ab_rows(targets.ab_arms(older)))
    assert rows["speed"]["status"] == rows["memory"]["status"] == "not judged"
    assert rows["speed"]["note"].endswith("run without --param-dtypes bf16")
    both = ab_file(tmp_path, "both.json", [("bf16 on te", "alternative", 100.0, 20.0),
                                           ("bf16 on te, bf16 params", "baseline", 102.0, 20.5),
                                           ("delayed", "ship", 140.0, 19.0), ("delayed, bf16 params", "ship", 141.0,
                                                                              21.0)])
    rows = by_target(targets.ab_rows([*targets.ab_arms(older), *targets.ab_arms(both)]))
    assert (rows["speed"]["file"], rows["speed"]["arm"], rows["speed"]["status"]) == (
        "both.json", "delayed, bf16 params", "not met")
    assert rows["speed"]["value"] == pytest.approx(141 / 102) and rows["memory"]["value"] == pytest.approx(21 / 20.5)
    assert (rows["memory-lean"]["arm"], rows["memory-lean"]["value"]) == ("delayed", pytest.approx(19 / 20.5))


def tree_ab_file(tmp_path, name, arms, job, ab):
    """An A/B evidence file as `fp8stack ab` writes it from the configuration tree: train_config holds the first
    arm's JobConfig sections and the A/B's options."""
    record = {"device": "NVIDIA H200", "model": "llama-1b-like",
              "train_config": {"job": to_dict(job), "ab": to_plain(ab)},
              "arms": [{"recipe": r, "verdict": v, "tokens_per_s": t, "peak_mem_gib": m} for r, v, t, m in arms]}
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def test_files_of_the_configuration_tree_are_read_from_their_sections(tmp_path):
    recomputed = from_overrides({"training.param_dtype": "bf16", "activation_checkpoint.layers": "all",
                                 "activation_checkpoint.modules": ("mlp",)})
    fastest = tree_ab_file(tmp_path, "tree.json", [("bf16", "alternative", 98.0, 25.0),
                                                   ("bf16 on te", "baseline", 100.0, 24.0),
                                                   ("delayed", "ship", 146.0, 21.0),
                                                   ("blockwise on deepgemm, bf16 params", "ship", 131.0, 22.0)],
                           recomputed, AbConfig(blockwise_gemms=("deepgemm",)))
    arms = targets.ab_arms(fastest)
    assert [(a["arm"], a["recipe"], a["note"]) for a in arms] == [
        ("delayed, recompute mlp", "delayed", ""),
        ("blockwise on deepgemm, bf16 params, recompute mlp", "blockwise", "")]
    rows = by_target(targets.ab_rows(arms))
    assert (rows["speed"]["status"], rows["memory"]["value"]) == ("met", pytest.approx(21 / 24))
    assert (rows["blockwise"]["arm"], rows["blockwise"]["status"]) == ("blockwise on deepgemm, bf16 params, recompute "
                                                                       "mlp", "met")
    plain = tree_ab_file(tmp_path, "plain.json", [("bf16", "baseline", 100.0, 20.0), ("delayed", "ship", 150.0, 17.0)],
                         from_overrides({"training.param_dtype": "fp32"}), AbConfig(fastest_bf16=False))
    [arm] = targets.ab_arms(plain)
    assert arm["reference_without"] == ["--fastest-bf16", "--param-dtypes bf16"]
    assert by_target(targets.ab_rows([arm]))["speed"]["status"] == "not judged"
    # the same A/B again is a repeat of its arms; one of other settings is not
    again = tree_ab_file(tmp_path, "again.json", [("bf16 on te", "baseline", 100.0, 24.0),
                                                  ("delayed", "ship", 140.0, 21.0)],
                         recomputed, AbConfig(blockwise_gemms=("te",)))
    other = tree_ab_file(tmp_path, "other.json", [("bf16 on te", "baseline", 100.0, 24.0),
                                                  ("delayed", "ship", 140.0, 21.0)],
                         from_overrides({"training.param_dtype": "bf16"}), AbConfig())
    rows = by_target(targets.ab_rows([*arms, *targets.ab_arms(again), *targets.ab_arms(other)]))
    assert "Repeats: 1.400x (again.json)." in rows["speed"]["note"] and "other.json" not in rows["speed"]["note"]


def test_a_file_without_a_reference_that_ran_is_refused(tmp_path):
    path = ab_file(tmp_path, "x.json", [("bf16", "baseline", None, None), ("delayed", "rollback", 100.0, 20.0)])
    with pytest.raises(ValueError, match="no reference"):
        targets.ab_arms(path)


def test_experts_profile_and_loss_rows(tmp_path):
    entry = {"source": "issue-7", "gemm": "w13", "recipe": "blockwise"}
    experts = tmp_path / "backends.json"
    experts.write_text(json.dumps({"grouped": [
        {**entry, "recipe": "bf16", "module": "GroupedExperts.w13", "speedup_vs_bf16": 1.0},
        {**entry, "module": "Float8GroupedExperts", "options": {"kernels": "deepgemm"}, "speedup_vs_bf16": 0.99},
        {**entry, "module": "TEGroupedExperts", "speedup_vs_bf16": 1.36},
        {**entry, "gemm": "experts", "module": "TEGroupedExperts", "speedup_vs_bf16": 1.9},  # another GEMM: ignored
        {**entry, "module": "Float8GroupedExperts", "error": "no kernel"}]}))
    moe = targets.experts_row(experts)
    assert (moe["arm"], moe["value"], moe["status"]) == ("TEGroupedExperts", 1.36, "not met")
    assert "Float8GroupedExperts (kernels deepgemm) 0.990x" in moe["note"]

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"recipe": "delayed", "quantize_over_gemm": 0.108,
                                   "quantize_overhead_over_gemm": 0.053, "amdahl_bound": 1.46}))
    quantize = targets.profile_row(profile)
    assert (quantize["value"], quantize["status"]) == (0.053, "met")
    assert "whole quantize kernels 10.80% of GEMM time" in quantize["note"] and "1.460x" in quantize["note"]

    # A file from before the overhead figure: derived from each run's top kernels. The FP8 run's SwiGLU backward
    # writes FP8 (quantize), the bf16 run's the same family in BF16: only its excess counts.
    def run(recipe, quantize_ms, kernels, gemm_ms):
        return {"recipe": recipe, "top_kernels": [{"name": name, "ms_per_step": ms} for name, ms in kernels],
                "categories": {"quantize": {"ms_per_step": quantize_ms}, "gemm": {"ms_per_step": gemm_ms}}}

    dgated = "void transformer_engine::dgated_act_kernel<16, true, float, {}>(...)"
    profile.write_text(json.dumps({"recipe": "delayed", "quantize_over_gemm": 0.12, "amdahl_bound": 1.5,
                                   "fp8_share_of_gemm_flops": 0.8, "gemm_share": 0.75, "runs": {
        "bf16": run("bf16", 0.0, [(dgated.format("__nv_bfloat16"), 9.5)], 160.0),
        "delayed": run("delayed", 12.0, [(dgated.format("__nv_fp8_e5m2"), 9.9),
                                         ("cast_transpose_kernel(...)", 2.1)], 100.0)}}))
    quantize = targets.profile_row(profile)
    assert quantize["value"] == pytest.approx((12.0 - 9.5) / 100.0) and quantize["status"] == "met"
    # 128 of bf16's 160 ms of GEMMs in FP8 took 100 - 32 = 68 ms: 1.88x, and the bound at it
    assert f"measured 1.88x: {1 / (1 - 0.6 + 0.6 / (128 / 68)):.3f}x" in quantize["note"]
    assert "Derived here from each run's top 2 kernels" in quantize["note"]
    assert "transformer_engine::dgated_act_kernel 9.900 ms (bf16 9.500)" in quantize["note"]

    band = tmp_path / "band.json"
    # The one-sided gate of fp8stack.bench.loss_band: below BF16 passes; a band without one is not judged.
    runs = [{"file": "a.json", "run": "delayed", "gap_to_mean": -0.0045, "position": "below every BF16 run",
             "gate": "pass", "gate_limit": 0.6758},
            {"file": "b.json", "run": "delayed", "gap_to_mean": 0.002, "position": "within the BF16 runs",
             "gate": "pass", "gate_limit": 0.6758},
            {"file": "c.json", "run": "tensorwise", "gap_to_mean": 0.02, "position": "above every BF16 run",
             "gate": "fail", "gate_limit": 0.6758},
            {"file": "d.json", "run": "tensorwise", "gap_to_mean": 0.0, "position": "within the BF16 runs"}]
    record = {"bf16_band": {"runs": 4, "mean": 0.668, "stdev": 0.0039}, "fp8_runs": runs}
    band.write_text(json.dumps(record))
    statuses = [(r["file"], r["status"]) for r in targets.loss_rows(band)]
    assert statuses == [("a.json", "met"), ("b.json", "met"), ("c.json", "not met"), ("d.json", "not judged")]
    band.write_text(json.dumps({**record, "memorised": ["a.json"]}))
    assert {r["status"] for r in targets.loss_rows(band)} == {"not judged"}
    assert "not a gate: a.json read the training text more than once" in targets.loss_rows(band)[0]["note"]


def test_main_writes_evidence_and_refuses_mixed_devices(tmp_path, capsys):
    h200 = ab_file(tmp_path, "a.json", [("bf16", "baseline", 100.0, 20.0), ("delayed", "ship", 140.0, 19.0)])
    out = tmp_path / "out"
    assert targets.main(["--ab", str(h200), "--label", "t", "--out-dir", str(out)]) == 0
    record = json.loads(written(out, "targets-llama-1b-like-t-h200.json").read_text())
    assert [r["target"] for r in record["rows"]] == ["speed", "memory", "memory-lean"]
    assert "| speed | ≥ 1.450x | 1.400x | not met |" in written(out, "targets-llama-1b-like-t-h200.md").read_text()

    h100 = ab_file(tmp_path, "b.json", [("bf16", "baseline", 100.0, 20.0), ("delayed", "ship", 140.0, 19.0)],
                   device="NVIDIA H100 80GB HBM3")
    assert targets.main(["--ab", str(h200), str(h100), "--label", "t", "--out-dir", str(out)]) == 2
    assert "several devices or models" in capsys.readouterr().err


def test_the_bound_row_reads_the_ab_arm_of_the_profiled_recipe_against_the_profiles_measured_bound(tmp_path):
    """The committed H200 A/B and profile at llama-1b-like's defaults: delayed's gain over the profile's Amdahl bound
    at the GEMM speed-up the profile measured."""
    runs = Path(__file__).resolve().parents[1] / "profiles" / "runs"
    ab = runs / "2026-11-26-ab-llama-1b-like-default-h200" / "ab-llama-1b-like-default-h200.json"
    profile = runs / "2026-11-26-profile-llama-1b-like-default-h200" / "profile-llama-1b-like-default-h200.json"
    arms = targets.ab_arms(ab)
    bound = targets.bound_row(profile, arms)
    delayed = next(a for a in arms if a["arm"] == "delayed")
    measured = json.loads(profile.read_text())["amdahl_bound_at_measured_speedup"]
    assert bound["value"] == pytest.approx(delayed["speedup"] / measured)
    assert bound["status"] == ("met" if bound["value"] >= 0.97 else "not met")
    with pytest.raises(ValueError, match="an A/B arm named 'delayed'"):
        targets.bound_row(profile, [a for a in arms if a["arm"] != "delayed"])
