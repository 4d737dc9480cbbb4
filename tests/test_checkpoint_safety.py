"""Checkpoints that cannot run code: every file a resume reads, swapped for a pickle whose loading would write a
marker file, is refused as damaged (or, where the loader never reads it, ignored) and the marker never appears;
damaged files are named as damage, not as a model mismatch; a resume under other settings is refused by name."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8stack.runtime.numerics import load_pin, pin_step, rng_states
from fp8stack.train import checkpoint
from fp8stack.train.command import main as train_main
from fp8stack.train.checkpoint import CheckpointDamagedError, CheckpointMismatchError

CKPT_RUN = ["--device", "cpu", "--no-progress", "--fp8-recipe", "tensorwise", "--micro-batch-size", "2",
            "--seq-length", "64", "--max-data-bytes", str(1 << 20), "--eval-iters", "0", "--train-iters", "2",
            "--lr-warmup-iters", "1"]
"""A two-step tiny run that leaves a checkpoint after its last step."""


class Payload:
    """Unpickling this writes `marker`: what a swapped checkpoint file would do to a loader that unpickles it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "the payload ran")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint folder (--save) holding step 2 of CKPT_RUN."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    assert train_main([*CKPT_RUN, "--save", str(folder)]) == 0
    return folder


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of `saved` to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _resume(ckpt: Path, capsys, *flags: str) -> tuple[int, str]:
    code = train_main([*CKPT_RUN, "--train-iters", "3", "--save", str(ckpt), "--load", "latest", *flags])
    return code, capsys.readouterr().err


def _step_folder(ckpt: Path) -> Path:
    return checkpoint.latest(ckpt)


@pytest.mark.parametrize("name", ["metadata.json", "run.json", "rank0.pt", "__0_0.distcp"])
def test_a_payload_in_any_file_the_loader_reads_is_refused_and_never_runs(ckpt, tmp_path, capsys, name):
    marker = tmp_path / "marker"
    target = _step_folder(ckpt) / name
    size = target.stat().st_size
    planted = pickle.dumps(Payload(marker)) if name != "rank0.pt" else None
    if planted is None:  # torch.save's own format, with the payload where the step count belongs
        torch.save({"step": Payload(marker), "data_position": 2}, target)
    else:  # padded to the size the metadata expects, so the reader gets as far as decoding it
        target.write_bytes(planted + bytes(max(0, size - len(planted))))
    code, err = _resume(ckpt, capsys)
    assert not marker.exists(), "the loader unpickled the planted file"
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "is damaged" in err and name in err, err
    assert "does not fit this model" not in err


