"""MasterWeights(release_main_grads=True) on a CPU: the FP32 main_grads exist only from a step's first backward to its
optimizer step, and training is bit-identical to the persistent buffers' (the hook path and the BF16 grouped experts'
GEMMs writing main_grad; one process and two gloo ranks; a checkpoint resumed right after a step). The TE and
grouped_fp8 paths, and the memory they save, are GPU tests (tests/gpu/test_release_main_grads_gpu.py)."""

import weakref
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from gloo_ranks import on_gloo_ranks

from fp8stack import PolicyConfig, assemble, load_description, make_plan
from fp8stack.config import ConfigError, from_overrides
from fp8stack.models import GroupedExperts, Llama, load_model_config
from fp8stack.precision import MasterWeights
from fp8stack.train.loop import train

STEPS, MICRO_BATCHES = 3, 2
"""Optimizer steps, each accumulating this many micro-batches."""
BUCKET_BYTES = 2048
"""Small buckets (a layer's main_grads or fewer each; WithUnused.unused's alone), so that each is allocated by the
backward that reaches it."""


class WithUnused(nn.Module):
    """An embedding (sparse gradients into main_grad), two linears, and a linear the forward never reaches: the
    optimizer still steps it with a zero gradient (weight decay), as it does with persistent main_grads."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(32, 16)
        self.unused, self.hidden, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.embedding(tokens)))).float()


def _plain_model() -> nn.Module:
    torch.manual_seed(0)
    return WithUnused()


def _tiny(name: str, recipe: str):
    """A model converted through the public make_plan / assemble API (the bf16 backend hands tiny-moe's grouped
    experts their main_grads: their wgrad GEMMs fetch them in the backward)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        plan = make_plan(load_description(name), PolicyConfig(recipe=recipe, small_gemm_filter="off"))
        return assemble(Llama(load_model_config(name)), plan)
    return build


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _steps(model: nn.Module, release: bool, mesh=None, rank: int = 0, world: int = 1) -> dict:
    """STEPS AdamW steps of MICRO_BATCHES micro-batches each (under no_sync but the last); the masters' gradients
    before each step, the masters and parameters after each, and what was alive when."""
    masters = MasterWeights(model, data_parallel=mesh, bucket_bytes=BUCKET_BYTES, release_main_grads=release)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-2, weight_decay=0.1))
    generator = torch.Generator().manual_seed(1)
    out = {"grads": [], "masters": [], "params": [], "allocated_before_backward": [], "alive_after_step": [],
           "buckets": len(masters.buffers)}
    for _ in range(STEPS):
        tokens = torch.randint(0, 32, (2 * world * MICRO_BATCHES, 9), generator=generator).chunk(world)[rank]
        for index, batch in enumerate(tokens.chunk(MICRO_BATCHES)):
            last = index == MICRO_BATCHES - 1
            with nullcontext() if last else masters.no_sync():
                loss = _loss(model, batch) / MICRO_BATCHES
                if index == 0:
                    out["allocated_before_backward"].append(sum(b is not None for b in masters.buffers))
                loss.backward()
        out["grads"].append([m.grad.clone() for m in masters.masters])
        freed = [weakref.ref(buffer) for buffer in masters.buffers]
        optimizer.step()
        optimizer.zero_grad()
        out["alive_after_step"].append(sum(ref() is not None for ref in freed)
                                       + sum(hasattr(p, "main_grad") for p in masters.params)
                                       + sum(m.grad is not None for m in masters.masters))
        out["masters"].append([m.detach().clone() for m in masters.masters])
        out["params"].append([p.detach().clone() for p in masters.params])
    return out


