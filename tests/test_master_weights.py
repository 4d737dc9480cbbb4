"""BF16 parameters with FP32 master weights (training.param_dtype = "bf16") on a CPU; the TE path is a GPU test
(tests/gpu/test_master_weights_gpu.py)."""

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

from fp8stack.config import ConfigError, from_overrides
from fp8stack.train.loop import session, train

FAST = {"training.micro_batch": 2, "training.seq_len": 64, "training.eval_batches": 0, "data.max_bytes": 1 << 20,
        "logging.progress": False, "training.dtype": "bf16"}
"""A tiny-model run in BF16 activations, a fraction of a second per step on 2 cores."""


def test_the_optimizer_steps_fp32_masters_and_the_model_holds_their_bf16_copies():
    with session(from_overrides({**FAST, "training.param_dtype": "bf16", "training.steps": 2,
                                 "optimizer.warmup": 1})) as run:
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


def main_grads(run, batches) -> list[torch.Tensor]:
    """The masters' main_grads after a backward per (tokens, targets) of `batches`, from zero."""
    for param in run.masters.params:
        param.main_grad.zero_()
    for tokens, targets in batches:
        with run.autocast():
            run.loss_fn(tokens, targets).backward()
    return [param.main_grad.clone() for param in run.masters.params]


def test_micro_batch_gradients_add_up_in_fp32():
    """Each micro-batch's BF16 gradient is added into the FP32 main_grad as it arrives: two micro-batches
    leave the FP32 sum of their gradients, where BF16 accumulation would round each partial sum to BF16."""
    with session(from_overrides({**FAST, "training.param_dtype": "bf16", "training.steps": 1,
                                 "training.global_batch": 4})) as run:
        tokens, targets = next(iter(run.data))
        halves = list(zip(tokens.chunk(2), targets.chunk(2), strict=True))

        first, second, both = main_grads(run, halves[:1]), main_grads(run, halves[1:]), main_grads(run, halves)
    assert all(p.dtype == torch.float32 for p in both)
    assert all(torch.equal(b, f + s) for b, f, s in zip(both, first, second, strict=True))
    # the check can fail: an FP32 sum of two BF16 gradients is not BF16 in general
    assert any(not torch.equal(b, b.to(torch.bfloat16).float()) for b in both)


def test_the_bf16_arms_grouped_experts_add_their_weight_gradients_into_main_grad():
    """The BF16 arm of an MoE (recipe bf16, BF16 parameters): master weights hand the grouped experts their main_grads
    (the bf16 backend's hand_over_main_grads), and their weight-gradient GEMMs add into them in the backward, as the
    FP8 arms' grouped experts do. Autograd gets no expert weight gradient (which the hook added before), two
    micro-batches sum in FP32, and the main_grads are those the hook gave."""
    from fp8stack.models import GroupedExperts

    with session(from_overrides({**FAST, "model.name": "tiny-moe", "precision.recipe": "bf16",
                                 "training.param_dtype": "bf16", "training.steps": 1})) as run:
        experts = [m for m in run.model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.wgrad_into_main_grad for m in experts)
        handed = []  # per expert weight and backward: whether autograd got a gradient for it
        for weight in (w for m in experts for w in (m.w13, m.w2)):
            weight.register_hook(lambda grad: handed.append(grad is not None))
        tokens, targets = next(iter(run.data))
        halves = list(zip(tokens.chunk(2), targets.chunk(2), strict=True))

        first, second, both = main_grads(run, halves[:1]), main_grads(run, halves[1:]), main_grads(run, halves)
        assert handed and not any(handed), "the fused experts hand autograd no weight gradient"
        handed.clear()
        for module in experts:
            module.wgrad_into_main_grad = False
        hooked = main_grads(run, halves)
        assert handed == [True] * 2 * 2 * len(experts), "unfused, each expert weight's gradient went through autograd"
    assert all(torch.equal(b, f + s) for b, f, s in zip(both, first, second, strict=True))
    assert all(torch.equal(fused, unfused) for fused, unfused in zip(both, hooked, strict=True))
    names = [name for name, _ in run.model.named_parameters()]
    assert any(".experts.w13" in name and g.abs().sum() > 0 for name, g in zip(names, both, strict=True))


