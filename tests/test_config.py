"""The configuration tree: TOML and flags in, one validated JobConfig out, the same run from what the evidence
records; every earlier flag maps to its new name or is refused with a pointer; presets load; help shows defaults;
recipe names are read only in plan/ and backends/."""

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fp8stack.cli import main
from fp8stack.config import (ConfigError, JobConfig, from_dict, from_overrides, load_config, preset_names, to_dict)
from fp8stack.config.flags import PRESETS, RETIRED
from fp8stack.train.command import job_from_flags

ROOT = Path(__file__).resolve().parents[1]

EARLIER_FLAGS = {
    # fp8stack train's (python -m fp8stack.train) flags before the tree, with a value -> the field it sets
    "--model": ("llama-1b-like", "model.name"), "--model-impl": ("torch", "model.impl"),
    "--fp8-recipe": ("delayed", "precision.recipe"), "--fp8-format": ("e4m3", "precision.fp8_format"),
    "--fp8-margin": ("1", "te.delayed_margin"), "--backend": ("te", "precision.backend"),
    "--num-layers-at-start-in-bf16": ("2", "precision.num_layers_at_start_in_bf16"),
    "--num-layers-at-end-in-bf16": ("2", "precision.num_layers_at_end_in_bf16"),
    "--small-gemm-filter": ("off", "precision.small_gemm_filter"),
    "--expert-backend": ("te", "precision.expert_backend"), "--blockwise-gemms": ("te", "te.blockwise_gemms"),
    "--train-iters": ("7", "training.steps"), "--steps": ("7", "training.steps"),
    "--lr-warmup-iters": ("3", "optimizer.warmup"), "--lr": ("1e-4", "optimizer.lr"),
    "--min-lr": ("1e-5", "optimizer.min_lr"), "--weight-decay": ("0.05", "optimizer.weight_decay"),
    "--clip-grad": ("0.5", "optimizer.grad_clip"), "--micro-batch-size": ("2", "training.micro_batch"),
    "--micro-batch": ("2", "training.micro_batch"), "--global-batch-size": ("8", "training.global_batch"),
    "--seq-length": ("128", "training.seq_len"), "--seq-len": ("128", "training.seq_len"),
    "--seed": ("3", "training.seed"), "--dtype": ("bf16", "training.dtype"),
    "--param-dtype": ("bf16", "training.param_dtype"), "--device": ("cpu", "training.device"),
    "--sdpa-backend": ("cudnn", "training.sdpa_backend"), "--recompute-layers": ("all", "activation_checkpoint.layers"),
    "--tensor-model-parallel-size": ("1", "parallelism.tensor_parallel"),
    "--profile-collectives": ("2", "logging.profile_collectives"), "--data-source": ("python", "data.source"),
    "--max-data-bytes": ("1000000", "data.max_bytes"), "--eval-iters": ("2", "training.eval_batches"),
    "--tensorboard-dir": ("logs", "logging.dir"), "--log-interval": ("5", "logging.interval"),
    "--save": ("ckpt", "checkpoint.dir"), "--save-interval": ("5", "checkpoint.interval"),
    "--load": ("ckpt/step-1", "checkpoint.resume"), "--fp8-stats-interval": ("5", "logging.fp8_stats_interval"),
}
EARLIER_SWITCHES = {
    "--fused-projections": "model.fused_projections", "--first-last-layers-bf16": "precision.first_last_layers_bf16",
    "--compile": "training.compile", "--fuse-norm": "precision.fuse_norm", "--fuse-mlp": "precision.fuse_mlp",
    "--compress-activations": "activation_checkpoint.compress",
    "--gradient-accumulation-fusion": "te.gradient_accumulation_fusion",
    "--fsdp-one-rank": "parallelism.data_parallel_one_rank",
    "--parallelism.fsdp-one-rank": "parallelism.data_parallel_one_rank",
    "--data-parallel-one-rank": "parallelism.data_parallel_one_rank",
    "--fsdp-float8-all-gather": "torchao.fsdp_float8_all_gather", "--trust-checkpoint": "checkpoint.trust",
    "--resume-despite-changes": "checkpoint.resume_despite_changes", "--progress": "logging.progress",
}


def _field(job: JobConfig, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(job, section), name)


