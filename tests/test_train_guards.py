"""The trainer's guards on a CPU: a non-finite step stops before the optimizer step with the batch pinned and the
layer named; FP8 statistics go to TensorBoard; SIGTERM/SIGINT end a run with a checkpoint it resumes from exactly;
a resumed run's logs hold each step once."""

import json
import signal
import time

import pytest
import torch

from fp8stack import assembly
from fp8stack.runtime.numerics import E4M3_MAX, load_pin
from fp8stack.train.command import main as train_main
from fp8stack.config import from_overrides
from fp8stack.train.data import TextData
from fp8stack.train.loop import train

SMALL_DATA = 1 << 20
FAST = {"training.micro_batch": 2, "training.seq_len": 64, "training.eval_batches": 0, "data.max_bytes": SMALL_DATA,
        "logging.progress": False, "optimizer.warmup": 1}
FAST_FLAGS = ["--device", "cpu", "--no-progress", "--micro-batch-size", "2", "--seq-length", "64",
              "--max-data-bytes", str(SMALL_DATA), "--eval-iters", "0", "--lr-warmup-iters", "1"]


def _hook_after_assembly(monkeypatch, fqn: str, hook) -> None:
    """Every model the trainer assembles gets `hook` as a forward hook on its module `fqn`."""
    assemble = assembly.assemble

    def assemble_and_hook(model, *args, **kwargs):
        model = assemble(model, *args, **kwargs)
        model.get_submodule(fqn).register_forward_hook(hook)
        return model

    monkeypatch.setattr(assembly, "assemble", assemble_and_hook)


def _scalars(folder, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return events.Scalars(tag)


def test_a_nan_in_one_layer_stops_before_the_optimizer_step_with_the_batch_pinned_and_the_layer_named(
        tmp_path, monkeypatch, capsys):
    forwards = []

    def nan_from_the_second_step(_module, _args, out):
        forwards.append(1)
        return out * float("nan") if len(forwards) > 1 else out

    _hook_after_assembly(monkeypatch, "layers.2.feed_forward.w2", nan_from_the_second_step)
    log = tmp_path / "log"
    code = train_main([*FAST_FLAGS, "--fp8-recipe", "tensorwise", "--train-iters", "4", "--tensorboard-dir", str(log),
                       "--save", str(tmp_path / "ckpt"), "--save-interval", "1"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "step 1: loss nan" in err and "the optimizer step was not taken" in err
    assert "the first layer with a non-finite output is layers.2.feed_forward.w2" in err
    pin = load_pin(log / "nonfinite-step1.pt")
    assert f"pinned in {log / 'nonfinite-step1.pt'}" in err
    assert pin["step"] == 1
    assert torch.equal(pin["batch"]["tokens"], TextData(64, 2, 0, max_bytes=SMALL_DATA).batch(1)[0])
    assert [json.loads(line)["step"] for line in (log / "train.jsonl").read_text().splitlines()] == [0]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000001"], "no checkpoint after the NaN step"


@pytest.mark.parametrize("interval, logged", [(1, [0, 1, 2, 3]), (2, [1, 3])])
def test_fp8_statistics_reach_tensorboard_every_interval(tmp_path, interval, logged):
    train(from_overrides({"precision.recipe": "tensorwise", "training.steps": 4, "logging.dir": str(tmp_path),
                          "logging.fp8_stats_interval": interval, **FAST}))
    amax = _scalars(tmp_path, "fp8/layers.0.attention.wqkv/amax/weight")
    scale = _scalars(tmp_path, "fp8/layers.0.attention.wqkv/scale/weight")
    assert [e.step for e in amax] == [e.step for e in scale] == logged
    assert all(s.value == pytest.approx(E4M3_MAX / a.value, rel=1e-5) and a.value > 0 for a, s in zip(amax, scale))
    assert [e.step for e in _scalars(tmp_path, "fp8/layers.3.feed_forward.w2/underflow_count/input")] == logged


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_ends_the_run_with_a_checkpoint_it_resumes_from_exactly(tmp_path, monkeypatch, capsys, stop):
    flags = [*FAST_FLAGS, "--fp8-recipe", "tensorwise", "--train-iters", "4", "--save", str(tmp_path / "ckpt"),
             "--tensorboard-dir", str(tmp_path / "log")]
    uninterrupted = train(from_overrides({"precision.recipe": "tensorwise", "training.steps": 4, **FAST}))
    forwards = []

    def signal_in_the_second_step(_module, _args, _out):
        forwards.append(1)
        if len(forwards) == 2:
            signal.raise_signal(stop)

    handler = signal.getsignal(stop)
    with monkeypatch.context() as patch:
        _hook_after_assembly(patch, "layers.0.attention", signal_in_the_second_step)
        code = train_main([*flags, "--result-json", str(tmp_path / "stopped.json")])
    err = capsys.readouterr().err
    assert code == 128 + stop and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"stopped by {stop.name} after step 2 of 4: checkpoint {tmp_path / 'ckpt' / 'step-00000002'} saved" in err
    assert signal.getsignal(stop) is handler, "the run gives the signal back"
    stopped = json.loads((tmp_path / "stopped.json").read_text())  # the steps taken, marked stopped
    assert stopped["stopped_after"] == 2 and stopped["losses"] == uninterrupted.losses[:2]
    assert stopped["tokens_per_s"] > 0 and stopped["val_loss"] is None and uninterrupted.stopped_after is None
    assert train_main([*flags, "--load", "latest", "--result-json", str(tmp_path / "resumed.json")]) == 0
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["first_step"] == 2 and resumed["losses"] == uninterrupted.losses[2:]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    settings = {"precision.recipe": "tensorwise", "training.steps": 4, "logging.dir": str(tmp_path / "log"),
                "checkpoint.dir": str(tmp_path / "ckpt"), **FAST}
    train(from_overrides({**settings, "checkpoint.interval": 2}))
    # TensorBoard reads event files in name order: <seconds>.<host>.<pid>.<writer count>; one process writing both
    # in one second can name the second file first (writer 10 before writer 9), where a resumed process is later
    time.sleep(1.1)
    resumed = train(from_overrides({**settings, "checkpoint.resume": str(tmp_path / "ckpt" / "step-00000002")}))
    records = [json.loads(line) for line in (tmp_path / "log" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["loss"] for r in records[2:]] == resumed.losses
    assert [e.step for e in _scalars(tmp_path / "log", "train/loss")] == [0, 1, 2, 3]
