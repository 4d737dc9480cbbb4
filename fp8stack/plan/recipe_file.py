"""Recipe files (configs/recipes/*.yaml): defaults for the policy plus per-block / per-fqn overrides."""

from pathlib import Path

from fp8stack.plan.description import CONFIGS_DIR, load_yaml_file
from fp8stack.plan.errors import PlanError
from fp8stack.plan.policy import Override

SETTINGS = ("recipe", "fp8_format", "backend", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16", "small_gemm_filter", "expert_backend", "head_on_te")
"""PolicyConfig fields a recipe file may set (command-line flags win over them)."""
_OVERRIDE_KEYS = {"block", "fqn", "backend", "recipe", "reason"}


def resolve_recipe_path(name_or_path: str | Path) -> Path:
    """A path as given, or a file name in configs/recipes ('moe-only-fp8')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = CONFIGS_DIR / "recipes" / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    raise PlanError(f"recipe file {str(name_or_path)!r} not found: give a YAML path or a name in configs/recipes/")


def load_recipe_file(name_or_path: str | Path) -> tuple[dict, tuple[Override, ...]]:
    """(policy settings, overrides) from a recipe file."""
    path = resolve_recipe_path(name_or_path)
    data = load_yaml_file(path, "recipe file")
    unknown = set(data) - {*SETTINGS, "overrides", "description"}
    if unknown:
        raise PlanError(f"{path}: unknown key(s) {sorted(map(str, unknown))}; allowed: {sorted({*SETTINGS, 'overrides', 'description'})}")
    settings = {k: data[k] for k in SETTINGS if k in data}
    entries = data.get("overrides") or []
    if not isinstance(entries, list):
        raise PlanError(f"{path}: 'overrides' must be a list of {{block, fqn, backend, recipe, reason}} entries")
    overrides = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - _OVERRIDE_KEYS:
            raise PlanError(f"{path}: override #{i + 1} must be a mapping with keys among {sorted(_OVERRIDE_KEYS)}")
        if not ({"backend", "recipe"} & set(entry)):
            raise PlanError(f"{path}: override #{i + 1} sets neither 'backend' nor 'recipe'")
        overrides.append(Override(
            block=str(entry.get("block", "*")), fqn=str(entry.get("fqn", "*")),
            backend=entry.get("backend"), recipe=entry.get("recipe"),
            reason=str(entry.get("reason", "")), source=path.name))
    return settings, tuple(overrides)
