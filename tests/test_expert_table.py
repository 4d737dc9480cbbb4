"""The plan's measured expert table (fp8stack/plan/expert_speeds.json) against the evidence it is generated from,
the policy's expert choices from it, and DeepGEMM as an optional dependency: its absence, its pinned source archive
and its JIT cache folder."""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from fp8stack.backends import BackendUnavailable, deepgemm, te_deepgemm
from fp8stack.backends.grouped import GroupedFP8Backend
from fp8stack.bench import expert_table
from fp8stack.config import ConfigError, from_overrides
from fp8stack.models import load_model_config
from fp8stack.models.llama import Llama
from fp8stack.plan import (ModelDescription, PlanError, PlanWarning, PolicyConfig, description_from_dict,
                           load_description, make_plan)
from fp8stack.plan import expert_speeds
from fp8stack.plan.expert_speeds import (TABLE_PATH, ExpertGemm, ExpertShape, load_table, measured, runnable_kernels,
                                         shape_note)
from fp8stack.train.command import main as train_main
from fp8stack.train.loop import resolve_job

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = "profiles/runs/*/backends-*.json"
"""The backends benchmark's evidence, as the table's own command names it."""
TARGET = ExpertShape(experts=8, dim=7168, hidden=2048, tokens_per_expert=4096)
"""The MoE target's expert block (fp8stack.bench.backends.ISSUE7_EXPERTS), measured on every sm90 GPU so far."""
W13 = ExpertGemm(experts=8, n=2 * 2048, k=7168, tokens_per_expert=1024)
"""Its w13 GEMM, as a plan of experts_model() reads the table for it."""


def evidence_files() -> list[Path]:
    return sorted(Path().glob(EVIDENCE))


LOOK_FOR_DEEP_GEMM = expert_speeds.deep_gemm_installed
"""The plan's own check, which deep_gemm_installed() below stands in for."""


@pytest.fixture(autouse=True)
def deep_gemm_installed(monkeypatch):
    """The plan reads the table as on a GPU machine with DeepGEMM, where grouped_fp8's measured best kernels run."""
    monkeypatch.setattr(expert_speeds, "deep_gemm_installed", lambda: True)


# --- the table, from the evidence ---------------------------------------------------------------------------

def test_the_packaged_table_is_what_the_evidence_gives(monkeypatch):
    monkeypatch.chdir(REPO)
    assert load_table()["generated_by"] == expert_table.COMMAND
    assert expert_table.render(expert_table.build_table(evidence_files())) == TABLE_PATH.read_text(), (
        f"fp8stack/plan/expert_speeds.json differs from the evidence: run {expert_table.COMMAND}")


def test_each_measurement_names_the_evidence_row_it_comes_from(monkeypatch):
    monkeypatch.chdir(REPO)
    archs = load_table()["archs"]
    assert "sm90" in archs
    for arch, paths in archs.items():
        for key, devices in paths.items():
            assert len({(m["device"], str(m["shape"])) for m in devices}) == len(devices), key  # the newest of each
            for m in devices:
                record = json.loads(Path(m["source"]).read_text())
                assert (record["environment"]["device"], record["date"][:10]) == (m["device"], m["date"])
                assert arch == "sm" + record["environment"]["compute_capability"].replace(".", "")
                recipe, backend = key.split(":")[0].split("/")
                rows = [r for r in record["grouped"] if r["gemm"] == "experts" and r["recipe"] == recipe
                        and r["backend"] == backend and expert_table.kernels_label(r.get("options", {})) == m["kernels"]
                        and all(r[field] == value for field, value in m["shape"].items())]
                assert [r["speedup_vs_bf16"] for r in rows] == [m["speedup"]], (key, m["source"])
    shapes = [ExpertShape(**shape) for shape in load_table()["shapes"]]
    assert TARGET in shapes and len(shapes) > 1  # the models' shapes the evidence measured are kept too


