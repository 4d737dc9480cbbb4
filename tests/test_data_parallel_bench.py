"""fp8stack.bench.data_parallel's figure and --plot-only on a CPU, from synthetic run records (the arms themselves
are launch/train.sh runs on a GPU: the lead runs `python -m fp8stack.bench.data_parallel` on an H200), and a run's
evidence folder holding the figure beside the JSON and the Markdown."""

import importlib.util
import json
from pathlib import Path

import pytest

from fp8stack.bench import data_parallel
from fp8stack.evidence import run_folder

STEPS = 8


def measured(step_ms: float, peak: float, drift: float = 0.0) -> dict:
    """A run record as launches.run_record keeps a finished run."""
    return {"command": f"NPROC=1 launch/train.sh --step-ms {step_ms}", "returncode": 0, "wall_s": 30.0,
            "losses": [10.0 - step + drift * step for step in range(STEPS)], "step_ms_median": step_ms,
            "step_ms_spread": 0.01, "tokens_per_s": 131072 / step_ms * 1000, "peak_mem_gib": peak, "world_size": 1,
            "device": "NVIDIA H200", "collectives": None, "first_step": 0, "plan_summary": {},
            "grad_norms": [1.0] * STEPS}


def failed() -> dict:
    """A run record of a launch that exited without its result."""
    return {"command": "NPROC=1 launch/train.sh --broken", "returncode": 1, "wall_s": 3.0,
            "log_tail": "RuntimeError: CUDA out of memory"}


def payload(arms: dict[str, dict]) -> dict:
    """The evidence record main writes, less the header write_evidence adds."""
    return {"model": "llama-1b-like", "recipe": "delayed", "steps": STEPS, "arms": arms,
            "targets": {"step_time_ratio": data_parallel.STEP_TIME_RATIO}, **data_parallel.judge(arms, STEPS)}


def write_json(folder: Path, arms: dict[str, dict]) -> Path:
    path = folder / "data-parallel-h200.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, **payload(arms)}))
    return path


ARMS = {"unwrapped": measured(500.0, 25.94), "ddp": measured(503.0, 25.94, drift=0.001),
        "fsdp": measured(573.0, 23.08, drift=-0.002), "fsdp_fp8_params": failed()}


def test_the_figure_shows_step_time_against_the_unwrapped_arm_and_the_target_and_names_a_failed_arm(tmp_path):
    pytest.importorskip("matplotlib")
    fig = data_parallel.figure(json.loads(write_json(tmp_path, ARMS).read_text()))
    speed, memory, losses, gaps = fig.axes
    assert [label.get_text() for label in speed.get_yticklabels()] == list(ARMS)
    bars = speed.containers[0]
    assert [bar.get_x() + bar.get_width() for bar in bars] == pytest.approx([1.0, 503 / 500, 573 / 500, 1.0])
    assert [bar.get_facecolor() for bar in bars][1:3] == [
        pytest.approx(matplotlib_rgba("tab:green")), pytest.approx(matplotlib_rgba("tab:red"))]
    assert sorted(line.get_xdata()[0] for line in speed.get_lines()) == [1.0, data_parallel.STEP_TIME_RATIO]
    assert "failed (exit 1)" in {text.get_text() for text in speed.texts}
    assert [bar.get_width() for bar in memory.containers[0]] == [25.94, 25.94, 23.08, 0]
    assert memory.get_lines()[0].get_xdata()[0] == 25.94
    assert [line.get_label() for line in losses.get_lines()] == ["unwrapped", "ddp", "fsdp"]
    ddp_gap = next(line for line in gaps.get_lines() if line.get_label() == "ddp")
    assert ddp_gap.get_ydata()[1] == pytest.approx(100 * (9.001 / 9 - 1))


def matplotlib_rgba(name: str) -> tuple:
    from matplotlib.colors import to_rgba

    return to_rgba(name)


def test_without_an_unwrapped_arm_the_figure_shows_step_times_with_no_target(tmp_path):
    pytest.importorskip("matplotlib")
    fig = data_parallel.figure(json.loads(write_json(tmp_path, {"ddp": ARMS["ddp"], "fsdp": ARMS["fsdp"]}).read_text()))
    speed, _, _, gaps = fig.axes
    assert [bar.get_width() for bar in speed.containers[0]] == [503.0, 573.0]
    assert not speed.get_lines() and "no target" in speed.get_title()
    assert [line.get_ydata()[0] for line in gaps.get_lines()] == [0]  # the zero line alone


