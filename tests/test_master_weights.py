"""BF16 parameters with FP32 master weights (TrainConfig.param_dtype = "bf16") on a CPU; the TE path is a GPU test
(tests/gpu/test_master_weights_gpu.py)."""

import pytest
import torch

from fp8stack.train.config import TrainConfig, TrainConfigError
from fp8stack.train.loop import session, train

FAST = dict(micro_batch=2, seq_len=64, eval_batches=0, max_data_bytes=1 << 20, progress=False, dtype="bf16")
"""A tiny-model run in BF16 activations, a fraction of a second per step on 2 cores."""


def test_the_optimizer_steps_fp32_masters_and_the_model_holds_their_bf16_copies():
    with session(TrainConfig(**FAST, param_dtype="bf16", steps=2, warmup=1)) as run:
        masters = run.masters
        names = [name for name, _ in run.model.named_parameters()]
        assert [name for name, _ in masters.module.named_parameters()] == names  # what a checkpoint saves
        assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in masters.masters} == {torch.float32}
        assert run.model.tok_embeddings.sparse, "the embedding adds only its looked-up rows into its main_grad"
        stepped = [p for group in run.optimizer.param_groups for p in group["params"]]
        assert len(stepped) == len(masters.masters) and {id(p) for p in stepped} == set(map(id, masters.masters))
        before = [m.detach().clone() for m in masters.masters]
        run.step(1.0)
        for param, master, old in zip(masters.params, masters.masters, before, strict=True):
            assert not torch.equal(master, old), "AdamW stepped the master"
            assert torch.equal(param, master.to(torch.bfloat16)), "the parameter is the master, rounded"
            assert param.grad is None and not param.main_grad.any(), "gradients start the next step at zero"
            assert master.grad is param.main_grad


def test_micro_batch_gradients_add_up_in_fp32():
    """Each micro-batch's BF16 gradient is added into the FP32 main_grad as it arrives: two micro-batches
    leave the FP32 sum of their gradients, where BF16 accumulation would round each partial sum to BF16."""
    with session(TrainConfig(**FAST, param_dtype="bf16", steps=1, global_batch=4)) as run:
        tokens, targets = next(iter(run.data))
        halves = list(zip(tokens.chunk(2), targets.chunk(2), strict=True))

        def gradients(batches) -> list[torch.Tensor]:
            for param in run.masters.params:
                param.main_grad.zero_()
            for tokens, targets in batches:
                with run.autocast():
                    run.loss_fn(tokens, targets).backward()
            return [param.main_grad.clone() for param in run.masters.params]

        first, second, both = gradients(halves[:1]), gradients(halves[1:]), gradients(halves)
    assert all(p.dtype == torch.float32 for p in both)
    assert all(torch.equal(b, f + s) for b, f, s in zip(both, first, second, strict=True))
    # the check can fail: an FP32 sum of two BF16 gradients is not BF16 in general
    assert any(not torch.equal(b, b.to(torch.bfloat16).float()) for b in both)


def test_bf16_parameters_compute_what_fp32_ones_under_autocast_do():
    """Without FP8, autocast's per-forward BF16 casts of FP32 parameters are the BF16 parameters, and both paths add
    BF16 weight gradients in FP32 (the embedding's rows too): the runs agree to FP32 summation order."""
    settings = dict(FAST, recipe="bf16", steps=5, warmup=1, global_batch=4)
    fp32, bf16 = (train(TrainConfig(**settings, param_dtype=dtype)) for dtype in ("fp32", "bf16"))
    assert bf16.losses[-1] < bf16.losses[0]
    assert bf16.losses == pytest.approx(fp32.losses, rel=1e-5)
    assert bf16.grad_norms == pytest.approx(fp32.grad_norms, rel=1e-5)


def test_bf16_parameters_train_as_fp32_ones_to_rounding_in_fp8():
    """FP8 casts of BF16 parameters round twice where FP32 ones round once: close, not equal."""
    settings = dict(FAST, recipe="tensorwise", steps=5, warmup=1, global_batch=4)
    fp32, bf16 = (train(TrainConfig(**settings, param_dtype=dtype)) for dtype in ("fp32", "bf16"))
    assert bf16.losses[-1] < bf16.losses[0]
    assert bf16.losses != fp32.losses and bf16.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert bf16.grad_norms == pytest.approx(fp32.grad_norms, rel=5e-2)


def test_bf16_parameters_refuse_what_they_cannot_serve():
    with pytest.raises(TrainConfigError, match="unknown param_dtype 'fp16'"):
        TrainConfig(param_dtype="fp16")
    for refused in ({"fsdp_one_rank": True}, {"dtype": "fp32"}):
        with pytest.raises(TrainConfigError, match="drop --fsdp-one-rank"):
            TrainConfig(param_dtype="bf16", **refused)
    with pytest.raises(TrainConfigError, match="use --model-impl torch"):
        TrainConfig(param_dtype="bf16", model_impl="megatron", model="llama-1b-like", dtype="bf16")
    with pytest.raises(TrainConfigError, match="pass --dtype bf16"), session(
            TrainConfig(**{**FAST, "dtype": "auto"}, device="cpu", param_dtype="bf16", steps=1)):
        pass


@pytest.mark.parametrize(("settings", "why"), [
    ({"recipe": "bf16"}, "has no FP8 layer"),
    ({"recipe": "tensorwise", "backend": "torchao"}, "in FP8 on torchao"),
])
def test_fp8_parameters_need_every_fp8_layer_on_te(settings, why):
    """param_dtype fp8 holds TE's FP8 weights in FP8 only (the TE path is a GPU test): a plan without FP8 layers, or
    with FP8 layers on another backend, is refused by name before anything is built."""
    with pytest.raises(TrainConfigError, match=f"param_dtype fp8 .*{why}.*--param-dtype bf16"), session(
            TrainConfig(**FAST, **settings, param_dtype="fp8", steps=1)):
        pass
    for refused in ({"fsdp_one_rank": True}, {"dtype": "fp32"}):
        with pytest.raises(TrainConfigError, match="param_dtype fp8 keeps FP32 masters.*drop --fsdp-one-rank"):
            TrainConfig(param_dtype="fp8", **refused)
