"""patches/: registry, version gating, idempotent apply and revert on CPU. The bugs themselves need CUDA
(megatron's checkpoint saves the CUDA RNG state; TE's recipes need TE): tests/gpu/test_megatron_gpu.py
shows each one with and without its patch."""

from types import SimpleNamespace

import pytest

from fp8stack import patches
from fp8stack.patches import recompute_fp8_context

from megatron.core.tensor_parallel.random import CheckpointFunction


def test_every_registered_patch_declares_what_it_applies_to():
    for name in patches.REGISTRY:
        module = __import__(name, fromlist=["apply"])
        package, versions = module.APPLIES_TO
        assert package and versions and callable(module.apply) and callable(module.revert)
        assert "https://github.com/" in module.__doc__


def test_apply_all_reports_each_patch():
    report = patches.apply_all()
    try:
        assert set(report) == {"recompute_fp8_context", "fp8_wgrad_ignored", "te_swiglu_fp8_dgrad"}
        assert report["recompute_fp8_context"].startswith(("applied", "already applied"))
        # TransformerEngine needs CUDA: CI's machine has none installed, and apply_all says so instead of failing
        assert report["te_swiglu_fp8_dgrad"] == "skipped: transformer-engine is not installed"
    finally:
        recompute_fp8_context.revert()


def test_recompute_patch_is_idempotent_and_reverts():
    megatron_forward = CheckpointFunction.forward
    try:
        assert recompute_fp8_context.apply().startswith("applied")
        patched = CheckpointFunction.forward
        assert patched is not megatron_forward
        assert recompute_fp8_context.apply() == "already applied"
        assert CheckpointFunction.forward is patched
    finally:
        recompute_fp8_context.revert()
    assert CheckpointFunction.forward is megatron_forward


@pytest.mark.parametrize("applies_to, expected", [
    (("megatron-core", ">=0.19,<0.20"), (True, "")),
    (("megatron-core", ">=0.20"), (False, "megatron-core 0.19.2 is outside >=0.20")),
    (("no-such-package-fp8stack", ">=1"), (False, "no-such-package-fp8stack is not installed")),
])
def test_version_gate(applies_to, expected):
    assert patches.applies(SimpleNamespace(APPLIES_TO=applies_to)) == expected
