"""A model as the policy sees it: its components (GEMMs, norms, lookups, scans) with shapes.

Loaded from YAML (configs/models/*.yaml), derived from an nn.Module (from_module.py) or from a
megatron-core TransformerConfig (from_megatron.py). All three give the same data type.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from fp8stack.plan.errors import PlanError

GEMM_KINDS = ("linear", "expert", "router", "head", "attn_core")
"""Kinds whose work is a matrix product (counted in the FLOP summary)."""
OTHER_KINDS = ("embedding", "norm", "ssm_scan")
"""Kinds with no GEMM: a lookup, a reduction, a recurrent scan."""
KINDS = GEMM_KINDS + OTHER_KINDS

_PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIGS_DIR = _PACKAGED_CONFIGS if _PACKAGED_CONFIGS.is_dir() else Path(__file__).resolve().parents[2] / "configs"
"""configs/: inside the package when installed from a wheel, at the top of the repository in a checkout."""
MAX_YAML_DEPTH = 32
"""Deepest nesting a description or recipe file may have (the formats need 5); deeper is refused before
the parser's recursion runs out."""
MAX_LAYERS = 4096
"""Most layers a description may expand to (repeats included): beyond any model trained today, and a bound
on the work a `repeat` can ask for."""


@dataclass(frozen=True)
class Component:
    """One unit of work in the model the plan decides a precision for."""

    fqn: str
    """Module path in the model, e.g. 'layers.3.attention.wqkv'."""
    kind: str
    """One of KINDS."""
    n: int
    """Output features (rows of the weight); for attn_core the keys attended; for norms the width."""
    k: int
    """Input (reduction) features; for attn_core the head dim; for embeddings the vocabulary."""
    block: str = "model"
    """Block type the component belongs to ('dense', 'moe', 'mamba', ...; 'model' outside the layers)."""
    layer: int | None = None
    """Index of its layer, None outside the layers."""
    experts: int = 1
    """Number of experts sharing the GEMM shape (grouped GEMMs)."""
    active: int = 1
    """GEMMs of this shape per token: top-k for experts, 2 x heads for attention (QK^T and PV)."""

    @property
    def flops_per_token(self) -> int:
        """Multiply-add FLOPs of one token's forward pass through this component."""
        return 2 * self.n * self.k * self.active if self.kind in GEMM_KINDS else 0

    @property
    def name(self) -> str:
        """The fqn inside its layer ('attention.wqkv'), the fqn itself outside the layers."""
        if self.layer is None:
            return self.fqn
        marker = f".{self.layer}."
        return self.fqn.split(marker, 1)[1] if marker in self.fqn else self.fqn


@dataclass(frozen=True)
class Rows:
    """Output rows [start, stop) of one linear's weight: the whole projection, or one half of a fused gate/up one."""

    fqn: str
    """The linear's fqn."""
    start: int
    stop: int


@dataclass(frozen=True)
class NormFeed:
    """A norm whose output is read by these linears and by nothing else, so that one module can normalize and
    project (TE LayerNormLinear; several projections merged into one GEMM whose output is split back)."""

    norm: str
    """The norm's fqn."""
    normalization: str
    """What it computes, checked on a traced input: RMSNorm or LayerNorm."""
    eps: float
    """Its epsilon."""
    linears: tuple[str, ...]
    """The linears reading its output, in the order the forward calls them."""


@dataclass(frozen=True)
class SwiGLUFeed:
    """A norm whose output is read only by `module`, which returns down(silu(gate(x)) * up(x)): one module can
    normalize and run the whole MLP (TE LayerNormMLP)."""

    norm: str
    """The norm's fqn."""
    normalization: str
    """RMSNorm or LayerNorm."""
    eps: float
    """The norm's epsilon."""
    module: str
    """The MLP module's fqn (its parameters are exactly the three projections')."""
    gate: Rows
    """The rows computing the gate (the input of silu)."""
    up: Rows
    """The rows computing what the gate multiplies."""
    down: str
    """The output projection's fqn."""

    @property
    def linears(self) -> tuple[str, ...]:
        """The MLP's linears, each once."""
        return tuple(dict.fromkeys((self.gate.fqn, self.up.fqn, self.down)))


