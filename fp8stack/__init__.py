"""fp8stack: FP8 training with a precision plan, an ordered assembly pipeline and measured deltas.

    plan = fp8stack.make_plan(model, fp8stack.PolicyConfig("delayed"), seq_len=4096)
    model = fp8stack.assemble(model, plan, compile=True, sdpa_backend="cudnn")
    masters = fp8stack.MasterWeights(model)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=3e-4, fused=True))
"""

__version__ = "0.2.0"
"""The one place the version is written: pyproject.toml reads it, `fp8stack --version` prints it."""

import sys

from fp8stack.plan import (Decision, ModelDescription, Plan, PlanError, PlanWarning, PolicyConfig, load_description,
                           make_plan)

_LAZY = {
    "OrderingError": "fp8stack.assembly", "assemble": "fp8stack.assembly", "describe_assembly": "fp8stack.assembly",
    "after_checkpoint_load": "fp8stack.assembly", "post_optimizer_step_hook": "fp8stack.assembly",
    "describe_module": "fp8stack.plan.from_module",
    "MasterWeights": "fp8stack.precision",
    "unfused_state_dict": "fp8stack.backends",
}
"""Loaded on first use: they import torch, and `fp8stack plan` should not have to."""


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp8stack' has no attribute {name!r}")


if "torch" in sys.modules:  # a training process: load the backends' libraries before any model runs (TE's cuDNN)
    import fp8stack.assembly  # noqa: F401

__all__ = ["Decision", "MasterWeights", "ModelDescription", "OrderingError", "Plan", "PlanError", "PlanWarning",
           "PolicyConfig", "after_checkpoint_load", "assemble", "describe_assembly", "describe_module",
           "load_description", "make_plan", "post_optimizer_step_hook", "unfused_state_dict"]