@pytest.mark.parametrize("flag", sorted(EARLIER_FLAGS))
def test_every_earlier_flag_sets_its_field(flag, monkeypatch):
    monkeypatch.setattr("fp8stack.config.job.importlib.util.find_spec", lambda name: object())  # megatron's check
    value, dotted = EARLIER_FLAGS[flag]
    extra = ["--first-last-layers-bf16"] if "layers-at" in flag else []
    extra += ["--fp8-recipe", "delayed"] if flag == "--fp8-margin" else []
    extra += ["--fp8-recipe", "blockwise"] if flag == "--blockwise-gemms" else []
    extra += ["--tensorboard-dir", "logs"] if flag == "--fp8-stats-interval" else []
    job = job_from_flags([flag, value, *extra])
    assert str(_field(job, dotted)) == str(type(_field(job, dotted))(value))


@pytest.mark.parametrize("flag", sorted(EARLIER_SWITCHES))
def test_every_earlier_switch_sets_its_field_both_ways(flag):
    extra = ["--fp8-recipe", "tensorwise"] if "float8" in flag else []
    assert _field(job_from_flags([flag, *extra]), EARLIER_SWITCHES[flag]) is True
    assert _field(job_from_flags([flag.replace("--", "--no-", 1)]), EARLIER_SWITCHES[flag]) is False


def test_megatrons_fp8_dot_product_attention_flag_sets_fp8_attention_off_by_default():
    assert JobConfig().precision.fp8_attention is False
    for flag in ("--fp8-dot-product-attention", "--precision.fp8-attention", "--precision.fp8_attention"):
        assert job_from_flags(["--fp8-recipe", "delayed", flag]).precision.fp8_attention is True
    assert job_from_flags(["--no-fp8-dot-product-attention"]).precision.fp8_attention is False
    toml = from_dict({"precision": {"recipe": "delayed", "fp8_attention": True}})
    assert toml.precision.fp8_attention is True and to_dict(toml)["precision"]["fp8_attention"] is True