def _assert_bit_identical(persistent: dict, released: dict) -> None:
    for key in ("grads", "masters", "params"):
        for step, (kept, freed) in enumerate(zip(persistent[key], released[key], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(kept, freed, strict=True)), f"{key} differ at step {step}"


@pytest.mark.parametrize("build", [_plain_model, _tiny("tiny", "tensorwise"), _tiny("tiny-moe", "bf16")],
                         ids=["hooks-embedding-unused", "tiny-tensorwise", "tiny-moe-bf16-grouped-experts"])
def test_released_main_grads_train_bit_identically_and_hold_nothing_between_steps(build):
    persistent, released = _steps(build(), release=False), _steps(build(), release=True)
    _assert_bit_identical(persistent, released)
    assert released["allocated_before_backward"] == [0] * STEPS, "a forward allocates no main_grad"
    assert released["alive_after_step"] == [0] * STEPS, "no buffer, main_grad or master .grad outlives the step"
    # the checks can fail: the persistent buffers stay
    assert persistent["allocated_before_backward"] == [persistent["buckets"]] * STEPS
    assert all(alive > 0 for alive in persistent["alive_after_step"])
    assert any(g.abs().sum() > 0 for g in released["grads"][-1])


def test_a_parameter_no_backward_reached_is_stepped_with_a_zero_gradient():
    """Its bucket is allocated at the backward's end: AdamW decays it as with persistent main_grads, where a None
    .grad would skip it."""
    model = _plain_model()
    before = model.unused.weight.detach().clone()
    released = _steps(model, release=True)
    assert released["buckets"] == 5, "the unused linear's main_grads are a bucket of their own"
    unused = list(dict(model.named_parameters())).index("unused.weight")
    assert all(not grads[unused].any() for grads in released["grads"])
    assert not torch.equal(released["masters"][-1][unused], before), "weight decay moved it"


def test_grouped_experts_fetch_their_released_main_grads_under_torch_compile():
    """The trainer compiles each block: the BF16 grouped experts' backward fetches the released buffer each step
    (dynamo runs that function outside its graph: a backward allocating memory is a side effect it cannot trace)
    and lands its gradient where the masters read it, bit for bit as eager."""
    def steps(compiled: bool) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        experts = GroupedExperts(32, 48, 4)
        experts.init_weights(0.02)
        experts.wgrad_into_main_grad = True  # as the bf16 backend's hand_over_main_grads sets it
        masters = MasterWeights(experts, release_main_grads=True)
        optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-2))
        forward = torch.compile(experts, backend="aot_eager") if compiled else experts
        x, offsets = torch.randn(36, 32, dtype=torch.bfloat16), torch.tensor([8, 8, 24, 32]).int()
        grads = []
        for step in range(STEPS):
            for micro_batch in range(MICRO_BATCHES):
                forward(x * (step + micro_batch + 1), offsets).float().square().sum().backward()
            grads.append([m.grad.clone() for m in masters.masters])
            optimizer.step()
        return grads

    eager, compiled = steps(False), steps(True)
    assert all(torch.equal(a, b) for e, c in zip(eager, compiled, strict=True) for a, b in zip(e, c, strict=True))
    assert all(g.abs().sum() > 0 for g in compiled[-1])


def on_two_ranks(rank: int, world: int) -> dict:
    """Both ways on each rank, the tiny Llama in tensorwise FP8 (hooks) and tiny-moe in BF16 (grouped experts)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, recipe in (("tiny", "tensorwise"), ("tiny-moe", "bf16")):
        build = _tiny(name, recipe)
        out[name] = [_steps(build(), release, mesh, rank, world) for release in (False, True)]
    return out


@pytest.mark.slow
def test_released_main_grads_average_over_gloo_ranks_bit_identically(tmp_path):
    """data_parallel: each released bucket is averaged as the persistent one is (allocated by the backward that
    fills it, or zero at the backward's end); the steps agree bit for bit."""
    results = on_gloo_ranks(on_two_ranks, 2, tmp_path)
    for name, (persistent, released) in results.items():
        _assert_bit_identical(persistent, released)
        assert released["alive_after_step"] == [0] * STEPS, name


def test_a_run_resumes_bit_identically_from_a_checkpoint_taken_right_after_a_step(tmp_path):
    """The trainer's option: its checkpoint saves the masters and the optimizer (their gradients were just freed), and
    the resumed run, which builds its optimizer state without them, continues loss for loss."""
    settings = {"training.micro_batch": 2, "training.global_batch": 4, "training.seq_len": 64,
                "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False,
                "training.dtype": "bf16", "training.param_dtype": "bf16", "precision.recipe": "tensorwise",
                "training.steps": 4, "optimizer.warmup": 1, "training.release_main_grads": True}
    uninterrupted = train(from_overrides(settings))
    assert uninterrupted.losses == train(from_overrides({**settings, "training.release_main_grads": False})).losses
    train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": 2}))
    resumed = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path),
                                    "checkpoint.resume": str(tmp_path / "step-00000002")}))
    assert resumed.first_step == 2 and resumed.losses == uninterrupted.losses[2:]


@pytest.mark.parametrize(("settings", "why"), [
    ({"training.param_dtype": "fp32"}, "FP32 parameters take autograd's gradients"),
    ({"training.param_dtype": "bf16", "training.dtype": "bf16", "parallelism.data_parallel": "fsdp",
      "parallelism.data_parallel_one_rank": True}, "FSDP2 reduces its own"),
])
def test_the_option_is_refused_where_no_master_weights_keep_main_grads(settings, why):
    with pytest.raises(ConfigError, match=f"release_main_grads frees .*\\({why}\\): drop --training.release-main"):
        from_overrides({**settings, "training.release_main_grads": True})