@dataclass(frozen=True)
class Unfusable:
    """A norm no module can fuse with what reads it, and why (or the whole model, when it could not be traced)."""

    norm: str
    """The norm's fqn ('' for the whole model)."""
    why: str
    """What the trace found."""


@dataclass(frozen=True)
class ModelDescription:
    """A model: a name, its sequence length and its components in execution order."""

    name: str
    """Model name, printed in plans and profile file names."""
    seq_len: int
    """Training sequence length (sets the attention core's shape)."""
    components: tuple[Component, ...]
    """Every component, in order."""
    feeds: tuple[NormFeed | SwiGLUFeed, ...] = ()
    """What norms feed, found by tracing a built model's forward (none for descriptions without a module)."""
    unfusable: tuple[Unfusable, ...] = ()
    """Norms found feeding something a fused module cannot compute, with why."""
    head_replaceable: bool = True
    """Whether a backend may replace the output head by its own module (False for megatron's GPTModel, whose output
    layer stays its ColumnParallelLinear)."""
    rope_theta: float | None = None
    """RoPE base frequency, read when the trainer builds the model (fp8stack.models.from_description); None where
    the description does not say (the plan needs no rotary frequencies)."""
    router: "Routing | None" = None
    """How an MoE model's routers score and weight experts, read when the model is built; None: the builder's
    defaults (softmax scores, top-k weights as scored)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for c in self.components:
            if c.fqn in seen:
                raise PlanError(f"{self.name}: component {c.fqn} appears twice: give each component its own name "
                                "(a plan decides once per fqn)")
            seen.add(c.fqn)

    @property
    def num_layers(self) -> int:
        """Number of layers (blocks) in the stack."""
        layers = {c.layer for c in self.components if c.layer is not None}
        return max(layers) + 1 if layers else 0


ROUTER_SCORES = ("softmax", "sigmoid")
"""Router score functions: softmax over experts (Mixtral) or per-expert sigmoid (DeepSeek-V3)."""


@dataclass(frozen=True)
class Routing:
    """An MoE router's scoring, the description's top-level `router: {score_func, route_norm}`."""

    score_func: str = "softmax"
    """One of ROUTER_SCORES."""
    route_norm: bool = False
    """Rescale each token's top-k weights to sum to 1 (DeepSeek-V3 does, with sigmoid scores)."""


