"""Expert parallelism on two GPUs (the Megatron path, --expert-model-parallel-size 2): tiny-moe's 8 experts split 4
and 4 over two NCCL ranks in TEGroupedMLP, each rank holding the plain Llama's experts 4r..4r+3; its first step
computes the loss and gradient norm of the same model on one GPU with every expert (EP=1, the same global batch),
its all-to-alls carry BF16 tokens (no FP8 dispatch), and a run resumed from its middle checkpoint repeats the
uninterrupted one bit for bit. Every EP=2 case runs in one launch of two ranks (split_runs), each test reading its
own. The CPU twin, on megatron's local spec over gloo: tests/test_megatron_expert_parallel_gloo.py. Run with
`pytest -m gpu tests/gpu/test_megatron_expert_parallel_gpu.py` on a machine with two GPUs."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gpu_ranks import as_rank, free_ports
from gpu_skips import require_te, te_mark, te_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

require_te(["delayed"])

from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.config import JobConfig, from_overrides  # noqa: E402
from fp8stack.train import checkpoint  # noqa: E402
from fp8stack.train.loop import session, train  # noqa: E402
from fp8stack.train.model import build_model  # noqa: E402

RECIPES = [pytest.param("bf16"), pytest.param("blockwise", marks=te_mark(["blockwise"]))]
"""BF16, and the FP8 recipe the expert-parallel bench runs (blockwise needs a Hopper GPU or newer)."""
SETTINGS = {"training.steps": 5, "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 4,
            "training.seq_len": 128, "data.max_bytes": 1 << 20, "logging.profile_collectives": 2}
"""Four sequences per step: two micro-batches on one GPU, one per rank on two."""
FIRST_LOSS_RTOL, FIRST_NORM_RTOL, LOSS_RTOL = 1e-3, 1e-2, 2e-2
"""EP=2 against EP=1: the first step's loss (the same weights and batch: only the experts' GEMMs see other token
counts), its gradient norm (summed in another order), and the later steps' losses (BF16 rounding amplified by
Adam's first steps)."""
MIDDLE = 3
"""The checkpoint resumed from (checkpoints every MIDDLE steps)."""
SPLIT = 2
"""The expert-parallel degree on two GPUs."""


