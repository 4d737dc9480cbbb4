"""TE's FP8 dot-product attention in the attention modules whose cores a plan puts in FP8.

The user's attention module keeps its code: it calls F.scaled_dot_product_attention(q, k, v, ...) with q, k, v as
[batch, heads, seq, head_dim], as torch's attention does. fp8_attention_in(module) gives the module a
TEScaledDotProductAttention (a te.pytorch.DotProductAttention, qkv_format bshd) and switches the module to a subclass
whose forward runs under a torch function mode that sends the SDPA calls made inside it, and only those, to TE's
attention under TE's autocast with the plan's recipe (its fp8_dpa set, so TE casts Q, K and V to FP8 and runs its
fused cuDNN FP8 kernel). Modules are found by the plan's fqns, never by name. A call TE's FP8 kernel cannot take (a
mask tensor, dropout, another scale) raises; a forward that makes no SDPA call raises: the plan's FP8 attention
never quietly runs in BF16.

Under torch.compile the mode is traced (dynamo supports torch function modes) and TE's attention runs eagerly, as
the TE linears do (te_modules): a graph break at each call.

Imports TransformerEngine at the top: fp8stack.backends.te imports this module only once it knows TE loads.
"""

import math
from functools import cache

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te
from torch import nn
from torch.overrides import TorchFunctionMode
from transformer_engine.common.recipe import Recipe

from fp8stack.plan import PlanError

ATTENTION_CHILD = "te_fp8_attention"
"""The name under which an attention module holds its TEScaledDotProductAttention (its state_dict gains
`<module>.te_fp8_attention._extra_state`: TE's FP8 scaling state, checkpointed like the TE linears')."""
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""F.scaled_dot_product_attention's parameters, in order."""
INPUT_DTYPES = (torch.bfloat16, torch.float16)
"""What TE's FP8 attention takes Q, K and V in (it casts them to FP8 itself)."""