def test_a_run_writes_the_figure_beside_its_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(data_parallel, "run_arms", lambda workdir, arms, steps, common: {
        name: ARMS[name] for name in arms})
    code = data_parallel.main(["--arms", "unwrapped,ddp,fsdp", "--steps", str(STEPS), "--out-dir", str(tmp_path)])
    folder = run_folder("data-parallel-cpu", tmp_path)
    assert code == 1  # fsdp's step time is beyond the target: evidence, and a failed check
    assert (folder / "data-parallel-cpu.json").is_file() and (folder / "data-parallel-cpu.md").is_file()
    png = folder / "data-parallel-cpu.png"
    assert png.is_file() == (importlib.util.find_spec("matplotlib") is not None)


def test_plot_only_draws_the_figure_of_an_existing_json_and_measures_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(data_parallel, "run_arms", lambda *a: pytest.fail("an arm ran"))
    source = write_json(tmp_path, ARMS)
    before = source.read_text()
    assert data_parallel.main(["--plot-only", str(source)]) == 0
    assert source.with_suffix(".png").read_bytes().startswith(b"\x89PNG") and source.read_text() == before
    assert capsys.readouterr().out.strip() == f"wrote {source.with_suffix('.png')}"


@pytest.mark.parametrize("case, message", [
    ("absent", "absent.json: not a file: pass the <stem>.json that python -m fp8stack.bench.data_parallel wrote"),
    ("folder", ": not a file: pass the <stem>.json"),
    ("markdown", "run.md: not a .json file: pass the <stem>.json"),
    ("broken", "broken.json: not JSON (Expecting value: line 1 column 1 (char 0)): pass the <stem>.json"),
    ("peers", "peers.json: not the evidence of python -m fp8stack.bench.data_parallel: pass the <stem>.json"),
])
def test_plot_only_refuses_what_is_not_a_data_parallel_json_with_one_line(case, message, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "run.md").write_text("# data-parallel\n")
    (tmp_path / "broken.json").write_text("")
    (tmp_path / "peers.json").write_text(json.dumps({"shape": {}, "arms": []}))
    source = {"absent": tmp_path / "absent.json", "folder": tmp_path, "markdown": tmp_path / "run.md",
              "broken": tmp_path / "broken.json", "peers": tmp_path / "peers.json"}[case]
    assert data_parallel.main(["--plot-only", str(source)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert err.startswith(f"{data_parallel.PROG}: error: --plot-only ")
    assert not list(tmp_path.glob("*.png"))


def test_plot_only_refuses_measuring_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        data_parallel.main(["--plot-only", str(write_json(tmp_path, ARMS)), "--steps", "3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{data_parallel.PROG}: error: --plot-only draws from a JSON and measures nothing: drop --steps")


def test_the_bound_arm_splits_fsdps_cost_into_what_te_gives_up_and_fsdps_own():
    """fsdp_bound is the unwrapped arm less the levers TE keeps off under fully_shard: not judged against the 3 %
    target itself, it measures each FSDP2 arm's own cost (step time over the bound's)."""
    arms = {"unwrapped": measured(500.0, 25.94), "fsdp_bound": measured(540.0, 25.0),
            "fsdp": measured(573.0, 23.08), "ddp": measured(503.0, 25.94)}
    judged = data_parallel.judge(arms, STEPS)
    assert judged["figures"]["fsdp"]["step_time_over_bound"] == pytest.approx(573 / 540)
    assert "step_time_over_bound" not in judged["figures"]["ddp"]
    assert not any(name.startswith("fsdp_bound: step time") for name in judged["checks"])
    assert judged["checks"]["fsdp: step time within 3% of unwrapped"] is False
    assert "| fsdp | 228,747 | 573.0 | 1.146x | 1.061x |" in data_parallel.render(payload(arms))


def test_the_bound_arm_turns_off_exactly_what_fully_shard_turns_off():
    from fp8stack.train.command import job_from_flags

    bound = job_from_flags(data_parallel.ARMS[data_parallel.BOUND])
    assert (bound.te.gradient_accumulation_fusion, bound.te.cache_fp8_weights) == (False, False)
