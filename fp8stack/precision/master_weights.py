"""BF16 parameters with FP32 master weights, as Megatron's --bf16 keeps them, for any model and optimizer.

    masters = MasterWeights(model)                                # after assemble(): parameters become BF16
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=3e-4, fused=True))
    ... the loop as before; clip the optimizer's parameters (the masters), whose .grad are FP32 ...

With FP32 parameters under autocast, every forward casts each weight to BF16 again, at every micro-batch of a step
(TE modules too: they cache FP8 weight casts across micro-batches, not BF16 ones). Here the model's parameters are
BF16, so forwards read them as they are; AdamW steps FP32 copies (the masters), and the BF16 parameters are
copied from them once per step. Each micro-batch's gradient lands in an FP32 main_grad per parameter: TE's
fused weight-gradient GEMMs (fuse_wgrad_accumulation) and grouped_fp8's blockwise expert wgrad GEMMs write into it
themselves (so do the BF16 grouped experts' wgrad GEMMs), every other parameter's BF16 gradient is added into it by
a hook as soon as autograd has it (no BF16 accumulation across micro-batches).
Embeddings hand that hook sparse gradients (nn.Embedding.sparse), so only the rows a micro-batch looked up are added
instead of a dense table-sized gradient. The masters' .grad are those main_grads, so clipping and AdamW read FP32
gradients.

Weights a backend holds in FP8 only (TE's fp8_weights) stay FP8: their masters start from the FP32 values the backend
quantized them from, and copying a master into such a weight quantizes it (TE's QuantizedTensor.copy_), with the scale
the recipe keeps for that weight.

With data_parallel (a process group or 1-D device mesh of replicas), the main_grads are averaged over its ranks in the
backward not run inside masters.no_sync() (fp8stack.precision.data_parallel): DDP with Megatron's FP32 gradient
buffers, TE's fused weight-gradient accumulation included. Each bucket's all-reduce starts as soon as its gradients are
final, while the backward goes on (OverlappedAverage): TE reports a weight whose main_grad its GEMM wrote by handing
autograd a placeholder gradient (Megatron's grad_added_to_main_grad protocol), whose hook marks it ready and drops it.

    masters = MasterWeights(model, data_parallel=mesh)
    for i, batch in enumerate(micro_batches):
        with masters.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss_fn(model(batch)).backward()

With release_main_grads the main_grads live only from a step's first backward to its optimizer step (across its
micro-batches), as torchtitan's gradients set to None after each step do: after_step() frees them, and each bucket is
allocated again, zeroed, when the next backward first needs it (4 bytes per parameter fewer between steps and in a
step's first backward: the peak falls where a step runs one micro-batch). The GEMMs that write main_grad themselves
fetch it in their backward: TE's through get_main_grad(), which TE calls for a weight marked __fsdp_param__ (its
Megatron-FSDP hook), grouped experts through get_main_grad() too (GroupedExperts.main_grad_of).
"""

import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fp8stack.assembly import assembly_state, post_optimizer_step_hook
from fp8stack.precision.data_parallel import (BUCKET_BYTES, AtBackwardEnd, OverlappedAverage, broadcast_from_first,
                                              buckets, process_group, refuse_sharded)


class SteppedMasters:
    """What a keeper of FP32 masters offers the optimizer: the masters to step, and the hook that copies them into the
    model after each step. Subclasses set model, masters and after_step()."""

    masters: list[nn.Parameter]
    model_holds: str = "BF16 copies"
    """What the model's own parameters are, for the error that names them."""

    @property
    def model(self) -> nn.Module:
        """The model these are the masters of, held weakly: its hooks hold this for as long as it lives, and a strong
        reference back would make a cycle only the collector frees, which keeps a finished run's model, masters and
        main_grads on the GPU while the next run starts (the collector seldom visits objects that old)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the model of these master weights is gone")
        return model

    @model.setter
    def model(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def after_step(self) -> None:
        raise NotImplementedError

    def parameters(self) -> Iterator[nn.Parameter]:
        """The FP32 masters: what the optimizer steps (and gradient clipping reads)."""
        return iter(self.masters)

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` (over parameters()), set to run after_step() and the assembly's post-step hook after each of
        its steps."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not held <= set(map(id, self.masters)):
            raise ValueError("the optimizer holds parameters that are not these master weights: build it over "
                             f"masters.parameters(), not model.parameters() (the model's are {self.model_holds})")
        after_assembly = post_optimizer_step_hook(self.model)
        optimizer.register_step_post_hook(lambda *_hook_args: (self.after_step(), after_assembly()))
        return optimizer


def _held_weakly(method: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """`method`, a MasterWeights' method of a parameter, as a callable that holds the MasterWeights weakly (for a
    parameter's gradient hook or its get_main_grad). A tensor keeps its hooks in C++,
    where the collector cannot follow a cycle: a strong hook would keep the model, its masters and its main_grads
    alive for the rest of the process (a second model built in it, as a profile's FP8 run after its BF16 one, then
    finds the GPU full). The model's forward pre-hook holds the MasterWeights as long as the model lives."""
    held = weakref.WeakMethod(method)
    return lambda param: held()(param)


