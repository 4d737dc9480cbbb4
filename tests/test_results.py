"""profiles/INDEX.md and RESULTS.md are generated from the evidence JSONs (fp8stack.bench.results) and committed
current; a page rendered on a CPU from GPU evidence names the GPU."""

import json
import subprocess
import sys
from pathlib import Path

import fp8stack.bench.results as results
from fp8stack.bench.results import PROFILES, README_END, README_START, main, pages

GPU = "NVIDIA H100 80GB HBM3"


def test_committed_pages_match_the_evidence():
    result = subprocess.run([sys.executable, "-m", "fp8stack.bench.results", "--check"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def _run(profiles: Path, area: str, folder: str, name: str, record: dict) -> None:
    (profiles / area / folder).mkdir(parents=True)
    (profiles / area / folder / name).write_text(json.dumps(record))


def _ab(tokens_per_s: float, date: str) -> dict:
    arms = [{"recipe": "bf16", "backend": "bf16", "tokens_per_s": 100.0, "peak_mem_gib": 10.0, "rel_loss_gap": 0.0,
             "verdict": "baseline"},
            {"recipe": "delayed", "backend": "te", "tokens_per_s": tokens_per_s, "peak_mem_gib": 9.0,
             "rel_loss_gap": 0.001, "verdict": "ship"}]
    return {"date": date, "commit": "abc1234", "environment": {"device": GPU}, "model": "tiny", "steps": 30,
            "train_config": {"model_impl": "torch", "global_batch": 16, "micro_batch": 2}, "arms": arms}


def _profiles(tmp_path: Path) -> Path:
    """An evidence folder: an A/B on a GPU, a later one that superseded it, and targets read on a CPU."""
    profiles = tmp_path / "profiles"
    _run(profiles, "archive", "2026-01-01-ab-first", "ab-tiny-h100.json", _ab(120.0, "2026-01-01T00:00:00+00:00"))
    _run(profiles, "runs", "2026-01-02-ab-again", "ab-tiny-h100.json", _ab(137.5, "2026-01-02T00:00:00+00:00"))
    row = {"target": "speed", "limit": 1.45, "at_least": True, "value": 1.375, "status": "not met",
           "file": "ab-tiny-h100.json", "arm": "delayed"}
    _run(profiles, "runs", "2026-01-03-targets", "targets-tiny-h100.json",
         {"date": "2026-01-03T00:00:00+00:00", "environment": {"device": "cpu"}, "rows": [row],
          "sources": ["profiles/ab-tiny-h100.json"]})
    return profiles


def test_pages_read_every_figure_from_the_evidence_and_name_the_gpu(tmp_path):
    profiles = _profiles(tmp_path)
    generated = pages(profiles)
    index, results = generated[profiles / "INDEX.md"], generated[profiles / "RESULTS.md"]
    assert "## Current runs (2)" in index and "## Superseded runs (1)" in index
    assert "[2026-01-01-ab-first](archive/2026-01-01-ab-first/)" in index and "`abc1234`" in index
    assert "cpu" not in results and f"## Targets on {GPU}" in results  # rendered on a CPU, measured on the GPU
    assert "| speed | ≥ 1.450x | 1.375x | not met | delayed | [2026-01-02-ab-again](runs/2026-01-02-ab-again/) |" in results
    assert "| delayed | te | 138 | 1.375x | 9.00 | +0.10% | ship |" in results  # the newer run's figures
    assert "120" not in results  # the superseded run is indexed, not a headline


def test_the_index_describes_an_expert_parallel_run(tmp_path):
    profiles = _profiles(tmp_path)
    _run(profiles, "runs", "2026-01-04-expert-parallel-h100", "expert-parallel-h100.json",
         {"date": "2026-01-04T00:00:00+00:00", "environment": {"device": GPU}, "model": "deepseek-moe-small",
          "recipes": ["bf16", "blockwise"], "passed": True})
    index = pages(profiles)[profiles / "INDEX.md"]
    assert "deepseek-moe-small with its experts split over 2 GPUs vs all on 1 (bf16, blockwise): all checks passed" \
        in index


def _band(date: str, clip: float, finals: list[float], gate: str | None) -> dict:
    """A loss band's record: its BF16 band at 1.0 and one FP8 run per final loss, judged `gate` (None: a band
    written before the gate)."""
    setting = {"model": "tiny", "steps": 2000, "global_batch": 4, "seq_len": 1024, "max_data_bytes": 2**27,
               "data_source": "python", "lr": 1e-4, "grad_clip": clip, "seed": 0, "device": GPU}
    runs = [{"file": f"profiles/runs/x/ab-tiny-gate-{i}-h100.json", "run": f"delayed {i}", "final_loss": final,
             "gap_to_mean": final - 1.0, "gate": gate, "fp8_flop_share": 0.9} for i, final in enumerate(finals)]
    repeated = [{"run": "delayed", "final_losses": finals, "passed_runs": 1, "gap_to_mean": 0.003, "gate": "fail"}]
    return {"date": date, "environment": {"device": "cpu"}, "settings": setting, "sources": [],
            "bf16_band": {"runs": 3, "mean": 1.0}, "gate_limit": 1.0025, "fp8_runs": runs,
            "repeated_plans": repeated if len(finals) > 1 else []}


def test_the_loss_gates_show_the_newest_judged_band_of_each_setting(tmp_path):
    """One table per setting (here clip 1 and clip 0), from its newest band; bands written before the gate judged
    their runs are left out."""
    profiles = _profiles(tmp_path)
    for folder, record in (("2026-01-04-loss-band-a", _band("2026-01-04", 1.0, [1.01], "fail")),
                           ("2026-01-05-loss-band-b", _band("2026-01-05", 1.0, [1.01, 0.99], "pass")),
                           ("2026-01-06-loss-band-c", _band("2026-01-06", 0.0, [0.98], "pass")),
                           ("2026-01-07-loss-band-d", _band("2026-01-07", 0.5, [1.5], None))):
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", record)
    page = pages(profiles)[profiles / "RESULTS.md"]
    gates = page.split("## Loss gates")[1].split("## A/B verdicts")[0]
    assert gates.count("### tiny: 2000 steps of 4 x 1024 tokens (128 MiB of python text)") == 2
    assert f"LR 0.0001, clip 1, seed 0, on {GPU}" in gates and "clip 0," in gates and "clip 0.5" not in gates
    assert "loss-band-a" not in gates and "[2026-01-05-loss-band-b](runs/2026-01-05-loss-band-b/)" in gates
    assert "| ab-tiny-gate-1-h100 | delayed 1 | 90% | 0.9900 | -1.00% | pass |" in gates
    assert "the gate passes up to 1.0025" in gates
    assert gates.count("Plans run more than once") == 1 and "| delayed | 1 of 2 | +0.30% | fail |" in gates


def test_of_one_days_bands_the_last_written_is_the_newest(tmp_path):
    """Runs of one day are named by their label: 'gate-b' written after 'gate-m' is still the newer band."""
    profiles = _profiles(tmp_path)
    for folder, written, final in (("2026-01-04-loss-band-gate-m", "2026-01-04T06:00:00+00:00", 1.01),
                                   ("2026-01-04-loss-band-gate-b", "2026-01-04T07:00:00+00:00", 1.02)):
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", _band(written, 1.0, [final], "fail"))
    gates = pages(profiles)[profiles / "RESULTS.md"].split("## Loss gates")[1]
    assert "loss-band-gate-b" in gates and "loss-band-gate-m" not in gates


def _own_model(date: str, judged: list[bool | None], commit: str = "abc1234", ratio: float = 1.0) -> dict:
    """An own-model run's record: one arm, and one target per entry, judged met/not met or not measured (None)."""
    targets = [{"arm": f"own {i}", "against": "trainer", "ratio": ratio if met is not None else None, "target": 0.95,
                "met": met} for i, met in enumerate(judged)]
    return {"date": date, "commit": commit, "environment": {"device": GPU},
            "arms": [{"arm": "own", "tokens_per_s": 1.0}], "targets": targets}


def test_the_own_model_headline_is_the_newest_run_judging_the_most_targets(tmp_path):
    """A later run that measured fewer of the targets (a memory probe) does not replace the headline."""
    profiles = _profiles(tmp_path)
    for folder, written, judged in (("2026-01-04-own-model-r1", "2026-01-04T01:00:00+00:00", [True, False]),
                                    ("2026-01-04-own-model-r2", "2026-01-04T02:00:00+00:00", [True, True]),
                                    ("2026-01-05-own-model-memory", "2026-01-05T00:00:00+00:00", [True, None])):
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", _own_model(written, judged))
    own = pages(profiles)[profiles / "RESULTS.md"].split("## Own model")[1]
    assert "own-model-r2" in own and "own-model-r1" not in own and "own-model-memory" not in own


def test_the_own_model_section_reads_each_target_over_every_run_at_the_headlines_commit(tmp_path):
    """The headline met a target that another run at its commit missed: both ratios are shown; a run at another
    commit is not counted, and a target measured once gets no row."""
    profiles = _profiles(tmp_path)
    for folder, written, judged, commit, ratio in (
            ("2026-01-04-own-model-r1", "2026-01-04T01:00:00+00:00", [True, None], "abc1234", 0.96),
            ("2026-01-04-own-model-r2", "2026-01-04T02:00:00+00:00", [False, None], "abc1234", 0.94),
            ("2026-01-04-own-model-r3", "2026-01-04T03:00:00+00:00", [True, True], "abc1234", 0.97),
            ("2026-01-04-own-model-r4", "2026-01-04T00:00:00+00:00", [True, True], "def5678", 0.99)):
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", _own_model(written, judged, commit, ratio))
    own = pages(profiles)[profiles / "RESULTS.md"].split("## Own model")[1]
    assert "own-model-r3" in own and "The same targets over every run at commit `abc1234`:" in own
    assert "| own 0 | trainer | 3 | 0.940x | 0.957x | 0.970x | 2 of 3 |" in own
    assert "| own 1 |" not in own.split("The same targets")[1]


def _moe_ab(date: str, loss_verdict: str) -> dict:
    """An A/B of an MoE model: arms with routing statistics, its FP8 arm's loss judged or not."""
    record = _ab(135.0, date)
    record["arms"] = [{**arm, "router_imbalance": 1.4, "loss_verdict": "-" if arm["verdict"] == "baseline" else
                       loss_verdict} for arm in record["arms"]]
    return record


def test_the_newest_speed_a_b_of_an_moe_model_is_a_headline_and_a_loss_gate_is_not(tmp_path):
    """An MoE A/B whose FP8 loss was not judged (a speed run) is shown, the newest per device; a later 2000-step
    gate of an MoE model (its loss judged) is a loss band's, not this section's."""
    profiles = _profiles(tmp_path)
    for folder, date, loss in (("2026-01-04-ab-moe-old", "2026-01-04T00:00:00+00:00", "not judged"),
                               ("2026-01-05-ab-moe-speed", "2026-01-05T00:00:00+00:00", "not judged"),
                               ("2026-01-06-ab-moe-gate", "2026-01-06T00:00:00+00:00", "above")):
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", _moe_ab(date, loss))
    verdicts = pages(profiles)[profiles / "RESULTS.md"].split("## A/B verdicts")[1]
    assert "ab-moe-speed" in verdicts and "ab-moe-old" not in verdicts and "ab-moe-gate" not in verdicts


def test_an_moe_speed_a_b_of_another_fp8_plan_stands_beside_the_newest_not_in_its_place(tmp_path):
    """A later MoE speed A/B whose FP8 arm runs another recipe file (MoE-only FP8 beside the faster mix) is shown
    next to the earlier one; one of the same plan replaces it."""
    profiles = _profiles(tmp_path)
    for folder, date, source in (("2026-01-04-ab-moe-mix", "2026-01-04T00:00:00+00:00", "mix.yaml"),
                                 ("2026-01-05-ab-moe-only", "2026-01-05T00:00:00+00:00", "moe-only.yaml"),
                                 ("2026-01-06-ab-moe-only-again", "2026-01-06T00:00:00+00:00", "moe-only.yaml")):
        record = _moe_ab(date, "not judged")
        fp8 = next(arm["recipe"] for arm in record["arms"] if arm["verdict"] != "baseline")
        record["runs"] = {fp8: {"config": {"precision": {"overrides": [{"fqn": "*experts.*", "source": source}]}}}}
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", record)
    verdicts = pages(profiles)[profiles / "RESULTS.md"].split("## A/B verdicts")[1]
    assert "ab-moe-mix" in verdicts and "ab-moe-only-again" in verdicts and "FP8 arms planned with mix.yaml" in verdicts
    assert "ab-moe-only-h100" not in verdicts.replace("ab-moe-only-again", "")


def test_an_moe_speed_a_b_of_another_model_stands_beside_the_newest_of_the_same_plan(tmp_path):
    """A later speed A/B of the same recipe file on a smaller MoE model (a host-bound shape) does not take the
    larger model's place."""
    profiles = _profiles(tmp_path)
    for folder, date, model in (("2026-01-04-ab-moe-medium", "2026-01-04T00:00:00+00:00", "moe-medium"),
                                ("2026-01-05-ab-moe-small", "2026-01-05T00:00:00+00:00", "moe-small")):
        record = {**_moe_ab(date, "not judged"), "model": model}
        _run(profiles, "runs", folder, f"{folder[11:]}-h100.json", record)
    verdicts = pages(profiles)[profiles / "RESULTS.md"].split("## A/B verdicts")[1]
    assert "ab-moe-medium" in verdicts and "ab-moe-small" in verdicts


def _scaling(date: str, ratios: dict[str, float]) -> dict:
    """A scaling run's record: FP8/BF16 per wrapper beside one GPU's 1.40x."""
    return {"date": date, "environment": {"device": GPU}, "model": "tiny", "one_gpu_model": None, "nproc": 2,
            "recipe": "delayed", "targets": {"ratio_tolerance": 0.03, "all_gather_ratio": 0.55}, "runs": {},
            "figures": {"fp8_over_bf16": {"one_gpu": 1.40, **ratios},
                        "per_gpu_tokens_per_s": {f"{w}/delayed": 100.0 for w in ratios},
                        "all_gather_bytes_fp8_over_bf16_blocks": {}}}


def test_each_wrappers_newest_scaling_run_is_judged_against_its_own_one_gpu_run(tmp_path):
    """A later scaling run of one wrapper replaces that wrapper's row only; a wrapper is within the tolerance of the
    one-GPU ratio of the run it was measured in."""
    profiles = _profiles(tmp_path)
    for folder, date, ratios in (("2026-01-04-scaling-a", "2026-01-04T00:00:00+00:00", {"ddp": 1.39, "fsdp": 1.20}),
                                 ("2026-01-05-scaling-b", "2026-01-05T00:00:00+00:00", {"fsdp": 1.38})):
        _run(profiles, "runs", folder, f"scaling-tiny-{folder[-1]}-2gpu-h100.json", _scaling(date, ratios))
    scaling = pages(profiles)[profiles / "RESULTS.md"].split(f"## Scaling on several GPUs, {GPU}")[1]
    assert "| tiny | 2 | ddp | delayed | 100 | 1.390x | 1.400x | yes | - | [2026-01-04-scaling-a]" in scaling
    assert "| tiny | 2 | fsdp | delayed | 100 | 1.380x | 1.400x | yes | - | [2026-01-05-scaling-b]" in scaling
    assert "1.200x" not in scaling


def test_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path, capsys):
    profiles = _profiles(tmp_path)
    assert main(["--profiles", str(profiles), "--check"]) == 1
    assert "INDEX.md" in capsys.readouterr().err
    assert main(["--profiles", str(profiles)]) == 0
    assert main(["--profiles", str(profiles), "--check"]) == 0
    (profiles / "RESULTS.md").write_text((profiles / "RESULTS.md").read_text().replace("1.375x", "1.500x"))
    assert main(["--profiles", str(profiles), "--check"]) == 1
    assert "RESULTS.md differ from the evidence" in capsys.readouterr().err


def test_a_folder_without_runs_is_refused(tmp_path, capsys):
    try:
        main(["--profiles", str(tmp_path)])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("a folder without runs/ was accepted")
    assert "is not a folder: pass --profiles the evidence folder" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_repository_evidence_is_laid_out_by_run():
    top = sorted(p.name for p in PROFILES.iterdir())
    assert top == ["INDEX.md", "RESULTS.md", "archive", "runs"], top
    assert not [p for p in (PROFILES / "runs").iterdir() if p.is_file()]
    for area in ("runs", "archive"):
        assert all(list(folder.glob("*.json")) for folder in (PROFILES / area).iterdir())


def test_every_run_names_the_commit_it_measured():
    nameless = [str(path.relative_to(PROFILES)) for path in sorted((PROFILES / "runs").glob("*/*.json"))
                if not _commit_of(json.loads(path.read_text()))]
    assert not nameless, f"evidence without a commit: {nameless}"


def _commit_of(record) -> str | None:
    return record.get("commit") if isinstance(record, dict) else None


def _readme(tmp_path: Path, body: str = f"# x\n\n{README_START}\nold table\n{README_END}\n\nhand-written\n") -> Path:
    (tmp_path / "README.md").write_text(body)
    return tmp_path / "README.md"


def test_the_readme_table_is_read_from_the_headline_run(tmp_path):
    profiles = _profiles(tmp_path)
    readme = _readme(tmp_path)
    text = pages(profiles, headline="2026-01-02-ab-again")[readme]
    assert text.startswith("# x\n\n") and text.endswith(f"{README_END}\n\nhand-written\n") and "old table" not in text
    assert f"Measured on one {GPU} on 2026-01-02 at commit `abc1234`" in text
    assert "| `delayed` | te | 138 | 1.375x | 9.00 |" in text
    assert "[profiles/runs/2026-01-02-ab-again/](profiles/runs/2026-01-02-ab-again/)" in text
    assert "`tiny` (" in text  # the model's shape, from its description


def test_check_fails_on_a_stale_readme_and_refuses_one_without_markers(tmp_path, monkeypatch, capsys):
    profiles = _profiles(tmp_path)
    _readme(tmp_path)
    monkeypatch.setattr(results, "HEADLINE_RUN", "2026-01-02-ab-again")
    assert main(["--profiles", str(profiles)]) == 0
    assert main(["--profiles", str(profiles), "--check"]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("1.375x", "1.400x"))
    assert main(["--profiles", str(profiles), "--check"]) == 1
    assert "README.md" in capsys.readouterr().err
    _readme(tmp_path, "# no markers\n")
    assert main(["--profiles", str(profiles)]) == 2
    assert "has no <!-- results:start -->" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"  # nothing written
    monkeypatch.setattr(results, "HEADLINE_RUN", "2026-01-09-missing")
    _readme(tmp_path)
    assert main(["--profiles", str(profiles)]) == 2
    assert "headline run 2026-01-09-missing is not an A/B folder" in capsys.readouterr().err
