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
"""

from collections.abc import Iterator
from contextlib import nullcontext

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

    model: nn.Module
    masters: list[nn.Parameter]
    model_holds: str = "BF16 copies"
    """What the model's own parameters are, for the error that names them."""

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


class MasterWeights(SteppedMasters):
    """The FP32 masters of a model whose parameters this makes BF16 (weights held in FP8 only stay FP8); `module`
    holds them under the model's names (what the optimizer steps and a checkpoint saves). After each optimizer step
    after_step() must run: track(optimizer) makes the optimizer run it (with the assembly's post-step hook)."""

    def __init__(self, model: nn.Module, data_parallel: dist.ProcessGroup | DeviceMesh | None = None,
                 bucket_bytes: int = BUCKET_BYTES):
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
        for backend in backends:  # main_grads a backend's modules accumulate into are ours from here on
            backend.hand_over_main_grads(model)
        ours = set(map(id, self.params))
        for module in model.modules():
            if isinstance(module, nn.Embedding) and id(module.weight) in ours:
                module.sparse = True
        written_by_backend = {id(p) for p in self.params if getattr(p, "main_grad", None) is not None}
        self.buffers, members = _main_grad_buffers(self.params, bucket_bytes)
        """The FP32 buffers every main_grad is a view into: zeroed, and averaged over the replicas, whole."""
        self.group = process_group(data_parallel) if data_parallel is not None else None
        """The replicas' process group (data_parallel), or None."""
        self._average = OverlappedAverage(self.buffers, members, self.group) if self.group is not None else None
        for param in self.params:
            if id(param) not in written_by_backend:
                param.register_post_accumulate_grad_hook(self._into_main_grad)
            elif self._average is not None:  # TE hands autograd a placeholder once its GEMM wrote the main_grad
                param.grad_added_to_main_grad = False
                param.register_post_accumulate_grad_hook(self._written_by_backend)
        if self.group is not None:
            broadcast_from_first(self.masters, self.group)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                if id(param) not in fp8_values:
                    param.data = param.data.to(torch.bfloat16)
                if self.group is not None:
                    param.copy_(master)
        self._at_backward_end = (AtBackwardEnd(model, self.reduce_grads, at_forward=self._average.arm)
                                 if self._average is not None else None)
        self._link_grads()
        model.register_forward_pre_hook(self._link_unlinked_grads)

    def after_step(self) -> None:
        """The BF16 (and FP8) parameters from the stepped masters; main_grads zeroed for the next step (and the masters'
        .grad, which optimizer.zero_grad(set_to_none=True) let go, pointed at them again)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master)
            for buffer in self.buffers:
                buffer.zero_()
        self._link_grads()

    def no_sync(self):
        """With data_parallel: forwards and backwards in here accumulate into the main_grads without averaging them
        (all micro-batches but a step's last). Without, nothing to hold back."""
        return self._at_backward_end.no_sync() if self._at_backward_end else nullcontext()

    def reduce_grads(self) -> None:
        """Average the main_grads over data_parallel's ranks now (what the end of a backward outside no_sync does,
        having started the buckets whose gradients were final on the way)."""
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
            param.main_grad.index_add_(0, grad._indices()[0], grad._values().to(param.main_grad.dtype))
        else:
            param.main_grad.add_(grad)
        param.grad = None
        if self._average is not None:
            self._average.ready(param)

    def _written_by_backend(self, param: torch.Tensor) -> None:
        """A backend's GEMM wrote this micro-batch's gradient into the main_grad: drop the placeholder."""
        param.grad = None
        self._average.ready(param)

    def _link_grads(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = param.main_grad

    def _link_unlinked_grads(self, *_hook_args) -> None:
        """Before a forward: optimizer.zero_grad(set_to_none=True) let the masters' .grad go; point them at the
        main_grads the coming backward accumulates into."""
        if self.masters and self.masters[0].grad is None:
            self._link_grads()


def _main_grad_buffers(params: list[nn.Parameter], bucket_bytes: int
                       ) -> tuple[list[torch.Tensor], list[list[nn.Parameter]]]:
    """Flat FP32 buffers, in buckets of about bucket_bytes, with each parameter's main_grad a view into one (starting
    from the values of any main_grad a backend made); and each buffer's parameters."""
    flats, runs = [], buckets(params, bucket_bytes, element_size=4)  # FP32 main_grads
    for run in runs:
        flat = torch.zeros(sum(p.numel() for p in run), dtype=torch.float32, device=run[0].device)
        offset = 0
        for param in run:
            view = flat[offset:offset + param.numel()].view(param.shape)
            if getattr(param, "main_grad", None) is not None:
                view.copy_(param.main_grad)
            param.main_grad = view
            offset += param.numel()
        flats.append(flat)
    return flats, runs


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
