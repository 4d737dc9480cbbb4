"""Speed levers that are flags of the trainer and the A/B harness: the SDPA kernel choice and TE
norm fusion. Their speed is measured on a GPU (profiles/INDEX.md: the lever-* runs); here, that they are wired
and refuse what cannot work."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from fp8stack.ab import speed_levers
from fp8stack.ab.run import _add_arguments as add_ab_arguments
from fp8stack.runtime.attention import SDPA_BACKENDS, sdpa_backend
from fp8stack.train.__main__ import build_parser, config_from_args
from fp8stack.train.config import TrainConfig, TrainConfigError
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
    args = build_parser().parse_args(["--sdpa-backend", "cudnn", "--fuse-norm", "--fuse-mlp", "--backend", "te",
                                      "--fp8-recipe", "tensorwise"])
    cfg = config_from_args(args)
    assert (cfg.sdpa_backend, cfg.fuse_norm, cfg.fuse_mlp) == ("cudnn", True, True)
    assert set(SDPA_BACKENDS) >= {"auto", "cudnn", "flash"}
    with pytest.raises(TrainConfigError, match="unknown sdpa_backend"):
        TrainConfig(sdpa_backend="fa3")


@pytest.mark.parametrize("options, match", [
    ({"sdpa_backend": "cudnn"}, "is a CUDA kernel, but this run is on cpu"),
    ({"fuse_norm": True}, "no TE layers"),
    ({"fuse_mlp": True}, "LayerNormMLP modules, but the plan .* has no TE layers.*--fuse-mlp"),
])
def test_trainer_refuses_levers_that_cannot_apply(options, match):
    with pytest.raises(TrainConfigError, match=match):
        train(TrainConfig(model="tiny", device="cpu", steps=1, eval_batches=0, progress=False, **options))


def test_ab_passes_the_levers_on():
    parser = argparse.ArgumentParser()
    add_ab_arguments(parser)
    args = parser.parse_args(["--sdpa-backend", "cudnn", "--fuse-norm", "--fuse-mlp"])
    assert (args.sdpa_backend, args.fuse_norm, args.fuse_mlp) == ("cudnn", True, True)
    assert (parser.parse_args([]).sdpa_backend, parser.parse_args([]).fuse_norm) == ("auto", False)
    assert not parser.parse_args([]).fuse_mlp
    fp8, bf16 = speed_levers(args, "delayed"), speed_levers(args, "bf16")
    assert (fp8["fuse_norm"], fp8["fuse_mlp"]) == (True, True), "FP8 arms get the TE fusions"
    assert (bf16["fuse_norm"], bf16["fuse_mlp"]) == (False, False), "the bf16 arm has no TE layers to fuse"
