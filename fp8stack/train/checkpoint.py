"""Save and resume everything a training step depends on, so a resumed run continues bit-identically.

One folder per checkpoint, `<checkpoint_dir>/step-<N>`:
- model and optimizer tensors through torch.distributed.checkpoint (works unsharded, and sharded
  under FSDP2/TP: each rank writes its shards), its metadata as JSON (dcp_json: DCP pickles it);
- `rank<r>.pt` per rank: step, data position, LR scheduler, RNG states, and the modules' extra
  state, all tensors and plain values, read back with torch.load(weights_only=True). FP8 scaling
  state lives there: TE DelayedScaling keeps its amax history and scales in module extra_state (a
  pickled byte tensor whose size changes once FP8 has run, which DCP cannot load in place).
  torchao's dynamic tensorwise/rowwise scaling keeps no state;
- `run.json` (rank 0, when the caller passes `run`): the settings and plan the run was saved
  under, so a resume under other ones is refused by name.
A caller whose tensors are laid out otherwise passes a TensorLayout (megatron's sharded state dicts:
fp8stack.train.megatron_checkpoint): its DCP items and planners replace torch's get_state_dict, the
plain values it keeps beside them go to the rank files, and everything else is as above.
Loading unpickles nothing a user can swap: the metadata and run.json are JSON, tensors and rank
files are read weights-only. TE unpickles its own DelayedScaling state, and TE reads it only with
NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1; load() sets that variable to 1 only when the caller says
the checkpoint is trusted and to 0 otherwise, so TE refuses it (UntrustedCheckpointError).
A checkpoint is written under a temporary name and renamed when complete, so `latest()` never
picks a half-written one. Once everything is in place, load() calls fp8stack.after_checkpoint_load(model), as a
user's own loop resuming with DCP would, so that the backends rebuild what their modules keep outside the model.
"""

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fp8stack.train.dcp_json import (METADATA_FILE, JsonMetadataReader, JsonMetadataWriter, UndecodableFileError,
                                     WeightsOnlyLoadPlanner)

EXTRA_STATE_SUFFIX = nn.modules.module._EXTRA_STATE_KEY_SUFFIX
"""Key suffix of a module's get_extra_state() in its state_dict ('_extra_state')."""
PREFIX = "step-"
RUN_FILE = "run.json"
"""The settings and plan a checkpoint was saved under (save's `run`)."""
TE_TRUSTED_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
"""TE's opt-in to unpickle DelayedScaling extra state (amax histories, scales); without it TE refuses
to load them."""
TRUST_FIX = "pass --trust-checkpoint (checkpoint.load(..., trusted=True)) if you wrote this checkpoint yourself"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here; the message says what to do."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint file that is missing, truncated, corrupt, or holds what fp8stack never writes there."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another model, layout or run settings than the run resuming it."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint whose FP8 scaling state TE reads by unpickling, loaded without trusted=True."""


class TensorLayout(Protocol):
    """How a model's and optimizer's tensors go into a checkpoint and back, when not through torch's
    get_state_dict / set_state_dict."""

    module: nn.Module
    """The module whose extra states (TE's FP8 scaling state) the rank files keep."""

    def save_items(self) -> tuple[dict, dict, SavePlanner]:
        """(what DCP saves, plain values the rank file keeps beside it, the save planner)."""

    def load_items(self) -> tuple[dict, LoadPlanner, Callable[[dict], None]]:
        """(what DCP loads into, the load planner -- reading non-tensor values weights-only --, and the function
        that puts the loaded items and the rank file's plain values in place)."""


@dataclass
class Resumed:
    """Where a loaded checkpoint left off."""

    step: int
    """Optimizer steps already taken."""
    data_position: int
    """Index of the next training batch."""


