"""Save and resume everything a training step depends on, so a resumed run continues bit-identically.

One folder per checkpoint, `<checkpoint_dir>/step-<N>`:
- model and optimizer tensors through torch.distributed.checkpoint (works unsharded, and sharded
  under FSDP2/TP: each rank writes its shards);
- `rank<r>.pt` per rank: step, data position, LR scheduler, RNG states, and the modules' extra
  state. FP8 scaling state lives there: TE DelayedScaling keeps its amax history and scales in
  module extra_state (a pickled byte tensor whose size changes once FP8 has run, which DCP cannot
  load in place, hence torch.save). torchao's dynamic tensorwise/rowwise scaling keeps no state.
  TransformerEngine 2.20 unpickles DelayedScaling state only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1;
  load() sets it while restoring, as it already unpickles the rank file of the same checkpoint.
A checkpoint is written under a temporary name and renamed when complete, so `latest()` never
picks a half-written one.
"""

import os
import random
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

EXTRA_STATE_SUFFIX = nn.modules.module._EXTRA_STATE_KEY_SUFFIX
"""Key suffix of a module's get_extra_state() in its state_dict ('_extra_state')."""
PREFIX = "step-"
TE_TRUSTED_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
"""TE's opt-in to unpickle DelayedScaling extra state (amax histories, scales); without it TE refuses
to load them. Loading a checkpoint trusts it: its rank file is a pickle too."""


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or does not fit the model being resumed; the message says what to do."""


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
    folder = Path(checkpoint_dir)
    found = sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit())
    return found[-1] if found else None


def save(checkpoint_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, data_position: int, masters: nn.Module | None = None) -> Path:
    """Write checkpoint `step` (every rank calls this); returns its folder. masters: the FP32 master weights under
    the model's names when the model's parameters are BF16 copies of them (fp8stack.precision.MasterWeights): saved as the
    model's tensors, which they are up to rounding, and what the optimizer steps."""
    final = checkpoint_path(checkpoint_dir, step)
    partial = final.with_name(final.name + ".partial")
    model_state, optim_state = get_state_dict(masters or model, optimizer)
    tensors, extra = _split_extra_state({**model_state, **_extra_state(model, masters)})
    with _single_process_quiet():
        dcp.save({"model": tensors, "optimizer": optim_state}, checkpoint_id=partial)
    torch.save({"step": step, "data_position": data_position, "scheduler": scheduler.state_dict(),
                "rng": _rng_state(), "extra_state": extra}, partial / f"rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        if final.exists():  # a resumed run passing the step again replaces that checkpoint
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, masters: nn.Module | None = None) -> Resumed:
    """Restore model, optimizer, scheduler, RNG and FP8 extra state from `path` in place; with `masters` (as for
    save) the masters take the tensors, and the caller copies them into the model's BF16 parameters (and gives the
    masters back their gradients, which this lets go)."""
    path = Path(path)
    own = path / f"rank{_rank()}.pt"
    if not own.is_file():
        raise CheckpointError(f"{path} is not a complete fp8stack checkpoint for rank {_rank()} (no {own.name}): "
                                "resume from another step, or with the same number of processes it was saved with")
    # get_state_dict builds a fresh optimizer's state (to load into) only while no parameter has a gradient, and
    # masters hold theirs from the start: without this the moments would silently stay unloaded.
    optimizer.zero_grad(set_to_none=True)
    model_state, optim_state = get_state_dict(masters or model, optimizer)
    tensors, extra_keys = _split_extra_state({**model_state, **_extra_state(model, masters)})
    state = {"model": tensors, "optimizer": optim_state}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:
        causes = sorted({" ".join(str(exc).split()) for exc, _ in err.failures.values()})
        raise CheckpointError(f"{path} does not fit this model ({'; '.join(causes)}): resume with the model, "
                              "parallel layout and number of processes it was saved with") from err
    saved = torch.load(own, weights_only=False)  # our own file: RNG states and recipes are Python objects
    if set(saved["extra_state"]) != set(extra_keys):
        raise CheckpointError(f"{path}: the model's extra state (FP8 scaling state) does not match the checkpoint's "
                           f"({sorted(set(saved['extra_state']) ^ set(extra_keys))}): resume with the same plan")
    with _te_extra_state_trusted():
        if masters is None:
            incompatible = set_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                                          model_state_dict={**state["model"], **saved["extra_state"]},
                                          options=StateDictOptions(strict=True))
        else:
            incompatible = set_state_dict(masters, optimizer, model_state_dict=state["model"],
                                          optim_state_dict=state["optimizer"], options=StateDictOptions(strict=True))
            model.load_state_dict(saved["extra_state"], strict=False)  # the keys matched extra_keys above
    if incompatible.missing_keys or incompatible.unexpected_keys:
        raise CheckpointError(f"{path} does not fit this model: missing {incompatible.missing_keys}, "
                           f"unexpected {incompatible.unexpected_keys}; resume with the same model and plan")
    scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(saved["rng"])
    return Resumed(step=saved["step"], data_position=saved["data_position"])


def _extra_state(model: nn.Module, masters: nn.Module | None) -> dict:
    """The model's extra states when its tensors come from `masters` (which have none); else nothing to add."""
    return {} if masters is None else _split_extra_state(model.state_dict())[1]


def _split_extra_state(model_state: dict) -> tuple[dict, dict]:
    """(tensors for DCP, extra states for torch.save); the extra states' values are cloned to CPU."""
    tensors = {k: v for k, v in model_state.items() if not k.endswith(EXTRA_STATE_SUFFIX)}
    extra = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
             for k, v in model_state.items() if k.endswith(EXTRA_STATE_SUFFIX)}
    return tensors, extra


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def _te_extra_state_trusted():
    """TE_TRUSTED_PICKLE_ENV set to 1 inside, as it was outside afterwards."""
    previous = os.environ.get(TE_TRUSTED_PICKLE_ENV)
    os.environ[TE_TRUSTED_PICKLE_ENV] = "1"
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
