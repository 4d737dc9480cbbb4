"""Expert parallelism on the Megatron path over two CPU ranks (gloo): megatron's MoE layers with their experts split
over the ranks train as with every expert on every rank.

deepseek-moe-small's routing at a CPU size (megatron_cpu.small_deepseek: 8 experts top 4, sigmoid scores with the
expert bias, a shared expert) on megatron's local spec (SequentialMLP experts; TEGroupedMLP needs CUDA, see
tests/gpu/test_megatron_expert_parallel_gpu.py) with the alltoall dispatcher, through megatron_cpu's shims. Both runs
have two data-parallel ranks reading halves of the same global batch, in megatron's DDP with the trainer's AdamW and
MegatronModel's gradient finishing; at EP=1 each rank holds all 8 experts, at EP=2 rank r holds experts 4r..4r+3 and
the dispatcher sends each token to its expert's rank over gloo's all_to_all_single. Measured: the losses and gradient
norms of 4 steps bit-identical, the experts' weights within WEIGHT_ATOL (an expert's weight gradient sums both ranks'
tokens in one GEMM at EP=2, in two reduced by DDP at EP=1). A checkpoint of the EP=2 run (each rank's experts at
their global expert index) resumes bit-identically.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import megatron_cpu
from gloo_ranks import on_gloo_ranks

from fp8stack.config import from_overrides
from fp8stack.train import checkpoint, megatron_model
from fp8stack.train.command import job_from_flags
from fp8stack.train.comm_stats import CollectiveCounter
from fp8stack.train.loop import _adamw
from fp8stack.train.model import model_config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:GPTModel IS DEPRECATED")]

STEPS = 4
"""Optimizer steps on one fixed global batch."""
GLOBAL_BATCH, SEQ = 4, 32
"""Sequences per step over both ranks, tokens per sequence."""
RTOL = 1e-5
"""Agreement of the EP=2 run's losses and gradient norms with the EP=1 run's (see the module docstring)."""
WEIGHT_ATOL = 1e-6
"""Agreement of the experts' weights after the steps: Adam divides each gradient by its own running magnitude, so
where a weight's gradient nearly vanishes the summation order's rounding moves its update by up to 1e-3 of the
learning rate (measured 2.3e-7 at lr 1e-3)."""


def job(expert_parallel: int):
    return from_overrides({"training.seq_len": SEQ, "parallelism.expert_parallel": expert_parallel},
                          job_from_flags(["--model-impl", "megatron", "--model", "deepseek-moe-small", "--lr", "1e-3"]))


def built_on_cpu(expert_parallel: int, seed: int) -> megatron_model.MegatronModel:
    """What megatron_model.build gives two data-parallel ranks, on the CPU: the GPTModel in megatron's DDP (FP32
    main_grad buffers), its expert-parallel group for the gradient norm."""
    from megatron.core import parallel_state

    cfg = job(expert_parallel)
    gpt = megatron_cpu.drawn_gpt(cfg, megatron_cpu.small_deepseek(model_config(cfg)), seed)
    model = megatron_model.with_main_grads(gpt, gpt.config, fuse_wgrad=False, distributed_optimizer=False)
    return megatron_model.MegatronModel(
        model=model, gpt=gpt, plan=None, seq_len=SEQ, tp_group=parallel_state.get_tensor_model_parallel_group(),
        expert_group=(parallel_state.get_expert_tensor_and_model_parallel_group() if expert_parallel > 1 else None),
        main_grads=True)


def step(built: megatron_model.MegatronModel, optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """One optimizer step as the trainer's Session.step takes it: (the loss averaged over the ranks, the norm)."""
    loss = megatron_cpu.causal_loss(built.model, tokens, tokens.roll(-1, 1))
    loss.backward()
    norm = built.clip(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    built.after_optimizer_step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size(), norm.item()


def trained(rank: int, expert_parallel: int, folder: str) -> dict:
    """STEPS steps at this expert-parallel degree on this rank's half of the global batch: losses, norms, the
    routers' expert bias, this rank's experts (layer 1's fc1) by global index; at EP=2 also the step after a
    checkpoint of step STEPS - 1, taken by a model resumed from it."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    try:
        built = built_on_cpu(expert_parallel, seed=0)
        optimizer = _adamw(built.model, job(expert_parallel))
        tokens = torch.randint(0, 512, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        tokens = tokens.chunk(dist.get_world_size())[rank]
        with CollectiveCounter(STEPS - 2) as counter:
            losses, norms = map(list, zip(*(counted(counter, step(built, optimizer, tokens))
                                            for _ in range(STEPS - 1))))
        resumed = resumed_beside(built, optimizer, tokens, folder) if expert_parallel > 1 else None
        last_loss, last_norm = step(built, optimizer, tokens)
        experts = megatron_model.local_experts(megatron_cpu.small_deepseek(model_config(job(expert_parallel))))
        layer = built.gpt.decoder.layers[1].mlp
        return {"losses": [*losses, last_loss], "norms": [*norms, last_norm], "resumed": resumed,
                "collectives": counter.result,
                "expert_bias": [layer.mlp.router.expert_bias.clone() for layer in built.gpt.decoder.layers[1:]],
                "experts": {expert: layer.experts.local_experts[local].linear_fc1.weight.detach().clone()
                            for local, expert in enumerate(experts)}}
    finally:
        parallel_state.destroy_model_parallel()


def counted(counter: CollectiveCounter, result):
    """`result` of a step, the step counted as done."""
    counter.step_done()
    return result


def resumed_beside(built, optimizer, tokens: torch.Tensor, folder: str) -> dict:
    """Save `built` and its optimizer, load them into a model drawn from another seed, and take the next step
    there: whether every tensor loaded equal, and that step's loss."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    path = checkpoint.save(folder, STEPS - 1, built.model, optimizer, scheduler, 0,
                           layout=built.checkpoint_layout(optimizer))
    other = built_on_cpu(2, seed=1)
    fresh = _adamw(other.model, job(2))
    checkpoint.load(path, other.model, fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda _: 1.0),
                    layout=other.checkpoint_layout(fresh))
    mine, theirs = built.gpt.state_dict(), other.gpt.state_dict()
    equal = {name: torch.equal(value, theirs[name]) for name, value in mine.items() if isinstance(value, torch.Tensor)}
    saved, loaded = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    equal["adamw"] = saved.keys() == loaded.keys() and all(torch.equal(saved[i][k], loaded[i][k])
                                                           for i in saved for k in saved[i])
    return {"equal": equal, "next_loss": step(other, fresh, tokens)[0]}


