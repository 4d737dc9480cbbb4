"""What runs around the model during training: activation recompute (more to come: activation
compression, CUDA-graph guards, numerics guards)."""

from fp8stack.runtime.recompute import checkpoint_module, has_te_modules

__all__ = ["checkpoint_module", "has_te_modules"]
