"""Step-time statistics shared by the loop and the A/B harness (pure Python: no torch import)."""

import statistics


def steady_state(step_ms: list[float]) -> list[float]:
    """Per-step times without the warm-up steps (allocator growth, kernel selection, compilation):
    the first 10% (at least 2) are dropped while 3 or more steps remain."""
    skip = max(2, len(step_ms) // 10)
    return step_ms[skip:] if len(step_ms) - skip >= 3 else step_ms


def tokens_per_s(tokens_per_step: int, step_ms: list[float]) -> float:
    """Throughput over the steady-state steps: tokens per step over the median steady-state step time (0 without
    steps)."""
    return tokens_per_step / statistics.median(steady_state(step_ms)) * 1000 if step_ms else 0.0


def relative_spread(step_ms: list[float]) -> float:
    """Interquartile range / median: how much step times vary, as a share of the typical step."""
    if len(step_ms) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(step_ms, n=4)
    return (q3 - q1) / statistics.median(step_ms)
