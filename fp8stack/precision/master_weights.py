"""BF16 parameters with FP32 master weights, as Megatron's --bf16 keeps them, for any model and optimizer.

    masters = MasterWeights(model)                                # after assemble(): parameters become BF16
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=3e-4, fused=True))
    ... the loop as before; clip the optimizer's parameters (the masters), whose .grad are FP32 ...

With FP32 parameters under autocast, every forward casts each weight to BF16 again, at every micro-batch of a step
(TE modules too: they cache FP8 weight casts across micro-batches, not BF16 ones). Here the model's parameters are
BF16, so forwards read them as they are; AdamW steps FP32 copies (the masters), and the BF16 parameters are
copied from them once per step. Each micro-batch's gradient lands in an FP32 main_grad per parameter: TE's
fused weight-gradient GEMMs (fuse_wgrad_accumulation) write into it themselves, every other parameter's BF16
gradient is added into it by a hook as soon as autograd has it (no BF16 accumulation across micro-batches).
Embeddings hand that hook sparse gradients (nn.Embedding.sparse), so only the rows a micro-batch looked up are added
instead of a dense table-sized gradient. The masters' .grad are those main_grads, so clipping and AdamW read FP32
gradients.

Weights a backend holds in FP8 only (TE's fp8_weights) stay FP8: their masters start from the FP32 values the backend
quantized them from, and copying a master into such a weight quantizes it (TE's QuantizedTensor.copy_), with the scale
the recipe keeps for that weight.
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fp8stack.assembly import assembly_state, post_optimizer_step_hook


class MasterWeights:
    """The FP32 masters of a model whose parameters this makes BF16 (weights held in FP8 only stay FP8); `module`
    holds them under the model's names (what the optimizer steps and a checkpoint saves). After each optimizer step
    after_step() must run: track(optimizer) makes the optimizer run it (with the assembly's post-step hook)."""

    def __init__(self, model: nn.Module):
        named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        wrong = sorted({str(p.dtype) for p in named.values()} - {"torch.float32"})
        if wrong:
            raise RuntimeError(f"BF16 parameters start from FP32 ones, found {wrong}: build the model in FP32")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("MasterWeights keeps the main_grads of one process, which no data-parallel wrapper "
                               f"reduces, and this process group has {dist.get_world_size()} ranks: train one process "
                               "with it, or keep FP32 parameters under FSDP's mixed precision")
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
        for param in self.params:
            if getattr(param, "main_grad", None) is None:
                param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                param.register_post_accumulate_grad_hook(_into_main_grad)
            if id(param) not in fp8_values:
                param.data = param.data.to(torch.bfloat16)
        self._link_grads()
        model.register_forward_pre_hook(self._link_unlinked_grads)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The FP32 masters: what the optimizer steps (and gradient clipping reads: their .grad are the main_grads)."""
        return iter(self.masters)

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` (over parameters()), set to run after_step() and the assembly's post-step hook after each of
        its steps."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not held <= set(map(id, self.masters)):
            raise ValueError("the optimizer holds parameters that are not these master weights: build it over "
                             "masters.parameters(), not model.parameters() (the model's are BF16 copies)")
        after_assembly = post_optimizer_step_hook(self.model)
        optimizer.register_step_post_hook(lambda *_hook_args: (self.after_step(), after_assembly()))
        return optimizer

    def after_step(self) -> None:
        """The BF16 (and FP8) parameters from the stepped masters; main_grads zeroed for the next step (and the masters'
        .grad, which optimizer.zero_grad(set_to_none=True) let go, pointed at them again)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master)
                param.main_grad.zero_()
        self._link_grads()

    def _link_grads(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = param.main_grad

    def _link_unlinked_grads(self, *_hook_args) -> None:
        """Before a forward: optimizer.zero_grad(set_to_none=True) let the masters' .grad go; point them at the
        main_grads the coming backward accumulates into."""
        if self.masters and self.masters[0].grad is None:
            self._link_grads()


def _into_main_grad(param: torch.Tensor) -> None:
    """Add a micro-batch's BF16 gradient into the FP32 main_grad, then drop it."""
    grad = param.grad
    if grad.is_sparse:  # an embedding's looked-up rows, one per token (uncoalesced: repeated rows add up here)
        param.main_grad.index_add_(0, grad._indices()[0], grad._values().to(param.main_grad.dtype))
    else:
        param.main_grad.add_(grad)
    param.grad = None


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