class TEScaledDotProductAttention(te.DotProductAttention):
    """te.pytorch.DotProductAttention answering SDPA's calls: q, k, v [batch, heads, seq, head_dim] in, the same
    layout out, under TE's autocast with `recipe` (whose fp8_dpa is set)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, recipe: Recipe, name: str) -> None:
        super().__init__(heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0, qkv_format="bshd",
                         attn_mask_type="causal", name=name)
        self.autocast_recipe = recipe
        """The plan's TE recipe, with fp8_dpa set."""
        self.where = name
        """The attention module's fqn, for errors."""
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.awaiting_call = False
        """Set when its attention module's forward starts, cleared by the first SDPA call it answers."""

    @torch.compiler.disable
    def sdpa(self, call: dict) -> torch.Tensor:
        """One F.scaled_dot_product_attention call (its arguments by name) through TE's FP8 attention."""
        q, k, v = call["query"], call["key"], call["value"]
        self._check(call, q, k, v)
        self.awaiting_call = False
        batch, heads, seq, head_dim = q.shape
        bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
        with te.autocast(enabled=True, recipe=self.autocast_recipe):
            out = self(*bshd, attn_mask_type="causal" if call.get("is_causal", False) else "no_mask")
        return out.reshape(batch, seq, heads, head_dim).transpose(1, 2)

    def _check(self, call: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Refuse, naming the fix, what TE's fused FP8 attention cannot compute as SDPA would."""
        where = f"{self.where} calls F.scaled_dot_product_attention"
        drop = "or drop --fp8-dot-product-attention"
        if call.get("attn_mask") is not None:
            raise PlanError(f"{where} with an attn_mask tensor, and TE's FP8 attention takes causal or no mask only: "
                            f"pass is_causal=True instead of a causal mask tensor, {drop}")
        if call.get("dropout_p", 0.0):
            raise PlanError(f"{where} with dropout_p={call['dropout_p']}, and TE's fused FP8 attention has no dropout: "
                            f"pass dropout_p=0.0, {drop}")
        scale = call.get("scale")
        if scale is not None and not math.isclose(scale, 1 / math.sqrt(self.head_dim), rel_tol=1e-6):
            raise PlanError(f"{where} with scale={scale}, and its FP8 attention scales by 1/sqrt(head_dim) (SDPA's "
                            f"default): leave scale unset, {drop}")
        if any(t.dim() != 4 for t in (q, k, v)) or q.dtype not in INPUT_DTYPES:
            raise PlanError(f"{where} with {q.dim()}-D {q.dtype} tensors; TE's FP8 attention takes 4-D [batch, heads, "
                            "seq, head_dim] BF16 or FP16 ones: run the activations in BF16 (torch.autocast), "
                            f"{drop}")
        shape = (q.shape[1], k.shape[1], q.shape[-1])
        if shape != (self.heads, self.kv_heads, self.head_dim) or v.shape[1] != k.shape[1]:
            raise PlanError(f"{where} with {q.shape[1]} query and {k.shape[1]} key/value heads of dim {q.shape[-1]}, "
                            f"but its FP8 attention was built for {self.heads} and {self.kv_heads} of dim "
                            f"{self.head_dim} from its n_heads, n_kv_heads and head_dim attributes: give the module "
                            f"n_kv_heads (its key/value heads) matching its calls, {drop}")
        if k.shape[1] != q.shape[1] and not call.get("enable_gqa", False):
            raise PlanError(f"{where} with {q.shape[1]} query and {k.shape[1]} key/value heads without enable_gqa, "
                            "which SDPA refuses: pass enable_gqa=True")


class _SDPAToTE(TorchFunctionMode):
    """Sends every F.scaled_dot_product_attention call made while it is active to `attention`."""

    def __init__(self, attention: TEScaledDotProductAttention) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention.sdpa({**dict(zip(SDPA_PARAMETERS, args)), **kwargs})
        return func(*args, **kwargs)


class _AttendsInFP8:
    """Mixin: the attention module's forward runs with its SDPA calls sent to its TEScaledDotProductAttention."""

    def forward(self, *args, **kwargs):
        attention = getattr(self, ATTENTION_CHILD)
        _await_call(attention)
        with _SDPAToTE(attention):
            out = super().forward(*args, **kwargs)
        _require_call(attention)
        return out


@torch.compiler.disable
def _await_call(attention: TEScaledDotProductAttention) -> None:
    attention.awaiting_call = True


@torch.compiler.disable
def _require_call(attention: TEScaledDotProductAttention) -> None:
    """A forward that made no SDPA call ran its attention some other way, in high precision: refuse it."""
    if attention.awaiting_call:
        raise PlanError(f"{attention.where}'s forward made no F.scaled_dot_product_attention call, so the plan's FP8 "
                        "attention did not run: compute attention with F.scaled_dot_product_attention in that module, "
                        "or drop --fp8-dot-product-attention")


@cache
def _fp8_attention_class(cls: type) -> type:
    """`cls` with its SDPA calls sent to TE's FP8 attention (one class per attention class)."""
    return type(f"FP8Attention{cls.__name__}", (_AttendsInFP8, cls),
                {"__module__": cls.__module__, "__doc__": f"{cls.__name__} with TE's FP8 dot-product attention."})


def fp8_attention_for(module: nn.Module, recipe: Recipe, name: str) -> TEScaledDotProductAttention:
    """The TEScaledDotProductAttention for the attention module `module` at `name`, sized from its n_heads, head_dim
    and (for grouped-query attention) n_kv_heads attributes; the module is not touched (install_fp8_attention)."""
    if isinstance(module, _AttendsInFP8):
        raise PlanError(f"{name} runs TE's FP8 attention already: convert the model once")
    if ATTENTION_CHILD in dict(module.named_children()) or hasattr(module, ATTENTION_CHILD):
        raise PlanError(f"{name} has an attribute {ATTENTION_CHILD!r}, where its FP8 attention goes: rename it")
    heads, head_dim = module.n_heads, module.head_dim
    kv_heads = getattr(module, "n_kv_heads", heads)
    sizes = {"n_heads": heads, "n_kv_heads": kv_heads, "head_dim": head_dim}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes.values()) or heads % kv_heads:
        raise PlanError(f"{name}: TE's FP8 attention is sized from the module's {sizes}, which must be positive "
                        "integers with n_heads a multiple of n_kv_heads: set them so")
    return TEScaledDotProductAttention(heads, kv_heads, head_dim, recipe, name).train(module.training)


def install_fp8_attention(module: nn.Module, attention: TEScaledDotProductAttention) -> None:
    """Give `module` its FP8 attention and switch it to the subclass whose SDPA calls go there (in place: its
    parameters, state_dict keys and hooks stay)."""
    module.add_module(ATTENTION_CHILD, attention)
    module.__class__ = _fp8_attention_class(type(module))
