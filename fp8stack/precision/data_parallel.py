"""Data parallelism by replicas (DDP), for any model and loop: every rank holds the whole model, and its FP32
gradients are averaged over the ranks once per optimizer step, as torch's and Megatron's DistributedDataParallel do.

    grads = DataParallelGradients(model, mesh)      # after assemble(); FP32 parameters (autocast computes in BF16)
    for i, batch in enumerate(micro_batches):
        with grads.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss_fn(model(batch)).backward()       # the last backward ends by averaging the gradients
    clip_grad_norm_(...); optimizer.step()

A model with BF16 or FP8 parameters gets the same through fp8stack.precision.MasterWeights(model, data_parallel=mesh),
whose FP32 main_grads (TE's fused weight-gradient GEMMs write into them) are the buffers averaged.

Unlike torch's DistributedDataParallel this wraps nothing: the model, its state-dict keys and its compiled blocks stay
as they are, and TE's fused weight-gradient accumulation, which writes into main_grad outside autograd's hooks, is
reduced with everything else. DataParallelGradients averages at the end of the backward, in buckets of BUCKET_BYTES all
in flight at once; MasterWeights starts each bucket's average during the last micro-batch's backward, as soon as its
gradients are final (OverlappedAverage), so the communication hides behind the rest of the backward.
"""

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

BUCKET_BYTES = 128 * 2**20
"""Gradient bytes per all-reduce: large enough that each collective runs near bus bandwidth (NCCL reaches it from a
few tens of MB), few enough collectives that their launch cost is negligible per step."""


