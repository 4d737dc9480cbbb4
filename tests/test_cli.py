"""`fp8stack plan`: bad input ends in exit code 2 and one stderr line; good input prints the plan."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8stack.cli import local_arch, main
from fp8stack.plan import parse_arch

REPO = Path(__file__).resolve().parents[1]
DEEPSEEK = "configs/models/deepseek-v3-like-moe.yaml"
LLAMA_DENSE = ("attention_norm", "attention.wqkv", "attention.core", "attention.wo", "ffn_norm",
               "feed_forward.w13", "feed_forward.w2")
"""Components of a llama-1b-like dense block."""

BAD_FILES = {
    "broken.yaml": "name: x\n  seq_len: 1\n",
    "list.yaml": "- just\n- a list\n",
    "binary.yaml": b"\xff\xfe\x00garbage",
    "bad-kind.yaml": "name: x\nseq_len: 8\nblocks: {dense: [{name: p, kind: conv, n: 16, k: 16}]}\nlayers: [{block: dense}]\n",
    "unknown-keys.yaml": "recipe: tensorwise\nspeed: max\n",
    "unknown-recipe.yaml": "recipe: fp4\n",
    "off-unquoted.yaml": "recipe: tensorwise\nsmall_gemm_filter: off\n",
    "override-pairing.yaml": "recipe: tensorwise\noverrides:\n  - {fqn: '*.wo', backend: te, recipe: rowwise}\n",
    "no-recipe.yaml": "small_gemm_filter: tensorwise\n",
}

PLAN = ["plan", "--arch", "sm90"]
"""A fixed target, so that the local GPU does not change what is valid."""

BAD_INPUTS = [
    # (argv, where {tmp} is the folder holding BAD_FILES; text the one-line message must contain)
    ([*PLAN, "--fp8-recipe", "fp4"], "unknown FP8 recipe 'fp4': use one of bf16, delayed"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--model", "no-such-model"], "model description 'no-such-model' not found: give a YAML path"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--recipe-file", "no-such-recipe"], "recipe file 'no-such-recipe' not found"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--model", "{tmp}/broken.yaml"], "is not valid YAML at line 2: fix the syntax"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--recipe-file", "{tmp}/broken.yaml"], "is not valid YAML"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--model", "{tmp}/list.yaml"], "must be a YAML mapping"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--model", "{tmp}/binary.yaml"], "is not UTF-8 text"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--model", "{tmp}/bad-kind.yaml"], "has kind 'conv'; use one of linear"),
    ([*PLAN, "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1", "--fp8-recipe", "rowwise"],
     "--num-layers-at-start-in-bf16 must be a non-negative integer, got -1"),
    ([*PLAN, "--num-layers-at-end-in-bf16", "2", "--fp8-recipe", "rowwise"],
     "--num-layers-at-end-in-bf16 only applies with --first-last-layers-bf16: add that flag"),
    ([*PLAN, "--num-layers-at-end-in-bf16", "two", "--fp8-recipe", "rowwise"], "invalid int value: 'two'"),
    ([*PLAN, "--fp8-recipe", "mxfp8"], "recipe 'mxfp8' needs sm100+ but the target is sm90: pick another recipe or pass --arch sm100"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--format", "html"], "argument --format: invalid choice: 'html'"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--backend", "te"], "recipe 'rowwise' has no te implementation: use --backend torchao"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--head-on-te"], "head_on_te puts the output head beside the plan's "
                                                          "TransformerEngine linears, and recipe rowwise with backend auto has none"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--fp8-format", "e5m2"], "--fp8-format: invalid choice: 'e5m2'"),
    (["plan", "--fp8-recipe", "rowwise", "--arch", "hopper"], "cannot read GPU arch 'hopper': write it like sm90"),
    (["plan", "--fp8-recipe", "rowwise", "--arch", "sm9"], "GPU arch 'sm9' is out of range"),
    ([*PLAN, "--recipe-file", "{tmp}/unknown-keys.yaml"], "unknown key(s) ['speed']; allowed:"),
    ([*PLAN, "--recipe-file", "{tmp}/unknown-recipe.yaml"], "unknown FP8 recipe 'fp4': use one of bf16"),
    ([*PLAN, "--recipe-file", "{tmp}/off-unquoted.yaml"], "small_gemm_filter must be a name, got False (YAML reads off"),
    ([*PLAN, "--recipe-file", "{tmp}/override-pairing.yaml"], "override for block '*', fqn '*.wo': recipe 'rowwise' has no te"),
    ([*PLAN, "--recipe-file", "{tmp}/no-recipe.yaml"], "no FP8 recipe given: pass --fp8-recipe"),
    (PLAN, "no FP8 recipe given: pass --fp8-recipe (bf16, delayed,"),
    ([*PLAN, "--fp8-recipe", "rowwise", "--fast"], "unrecognized arguments: --fast"),
    (["train", "--grouped-fp8.wgrad-flatten", "gather"],
     "argument --grouped-fp8.wgrad-flatten: invalid choice: 'gather' "
     "(choose from 'auto', 'copies', 'compiled', 'triton')"),
    (["paln"], "argument command: invalid choice: 'paln'"),
    ([], "the following arguments are required: command"),
]


@pytest.fixture
def bad_files(tmp_path):
    for name, content in BAD_FILES.items():
        target = tmp_path / name
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    return tmp_path


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=[m[:40] for _, m in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(bad_files, capsys, argv, message):
    code = main([word.format(tmp=bad_files) for word in argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("fp8stack: error: "), err
    assert "Traceback" not in err
    assert message in err


def test_a_genuine_bug_still_shows_its_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug, not bad input")

    monkeypatch.setattr("fp8stack.cli.make_plan", broken)
    with pytest.raises(ZeroDivisionError):
        main(["plan", "--fp8-recipe", "rowwise", "--arch", "sm90"])


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--fp8-recipe", "--first-last-layers-bf16", "--recipe-file", "--small-gemm-filter"):
        assert flag in out


# --- output formats ------------------------------------------------------------------------------

def _plan(capsys, *words: str) -> str:
    assert main(["plan", *words]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _json_plan(capsys, *words: str) -> dict:
    return json.loads(_plan(capsys, *words, "--format", "json"))


@pytest.mark.parametrize("columns", ["60", "100", "130", "160"])
def test_table_groups_identical_layers_into_one_row(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    out = _plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90")
    rows = [line for line in out.splitlines() if line.startswith("│ ") and not line.startswith("│  ")]
    assert len(rows) == len(LLAMA_DENSE) + 3  # + embedding, final norm, head
    grouped = [row for row in rows if row.startswith("│ 0-3 ")]
    assert len(grouped) == len(LLAMA_DENSE)
    for name in LLAMA_DENSE:
        assert sum(f"dense: {name} " in row for row in grouped) == 1, name
    assert max(len(line) for line in out.splitlines()) <= max(100, int(columns))
    assert "share by precision: bf16 23.3%, fp8 76.7%" in out


def test_narrow_table_moves_reasons_to_numbered_notes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = _plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90")
    assert "┃ why ┃" in out
    assert "\n[1] embedding lookup is not a GEMM" in out
    monkeypatch.setenv("COLUMNS", "160")
    assert "┃ reason" in _plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90")


@pytest.mark.parametrize("columns", ["100", "200"])
def test_table_prints_reasons_verbatim(capsys, monkeypatch, tmp_path, columns):
    monkeypatch.setenv("COLUMNS", columns)
    reason = "see [bold]DeepSeek-V3[/bold] :fire: [/x]"
    (tmp_path / "r.yaml").write_text(f'recipe: tensorwise\noverrides:\n  - {{fqn: "*.wo", backend: bf16, reason: "{reason}"}}\n')
    out = _plan(capsys, "--model", "llama-1b-like", "--recipe-file", str(tmp_path / "r.yaml"), *PLAN[1:])
    assert f"r.yaml: {reason}" in out


def test_json_output_shape(capsys):
    plan = _json_plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90")
    assert {"model", "recipe", "arch", "layers", "summary"} <= set(plan)
    assert (plan["model"], plan["recipe"], plan["arch"]) == ("llama-1b-like", "tensorwise", "sm90")
    assert len(plan["layers"]) == 1 + 4 * len(LLAMA_DENSE) + 2
    for layer in plan["layers"]:
        assert set(layer) == {"fqn", "block", "kind", "n", "k", "backend", "recipe", "reason"}
        assert layer["reason"]
    wqkv = next(x for x in plan["layers"] if x["fqn"] == "layers.2.attention.wqkv")
    assert (wqkv["block"], wqkv["kind"], wqkv["n"], wqkv["k"]) == ("dense", "linear", 6144, 4096)
    assert (wqkv["backend"], wqkv["recipe"]) == ("torchao", "tensorwise")
    assert plan["summary"]["flops_share_by_precision"]["fp8"] == pytest.approx(0.767, abs=1e-3)


def test_markdown_output(capsys):
    out = _plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "blockwise", "--arch", "sm90", "--format", "markdown")
    lines = out.splitlines()
    assert lines[0] == "### llama-1b-like: recipe blockwise (e4m3), sm90"
    assert "| layers | component | kind | shape | backend | recipe | reason |" in lines
    assert any(line.startswith("| 0-3 | dense: attention.wqkv | linear | 6144x4096 | te | blockwise |") for line in lines)
    assert sum(line.startswith("| 0-3 |") for line in lines) == len(LLAMA_DENSE)


def test_default_model_is_tiny(capsys):
    assert _json_plan(capsys, "--fp8-recipe", "bf16", "--arch", "sm90")["model"] == "tiny"


def test_default_arch_is_the_local_gpu_else_sm90(capsys):
    import torch

    plan = _json_plan(capsys, "--fp8-recipe", "bf16")
    assert plan["arch"] == f"sm{parse_arch(local_arch())}"
    if not torch.cuda.is_available():
        assert plan["arch"] == "sm90"


@pytest.mark.parametrize(("arch", "expected"), [("sm100", "sm100"), ("90", "sm90"), ("10.0", "sm100"), ("sm_90", "sm90")])
def test_arch_spellings(capsys, arch, expected):
    assert _json_plan(capsys, "--fp8-recipe", "bf16", "--arch", arch)["arch"] == expected


def test_mxfp8_plan_on_sm100(capsys):
    plan = _json_plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "mxfp8", "--arch", "sm100")
    wo = next(x for x in plan["layers"] if x["fqn"] == "layers.1.attention.wo")
    assert (wo["backend"], wo["recipe"]) == ("te", "mxfp8")


# --- settings precedence: flag > recipe file > default ---------------------------------------------

@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text("""\
description: team defaults
recipe: rowwise
fp8_format: e4m3
small_gemm_filter: "off"
first_last_layers_bf16: true
overrides:
  - {fqn: "layers.*.attention.wo", backend: bf16, reason: wo stays high precision}
