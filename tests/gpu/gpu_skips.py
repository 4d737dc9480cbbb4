"""Skips shared by the GPU test modules, each saying what is missing. pytest puts tests/gpu on sys.path
(no __init__.py there), so a module calls, before importing transformer_engine:

    from gpu_skips import require_te
    require_te(["delayed"])  # skips the whole module without CUDA, or where TE cannot run these recipes
"""

from collections.abc import Sequence

import pytest
import torch

from fp8stack.backends.te import TEBackend

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is False"


def require_cuda() -> None:
    """Skip the calling module when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA, allow_module_level=True)


def te_runs(recipes: Sequence[str] = ()) -> tuple[bool, str]:
    """(True, '') when TE imports with CUDA and runs every FP8 recipe in `recipes` on this GPU; else why."""
    usable, why = TEBackend().available(recipes)
    return usable, why or "TransformerEngine unavailable"


def require_te(recipes: Sequence[str] = ()) -> None:
    """Skip the calling module without CUDA, or when TE cannot run `recipes` here (none: TE importable)."""
    require_cuda()
    usable, why = te_runs(recipes)
    if not usable:
        pytest.skip(why, allow_module_level=True)


def te_mark(recipes: Sequence[str]) -> pytest.MarkDecorator:
    """Skip marker for the tests of a module that also has tests without TE."""
    usable, why = te_runs(recipes)
    return pytest.mark.skipif(not usable, reason=why)
