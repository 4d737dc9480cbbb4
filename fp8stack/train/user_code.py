"""A user's own model and batches in the trainer: `--model-factory module:function` and `--data module:function`.

Each flag names a function as `module:function` (an importable module; the current folder comes first on the
path, as under `python -m`) or `path/to/file.py:function` (the file's folder comes first on the path while it is
imported, as when Python runs it, so it can import the files beside it).

Model factory, `() -> torch.nn.Module`: called once per run with the torch RNG seeded by the run's seed (the same
seed gives every A/B arm the same weights) and the run's device as the default device. It returns the model with its
weights initialised, as FP32 parameters (the trainer keeps them as the master weights; autocast and the FP8 modules
cast what they compute with). `model(tokens)` takes token ids [B, S] int64 and returns logits [B, S, V] (V: the
vocabulary); the trainer's loss is the mean next-token cross-entropy of those logits in FP32. Its blocks sit in a
`layers` ModuleList or ModuleDict, where fp8stack.make_plan finds them (examples/own_model/model.py: torchtitan's
layout).

Data factory, `(*, split, seq_len, batch_size, seed, rank, ranks) -> batch`: called once per split ('train', and
'validation' for the evaluation after the last step). It returns `batch(index) -> (tokens, targets)`, two CPU int64
tensors [batch_size, seq_len] of ids in [0, V), targets the tokens shifted by one. batch(index) must be a pure
function of (seed, split, rank, ranks, index): every A/B arm passes the same seed and so trains on the same tokens,
and a resumed run continues from the index alone. With `ranks` data-parallel processes, rank r returns its own
slice of global batch `index`. fp8stack.train.data.TextData(...).batch is one such function.
"""

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

MODEL_FACTORY_FLAG = "--model-factory"
DATA_FLAG = "--data"

Batch = tuple[torch.Tensor, torch.Tensor]
"""(tokens, targets), each [batch_size, seq_len] int64 on the CPU."""


class ModelFactory(Protocol):
    """`--model-factory`: builds the user's model (see the module docstring)."""

    def __call__(self) -> nn.Module: ...


class DataFactory(Protocol):
    """`--data`: returns the batch function of one split (see the module docstring)."""

    def __call__(self, *, split: str, seq_len: int, batch_size: int, seed: int, rank: int,
                 ranks: int) -> Callable[[int], Batch]: ...


class UserCodeError(ValueError):
    """A --model-factory or --data that cannot be used; the message names the flag and the fix."""


def load_factory(spec: str, flag: str) -> Callable:
    """The function `spec` names ('module:function' or 'path/to/file.py:function'), for the command-line `flag`."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise UserCodeError(f"{flag} {spec!r} is not module:function: write e.g. {flag} "
                            f"my_package.factories:{'model' if flag == MODEL_FACTORY_FLAG else 'data'} "
                            "or path/to/file.py:function")
    module = _import_file(module_name, spec, flag) if _is_path(module_name) else _import_module(module_name, spec, flag)
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            defined = sorted(name for name, value in vars(module).items()
                             if callable(value) and getattr(value, "__module__", None) == module.__name__)
            raise UserCodeError(f"{flag} {spec}: {module_name} has no {attribute!r} (it defines "
                                f"{', '.join(defined) or 'no functions'}): name a function it defines")
        target = getattr(target, part)
    if not callable(target):
        article = "an" if type(target).__name__[0] in "aeiou" else "a"
        raise UserCodeError(f"{flag} {spec}: {attribute} ({article} {type(target).__name__}) is not callable: name the "
                            f"function that returns the {'model' if flag == MODEL_FACTORY_FLAG else 'batch function'}")
    return target


def _is_path(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_module(module_name: str, spec: str, flag: str):
    """Import `module_name` with the current folder first on the path (as `python -m` runs)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # the module exists and failed importing something else: its traceback says what
        raise UserCodeError(f"{flag} {spec}: no module named {module_name!r} from {os.getcwd()}: install it, run "
                            "from the folder holding it, or give path/to/file.py:function") from None