""")
    return path


def test_recipe_file_settings_apply_when_no_flag_is_given(capsys, recipe_file):
    plan = _json_plan(capsys, "--recipe-file", str(recipe_file), "--arch", "sm90")
    assert (plan["recipe"], plan["fp8_format"]) == ("rowwise", "e4m3")
    layers = {x["fqn"]: x for x in plan["layers"]}
    assert layers["layers.1.attention.wqkv"]["recipe"] == "rowwise"  # tiny shape: small-GEMM filter is off
    assert layers["layers.0.attention.wqkv"]["backend"] == "bf16"  # first layer, from the file
    assert layers["layers.2.attention.wo"]["reason"] == "team.yaml: wo stays high precision"


def test_flags_win_over_the_recipe_file(capsys, recipe_file):
    plan = _json_plan(capsys, "--recipe-file", str(recipe_file), "--arch", "sm90", "--fp8-recipe", "tensorwise",
                      "--fp8-format", "hybrid", "--no-first-last-layers-bf16", "--small-gemm-filter", "tensorwise")
    assert (plan["recipe"], plan["fp8_format"]) == ("tensorwise", "hybrid")
    layers = {x["fqn"]: x for x in plan["layers"]}
    assert layers["layers.0.feed_forward.w13"]["recipe"] == "tensorwise"  # first layer no longer BF16
    assert layers["layers.0.attention.wqkv"]["reason"].startswith("small GEMM")  # tensorwise filter from the flag
    assert layers["layers.2.attention.wo"]["backend"] == "bf16"  # the file's overrides still apply


def test_defaults_apply_without_flag_or_file(capsys):
    plan = _json_plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90")
    assert plan["fp8_format"] == "hybrid"
    assert all(x["backend"] != "bf16" for x in plan["layers"] if x["kind"] == "linear")  # first/last off


def test_first_last_layer_counts_from_flags(capsys):
    plan = _json_plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--arch", "sm90",
                      "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0")
    bf16_layers = sorted({int(x["fqn"].split(".")[1]) for x in plan["layers"]
                          if x["kind"] == "linear" and x["backend"] == "bf16"})
    assert bf16_layers == [0, 1]


def test_head_on_te_flag(capsys):
    plan = _json_plan(capsys, "--model", "llama-1b-like", "--fp8-recipe", "delayed", "--arch", "sm90", "--head-on-te")
    head, = (x for x in plan["layers"] if x["kind"] == "head")
    assert (head["backend"], head["recipe"]) == ("te", "bf16")


# --- the DeepSeek-V3-like MoE -----------------------------------------------------------------------

def test_deepseek_moe_blockwise_plan(capsys, monkeypatch):
    if not (REPO / DEEPSEEK).is_file():
        pytest.skip(f"{DEEPSEEK} is not written yet")
    monkeypatch.chdir(REPO)
    plan = _json_plan(capsys, "--model", DEEPSEEK, "--fp8-recipe", "blockwise", "--arch", "sm90")
    kinds = {x["kind"] for x in plan["layers"]}
    assert {"router", "embedding", "head", "norm", "expert"} <= kinds
    for layer in plan["layers"]:
        assert layer["reason"], layer["fqn"]
        if layer["kind"] in ("router", "embedding", "norm"):
            assert (layer["backend"], layer["recipe"]) == ("bf16", "bf16"), layer["fqn"]
        if layer["kind"] == "head":  # on a TE module without FP8 (head_on_te: auto beside TE linears)
            assert (layer["backend"], layer["recipe"]) == ("te", "bf16"), layer["fqn"]
        if layer["kind"] == "expert":  # TE's GroupedLinear: the fastest blockwise expert path measured on sm90
            assert (layer["backend"], layer["recipe"]) == ("te", "blockwise"), layer["fqn"]
    grouped = _json_plan(capsys, "--model", DEEPSEEK, "--fp8-recipe", "blockwise", "--arch", "sm90",
                         "--expert-backend", "grouped_fp8")
    assert {(x["backend"], x["recipe"]) for x in grouped["layers"] if x["kind"] == "expert"} == {
        ("grouped_fp8", "blockwise")}


# --- as a separate process ----------------------------------------------------------------------------

def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "fp8stack"
    if not script.is_file():
        pytest.skip(f"console script {script} missing: install the package (make venv)")
    ok = _run([str(script), "plan", "--model", "tiny", "--fp8-recipe", "tensorwise", "--small-gemm-filter", "off",
               "--arch", "sm90"])
    assert ok.returncode == 0, ok.stderr
    assert "tiny - recipe tensorwise (hybrid), target sm90" in ok.stdout
    bad = _run([str(script), "plan", "--fp8-recipe", "mxfp8", "--arch", "sm90"])
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "fp8stack: error: recipe 'mxfp8' needs sm100+ but the target is sm90: pick another recipe or pass --arch sm100"]


def test_python_dash_m():
    ok = _run([sys.executable, "-m", "fp8stack", "plan", "--fp8-recipe", "rowwise", "--arch", "sm90", "--format", "json"])
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["recipe"] == "rowwise"
    bad = _run([sys.executable, "-m", "fp8stack", "plan", "--fp8-recipe", "rowwise", "--arch", "sm90", "--format", "xml"])
    assert bad.returncode == 2
    assert len(bad.stderr.splitlines()) == 1 and bad.stderr.startswith("fp8stack: error: ")
    assert "Traceback" not in bad.stderr


def test_the_command_line_parses_and_plans_for_a_given_arch_without_importing_torch():
    """`fp8stack --help`, `--version`, every subcommand's --help and `fp8stack plan --arch ...` answer in a fraction
    of a second: building the parser imports no torch (a command imports it when it runs), nor does a plan whose
    target is given (only the local GPU's needs torch), where importing torch takes seconds."""
    code = ("import sys, fp8stack.cli as cli; cli.build_parser(); parsed = 'torch' in sys.modules; "
            "cli.main(['plan', '--arch', 'sm90', '--fp8-recipe', 'rowwise', '--format', 'json']); "
            "print(parsed, 'torch' in sys.modules)")
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "False False", done.stderr