def test_bf16_parameters_compute_what_fp32_ones_under_autocast_do():
    """Without FP8, autocast's per-forward BF16 casts of FP32 parameters are the BF16 parameters, and both paths add
    BF16 weight gradients in FP32 (the embedding's rows too): the runs agree to FP32 summation order."""
    settings = {**FAST, "precision.recipe": "bf16", "training.steps": 5, "optimizer.warmup": 1,
                "training.global_batch": 4}
    fp32, bf16 = (train(from_overrides({**settings, "training.param_dtype": dtype})) for dtype in ("fp32", "bf16"))
    assert bf16.losses[-1] < bf16.losses[0]
    assert bf16.losses == pytest.approx(fp32.losses, rel=1e-5)
    assert bf16.grad_norms == pytest.approx(fp32.grad_norms, rel=1e-5)


def test_bf16_parameters_train_as_fp32_ones_to_rounding_in_fp8():
    """FP8 casts of BF16 parameters round twice where FP32 ones round once: close, not equal."""
    settings = {**FAST, "precision.recipe": "tensorwise", "training.steps": 5, "optimizer.warmup": 1,
                "training.global_batch": 4}
    fp32, bf16 = (train(from_overrides({**settings, "training.param_dtype": dtype})) for dtype in ("fp32", "bf16"))
    assert bf16.losses[-1] < bf16.losses[0]
    assert bf16.losses != fp32.losses and bf16.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert bf16.grad_norms == pytest.approx(fp32.grad_norms, rel=5e-2)


def test_bf16_parameters_refuse_what_they_cannot_serve():
    with pytest.raises(ConfigError, match="unknown training.param_dtype 'fp16': use fp32, bf16, fp8"):
        from_overrides({"training.param_dtype": "fp16"})
    with pytest.raises(ConfigError, match="pass --training.dtype bf16 or --training.param-dtype fp32"):
        from_overrides({"training.param_dtype": "bf16", "training.dtype": "fp32"})
    with pytest.raises(ConfigError, match="megatron does not take training.param_dtype fp8.*use --model.impl torch"):
        from_overrides({"training.param_dtype": "fp8", "model.impl": "megatron", "model.name": "llama-1b-like",
                        "training.dtype": "bf16"})
    with pytest.raises(ConfigError, match="FP32 \\(auto is on a CPU\\): pass --training.dtype bf16"), session(
            from_overrides({**FAST, "training.dtype": "auto", "training.device": "cpu", "training.param_dtype": "bf16",
                            "training.steps": 1})):
        pass


@pytest.mark.parametrize(("settings", "why"), [
    ({"precision.recipe": "bf16"}, "has no FP8 layer"),
    ({"precision.recipe": "tensorwise", "precision.backend": "torchao"}, "in FP8 on torchao"),
])
def test_fp8_parameters_need_every_fp8_layer_on_te(settings, why):
    """param_dtype fp8 holds TE's FP8 weights in FP8 only (the TE path is a GPU test): a plan without FP8 layers, or
    with FP8 layers on another backend, is refused by name before anything is built."""
    with pytest.raises(ConfigError, match=f"param_dtype fp8 .*{why}.*--param-dtype bf16"), session(
            from_overrides({**FAST, **settings, "training.param_dtype": "fp8", "training.steps": 1})):
        pass
    with pytest.raises(ConfigError, match="param_dtype fp8 keeps BF16 parameters.*pass --training.dtype bf16"):
        from_overrides({"training.param_dtype": "fp8", "training.dtype": "fp32"})