def test_the_table_keeps_one_measurement_per_device_and_shape_the_newest(tmp_path):
    def evidence(name, date, speedups):
        path = tmp_path / name
        path.write_text(json.dumps({"date": date, "environment": {"device": "H", "compute_capability": "9.0"},
                                    "grouped": [{"gemm": "experts", "recipe": "blockwise", "backend": "te",
                                                 "speedup_vs_bf16": speedup, **shape} for shape, speedup in speedups]}))
        return path

    small = {"experts": 32, "dim": 2048, "hidden": 1536, "tokens_per_expert": 1024}
    old = evidence("old.json", "2026-11-01T00:00:00", [(asdict(TARGET), 1.2), (small, 0.5)])
    new = evidence("new.json", "2026-11-02T00:00:00", [(small, 0.6)])
    table = expert_table.build_table([old, new])
    assert table["shapes"] == [asdict(TARGET), small]
    assert [(m["speedup"], m["source"]) for m in table["archs"]["sm90"]["blockwise/te"]] == [
        (1.2, old.as_posix()), (0.6, new.as_posix())]


def test_of_two_evidence_files_of_one_day_the_later_measured_wins_whatever_their_names(tmp_path):
    def evidence(name, date, speedup):
        path = tmp_path / name
        path.write_text(json.dumps({"date": date, "environment": {"device": "H", "compute_capability": "9.0"},
                                    "grouped": [{"gemm": "experts", "recipe": "blockwise", "backend": "te",
                                                 "speedup_vs_bf16": speedup, **asdict(TARGET)}]}))
        return path

    later = evidence("a-later.json", "2026-11-28T13:40:07+00:00", 1.3)
    earlier = evidence("b-earlier.json", "2026-11-28T05:12:00+00:00", 1.1)
    for order in ([later, earlier], [earlier, later]):
        [measurement] = expert_table.build_table(order)["archs"]["sm90"]["blockwise/te"]
        assert (measurement["speedup"], measurement["date"]) == (1.3, "2026-11-28")


