"""fp8stack.bench.scaling on a CPU: which runs it plans and with which flags, how it judges them (synthetic run
records as launches.run_record keeps them), its evidence and figure. The runs themselves are launch/train.sh runs on
2+ GPUs (the lead runs `python -m fp8stack.bench.scaling --nproc 2` there); their launching is shared with
fp8stack.bench.multigpu, whose 2-rank runs tests/test_multigpu_cpu.py starts on gloo."""

import importlib.util
import json
from types import SimpleNamespace

import pytest

from fp8stack.bench import scaling
from fp8stack.evidence import run_folder
from fp8stack.train.command import job_from_flags

STEPS = 6
TOKENS_PER_STEP = 65536


def measured(tokens_per_s: float, peak: float, world_size: int, gathered: dict | None = None) -> dict:
    """A run record as launches.run_record keeps a finished run; `gathered`: all-gather bytes per group."""
    collectives = None if gathered is None else {
        "bytes": {"all_gather": sum(gathered.values()), "reduce_scatter": 1.0, "all_reduce": 0.0},
        "all_gather_bytes_by_group": gathered}
    return {"command": f"NPROC={world_size} launch/train.sh", "returncode": 0, "wall_s": 60.0,
            "losses": [10.0 - step for step in range(STEPS)], "step_ms_median": TOKENS_PER_STEP / tokens_per_s * 1000,
            "step_ms_spread": 0.01, "tokens_per_s": tokens_per_s, "peak_mem_gib": peak, "resident_mem_gib": peak / 2,
            "world_size": world_size, "device": "NVIDIA H200", "collectives": collectives, "first_step": 0,
            "plan_summary": {}, "grad_norms": [1.0] * STEPS}


RECORDS = {"one_gpu/bf16": measured(93_000, 24.7, 1), "one_gpu/delayed": measured(132_000, 25.9, 1),
           "ddp/bf16": measured(184_000, 24.8, 2), "ddp/delayed": measured(258_000, 26.0, 2),
           "fsdp/bf16": measured(170_000, 20.0, 2, {"root": 0.5e9, "layers.0": 4e9}),
           "fsdp/delayed": measured(225_000, 20.5, 2, {"root": 0.5e9, "layers.0": 4e9}),
           "fsdp_fp8_params/delayed": measured(240_000, 18.0, 2, {"root": 0.5e9, "layers.0": 2e9})}


def test_the_runs_are_each_wrappers_bf16_and_fp8_pair_beside_one_gpus_and_fp8_weights_only_in_fp8():
    planned = scaling.runs(["ddp", "fsdp", "fsdp_fp8_params"], "delayed")
    assert [scaling.run_name(*run) for run in planned] == list(RECORDS)


def test_the_fused_wgrad_wrapper_runs_the_recipe_only_over_gather_onces_bf16_run():
    planned = scaling.runs(["fsdp_gather_once_fused"], "delayed")
    assert [scaling.run_name(*run) for run in planned] == [
        "one_gpu/bf16", "one_gpu/delayed", "fsdp_gather_once/bf16", "fsdp_gather_once_fused/delayed"]
    job = job_from_flags(["--fp8-recipe", "delayed", *scaling.WRAPPERS["fsdp_gather_once_fused"]])
    assert job.te.gradient_accumulation_fusion is True and job.parallelism.fsdp_reshard_after_forward is False
    records = {"one_gpu/bf16": RECORDS["one_gpu/bf16"], "one_gpu/delayed": RECORDS["one_gpu/delayed"],
               "fsdp_gather_once/bf16": RECORDS["fsdp/bf16"], "fsdp_gather_once_fused/delayed": RECORDS["fsdp/delayed"]}
    result = scaling.judge(records, planned, "delayed", 2, STEPS)
    assert result["figures"]["fp8_over_bf16"]["fsdp_gather_once_fused"] == pytest.approx(225 / 170)
    assert not result["figures"].get("all_gather_bytes_fp8_over_bf16_blocks"), "it gathers BF16 weights"


