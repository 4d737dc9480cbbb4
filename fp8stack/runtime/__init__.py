"""What runs around the model during training: activation recompute (recompute.py), FP8 compression
of saved activations (compress.py), CUDA-graph guards (graphs.py), numerics guards (numerics.py).
Imports point downward only (plan, backends); TransformerEngine is imported lazily where needed."""

from fp8stack.runtime.compress import ActivationCompressor, compress_saved_activations
from fp8stack.runtime.graphs import (CaptureRefused, CaptureReport, branchless_clamp, capture_blockers, capture_check,
                                     check_capturable, is_graph_capturing, no_host_sync, te_graphed)
from fp8stack.runtime.numerics import (NonFiniteLossError, check_finite, clear_fp8_stats, fp8_stats, load_pin,
                                       pin_step, rng_states, set_rng_states, track_fp8_stats, watch_layers,
                                       zero_fp8_weight_grads)
from fp8stack.runtime.recompute import (RECOMPUTE_MODULES, PrecisionProbe, checkpoint_module, has_te_modules,
                                        precision_context)

__all__ = ["RECOMPUTE_MODULES", "ActivationCompressor", "CaptureRefused", "CaptureReport", "NonFiniteLossError",
           "PrecisionProbe", "branchless_clamp", "capture_blockers", "capture_check", "check_capturable",
           "check_finite", "checkpoint_module", "clear_fp8_stats", "compress_saved_activations", "fp8_stats",
           "has_te_modules", "is_graph_capturing", "load_pin", "no_host_sync", "pin_step", "precision_context",
           "rng_states", "set_rng_states", "te_graphed", "track_fp8_stats", "watch_layers", "zero_fp8_weight_grads"]
