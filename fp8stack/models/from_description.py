"""The trainer's model from a model description: the LlamaConfig whose built model has the description's components.

`fp8stack plan` reads any description (configs/models/*.yaml or a YAML path); fp8stack builds those whose blocks
are attention + dense MLP or attention + MoE, named as fp8stack.models.llama names them (configs/models/tiny.yaml
and tiny-moe.yaml show both layouts, fused or separate projections). The shapes are read from the components, and
then the Llama of that config is built on the meta device and its description compared with the YAML's, component
by component: what is planned is what is trained, or the description is refused naming the first difference.

What the description does not say takes LlamaConfig's defaults: RoPE base frequency (unless `rope_theta` is given),
RMSNorm epsilon (unless a norm gives `eps`) and softmax top-k routing (MoEConfig).
"""

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from fp8stack.models.llama import Llama, LlamaConfig
from fp8stack.models.moe import MoEConfig
from fp8stack.plan.description import (CONFIGS_DIR, Component, ModelDescription, Routing, load_description,
                                       resolve_model_path)
from fp8stack.plan.errors import PlanError
from fp8stack.plan.from_module import describe_module

BUILDABLE = "fp8stack builds attention + dense MLP and attention + MoE blocks"
WAY_OUT = "plan it with `fp8stack plan`, train it through your own model with --model-factory"

ATTENTION = {"attention_norm", "attention.wqkv", "attention.wq", "attention.wk", "attention.wv", "attention.core",
             "attention.wo"}