_COMPONENT_KEYS = {"name", "kind", "n", "k", "experts", "active"}
_FEED_KEYS = {"feeds", "swiglu", "eps", "normalization"}
"""A norm's keys saying what reads its output (what describe_module finds by tracing a built model): `feeds` the
linears, in call order; `swiglu: {module, down}` when they are the gate and up of a SwiGLU MLP (two linears, or
the two halves of one)."""
_TOP_KEYS = {"name", "seq_len", "rope_theta", "router", "layer_prefix", "before_layers", "blocks", "layers", "after_layers"}


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A path as given, or the name of a file in configs/models ('tiny' -> configs/models/tiny.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = CONFIGS_DIR / "models" / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.yaml")))
    raise PlanError(f"model description {str(name_or_path)!r} not found: give a YAML path or one of {known}")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing duplicate keys (YAML keeps the last silently) and nesting deeper than MAX_YAML_DEPTH."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise yaml.YAMLError(f"nesting deeper than {MAX_YAML_DEPTH} levels at line "
                                     f"{self.peek_event().start_mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges are YAML's own business
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in keys:
                raise yaml.YAMLError(f"key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1}"
                                     "): keep one")
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: Path, what: str) -> dict:
    """Parse a YAML mapping, turning read and syntax errors, duplicate keys and excessive nesting into one-line
    PlanErrors."""
    try:
        data = yaml.load(path.read_text(), Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except OSError as err:
        raise PlanError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise PlanError(f"{what} {path} is not UTF-8 text: give a YAML file") from None
    except yaml.MarkedYAMLError as err:
        where = f" at line {err.problem_mark.line + 1}" if err.problem_mark else ""
        raise PlanError(f"{what} {path} is not valid YAML{where}: fix the syntax") from None
    except yaml.YAMLError as err:
        raise PlanError(f"{what} {path}: {err}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{what} {path} must be a YAML mapping (key: value), not {type(data).__name__}")
    return data


def load_description(name_or_path: str | Path) -> ModelDescription:
    """Read a model description YAML (see configs/models/tiny.yaml for the format)."""
    path = resolve_model_path(name_or_path)
    return description_from_dict(load_yaml_file(path, "model description"), source=str(path))


def description_from_dict(data: dict, source: str = "<dict>") -> ModelDescription:
    """Build a description from the YAML mapping: before_layers, blocks + layers, after_layers."""
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise PlanError(f"{source}: unknown key(s) {sorted(map(str, unknown))}; allowed: {sorted(_TOP_KEYS)}")
    for key in ("name", "seq_len", "blocks", "layers"):
        if key not in data:
            raise PlanError(f"{source}: missing required key {key!r}")
    seq_len = _positive_int(data["seq_len"], f"{source}: seq_len")
    prefix = str(data.get("layer_prefix", "layers"))
    blocks = data["blocks"]
    if not isinstance(blocks, dict) or not blocks or not all(isinstance(b, str) for b in blocks):
        raise PlanError(f"{source}: 'blocks' must map block type names to component lists")

    components = [_component(c, _name_of(c, source), "model", None, source)
                  for c in _list(data.get("before_layers") or [], f"{source}: before_layers")]
    feeds = [f for c in _list(data.get("before_layers") or [], "") for f in _feeds(c, "", source)]
    stack = _layer_stack(data["layers"], blocks, source)
    layer = 0
    for block, repeat in stack:
        for _ in range(repeat):
            for spec in _list(blocks[block], f"{source}: block {block}"):
                local = _name_of(spec, source)
                components.append(_component(spec, f"{prefix}.{layer}.{local}", block, layer, source))
                feeds += _feeds(spec, f"{prefix}.{layer}.", source)
            layer += 1
    after = _list(data.get("after_layers") or [], f"{source}: after_layers")
    components += [_component(c, _name_of(c, source), "model", None, source) for c in after]
    feeds += [f for c in after for f in _feeds(c, "", source)]
    rope_theta = _positive_number(data["rope_theta"], f"{source}: rope_theta") if "rope_theta" in data else None
    return ModelDescription(name=str(data["name"]), seq_len=seq_len, components=tuple(components), feeds=tuple(feeds),
                            rope_theta=rope_theta, router=_routing(data["router"], source) if "router" in data else None)


def _routing(spec: object, source: str) -> Routing:
    """The top-level `router: {score_func, route_norm}`, each key optional."""
    where = f"{source}: router"
    if not isinstance(spec, dict) or set(spec) - {"score_func", "route_norm"}:
        raise PlanError(f"{where} must be a mapping of score_func ({' or '.join(ROUTER_SCORES)}) and route_norm "
                        f"(true or false), got {spec!r}: fix the description")
    routing = Routing(**spec)
    if routing.score_func not in ROUTER_SCORES or not isinstance(routing.route_norm, bool):
        raise PlanError(f"{where}: score_func must be one of {', '.join(ROUTER_SCORES)} and route_norm true or false, "
                        f"got {spec!r}: fix the description")
    return routing


def _feeds(spec: dict, prefix: str, source: str) -> list[NormFeed | SwiGLUFeed]:
    """The NormFeed (and SwiGLUFeed) a norm component declares, fqns under `prefix`."""
    if "feeds" not in spec:
        return []
    where = f"{source}: {prefix}{spec['name']}"
    linears = spec["feeds"]
    if spec.get("kind") != "norm" or not isinstance(linears, list) or not all(isinstance(x, str) for x in linears):
        raise PlanError(f"{where}: 'feeds' belongs to a norm and lists the linears reading its output")
    normalization = spec.get("normalization", "RMSNorm")
    eps = spec.get("eps", 1e-5)
    if normalization not in ("RMSNorm", "LayerNorm") or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise PlanError(f"{where}: normalization must be RMSNorm or LayerNorm and eps a number")
    norm = prefix + str(spec["name"])
    out: list[NormFeed | SwiGLUFeed] = [NormFeed(norm, normalization, float(eps), tuple(prefix + x for x in linears))]
    swiglu = spec.get("swiglu")
    if swiglu is not None:
        if not isinstance(swiglu, dict) or set(swiglu) != {"module", "down", "hidden"} or len(linears) not in (1, 2):
            raise PlanError(f"{where}: swiglu is {{module, down, hidden}} for a norm feeding the gate and up "
                            "projections (two linears, or one holding both)")
        hidden = _positive_int(swiglu["hidden"], f"{where}: swiglu hidden")
        gate, up = ((Rows(prefix + linears[0], 0, hidden), Rows(prefix + linears[0], hidden, 2 * hidden))
                    if len(linears) == 1 else tuple(Rows(prefix + x, 0, hidden) for x in linears))
        out.append(SwiGLUFeed(norm, normalization, float(eps), prefix + str(swiglu["module"]), gate, up,
                              prefix + str(swiglu["down"])))
    return out


def _layer_stack(entries: object, blocks: dict, source: str) -> list[tuple[str, int]]:
    """(block, repeat) per 'layers' entry, after checking that they expand to at most MAX_LAYERS layers."""
    stack = []
    for entry in _list(entries, f"{source}: layers"):
        if not isinstance(entry, dict) or "block" not in entry:
            raise PlanError(f"{source}: each 'layers' entry needs 'block' (and optional 'repeat')")
        block = entry["block"]
        if not isinstance(block, str) or block not in blocks:
            raise PlanError(f"{source}: layers use block {block!r}, not defined under 'blocks' ({sorted(blocks)})")
        stack.append((block, _positive_int(entry.get("repeat", 1), f"{source}: repeat of {block}")))
    total = sum(repeat for _, repeat in stack)
    if total > MAX_LAYERS:
        raise PlanError(f"{source}: 'layers' expands to {total} layers, more than {MAX_LAYERS}: lower the repeats")
    return stack


def _name_of(spec: object, source: str) -> str:
    if not isinstance(spec, dict) or "name" not in spec:
        raise PlanError(f"{source}: every component needs a 'name' (got {spec!r})")
    return str(spec["name"])


def _component(spec: dict, fqn: str, block: str, layer: int | None, source: str) -> Component:
    unknown = set(spec) - _COMPONENT_KEYS - _FEED_KEYS
    if unknown:
        raise PlanError(f"{source}: component {fqn} has unknown key(s) {sorted(map(str, unknown))}; allowed: {sorted(_COMPONENT_KEYS)}")
    kind = spec.get("kind")
    if kind not in KINDS:
        raise PlanError(f"{source}: component {fqn} has kind {kind!r}; use one of {', '.join(KINDS)}")
    where = f"{source}: {fqn}"
    return Component(
        fqn=fqn, kind=kind, block=block, layer=layer,
        n=_positive_int(spec.get("n"), f"{where} n"),
        k=_positive_int(spec.get("k"), f"{where} k"),
        experts=_positive_int(spec.get("experts", 1), f"{where} experts"),
        active=_positive_int(spec.get("active", 1), f"{where} active"),
    )


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise PlanError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _list(value: object, what: str) -> Iterable:
    if not isinstance(value, list):
        raise PlanError(f"{what} must be a list")
    return value
