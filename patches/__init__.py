"""Fixes for upstream FP8 bugs that affect fp8stack's megatron-core / TransformerEngine use, one file each.

Each patch module has APPLIES_TO (distribution name, version specifier), an idempotent apply() that
returns what it did, revert() (tests show the bug with and without), and a docstring linking upstream.
apply_all() applies every patch whose package is installed in a matching version.
The folder sits at the top of the repository and installs as fp8stack.patches (package-dir in pyproject.toml).

Not a patch: "MoE-only FP8". megatron-core has no flag for it, but fp8stack needs none: the plan decides
per GEMM (plan_from_megatron_args(..., moe_only=True) or the moe-only-fp8 recipe file) and
fp8stack.megatron.block_spec gives each layer and GEMM its own FP8 context, so changing megatron is
not needed and a version bump cannot break it.
"""

from importlib import import_module, metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

REGISTRY = ("fp8stack.patches.recompute_fp8_context", "fp8stack.patches.fp8_wgrad_ignored",
            "fp8stack.patches.te_swiglu_fp8_dgrad")
"""Patch modules, applied in this order."""


def applies(module) -> tuple[bool, str]:
    """(True, '') when the patched package is installed in APPLIES_TO's range, else (False, why not)."""
    package, versions = module.APPLIES_TO
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        return False, f"{package} is not installed"
    if Version(installed) not in SpecifierSet(versions):
        return False, f"{package} {installed} is outside {versions}"
    return True, ""


def apply_patch(name: str) -> str:
    """Apply the patch module `name` (e.g. 'fp8stack.patches.te_swiglu_fp8_dgrad') if it applies here; what happened."""
    module = import_module(name)
    ok, why = applies(module)
    return module.apply() if ok else f"skipped: {why}"


def apply_all() -> dict[str, str]:
    """Apply every registered patch that applies here; patch name -> what happened."""
    return {name.rpartition(".")[2]: apply_patch(name) for name in REGISTRY}
