"""FP32 gradient accumulation under fully_shard (FSDP2) for weights whose module adds its weight gradient into the
weight's `main_grad` itself and hands autograd none (TE's fuse_wgrad_accumulation).

FSDP2 reduce-scatters autograd's gradients. Between reductions (micro-batches run with requires_gradient_sync off) it
keeps one FP32 accumulator per parameter (FSDPParam.unsharded_accumulated_grad, its reduce dtype), adds autograd's
gradient into it after each backward, and at a reduction takes the accumulator in place of .grad and lets go of it.
Here each accumulator is a persistent FP32 buffer of ours, zeroed and handed to FSDP2 before the first forward after a
reduction; for a weight whose module writes main_grad, the same buffer is the gathered weight's main_grad, so that the
module's weight-gradient GEMM adds into what FSDP2 will reduce-scatter: no BF16 weight gradient, cast or add per
micro-batch. A reduce-scatter takes one dtype per FSDP2 unit, so every parameter of a unit holding such a weight gets
an FP32 accumulator. Memory: 4 bytes per parameter of those units, unsharded, on every rank (DDP's gradient buffers),
kept between steps. A parameter of such a unit that gets no gradient in a step is reduced as zeros, not skipped.

Reads FSDP2's per-parameter state, which torch does not publish (the same in torch 2.11 and 2.14; check_fsdp2 refuses
a torch without it). The buffers are zeroed on the compute stream in a forward after FSDP2's backward has waited for
its reduce-scatters (FSDPParamGroup.finalize_backward), so no reduce-scatter still reads one.
"""

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def install(model: nn.Module, writers: Iterable[tuple[nn.Module, str]]) -> int:
    """For each (module, parameter name) whose weight gradient the module adds into the parameter's main_grad: FP32
    accumulators for every parameter of the FSDP2 unit that holds it, handed to FSDP2 by a forward pre-hook on the
    unit (after FSDP2's own, which gathers the parameters). Returns how many units got them. Call once fully_shard
    has wrapped `model`; raises ValueError for a writer no FSDP2 unit of `model` holds."""
    check_fsdp2()
    wanted = {(id(module), name) for module, name in writers}
    found, units = set(), 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        params = _fsdp_params(unit)
        written = {id(p) for p in params if _owner(p) in wanted}
        if written:
            unit.register_forward_pre_hook(_Accumulators(params, written))
            found |= {_owner(p) for p in params if id(p) in written}
            units += 1
    if found != wanted:
        raise ValueError(f"{len(wanted - found)} parameter(s) whose module writes main_grad are in no fully_shard unit "
                         "of this model: fully_shard the module holding them (apply_fsdp shards every block and "
                         "the root)")
    return units


def check_fsdp2() -> None:
    """Refuse a torch whose FSDP2 keeps no per-parameter FP32 accumulator where this module hands it one."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if not all(hasattr(FSDPParam, name) for name in ("accumulate_unsharded_grad_if_needed",
                                                     "to_accumulated_grad_if_needed")):
        raise NotImplementedError(f"torch {torch.__version__}'s FSDP2 keeps no per-parameter gradient accumulator "
                                  "(FSDPParam.unsharded_accumulated_grad) for fused weight-gradient accumulation to "
                                  "write into: turn fuse_wgrad_accumulation off under fully_shard")


class _Accumulators:
    """The forward pre-hook of one FSDP2 unit: a zeroed FP32 accumulator for each of its parameters whose last one
    FSDP2 has reduce-scattered (or that never had one), and the gathered written weights' main_grad."""

    def __init__(self, params: list, written: set[int]):
        self.params = params
        self.written = written
        self.buffers: dict[int, torch.Tensor] = {}

    @torch.compiler.disable  # as FSDP2's own hooks: a compiled block (Module.compile) calls its hooks inside dynamo
    def __call__(self, unit: nn.Module, args) -> None:
        for param in self.params:
            if param.unsharded_accumulated_grad is None:
                param.unsharded_accumulated_grad = self._zeroed(param)
            if id(param) in self.written:
                param.unsharded_param.main_grad = param.unsharded_accumulated_grad

    def _zeroed(self, param) -> torch.Tensor:
        buffer = self.buffers.get(id(param))
        if buffer is None:
            gathered = param.unsharded_param
            buffer = self.buffers[id(param)] = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
        else:
            buffer.zero_()
        return buffer


def _fsdp_params(unit: FSDPModule) -> list:
    """The FSDPParams of one FSDP2 unit (torch 2.14 keeps a list of parameter groups, 2.11 one group or None)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return [param for group in groups for param in group.fsdp_params]


def _owner(param) -> tuple[int, str]:
    """(id of the module holding an FSDPParam's parameter, the parameter's name there)."""
    return id(param._module_info.module), param._module_info.param_name