def both_degrees(folder: str, rank: int, world: int) -> dict:
    """Expert-parallel degree -> trained(); rank 0's view."""
    with pytest.MonkeyPatch.context() as patch:
        megatron_cpu.megatron_moe_on_cpu(patch)
        return {expert_parallel: trained(rank, expert_parallel, folder) for expert_parallel in (1, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("expert-parallel")
    return on_gloo_ranks(functools.partial(both_degrees, str(folder / "checkpoints")), 2, folder)


def test_split_experts_compute_the_same_first_loss(runs):
    """The same weights and batch: the first step's loss (its forward) as with all experts on every rank."""
    assert runs[2]["losses"][0] == pytest.approx(runs[1]["losses"][0], rel=1e-6)


def test_split_experts_train_as_all_experts_on_every_rank(runs):
    """Each step's loss and gradient norm (each rank's experts counted once), the expert bias (moved by the token
    counts summed over both ranks) and rank 0's experts after the steps: as at EP=1."""
    split, whole = runs[2], runs[1]
    assert split["losses"] == pytest.approx(whole["losses"], rel=RTOL)
    assert split["norms"] == pytest.approx(whole["norms"], rel=RTOL)
    assert whole["losses"][-1] < whole["losses"][0]
    assert all(torch.equal(a, b) for a, b in zip(split["expert_bias"], whole["expert_bias"], strict=True))
    assert any(bias.abs().sum() > 0 for bias in split["expert_bias"])
    assert sorted(split["experts"]) == [0, 1, 2, 3] and sorted(whole["experts"]) == list(range(8))
    for expert, weight in split["experts"].items():
        torch.testing.assert_close(weight, whole["experts"][expert], rtol=RTOL, atol=WEIGHT_ATOL)


def test_split_experts_exchange_their_tokens_by_all_to_all(runs):
    """Per step and MoE layer (2 of them), three all-to-alls forward (tokens to the experts' ranks, their routing
    weights, the expert outputs back) and their three gradients backward, in the activations' dtype (FP32 on a
    CPU); none with every expert on every rank."""
    split, whole = runs[2]["collectives"], runs[1]["collectives"]
    assert split.steps == whole.steps == STEPS - 2
    assert split.counts["all_to_all"] == 2 * 6 and "all_to_all" not in whole.counts
    assert set(split.all_to_all_bytes_by_dtype) == {"float"} and split.bytes["all_to_all"] > 0


def test_split_experts_resume_from_a_checkpoint_bit_identically(runs):
    """Each rank's experts saved at their global index (and AdamW's moments beside them), loaded into a model drawn
    from another seed: every tensor equal, and the next step's loss the uninterrupted run's, bit for bit."""
    resumed = runs[2]["resumed"]
    assert all(resumed["equal"].values()), [name for name, ok in resumed["equal"].items() if not ok]
    assert resumed["next_loss"] == runs[2]["losses"][-1]
