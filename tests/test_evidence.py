"""Evidence tooling on CPU: environment, evidence files, the GPU-test collector, the benchmark's guards."""

import json
import random
import signal
import subprocess
import sys
import weakref
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from fp8stack.bench import backends as bench
from fp8stack import evidence
from fp8stack.evidence import (EvidenceError, claim_evidence, describe_commit, device_copy, device_slug, environment,
                               evidence_json, latest_evidence, rerender, run_folder, write_evidence)
from fp8stack.bench import gpu_tests
from fp8stack.bench.gpu_tests import OutcomeCollector
from fp8stack.plan import PlanError

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


@cpu_only
def test_environment_on_cpu():
    env = environment()
    assert env["device"] == "cpu" and env["compute_capability"] is None
    assert env["torch"] == torch.__version__
    for name in ("cuda", "transformer_engine", "torchao", "megatron_core", "deep_gemm"):
        assert name in env  # a version string, or None when not installed
    assert device_slug() == "cpu"


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090")])
def test_device_slug(name, slug):
    assert device_slug(name) == slug


def test_write_evidence_writes_json_and_markdown(tmp_path, monkeypatch):
    out = tmp_path / "device-out"
    monkeypatch.setenv("OUT", str(out))
    json_path, md_path = write_evidence("demo-cpu", {"timings_ms": [1.0, 2.0]}, "| a |\n|---|\n| 1 |",
                                        tmp_path / "profiles")
    folder = json_path.parent  # the run's own folder: profiles/runs/<UTC date>-<stem>/
    assert folder == run_folder("demo-cpu", tmp_path / "profiles") and md_path.parent == folder
    assert folder.parent == tmp_path / "profiles" / "runs"
    assert folder.name == f"{datetime.now(timezone.utc).date().isoformat()}-demo-cpu"
    record = json.loads(json_path.read_text())
    assert {"date", "command", "environment", "timings_ms"} <= set(record)
    assert record["timings_ms"] == [1.0, 2.0] and record["environment"]["device"] == environment()["device"]
    markdown = md_path.read_text()
    for needle in ("# demo-cpu", "- device:", "- versions:", "- date:", "- command:", "| 1 |"):
        assert needle in markdown
    copies = out / "runs" / folder.name  # $OUT holds the run folder as profiles/runs/ does
    assert (copies / "demo-cpu.json").read_text() == json_path.read_text()
    assert (copies / "demo-cpu.md").read_text() == markdown
    assert device_copy(folder / "demo-cpu.png") == copies / "demo-cpu.png"