def checkpoint_path(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"{PREFIX}{step:08d}"


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The completed checkpoint with the highest step under `checkpoint_dir`, or None."""
    found = saved_steps(checkpoint_dir)
    return found[max(found)] if found else None


def saved_steps(checkpoint_dir: str | Path) -> dict[int, Path]:
    """The completed checkpoints under `checkpoint_dir` by their step, in step order (none when it does not exist)."""
    folders = (p for p in Path(checkpoint_dir).glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit())
    return dict(sorted((int(p.name[len(PREFIX):]), p) for p in folders))


def keep_latest(checkpoint_dir: str | Path, count: int) -> None:
    """Remove all but the `count` newest completed checkpoints under `checkpoint_dir` (rank 0; count >= 1)."""
    if _rank() == 0:
        for path in list(saved_steps(checkpoint_dir).values())[:-count]:
            shutil.rmtree(path)


def save(checkpoint_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, data_position: int, masters: nn.Module | None = None,
         run: dict | None = None, layout: TensorLayout | None = None) -> Path:
    """Write checkpoint `step` (every rank calls this); returns its folder. masters: the FP32 master weights under
    the model's names when the model's parameters are BF16 copies of them (fp8stack.precision.MasterWeights): saved as
    the model's tensors, which they are up to rounding, and what the optimizer steps. run: JSON-serialisable settings
    a resume must share (load's `run` compares them), kept in run.json. layout: the model's and optimizer's tensors
    as it lays them out, instead of get_state_dict's."""
    final = checkpoint_path(checkpoint_dir, step)
    partial = final.with_name(final.name + ".partial")
    plain = {}
    if layout is None:
        model_state, optim_state = get_state_dict(masters or model, optimizer)
        tensors, extra = _split_extra_state({**model_state, **_extra_state(model, masters)})
        items, planner = {"model": tensors, "optimizer": optim_state, **_buffer_items(model, masters)}, None
    else:
        items, plain["layout"], planner = layout.save_items()
        extra = _split_extra_state(layout.module.state_dict())[1]
    with _single_process_quiet():
        dcp.save(items, storage_writer=JsonMetadataWriter(partial), planner=planner)
    torch.save({"step": step, "data_position": data_position, "scheduler": scheduler.state_dict(),
                "rng": _rng_state(), "extra_state": extra, **plain}, _rank_file(partial))
    if run is not None and _rank() == 0:
        (partial / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
    _barrier()
    if _rank() == 0:
        if final.exists():  # a resumed run passing the step again replaces that checkpoint
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, masters: nn.Module | None = None, *, trusted: bool = False,
         run: dict | None = None, allow_run_changes: bool = False, layout: TensorLayout | None = None) -> Resumed:
    """Restore model, optimizer, scheduler, RNG and FP8 extra state from `path` in place; with `masters` (as for
    save) the masters take the tensors, and the caller copies them into the model's BF16 parameters (and gives the
    masters back their gradients, which this lets go).
    trusted: let TE unpickle the FP8 scaling state of its DelayedScaling modules (only for a checkpoint you wrote).
    run: the settings of the run resuming (as save's `run`): a checkpoint saved under others is refused naming
    them, unless allow_run_changes. layout: as save's (the checkpoint must have been saved with one). Everything is
    read and checked before the model is touched, except that a tensor file found corrupt while loading, or FP8
    state TE refuses, leaves the model partly loaded."""
    from fp8stack.assembly import after_checkpoint_load  # here: the assembly loads every backend, preflight need not

    path = Path(path)
    if run is not None:
        check_run(path, run, allow_run_changes)
    saved, reader = _read_files(path)
    if layout is not None:
        _load_laid_out(path, layout, saved, reader, trusted)
        after_checkpoint_load(layout.module)
        scheduler.load_state_dict(saved["scheduler"])
        _set_rng_state(saved["rng"])
        return Resumed(step=saved["step"], data_position=saved["data_position"])
    # get_state_dict builds a fresh optimizer's state (to load into) only while no parameter has a gradient, and
    # masters hold theirs from the start: without this the moments would silently stay unloaded.
    optimizer.zero_grad(set_to_none=True)
    model_state, optim_state = get_state_dict(masters or model, optimizer)
    tensors, extra_keys = _split_extra_state({**model_state, **_extra_state(model, masters)})
    _check_extra_state_keys(path, saved, extra_keys)
    state = {"model": tensors, "optimizer": optim_state, **_buffer_items(model, masters)}  # buffers load in place
    with _te_extra_state_trust(trusted):
        _load_extra_state(path, model, saved["extra_state"])  # first: what TE refuses stops the load here
        _load_tensors(path, state, reader)
        if masters is None:
            incompatible = set_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                                          model_state_dict={**state["model"], **saved["extra_state"]},
                                          options=StateDictOptions(strict=True))
        else:
            incompatible = set_state_dict(masters, optimizer, model_state_dict=state["model"],
                                          optim_state_dict=state["optimizer"], options=StateDictOptions(strict=True))
    if incompatible.missing_keys or incompatible.unexpected_keys:
        raise CheckpointMismatchError(f"{path} does not fit this model: missing {incompatible.missing_keys}, "
                                      f"unexpected {incompatible.unexpected_keys}; resume with the same model and plan")
    after_checkpoint_load(model)  # after set_state_dict, which loads the extra states a second time without masters
    scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(saved["rng"])
    return Resumed(step=saved["step"], data_position=saved["data_position"])


def _load_laid_out(path: Path, layout: TensorLayout, saved: dict, reader: JsonMetadataReader, trusted: bool) -> None:
    """load()'s tensors through `layout`: the extra states first (what TE refuses stops the load there), then its
    items, put in place with the plain values saved beside them."""
    if not isinstance(saved.get("layout"), dict):
        raise CheckpointMismatchError(f"{path} was not saved in this model's layout (its rank file has no layout "
                                      "values): resume it with the model implementation it was saved with")
    _check_extra_state_keys(path, saved, _split_extra_state(layout.module.state_dict())[1])
    items, planner, put_in_place = layout.load_items()
    with _te_extra_state_trust(trusted):
        _load_extra_state(path, layout.module, saved["extra_state"])
        _load_tensors(path, items, reader, planner)
        put_in_place(saved["layout"])


def _check_extra_state_keys(path: Path, saved: dict, extra_keys) -> None:
    """The model's extra states (TE's FP8 scaling state) are the ones the rank file holds, or the plan changed."""
    if set(saved["extra_state"]) != set(extra_keys):
        raise CheckpointMismatchError(
            f"{path}: the model's extra state (FP8 scaling state) does not match the checkpoint's "
            f"({sorted(set(saved['extra_state']) ^ set(extra_keys))}): resume with the same plan")


def saved_run(path: str | Path) -> dict | None:
    """The `run` settings checkpoint `path` was saved with (run.json), or None when it was saved without."""
    file = Path(path) / RUN_FILE
    if not file.exists():
        return None
    try:
        record = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointDamagedError(f"{path} is damaged: {RUN_FILE} does not decode ({err}): resume from another "
                                     "checkpoint") from None
    if not isinstance(record, dict):
        raise CheckpointDamagedError(f"{path} is damaged: {RUN_FILE} holds a {type(record).__name__}, not the run's "
                                     "settings: resume from another checkpoint")
    return record


def check_run(path: str | Path, run: dict, allow_changes: bool = False) -> None:
    """Refuse (CheckpointMismatchError) a checkpoint saved under other `run` settings, naming each that differs;
    allow_changes accepts them."""
    saved = saved_run(path)
    if allow_changes:
        return
    run = json.loads(json.dumps(run))  # as run.json holds it: tuples as lists
    if saved is None:
        raise CheckpointMismatchError(f"{path} records no run settings ({RUN_FILE}), so a changed recipe, model or "
                                      "batch would go unnoticed: load it without run=, or pass "
                                      "--resume-despite-changes")
    differ = [key for key in run if saved.get(key) != run[key]]
    if differ:
        changes = "; ".join(_difference(key, saved.get(key), run[key]) for key in differ)
        raise CheckpointMismatchError(f"{path} was saved under other settings ({changes}): resume with the settings "
                                      "it was saved with, or pass --resume-despite-changes to continue under the "
                                      "new ones")


def _difference(key: str, saved, now) -> str:
    """'key: saved -> now'; for mappings (a plan's decisions) the first entries that differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = [k for k in dict.fromkeys([*saved, *now]) if saved.get(k) != now.get(k)]
        shown = ", ".join(f"{k}: {saved.get(k)} -> {now.get(k)}" for k in keys[:3])
        return f"{key} ({shown}{f' and {len(keys) - 3} more' if len(keys) > 3 else ''})"
    return f"{key}: {json.dumps(saved)} -> {json.dumps(now)}"


def check_files(path: str | Path) -> None:
    """Read and check what load() reads of checkpoint `path` before it touches a model: this rank's file, the
    metadata, and that every tensor file is there and long enough (CheckpointError, CheckpointDamagedError)."""
    _read_files(Path(path))


def _read_files(path: Path) -> tuple[dict, JsonMetadataReader]:
    own = _rank_file(path)
    if not own.is_file():
        raise CheckpointError(f"{path} is not a complete fp8stack checkpoint for rank {_rank()} (no {own.name}): "
                              "resume from another step, or with the same number of processes it was saved with")
    return _read_rank_file(own), _reader(path)


def _rank_file(folder: Path) -> Path:
    return folder / f"rank{_rank()}.pt"


def _reader(path: Path) -> JsonMetadataReader:
    try:
        return JsonMetadataReader(path)
    except UndecodableFileError as err:
        if (path / ".metadata").is_file() and not (path / METADATA_FILE).exists():
            raise CheckpointDamagedError(f"{path} was written by an older fp8stack whose metadata is a pickle, "
                                         "which this version does not load: start the run afresh") from None
        raise CheckpointDamagedError(f"{path} is damaged: {err}: resume from another checkpoint") from None


def _read_rank_file(file: Path) -> dict:
    """The rank file's contents, read weights-only (tensors and plain values) and checked field by field."""
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types on a file that is not its format
        raise CheckpointDamagedError(f"{file} is damaged or holds more than tensors and plain values "
                                     f"({_first_line(err)}): resume from another checkpoint") from None
    rng = saved.get("rng") if isinstance(saved, dict) else None
    valid = (isinstance(saved, dict) and all(isinstance(saved.get(k), int) and saved[k] >= 0
                                              for k in ("step", "data_position"))
             and isinstance(saved.get("scheduler"), dict) and isinstance(saved.get("extra_state"), dict)
             and isinstance(rng, dict) and _valid_python_rng(rng.get("python"))
             and isinstance(rng.get("torch"), torch.Tensor) and isinstance(rng.get("cuda"), (list, type(None))))
    if not valid:
        raise CheckpointDamagedError(f"{file} is damaged: it lacks the step, data position, scheduler, RNG or extra "
                                     "state of an fp8stack rank file: resume from another checkpoint")
    return saved


def _first_line(err: Exception) -> str:
    """A short reason: torch.load's weights-only refusal names the global it met on one of many lines."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "Unsupported operand" in line]
    return f"{type(err).__name__}: {(named or lines or [''])[0][:200]}"


def _load_extra_state(path: Path, model: nn.Module, extra: dict) -> None:
    """The modules' extra states, before any weight: TE refuses its pickled DelayedScaling state unless trusted."""
    try:
        model.load_state_dict(extra, strict=False)  # the keys matched the model's extra-state keys
    except RuntimeError as err:
        if TE_TRUSTED_PICKLE_ENV not in str(err):
            raise
        raise UntrustedCheckpointError(f"{path} holds TransformerEngine FP8 scaling state that TE reads by "
                                       f"unpickling, which can run code: {TRUST_FIX}") from None


def _load_tensors(path: Path, state: dict, reader: JsonMetadataReader, planner: LoadPlanner | None = None) -> None:
    """DCP's load into `state` (planner: one that reads non-tensor values weights-only; WeightsOnlyLoadPlanner by
    default); a file that does not decode is damage, a key or shape DCP cannot place a mismatch."""
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=planner or WeightsOnlyLoadPlanner())
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()]
        damaged = [exc for exc in failures if isinstance(exc, UndecodableFileError)]
        if damaged:
            raise CheckpointDamagedError(f"{path} is damaged: {damaged[0]}: resume from another checkpoint") from None
        causes = sorted({" ".join(str(exc).split()) for exc in failures})
        raise CheckpointMismatchError(f"{path} does not fit this model ({'; '.join(causes)}): resume with the "
                                      "model, parallel layout and number of processes it was saved with") from err


