"""Levers that are options of the trainer and the A/B harness: the SDPA kernel choice, TE norm fusion, weight-gradient
fusion, delayed scaling's margin. Their speed is measured on a GPU; here, that they are wired and refuse what cannot
work."""

import pytest
import torch
import torch.nn.functional as F

from fp8stack.ab import AbConfig, arm_configs
from fp8stack.runtime.attention import SDPA_BACKENDS, sdpa_backend
from fp8stack.train.command import job_from_flags
from fp8stack.config import ConfigError, from_overrides
from fp8stack.train.loop import train


def _flags() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {f: getattr(cuda, f"{f}_enabled")() for f in ("cudnn_sdp", "flash_sdp", "mem_efficient_sdp", "math_sdp")}


def test_named_backend_enables_only_that_kernel_and_restores_the_flags():
    before = _flags()
    cuda = torch.device("cuda")  # only its type is read: no GPU is touched
    with sdpa_backend("cudnn", cuda):
        assert _flags() == {"cudnn_sdp": True, "flash_sdp": False, "mem_efficient_sdp": False, "math_sdp": False}
    assert _flags() == before
    with sdpa_backend("auto", torch.device("cpu")):
        assert _flags() == before


def test_named_backend_off_the_gpu_is_refused_not_silently_math():
    with pytest.raises(ValueError, match="CUDA kernel"):
        with sdpa_backend("flash", torch.device("cpu")):
            pass
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        with sdpa_backend("fa3", torch.device("cuda")):
            pass
    q = torch.randn(1, 2, 8, 16)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)  # the flags were restored after the refusal


def test_trainer_flags_reach_the_config():
    cfg = job_from_flags(["--sdpa-backend", "cudnn", "--no-fuse-norm", "--fuse-mlp", "--backend", "te",
                          "--fp8-recipe", "tensorwise"])
    assert (cfg.training.sdpa_backend, cfg.precision.fuse_norm, cfg.precision.fuse_mlp) == ("cudnn", False, True)
    assert set(SDPA_BACKENDS) >= {"auto", "cudnn", "flash"}
    with pytest.raises(ConfigError, match="unknown training.sdpa_backend"):
        from_overrides({"training.sdpa_backend": "fa3"})


@pytest.mark.parametrize("options, match", [
    ({"training.sdpa_backend": "cudnn"}, "is a CUDA kernel, but this run is on cpu"),
    ({"te.gradient_accumulation_fusion": True}, "has no TE layers.*--gradient-accumulation-fusion"),
])
def test_trainer_refuses_levers_that_cannot_apply(options, match):
    with pytest.raises(ConfigError, match=match):
        train(from_overrides({"model.name": "tiny", "training.device": "cpu", "training.steps": 1,
                              "training.eval_batches": 0, "logging.progress": False, **options}))


def test_ab_gives_each_arm_the_levers_its_plan_uses():
    cfg = from_overrides({"model.name": "tiny", "precision.backend": "te", "te.gradient_accumulation_fusion": True,
                          "te.delayed_margin": 1, "precision.recipe": "delayed"})
    arms = arm_configs(AbConfig(fastest_bf16=False), cfg, ["bf16", "delayed", "tensorwise"], te_runs=True)
    assert [a.te.delayed_margin for a in arms.values()] == [0, 1, 0], "the margin of scales taken from history"
    assert [a.te.gradient_accumulation_fusion for a in arms.values()] == [None, True, True], \
        "explicit weight-gradient fusion goes to arms with TE layers; the plain bf16 arm has none"
    assert all(a.precision.fuse_norm and a.precision.fuse_mlp for a in arms.values()), \
        "fusions are the plan's: a plan without TE layers fuses nothing and says so"