def test_an_fp8_weight_wrapper_asked_alone_brings_its_twins_bf16_run_and_is_judged_over_it():
    planned = scaling.runs(["fsdp_fp8_params_gather_once"], "delayed")
    assert [scaling.run_name(*run) for run in planned] == [
        "one_gpu/bf16", "one_gpu/delayed", "fsdp_gather_once/bf16", "fsdp_fp8_params_gather_once/delayed"]
    records = {"one_gpu/bf16": RECORDS["one_gpu/bf16"], "one_gpu/delayed": RECORDS["one_gpu/delayed"],
               "fsdp_gather_once/bf16": RECORDS["fsdp/bf16"],
               "fsdp_fp8_params_gather_once/delayed": RECORDS["fsdp_fp8_params/delayed"]}
    result = scaling.judge(records, planned, "delayed", 2, STEPS)
    assert result["figures"]["fp8_over_bf16"]["fsdp_fp8_params_gather_once"] == pytest.approx(240 / 170)
    assert result["figures"]["all_gather_bytes_fp8_over_bf16_blocks"] == pytest.approx(
        {"fsdp_fp8_params_gather_once": 0.5})  # over the BF16 run's gathered BF16 weights


@pytest.mark.parametrize("wrapper, data_parallel, param_dtype, reshard", [
    ("ddp", "ddp", None, None), ("fsdp", "fsdp", None, None), ("fsdp_gather_once", "fsdp", None, False),
    ("fsdp_fp8_params", "fsdp", "fp8", None), ("fsdp_fp8_params_gather_once", "fsdp", "fp8", False)])
def test_each_wrappers_flags_ask_for_that_wrapper_and_leave_the_rest_at_the_fast_paths_defaults(
        wrapper, data_parallel, param_dtype, reshard):
    job = job_from_flags(["--fp8-recipe", "delayed", *scaling.WRAPPERS[wrapper]])
    assert job.parallelism.data_parallel == data_parallel and job.training.param_dtype == param_dtype
    assert job.parallelism.fsdp_reshard_after_forward is reshard and not job.parallelism.data_parallel_one_rank
    assert job.te.gradient_accumulation_fusion is None and job.te.cache_fp8_weights  # the wrapper decides


def judged(records: dict = RECORDS) -> dict:
    return scaling.judge(records, scaling.runs(["ddp", "fsdp", "fsdp_fp8_params"], "delayed"), "delayed", 2, STEPS)


def test_each_wrappers_fp8_over_bf16_is_judged_against_one_gpus_and_the_fp8_all_gather_against_bf16s():
    result = judged()
    ratios, checks = result["figures"]["fp8_over_bf16"], result["checks"]
    assert ratios == pytest.approx({"one_gpu": 132 / 93, "ddp": 258 / 184, "fsdp": 225 / 170,
                                    "fsdp_fp8_params": 240 / 170})  # over FSDP2's BF16 run
    assert checks[f"ddp: FP8/BF16 {258 / 184:.3f} within 0.03 of one GPU's {132 / 93:.3f}"] is True
    assert checks[f"fsdp: FP8/BF16 {225 / 170:.3f} within 0.03 of one GPU's {132 / 93:.3f}"] is False
    assert result["figures"]["all_gather_bytes_fp8_over_bf16_blocks"] == pytest.approx({"fsdp_fp8_params": 0.5})
    assert checks["fsdp_fp8_params: blocks' all-gather bytes at most 0.55x fsdp's"] is True
    assert result["figures"]["per_gpu_tokens_per_s"]["ddp/delayed"] == 129_000
    assert result["figures"]["scaling_efficiency"]["ddp/delayed"] == pytest.approx(258 / 264)
    assert all(checks[f"{name} ran {STEPS} steps"] for name in RECORDS)


def test_a_failed_run_fails_its_check_and_leaves_its_wrapper_unjudged():
    records = {**RECORDS, "ddp/delayed": {"command": "NPROC=2 launch/train.sh", "returncode": 1, "wall_s": 5.0,
                                          "log_tail": "RuntimeError: NCCL error"}}
    result = judged(records)
    assert result["checks"]["ddp/delayed ran 6 steps"] is False
    assert "ddp" not in result["figures"]["fp8_over_bf16"]
    text = scaling.render({"model": "llama-1b-like", "recipe": "delayed", "steps": STEPS, "nproc": 2,
                           "runs": records, **result})
    assert "| ddp/delayed | - |" in text and "failed (exit 1)" in text and "FAIL: ddp/delayed ran 6 steps" in text
    assert "| fsdp/delayed | 2 | 225,000 | 112,500 | 0.852 | 20.50 | 10.25 | 4.19 / 0.00 | 0 |" in text
    assert "fsdp_fp8_params's all-gather bytes over the blocks, FP8 weights vs fsdp's BF16 copies: 0.500x." in text


