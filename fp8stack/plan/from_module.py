"""Derive a ModelDescription from a built nn.Module by walking it (duck-typed, works on meta tensors).

What each module becomes:
  nn.Embedding                                   -> embedding (n = embedding_dim, k = num_embeddings)
  RMSNorm / LayerNorm / *Norm* with a 1-D weight -> norm (n = k = width)
  a 2-D weight with in_features / out_features   -> linear; head if it sits outside the blocks and
                                                    writes one logit per embedding row (or shares
                                                    the embedding's weight), else the last linear
                                                    after the blocks; router if it writes one score
                                                    per expert of the experts beside it
  a module holding 3-D parameters [E, N, K]      -> one expert component per 3-D parameter
                                                    (per-expert biases ride along with them)
  a module with n_heads and head_dim             -> adds `<fqn>.core` (attn_core) before its last linear
                                                    (the output projection: after wqkv, or after wq/wk/wv)
  a *Mamba* / *SSM* module with d_state          -> adds `<fqn>.scan` (ssm_scan) after its first linear,
                                                    standing for all its parameters but the linears
A module with parameters that is none of these raises PlanError: nothing is silently left out.
What each norm feeds is found by tracing one forward (dataflow.py), so that fusions follow the model's
data flow, whatever its modules are called.
"""

from dataclasses import dataclass, replace

from torch import nn

from fp8stack.plan.dataflow import trace_feeds
from fp8stack.plan.description import Component, ModelDescription
from fp8stack.plan.errors import PlanError


@dataclass(frozen=True)
class _Found:
    """A component from the walk, before its layer's block type is known."""

    component: Component
    in_attention: bool
    """Inside an attention module (so it does not count as the block's MLP)."""


def describe_module(model: nn.Module, *, seq_len: int, name: str, layers_attr: str = "layers",
                    example_input: object = None, trace: bool = True) -> ModelDescription:
    """The components of `model` in registration order; `layers_attr` names the ModuleList (or
    ModuleDict) of blocks, whose children become layers 0, 1, ... with a block type each. With `trace`, one
    forward on `example_input` (a tensor or a tuple of arguments; default: a few token ids) finds what each
    norm feeds, for the plan's fusions."""
    try:
        layers = model.get_submodule(layers_attr)
    except AttributeError:
        raise PlanError(f"{type(model).__name__} has no submodule {layers_attr!r}: pass layers_attr=") from None
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise PlanError(f"{layers_attr!r} is a {type(layers).__name__}: pass the ModuleList of blocks as layers_attr")
    walker = _Walker(seq_len, layers_attr)
    components = tuple(_with_blocks(_with_routers(_with_head(walker.visit(model, "", ()), model))))
    feeds, unfusable = (), ()
    if trace:
        modules = dict(model.named_modules())
        by_kind = {kind: {c.fqn: modules[c.fqn] for c in components if c.kind == kind and c.fqn in modules}
                   for kind in ("norm", "linear", "head", "router")}
        feeds, unfusable = trace_feeds(model, by_kind["norm"], {**by_kind["linear"], **by_kind["head"]},
                                       example_input)
    return ModelDescription(name=name, seq_len=seq_len, components=components, feeds=feeds, unfusable=unfusable)


class _Walker:
    def __init__(self, seq_len: int, layers_attr: str):
        self.seq_len = seq_len
        self.layers_attr = layers_attr

    def visit(self, module: nn.Module, fqn: str, ancestors: tuple[nn.Module, ...],
              layer: int | None = None, in_attention: bool = False, in_scan: bool = False) -> list[_Found]:
        def leaf(kind: str, n: int, k: int, experts: int = 1, active: int = 1, at: str = fqn) -> _Found:
            return _Found(Component(fqn=at, kind=kind, n=n, k=k, layer=layer, experts=experts, active=active),
                          in_attention)

        if isinstance(module, nn.Embedding):
            return [leaf("embedding", module.embedding_dim, module.num_embeddings)]
        if _is_norm(module) and not in_scan:
            width = _norm_width(module)
            return [leaf("norm", width, width)]
        if _is_linear(module):
            return [leaf("linear", module.out_features, module.in_features)]
        # Inside an SSM mixer, the scan component stands for all but the linears (conv1d, A_log, D,
        # the gated norm), as in configs/models/hybrid-mamba-moe.yaml.
        is_scan = not in_scan and _is_scan(module)
        covered = in_scan or is_scan
        experts = [(p_name, p) for p_name, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if experts and not covered:
            top_k = _top_k(fqn, module, ancestors)
            return [leaf("expert", p.shape[1], p.shape[2], experts=p.shape[0], active=top_k, at=f"{fqn}.{p_name}")
                    for p_name, p in experts]

        is_attention = hasattr(module, "n_heads") and hasattr(module, "head_dim")
        own = [p_name for p_name, _ in module.named_parameters(recurse=False)]
        if own and not covered:
            raise PlanError(f"cannot describe module {fqn or '<root>'} ({type(module).__name__}) with parameters "
                            f"{own}: it is not an embedding, norm, linear or grouped-experts module; "
                            "describe the model in YAML or make the module one of those")

        found: list[_Found] = []
        for child_name, child in module.named_children():
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if child_fqn == self.layers_attr:
                for index, (block_name, block) in enumerate(child.named_children()):
                    found += self.visit(block, f"{child_fqn}.{block_name}", (*ancestors, module, child), index)
                continue
            found += self.visit(child, child_fqn, (*ancestors, module), layer,
                                in_attention or is_attention, covered)

        if is_attention:
            core = leaf("attn_core", self.seq_len, module.head_dim, active=2 * module.n_heads, at=f"{fqn}.core")
            found = _before_last_linear(found, replace(core, in_attention=True), fqn)
        if is_scan:
            found = _after_first_linear(found, leaf("ssm_scan", *_scan_shape(module, fqn), at=f"{fqn}.scan"), fqn)
        return found


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        return True
    weight = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and isinstance(weight, nn.Parameter) and weight.dim() == 1


def _norm_width(module: nn.Module) -> int:
    shape = getattr(module, "normalized_shape", None)
    return int(shape[-1]) if shape else module.weight.shape[0]


def _is_scan(module: nn.Module) -> bool:
    """A Mamba mixer: the class says so and it has a state size (a wrapping *Layer has none)."""
    return any(word in type(module).__name__ for word in ("Mamba", "SSM")) and hasattr(module, "d_state")


def _is_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 2
            and hasattr(module, "in_features") and hasattr(module, "out_features"))