def _extra_state(model: nn.Module, masters: nn.Module | None) -> dict:
    """The model's extra states when its tensors come from `masters` (which have none); else nothing to add."""
    return {} if masters is None else _split_extra_state(model.state_dict())[1]


def _buffer_items(model: nn.Module, masters: nn.Module | None) -> dict:
    """The model's persistent buffers (an MoE's routing biases) when its tensors come from `masters`, which hold only
    parameters: {'buffers': {name: the buffer itself}}, which DCP saves and loads in place; nothing else to add."""
    if masters is None:
        return {}
    parameters = {name for name, _ in model.named_parameters()}
    buffers = {name: value for name, value in _split_extra_state(model.state_dict(keep_vars=True))[0].items()
               if name not in parameters}
    return {"buffers": buffers} if buffers else {}


def _split_extra_state(model_state: dict) -> tuple[dict, dict]:
    """(tensors for DCP, extra states for the rank file); the extra states' values are cloned to CPU."""
    tensors = {k: v for k, v in model_state.items() if not k.endswith(EXTRA_STATE_SUFFIX)}
    extra = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
             for k, v in model_state.items() if k.endswith(EXTRA_STATE_SUFFIX)}
    return tensors, extra


def _rng_state() -> dict:
    """The RNG states as tensors and lists (Python's tuple state as a list), which a weights-only load reads."""
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _valid_python_rng(state) -> bool:
    return (isinstance(state, list) and len(state) == 3 and isinstance(state[1], list)
            and all(isinstance(v, int) for v in state[1]) and isinstance(state[2], (float, type(None))))


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def _te_extra_state_trust(trusted: bool):
    """TE_TRUSTED_PICKLE_ENV 1 (trusted) or 0 inside, whatever the environment said; as it was afterwards."""
    previous = os.environ.get(TE_TRUSTED_PICKLE_ENV)
    os.environ[TE_TRUSTED_PICKLE_ENV] = "1" if trusted else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[TE_TRUSTED_PICKLE_ENV]
        else:
            os.environ[TE_TRUSTED_PICKLE_ENV] = previous


@contextmanager
def _single_process_quiet():
    """DCP warns on every call that it assumes one process when none is initialised: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