def write_json(folder, records: dict = RECORDS):
    path = folder / "scaling-llama-1b-like-2gpu-h200.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, "model": "llama-1b-like",
                                "recipe": "delayed", "steps": STEPS, "nproc": 2, "runs": records, **judged(records)}))
    return path


def test_the_figure_shows_per_gpu_tokens_and_each_wrappers_ratio_against_the_one_gpu_band(tmp_path):
    pytest.importorskip("matplotlib")
    fig = scaling.figure(json.loads(write_json(tmp_path).read_text()))
    speed, ratio = fig.axes
    assert [label.get_text() for label in speed.get_yticklabels()] == list(RECORDS)
    assert [bar.get_width() for bar in speed.containers[0]][:3] == [93_000, 132_000, 92_000]
    assert [label.get_text() for label in ratio.get_xticklabels()] == ["one_gpu", "ddp", "fsdp", "fsdp_fp8_params"]
    bars, band = ratio.patches[:4], ratio.patches[4]
    assert [bar.get_height() for bar in bars] == pytest.approx([132 / 93, 258 / 184, 225 / 170, 240 / 170])
    assert (band.get_y(), band.get_height()) == pytest.approx((132 / 93 - 0.03, 0.06))


def test_a_run_writes_json_markdown_and_figure_and_fails_on_a_failed_check(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "run_all", lambda workdir, planned, nproc, common, gpus, models: {
        scaling.run_name(*run): RECORDS[scaling.run_name(*run)] for run in planned})
    code = scaling.main(["--nproc", "2", "--steps", str(STEPS), "--out-dir", str(tmp_path)])
    folder = run_folder("scaling-llama-1b-like-2gpu-cpu", tmp_path)
    assert code == 1  # fsdp's ratio is outside the band: evidence, and a failed check
    record = json.loads((folder / "scaling-llama-1b-like-2gpu-cpu.json").read_text())
    assert record["nproc"] == 2 and set(record["runs"]) == set(RECORDS) and record["passed"] is False
    assert (folder / "scaling-llama-1b-like-2gpu-cpu.png").is_file() == (importlib.util.find_spec("matplotlib")
                                                                         is not None)


