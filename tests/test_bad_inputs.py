"""Bad input, as a hostile or careless user gives it, to `python -m fp8stack.train`, `fp8stack ab`, `fp8stack plan`
and the API: each ends in exit code 2 and one stderr line naming the problem and the fix (or a typed exception),
before any model is built or arm started, with nothing written or replaced."""

import json
import time
from pathlib import Path

import pytest
import torch

from fp8stack import cli
from fp8stack.ab import run as ab_run
from fp8stack.evidence import EvidenceError, claim_evidence, run_folder, write_evidence
from fp8stack.plan import Override, PlanError, PolicyConfig, description_from_dict, load_description, make_plan
from fp8stack.train import loop
from fp8stack.train.command import main as train_main
from fp8stack.config import ConfigError, from_overrides

FAST = ["--device", "cpu", "--no-progress", "--train-iters", "2", "--micro-batch-size", "2", "--seq-length", "64",
        "--max-data-bytes", str(1 << 20), "--eval-iters", "0", "--tensorboard-dir", "{tmp}/log", "--save", "{tmp}/ckpt",
        "--result-json", "{tmp}/result.json"]
"""A run that would train in seconds and write under {tmp}: the rows add the bad part (later flags win)."""

FILES = {
    "a-file": "not a folder\n",
    "a-dir/kept": "an existing folder\n",
    "empty-ckpts/kept": "a folder without step-* checkpoints\n",
    "wrong-type.json": json.dumps({"optimizer": {"warmup": "ten"}}),
    "bool-int.json": json.dumps({"training": {"seed": True}}),
    "string-lr.json": json.dumps({"optimizer": {"lr": "1e-3"}}),
    "tuple-as-string.json": json.dumps({"activation_checkpoint": {"layers": "all", "modules": "mlp"}}),
    "list.json": json.dumps([1, 2]),
    "not-json.json": "{steps: 10",
    "unknown-field.json": json.dumps({"training": {"speed": "max"}}),
    "unknown-section.json": json.dumps({"speed": "max"}),
    "flat-field.json": json.dumps({"steps": 10}),
    "nan-lr.json": '{"optimizer": {"lr": NaN}}',
    "bad-flatten.json": json.dumps({"grouped_fp8": {"wgrad_flatten": "gather"}}),
    "dup-recipe.yaml": "recipe: tensorwise\nsmall_gemm_filter: 'off'\nrecipe: rowwise\n",
    "dup-model.yaml": "name: x\nseq_len: 8\nseq_len: 16\nblocks: {dense: [{name: p, kind: linear, n: 16, k: 16}]}\n"
                      "layers: [{block: dense}]\n",
    "deep-5k.yaml": "recipe: " + "[" * 5000 + "]" * 5000 + "\n",
    "deep-100k.yaml": "recipe: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "deep-block.yaml": "recipe:\n" + "".join("  " * depth + "-\n" for depth in range(1, 200)),
    "billion-layers.yaml": "name: x\nseq_len: 8\nblocks: {dense: [{name: p, kind: linear, n: 16, k: 16}]}\n"
                           "layers: [{block: dense, repeat: 1000000000}]\n",
    "dup-fqn.yaml": "name: x\nseq_len: 8\nblocks: {dense: [{name: p, kind: linear, n: 16, k: 16}, "
                    "{name: p, kind: linear, n: 32, k: 16}]}\nlayers: [{block: dense}]\n",
    "dup-outer.yaml": "name: x\nseq_len: 8\nbefore_layers: [{name: norm, kind: norm, n: 16, k: 16}]\n"
                      "blocks: {dense: [{name: p, kind: linear, n: 16, k: 16}]}\nlayers: [{block: dense}]\n"
                      "after_layers: [{name: norm, kind: norm, n: 16, k: 16}]\n",
    "block-typo.yaml": "recipe: tensorwise\noverrides: [{block: dnese, backend: bf16}]\n",
    "fqn-typo.yaml": "recipe: tensorwise\noverrides: [{fqn: 'layers.*.attention.wqvk', backend: bf16}]\n",
    "moe-on-dense.yaml": "recipe: tensorwise\noverrides: [{block: moe, recipe: rowwise}]\n",
    "bf16-moments-ckpt/run.json": json.dumps({"config": {"optimizer": {"moments": "bf16"}}}),
    "core-on-torchao.yaml": "overrides: [{fqn: 'layers.*.attention.core', backend: torchao, recipe: tensorwise}]\n",
    "train.py": "raise SystemExit('a trip wire: the training script ran')\n",
}