"""Components of a block's attention half in fp8stack's Llama (fused wqkv, or wq/wk/wv)."""
DENSE_MLP = {"ffn_norm", "feed_forward.w13", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"}
"""Components of a dense SwiGLU MLP (fused w13, or w1/w3)."""
MOE_MLP = {"ffn_norm", "moe.router.gate", "moe.experts.w13", "moe.experts.w2", "moe.shared_experts.w13",
           "moe.shared_experts.w1", "moe.shared_experts.w3", "moe.shared_experts.w2"}
"""Components of an MoE MLP: router, grouped experts, optional shared expert."""
OUTSIDE = ("tok_embeddings", "norm", "output")
"""Components before and after the layers."""
MLA = {"attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.q_norm",
       "attention.kv_norm"}
"""DeepSeek's multi-head latent attention projections and norms."""


class ModelBuildError(PlanError):
    """A model description fp8stack can plan but not build; the message names the block and the way out."""


@dataclass(frozen=True)
class _Block:
    """One block type of the description, as its first layer has it."""

    name: str
    """The block type's name in the description ('dense', 'moe', ...)."""
    layer: int
    """Index of its first layer."""
    parts: dict[str, Component]
    """Its components by their name inside the layer ('attention.wqkv')."""

    @property
    def is_moe(self) -> bool:
        return "moe.router.gate" in self.parts


def load_model_config(name_or_path: str | Path) -> LlamaConfig:
    """The LlamaConfig of a model description: what `fp8stack plan --model` takes (a name in configs/models or a
    YAML path). Raises PlanError for a missing or malformed file, ModelBuildError for blocks fp8stack cannot build."""
    path = resolve_model_path(name_or_path)
    shown = path.resolve().relative_to(Path.cwd()) if path.resolve().is_relative_to(Path.cwd()) else path
    return model_config_from_description(load_description(path), source=str(shown))


def named_model_config(name: str) -> LlamaConfig:
    """The LlamaConfig of configs/models/<name>.yaml (a file of that name in the working folder does not count)."""
    return load_model_config(CONFIGS_DIR / "models" / f"{name}.yaml")


def model_config_from_description(description: ModelDescription, source: str | None = None) -> LlamaConfig:
    """The LlamaConfig whose built Llama has exactly `description`'s components (fqn, kind and shape; block type
    names may differ). `source` names the description in errors (default: its name)."""
    where = source or description.name
    blocks = _blocks(description, where)
    config = _config(description, blocks, where)
    _check_round_trip(description, config, where)
    return config


def _blocks(description: ModelDescription, where: str) -> list[_Block]:
    """Each block type in layer order, after refusing what fp8stack's Llama cannot build."""
    by_type: dict[str, _Block] = {}
    for component in description.components:
        if component.layer is None:
            if component.fqn not in OUTSIDE:
                raise ModelBuildError(f"{where}: {component.fqn} ({component.kind}) outside the layers cannot be "
                                      f"built yet: fp8stack's Llama has only {', '.join(OUTSIDE)} there; {WAY_OUT}")
            continue
        if not component.fqn.startswith(f"layers.{component.layer}."):
            raise ModelBuildError(f"{where}: {component.fqn} is not under layers.{component.layer}: fp8stack's Llama "
                                  "keeps its blocks in `layers` (drop layer_prefix); " + WAY_OUT)
        block = by_type.setdefault(component.block, _Block(component.block, component.layer, {}))
        if block.layer == component.layer:
            block.parts[component.name] = component
    if not by_type:
        raise ModelBuildError(f"{where}: no layers: fp8stack builds a stack of attention + MLP blocks; add 'layers'")
    for block in by_type.values():
        _check_buildable(block, where)
    moe_layers = [c.layer for c in description.components if c.name == "moe.experts.w13"]
    dense_after_moe = [c.layer for c in description.components
                       if c.name == "feed_forward.w2" and moe_layers and c.layer > moe_layers[0]]
    if dense_after_moe:
        raise ModelBuildError(f"{where}: layer {dense_after_moe[0]} has a dense MLP after the MoE layer "
                              f"{moe_layers[0]}: fp8stack's Llama keeps its dense layers first (first_moe_layer); "
                              + WAY_OUT)
    return list(by_type.values())


def _check_buildable(block: _Block, where: str) -> None:
    """Refuse a block that is not attention + dense MLP or attention + MoE in fp8stack's Llama's names."""
    missing = _unbuildable_part(block)
    if missing:
        raise ModelBuildError(f"{where}: block '{block.name}' ({missing}) cannot be built yet: {BUILDABLE}, named as "
                              f"fp8stack.models.llama names them (configs/models/tiny.yaml, tiny-moe.yaml); {WAY_OUT}")


def _unbuildable_part(block: _Block) -> str | None:
    """What in `block` fp8stack's Llama has no module for, or lacks; None when it builds."""
    names = set(block.parts)
    scans = [c.name for c in block.parts.values() if c.kind == "ssm_scan"]
    latent = [name for name in block.parts if name in MLA]
    if scans:
        return f"ssm_scan: {scans[0]}"
    if latent:
        return f"multi-head latent attention (MLA): {latent[0]}"
    if "attention.core" not in names:
        return "no attention: attention.core"
    mlp = MOE_MLP if names & MOE_MLP - {"ffn_norm"} else DENSE_MLP if names & DENSE_MLP - {"ffn_norm"} else None
    if mlp is None:
        return "no MLP: feed_forward or moe"
    unknown = [c for c in block.parts.values() if c.name not in ATTENTION | mlp]
    if unknown:
        return f"{unknown[0].name}, {unknown[0].kind}"
    # What the shapes are read from; the comparison with the built model finds anything else missing.
    required = ["attention.wo", "attention.wqkv" if "attention.wqkv" in names else "attention.wk",
                *(("moe.router.gate", "moe.experts.w13", "moe.experts.w2") if mlp is MOE_MLP else ("feed_forward.w2",))]
    absent = [name for name in required if name not in names]
    return f"no {absent[0]}" if absent else None


def _config(description: ModelDescription, blocks: list[_Block], where: str) -> LlamaConfig:
    """The LlamaConfig read from the embedding, the first block's attention and each MLP."""
    outside = {c.fqn: c for c in description.components if c.layer is None}
    if "tok_embeddings" not in outside:
        raise ModelBuildError(f"{where}: no tok_embeddings (embedding): fp8stack's Llama reads token ids; {WAY_OUT}")
    dim, vocab = outside["tok_embeddings"].n, outside["tok_embeddings"].k
    first = blocks[0].parts
    head_dim = first["attention.core"].k
    n_heads = _whole(first["attention.core"].active, 2, "attention.core's active (2 x heads)", where)
    if n_heads * head_dim != dim:
        raise ModelBuildError(f"{where}: attention.core's {n_heads} heads x head dim {head_dim} = {n_heads * head_dim} "
                              f"differ from the hidden size {dim} (tok_embeddings n): fp8stack's Llama has head dim = "
                              "hidden size / heads; fix the description's attention shapes")
    if "attention.wqkv" in first:
        n_kv_heads = _whole(_whole(first["attention.wqkv"].n, head_dim, "attention.wqkv's outputs", where) - n_heads,
                            2, "attention.wqkv's key and value heads", where)
    else:
        n_kv_heads = _whole(first["attention.wk"].n, head_dim, "attention.wk's outputs", where)
    dense = next((b.parts for b in blocks if not b.is_moe), None)
    moe = next((b for b in blocks if b.is_moe), None)
    moe_config = _moe_config(moe.parts, description.router) if moe else None
    try:
        return LlamaConfig(
            dim=dim, n_layers=description.num_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
            # A model whose every layer is MoE builds no dense MLP: its ffn_dim is then unused.
            ffn_dim=dense["feed_forward.w2"].k if dense else moe_config.expert_ffn_dim,
            vocab_size=vocab, seq_len=description.seq_len, norm_eps=_norm_eps(description, where),
            rope_theta=_default("rope_theta") if description.rope_theta is None else description.rope_theta,
            moe=moe_config, first_moe_layer=moe.layer if moe else 0,
            fused_projections="attention.wqkv" in first)
    except ValueError as err:
        raise ModelBuildError(f"{where}: the shapes give no Llama ({err}): fix the description's shapes") from None


def _moe_config(parts: dict[str, Component], router: Routing | None) -> MoEConfig:
    """Routed experts from moe.experts.w13 (count, top-k) and w2 (width); the shared expert's width from its w2; the
    scoring from the description's router (MoEConfig's defaults where it gives none)."""
    experts = parts["moe.experts.w13"]
    shared = parts.get("moe.shared_experts.w2")
    routing = {"score_func": router.score_func, "route_norm": router.route_norm} if router else {}
    return MoEConfig(num_experts=experts.experts, top_k=experts.active, expert_ffn_dim=parts["moe.experts.w2"].k,
                     shared_ffn_dim=shared.k if shared else 0, **routing)


def _norm_eps(description: ModelDescription, where: str) -> float:
    """The epsilon the norms give (`eps` beside `feeds`), LlamaConfig's default where none does; one for all."""
    given = {feed.eps for feed in description.feeds}
    if len(given) > 1:
        raise ModelBuildError(f"{where}: the norms give different eps {sorted(given)}: fp8stack's Llama has one "
                              "norm_eps; give every norm the same eps")
    return given.pop() if given else _default("norm_eps")


def _default(field_name: str) -> float:
    """LlamaConfig's default for `field_name`."""
    return next(f.default for f in fields(LlamaConfig) if f.name == field_name)


def _whole(numerator: int, denominator: int, what: str, where: str) -> int:
    """numerator / denominator, refused unless a positive whole number."""
    if numerator <= 0 or denominator <= 0 or numerator % denominator:
        raise ModelBuildError(f"{where}: {what} ({numerator}) is not a positive multiple of {denominator}: fix the "
                              "description's attention shapes (heads x head dim)")
    return numerator // denominator


def _check_round_trip(description: ModelDescription, config: LlamaConfig, where: str) -> None:
    """Build `config`'s Llama on the meta device and refuse the description unless its components are the built
    model's (block type names aside: the YAML names its own)."""
    with torch.device("meta"):
        model = Llama(config)
    built = describe_module(model, seq_len=config.seq_len, name=description.name, trace=False).components
    want, got = ([_shape(c) for c in components] for components in (description.components, built))
    if want == got:
        return
    at = next((i for i, (w, g) in enumerate(zip(want, got)) if w != g), min(len(want), len(got)))
    have = _describe(want[at]) if at < len(want) else "nothing"
    builds = _describe(got[at]) if at < len(got) else "nothing"
    raise ModelBuildError(f"{where}: component {at} is {have}, where the Llama read from the description ({_brief(config)}) "
                          f"has {builds}: fix the description's shapes or names (configs/models/tiny.yaml), or "
                          f"{WAY_OUT.removeprefix('plan it with `fp8stack plan`, ')}")


def _shape(component: Component) -> tuple:
    return component.fqn, component.kind, component.n, component.k, component.experts, component.active


def _describe(shape: tuple) -> str:
    fqn, kind, n, k, experts, active = shape
    extra = f", experts={experts}" if experts != 1 else ""
    return f"{fqn} ({kind} n={n} k={k}{extra}, active={active})"


def _brief(config: LlamaConfig) -> str:
    return (f"dim={config.dim}, n_layers={config.n_layers}, n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}, "
            f"ffn_dim={config.ffn_dim}" + (f", {config.moe.num_experts} experts" if config.moe else ""))
