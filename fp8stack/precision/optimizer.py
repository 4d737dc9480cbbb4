"""AdamW over FP32 master weights, its two moments kept in FP32 or BF16, for any model and loop.

    optimizer = adamw(model.parameters(), moments="bf16", lr=3e-4)       # or masters.parameters() (MasterWeights)

moments="fp32" is torch.optim.AdamW (fused on CUDA): 8 bytes of moments per parameter. moments="bf16" is
TransformerEngine's FusedAdam with BF16 exp_avg and exp_avg_sq (DeepSeek-V3's optimizer states; Megatron's
--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 builds the same one): 4 bytes per
parameter. Its kernel reads each BF16 moment, updates it in FP32 and rounds it back to BF16 in place (no FP32 copy of
the moments at the step). The parameters it steps stay the FP32 masters, and so does the update's arithmetic; only
the stored moments round. FusedAdam keeps one step count per parameter group and its state_dict() hands the moments
out in FP32 (exactly the BF16 values), which its load_state_dict() rounds back, so a checkpoint restores them bit for
bit. It takes FSDP2's and tensor parallelism's DTensor parameters (its states are DTensors of the same placements).
"""

from collections.abc import Iterable

import torch

MOMENTS = ("fp32", "bf16")
"""How AdamW stores its two moments: fp32 (torch's AdamW) or bf16 (TransformerEngine's FusedAdam)."""
NEED = "BF16 Adam moments need TransformerEngine's FusedAdam on a GPU"
"""What BF16 moments need, as the refusals say it."""


def adamw(params: Iterable[torch.Tensor] | Iterable[dict], *, moments: str = "fp32", lr: float = 1e-3,
          betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2
          ) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) over `params` (tensors or parameter groups, as torch.optim.AdamW takes them),
    its moments stored in `moments` (MOMENTS); the defaults are torch.optim.AdamW's. fp32: torch.optim.AdamW, fused
    when the parameters are on CUDA. bf16: TransformerEngine's FusedAdam with BF16 moments, over FP32 CUDA
    parameters (the masters: fp8stack.precision.MasterWeights keeps them for BF16 or FP8 models)."""
    if moments not in MOMENTS:
        raise ValueError(f"unknown moments {moments!r}: use {', '.join(MOMENTS)}")
    params = list(params)
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    if moments == "fp32":
        fused = bool(tensors) and tensors[0].device.type == "cuda"
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
    _check_bf16_moments_params(tensors)
    fused_adam = te_fused_adam()
    return fused_adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True,
                      exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def te_fused_adam() -> type[torch.optim.Optimizer]:
    """TransformerEngine's FusedAdam class, or ImportError saying what BF16 moments need."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as err:  # TE raises more than ImportError when it finds no CUDA or a mismatched build
        raise ImportError(f"{NEED}, and transformer_engine does not import "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:200]}): pip install "
                          "'fp8stack[te]' on a GPU machine, or keep moments fp32") from None
    return FusedAdam


def keeps_step_per_group(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is TE's FusedAdam, which counts steps per parameter group (param_groups[i]['step']) and
    makes its states in its own dtypes (initialize_state), where torch's AdamW keeps a step per parameter."""
    return type(optimizer).__module__.startswith("transformer_engine.")


def _check_bf16_moments_params(tensors: list[torch.Tensor]) -> None:
    """FusedAdam steps BF16 parameters in place without masters, and runs on CUDA only: refuse both."""
    if any(p.device.type != "cuda" for p in tensors):
        raise ValueError(f"{NEED}, and some parameters are not on CUDA: move the model "
                         "to the GPU, or keep moments fp32")
    wrong = sorted({str(p.dtype) for p in tensors} - {"torch.float32"})
    if wrong:
        raise ValueError(f"BF16 Adam moments step FP32 master weights, and some parameters are {', '.join(wrong)}: "
                         "step the FP32 masters (fp8stack.precision.MasterWeights(model).parameters())")