@pytest.fixture
def workspace(tmp_path) -> Path:
    recorded = run_folder("ab-tiny-cpu", tmp_path / "ab-out") / "ab-tiny-cpu.json"  # an A/B recorded earlier today
    for path, text in [*((tmp_path / name, text) for name, text in FILES.items()),
                       (recorded, '{"recorded": "earlier today"}\n')]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _contents(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder): what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def _refused(run, argv: list[str], workspace: Path, capsys, prefix: str, message: str) -> None:
    before = _contents(workspace)
    code = run([word.format(tmp=workspace) for word in argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(prefix) and "Traceback" not in err, err
    assert message.format(tmp=workspace) in err, err
    assert _contents(workspace) == before, "a refused command wrote or replaced something"


@pytest.fixture
def no_model(monkeypatch):
    """A trip wire: building a model fails the test (a refusal must come before it)."""
    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(loop, "build_model", built)


TRAIN_BAD = [
    (["--save", "{tmp}/a-file"], "checkpoint.dir (--save) {tmp}/a-file is a file, not a folder: pass a folder"),
    (["--save", "{tmp}/a-file/ckpt"], "cannot be created: {tmp}/a-file is a file: pass a path under a folder"),
    (["--save", "/proc/fp8stack-ckpt"], "cannot write in /proc"),
    (["--tensorboard-dir", "{tmp}/a-file"], "logging.dir (--tensorboard-dir) {tmp}/a-file is a file, not a folder"),
    (["--tensorboard-dir", "{tmp}/a-file/log"], "cannot be created: {tmp}/a-file is a file"),
    (["--result-json", "{tmp}/a-dir"], "--result-json {tmp}/a-dir is a folder: pass a file path"),
    (["--result-json", "{tmp}/a-file/result.json"],
     "--result-json {tmp}/a-file/result.json: its folder {tmp}/a-file is a file, not a folder"),
    (["--lr", "0"], "optimizer.lr must be positive, got 0.0"),
    (["--lr=-1e-3"], "optimizer.lr must be positive"),
    (["--lr", "inf"], "optimizer.lr must be a finite number, got inf"),
    (["--lr", "nan"], "optimizer.lr must be a finite number, got nan"),
    (["--min-lr", "inf"], "optimizer.min_lr must be a finite number"),
    (["--clip-grad", "-1"], "optimizer.grad_clip must be at least 0, got -1.0"),
    (["--weight-decay", "-5"], "optimizer.weight_decay must be at least 0, got -5.0"),
    (["--weight-decay", "inf"], "optimizer.weight_decay must be a finite number"),
    (["--micro-batch-size", "0"], "training.micro_batch must be at least 1, got 0"),
    (["--seq-length", "0"], "training.seq_len must be between 2 and 131072, got 0"),
    (["--seq-length", "100000000"], "training.seq_len must be between 2 and 131072, got 100000000"),
    (["--max-data-bytes", "0"], "data.max_bytes must be at least 1, got 0"),
    (["--max-data-bytes", "3000", "--seq-length", "100000"], "too few for seq_len=100000: raise --max-data-bytes"),
    (["--eval-iters", "-1"], "training.eval_batches must be at least 0, got -1"),
    (["--train-iters", "0"], "training.steps must be at least 1, got 0"),
    (["--save-interval", "-1"], "checkpoint.interval must be at least 0, got -1"),
    (["--checkpoint.keep-latest", "-1"], "checkpoint.keep_latest must be at least 0, got -1"),
    (["--lr-warmup-iters", "-1"], "optimizer.warmup must be at least 0, got -1"),
    (["--global-batch-size", "3"], "training.global_batch=3 must be a multiple of training.micro_batch=2"),
    (["--recompute-layers", "9"], "recompute names block(s) 9, and tiny has blocks 0-3"),
    (["--recompute-modules", "moe"], "recompute_modules moe: none of the recomputed blocks of tiny has that part"),
    (["--model", "tiny-moe", "--recompute-layers", "0", "--recompute-modules", "moe"],
     "recompute_modules moe: none of the recomputed blocks of tiny-moe"),
    (["--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "9"],
     "--num-layers-at-start-in-bf16 9 is more than the model's 4 layers: pass at most 4"),
    (["--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
      "--num-layers-at-end-in-bf16", "2"], "keep all 4 layers BF16, so recipe tensorwise would train none in FP8"),
    (["--fp8-recipe", "tensorwise", "--num-layers-at-start-in-bf16", "2"],
     "--num-layers-at-start-in-bf16 only applies with --first-last-layers-bf16: add that flag"),
    (["--fp8-recipe", "tensorwise", "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"],
     "--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 only apply with --first-last-layers-bf16"),
    (["--no-fused-projections", "--tensor-model-parallel-size", "2", "--seq-length", "63"],
     "seq_len=63 is not divisible by tensor_parallel=2"),
    (["--fp8-stats-interval", "2", "--tensorboard-dir", ""],
     "logging.fp8_stats_interval writes to TensorBoard: pass --tensorboard-dir DIR"),
    (["--fp8-stats-interval", "-1"], "logging.fp8_stats_interval must be at least 0, got -1"),
    (["--config", "{tmp}/wrong-type.json"], "optimizer.warmup must be an integer or unset (omit it), got 'ten'"),
    (["--config", "{tmp}/bool-int.json"], "training.seed must be an integer, got True"),
    (["--config", "{tmp}/string-lr.json"], "optimizer.lr must be a number or unset (omit it), got '1e-3'"),
    (["--config", "{tmp}/tuple-as-string.json"], "activation_checkpoint.modules must be a list of names, got 'mlp'"),
    (["--config", "{tmp}/list.json"], "--config {tmp}/list.json holds a list: pass a table of sections"),
    (["--config", "{tmp}/not-json.json"], "cannot read --config {tmp}/not-json.json"),
    (["--config", "{tmp}/unknown-field.json"], "unknown field(s) training.speed; section training has steps,"),
    (["--config", "{tmp}/unknown-section.json"], "unknown section(s) speed: use model, precision,"),
    (["--config", "{tmp}/flat-field.json"], "unknown section(s) steps: use model, precision,"),
    (["--config", "{tmp}/nan-lr.json"], "optimizer.lr must be a finite number, got nan"),
    (["--config", "{tmp}/bad-flatten.json"],
     "unknown grouped_fp8.wgrad_flatten 'gather': use auto, copies, compiled, triton"),
    (["--recipe-file", "{tmp}/no-such-recipe.yaml"], "--recipe-file: recipe file '{tmp}/no-such-recipe.yaml' not "
     "found: give a YAML path or a name in configs/recipes/"),
    (["--load", "{tmp}/no-such-checkpoint"], "checkpoint {tmp}/no-such-checkpoint does not exist"),
    (["--save", "{tmp}/empty-ckpts", "--load", "latest"], "no step-* checkpoint under {tmp}/empty-ckpts"),
    (["--use-distributed-optimizer"], "optimizer.distributed is megatron-core's distributed optimizer, for "
                                      "--model-impl megatron"),
    (["--model", "tiny-moe", "--expert-model-parallel-size", "2"],
     "the plain path's MoE has no expert parallelism: add --model.impl megatron"),
    (["--model-impl", "megatron", "--expert-model-parallel-size", "2"],
     "parallelism.expert_parallel=2 splits routed experts over ranks, and tiny is dense: drop "
     "--expert-model-parallel-size or pick an MoE model (tiny-moe, deepseek-moe-small, deepseek-moe-medium)"),
    (["--parallelism.expert-parallel", "0"], "parallelism.expert_parallel must be at least 1, got 0"),
    (["--optimizer.moments", "bf16"], "optimizer.moments bf16 needs TransformerEngine's FusedAdam on a GPU, and this "
                                      "run is on a CPU: run on a GPU, or drop --optimizer.moments bf16"),
    (["--load", "{tmp}/bf16-moments-ckpt", "--resume-despite-changes"],
     "{tmp}/bf16-moments-ckpt holds BF16 Adam moments and this run keeps FP32 ones (optimizer.moments): resume with "
     "--optimizer.moments bf16; the two optimizers' states do not convert into each other"),
    (["--fp8-dot-product-attention"], "fp8_attention runs attention in FP8 under an FP8 recipe, and the recipe is "
     "bf16: pass --fp8-recipe with one of delayed (sm90+), tensorwise (sm100+), mxfp8 (sm100+)"),
    (["--fp8-recipe", "rowwise", "--fp8-dot-product-attention"], "recipe rowwise has no FP8 attention"),
    (["--fp8-recipe", "tensorwise", "--fp8-dot-product-attention"],
     "TE's FP8 attention under recipe tensorwise needs sm100+"),
    (["--fp8-recipe", "delayed", "--fp8-dot-product-attention"],
     "on sm90 TE's fused FP8 attention trains head dim 128 only, and this model's is 32: "
     "drop --fp8-dot-product-attention for tiny"),
    (["--fp8-recipe", "delayed", "--fp8-dot-product-attention", "--recompute-modules", "core_attn"],
     "--recompute-modules core_attn recomputes the attention core alone, outside the attention module that sends it "
     "to TE's FP8 attention, so without FP8: recompute attn instead"),
]


@pytest.mark.parametrize("argv, message", TRAIN_BAD, ids=[" ".join(a)[:40] for a, _ in TRAIN_BAD])
def test_train_refuses_bad_input_before_building_a_model(workspace, capsys, no_model, argv, message):
    _refused(train_main, [*FAST, *argv], workspace, capsys, "fp8stack train: error: ", message)


AB = ["ab", "--model", "tiny", "--device", "cpu", "--steps", "2", "--recipes", "tensorwise", "--out-dir", "{tmp}/out"]

AB_BAD = [
    (["--micro-batch", "0"], "training.micro_batch must be at least 1, got 0"),
    (["--seq-len", "0"], "training.seq_len must be between 2 and 131072, got 0"),
    (["--seq-len", "100000000"], "training.seq_len must be between 2 and 131072"),
    (["--max-data-bytes", "0"], "data.max_bytes must be at least 1, got 0"),
    (["--steps", "0"], "training.steps must be at least 1, got 0"),
    (["--lr", "0"], "optimizer.lr must be positive"),
    (["--lr-warmup-iters", "-1"], "optimizer.warmup must be at least 0, got -1"),
    (["--nproc", "0"], "--nproc 0: each arm runs in at least one process"),
    (["--optimizer.moments", "bf16"], "optimizer.moments bf16 needs TransformerEngine's FusedAdam on a GPU, and this "
                                      "run is on a CPU"),
    (["--loss-tolerance", "-0.1"], "--loss-tolerance -0.1: pass a relative gap >= 0"),
    (["--loss-tolerance", "nan"], "--loss-tolerance nan: pass a relative gap >= 0"),
    (["--activation-checkpoint.layers", "all", "--activation-checkpoint.modules", "moe"],
     "recompute_modules moe: none of the recomputed blocks of tiny"),
    (["--recompute-modules", "moe"], "recompute_modules moe: none of the recomputed blocks of tiny"),
    (["--out-dir", "{tmp}/a-file"], "{tmp}/a-file is a file, not a folder"),
    (["--out-dir", "{tmp}/a-file/out"], "cannot be created: {tmp}/a-file is a file"),
    (["--out-dir", "{tmp}/ab-out"], "-ab-tiny-cpu/ab-tiny-cpu.json exists: pass --force to replace that evidence"),
    (["--attention", "fp16"], "unknown fp16 in --param-dtypes/--blockwise-gemms/--attention"),
    (["--attention", "bf16,fp8"], "--attention fp8 runs TE's FP8 dot-product attention, which none of --recipes "
     "tensorwise has here"),
    (["--recipes", "rowwise", "--fp8-dot-product-attention"],
     "fp8_attention runs attention in FP8 under an FP8 recipe, and the recipe is bf16"),
    (["--recipes", "delayed", "--fp8-dot-product-attention"],
     "on sm90 TE's fused FP8 attention trains head dim 128 only, and this model's is 32: drop "
     "--fp8-dot-product-attention for tiny"),
]


@pytest.mark.parametrize("argv, message", AB_BAD, ids=[" ".join(a)[:40] for a, _ in AB_BAD])
def test_ab_refuses_bad_input_before_any_arm_runs(workspace, capsys, monkeypatch, argv, message):
    def started(*args, **kwargs):
        raise AssertionError("an arm was started")

    monkeypatch.setattr(ab_run, "_RunningArm", started)
    _refused(cli.main, [*AB, *argv], workspace, capsys, "fp8stack ab: error: ", message)


PLAN = ["plan", "--arch", "sm90", "--fp8-recipe", "tensorwise"]

PLAN_BAD = [
    (["plan", "--fp8-recipe", "tensorwise", "--arch", "1.e999"], "cannot read GPU arch '1.e999': write it like sm90"),
    (["plan", "--fp8-recipe", "tensorwise", "--arch", "nan"], "cannot read GPU arch 'nan'"),
    ([*PLAN, "--recipe-file", "{tmp}/dup-recipe.yaml"], "key 'recipe' appears twice in one mapping (line 3): keep one"),
    ([*PLAN, "--model", "{tmp}/dup-model.yaml"], "key 'seq_len' appears twice in one mapping (line 3)"),
    ([*PLAN, "--recipe-file", "{tmp}/deep-5k.yaml"], "nesting deeper than 32 levels at line 1"),
    ([*PLAN, "--recipe-file", "{tmp}/deep-100k.yaml"], "nesting deeper than 32 levels"),
    ([*PLAN, "--recipe-file", "{tmp}/deep-block.yaml"], "nesting deeper than 32 levels at line 33"),
    ([*PLAN, "--model", "{tmp}/billion-layers.yaml"], "'layers' expands to 1000000000 layers, more than 4096"),
    ([*PLAN, "--model", "{tmp}/dup-fqn.yaml"], "x: component layers.0.p appears twice"),
    ([*PLAN, "--model", "{tmp}/dup-outer.yaml"], "x: component norm appears twice"),
    ([*PLAN, "--recipe-file", "{tmp}/block-typo.yaml"],
     "block-typo.yaml: the override for block 'dnese', fqn '*' matches no component of tiny (block 'dnese' matches "
     "nothing; closest: dense, model)"),
    ([*PLAN, "--recipe-file", "{tmp}/fqn-typo.yaml"],
     "(fqn 'layers.*.attention.wqvk' matches nothing; closest: layers.*.attention.wqkv"),
    ([*PLAN, "--recipe-file", "{tmp}/moe-on-dense.yaml"], "the override for block 'moe', fqn '*' matches no component"),
    ([*PLAN, "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "5"],
     "--num-layers-at-end-in-bf16 5 is more than the model's 4 layers"),
    ([*PLAN, "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3", "--num-layers-at-end-in-bf16", "1"],
     "keep all 4 layers BF16, so recipe tensorwise would train none in FP8"),
    ([*PLAN, "--fp8-dot-product-attention"], "TE's FP8 attention under recipe tensorwise needs sm100+"),
    ([*PLAN, "--arch", "sm100", "--fp8-dot-product-attention"],
     "fp8_attention is TransformerEngine's FP8 dot-product attention (torchao has none), and recipe tensorwise with "
     "backend auto runs the linears on torchao: pass --backend te"),
    (["plan", "--fp8-recipe", "blockwise", "--fp8-dot-product-attention"], "recipe blockwise has no FP8 attention"),
    (["plan", "--fp8-recipe", "delayed", "--fp8-dot-product-attention"],
     "on sm90 TE's fused FP8 attention trains head dim 128 only, and this model's is 32"),
    (["plan", "--fp8-recipe", "delayed", "--arch", "sm100", "--fp8-dot-product-attention", "--model",
      "llama-1b-like", "--recipe-file", "{tmp}/core-on-torchao.yaml"],
     "override on layers.0.attention.core: FP8 attention runs on TE under delayed (sm90+), tensorwise (sm100+), "
     "mxfp8 (sm100+), not tensorwise on torchao at sm100"),
]


@pytest.mark.parametrize("argv, message", PLAN_BAD, ids=[" ".join(a[4:])[:40] for a, _ in PLAN_BAD])
def test_plan_refuses_bad_input_quickly(workspace, capsys, argv, message):
    began = time.perf_counter()
    _refused(cli.main, argv, workspace, capsys, "fp8stack: error: ", message)
    assert time.perf_counter() - began < 10, "a refusal should not take this long"


SCRIPT = ["--", "{tmp}/train.py", "--lr", "1e-3"]

PROFILE_SCRIPT_BAD = [
    (["--out", "{tmp}/p.json"], "no training script given: pass it after --, e.g. -- train.py --lr 1e-3"),
    (["--out", "{tmp}/p.json", "--", "-m"], "no training script given"),
    (["--out", "{tmp}/p.json", "--", "{tmp}/missing.py"],
     "script {tmp}/missing.py is not a file: pass the training script's path after --"),
    (["--out", "{tmp}/p.json", "--", "{tmp}/a-dir"], "script {tmp}/a-dir is not a file"),
    (["--out", "{tmp}/p.json", "--", "-m", "no_such_module"],
     "no module named no_such_module: pass an importable module after -m, or a script's path"),
    (["--out", "{tmp}/p.json", "--", "-m", "no_such_package.train"], "no module named no_such_package.train"),
    (["--out", "{tmp}/p.json", "--steps", "0", *SCRIPT], "need --steps >= 1 and --warmup-steps >= 1, got 0 and 3"),
    (["--out", "{tmp}/p.json", "--warmup-steps", "0", *SCRIPT], "--warmup-steps >= 1, got 5 and 0"),
    (["--out", "{tmp}/p.json", "--steps", "two", *SCRIPT], "--steps: invalid int value: 'two'"),
    (SCRIPT, "the following arguments are required: --out"),
    (["--out", "{tmp}/a-dir", *SCRIPT], "--out {tmp}/a-dir is a folder: pass a file path"),
    (["--out", "{tmp}/a-file/p.json", *SCRIPT], "--out {tmp}/a-file/p.json: its folder {tmp}/a-file is a file"),
    (["--out", "{tmp}/p.json", "--memory", *SCRIPT],
     "--memory records CUDA allocations, and torch sees no CUDA GPU here: run it on a GPU machine, or drop --memory"),
]


@pytest.mark.parametrize("argv, message", PROFILE_SCRIPT_BAD, ids=[" ".join(a)[:40] for a, _ in PROFILE_SCRIPT_BAD])
def test_profile_script_refuses_bad_input_before_the_script_runs(workspace, capsys, argv, message):
    from fp8stack.bench.profile_script import main

    _refused(main, argv, workspace, capsys, "fp8stack: error: ", message)


API_BAD = [
    ({"training.steps": "10"}, "training.steps must be an integer, got '10'"),
    ({"training.compile": 1}, "training.compile must be true or false or unset (omit it), got 1"),
    ({"optimizer.lr": float("inf")}, "optimizer.lr must be a finite number"),
    ({"optimizer.grad_clip": float("nan")}, "optimizer.grad_clip must be a finite number"),
    ({"training.seq_len": 1 << 20}, "training.seq_len must be between 2 and 131072"),
    ({"activation_checkpoint.modules": "mlp"}, "activation_checkpoint.modules must be a list of names"),
    ({"checkpoint.resume": 7}, "checkpoint.resume must be a string or unset (omit it), got 7"),
    ({"training.eval_batches": -3}, "training.eval_batches must be at least 0, got -3"),
    ({"training.step": 3}, "unknown option 'training.step'"),
]


@pytest.mark.parametrize("fields, message", API_BAD, ids=[m[:30] for _, m in API_BAD])
def test_train_config_refuses_bad_values_by_name(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_overrides(fields)


def test_evidence_is_not_replaced_without_being_asked(tmp_path):
    json_path, md_path = write_evidence("demo-cpu", {"x": 1}, "| a |", tmp_path)
    recorded = json_path.read_text(), md_path.read_text()
    with pytest.raises(EvidenceError, match=r"demo-cpu.json, .*demo-cpu.md exist: pass --force to replace"):
        write_evidence("demo-cpu", {"x": 2}, "| b |", tmp_path)
    assert (json_path.read_text(), md_path.read_text()) == recorded
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["demo-cpu.json", "demo-cpu.md"], "no partial files"
    with pytest.raises(EvidenceError, match="is a file, not a folder"):
        claim_evidence("demo-cpu", json_path)
    claim_evidence("demo-cpu", tmp_path, force=True)
    write_evidence("demo-cpu", {"x": 2}, "| b |", tmp_path, replace=True)
    assert json.loads(json_path.read_text())["x"] == 2


def test_the_policy_api_refuses_an_override_that_matches_nothing():
    with pytest.raises(PlanError, match=r"feed_forward.w4' matches nothing; closest: layers\.\*\.feed_forward\.w"):
        make_plan(load_description("tiny"), PolicyConfig(recipe="tensorwise", overrides=(
            Override(fqn="layers.*.feed_forward.w4", backend="bf16"),)))


def test_a_description_with_a_repeat_of_the_wrong_type_is_refused():
    data = {"name": "x", "seq_len": 8, "blocks": {"dense": [{"name": "p", "kind": "linear", "n": 16, "k": 16}]},
            "layers": [{"block": "dense", "repeat": 1e9}]}
    with pytest.raises(PlanError, match="repeat of dense must be a positive integer, got 1000000000.0"):
        description_from_dict(data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs its arm to fail: the bf16 arm on TE modules, which "
                                                      "need a CUDA GPU")
def test_an_ab_in_which_no_arm_measures_anything_writes_no_evidence(tmp_path, capsys):
    code = cli.main(["ab", "--model", "tiny", "--recipes", "bf16", "--baseline-runs", "1", "--bf16-on-te",
                     "--device", "cpu", "--steps", "2", "--out-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 1 and "failed: fp8stack train: error: the plan runs" in out, out
    assert "on te: TransformerEngine" in out, out
    assert "no arm measured anything: no evidence written" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_an_ab_on_a_device_this_machine_lacks_is_refused_before_any_arm(tmp_path, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("an arm was started")

    monkeypatch.setattr(ab_run, "_RunningArm", started)
    _refused(cli.main, ["ab", "--model", "tiny", "--recipes", "bf16", "--device", "cuda", "--steps", "2",
                        "--out-dir", "{tmp}/out"], tmp_path, capsys, "fp8stack ab: error: ",
             "training.device cuda requested but torch sees no CUDA GPU: pass --device cpu")
