"""The test-only shims that let megatron-core's GPTModel (its local spec) run on a CPU: each replaces a CUDA call of
torch or a CUDA allocation of megatron's buffers, megatron's own model code runs unchanged. For fixtures and for
spawned gloo ranks (which inherit no fixture), given a pytest MonkeyPatch."""

import contextlib
import dataclasses
import functools
import operator

import pytest
import torch

from fp8stack.config import JobConfig
from fp8stack.models import Llama, LlamaConfig


def megatron_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GlobalMemoryBuffer.get_tensor allocates on CPU (megatron asks torch.cuda.current_device()), and the CUDA RNG
    tracker's fork is a no-op (there is no CUDA RNG state to fork)."""
    from megatron.core import tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(functools.reduce(operator.mul, tensor_shape, 1), dtype=dtype).view(*tensor_shape)

    monkeypatch.setattr(GlobalMemoryBuffer, "get_tensor", get_tensor)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())


class _HostStream:
    """A CUDA stream where there is none: nothing to wait for, every event already reached."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_HostStream":
        return self

    def synchronize(self) -> None:
        pass


def megatron_moe_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron_on_cpu, and what megatron's MoE layers ask of CUDA: torch.cuda.current_device() (where the router
    puts its weight, RoPE its frequencies, the all-to-all its output) is the CPU; the alltoall dispatcher's side
    stream for its device-to-host copies of the token counts is a stream with nothing to wait for (the counts are on
    the host already); and gloo's all_to_all_single takes those counts as lists, which megatron hands over as the
    host tensors a CPU leaves them (on a GPU, as the numpy arrays of their host copies)."""
    megatron_on_cpu(monkeypatch)
    host = _HostStream()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "Stream", _HostStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: host)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    all_to_all_single = torch.distributed.all_to_all_single

    def with_listed_splits(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        listed = [sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes
                  for sizes in (output_split_sizes, input_split_sizes)]
        return all_to_all_single(output, input, *listed, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_to_all_single", with_listed_splits)


def causal_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A GPTModel's mean next-token loss of one batch, given the causal mask megatron's default would make on
    CUDA."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    causal = torch.ones(seq, seq).triu(1).bool()[None, None]
    return model(tokens, positions, causal, labels=targets).mean()


def small_deepseek(shape: LlamaConfig) -> LlamaConfig:
    """deepseek-moe-small's layout and routing (layer 0 dense, sigmoid scores renormalised over the top k, the expert
    bias, a shared expert) at a size CPU tests train in seconds: 3 layers of width 256, 8 experts, top 4."""
    return dataclasses.replace(shape, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=512, n_layers=3,
                               moe=dataclasses.replace(shape.moe, num_experts=8, top_k=4, expert_ffn_dim=128,
                                                       shared_ffn_dim=128))


def drawn_gpt(cfg: JobConfig, shape: LlamaConfig, seed: int) -> torch.nn.Module:
    """The GPTModel of `shape` on megatron's local spec holding this rank's shards of the plain Llama drawn for
    `seed`, as megatron_model.build makes it (megatron's parallel state must be initialised)."""
    from fp8stack.train import megatron_model

    config = megatron_model.transformer_config(cfg, shape, "hybrid")
    plain = Llama(shape)
    plain.init_weights(seed=seed)
    return megatron_model.gpt_model(config, megatron_model.build_plan(config, cfg, shape, arch=90), plain,
                                    use_te=False)