def test_under_ddp_each_bucket_is_averaged_as_soon_as_its_gradients_are_final_not_at_the_backwards_end(mesh):
    """MasterWeights(model, data_parallel=...) starts a bucket's all-reduce from the hook of its last parameter's
    gradient, during the backward of the step's last micro-batch; the backward's end only waits. Micro-batches
    under no_sync start none. One gloo rank (conftest's mesh): the collectives run, the order of calls is what is
    checked."""
    import torch.distributed as dist
    from torch import nn

    from fp8stack.precision import MasterWeights

    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    masters = MasterWeights(model, data_parallel=mesh, bucket_bytes=16 * 16 * 4 + 16 * 4)
    assert len(masters.buffers) == 4  # a bucket per layer (weight and bias)
    events, all_reduce, finish = [], dist.all_reduce, masters._average.finish
    masters._average.finish = lambda: (events.append(("backward end",)), finish())[1]
    dist.all_reduce = lambda buffer, **kwargs: (events.append(("start", buffer.numel())),
                                                 all_reduce(buffer, **kwargs))[1]
    try:
        x = torch.randn(8, 16)
        with masters.no_sync():
            model(x.bfloat16()).float().sum().backward()
        assert events == [], "accumulation micro-batches average nothing"
        model(x.bfloat16()).float().sum().backward()
    finally:
        dist.all_reduce = all_reduce
    assert events == [("start", 16 * 16 + 16)] * 4 + [("backward end",)]
    assert all(p.grad is None for p in masters.params)


@contextmanager
def _without_the_collector():
    """Only reference counting frees objects in here: a cycle stays (the collector seldom visits a finished run's
    objects, which have grown old, so a run's model could stay on the GPU while the next one starts)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("keeper", ["masters", "masters-released", "masters-ddp", "masters-ddp-released", "grads-ddp"])
def test_a_model_and_its_gradient_keeper_are_freed_once_the_user_lets_go_of_them(keeper, mesh):
    """Nothing the model holds (forward hooks, gradient hooks, get_main_grad) makes a cycle with its MasterWeights
    (or DataParallelGradients): model, masters, parameters and main_grads go with the last reference to them."""
    from torch import nn

    from fp8stack.precision import DataParallelGradients, MasterWeights

    with _without_the_collector():
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        data_parallel = mesh if "ddp" in keeper else None
        if keeper == "grads-ddp":
            keeper = DataParallelGradients(model, data_parallel)
            optimizer = torch.optim.AdamW(model.parameters())
            tensors = [*model.parameters()]
        else:
            keeper = MasterWeights(model, data_parallel=data_parallel, release_main_grads="released" in keeper)
            optimizer = keeper.track(torch.optim.AdamW(keeper.parameters()))
        for _ in range(2):
            with keeper.no_sync():
                model(torch.randn(4, 16).to(model[0].weight.dtype)).float().sum().backward()
            model(torch.randn(4, 16).to(model[0].weight.dtype)).float().sum().backward()
            if isinstance(keeper, MasterWeights):
                tensors = [*keeper.params, *keeper.masters, *(b for b in keeper.buffers if b is not None)]
            optimizer.step()
        alive = [weakref.ref(o) for o in (model, keeper, optimizer, *tensors)]
        del model, keeper, optimizer, tensors
        assert [ref() is not None for ref in alive] == [False] * len(alive)


@pytest.mark.parametrize("settings", [{}, {"training.release_main_grads": True},
                                      {"parallelism.data_parallel": "ddp", "parallelism.data_parallel_one_rank": True,
                                       "training.release_main_grads": True}],
                         ids=["persistent", "released", "ddp-released"])
def test_a_finished_session_frees_its_model_and_masters_with_its_last_reference(settings):
    """As the GPU memory test runs two sessions one after the other: once the caller lets go of a finished session,
    its model, optimizer, masters and main_grads are gone before the next session starts."""
    with _without_the_collector():
        with session(from_overrides({**FAST, "training.param_dtype": "bf16", "precision.recipe": "tensorwise",
                                     "training.global_batch": 4, "training.steps": 2, **settings})) as run:
            for _ in range(2):
                run.step(1.0)
            masters = run.masters
            alive = [weakref.ref(o) for o in (run.model, run.optimizer, masters, *masters.params, *masters.masters,
                                              *(b for b in masters.buffers if b is not None))]
        del run, masters
        assert [ref() is not None for ref in alive] == [False] * len(alive)