def test_a_payload_where_dcp_keeps_its_pickled_metadata_is_never_read(ckpt, tmp_path, capsys):
    """DCP's own `.metadata` (a pickle) is not what these checkpoints are read from: planted there, it is ignored."""
    marker = tmp_path / "marker"
    (_step_folder(ckpt) / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    code, err = _resume(ckpt, capsys)
    assert (code, err, marker.exists()) == (0, "", False)


def test_a_pinned_step_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker"
    pin = pin_step(tmp_path, 3, {"tokens": torch.arange(4)}, rng_states(), loss=torch.tensor(float("nan")))
    assert load_pin(pin)["step"] == 3 and torch.equal(load_pin(pin)["batch"]["tokens"], torch.arange(4))
    torch.save({"step": 3, "batch": Payload(marker), "rng": {}}, pin)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_pin(pin)
    assert not marker.exists()


@pytest.mark.parametrize("name, damage, named", [
    ("rank0.pt", lambda b: b[: len(b) // 2], "rank0.pt is damaged"),
    ("rank0.pt", lambda b: b"", "rank0.pt is damaged"),
    ("rank0.pt", lambda b: bytes(range(256)) * 8, "rank0.pt is damaged"),
    ("metadata.json", lambda b: b[: len(b) // 2], "metadata.json does not decode"),
    ("metadata.json", lambda b: b"", "metadata.json does not decode"),
    ("metadata.json", lambda b: json.dumps({"format": "fp8stack-dcp-json/1"}).encode(), "metadata.json does not"),
    ("metadata.json", lambda b: b.replace(b'"__0_0.distcp"', b'"../../etc/passwd"'), "not a file name in the"),
    ("__0_0.distcp", lambda b: b[: len(b) // 2], "__0_0.distcp is"),
    ("__0_0.distcp", lambda b: b"", "__0_0.distcp is 0 bytes"),
    ("__0_0.distcp", lambda b: bytes(reversed(b)), "__0_0.distcp does not decode"),
    ("run.json", lambda b: b"{", "run.json does not decode"),
    ("run.json", lambda b: b"[1, 2]", "run.json holds a list"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_damaged_files_are_reported_as_damage_in_one_line(ckpt, capsys, name, damage, named):
    target = _step_folder(ckpt) / name
    target.write_bytes(damage(target.read_bytes()))
    code, err = _resume(ckpt, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fp8stack train: error: ") and named in err and "damaged" in err, err


def test_a_checkpoint_with_only_dcps_pickled_metadata_is_named_as_older(ckpt, capsys):
    folder = _step_folder(ckpt)
    (folder / "metadata.json").rename(folder / ".metadata")
    code, err = _resume(ckpt, capsys)
    assert code == 2 and "written by an older fp8stack whose metadata is a pickle" in err


@pytest.mark.parametrize("flags, change", [
    (["--fp8-recipe", "rowwise"], 'precision.recipe: "tensorwise" -> "rowwise"'),
    (["--micro-batch-size", "4"], "training.micro_batch: 2 -> 4"),
    (["--global-batch-size", "4"], "training.global_batch: null -> 4"),
    (["--seq-length", "32"], "seq_len: 64 -> 32"),
    (["--seed", "1"], "training.seed: 0 -> 1"),
    (["--first-last-layers-bf16"], "plan ("),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_a_resume_under_other_settings_is_refused_naming_them(ckpt, capsys, flags, change):
    code, err = _resume(ckpt, capsys, *flags)
    assert code == 2 and err.count("\n") == 1, err
    assert "was saved under other settings" in err and change in err and "--resume-despite-changes" in err, err


def test_resume_despite_changes_continues_under_the_new_settings(ckpt, capsys):
    code, err = _resume(ckpt, capsys, "--micro-batch-size", "4", "--resume-despite-changes")
    assert (code, err) == (0, "")


def test_the_api_names_damage_and_mismatch_by_type(tmp_path):
    def parts(model):
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    path = checkpoint.save(tmp_path, 1, *parts(nn.Linear(4, 4)), data_position=1, run={"precision.recipe": "bf16"})
    with pytest.raises(CheckpointMismatchError, match=r"precision\.recipe: \"bf16\" -> \"tensorwise\""):
        checkpoint.load(path, *parts(nn.Linear(4, 4)), run={"precision.recipe": "tensorwise"})
    (path / "rank0.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointDamagedError, match="rank0.pt is damaged"):
        checkpoint.load(path, *parts(nn.Linear(4, 4)))


def test_a_checkpoint_takes_what_the_space_check_expects(saved):
    """The preflight's estimate of a checkpoint (FP32 weights and Adam moments) against the bytes CKPT_RUN's wrote:
    close enough to refuse a disk that cannot hold one."""
    from fp8stack.config import from_dict
    from fp8stack.train.model import model_shape
    from fp8stack.train.preflight import checkpoint_bytes

    written = sum(f.stat().st_size for f in checkpoint.latest(saved).rglob("*") if f.is_file())
    cfg = from_dict({"model": {"name": "tiny"}})
    expected = checkpoint_bytes(cfg, model_shape(cfg))
    assert 0.9 < written / expected < 1.1, (written, expected)


def test_a_save_folder_on_a_disk_without_room_for_a_checkpoint_is_refused_before_any_step(tmp_path, capsys,
                                                                                         monkeypatch):
    """Without room for one checkpoint the run would lose its steps at the first save: one line, exit 2, no folder."""
    import fp8stack.train.preflight as preflight

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1024,
                                                                                               1024))
    assert train_main([*CKPT_RUN, "--save", str(tmp_path / "ckpt")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "0.0 GiB free on its disk, and a checkpoint of tiny take about" in error, error
    assert "free space there or pass a folder on a larger disk" in error and not (tmp_path / "ckpt").exists()


def test_keep_latest_removes_the_older_checkpoints_after_each_save(tmp_path):
    """--checkpoint.keep-latest 2 with a save every step: after four steps only steps 3 and 4 are left, each whole
    (the older removed only once a newer was written); 0, the default, keeps every one (the `saved` fixture)."""
    folder = tmp_path / "ckpt"
    assert train_main([*CKPT_RUN, "--train-iters", "4", "--save", str(folder), "--save-interval", "1",
                       "--checkpoint.keep-latest", "2"]) == 0
    assert list(checkpoint.saved_steps(folder)) == [3, 4] and sorted(p.name for p in folder.iterdir()) == [
        "step-00000003", "step-00000004"]
    checkpoint.check_files(checkpoint.latest(folder))
