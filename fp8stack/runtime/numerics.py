"""Numerics guards: stop on a non-finite loss with what is needed to replay the step, find the first
layer whose output went non-finite, read per-layer FP8 amax / scale / saturation statistics, and name
the FP8 weights whose whole gradient flushed to zero.

All of it is opt-in: check_finite reads one scalar per step; watch_layers and track_fp8_stats add
forward hooks whose work stays on the device until read.
"""

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear

from fp8stack.models.moe import GroupedExperts
from fp8stack.runtime.recompute import is_te_module

__all__ = ["E4M3_MAX", "LayerWatch", "NonFiniteLossError", "check_finite", "clear_fp8_stats", "fp8_stats", "load_pin",
           "pin_step", "rng_states", "set_rng_states", "track_fp8_stats", "watch_layers", "zero_fp8_weight_grads"]

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: what the largest |value| of a tensor is scaled to, and where casts saturate."""
E4M3_TOP_CODE_FROM = 432.0
"""|x * scale| from here up is cast to 448, the largest E4M3 value (the next one down is 416)."""


class NonFiniteLossError(FloatingPointError):
    """The loss is NaN or infinite; the message names the file holding the batch and RNG states."""


def rng_states() -> dict:
    """Every RNG a step may draw from: torch (CPU), CUDA (when initialised), Python's random, NumPy's
    (when NumPy is imported). Take it before a step to replay that step exactly."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        states["numpy"] = sys.modules["numpy"].random.get_state()
    return states


