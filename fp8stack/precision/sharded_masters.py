"""FP32 master weights for a model sharded by fully_shard (FSDP2), whose TE weights may be held in FP8 only.

    model = assemble(model, plan, fsdp_mesh=mesh, backend_options={"te": {"fp8_weights": True}})
    masters = ShardedMasterWeights(model)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=3e-4))
    ... the loop as before; clip masters.parameters(), whose .grad are FP32 and sharded ...

Under FSDP2's MixedPrecisionPolicy the sharded parameters stay FP32 and each forward all-gathers them as BF16: those
are their own masters, and the optimizer steps them as they are. A weight TE holds in FP8 only (fp8_weights, built in
TE's quantized_model_init) is sharded as a DTensor whose local shard is TE's QuantizedTensor, and FSDP2 all-gathers
its FP8 bytes (TE's fsdp_pre_all_gather / fsdp_post_all_gather). Such a weight gets an FP32 master: a DTensor with
its mesh and placements, started from the FP32 values TE quantized it from (which apply_fsdp took from the backend
before sharding) and sharded as FSDP2 sharded the weight. After each optimizer step the master's local shard is copied
into the weight's (QuantizedTensor.copy_ quantizes it with the recipe's scale for that weight, as TE's FusedAdam does).

Gradients: FSDP2 reduce-scatters into each sharded parameter's .grad, in reduce_dtype and then in the parameter's
dtype (FP32 for an FP8 weight built from FP32 weights), and adds into a .grad that exists instead of replacing it. So
each FP8 weight keeps an FP32 .grad from the start, which is its master's .grad too: clipping and the optimizer read
it, after_step zeroes it.
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from fp8stack.assembly import assembly_state
from fp8stack.precision.master_weights import SteppedMasters, _holding


class ShardedMasterWeights(SteppedMasters):
    """The FP32 masters of a fully_shard'ed model: its own FP32 sharded parameters, and a sharded FP32 master for each
    weight held in FP8 only; `module` holds them under the model's names (what the optimizer steps and a checkpoint
    saves). After each optimizer step after_step() must run: track(optimizer) makes the optimizer run it (with the
    assembly's post-step hook)."""

    model_holds = "FP8 weights, quantized copies"

    def __init__(self, model: nn.Module):
        named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        _check_sharded(model, named)
        quantized = {name for name, p in named.items() if _held_quantized(p)}
        wrong = sorted({str(p.dtype) for p in named.values()} - {"torch.float32"})  # an FP8 weight's nominal dtype
        if wrong:
            raise RuntimeError(f"ShardedMasterWeights steps FP32 masters and takes FP32 gradients, and some sharded "
                               f"parameters are {', '.join(wrong)}: build the model in FP32 (FSDP2's "
                               "MixedPrecisionPolicy computes in BF16)")
        values = assembly_state(model).master_values
        missing = sorted(quantized - set(values))
        if missing:
            raise RuntimeError(f"{missing[0]} is held in FP8 only and the FP32 values its master starts from are "
                               "gone (another ShardedMasterWeights took them, or fully_shard ran outside "
                               "fp8stack.assembly.apply_fsdp): build and assemble the model again, then make one "
                               "ShardedMasterWeights")
        self.model = model
        masters = {name: nn.Parameter(shard_like(p, values.pop(name))) if name in quantized else p
                   for name, p in named.items()}
        self.masters = list(masters.values())
        """What the optimizer steps, in the order of the model's parameters: FP32 DTensors."""
        self.module = _holding(masters)
        """An nn.Module with the masters under the model's parameter names."""
        self.fp8_pairs = [(named[name], masters[name]) for name in named if name in quantized]
        """(weight held in FP8, its FP32 master) for each such weight."""
        self._link_grads()
        model.register_forward_pre_hook(self._link_grads)

    def after_step(self) -> None:
        """The FP8 weights' local shards quantized from their stepped masters; their gradients zeroed for the next
        step (and linked to the masters again)."""
        with torch.no_grad():
            for weight, master in self.fp8_pairs:
                # The local tensor is looked up each time: FSDP2 re-wraps it at its lazy initialisation.
                weight.to_local().copy_(master.to_local())
                if weight.grad is not None:
                    weight.grad.zero_()
        self._link_grads()

    def _link_grads(self, *_hook_args) -> None:
        """Each FP8 weight's FP32 .grad (made if gone: FSDP2 adds into it) is its master's .grad; before each forward
        too, since optimizer.zero_grad(set_to_none=True) lets the masters' .grad go."""
        for weight, master in self.fp8_pairs:
            if weight.grad is None:
                weight.grad = torch.zeros_like(master)
            if master.grad is not weight.grad:
                master.grad = weight.grad


def shard_like(param: DTensor, value: torch.Tensor) -> DTensor:
    """`value` (the whole tensor, on any device) as an FP32 DTensor sharded as `param` is: its mesh, placements and
    local shard shape (FSDP2 shards dim 0 as torch.chunk does, the last ranks' shards smaller or empty, and so does
    DTensor's Shard). Every rank holds the whole value, so each takes its shard with no communication."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"a master of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}: "
                         "pass the parameter's whole (unsharded) value")
    with torch.no_grad():
        local = param.to_local()
        whole = value.detach().to(device=local.device, dtype=torch.float32)
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def _check_sharded(model: nn.Module, named: dict[str, nn.Parameter]) -> None:
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"ShardedMasterWeights keeps the masters of a model sharded by fully_shard, and this "
                           f"{type(model).__name__} is not: assemble(model, plan, fsdp_mesh=...) first, or use "
                           "fp8stack.precision.MasterWeights(model) for an unsharded model")
    unsharded = [name for name, p in named.items() if not isinstance(p, DTensor)]
    if unsharded:
        raise RuntimeError(f"parameter {unsharded[0]!r} is not sharded by fully_shard: fully_shard the root too "
                           "(assemble(..., fsdp_mesh=...) shards every block and then the root)")


def _held_quantized(param: DTensor) -> bool:
    """Whether the local shard is a quantized tensor subclass (TE's QuantizedTensor) rather than a plain tensor."""
    with torch.no_grad():
        return type(param.to_local()) not in (torch.Tensor, nn.Parameter)
