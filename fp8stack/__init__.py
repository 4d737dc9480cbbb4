"""fp8stack: FP8 training with a precision plan, an ordered assembly pipeline and measured deltas."""

from fp8stack.plan import Decision, ModelDescription, Plan, PlanError, PolicyConfig, load_description, make_plan

__all__ = ["Decision", "ModelDescription", "Plan", "PlanError", "PolicyConfig", "load_description", "make_plan"]