def test_a_label_names_a_second_run_of_the_day_beside_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "run_all", lambda workdir, planned, nproc, common, gpus, models: {
        scaling.run_name(*run): RECORDS[scaling.run_name(*run)] for run in planned})
    scaling.main(["--nproc", "2", "--steps", str(STEPS), "--out-dir", str(tmp_path)])
    scaling.main(["--nproc", "2", "--steps", str(STEPS), "--out-dir", str(tmp_path), "--label", "reduce-each"])
    for name in ("scaling-llama-1b-like-2gpu-cpu", "scaling-llama-1b-like-reduce-each-2gpu-cpu"):
        assert (run_folder(name, tmp_path) / f"{name}.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1"], "--nproc 1: the wrapped runs need at least 2 GPUs"),
    (["--wrappers", "ddp,zero"], "--wrappers 'ddp,zero': name some of ddp,fsdp,fsdp_gather_once,fsdp_fp8_params,"),
    (["--recipe", "bf16"], "--recipe bf16: name the FP8 recipe set against BF16"),
])
def test_bad_options_are_refused_in_one_line_before_any_run(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scaling, "run_all", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_:
        scaling.main([*argv, "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_the_evidence_index_describes_a_scaling_run(tmp_path):
    from fp8stack.bench.results import Run, describe

    record = json.loads(write_json(tmp_path).read_text())
    run = Run(tmp_path, {"scaling-llama-1b-like-2gpu-h200.json": {**record, "passed": False}})
    assert run.kind == "scaling"
    assert describe(run) == ("llama-1b-like BF16 and delayed on 2 GPUs and one (" + ", ".join(RECORDS) +
                             "): not all checks passed")


def test_flags_after_the_double_dash_reach_every_run(tmp_path, monkeypatch):
    seen = {}

    def record(workdir, planned, nproc, common, gpus, models):
        seen["common"] = common
        return {scaling.run_name(*run): RECORDS[scaling.run_name(*run)] for run in planned}

    monkeypatch.setattr(scaling, "run_all", record)
    scaling.main(["--nproc", "2", "--wrappers", "fsdp", "--out-dir", str(tmp_path), "--",
                  "--activation-checkpoint.layers", "all", "--micro-batch-size", "1"])
    assert seen["common"][-4:] == ["--activation-checkpoint.layers", "all", "--micro-batch-size", "1"]
    job = job_from_flags(seen["common"])
    assert (job.activation_checkpoint.layers, job.training.micro_batch) == ("all", 1)


def test_a_model_too_big_for_one_gpu_is_set_against_fewer_layers_of_it_on_one_gpu(tmp_path, monkeypatch):
    """--one-gpu-model: the one-GPU pair trains that model, the wrapped runs --model; the FP8/BF16 ratio is still
    judged against the one-GPU pair's, but no scaling efficiency compares tokens/s of two models."""
    launched = {}

    def started(name, workdir, nproc, flags, env=None):
        launched[name] = flags
        return SimpleNamespace(name=name)

    monkeypatch.setattr(scaling, "launch", started)
    monkeypatch.setattr(scaling, "start", started)
    monkeypatch.setattr(scaling, "wait", lambda run: run)
    monkeypatch.setattr(scaling, "run_record", lambda run: RECORDS[run.name])
    planned = scaling.runs(["fsdp"], "delayed")
    scaling.run_all(tmp_path, planned, 2, ["--train-iters", "6"], 2, {scaling.ONE_GPU: "llama3-8b-16-layers",
                                                                       None: "llama3-8b"})
    models = {name: job_from_flags(flags).model.name for name, flags in launched.items()}
    assert models == {"one_gpu/bf16": "llama3-8b-16-layers", "one_gpu/delayed": "llama3-8b-16-layers",
                      "fsdp/bf16": "llama3-8b", "fsdp/delayed": "llama3-8b"}
    records = {name: RECORDS[name] for name in models}
    result = scaling.judge(records, planned, "delayed", 2, STEPS, same_model=False)
    assert result["figures"]["scaling_efficiency"] == {}
    assert f"fsdp: FP8/BF16 {225 / 170:.3f} within 0.03 of one GPU's {132 / 93:.3f}" in result["checks"]
    text = scaling.render({"model": "llama3-8b", "one_gpu_model": "llama3-8b-16-layers", "recipe": "delayed",
                           "steps": STEPS, "nproc": 2, "runs": records, **result})
    assert "The one-GPU runs trained llama3-8b-16-layers, the same blocks at fewer layers" in text


def test_the_fsdp2_bound_runs_on_one_gpu_without_tes_two_fsdp2_levers_and_judges_each_fsdp2_wrapper(tmp_path,
                                                                                                   monkeypatch):
    """one_gpu_fsdp2_bound: one process per run, two at a time on two GPUs beside the one-GPU pair, without fused
    weight-gradient accumulation and the FP8 weight cache; the FSDP2 wrappers' ratios are judged against it as well
    as against one GPU's, DDP's against one GPU's only."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")  # a lane's GPUs: the one-GPU runs go to them
    batches, running = [], []

    def started(name, workdir, nproc, flags, env=None):
        running.append((name, nproc, env and env["CUDA_VISIBLE_DEVICES"], flags))
        return SimpleNamespace(name=name)

    def waited(run):
        if running:
            batches.append(list(running))
            running.clear()
        return run

    monkeypatch.setattr(scaling, "start", started)
    monkeypatch.setattr(scaling, "launch", lambda *args: waited(started(*args)))
    monkeypatch.setattr(scaling, "wait", waited)
    monkeypatch.setattr(scaling, "run_record", lambda run: run)
    planned = scaling.runs(["ddp", "fsdp", scaling.FSDP2_BOUND], "delayed")
    scaling.run_all(tmp_path, planned, 2, ["--train-iters", "6"], 2, {scaling.ONE_GPU: "m", None: "m"})
    assert [[(name, nproc, gpu) for name, nproc, gpu, _ in batch] for batch in batches] == [
        [("one_gpu/bf16", 1, "6"), ("one_gpu/delayed", 1, "7")],
        [("one_gpu_fsdp2_bound/bf16", 1, "6"), ("one_gpu_fsdp2_bound/delayed", 1, "7")],
        *([(name, 2, None)] for name in ("ddp/bf16", "ddp/delayed", "fsdp/bf16", "fsdp/delayed"))]
    bound = job_from_flags(batches[1][1][3])
    assert bound.te.gradient_accumulation_fusion is False and bound.te.cache_fp8_weights is False
    records = {**{name: RECORDS[name] for name in ("one_gpu/bf16", "one_gpu/delayed", "ddp/bf16", "ddp/delayed",
                                                   "fsdp/bf16", "fsdp/delayed")},
               "one_gpu_fsdp2_bound/bf16": measured(92_000, 24.7, 1),
               "one_gpu_fsdp2_bound/delayed": measured(122_000, 25.0, 1)}
    result = scaling.judge(records, planned, "delayed", 2, STEPS)
    checks = result["checks"]
    assert result["figures"]["fp8_over_bf16"]["one_gpu_fsdp2_bound"] == pytest.approx(122 / 92)
    assert checks[f"fsdp: FP8/BF16 {225 / 170:.3f} within 0.03 of the FSDP2 bound's {122 / 92:.3f} (one GPU "
                  "without the TE levers FSDP2 takes away)"] is True
    assert not any("bound's" in name for name in checks if name.startswith("ddp"))
    assert not any(name.startswith("one_gpu_fsdp2_bound: FP8/BF16") for name in checks)
    assert "one_gpu_fsdp2_bound/delayed" not in result["figures"]["scaling_efficiency"]
    assert result["figures"]["per_gpu_tokens_per_s"]["one_gpu_fsdp2_bound/delayed"] == 122_000


def test_each_lever_of_the_fsdp2_bound_runs_alone_on_one_gpu_and_is_reported_not_judged(tmp_path, monkeypatch):
    """one_gpu_uncached and one_gpu_unfused: one process each, BF16 and the recipe, without one of the bound's two TE
    levers; their FP8/BF16 is in the figures and no check names them."""
    started_runs = []

    def started(name, workdir, nproc, flags, env=None):
        started_runs.append((name, nproc, flags))
        return SimpleNamespace(name=name)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(scaling, "start", started)
    monkeypatch.setattr(scaling, "launch", lambda *args: started(*args))
    monkeypatch.setattr(scaling, "wait", lambda run: run)
    monkeypatch.setattr(scaling, "run_record", lambda run: run)
    parts = list(scaling.BOUND_PARTS)
    planned = scaling.runs(["fsdp", *parts], "delayed")
    scaling.run_all(tmp_path, planned, 2, ["--train-iters", "6"], 2, {scaling.ONE_GPU: "m", None: "m"})
    flags = {name: job_from_flags(flags) for name, nproc, flags in started_runs if nproc == 1}
    uncached, unfused = (flags[f"{part}/delayed"].te for part in parts)
    assert not uncached.cache_fp8_weights and uncached.gradient_accumulation_fusion is not False
    assert unfused.gradient_accumulation_fusion is False and unfused.cache_fp8_weights
    records = {**{name: RECORDS[name] for name in ("one_gpu/bf16", "one_gpu/delayed", "fsdp/bf16", "fsdp/delayed")},
               **{f"{part}/{recipe}": measured(tokens, 24.7, 1) for part in parts
                  for recipe, tokens in (("bf16", 93_000), ("delayed", 127_000))}}
    result = scaling.judge(records, planned, "delayed", 2, STEPS)
    assert result["figures"]["fp8_over_bf16"]["one_gpu_uncached"] == pytest.approx(127 / 93)
    assert not any(part in name for name in result["checks"] for part in parts if "ran" not in name)