def _main_grad_getter(masters: "MasterWeights", param: nn.Parameter) -> Callable[[], torch.Tensor]:
    """param.get_main_grad() with release_main_grads, holding both weakly: the parameter holds it, and a strong
    reference would make a cycle (through the parameter itself, or the MasterWeights holding the parameters)."""
    main_grad_of, held = _held_weakly(masters._main_grad), weakref.ref(param)
    return lambda: main_grad_of(held())


class MasterWeights(SteppedMasters):
    """The FP32 masters of a model whose parameters this makes BF16 (weights held in FP8 only stay FP8); `module`
    holds them under the model's names (what the optimizer steps and a checkpoint saves). After each optimizer step
    after_step() must run: track(optimizer) makes the optimizer run it (with the assembly's post-step hook)."""

    def __init__(self, model: nn.Module, data_parallel: dist.ProcessGroup | DeviceMesh | None = None,
                 bucket_bytes: int = BUCKET_BYTES, release_main_grads: bool = False):
        named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        wrong = sorted({str(p.dtype) for p in named.values()} - {"torch.float32"})
        if wrong:
            raise RuntimeError(f"BF16 parameters start from FP32 ones, found {wrong}: build the model in FP32")
        refuse_sharded(model, "MasterWeights")
        if data_parallel is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"this process group has {dist.get_world_size()} ranks, and MasterWeights without "
                               "data_parallel keeps one process's main_grads: pass data_parallel=<the replicas' "
                               "process group or 1-D mesh> to average them (DDP), or fully_shard the model (FSDP2)")
        backends = assembly_state(model).backends
        fp8_values = {pid: value for backend in backends for pid, value in backend.take_master_values(model).items()}
        self.model = model
        self.params = list(named.values())
        """The model's parameters, BF16 (or FP8) once constructed."""
        masters = {name: nn.Parameter(fp8_values[id(p)].to(p.device) if id(p) in fp8_values else p.detach().clone())
                   for name, p in named.items()}
        self.masters = list(masters.values())
        """The FP32 masters, in the order of params."""
        self.module = _holding(masters)
        """An nn.Module with the FP32 masters under the model's parameter names."""
        self._master_of = {id(param): master for param, master in zip(self.params, self.masters, strict=True)}
        for backend in backends:  # main_grads a backend's modules accumulate into are ours from here on
            backend.hand_over_main_grads(model)
        ours = set(map(id, self.params))
        for module in model.modules():
            if isinstance(module, nn.Embedding) and id(module.weight) in ours:
                module.sparse = True
        written_by_backend = {id(p) for p in self.params if getattr(p, "main_grad", None) is not None}
        self.release_main_grads = release_main_grads
        """The main_grads are freed by after_step() and allocated again by the next backward (see the module)."""
        self._members = buckets(self.params, bucket_bytes, element_size=4)  # FP32 main_grads
        self._bucket_of = {id(param): index for index, run in enumerate(self._members) for param in run}
        self.buffers: list[torch.Tensor | None] = [None] * len(self._members)
        """The FP32 buffers every main_grad is a view into: zeroed, and averaged over the replicas, whole. With
        release_main_grads a bucket's is None from after_step() until a backward needs it."""
        if release_main_grads:
            _drop_backend_main_grads([p for p in self.params if id(p) in written_by_backend])
            for param in self.params:
                param.get_main_grad = _main_grad_getter(self, param)
                if id(param) in written_by_backend:  # TE fetches main_grad in its backward from get_main_grad()
                    param.__fsdp_param__ = True
        else:
            for index in range(len(self.buffers)):
                self._allocate(index)
        self.group = process_group(data_parallel) if data_parallel is not None else None
        """The replicas' process group (data_parallel), or None."""
        self._average = (OverlappedAverage(self.buffers, self._members, self.group) if self.group is not None
                         else None)
        for param in self.params:
            if id(param) not in written_by_backend:
                param.register_post_accumulate_grad_hook(_held_weakly(self._into_main_grad))
            elif self._average is not None:  # TE hands autograd a placeholder once its GEMM wrote the main_grad
                param.grad_added_to_main_grad = False
                param.register_post_accumulate_grad_hook(_held_weakly(self._written_by_backend))
        if self.group is not None:
            broadcast_from_first(self.masters, self.group)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                if id(param) not in fp8_values:
                    param.data = param.data.to(torch.bfloat16)
                if self.group is not None:
                    param.copy_(master)
        # Released main_grads: every bucket exists at a backward's end, so that the optimizer steps a parameter the
        # backward did not reach with a zero gradient, as it does the persistent buffers'. The model's hook holds it
        # (and it this), so this holds it weakly.
        self._at_backward_end = (weakref.ref(AtBackwardEnd(model, self.reduce_grads, at_forward=self._average.arm
                                                           if self._average is not None else None))
                                 if self._average is not None or release_main_grads else None)
        model.register_forward_pre_hook(self._link_unlinked_grads)

    def after_step(self) -> None:
        """The BF16 (and FP8) parameters from the stepped masters; main_grads zeroed for the next step (and the masters'
        .grad, which optimizer.zero_grad(set_to_none=True) let go, pointed at them again), or freed with
        release_main_grads (the masters' .grad None until the next backward)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master)
            if self.release_main_grads:
                self._release()
            else:
                for buffer in self.buffers:
                    buffer.zero_()
        self._link_grads()

    def no_sync(self):
        """With data_parallel: forwards and backwards in here accumulate into the main_grads without averaging them
        (all micro-batches but a step's last). Without, nothing to hold back."""
        at_backward_end = self._at_backward_end() if self._at_backward_end else None
        return at_backward_end.no_sync() if at_backward_end else nullcontext()

    def reduce_grads(self) -> None:
        """Average the main_grads over data_parallel's ranks now (what the end of a backward outside no_sync does,
        having started the buckets whose gradients were final on the way); released buckets the backward did not
        reach are allocated (zero) first."""
        for index in range(len(self.buffers)):
            if self.buffers[index] is None:
                self._allocate(index)
        if self._average is not None:
            self._average.finish()

    def _into_main_grad(self, param: torch.Tensor) -> None:
        """Add a micro-batch's BF16 gradient into the FP32 main_grad, then drop it. None: a module's GEMM added it
        into the main_grad itself and handed autograd no gradient (a backend's hand_over_main_grads turned that on),
        and autograd still runs this hook, so the parameter is reported ready all the same."""
        grad = param.grad
        if grad is None:
            pass
        elif grad.is_sparse:  # an embedding's looked-up rows, one per token (uncoalesced: repeated rows add up here)
            main_grad = self._main_grad(param)
            main_grad.index_add_(0, grad._indices()[0], grad._values().to(main_grad.dtype))
        else:
            self._main_grad(param).add_(grad)
        param.grad = None
        if self._average is not None:
            self._average.ready(param)

    def _written_by_backend(self, param: torch.Tensor) -> None:
        """A backend's GEMM wrote this micro-batch's gradient into the main_grad: drop the placeholder."""
        param.grad = None
        self._average.ready(param)

    def _main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """param's main_grad, its bucket allocated first if released (param.get_main_grad with release_main_grads)."""
        index = self._bucket_of[id(param)]
        if self.buffers[index] is None:
            self._allocate(index)
        return param.main_grad

    def _allocate(self, index: int) -> None:
        """Bucket `index`'s flat FP32 buffer, zeroed, with each parameter's main_grad a view into it (starting from
        the values of any main_grad a backend made) and its master's .grad that view."""
        run = self._members[index]
        flat = torch.zeros(sum(p.numel() for p in run), dtype=torch.float32, device=run[0].device)
        offset = 0
        for param in run:
            view = flat[offset:offset + param.numel()].view(param.shape)
            if getattr(param, "main_grad", None) is not None:
                view.copy_(param.main_grad)
            param.main_grad = view
            offset += param.numel()
        self.buffers[index] = flat
        for param in run:
            self._master_of[id(param)].grad = param.main_grad

    def _release(self) -> None:
        """Free every bucket: neither a parameter's main_grad (where TE's backward set it too) nor this holds one
        (_link_grads then lets the masters' .grad go)."""
        for index, run in enumerate(self._members):
            if self.buffers[index] is not None:
                for param in run:
                    del param.main_grad
                self.buffers[index] = None

    def _link_grads(self) -> None:
        """Each master's .grad: its parameter's main_grad, where allocated."""
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = getattr(param, "main_grad", None)

    def _link_unlinked_grads(self, *_hook_args) -> None:
        """Before a forward: optimizer.zero_grad(set_to_none=True) let the masters' .grad go; point them at the
        main_grads the coming backward accumulates into."""
        if self.masters and self.masters[0].grad is None:
            self._link_grads()


def _drop_backend_main_grads(params: list[nn.Parameter]) -> None:
    """Free the main_grads a backend made (TE's fuse_wgrad_accumulation, at conversion): released main_grads start
    each step from zero, and a gradient accumulated there before master weights took over would be lost."""
    if params and torch.stack([p.main_grad.any() for p in params]).any():
        raise RuntimeError("release_main_grads starts each step's main_grads from zero, and a backward already "
                           "accumulated gradients into the main_grads of this model's TE weights: build MasterWeights "
                           "before the first backward, or keep the main_grads (release_main_grads=False)")
    for param in params:
        del param.main_grad


def _holding(named: dict[str, nn.Parameter]) -> nn.Module:
    """A module tree holding `named`'s parameters under their dotted names."""
    root = nn.Module()
    for name, param in named.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, param)
    return root