def _import_file(module_name: str, spec: str, flag: str):
    """Import the file `module_name` names, its folder first on the path (so it can import the files beside it)."""
    path = Path(module_name).expanduser().resolve()
    if not path.is_file() or path.suffix != ".py":
        raise UserCodeError(f"{flag} {spec}: no Python file {module_name}: give an existing path/to/file.py:function "
                            "or an importable module:function")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    name = f"fp8stack_user_code.{path.stem}"
    if getattr(sys.modules.get(name), "__file__", None) == str(path):  # --model-factory and --data in one file
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up here
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def build_model(factory: ModelFactory, *, seed: int, device: torch.device,
                flag: str = MODEL_FACTORY_FLAG) -> nn.Module:
    """Call the model factory with the torch RNG seeded by `seed` (the global RNG left as it was) and `device` as the
    default device; check what it returned (check_model)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type), torch.device(device):
        torch.manual_seed(seed)
        model = factory()
    return check_model(model, flag)


def check_model(model: object, flag: str = MODEL_FACTORY_FLAG) -> nn.Module:
    """`model` if it is an nn.Module with FP32 parameters to train, else a UserCodeError naming the fix."""
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"{flag} returned a {type(model).__name__}, not a torch.nn.Module: return the model")
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trained:
        raise UserCodeError(f"{flag} returned a {type(model).__name__} with no parameters to train: return the model "
                            "with its weights (requires_grad=True)")
    wrong = [(name, p.dtype) for name, p in trained if p.dtype != torch.float32]
    if wrong:
        name, dtype = wrong[0]
        raise UserCodeError(f"{flag} returned {name} as {str(dtype).removeprefix('torch.')}: return FP32 parameters "
                            "(the trainer keeps them as master weights; autocast and FP8 modules cast them; "
                            "--param-dtype bf16 keeps BF16 copies)")
    return model


@torch.no_grad()
def vocab_size_of(model: nn.Module, tokens: torch.Tensor, flag: str = MODEL_FACTORY_FLAG) -> int:
    """V of the logits [B, S, V] the model returns for one sequence of `tokens` [B, S]; a UserCodeError when the
    forward does not return such logits."""
    sample = tokens[:1]
    logits = model(sample.to(next(model.parameters()).device))
    if not isinstance(logits, torch.Tensor):
        raise UserCodeError(f"{flag}: the model's forward returned a {type(logits).__name__}: return the logits "
                            "tensor [batch, seq, vocab]")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(sample.shape) or not logits.is_floating_point():
        raise UserCodeError(f"{flag}: the model's forward returned {logits.dtype} {tuple(logits.shape)} for token ids "
                            f"{tuple(sample.shape)}: return floating-point logits [batch, seq, vocab] "
                            f"({sample.shape[0]}, {sample.shape[1]}, V)")
    return logits.shape[-1]


def check_batch(batch: object, *, batch_size: int, seq_len: int, vocab_size: int | None, index: int,
                flag: str = DATA_FLAG) -> Batch:
    """`batch` if it is (tokens, targets) as the data protocol says: CPU int64 [batch_size, seq_len], ids in
    [0, vocab_size) (not bounded above when vocab_size is None); else a UserCodeError naming the fix."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not all(isinstance(t, torch.Tensor) for t in batch):
        raise UserCodeError(f"{flag}: batch({index}) returned a {type(batch).__name__}: return (tokens, targets), "
                            "two tensors")
    for name, tensor in zip(("tokens", "targets"), batch):
        where = f"{flag}: batch({index})'s {name}"
        if tensor.dtype != torch.int64:
            raise UserCodeError(f"{where} are {str(tensor.dtype).removeprefix('torch.')}: return int64 token ids "
                                "(.long())")
        if tuple(tensor.shape) != (batch_size, seq_len):
            raise UserCodeError(f"{where} have shape {tuple(tensor.shape)}: return [batch_size, seq_len] = "
                                f"({batch_size}, {seq_len}), the sizes the trainer passed")
        if tensor.device.type != "cpu":
            raise UserCodeError(f"{where} are on {tensor.device}: return CPU tensors (the trainer moves them)")
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab)"
            raise UserCodeError(f"{where} hold ids from {low} to {high}: return ids in {bound}, the model's vocabulary")
    return tuple(batch)


class FactoryBatches:
    """One split of a data factory's batches, read as the trainer reads TextData: batch(index), each checked with
    check_batch, and next() from `position` (saved by a checkpoint to resume)."""

    def __init__(self, factory: DataFactory, *, split: str, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, ranks: int = 1, vocab_size: int | None = None, flag: str = DATA_FLAG):
        self.batch_fn = factory(split=split, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank,
                                ranks=ranks)
        if not callable(self.batch_fn):
            raise UserCodeError(f"{flag} returned a {type(self.batch_fn).__name__}: return the batch function, "
                                "batch(index) -> (tokens, targets)")
        self.seq_len, self.batch_size, self.vocab_size, self.flag = seq_len, batch_size, vocab_size, flag
        self.position = 0
        """Index of the next batch; save it to resume."""

    def batch(self, index: int) -> Batch:
        """Batch number `index` of this split and rank."""
        return check_batch(self.batch_fn(index), batch_size=self.batch_size, seq_len=self.seq_len,
                           vocab_size=self.vocab_size, index=index, flag=self.flag)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.position)
        self.position += 1
        return batch
