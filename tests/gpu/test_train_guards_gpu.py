"""The trainer's guards with TransformerEngine on a GPU: a NaN injected into one TE layer's output stops training
before the optimizer step with the batch pinned and that layer named; TE layers' FP8 statistics reach the
TensorBoard event files; a delayed-scaling checkpoint (TE pickles its scaling state) is refused unless trusted,
a payload planted in that state never runs, and a stateless recipe's checkpoint resumes without trust.
Run with `pytest -m gpu tests/gpu/test_train_guards_gpu.py`."""

import pickle
from pathlib import Path

import pytest
import torch

from fp8stack import assembly
from fp8stack.runtime.numerics import NonFiniteLossError, load_pin
from fp8stack.train import checkpoint
from fp8stack.train.command import main as train_main
from fp8stack.train.checkpoint import UntrustedCheckpointError
from fp8stack.config import JobConfig, from_overrides
from fp8stack.train.data import TextData
from fp8stack.train.loop import train

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])

from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

SETTINGS = {"model.name": "tiny", "precision.recipe": "delayed", "precision.backend": "te", "precision.small_gemm_filter": "off", "training.device": "cuda", "training.steps": 4, "optimizer.warmup": 1, "training.micro_batch": 2, "training.seq_len": 128, "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False,
            # the levers a GPU run resolves to by default, off: each test turns on what it tests
            "training.compile": False, "training.param_dtype": "fp32", "training.sdpa_backend": "auto",
            "te.gradient_accumulation_fusion": False, "precision.fuse_norm": False, "precision.fuse_mlp": False}
"""Every GEMM of the tiny model on TE delayed scaling (as tests/gpu/test_train_gpu.py)."""
PRIMING = from_overrides({}).te.priming_passes
"""Forwards a delayed-scaling run takes before its first step."""


class Payload:
    """Unpickling this writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "the payload ran")


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def test_a_nan_in_one_te_layer_stops_training_with_the_batch_pinned_and_the_layer_named(tmp_path, monkeypatch):
    forwards = []

    def nan_from_the_second_step(_module, _args, out):
        forwards.append(1)
        return out * float("nan") if len(forwards) > PRIMING + 1 else out

    assemble = assembly.assemble

    def assemble_and_hook(model, *args, **kwargs):
        model = assemble(model, *args, **kwargs)
        model.get_submodule("layers.1.feed_forward.w2").register_forward_hook(nan_from_the_second_step)
        return model

    monkeypatch.setattr(assembly, "assemble", assemble_and_hook)
    log = tmp_path / "log"
    with pytest.raises(NonFiniteLossError) as stopped:
        train(from_overrides({**SETTINGS, "logging.dir": str(log)}))
    message = str(stopped.value)
    assert "step 1: loss nan" in message and "the optimizer step was not taken" in message, message
    assert "the first layer with a non-finite output is layers.1.feed_forward.w2" in message, message
    pin = load_pin(log / "nonfinite-step1.pt")
    assert pin["step"] == 1
    assert torch.equal(pin["batch"]["tokens"], TextData(128, 2, 0, max_bytes=1 << 20).batch(1)[0])
    assert (log / "train.jsonl").read_text().count("\n") == 1, "only step 0 was logged"


def test_fp8_statistics_of_te_layers_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(from_overrides({**SETTINGS, "logging.dir": str(tmp_path), "logging.fp8_stats_interval": 2}))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    amax = events.Scalars("fp8/layers.0.attention.wqkv/amax/weight")
    assert [e.step for e in amax] == [1, 3] and all(e.value > 0 for e in amax)
    assert [e.step for e in events.Scalars("fp8/layers.0.attention.wqkv/underflow_count/input")] == [1, 3]
    te_scales = events.Scalars("fp8/layers.0.attention.wqkv/te_scale/0")  # TE's own delayed-scaling scale
    assert [e.step for e in te_scales] == [1, 3] and all(e.value != 1.0 for e in te_scales)


def test_an_untrusted_delayed_scaling_checkpoint_is_refused_and_its_payload_never_runs(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    train(from_overrides({**{**SETTINGS, "training.steps": 2}, "checkpoint.dir": str(folder)}))
    FP8GlobalStateManager.reset()
    resume = from_overrides({**SETTINGS, "checkpoint.dir": str(folder), "checkpoint.resume": "latest"})
    with pytest.raises(UntrustedCheckpointError, match="TE reads by unpickling, which can run code: pass "
                                                       "--trust-checkpoint"):
        train(resume)
    FP8GlobalStateManager.reset()
    flags = ["--model", "tiny", "--fp8-recipe", "delayed", "--backend", "te", "--small-gemm-filter", "off",
             "--device", "cuda", "--train-iters", "4", "--lr-warmup-iters", "1", "--micro-batch-size", "2",
             "--seq-length", "128", "--eval-iters", "0", "--max-data-bytes", str(1 << 20), "--no-progress",
             "--save", str(folder), "--load", "latest"]
    assert train_main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trust-checkpoint" in err and "Traceback" not in err, err

    marker = tmp_path / "marker"
    rank_file = checkpoint.latest(folder) / "rank0.pt"
    saved = torch.load(rank_file, weights_only=True)
    key = next(key for key, value in saved["extra_state"].items() if value.numel())
    saved["extra_state"][key] = torch.frombuffer(bytearray(pickle.dumps(Payload(marker))), dtype=torch.uint8)
    torch.save(saved, rank_file)
    FP8GlobalStateManager.reset()
    with pytest.raises(UntrustedCheckpointError):
        train(resume)
    assert not marker.exists(), "TE unpickled the planted extra state without trust"


def test_a_stateless_recipe_checkpoint_resumes_bit_identically_without_trust(tmp_path):
    """TE's tensorwise (current scaling) modules keep no scaling state: TE ignores their pickled extra state, and
    the resume needs no trust."""
    settings = {**SETTINGS, "precision.recipe": "tensorwise"}
    full = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": 2}))
    FP8GlobalStateManager.reset()
    resumed = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.resume": str(checkpoint.checkpoint_path(tmp_path, 2))}))
    assert resumed.first_step == 2 and resumed.losses == full.losses[2:]
