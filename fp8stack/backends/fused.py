"""Running several modules of a user's model as one fused module, without touching the code that calls them.

- FoldedNorm takes the place of a norm whose work moved into the fused module it feeds: it passes its input on.
- ProjectionSlice takes the place of each linear of a merged group (q, k and v; gate and up): the group's first call
  on an input runs the fused module once, each projection's call returns its slice of that output.
- StateKeys keeps the user's checkpoints loading: a load_state_dict pre-hook builds each fused tensor from the
  user's keys (rows concatenated in order), and unfused_state_dict() writes a state dict under the user's keys.

Backend-agnostic: a backend passes the fused module it built (TE's LayerNormLinear, for one).
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FoldedNorm", "Part", "ProjectionSlice", "StateKeys", "merged_projections", "unfused_state_dict"]


class FoldedNorm(nn.Identity):
    """A norm whose work runs inside the fused module after it (folded_into): returns its input unchanged."""

    def __init__(self, folded_into: str):
        super().__init__()
        self.folded_into = folded_into
        """The fqn of the fused module that normalizes now."""

    def extra_repr(self) -> str:
        return f"folded into {self.folded_into}"


class _MergedOutputs:
    """The fused module of a merged group and its latest output, shared by the group's ProjectionSlices."""

    def __init__(self, fused: nn.Module, widths: Sequence[int]):
        self.fused = fused
        self.widths = list(widths)
        self.input: torch.Tensor | None = None
        self.pieces: tuple[torch.Tensor, ...] = ()
        self.taken: set[int] = set()

    @torch.compiler.disable  # the identity of the input decides whether to run: a Python-level decision
    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index`'s output for input x: its piece of the fused module's output for x while the group has
        not taken it yet, else of a new call (another input, or a projection called twice). The output is split once
        for the group, here: one autograd node, whose backward writes the merged gradient with one concatenation.
        Pieces taken in traced code instead each cost a zero-filled merged-size gradient, a copy and an add in
        backward, since this call breaks the compiled graph before each projection (seen in the own model's profile,
        profiles/runs/2026-11-29-own-model-r7-own-h200)."""
        if self.input is not x or index in self.taken:
            self.input, self.pieces, self.taken = x, self.fused(x).split(self.widths, dim=-1), set()
        self.taken.add(index)
        piece = self.pieces[index]
        if len(self.taken) == len(self.widths):  # every projection has its output: hold nothing between calls
            self.input, self.pieces = None, ()
        return piece


class ProjectionSlice(nn.Module):
    """One linear of a merged group: its output is its slice of the fused module's. The group's first projection
    holds the fused module (as `fused`, so that its parameters and state appear once)."""

    def __init__(self, shared: _MergedOutputs, index: int, in_features: int, out_features: int):
        super().__init__()
        if index == 0:
            self.fused = shared.fused
        self._shared = shared  # a plain object: not a submodule
        self.index = index
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.output(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slice {self.index} of a merged GEMM"


def merged_projections(fused: nn.Module, linears: Sequence[nn.Linear]) -> list[ProjectionSlice]:
    """The ProjectionSlices that replace `linears` (which read one input), given `fused`, which computes their outputs
    concatenated along the last dim in this order."""
    shared = _MergedOutputs(fused, [linear.out_features for linear in linears])
    return [ProjectionSlice(shared, i, linear.in_features, linear.out_features) for i, linear in enumerate(linears)]


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of a user's state-dict entry."""

    key: str
    start: int
    stop: int


class StateKeys:
    """Fused state-dict key -> the user's parts it is made of, in row order; hooked on the model so that
    model.load_state_dict accepts the user's keys as well as the fused ones."""

    def __init__(self, model: nn.Module):
        self.fused: dict[str, tuple[Part, ...]] = {}
        model.register_load_state_dict_pre_hook(self._from_user_keys)

    @classmethod
    def of(cls, model: nn.Module) -> "StateKeys":
        """The model's key map, made on first use."""
        if "_fp8stack_state_keys" not in model.__dict__:
            model.__dict__["_fp8stack_state_keys"] = cls(model)
        return model.__dict__["_fp8stack_state_keys"]

    def add(self, fused_key: str, parts: Sequence[Part]) -> None:
        """Record that `fused_key` holds `parts` concatenated along dim 0."""
        self.fused[fused_key] = tuple(parts)

    def _from_user_keys(self, module: nn.Module, state_dict: dict, prefix: str, *_hook_args) -> None:
        for fused_key, parts in self.fused.items():
            keys = [prefix + p.key for p in parts]
            if prefix + fused_key in state_dict or not all(k in state_dict for k in keys):
                continue  # a fused state dict, or one without this entry: strict loading reports what is missing
            pieces = [state_dict[prefix + p.key][p.start:p.stop] for p in parts]
            state_dict[prefix + fused_key] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            for key in dict.fromkeys(keys):
                del state_dict[key]

    def to_user_keys(self, state_dict: dict) -> dict:
        """`state_dict` (the fused model's) under the user's keys: fused entries cut back into their parts, and parts
        of one user tensor (the halves of a fused gate/up projection) joined in row order."""
        out = {k: v for k, v in state_dict.items() if k not in self.fused}
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for fused_key, parts in self.fused.items():
            row = 0
            for part in parts if fused_key in state_dict else ():
                pieces[part.key].append((part.start, state_dict[fused_key][row:row + part.stop - part.start]))
                row += part.stop - part.start
        for key, found in pieces.items():
            found.sort(key=lambda piece: piece[0])
            out[key] = found[0][1] if len(found) == 1 else torch.cat([p for _, p in found])
        return out


def unfused_state_dict(model: nn.Module) -> dict:
    """model.state_dict() under the keys the model had before its modules were fused (a model without fusions: its
    state dict as it is), so that the user's unfused model loads it."""
    keys = model.__dict__.get("_fp8stack_state_keys")
    state = model.state_dict()
    return keys.to_user_keys(state) if keys is not None else state