@pytest.mark.parametrize("flag", sorted(RETIRED))
def test_retired_flags_are_refused_with_a_pointer(flag, capsys):
    for command in ("train", "ab", "profile"):
        assert main([command, flag, "x"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"{flag} no longer exists" in err and "--" in err.split(":", 2)[-1]


def test_torchao_and_megatron_spellings_are_accepted():
    job = job_from_flags(["--fp8-recipe", "rowwise_with_gw_hp", "--recompute-granularity", "selective",
                          "--recompute-modules", "mlp", "attn", "--training.micro_batch", "3"])
    assert job.precision.recipe == "rowwise_gw_hp"
    assert (job.activation_checkpoint.layers, job.activation_checkpoint.modules) == ("all", ("mlp", "attn"))
    assert job.training.micro_batch == 3  # underscores and hyphens alike in dotted flags


def test_toml_overrides_json_round_trip_to_the_same_run(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "tiny"\n\n[precision]\nrecipe = "tensorwise"\n\n[training]\nsteps = 3\n'
                    'micro_batch = 2\n\n[activation_checkpoint]\nlayers = "all"\nmodules = ["mlp"]\n')
    job = job_from_flags(["--config", str(toml), "--training.steps", "5", "--no-fuse-mlp"])
    assert (job.model.name, job.precision.recipe, job.training.steps, job.training.micro_batch) == (
        "tiny", "tensorwise", 5, 2)
    assert job.precision.fuse_mlp is False and job.activation_checkpoint.modules == ("mlp",)
    recorded = json.loads(json.dumps(to_dict(job)))  # what TrainResult.config and the evidence hold
    assert from_dict(recorded) == job
    (tmp_path / "run.json").write_text(json.dumps(recorded))
    assert job_from_flags(["--config", str(tmp_path / "run.json")]) == job


MIXED_RECIPE_FILE = """recipe: delayed
expert_backend: grouped_fp8
small_gemm_filter: "off"
overrides:
  - {block: moe, fqn: "*.experts.*", recipe: blockwise, reason: routed experts in block scales}
"""


def test_a_recipe_file_sets_the_runs_precision_over_config_and_under_the_flags(tmp_path):
    """--recipe-file on train/ab/profile, as fp8stack plan takes it: its settings over --config's, the flags given
    over both, its overrides in the plan the trainer makes; recorded, the run resolves to itself."""
    recipe_file = tmp_path / "mixed.yaml"
    recipe_file.write_text(MIXED_RECIPE_FILE)
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "tiny-moe"\n\n[precision]\nrecipe = "tensorwise"\nexpert_backend = "te"\n')
    job = job_from_flags(["--config", str(toml), "--recipe-file", str(recipe_file), "--small-gemm-filter", "auto"])
    assert (job.precision.recipe, job.precision.expert_backend, job.precision.small_gemm_filter) == (
        "delayed", "grouped_fp8", "auto")
    assert [(o.block, o.fqn, o.recipe, o.source) for o in job.precision.overrides] == [
        ("moe", "*.experts.*", "blockwise", "mixed.yaml")]
    assert from_dict(json.loads(json.dumps(to_dict(job)))) == job
    from fp8stack.plan import load_description, make_plan

    plan = make_plan(load_description("tiny-moe"), replace(job.precision, small_gemm_filter="off"))
    recipes = {(d.component.kind, d.backend, d.recipe) for d in plan.decisions if d.recipe != "bf16"}
    assert recipes == {("linear", "te", "delayed"), ("expert", "grouped_fp8", "blockwise")}


def test_a_recorded_run_resolves_to_itself():
    from fp8stack.train.loop import resolve_job

    resolved = resolve_job(from_overrides({"precision.recipe": "tensorwise", "training.device": "cpu"}))
    assert None not in (resolved.optimizer.lr, resolved.optimizer.warmup, resolved.training.micro_batch,
                        resolved.training.compile, resolved.training.param_dtype, resolved.training.sdpa_backend)
    assert resolve_job(from_dict(to_dict(resolved))) == resolved


@pytest.mark.parametrize("text, message", [
    ("[modle]\nname = 'tiny'\n", "unknown section(s) modle"),
    ("[training]\nstep = 3\n", "unknown field(s) training.step"),
    ("[training]\nsteps = 'three'\n", "training.steps must be an integer"),
    ("[training]\nsteps = 0\n", "training.steps must be at least 1"),
    ("[precision]\nrecipe = 'fp4'\n", "unknown FP8 recipe 'fp4'"),
    ("training = 3\n", "section training must be a table"),
    ("[training\n", "cannot read --config"),
])
def test_bad_config_files_are_refused_in_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


def test_every_preset_loads_validates_and_cites_its_evidence():
    assert {"fastest", "memory", "cpu-demo"} <= set(preset_names())
    for name in preset_names():
        job = load_config(name)
        assert isinstance(job, JobConfig)
        cited = re.findall(r"^# evidence: (\S+)$", (PRESETS / f"{name}.toml").read_text(), re.M)
        assert cited and all((ROOT / path).is_dir() for path in cited), name
    assert load_config("fastest").precision.recipe == "delayed"


def test_unknown_preset_names_the_presets(capsys):
    assert main(["train", "--config", "fastset"]) == 2
    assert "no such preset (presets: cpu-demo, fastest, memory" in capsys.readouterr().err


def test_help_shows_every_field_with_its_default(capsys):
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--training.steps N, --train-iters N, --steps N" in text and "(default: 40)" in text
    assert "--te.gradient-accumulation-fusion" in text and "(default: chosen per run, see above)" in text


def test_version_and_train_command():
    done = subprocess.run([sys.executable, "-m", "fp8stack", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("fp8stack ")
    assert "train" in subprocess.run([sys.executable, "-m", "fp8stack", "--help"], capture_output=True,
                                     text=True).stdout


def test_cross_section_rules_ask_the_plan():
    with pytest.raises(ConfigError, match="drop --fp8-margin or use --fp8-recipe delayed"):
        from_overrides({"precision.recipe": "tensorwise", "te.delayed_margin": 1})
    with pytest.raises(ConfigError, match="use --fp8-recipe tensorwise"):
        from_overrides({"precision.recipe": "rowwise", "torchao.fsdp_float8_all_gather": True})


RECIPE_NAMES = ("bf16", "delayed", "tensorwise", "rowwise", "rowwise_gw_hp", "blockwise", "mxfp8")
ALLOWED = ("plan/", "backends/", "megatron/precision.py", "config/flags.py")
"""Where recipe names may be read: the plan, the backends implementing them (megatron's TE recipes among them) and
the flags' help listing their choices."""


def test_no_module_outside_plan_and_backends_compares_a_recipe_name():
    names = "|".join(RECIPE_NAMES)
    compare = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = []
    for path in sorted((ROOT / "fp8stack").rglob("*.py")):
        relative = path.relative_to(ROOT / "fp8stack").as_posix()
        if relative.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line) and "param_dtype" not in line and "dtype" not in line:
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "recipe names compared outside plan/ and backends/:\n" + "\n".join(found)


def test_ab_takes_a_yaml_model_and_a_factory_model(tmp_path, capsys):
    """`fp8stack ab` trains what `fp8stack plan` describes (a YAML path) and a user's module on a user's batches."""
    fast = ["--steps", "2", "--seq-length", "64", "--micro-batch", "2", "--eval-iters", "0", "--no-repeat-baseline",
            "--device", "cpu", "--no-progress"]
    assert main(["ab", "--model", str(ROOT / "configs/models/tiny.yaml"), "--recipes", "bf16,tensorwise",
                 "--out-dir", str(tmp_path / "yaml"), *fast]) == 0
    record = json.loads(next((tmp_path / "yaml").rglob("ab-tiny-cpu.json")).read_text())
    assert [arm["recipe"] for arm in record["arms"]] == ["bf16", "tensorwise"]
    assert all(isinstance(run, dict) for run in record["runs"].values())
    factories = ROOT / "examples/own_model/factories.py"
    assert main(["ab", "--model-factory", f"{factories}:model", "--data", f"{factories}:data", "--recipes",
                 "bf16,tensorwise", "--out-dir", str(tmp_path / "factory"), *fast]) == 0
    record = json.loads(next((tmp_path / "factory").rglob("ab-model-cpu.json")).read_text())
    run = record["runs"]["tensorwise"]
    assert run["config"]["model"]["factory"].endswith("factories.py:model") and run["plan_summary"]["fp8_gemms"] > 0


EARLIER_AB_FLAGS = {
    "--recipes": ("bf16,delayed", "ab.recipes"), "--param-dtypes": ("fp32,bf16", "ab.param_dtypes"),
    "--blockwise-gemms": ("te,deepgemm", "ab.blockwise_gemms"), "--baseline-runs": ("3", "ab.baseline_runs"),
    "--attention": ("bf16,fp8", "ab.attention"),
    "--loss-tolerance": ("0.01", "ab.loss_tolerance"), "--nproc": ("2", "ab.nproc"), "--gpus": ("0,1", "ab.gpus"),
    "--continue-from": ("a.json", "ab.continue_from"), "--out-dir": ("out", "ab.out_dir"), "--label": ("x", "ab.label"),
}


@pytest.mark.parametrize("flag", sorted(EARLIER_AB_FLAGS))
def test_every_earlier_ab_flag_sets_its_field(flag):
    from fp8stack.ab.run import ab_config
    from fp8stack.cli import build_parser
    from fp8stack.config import parse_args

    value, dotted = EARLIER_AB_FLAGS[flag]
    ab = ab_config(parse_args(build_parser(), ["ab", flag, value]))
    got = getattr(ab, dotted.removeprefix("ab."))
    assert (",".join(got) if isinstance(got, tuple) else str(got)) == value


def test_ab_keeps_a_gpu_listed_twice_and_drops_a_recipe_listed_twice():
    """--gpus 0,0 runs two arms on GPU 0 at once; a repeated recipe is one arm."""
    from fp8stack.ab.run import ab_config
    from fp8stack.cli import build_parser
    from fp8stack.config import parse_args

    ab = ab_config(parse_args(build_parser(), ["ab", "--gpus", "0,0", "1", "--recipes", "delayed,delayed"]))
    assert ab.gpus == ("0", "0", "1") and ab.recipes == ("delayed",)


def test_earlier_ab_and_profile_switches():
    from fp8stack.ab.run import ab_config
    from fp8stack.cli import build_parser
    from fp8stack.config import parse_args

    parser = build_parser()
    ab = ab_config(parse_args(parser, ["ab", "--fastest-bf16", "--bf16-on-te", "--no-repeat-baseline", "--force"]))
    assert (ab.fastest_bf16, ab.bf16_on_te, ab.baseline_runs, ab.force) == (True, True, 1, True)
    profile = vars(parse_args(parser, ["profile", "--steps", "7", "--gemm-speedup", "1.5", "--label", "x"]))
    assert (profile["profile.steps"], profile["profile.gemm_speedup"], profile["profile.label"]) == (7, 1.5, "x")
    assert "training.steps" not in profile, "a profile's --steps counts profiled steps, not training steps"