def _with_head(found: list[_Found], model: nn.Module) -> list[_Found]:
    """The output head by structure: a linear outside the blocks that shares an embedding's weight or writes one
    logit per embedding row; without embeddings, the last linear after the blocks."""
    modules = dict(model.named_modules())
    embeddings = [m for m in modules.values() if isinstance(m, nn.Embedding)]
    outside = [i for i, f in enumerate(found) if f.component.kind == "linear" and f.component.layer is None]

    def writes_logits(index: int) -> bool:
        module = modules.get(found[index].component.fqn)
        return any(getattr(module, "weight", None) is e.weight or found[index].component.n == e.num_embeddings
                   for e in embeddings)

    if embeddings:
        heads = [i for i in outside if writes_logits(i)]
    else:
        last_layer = max((i for i, f in enumerate(found) if f.component.layer is not None), default=-1)
        heads = [i for i in outside if i > last_layer][-1:]
    return [replace(f, component=replace(f.component, kind="head")) if i in heads else f for i, f in enumerate(found)]


def _with_routers(found: list[_Found]) -> list[_Found]:
    """An MoE router by structure: a linear of a layer with experts that writes one score per expert, outside the
    attention."""
    experts = {f.component.layer: f.component.experts for f in found if f.component.kind == "expert"}
    return [replace(f, component=replace(f.component, kind="router"))
            if (f.component.kind == "linear" and not f.in_attention and f.component.layer in experts
                and f.component.n == experts[f.component.layer]) else f
            for f in found]


def _top_k(fqn: str, module: nn.Module, ancestors: tuple[nn.Module, ...]) -> int:
    """Experts per token, from the nearest enclosing module (or its `config`) with a `top_k`."""
    for owner in (module, *reversed(ancestors)):
        for source in (owner, getattr(owner, "config", None)):
            top_k = getattr(source, "top_k", None)
            if isinstance(top_k, int) and not isinstance(top_k, bool):
                return top_k
    raise PlanError(f"experts at {fqn} have no top_k: set a `top_k` attribute on their MoE module")


def _scan_shape(module: nn.Module, fqn: str) -> tuple[int, int]:
    """(inner width, state size) of a Mamba mixer (megatron-core and mamba_ssm use these names)."""
    d_inner, d_state = getattr(module, "d_inner", None), getattr(module, "d_state", None)
    if not (isinstance(d_inner, int) and isinstance(d_state, int)):
        raise PlanError(f"SSM module {fqn} ({type(module).__name__}) needs int attributes d_inner and d_state")
    return d_inner, d_state


def _owned_linears(found: list[_Found], owner: str) -> list[int]:
    return [i for i, item in enumerate(found)
            if item.component.kind == "linear" and item.component.fqn.startswith(f"{owner}.")]


def _after_first_linear(found: list[_Found], extra: _Found, owner: str) -> list[_Found]:
    """Insert `extra` right after the first GEMM of `owner` (an SSM mixer: after in_proj), else at the end."""
    owned = _owned_linears(found, owner)
    at = owned[0] + 1 if owned else len(found)
    return [*found[:at], extra, *found[at:]]


def _before_last_linear(found: list[_Found], extra: _Found, owner: str) -> list[_Found]:
    """Insert `extra` right before the last GEMM of `owner` (attention: the core runs between the input
    projections, fused or not, and the output projection wo); after its only GEMM; else at the end."""
    owned = _owned_linears(found, owner)
    at = owned[-1] if len(owned) > 1 else owned[0] + 1 if owned else len(found)
    return [*found[:at], extra, *found[at:]]


def _block_type(items: list[_Found]) -> str:
    kinds = {f.component.kind for f in items}
    if "expert" in kinds:
        return "moe"
    if "ssm_scan" in kinds:
        return "mamba"
    has_mlp = any(f.component.kind == "linear" and not f.in_attention for f in items)
    if "attn_core" in kinds:
        return "dense" if has_mlp else "attention"
    return "mlp"


def _with_blocks(found: list[_Found]) -> list[Component]:
    """Set each layer's block type from what the layer contains; 'model' outside the layers."""
    by_layer: dict[int, list[_Found]] = {}
    for f in found:
        if f.component.layer is not None:
            by_layer.setdefault(f.component.layer, []).append(f)
    blocks = {layer: _block_type(items) for layer, items in by_layer.items()}
    return [replace(f.component, block=blocks[f.component.layer]) if f.component.layer is not None
            else f.component for f in found]
