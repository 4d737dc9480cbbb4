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
class ModelDescription:
    """A model: a name, its sequence length and its components in execution order."""

    name: str
    """Model name, printed in plans and profile file names."""
    seq_len: int
    """Training sequence length (sets the attention core's shape)."""
    components: tuple[Component, ...]
    """Every component, in order."""

    @property
    def num_layers(self) -> int:
        """Number of layers (blocks) in the stack."""
        layers = {c.layer for c in self.components if c.layer is not None}
        return max(layers) + 1 if layers else 0


_COMPONENT_KEYS = {"name", "kind", "n", "k", "experts", "active"}
_TOP_KEYS = {"name", "seq_len", "layer_prefix", "before_layers", "blocks", "layers", "after_layers"}


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


def load_yaml_file(path: Path, what: str) -> dict:
    """Parse a YAML mapping, turning read and syntax errors into one-line PlanErrors."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise PlanError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise PlanError(f"{what} {path} is not UTF-8 text: give a YAML file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise PlanError(f"{what} {path} is not valid YAML{where}: fix the syntax") from None
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
    layer = 0
    for entry in _list(data["layers"], f"{source}: layers"):
        if not isinstance(entry, dict) or "block" not in entry:
            raise PlanError(f"{source}: each 'layers' entry needs 'block' (and optional 'repeat')")
        block = entry["block"]
        if not isinstance(block, str) or block not in blocks:
            raise PlanError(f"{source}: layers use block {block!r}, not defined under 'blocks' ({sorted(blocks)})")
        for _ in range(_positive_int(entry.get("repeat", 1), f"{source}: repeat of {block}")):
            for spec in _list(blocks[block], f"{source}: block {block}"):
                local = _name_of(spec, source)
                components.append(_component(spec, f"{prefix}.{layer}.{local}", block, layer, source))
            layer += 1
    components += [_component(c, _name_of(c, source), "model", None, source)
                   for c in _list(data.get("after_layers") or [], f"{source}: after_layers")]
    return ModelDescription(name=str(data["name"]), seq_len=seq_len, components=tuple(components))


def _name_of(spec: object, source: str) -> str:
    if not isinstance(spec, dict) or "name" not in spec:
        raise PlanError(f"{source}: every component needs a 'name' (got {spec!r})")
    return str(spec["name"])


def _component(spec: dict, fqn: str, block: str, layer: int | None, source: str) -> Component:
    unknown = set(spec) - _COMPONENT_KEYS
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


def _list(value: object, what: str) -> Iterable:
    if not isinstance(value, list):
        raise PlanError(f"{what} must be a list")
    return value
