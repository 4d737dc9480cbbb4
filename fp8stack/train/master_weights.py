"""BF16 parameters with FP32 master weights (TrainConfig.param_dtype = "bf16"), as Megatron's --bf16 keeps them.

With FP32 parameters under autocast, every forward casts each weight to BF16 again, at every micro-batch of a step
(TE modules too: they cache FP8 weight casts across micro-batches, not BF16 ones). Here the model's parameters are
BF16, so forwards read them as they are; AdamW steps FP32 copies (the masters), and the BF16 parameters are
copied from them once per step. Each micro-batch's gradient lands in an FP32 main_grad per parameter: TE's
fused weight-gradient GEMMs (fuse_wgrad_accumulation) write into it themselves, every other parameter's BF16
gradient is added into it by a hook as soon as autograd has it (no BF16 accumulation across micro-batches).
Embeddings hand that hook sparse gradients (nn.Embedding.sparse), so only the rows a micro-batch looked up are added
instead of a dense table-sized gradient. The masters' .grad are those main_grads, so clipping and AdamW read FP32
gradients.

With param_dtype fp8 the TE linears were built holding their weights in FP8 only (TEBackend.fp8_weights): those stay
FP8, their masters start from the FP32 values TE quantized them from, and copying a master into such a weight
quantizes it (TE's QuantizedTensor.copy_), with the scale the recipe keeps for that weight.
"""

import torch
from torch import nn

from fp8stack.backends.te import fp8_weight_masters


class MasterWeights:
    """The FP32 masters of a model whose parameters this makes BF16 (TE weights held in FP8 only stay FP8); `module`
    holds them under the model's names (what the optimizer steps and a checkpoint saves); call after_step() after
    each optimizer step."""

    def __init__(self, model: nn.Module):
        named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        wrong = sorted({str(p.dtype) for p in named.values()} - {"torch.float32"})
        if wrong:
            raise RuntimeError(f"BF16 parameters start from FP32 ones, found {wrong}: build the model in FP32")
        fp8_values = fp8_weight_masters(model)
        self.params = list(named.values())
        """The model's parameters, BF16 (or FP8) once constructed."""
        masters = {name: nn.Parameter(fp8_values[id(p)].to(p.device) if id(p) in fp8_values else p.detach().clone())
                   for name, p in named.items()}
        self.masters = list(masters.values())
        """The FP32 masters, in the order of params."""
        self.module = _holding(masters)
        """An nn.Module with the FP32 masters under the model's parameter names."""
        ours = set(map(id, self.params))
        for module in model.modules():
            # TE modules with fuse_wgrad_accumulation gave their weights a main_grad and make it the weight's .grad
            # at each step's first forward, which a BF16 parameter cannot take: from here on these main_grads are ours.
            if getattr(module, "main_grad_weights", ()):
                module.main_grad_weights = ()
            if isinstance(module, nn.Embedding) and id(module.weight) in ours:
                module.sparse = True
        for param in self.params:
            if getattr(param, "main_grad", None) is None:
                param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                param.register_post_accumulate_grad_hook(_into_main_grad)
            if id(param) not in fp8_values:
                param.data = param.data.to(torch.bfloat16)
        self._link_grads()

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