def test_the_tool_writes_the_table_where_asked(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "speeds.json"
    assert expert_table.main([*map(str, evidence_files()), "--out", str(out)]) == 0
    assert out.read_text() == TABLE_PATH.read_text()


@pytest.mark.parametrize("text, message", [
    ("{}", "is not fp8stack.bench.backends evidence (KeyError"),
    ("[1", "is not fp8stack.bench.backends evidence (JSONDecodeError"),
    (json.dumps({"date": "2026-11-26", "environment": {"device": "X", "compute_capability": "9.0"}, "grouped": []}),
     "no timed FP8 whole-expert-block measurement in these files"),
    (json.dumps({"date": "2026-11-26", "environment": {"device": "X", "compute_capability": "9.0"},
                 "grouped": [{"gemm": "experts", "recipe": "blockwise", "backend": "te", "speedup_vs_bf16": 1.1}]}),
     "is not fp8stack.bench.backends evidence (KeyError: 'experts')"),
])
def test_the_tool_refuses_what_is_not_expert_evidence_in_one_line(tmp_path, capsys, text, message):
    bad, out = tmp_path / "bad.json", tmp_path / "speeds.json"
    bad.write_text(text)
    assert expert_table.main([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def row(speedup, device, kernels="", shape=TARGET):
    """A table measurement."""
    return {"speedup": speedup, "shape": asdict(shape), "device": device, "date": "2026-11-26",
            "source": f"p/{device}/x.json", "kernels": kernels}


def test_the_slowest_device_of_a_path_counts_and_the_fastest_kernels():
    table = {"archs": {"sm90": {
        "blockwise/grouped_fp8:deepgemm": [row(0.9, "A", "deepgemm"), row(0.8, "B", "deepgemm")],
        "blockwise/grouped_fp8:torch": [row(0.7, "A", "torch"), row(0.75, "B", "torch")],
        "blockwise/te": [row(1.3, "A"), row(1.2, "B")]}}}
    grouped = measured(90, "blockwise", "grouped_fp8", W13, table)
    assert (grouped.speedup, grouped.device, grouped.kernels) == (0.8, "B", "deepgemm")
    te = measured(90, "blockwise", "te", W13, table)
    assert (te.speedup, te.device, te.shape) == (1.2, "B", TARGET)
    assert measured(100, "blockwise", "te", W13, table) is None
    assert measured(90, "rowwise", "grouped_fp8", W13, table) is None


def test_te_quantizer_rows_file_as_a_kernel_choice_of_their_own(tmp_path):
    """A grouped_fp8 row timed with TE's quantizer is its own kernel choice ('deepgemm+te-quantizer'), beside the
    inductor quantizers' ('deepgemm', also where the row names no quantizer); the plan reads the faster."""
    shape = {"source": "t", **asdict(TARGET), "gemm": "experts", "backend": "grouped_fp8", "recipe": "blockwise"}
    evidence = tmp_path / "backends-h200.json"
    evidence.write_text(json.dumps({"date": "2026-11-28T00:00:00", "environment": {
        "device": "NVIDIA H200", "compute_capability": "9.0"}, "grouped": [
        {**shape, "options": {"kernels": "deepgemm", "quantizer": "inductor"}, "speedup_vs_bf16": 0.88},
        {**shape, "options": {"kernels": "deepgemm", "quantizer": "te"}, "speedup_vs_bf16": 1.09}]}))
    table = expert_table.build_table([evidence])
    assert sorted(table["archs"]["sm90"]) == ["blockwise/grouped_fp8:deepgemm",
                                              "blockwise/grouped_fp8:deepgemm+te-quantizer"]
    grouped = measured(90, "blockwise", "grouped_fp8", W13, table)
    assert (grouped.speedup, grouped.kernels) == (1.09, "deepgemm+te-quantizer")
    assert "with deepgemm+te-quantizer kernels" in grouped.describe()
    assert expert_table.kernels_label({"kernels": "deepgemm"}) == "deepgemm"


# --- the plan's choice at each model's shape ----------------------------------------------------------------

SMALL = ExpertShape(experts=32, dim=2048, hidden=1536, tokens_per_expert=1024)
"""deepseek-moe-small's expert block at micro-batch 1 (32 experts top-8 of 2048 -> 1536, 4096 tokens)."""
TWO_SHAPES = {"archs": {"sm90": {
    "blockwise/te": [row(1.24, "H200"), row(0.47, "H200", shape=SMALL)],
    "blockwise/grouped_fp8:deepgemm": [row(0.89, "H200", "deepgemm"), row(1.1, "H200", "deepgemm", SMALL)]}}}
"""A path faster than BF16 at one shape and slower at the other, and one the other way round."""


def test_a_path_is_read_at_the_gemm_s_own_shape_from_w13_or_w2():
    for gemm in (ExpertGemm(32, 2 * 1536, 2048, 1024), ExpertGemm(32, 2048, 1536, 1024)):  # w13, w2
        te = measured(90, "blockwise", "te", gemm, TWO_SHAPES)
        assert (te.speedup, te.shape) == (0.47, SMALL) and shape_note(te, gemm) == ""
    te = measured(90, "blockwise", "te", W13, TWO_SHAPES)
    assert (te.speedup, te.shape) == (1.24, TARGET) and shape_note(te, W13) == ""
    assert "at 32 experts of 2048 -> 1536 with 1024 tokens each on H200" in measured(
        90, "blockwise", "te", ExpertGemm(32, 2048, 1536, 1024), TWO_SHAPES).describe()


def test_elsewhere_the_nearest_measured_shape_counts_and_the_reason_says_so():
    """Nearest: the fewest of (experts, dim, hidden) differing, then the closest tokens per expert (log scale)."""
    wider = ExpertGemm(32, 2 * 2048, 2048, 1024)  # SMALL's experts and dim, another hidden: one differs
    assert measured(90, "blockwise", "te", wider, TWO_SHAPES).shape == SMALL
    many = ExpertGemm(256, 2 * 2048, 7168, 128)  # TARGET's dim and hidden, 256 experts: one differs
    assert measured(90, "blockwise", "te", many, TWO_SHAPES).shape == TARGET
    tied = {"archs": {"sm90": {"blockwise/te": [row(1.2, "H", shape=TARGET),
                                                row(0.5, "H", shape=ExpertShape(32, 7168, 2048, 256))]}}}
    assert measured(90, "blockwise", "te", many, tied).shape.tokens_per_expert == 256  # 128 is nearer 256 than 4096
    note = shape_note(measured(90, "blockwise", "te", wider, TWO_SHAPES), wider)
    assert note == ("; 32 experts of 2048 -> 1536 is the nearest shape measured to this GEMM's 32 experts of "
                    "[4096, 2048] with 1024 tokens each per sequence: measure this model (fp8stack ab)")


def test_a_gemm_whose_role_is_known_is_read_as_that_role_only():
    """deepseek-moe-medium's square w2 [4096, 4096] (F = D) would also read as the w13 of a block of hidden 2048,
    TARGET's; told it is a w2, it reads as its own block (16 experts of 4096 -> 4096), as its w13 does, and both
    take the nearest shape to that block."""
    unknown, w2 = ExpertGemm(16, 4096, 4096, 1024), ExpertGemm(16, 4096, 4096, 1024, role="w2")
    w13 = ExpertGemm(16, 2 * 4096, 4096, 1024, role="w13")
    assert measured(90, "blockwise", "te", unknown, TWO_SHAPES).shape == TARGET
    assert measured(90, "blockwise", "te", w2, TWO_SHAPES).shape == SMALL
    assert measured(90, "blockwise", "te", w13, TWO_SHAPES).shape == SMALL


def moe_model(experts: int, dim: int, hidden: int, active: int) -> ModelDescription:
    """A description with one MoE layer of these experts beside a dense linear large enough that the plan has FP8
    either way."""
    return description_from_dict({
        "name": "experts", "seq_len": 4096,
        "blocks": {"moe": [{"name": "attention.wo", "kind": "linear", "n": 7168, "k": 7168},
                           {"name": "moe.experts.w13", "kind": "expert", "n": 2 * hidden, "k": dim,
                            "experts": experts, "active": active},
                           {"name": "moe.experts.w2", "kind": "expert", "n": dim, "k": hidden, "experts": experts,
                            "active": active}]},
        "layers": [{"block": "moe"}]})


def test_the_plan_chooses_each_model_s_expert_path_at_its_own_shape(monkeypatch):
    monkeypatch.setattr(expert_speeds, "load_table", lambda: TWO_SHAPES)
    policy = PolicyConfig(recipe="blockwise", small_gemm_filter="off")
    target = make_plan(moe_model(8, 7168, 2048, 2), policy)
    small = make_plan(moe_model(32, 2048, 1536, 8), policy)
    for fqn in ("layers.0.moe.experts.w13", "layers.0.moe.experts.w2"):
        d = target.decision(fqn)
        assert (d.backend, d.recipe) == ("te", "blockwise")
        assert "the fastest blockwise expert path on sm90, measured 1.24x BF16 at 8 experts of 7168 -> 2048" in d.reason
        assert "nearest shape" not in d.reason and "nearest shape" not in small.decision(fqn).reason
        d = small.decision(fqn)
        assert (d.backend, d.recipe) == ("grouped_fp8", "blockwise")
        assert "measured 1.1x BF16 with deepgemm kernels at 32 experts of 2048 -> 1536 with 1024 tokens" in d.reason
        assert d.reason.endswith("; te: 0.47x")
    slower = {"archs": {"sm90": {"blockwise/te": TWO_SHAPES["archs"]["sm90"]["blockwise/te"],
                                 "blockwise/grouped_fp8:deepgemm": [row(0.8, "H200", "deepgemm", SMALL)]}}}
    monkeypatch.setattr(expert_speeds, "load_table", lambda: slower)
    kept = make_plan(moe_model(32, 2048, 1536, 8), policy).decision("layers.0.moe.experts.w13")
    assert (kept.backend, kept.recipe) == ("bf16", "bf16")
    assert kept.reason.startswith("every FP8 expert path of recipe blockwise is slower than BF16 on sm90 (te/blockwise "
                                  "measured 0.47x BF16 at 32 experts of 2048 -> 1536 with 1024 tokens each on H200")
    asked_te = PolicyConfig(recipe="blockwise", small_gemm_filter="off", expert_backend="te")
    asked = make_plan(moe_model(32, 2048, 1536, 8), asked_te).decision("layers.0.moe.experts.w13")
    assert (asked.backend, asked.recipe) == ("te", "blockwise")
    assert asked.reason.endswith("expert_backend=te, as asked: measured 0.47x BF16 at 32 experts of 2048 -> 1536 with "
                                 "1024 tokens each on H200 (p/H200)")


def test_evidence_at_deepseek_moe_small_s_shape_decides_its_plan(tmp_path, monkeypatch):
    """What `python -m fp8stack.bench.backends --shapes deepseek-moe-small --tokens 4096 --grouped-only` records
    (here with made-up speeds) becomes the table the plan reads for that model's experts, at their own shape."""
    small = {"source": "deepseek-moe-small", "experts": 32, "model_experts": 32, "top_k": 8, "dim": 2048,
             "hidden": 1536, "tokens_per_expert": 1024, "gemm": "experts"}
    evidence = tmp_path / "backends-small-h200.json"
    evidence.write_text(json.dumps({"date": "2026-11-27T00:00:00", "environment": {
        "device": "NVIDIA H200", "compute_capability": "9.0"}, "grouped": [
        {**small, "backend": "te", "recipe": "blockwise", "options": {}, "speedup_vs_bf16": 0.474},
        {**small, "backend": "grouped_fp8", "recipe": "blockwise", "options": {"kernels": "deepgemm"},
         "speedup_vs_bf16": 0.9}]}))
    table = expert_table.build_table([evidence])
    monkeypatch.setattr(expert_speeds, "load_table", lambda: table)
    with pytest.warns(PlanWarning, match="runs 4% of its GEMM FLOPs in FP8"):  # its FLOPs are the experts'
        plan = make_plan(load_description("deepseek-moe-small"), PolicyConfig(recipe="blockwise"))
    experts = [d for d in plan.decisions if d.component.kind == "expert"]
    assert len(experts) == 14 and {(d.backend, d.recipe) for d in experts} == {("bf16", "bf16")}
    for d in experts:
        assert "te/blockwise measured 0.474x BF16 at 32 experts of 2048 -> 1536 with 1024 tokens each" in d.reason
        assert "pass expert_backend=grouped_fp8 to run them in FP8 anyway" in d.reason and "nearest" not in d.reason


MEDIUM = {"source": "deepseek-moe-medium", "experts": 16, "model_experts": 16, "top_k": 4, "dim": 4096,
          "hidden": 4096, "tokens_per_expert": 1024, "gemm": "experts"}
"""deepseek-moe-medium's expert block as `python -m fp8stack.bench.backends --shapes deepseek-moe-medium --tokens 4096
--grouped-only` records it (16 experts of 4096 -> 4096, 4096 tokens x top-4 / 16 = 1024 each)."""


def medium_experts(table: dict) -> list:
    """deepseek-moe-medium's expert decisions under the default blockwise policy, reading `table`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_speeds, "load_table", lambda: table)
        plan = make_plan(load_description("deepseek-moe-medium"), PolicyConfig(recipe="blockwise"))
    return [d for d in plan.decisions if d.component.kind == "expert"]


def test_without_evidence_at_deepseek_moe_medium_s_shape_its_plan_reads_the_nearest_and_says_so():
    """The packaged table without any measurement at this model's expert block: each expert GEMM is planned from
    the nearest measured shape, w13 and w2 from the same one, and the reason names it and asks for a measurement."""
    block = {"experts": 16, "dim": 4096, "hidden": 4096}
    table = json.loads(TABLE_PATH.read_text())
    for paths in table["archs"].values():
        for key in paths:
            paths[key] = [m for m in paths[key] if {k: m["shape"][k] for k in block} != block]
    experts = medium_experts(table)
    assert len(experts) == 2 * 5
    assert len({(d.backend, d.recipe) for d in experts}) == 1  # one block, one measurement
    nearest = {d.reason.split("; ")[-1].split(" is the nearest shape")[0] for d in experts}
    assert len(nearest) == 1 and "experts of" in nearest.pop()
    for d in experts:
        gemm = "[8192, 4096]" if d.fqn.endswith("w13") else "[4096, 4096]"
        assert d.reason.endswith(f"is the nearest shape measured to this GEMM's 16 experts of {gemm} with 1024 tokens "
                                 "each per sequence: measure this model (fp8stack ab)"), d.reason


def test_evidence_at_deepseek_moe_medium_s_shape_decides_its_plan(tmp_path):
    """Once its block is measured (here with made-up speeds: TE's blockwise path faster than BF16, grouped_fp8's
    slower), the plan takes the fastest path for both expert GEMMs at their own shape, without a nearest-shape note."""
    evidence = tmp_path / "backends-medium-h200.json"
    evidence.write_text(json.dumps({"date": "2026-11-29T00:00:00", "environment": {
        "device": "NVIDIA H200", "compute_capability": "9.0"}, "grouped": [
        {**MEDIUM, "backend": "te", "recipe": "blockwise", "options": {}, "speedup_vs_bf16": 1.3},
        {**MEDIUM, "backend": "grouped_fp8", "recipe": "blockwise", "options": {"kernels": "deepgemm"},
         "speedup_vs_bf16": 0.8}]}))
    experts = medium_experts(expert_table.build_table([evidence]))
    assert {(d.backend, d.recipe) for d in experts} == {("te", "blockwise")}
    for d in experts:
        assert "measured 1.3x BF16 at 16 experts of 4096 -> 4096 with 1024 tokens each on NVIDIA H200" in d.reason
        assert d.reason.endswith("; grouped_fp8: 0.8x"), d.reason


# --- the plan's choice, from the packaged table -------------------------------------------------------------

def experts_model():
    """The MoE target's expert shape beside a dense linear large enough that the plan has FP8 either way."""
    return moe_model(8, 7168, 2048, 2)


def expert_decision(recipe: str, **policy):
    return make_plan(experts_model(), PolicyConfig(recipe=recipe, small_gemm_filter="off", **policy)).decision(
        "layers.0.moe.experts.w13")


def test_blockwise_experts_take_the_fastest_path_measured_on_sm90():
    paths = {backend: measured(90, "blockwise", backend, W13, kernels=runnable_kernels("deepgemm"))
             for backend in ("te", "grouped_fp8")}
    fastest = max(paths, key=lambda backend: paths[backend].speedup)
    [other] = set(paths) - {fastest}
    assert paths[fastest].speedup > 1  # what the evidence says today; the plan follows it
    d = expert_decision("blockwise")
    assert (d.backend, d.recipe) == (fastest, "blockwise")
    best = paths[fastest]
    assert f"expert_backend=auto: the fastest blockwise expert path on sm90, {best.describe()}" in d.reason
    assert d.reason.endswith(f"; {other}: {paths[other].speedup}x")  # the measured shape: no note on it
    assert (REPO / best.folder).is_dir() and best.device in d.reason and f"{best.speedup}x BF16" in d.reason
    assert "at 8 experts of 7168 -> 2048 with 4096 tokens each" in d.reason


def test_where_deep_gemm_is_missing_the_plan_counts_no_speed_measured_on_it(no_deep_gemm, monkeypatch):
    """grouped_fp8 runs torch's scaled GEMMs there, so its DeepGEMM measurements must not pick it; auto finds out,
    and grouped_kernels names the kernels for a plan made on another machine."""
    monkeypatch.setattr(expert_speeds, "deep_gemm_installed", LOOK_FOR_DEEP_GEMM)
    assert runnable_kernels("auto") == runnable_kernels("torch") == frozenset({"", "torch"})
    grouped = measured(90, "blockwise", "grouped_fp8", W13, kernels=runnable_kernels("auto"))
    assert grouped.kernels == "torch" and grouped.speedup < 1
    d = expert_decision("blockwise")
    assert (d.backend, d.recipe) == ("te", "blockwise") and "grouped_fp8: " + str(grouped.speedup) + "x" in d.reason
    on_deepgemm = expert_decision("blockwise", grouped_kernels="deepgemm")
    best = measured(90, "blockwise", "grouped_fp8", W13, kernels=runnable_kernels("deepgemm"))
    assert best.kernels.startswith("deepgemm") and f"{best.speedup}x" in on_deepgemm.reason
    with pytest.raises(PlanError, match="grouped_kernels='cutlass': use one of auto, deepgemm, torch"):
        PolicyConfig(recipe="blockwise", grouped_kernels="cutlass")


def test_a_choice_says_when_the_model_s_experts_are_not_a_measured_shape():
    """A model whose expert GEMMs were not measured is told which shape its speed was read at; the measured shape's
    GEMMs, w13 and w2, are not."""
    te = measured(90, "blockwise", "te", W13)
    assert shape_note(te, W13) == shape_note(te, ExpertGemm(8, 7168, 2048, 1024)) == ""
    unmeasured = moe_model(16, 3072, 1024, 4)  # no evidence measures 16 experts of 3072 -> 1024
    experts = [d for d in make_plan(unmeasured, PolicyConfig(recipe="blockwise", small_gemm_filter="off")).decisions
               if d.component.kind == "expert"]
    assert len(experts) == 2
    assert all("is the nearest shape measured to this GEMM's 16 experts of [" in d.reason for d in experts)


def test_a_path_measured_slower_than_bf16_is_planned_only_when_asked():
    """deepseek-moe-small's expert block (32 experts of 2048 -> 1536): every blockwise path measured slower than
    BF16 there, so its experts stay BF16 unless a backend is named; grouped_fp8's fastest kernels there are
    DeepGEMM's with TE's quantizer."""
    small_w13 = ExpertGemm(experts=32, n=2 * 1536, k=2048, tokens_per_expert=1024)
    grouped, te = (measured(90, "blockwise", backend, small_w13) for backend in ("grouped_fp8", "te"))
    assert grouped.speedup < 1 and te.speedup < 1  # what the evidence says today
    plan = make_plan(moe_model(32, 2048, 1536, 8), PolicyConfig(recipe="blockwise", small_gemm_filter="off"))
    assert (plan.decision("layers.0.moe.experts.w13").backend, plan.decision("layers.0.moe.experts.w13").recipe) \
        == ("bf16", "bf16")
    plan = make_plan(moe_model(32, 2048, 1536, 8), PolicyConfig(recipe="blockwise", small_gemm_filter="off",
                                                                 expert_backend="grouped_fp8"))
    d = plan.decision("layers.0.moe.experts.w13")
    assert (d.backend, d.recipe) == ("grouped_fp8", "blockwise")
    assert d.reason.endswith(f"expert_backend=grouped_fp8, as asked: {grouped.describe()}")
    assert grouped.kernels == "deepgemm+te-quantizer" and "with deepgemm+te-quantizer kernels" in d.reason


def test_deepseek_moe_medium_s_blockwise_experts_take_the_path_measured_faster_at_their_shape():
    medium_w13 = ExpertGemm(experts=16, n=2 * 4096, k=4096, tokens_per_expert=1024)
    paths = {backend: measured(90, "blockwise", backend, medium_w13) for backend in ("te", "grouped_fp8")}
    fastest = max(paths, key=lambda backend: paths[backend].speedup)
    assert paths[fastest].speedup > 1  # what the evidence says today
    d = make_plan(moe_model(16, 4096, 4096, 4), PolicyConfig(recipe="blockwise", small_gemm_filter="off")).decision(
        "layers.0.moe.experts.w13")
    assert (d.backend, d.recipe) == (fastest, "blockwise") and paths[fastest].describe() in d.reason


def test_rowwise_experts_stay_bf16_unless_asked_because_every_path_is_slower():
    rowwise = measured(90, "rowwise", "grouped_fp8", W13)
    assert rowwise.speedup < 1
    kept = expert_decision("rowwise")
    assert (kept.backend, kept.recipe) == ("bf16", "bf16")
    assert kept.reason == (f"every FP8 expert path of recipe rowwise is slower than BF16 on sm90 (grouped_fp8/rowwise "
                           f"{rowwise.describe()}), so the experts stay BF16: pass expert_backend=grouped_fp8 to run "
                           "them in FP8 anyway")
    asked = expert_decision("rowwise", expert_backend="grouped_fp8")
    assert (asked.backend, asked.recipe) == ("grouped_fp8", "rowwise")
    assert asked.reason.endswith(f"expert_backend=grouped_fp8, as asked: {rowwise.describe()}")


def test_unmeasured_experts_are_planned_on_the_recipes_first_path_and_say_so():
    assert measured(100, "mxfp8", "te", W13) is None
    d = expert_decision("mxfp8", arch=100)
    assert (d.backend, d.recipe) == ("te", "mxfp8")
    assert "expert_backend=auto: te/mxfp8 experts are unmeasured on sm100, so planned untimed" in d.reason
    asked = expert_decision("blockwise", arch=100, expert_backend="grouped_fp8")
    assert asked.reason.endswith("expert_backend=grouped_fp8, as asked: unmeasured on sm100")


# --- DeepGEMM absent ------------------------------------------------------------------------------------------

@pytest.fixture
def no_deep_gemm(monkeypatch):
    """`import deep_gemm` fails, as on a machine where it is not installed."""
    monkeypatch.setitem(sys.modules, "deep_gemm", None)


def test_deepgemm_absence_is_a_reason_never_an_import_error(no_deep_gemm):
    library, why = deepgemm.load()
    assert library is None and why.startswith("deep_gemm is not importable (ModuleNotFoundError: ")
    assert "launch/build_deepgemm.sh (make deepgemm" in why
    with pytest.raises(BackendUnavailable, match="deep_gemm is not importable"):
        deepgemm.DeepGemmKernels()
    with pytest.raises(BackendUnavailable, match="blockwise_gemms=deepgemm: deep_gemm is not importable"):
        te_deepgemm.load_library()


def test_grouped_experts_without_deepgemm_say_why_in_their_notes(no_deep_gemm):
    torch.manual_seed(0)
    model = Llama(load_model_config("tiny-moe"))
    plan = make_plan(load_description("tiny-moe"), PolicyConfig(recipe="blockwise", expert_backend="grouped_fp8"))
    _, record = GroupedFP8Backend(kernels="auto").convert(model, list(plan.for_backend("grouped_fp8")), plan)
    assert any(note.startswith("blockwise expert GEMMs run on torch") for note in record.notes)
    assert any(note.startswith("not on DeepGEMM: deep_gemm is not importable") for note in record.notes)


# --- the pinned source archive --------------------------------------------------------------------------------

def test_the_build_refuses_an_archive_that_is_not_the_pinned_one(tmp_path):
    fake, target = tmp_path / "deepinfer_gemm-2.8.2.tar.gz", tmp_path / "site"
    fake.write_bytes(b"not DeepGEMM's sources")
    done = subprocess.run(["bash", str(REPO / "launch/build_deepgemm.sh"), str(fake), str(target)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "not deepinfer-gemm 2.8.2's pinned " in done.stderr, done.stderr
    assert not target.exists()


# --- the JIT cache folder -------------------------------------------------------------------------------------

def test_the_jit_cache_folder_reaches_the_environment_before_deepgemm_is_imported(monkeypatch, tmp_path):
    monkeypatch.setenv(deepgemm.JIT_CACHE_ENV, "unchanged")  # restored after the test
    folder = tmp_path / "cache" / "deep_gemm"
    resolve_job(from_overrides({"model.name": "tiny", "training.device": "cpu",
                                "deepgemm.jit_cache_dir": str(folder)}))
    assert os.environ[deepgemm.JIT_CACHE_ENV] == str(folder) and folder.is_dir()
    assert "deep_gemm" not in sys.modules


def test_the_jit_cache_folder_is_not_changed_under_an_imported_deepgemm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deep_gemm", object())
    monkeypatch.setenv(deepgemm.JIT_CACHE_ENV, str(tmp_path / "first"))
    with pytest.raises(RuntimeError, match="deep_gemm was imported before fp8stack could set DG_JIT_CACHE_DIR="):
        deepgemm.use_jit_cache_dir(str(tmp_path / "second"))
    deepgemm.use_jit_cache_dir(str(tmp_path / "first"))  # the folder it has: nothing to change


@pytest.mark.parametrize("value, message", [
    ("{tmp}/a-file", "deepgemm.jit_cache_dir '{tmp}/a-file' is a file, not a folder: pass a folder path"),
    ("{tmp}/a-file/cache", "{tmp}/a-file is not a folder this user can write in: pass a writable folder"),
    ("", "deepgemm.jit_cache_dir must be a folder path, got '': pass a folder, or leave it unset"),
])
def test_a_bad_jit_cache_folder_is_refused_in_one_line(tmp_path, capsys, value, message):
    (tmp_path / "a-file").write_text("not a folder\n")
    code = train_main(["--device", "cpu", "--no-progress", "--deepgemm.jit-cache-dir", value.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message.format(tmp=tmp_path) in err, err
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        from_overrides({"deepgemm.jit_cache_dir": str(tmp_path / "a-file")})