def set_rng_states(states: dict) -> None:
    """Restore what rng_states() (or load_pin's 'rng') holds."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(states["numpy"])


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def check_finite(loss: torch.Tensor, *, step: int, batch, pin_dir: str | Path, rng: dict | None = None) -> None:
    """Raise NonFiniteLossError when `loss` is NaN or infinite, after writing
    <pin_dir>/nonfinite-step<step>.pt: the step, the loss, the batch (on CPU) and the RNG states
    (`rng`, taken with rng_states() before the step; by default those at the time of the check).
    Reads the loss on the host: one sync per call."""
    if bool(torch.isfinite(loss.detach()).all()):
        return
    path = pin_step(pin_dir, step, batch, rng if rng is not None else rng_states(), loss=loss)
    raise NonFiniteLossError(f"loss is {loss.detach().float().cpu().tolist()} at step {step}: batch and RNG states "
                             f"pinned in {path}; reload with fp8stack.runtime.numerics.load_pin({str(path)!r}) and "
                             "rerun the step with watch_layers(model) to find the first non-finite layer")


def pin_step(pin_dir: str | Path, step: int, batch, rng: dict, **values: torch.Tensor) -> Path:
    """Write <pin_dir>/nonfinite-step<step>.pt: the step, `values` (the loss, ...), the batch (on CPU) and the RNG
    states as tensors and lists, which load_pin reads back without unpickling any object; returns its path."""
    pin_dir = Path(pin_dir)
    pin_dir.mkdir(parents=True, exist_ok=True)
    path = pin_dir / f"nonfinite-step{step}.pt"
    torch.save({"step": step, **_to_cpu(values), "batch": _to_cpu(batch), "rng": _plain_rng(rng)}, path)
    return path


def load_pin(path: str | Path) -> dict:
    """A file pin_step (check_finite) wrote: {'step', 'loss', 'batch', 'rng', ...}, read weights-only; 'rng' as
    rng_states() gives it (set_rng_states restores it)."""
    pin = torch.load(path, map_location="cpu", weights_only=True)
    rng = pin["rng"]
    version, internal, gauss = rng["python"]
    rng["python"] = (version, tuple(internal), gauss)
    if "numpy" in rng:
        import numpy as np

        name, keys, position, has_gauss, cached = rng["numpy"]
        rng["numpy"] = (name, np.array(keys, dtype=np.uint32), position, has_gauss, cached)
    return pin


def _plain_rng(states: dict) -> dict:
    """rng_states() with Python's and NumPy's tuples (and NumPy's key array) as lists, for a weights-only load."""
    plain = dict(states)
    version, internal, gauss = states["python"]
    plain["python"] = [version, list(internal), gauss]
    if "numpy" in states:
        name, keys, position, has_gauss, cached = states["numpy"]
        plain["numpy"] = [name, [int(k) for k in keys], int(position), int(has_gauss), float(cached)]
    return plain


@dataclass
class LayerWatch:
    """Forward hooks flagging, on the device, every module output that is not finite."""

    calls: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """(fqn, 0-dim bool: some output value is NaN or inf), in execution order (post-hook order:
    an inner module comes before the module containing it)."""
    handles: list = field(default_factory=list)

    def first_nonfinite(self) -> str | None:
        """fqn of the first module (in execution order) whose output was not finite, or None. One sync."""
        if not self.calls:
            return None
        flags = torch.stack([flag.to("cpu") for _, flag in self.calls])
        bad = flags.nonzero()
        return self.calls[int(bad[0])][0] if len(bad) else None

    def clear(self) -> None:
        self.calls.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> "LayerWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _floats(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _floats(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _floats(o)]
    return []


def watch_layers(model: nn.Module) -> LayerWatch:
    """Hook every module of `model`; after a forward, watch.first_nonfinite() names the first module
    whose output held a NaN or inf. Use as a context manager, or call remove().
    A GroupedExperts' rows past its last group hold what its kernels left there (possibly NaN; no reader reads them):
    it is judged by its groups' rows, and the modules inside it (its SwiGLU, which carries those rows) are not
    hooked."""
    watch = LayerWatch()
    inside_experts = {name for fqn, module in model.named_modules() if isinstance(module, GroupedExperts)
                      for name, _ in module.named_modules(prefix=fqn) if name != fqn}
    for fqn, module in model.named_modules():
        if fqn in inside_experts:
            continue

        def hook(module, args, kwargs, out, fqn=fqn or "<root>") -> None:
            if isinstance(module, GroupedExperts):
                tensors = [_rows_of_groups(out, args[1] if len(args) > 1 else kwargs["offsets"])]
            else:
                tensors = _floats(out)
            if tensors:
                with torch.no_grad():
                    flag = torch.stack([~torch.isfinite(t.detach()).all() for t in tensors]).any()
                watch.calls.append((fqn, flag))
        watch.handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return watch


def _rows_of_groups(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A GroupedExperts output with its rows past the last group zeroed (a mask on the device: no host read)."""
    past = torch.arange(out.shape[0], device=out.device) >= offsets[-1]
    return torch.where(past.unsqueeze(1), 0, out.detach())


# --- FP8 statistics ------------------------------------------------------------------------------

_STATS_ATTR = "_fp8stack_fp8_stats"


def _cast_stats(x: torch.Tensor, rowwise: bool) -> dict[str, torch.Tensor]:
    """amax, the E4M3 scale it gives (448 / amax, per tensor or per row as the layer scales), values
    that saturate (cast to 448, the top E4M3 code: the amax itself, and with a stale scale everything
    clamped) and non-zero values that round to 0 in E4M3. On the device."""
    if hasattr(x, "to_local"):  # a DTensor (FSDP / TP shard): statistics of the local shard
        x = x.to_local()
    x = x.detach().float()
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = E4M3_MAX / amax.clamp(min=1e-12)
    scaled = x * scale
    return {"amax": amax.max(), "scale": scale.min(),
            "overflow_count": (scaled.abs() >= E4M3_TOP_CODE_FROM).sum(),
            "underflow_count": ((x != 0) & (scaled.to(torch.float8_e4m3fn).float() == 0)).sum()}


def _is_rowwise(cast_config) -> bool:
    return cast_config.scaling_granularity is ScalingGranularity.AXISWISE


def track_fp8_stats(model: nn.Module) -> list:
    """Forward hooks on every torchao Float8Linear and TE module with a 2-D weight computing, from the
    tensors it casts, the statistics fp8_stats reads (input and weight: amax, scale, counts summed over
    calls). Returns the hook handles (call .remove() on each to stop). Costs a few reductions per layer."""
    handles = []
    for module in model.modules():
        if isinstance(module, Float8Linear):
            rowwise = {"input": _is_rowwise(module.config.cast_config_input),
                       "weight": _is_rowwise(module.config.cast_config_weight)}
        elif _is_fp8_module(module) and isinstance(getattr(module, "weight", None), torch.Tensor):
            rowwise = {"input": False, "weight": False}
        else:
            continue

        def hook(mod, args, _out, rowwise=rowwise) -> None:
            roles = {"weight": mod.weight}
            # A LayerNormLinear normalizes before casting: its input is not what it casts.
            if "LayerNorm" not in type(mod).__name__ and args and isinstance(args[0], torch.Tensor):
                roles["input"] = args[0]
            with torch.no_grad():
                fresh = {role: _cast_stats(t, rowwise[role]) for role, t in roles.items()}
            kept = mod.__dict__.setdefault(_STATS_ATTR, {})
            for role, stats in fresh.items():
                if role in kept:
                    for key in ("overflow_count", "underflow_count"):
                        stats[key] = stats[key] + kept[role][key]
                kept[role] = stats
        handles.append(module.register_forward_hook(hook))
    return handles


def _is_fp8_module(module: nn.Module) -> bool:
    """torchao Float8Linear, or a TE module that quantizes (it keeps fp8_meta; TE's padding helpers do not)."""
    return isinstance(module, Float8Linear) or (is_te_module(module) and hasattr(module, "fp8_meta"))


def _te_delayed_meta(module: nn.Module) -> dict | None:
    """A TE module's delayed-scaling state (scale and latest amax per forward tensor), if it has one."""
    state = getattr(module, "fp8_meta", {}).get("scaling_fwd")
    if state is None or not hasattr(state, "amax_history"):
        return None
    return {"te_scale": state.scale.tolist(), "te_amax": state.amax_history[0].tolist()}


def fp8_stats(model: nn.Module) -> dict[str, dict]:
    """fqn -> {'amax', 'scale', 'overflow_count', 'underflow_count': {'input': ..., 'weight': ...}}
    for every FP8 module (torchao Float8Linear, TE modules), from track_fp8_stats' hooks; TE modules
    with delayed scaling add 'te_scale' and 'te_amax' (the scales they use, from fp8_meta: forward
    input, weight, output per GEMM). A module with neither says {'source': 'not tracked ...'}."""
    out: dict[str, dict] = {}
    for fqn, module in model.named_modules():
        if not _is_fp8_module(module):
            continue
        entry: dict = {}
        for role, stats in module.__dict__.get(_STATS_ATTR, {}).items():
            for key, value in stats.items():
                entry.setdefault(key, {})[role] = value.item()
        delayed = None if isinstance(module, Float8Linear) else _te_delayed_meta(module)
        if delayed:
            entry.update(delayed)
        out[fqn or "<root>"] = entry or {"source": "not tracked: call track_fp8_stats(model) before the forward"}
    return out


def clear_fp8_stats(model: nn.Module) -> None:
    """Forget the statistics track_fp8_stats' hooks have summed so far (the next fp8_stats starts afresh)."""
    for module in model.modules():
        module.__dict__.pop(_STATS_ATTR, None)


def zero_fp8_weight_grads(model: nn.Module) -> list[str]:
    """After a backward: the names of the weights (2-D and up) of FP8 modules (torchao Float8Linear, TE
    modules) whose gradient on this rank, or megatron's main_grad where the gradient is accumulated there,
    is all zero. Such a weight trains nothing, silently: every value of an FP8 gradient cast flushed, as
    when a TE delayed-scaling scale has not yet seen its tensor's amax (TE starts each scale at 1). One sync."""
    names, flags = [], []
    for fqn, module in model.named_modules():
        if not _is_fp8_module(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
            if param.dim() < 2 or not param.requires_grad or grad is None:
                continue
            if hasattr(grad, "to_local"):  # a DTensor shard (FSDP / TP): this rank's part
                grad = grad.to_local()
            names.append(f"{fqn}.{name}" if fqn else name)
            flags.append(~grad.detach().any())
    if not flags:
        return []
    zero = torch.stack(flags).cpu().tolist()
    return [name for name, is_zero in zip(names, zero) if is_zero]