def test_a_run_folder_is_claimed_once_and_found_as_the_latest(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert device_copy(tmp_path / "x.json") is None
    assert latest_evidence("ab-x-cpu", tmp_path) == run_folder("ab-x-cpu", tmp_path) / "ab-x-cpu.json"  # none yet
    for folder in ("2026-01-02-older-run", "2026-03-04-newer-run"):
        (tmp_path / "runs" / folder).mkdir(parents=True)
        (tmp_path / "runs" / folder / "ab-x-cpu.json").write_text("{}")
    (tmp_path / "archive" / "2027-01-01-superseded").mkdir(parents=True)
    (tmp_path / "archive" / "2027-01-01-superseded" / "ab-x-cpu.json").write_text("{}")
    assert latest_evidence("ab-x-cpu", tmp_path) == tmp_path / "runs" / "2026-03-04-newer-run" / "ab-x-cpu.json"
    claim_evidence("demo-cpu", tmp_path)
    json_path, _ = write_evidence("demo-cpu", {"x": 1}, "", tmp_path, replace=True)
    with pytest.raises(EvidenceError, match="-demo-cpu/demo-cpu.json, .* exist: pass --force"):
        claim_evidence("demo-cpu", tmp_path)
    claim_evidence("demo-cpu-r2", tmp_path)  # another name, another folder
    assert sorted(p.name for p in (tmp_path / "runs").iterdir())[-1] == json_path.parent.name


def test_evidence_records_the_commit_and_whether_the_tree_was_dirty(tmp_path, monkeypatch):
    monkeypatch.delenv("FP8STACK_COMMIT", raising=False)
    monkeypatch.delenv("FP8STACK_DIRTY", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    json_path, md_path = write_evidence("checkout", {}, "", tmp_path)
    record = json.loads(json_path.read_text())
    assert (record["commit"], record["dirty"]) == (head, bool(status.strip()))
    assert f"- commit: {head} ({'dirty' if status.strip() else 'clean'})" in md_path.read_text()

    monkeypatch.setenv("FP8STACK_COMMIT", "0123abc")  # a tree sent to a GPU machine without .git
    monkeypatch.setenv("FP8STACK_DIRTY", "1")
    json_path, md_path = write_evidence("device", {}, "", tmp_path)
    record = json.loads(json_path.read_text())
    assert (record["commit"], record["dirty"]) == ("0123abc", True)
    assert "- commit: 0123abc (dirty)" in md_path.read_text()
    monkeypatch.delenv("FP8STACK_DIRTY")
    assert json.loads(write_evidence("unknown", {}, "", tmp_path)[0].read_text())["dirty"] is None


def test_a_bad_dirty_flag_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8STACK_DIRTY", "maybe")
    with pytest.raises(EvidenceError, match="FP8STACK_DIRTY='maybe': set it to 1 .* or 0"):
        write_evidence("bad", {}, "", tmp_path)
    assert not run_folder("bad", tmp_path).exists()


@pytest.mark.parametrize("record, line", [
    ({"commit": "abc", "dirty": False}, "abc (clean)"), ({"commit": "abc", "dirty": None}, "abc (dirty: not recorded)"),
    ({"commit": "abc (dirty)"}, "abc (dirty)"), ({}, "not recorded")])
def test_describe_commit(record, line):
    assert describe_commit(record) == line


def test_write_evidence_refuses_reserved_keys(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_evidence("x", {"date": "yesterday"}, "", tmp_path)


def _indented(record) -> str:
    """An evidence file's text as write_evidence wrote it before evidence_json."""
    return json.dumps(record, indent=2, default=str) + "\n"


def _same_content(text: str, other: str) -> bool:
    """Both texts parse to the same value: key order, number types and floats (NaN included) alike."""
    return json.dumps(json.loads(text)) == json.dumps(json.loads(other))


def test_evidence_json_reads_as_the_indented_json_with_each_list_of_scalars_on_one_line():
    floats = [random.Random(0).random() * 10 for _ in range(300)]
    record = {"nested": {"arm": {"losses": floats, "final": 1e-07}}, "runs": [{"note": 'a "q"\nline\\', "n": 3}, {}],
              "special": [float("nan"), float("inf"), -float("inf"), -0.0, 10**30], "empty": [], "none": {},
              "names": ["µs", 'tab\tand "quote"', True, None], "pair": (1, 2), "path": Path("a/b"),
              "dtype": torch.bfloat16, 7: "an int key", "mixed": [1, [2, 3], {"c": []}, []]}
    text = evidence_json(record)
    assert _same_content(text, _indented(record)) and text.endswith("]\n}\n")
    lines = text.splitlines()
    for line in ('      "losses": ' + json.dumps(floats) + ",", '  "empty": [],', '  "none": {},',
                 f'  "special": [NaN, Infinity, -Infinity, -0.0, {10**30}],', '  "pair": [1, 2],',
                 r'  "names": ["\u00b5s", "tab\tand \"quote\"", true, null],',
                 '  "path": "a/b",', '  "dtype": "torch.bfloat16",', '  "7": "an int key",'):
        assert line in lines
    assert text.split('"mixed": ')[1] == '[\n    1,\n    [2, 3],\n    {\n      "c": []\n    },\n    []\n  ]\n}\n'
    no_scalar_lists = {"a": {"b": {}, "c": 1.5}, "d": [{"e": "f"}, [[]]], "g": []}
    assert evidence_json(no_scalar_lists) == _indented(no_scalar_lists)  # dicts and lists of them: indented as before


def test_each_flat_record_of_a_list_takes_one_line():
    """A per-step series of routing statistics: one line per step, not one per layer and statistic; a list that also
    holds an empty or a nested dict is indented as before."""
    steps = [{f"layers.{layer}.moe/imbalance": 1.5 + layer, f"layers.{layer}.moe/dropped": 0.0} for layer in range(3)]
    record = {"router": steps, "mixed": [{"a": 1}, {}], "nested": [{"a": {"b": 1}}]}
    text = evidence_json(record)
    assert _same_content(text, _indented(record))
    assert text.split('"router": ')[1].startswith("[\n" + ",\n".join("    " + json.dumps(s) for s in steps) + "\n  ],")
    assert '"mixed": [\n    {\n      "a": 1\n    },\n    {}\n  ]' in text and '"a": {\n' in text


def test_a_2000_step_record_is_two_thirds_of_the_indented_one():
    """Full-precision floats keep most of the bytes: what goes is each item's line and indent."""
    values = random.Random(0)
    record = {"runs": {arm: {"losses": [10 * values.random() for _ in range(2000)],
                             "step_ms": [60 + values.random() for _ in range(2000)],
                             "lrs": [3e-4 * min(1, step / 100) for step in range(2000)],
                             "grad_norms": [values.random() for _ in range(2000)], "final_loss": 1.0}
                       for arm in ("bf16", "tensorwise", "blockwise")}}
    text = evidence_json(record)
    assert len(text) < 0.7 * len(_indented(record)) and len(text.splitlines()) < 30
    assert _same_content(text, _indented(record))


def test_compact_rewrites_files_in_the_new_layout_and_leaves_what_does_not_parse(tmp_path, capsys):
    record = {"date": "d", "losses": [1.5, 2.25, float("nan")], "arms": [{"name": "bf16", "step_ms": [60.1, 60.2]}]}
    old, new, broken = tmp_path / "runs" / "a" / "old.json", tmp_path / "runs" / "b" / "new.json", tmp_path / "bad.json"
    for path, text in ((old, _indented(record)), (new, evidence_json(record)), (broken, '{"cut": [1,')):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "runs" / "a" / "old.md").write_text("| a |\n")
    assert evidence.main(["--compact", str(tmp_path / "runs"), str(broken)]) == 1
    assert old.read_text() == new.read_text() == evidence_json(record) and broken.read_text() == '{"cut": [1,'
    out, err = capsys.readouterr()
    assert out == "rewrote 1 file(s)\n" and err.startswith(f"left as it was: {broken}: Expecting")
    assert evidence.compact([tmp_path / "runs"]) == ([], [])  # nothing left to rewrite
    assert (tmp_path / "runs" / "a" / "old.md").read_text() == "| a |\n"


def _figure_png(path: Path) -> bytes:
    """An RGBA PNG as matplotlib writes one: a few coloured lines with anti-aliased edges on white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3))
    for shift, colour in enumerate(("tab:blue", "tab:orange", "tab:green")):
        axes.plot([x / 10 + shift for x in range(50)], color=colour)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path.read_bytes()


def test_figures_are_written_and_compacted_with_a_palette(tmp_path, capsys):
    """A figure keeps at most PNG_COLORS colours, the plot's own among them: save_figure writes it so, and --compact
    rewrites an older RGBA figure so (smaller), leaves a palette one as it is, and reports a file that is no PNG."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from fp8stack.ab.plot import pyplot, save_figure

    old, broken = tmp_path / "runs" / "a" / "old.png", tmp_path / "runs" / "b" / "broken.png"
    old.parent.mkdir(parents=True)
    rgba = _figure_png(old)
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a png")
    assert evidence.main(["--compact", str(tmp_path / "runs")]) == 1
    assert "left as it was" in capsys.readouterr().err and broken.read_bytes() == b"not a png"
    with Image.open(old) as image:
        assert image.mode == "P" and len(old.read_bytes()) < len(rgba) / 2
        colours = {colour for _, colour in image.convert("RGB").getcolors(evidence.PNG_COLORS)}
    assert {(31, 119, 180), (255, 127, 14), (44, 160, 44), (255, 255, 255)} <= colours  # tab10's and the paper
    assert evidence.compact([old]) == ([], [])  # a palette PNG stays as it is

    def draw():
        figure, axes = pyplot().subplots()
        axes.plot([0, 1], [1, 0], color="tab:red")
        return figure

    written = save_figure(draw, tmp_path / "new.png")
    with Image.open(written) as image:
        assert image.mode == "P"


def test_collector_records_each_outcome(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU here')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_error(broken): pass\n")
    (tmp_path / "test_no_gpu_module.py").write_text(
        "import pytest\npytest.skip('needs a CUDA GPU', allow_module_level=True)\n")
    collector = OutcomeCollector()
    code = pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-o", "addopts=",
                        "--import-mode=importlib"], plugins=[collector])
    assert code == pytest.ExitCode.TESTS_FAILED
    by_name = {nodeid.split("::")[-1]: r for nodeid, r in collector.results.items()}
    assert by_name["test_ok"]["outcome"] == "passed"
    assert by_name["test_bad"]["outcome"] == "failed" and "one is not two" in by_name["test_bad"]["failure"]
    assert by_name["test_skip"]["outcome"] == "skipped" and by_name["test_skip"]["reason"].endswith("no GPU here")
    assert by_name["test_error"]["outcome"] == "error in setup" and "fixture broke" in by_name["test_error"]["failure"]
    assert by_name["test_no_gpu_module.py"]["outcome"] == "skipped"
    assert "needs a CUDA GPU" in by_name["test_no_gpu_module.py"]["reason"]
    assert all(r["duration_s"] >= 0 for r in collector.results.values())


def test_gpu_tests_runs_only_gpu_tests_and_writes_evidence(tmp_path):
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu\n"
        "def test_on_gpu(): pass\n"
        "def test_on_cpu(): pass\n")
    code = gpu_tests.run([str(tmp_path), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-o", "addopts=",
                          "--import-mode=importlib", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                         out_dir=tmp_path / "profiles")
    assert code == pytest.ExitCode.OK
    (json_path,) = (tmp_path / "profiles").glob("runs/*-gpu-tests-*/gpu-tests-*.json")
    record = json.loads(json_path.read_text())
    assert record["exit_code"] == 0 and record["counts"] == {"passed": 1}
    assert [t["nodeid"].split("::")[-1] for t in record["tests"]] == ["test_on_gpu"]
    written = json_path.with_suffix(".md").read_text()
    assert "test_on_gpu" in written and "pytest exit code 0: 1 passed" in written
    json_path.with_suffix(".md").unlink()  # the record renders the same Markdown again (rerender)
    assert rerender(json_path, gpu_tests.render).read_text() == written


def test_gpu_tests_help_prints_both_helps_and_writes_no_evidence(tmp_path, capsys):
    assert gpu_tests.run(["--help"], out_dir=tmp_path / "profiles") == pytest.ExitCode.OK
    printed = capsys.readouterr().out
    assert "--label NAME" in printed and "-k EXPRESSION" in printed
    assert not (tmp_path / "profiles").exists()


def test_gpu_tests_stopped_by_sigterm_still_writes_the_tests_that_finished(tmp_path):
    """A device call's `timeout` sends SIGTERM: the evidence keeps what ran before it, marked interrupted."""
    (tmp_path / "test_slow.py").write_text(
        "import os, signal, pytest\n"
        "@pytest.mark.gpu\n"
        "def test_first(): pass\n"
        "@pytest.mark.gpu\n"
        "def test_stopped(): os.kill(os.getpid(), signal.SIGTERM)\n"
        "@pytest.mark.gpu\n"
        "def test_never(): pass\n")
    before = signal.getsignal(signal.SIGTERM)
    code = gpu_tests.run([str(tmp_path), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-o", "addopts=",
                          "--import-mode=importlib", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                         out_dir=tmp_path / "profiles")
    assert code == pytest.ExitCode.INTERRUPTED
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is its own
    (json_path,) = (tmp_path / "profiles").glob("runs/*-gpu-tests-*/gpu-tests-*.json")
    record = json.loads(json_path.read_text())
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in record["tests"]}
    assert outcomes["test_first"] == "passed" and "test_never" not in outcomes
    assert outcomes["test_stopped"] == "interrupted"
    assert "interrupted: the tests below finished" in json_path.with_suffix(".md").read_text()


def test_gpu_tests_label_names_the_evidence_and_a_bad_label_exits_2_before_pytest(tmp_path, capsys):
    (tmp_path / "test_one.py").write_text("import pytest\n@pytest.mark.gpu\ndef test_one(): pass\n")
    args, force, label = gpu_tests.split_arguments(["--label", "moe", "-q", str(tmp_path), "--force"])
    assert (args, force, label) == (["-q", str(tmp_path)], True, "moe")
    code = gpu_tests.run([*args, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-o", "addopts=",
                          "--import-mode=importlib", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                         out_dir=tmp_path / "profiles", label=label)
    assert code == pytest.ExitCode.OK
    assert list((tmp_path / "profiles").glob("runs/*-gpu-tests-moe-*/gpu-tests-moe-*.json"))
    for bad in (["--label"], ["--label", "Bad Name"]):
        with pytest.raises(SystemExit) as stopped:
            gpu_tests.split_arguments(bad)
        assert stopped.value.code == 2
        assert "--label" in capsys.readouterr().err


def test_one_component_plan_targets_the_requested_backend():
    plan, decisions = bench.linear_plan(4096, 14336, "rowwise", "torchao")
    assert len(decisions) == 1 and len(plan.decisions) == 1
    (d,) = decisions
    assert (d.backend, d.recipe, d.component.n, d.component.k) == ("torchao", "rowwise", 4096, 14336)
    _, (te_decision,) = bench.linear_plan(4096, 4096, "delayed", "te")
    assert (te_decision.backend, te_decision.recipe) == ("te", "delayed")
    _, experts = bench.expert_plan(8, 7168, 2048, "blockwise", "auto")
    assert [(d.backend, d.recipe, d.fqn) for d in experts] == [
        ("grouped_fp8", "blockwise", "layers.0.experts.w13"), ("grouped_fp8", "blockwise", "layers.0.experts.w2")]
    _, te_experts = bench.expert_plan(8, 7168, 2048, "tensorwise", "te")
    assert {d.backend for d in te_experts} == {"te"}
    with pytest.raises(PlanError, match="not divisible"):
        bench.linear_plan(576, 7168, "blockwise", "te")  # DeepSeek-V3's wkv_a: the policy keeps it BF16


def test_benchmark_shapes():
    linears = bench.linear_shapes(["llama-1b-like"])
    assert [(s["n"], s["k"]) for s in linears] == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    experts = bench.expert_shapes(["llama-1b-like", "deepseek-v3-like-moe"], tokens=8192, local_experts=32)
    assert [(s["source"], s["experts"], s["dim"], s["hidden"], s["tokens_per_expert"]) for s in experts] == [
        ("deepseek-v3-like-moe", 32, 7168, 2048, 256),  # 8192 tokens x top-8 over 256 experts
        ("issue-7", 8, 7168, 2048, 4096)]


def test_grouped_only_times_the_expert_blocks_of_the_named_models_and_no_linear():
    """The run that measures deepseek-moe-small's expert block for the plan's table: every expert variant at its shape
    (32 experts of 2048 -> 1536, 4096 tokens x top-8 / 32 = 1024 each) and the MoE target's, no dense linear."""
    args = bench.parse_args(["--shapes", "deepseek-moe-small", "--tokens", "4096", "--local-experts", "32",
                             "--grouped-only", "--label", "deepseek-moe-small-experts"])
    assert bench.dense_runs(args) == []
    runs = bench.grouped_runs(args)
    assert len(runs) == 2 * 2 * len(bench.EXPERT_VARIANTS)  # (its shape, the target's) x (w13, whole block)
    small = {"source": "deepseek-moe-small", "experts": 32, "model_experts": 32, "top_k": 8, "dim": 2048,
             "hidden": 1536, "tokens_per_expert": 1024}
    blocks = [(backend, recipe, options) for shape, gemm, backend, recipe, options in runs
              if shape == small and gemm == "experts"]
    assert blocks == list(bench.EXPERT_VARIANTS)
    planned = set()
    for backend, recipe, options in blocks:  # the policy runs each as asked at this shape
        _, decisions = bench.expert_plan(32, 2048, 1536, recipe, backend)
        planned |= {(d.backend, d.recipe, options.get("kernels", "")) for d in decisions}
    assert planned == {("bf16", "bf16", ""), ("grouped_fp8", "blockwise", "torch"),
                       ("grouped_fp8", "blockwise", "deepgemm"), ("grouped_fp8", "rowwise", ""),
                       ("grouped_fp8", "rowwise_gw_hp", ""), ("te", "tensorwise", ""), ("te", "delayed", ""),
                       ("te", "blockwise", "")}
    # no optimizer step between the timed steps: a weight cache would time no weight cast
    cached = {(d.backend, recipe) for backend, recipe, options in blocks if options.get("cache_fp8_weights", True)
              for d in bench.expert_plan(32, 2048, 1536, recipe, backend)[1]
              if d.backend == "te" or d.recipe == "blockwise"}
    assert cached == set()
    assert len(bench.dense_runs(bench.parse_args(["--shapes", "deepseek-moe-small"]))) == 6 * len(
        bench.DENSE_VARIANTS)  # without the flag: its six linear shapes too


def test_a_measured_variant_leaves_nothing_alive_even_in_a_reference_cycle():
    """A converted model and its MasterWeights hold each other through hooks; left to the collector's own pace, every
    variant's weights stayed on the GPU until an H200 ran out of memory."""
    class Model:
        pass

    alive = []

    def run() -> list[float]:
        model = Model()
        model.hooks = [model]
        alive.append(weakref.ref(model))
        return [1.0, 2.0]

    entry = bench._measure({}, run, flops=6)
    assert entry["median_ms"] == 1.5 and alive[0]() is None


def test_the_bench_measures_deepseek_moe_medium_s_expert_block_by_its_name():
    """`--shapes deepseek-moe-medium --tokens 4096` times its block as one GPU holds it at micro-batch 1: all 16
    experts of 4096 -> 4096, 4096 tokens x top-4 / 16 = 1024 each, the shape the plan reads for it."""
    args = bench.parse_args(["--shapes", "deepseek-moe-medium", "--tokens", "4096", "--grouped-only"])
    shapes = {shape["source"]: shape for shape, *_ in bench.grouped_runs(args)}
    assert shapes["deepseek-moe-medium"] == {"source": "deepseek-moe-medium", "experts": 16, "model_experts": 16,
                                             "top_k": 4, "dim": 4096, "hidden": 4096, "tokens_per_expert": 1024}
    assert set(shapes) == {"deepseek-moe-medium", "issue-7"} and bench.dense_runs(args) == []


def test_speedups_compare_like_with_like_and_failures_stay_visible():
    results = [{"n": 1, "recipe": "bf16", "compiled": False, "median_ms": 2.0},
               {"n": 1, "recipe": "rowwise", "compiled": False, "median_ms": 1.0},
               {"n": 1, "recipe": "bf16", "compiled": True, "median_ms": 1.0},
               {"n": 1, "recipe": "rowwise", "compiled": True, "median_ms": 0.5},
               {"n": 1, "recipe": "blockwise", "compiled": False, "error": "RuntimeError: boom"}]
    bench._speedups(results, lambda r: (r["n"], r["compiled"]))
    assert [r.get("speedup_vs_bf16") for r in results] == [1.0, 2.0, 1.0, 2.0, None]
    assert bench._cell(results[4], "median_ms") == "error: RuntimeError: boom"


@cpu_only
def test_benchmark_refuses_cpu(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fp8stack.bench.backends", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs a CUDA GPU" in result.stderr
    assert not list(tmp_path.iterdir())


@cpu_only
def test_te_gemms_refuses_cpu(tmp_path, capsys):
    from fp8stack.bench import te_gemms

    assert te_gemms.main(["--out", str(tmp_path)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_expert_blocks_are_timed_as_training_runs_them(monkeypatch):
    """The backends benchmark's expert blocks train as fp8stack's training runs them (FP32 model -> apply_fp8 ->
    MasterWeights): BF16 parameters, weight gradients in FP32 main_grads, none left in .grad; on CPU, BF16's."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    models = []

    def run_twice(step, grads_of, iters, warmup):
        step(0)
        step(1)
        models.append(grads_of)
        return [1.0]

    monkeypatch.setattr(bench, "time_steps", run_twice)
    shape = {"source": "t", "experts": 2, "dim": 128, "hidden": 128, "tokens_per_expert": 128}
    settings = bench.Settings(tokens=256, iters=1, warmup=0, arch=90, compile=False)
    entry = bench.bench_experts(shape, "auto", "bf16", {}, "experts", settings)
    assert "error" not in entry and entry["weight_gradients"] == "into FP32 main_grad (MasterWeights)"
    weights = [t for t in models[0] if t.dim() == 3]
    assert len(weights) == 2 and all(w.dtype == torch.bfloat16 and w.grad is None for w in weights)
    assert all(w.main_grad.dtype == torch.float32 and w.main_grad.abs().sum() > 0 for w in weights)
