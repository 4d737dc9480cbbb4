"""fp8stack: FP8 training with a precision plan, an ordered assembly pipeline and measured deltas."""

__version__ = "0.2.0"
"""The one place the version is written: pyproject.toml reads it, `fp8stack --version` prints it."""

from fp8stack.plan import Decision, ModelDescription, Plan, PlanError, PolicyConfig, load_description, make_plan

_ASSEMBLY = ("OrderingError", "assemble")
"""Loaded on first use: the assembly imports torch, and `fp8stack plan` should not have to."""


def __getattr__(name: str):
    if name in _ASSEMBLY:
        from fp8stack import assembly

        return getattr(assembly, name)
    raise AttributeError(f"module 'fp8stack' has no attribute {name!r}")


__all__ = ["Decision", "ModelDescription", "OrderingError", "Plan", "PlanError", "PolicyConfig", "assemble",
           "load_description", "make_plan"]