@pytest.fixture(autouse=True)
def no_megatron_state_left_by_other_modules():
    """The trainer sets up megatron's parallel state itself; each run starts as a new process would."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    yield
    FP8GlobalStateManager.reset()


def tiny_moe(recipe: str, expert_parallel: int, overrides: dict | None = None) -> JobConfig:
    return from_overrides({"model.name": "tiny-moe", "model.impl": "megatron", "precision.recipe": recipe,
                           "parallelism.expert_parallel": expert_parallel, "training.device": "cuda",
                           "training.eval_batches": 0, "logging.progress": False, "optimizer.lr": 1e-3,
                           **SETTINGS, **(overrides or {})})


def _train(cfg: JobConfig):
    result = train(cfg)
    FP8GlobalStateManager.reset()  # the next run starts as a new process would
    return result


def _split_case(rank: int, ports: list[int], recipe: str, out: str) -> None:
    """Rank `rank` at EP=2: which experts its TEGroupedMLPs hold (against the plain Llama's), then the run."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    as_rank(rank, SPLIT, ports[0])
    cfg = tiny_moe(recipe, SPLIT)
    with session(cfg) as run:
        gpt = run.model.module
        plain = build_model(run.config, run.env.device)  # as megatron_model.build draws it
        experts = [layer.mlp.experts for layer in gpt.decoder.layers[1:]]
        held = all(isinstance(e, TEGroupedMLP) and e.num_local_experts == 4 for e in experts) and all(
            torch.equal(getattr(e.linear_fc1, f"weight{j}"), block.moe.experts.w13[4 * rank + j])
            and torch.equal(getattr(e.linear_fc2, f"weight{j}"), block.moe.experts.w2[4 * rank + j])
            for e, block in zip(experts, plain.layers[1:]) for j in range(4))
    FP8GlobalStateManager.reset()
    as_rank(rank, SPLIT, ports[1])
    result = _train(cfg)
    torch.save({"held": held, "losses": result.losses, "grad_norms": result.grad_norms,
                "collectives": result.collectives}, out)


def _resume_case(rank: int, ports: list[int], folder: str, out: str) -> None:
    """Rank `rank` at EP=2: the full run saving every MIDDLE steps, then the run resumed from step MIDDLE."""
    cfg = tiny_moe("delayed", SPLIT, {"checkpoint.dir": folder, "checkpoint.interval": MIDDLE})
    as_rank(rank, SPLIT, ports[0])
    full = _train(cfg)
    as_rank(rank, SPLIT, ports[1])
    resumed = _train(from_overrides({"checkpoint.resume": str(checkpoint.checkpoint_path(folder, MIDDLE)),
                                     "checkpoint.trust": True}, cfg))
    torch.save({"full": (full.losses, full.grad_norms), "resumed": (resumed.losses, resumed.grad_norms),
                "first_step": resumed.first_step}, out)


def _rank(rank: int, ports: list[int], recipes: list[str], folder: str) -> None:
    """Rank `rank` of the one launch: each recipe's split case, then the resume case, each run meeting the other rank
    on a port of its own."""
    for i, recipe in enumerate(recipes):
        _split_case(rank, ports[2 * i:2 * i + 2], recipe, f"{folder}/{recipe}-rank{rank}")
    _resume_case(rank, ports[-2:], f"{folder}/ckpt", f"{folder}/resume-rank{rank}")


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> Path:
    """The folder where one launch of two ranks left every EP=2 case's results: a launch imports torch, TE and
    megatron anew in each rank, the slowest part of these tests, so the cases share one. A rank's error fails every
    test of the module, naming it."""
    folder = tmp_path_factory.mktemp("expert-parallel")
    recipes = [recipe for recipe in ("bf16", "blockwise") if recipe == "bf16" or te_runs([recipe])[0]]
    mp.spawn(_rank, args=(free_ports(2 * len(recipes) + 2), recipes, str(folder)), nprocs=2, join=True)
    return folder


@pytest.mark.parametrize("recipe", RECIPES)
def test_split_experts_start_as_all_experts_on_one_gpu(recipe, split_runs):
    """Each rank's TEGroupedMLPs hold its four of the plain Llama's experts; the first step's loss and gradient norm
    are one GPU's with every expert, the later losses close; EP=2 dispatches BF16 tokens by all-to-all, EP=1 none."""
    whole = _train(tiny_moe(recipe, 1))
    ranks = [torch.load(split_runs / f"{recipe}-rank{rank}", weights_only=False) for rank in (0, 1)]
    assert all(found["held"] for found in ranks)
    split = ranks[0]
    assert split["losses"] == ranks[1]["losses"]  # averaged over the ranks: the same on both
    assert split["losses"][0] == pytest.approx(whole.losses[0], rel=FIRST_LOSS_RTOL)
    assert split["grad_norms"][0] == pytest.approx(whole.grad_norms[0], rel=FIRST_NORM_RTOL)
    assert split["losses"] == pytest.approx(whole.losses, rel=LOSS_RTOL), (split["losses"], whole.losses)
    sent = split["collectives"]
    assert sent["counts"].get("all_to_all", 0) > 0 and "all_to_all" not in whole.collectives["counts"]
    assert "c10::BFloat16" in sent["all_to_all_bytes_by_dtype"], sent["all_to_all_bytes_by_dtype"]
    assert not any("Float8" in element for element in sent["all_to_all_bytes_by_dtype"])


def test_split_experts_resume_from_a_checkpoint_bit_identically(split_runs):
    """Delayed scaling at EP=2: each rank saves its experts at their global index (and AdamW's moments beside
    them) and the FP8 scaling state of its own GroupedLinears in its rank file; the run resumed from the middle
    checkpoint repeats the uninterrupted losses and gradient norms exactly."""
    for rank in (0, 1):
        found = torch.load(split_runs / f"resume-rank{rank}", weights_only=False)
        (full_losses, full_norms), (losses, norms) = found["full"], found["resumed"]
        assert found["first_step"] == MIDDLE
        assert losses == full_losses[MIDDLE:] and norms == full_norms[MIDDLE:]