def process_group(data_parallel: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """The process group of a 1-D device mesh (or the group itself)."""
    if isinstance(data_parallel, DeviceMesh):
        if data_parallel.ndim != 1:
            raise ValueError(f"data_parallel is a {data_parallel.ndim}-D device mesh: pass its data-parallel "
                             "dimension (mesh['dp']) or a process group")
        return data_parallel.get_group()
    return data_parallel


def refuse_sharded(model: nn.Module, what: str) -> None:
    """Replicas need whole parameters: refuse a model fully_shard or tensor parallelism has split."""
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        raise ValueError(f"{what} keeps whole replicas of the parameters, and this model is fully_shard'ed: FSDP2 "
                         "reduce-scatters its gradients itself (its MixedPrecisionPolicy keeps sharded FP32 masters; "
                         "fp8stack.precision.ShardedMasterWeights those of FP8 weights)")
    sharded = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:
        raise ValueError(f"{what} keeps whole replicas of the parameters, and {sharded!r} is a DTensor (tensor "
                         "parallelism): combine tensor parallelism with fully_shard (a 2-D mesh) instead")


class AtBackwardEnd:
    """Runs `action` once at the end of every backward through `model`'s output, unless the forward ran inside
    no_sync() (as with DDP, the forward decides: run the forward and backward of accumulation micro-batches in it);
    `at_forward`, if given, at each such forward's end, before its backward."""

    def __init__(self, model: nn.Module, action: Callable[[], None], at_forward: Callable[[], None] | None = None):
        self._action = action
        self._at_forward = at_forward
        self._sync = True
        self._queued = False
        model.register_forward_hook(self._watch_output)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards (and their backwards) in here only accumulate gradients."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _watch_output(self, _module, _args, output) -> None:
        if not (self._sync and torch.is_grad_enabled()):
            return
        tensor = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is not None:
            if self._at_forward is not None:
                self._at_forward()
            tensor.register_hook(self._queue_action)

    def _queue_action(self, _grad: torch.Tensor) -> None:
        """A backward reached the output: run the action once that backward has finished."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run_action)

    def _run_action(self) -> None:
        self._queued = False
        self._action()


def average(buffers: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average each FP32 buffer over `group` in place, all buckets in flight at once."""
    for handle in [start_average(buffer, group) for buffer in buffers]:
        handle.wait()


def start_average(buffer: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start averaging `buffer` over `group` in place: divided first, then summed (gloo has no AVG)."""
    buffer.div_(dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True)


class OverlappedAverage:
    """Averages flat FP32 gradient buffers over `group` while the backward still runs, as torch's and Megatron's DDP
    do: once armed (at the forward of a step's last micro-batch), each buffer's all-reduce starts as soon as every
    parameter whose gradient it holds has reported ready() (from its post-accumulate-grad hook, once its gradient is
    in the buffer); finish() starts the buffers still waiting (parameters this backward did not reach) and waits for
    all. `members[i]`: the parameters whose gradients buffers[i] holds."""

    def __init__(self, buffers: list[torch.Tensor], members: list[list[torch.Tensor]], group: dist.ProcessGroup):
        self.buffers, self.group = buffers, group
        self._bucket_of = {id(param): index for index, run in enumerate(members) for param in run}
        self._sizes = [len({id(param) for param in run}) for run in members]
        self._ready: list[set[int]] | None = None
        self._handles: dict[int, dist.Work] = {}

    def arm(self) -> None:
        """The coming backward ends the step: average each buffer as soon as it is complete."""
        self._ready = [set() for _ in self.buffers]

    def ready(self, param: torch.Tensor) -> None:
        """`param`'s gradient of this backward is in its buffer (nothing to do unless armed)."""
        if self._ready is None:
            return
        index = self._bucket_of[id(param)]
        self._ready[index].add(id(param))
        if len(self._ready[index]) == self._sizes[index] and index not in self._handles:
            self._start(index)

    def finish(self) -> None:
        """Start every buffer not started yet and wait for all: the buffers hold the averages."""
        for index in range(len(self.buffers)):
            if index not in self._handles:
                self._start(index)
        for handle in self._handles.values():
            handle.wait()
        self._ready, self._handles = None, {}

    def _start(self, index: int) -> None:
        self._handles[index] = start_average(self.buffers[index], self.group)


def buckets(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES,
            element_size: int | None = None) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs on one device of about bucket_bytes each (a larger tensor is a run of its
    own); element_size: the bytes per element to count (default each tensor's own)."""
    runs: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * (element_size or tensor.element_size())
        if not runs or size + nbytes > bucket_bytes or runs[-1][-1].device != tensor.device:
            runs.append([])
            size = 0
        runs[-1].append(tensor)
        size += nbytes
    return runs


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every replica starts from the group's first rank's values (as DDP does at construction)."""
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=first, group=group)


class DataParallelGradients:
    """Averages the gradients of `model`'s trainable FP32 parameters over `data_parallel`'s ranks at the end of each
    backward not run inside no_sync(): each parameter's .grad (which is its FP32 main_grad where TE's fused
    weight-gradient GEMMs accumulate). The replicas start from the first rank's parameters and buffers."""

    def __init__(self, model: nn.Module, data_parallel: dist.ProcessGroup | DeviceMesh,
                 bucket_bytes: int = BUCKET_BYTES):
        refuse_sharded(model, "DataParallelGradients")
        self.params = [p for p in model.parameters() if p.requires_grad]
        """The parameters whose gradients are averaged."""
        low = sorted({str(p.dtype) for p in self.params} - {"torch.float32"})
        if low:
            raise ValueError(f"DataParallelGradients averages FP32 gradients, and the model has {', '.join(low)} "
                             "parameters: use MasterWeights(model, data_parallel=...) for BF16 or FP8 parameters")
        self.group = process_group(data_parallel)
        self.bucket_bytes = bucket_bytes
        broadcast_from_first([*self.params, *model.buffers()], self.group)
        # Held weakly: the model's hook holds it (and it this), so the model keeps both alive and nothing else.
        self._at_backward_end = weakref.ref(AtBackwardEnd(model, self.reduce_grads))

    def no_sync(self):
        """Forwards and backwards in here accumulate gradients without averaging them (all micro-batches but a step's
        last)."""
        at_backward_end = self._at_backward_end()
        return at_backward_end.no_sync() if at_backward_end else nullcontext()

    def reduce_grads(self) -> None:
        """Average the parameters' gradients over the ranks now (a parameter without one gets zeros, so that every
        rank reduces the same buffers)."""
        grads = []
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif param.grad.is_sparse:
                param.grad = param.grad.to_dense()
            grads.append(param.grad)
        runs = buckets(grads, self.bucket_bytes)
        flats = [torch._utils._flatten_dense_tensors(run) for run in runs]
        average(flats, self.group)
        for run, flat in zip(runs, flats, strict=True):
            for grad, averaged in zip(run, torch._utils._unflatten_dense_tensors(flat, run), strict=True):
                grad.copy_(averaged)
