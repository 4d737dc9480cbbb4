"""The trainer on two gloo ranks under each data-parallel wrapper, against one process on the same global batch:
DDP with BF16 parameters and FP32 masters (fp8stack.precision.MasterWeights averaging its main_grads) and with FP32
parameters (DataParallelGradients averaging their .grad), FSDP2 with BF16 parameters (its mixed-precision policy over
sharded FP32 masters), a DDP checkpoint saved on 2 ranks and resumed on 2 ranks (under DDP, and under FSDP2; an FSDP2
checkpoint under DDP), and the levers that once refused more
than one process now taken (or refused only for what a CPU lacks).

Every run accumulates 2 micro-batches per rank per step (4 in one process), so the gradients are averaged across
ranks once per step, after the last micro-batch (Session.no_sync), and clipping reads the averaged gradients.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fp8stack.backends.base import BackendUnavailable
from fp8stack.config import ConfigError, from_overrides
from fp8stack.models import load_model_config
from fp8stack.train.command import job_from_flags
from fp8stack.train.loop import cpu_fp8_gemms, train
from gloo_ranks import spawn

pytestmark = pytest.mark.slow

RUN = {"model.name": "tiny", "precision.recipe": "bf16", "training.device": "cpu", "training.dtype": "bf16",
       "training.steps": 4, "optimizer.warmup": 1, "training.micro_batch": 2, "training.global_batch": 8,
       "training.seq_len": 32, "training.eval_batches": 0, "data.max_bytes": 1 << 20, "logging.progress": False}
"""Tiny and few steps (two ranks share two cores); 8 sequences per step over all ranks."""
FP32 = {"training.dtype": "fp32"}
"""FP32 activations, so FP32 parameters (param_dtype resolves to fp32): DDP averages their .grad
(fp8stack.precision.DataParallelGradients) with no masters."""
FP32_RTOL = 1e-5
"""2 ranks vs 1 process in FP32: the same gradients up to summation order (observed: equal, or 1.4e-7 apart)."""
MICRO_BATCHES = 2
"""Micro-batches per rank per step on 2 ranks (global_batch / (micro_batch x 2))."""
PROFILED = 2
"""Steps whose collectives are counted (after the first)."""
STEP_ALL_REDUCES = 2
"""All-reduces every step of a multi-process run issues besides the gradients': the logged loss's mean over ranks
and the ranks' agreement on a stop signal."""
LOSS_RTOL = 2e-3
"""2 ranks vs 1 process, per step, with BF16 parameters. Both take the same FP32 gradient of the same global batch
up to summation order (each rank sums its half, then the halves are averaged), so the FP32 masters agree to rounding
and their BF16 copies agree except where a value lies near a BF16 rounding boundary. Observed: DDP 1.2e-7 (loss)
and 0 (gradient norm); FSDP2, whose reduce-scatter sums in another order and whose BF16 parameters are cast from FP32
shards where one process copies them from its masters, 3.5e-5 and 3.4e-4. Gradients of one rank's half-batch alone
(no average) differ by percents from the second step on."""

TWO_D = {"parallelism.tensor_parallel": 2, "parallelism.data_parallel_one_rank": True, "model.fused_projections": False,
         "precision.recipe": "rowwise"}
"""A 2-D mesh over the two ranks, data-parallel (FSDP2) 1 x tensor-parallel 2, with torchao rowwise layers (tensorwise
ones would all-gather float8 tensors, which gloo cannot move); the one-process twin runs the same model and plan."""
TWO_D_RTOL = 5e-3
"""TP vs one process with rowwise FP8: each rank scales its slice of a row on its own, so FP8 rounds differently (a
single step's loss: 1e-4 in tests/test_fsdp_gloo.py), and BF16 parameters under FSDP2 round their gathered copies once
more; a missing reduction or a wrong shard moves the loss by percents."""

FP8_PARAMETERS = {"training.param_dtype": "fp8", "precision.recipe": "delayed", "precision.backend": "te"}
LEVER_REFUSALS = {
    "param_dtype fp8, ddp": ({**FP8_PARAMETERS, "parallelism.data_parallel": "ddp"},
                             "TransformerEngine is not installed"),
    "param_dtype fp8, fsdp": ({**FP8_PARAMETERS, "parallelism.data_parallel": "fsdp"},
                              "TransformerEngine is not installed"),
    "te.gradient_accumulation_fusion, ddp": ({"te.gradient_accumulation_fusion": True,
                                              "parallelism.data_parallel": "ddp"}, "has no TE layers"),
}
"""Levers that refused more than one process -> (settings, what a CPU refuses them for now: TE, a GPU library)."""


def _ranks(rank: int, world: int, init_file: str, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    checkpoints = f"{folder}/checkpoints"
    try:
        with cpu_fp8_gemms(torch.device("cpu")):
            counted = {**RUN, "logging.profile_collectives": PROFILED}
            results = {"fsdp": train(from_overrides({**counted, "training.param_dtype": "bf16"})),
                       "ddp": train(from_overrides({**counted, "parallelism.data_parallel": "ddp"})),
                       "ddp_fp32": train(from_overrides({**RUN, **FP32, "parallelism.data_parallel": "ddp"})),
                       "tp_fsdp": train(from_overrides({**RUN, **TWO_D})),
                       "ddp_saving": train(from_overrides({**counted, "parallelism.data_parallel": "ddp",
                                                           "checkpoint.dir": checkpoints, "checkpoint.interval": 2})),
                       "ddp_resumed": train(from_overrides({**RUN, "parallelism.data_parallel": "ddp",
                                                            "checkpoint.dir": checkpoints,
                                                            "checkpoint.resume": f"{checkpoints}/step-00000002"}))}
            results.update(_resumed_under_the_other_wrapper(checkpoints, f"{folder}/fsdp_checkpoints"))
            refused = {}
            for lever, (settings, _) in LEVER_REFUSALS.items():
                try:
                    train(from_overrides({**RUN, **settings}))
                    refused[lever] = ""
                except (ConfigError, BackendUnavailable) as err:  # what `fp8stack train` reports, exit 2
                    refused[lever] = str(err)
        if rank == 0:
            torch.save({"results": {name: (r.losses, r.grad_norms, r.world_size, r.config, r.first_step,
                                           r.collectives)
                                    for name, r in results.items()},
                        "refused": refused}, f"{folder}/out.pt")
    finally:
        dist.destroy_process_group()


def _resumed_under_the_other_wrapper(ddp_checkpoints: str, fsdp_checkpoints: str) -> dict:
    """The DDP run's step-2 checkpoint resumed under FSDP2, and an FSDP2 run's under DDP (each in a new folder)."""
    fsdp = {**RUN, "parallelism.data_parallel": "fsdp"}
    fsdp_saving = train(from_overrides({**fsdp, "checkpoint.dir": fsdp_checkpoints, "checkpoint.interval": 2}))
    return {"fsdp_saving": fsdp_saving,
            "fsdp_resumed_from_ddp": train(from_overrides({**fsdp, "checkpoint.dir": f"{ddp_checkpoints}-fsdp",
                                                           "checkpoint.resume": f"{ddp_checkpoints}/step-00000002"})),
            "ddp_resumed_from_fsdp": train(from_overrides({**RUN, "parallelism.data_parallel": "ddp",
                                                           "checkpoint.dir": f"{fsdp_checkpoints}-ddp",
                                                           "checkpoint.resume": f"{fsdp_checkpoints}/step-00000002"}))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Every 2-rank run in one spawn: each process start costs seconds of imports."""
    folder = tmp_path_factory.mktemp("data_parallel")
    spawn(_ranks, (2, str(folder / "init"), str(folder)), 2)
    return torch.load(folder / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process():
    """The reference: one process, 4 micro-batches of 2 per step, BF16 parameters with FP32 masters."""
    result = train(from_overrides(RUN))
    assert result.config["training"]["param_dtype"] == "bf16" and result.losses[-1] < result.losses[0]
    return result


def _assert_close(one: list[float], two: list[float], what: str) -> None:
    assert len(one) == len(two) == RUN["training.steps"]
    for step, (a, b) in enumerate(zip(one, two)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{what} step {step}: 1 process {a:.6f} vs 2 ranks {b:.6f}"


def test_ddp_with_bf16_parameters_trains_as_one_process_reducing_once_per_step(two_ranks, one_process):
    losses, grad_norms, world_size, config, _, collectives = two_ranks["results"]["ddp"]
    assert world_size == 2 and config["parallelism"]["data_parallel"] == "ddp"
    assert config["training"]["param_dtype"] == "bf16"  # the default wherever activations are BF16
    _assert_close(one_process.losses, losses, "ddp")
    _assert_close(one_process.grad_norms, grad_norms, "ddp gradient norm")
    # One all-reduce of the tiny model's FP32 gradients (one bucket) per step, after the second micro-batch, beside
    # the step's loss mean and the stop-signal agreement: averaging after each micro-batch would make it 4.
    assert collectives["counts"] == {"all_reduce": 1 + STEP_ALL_REDUCES}


def test_ddp_with_fp32_parameters_trains_as_one_process(two_ranks):
    losses, grad_norms, _, config, _, _ = two_ranks["results"]["ddp_fp32"]
    assert config["training"]["param_dtype"] == "fp32"
    one = train(from_overrides({**RUN, **FP32}))
    assert len(losses) == len(one.losses) and one.losses[-1] < one.losses[0]
    assert losses == pytest.approx(one.losses, rel=FP32_RTOL)
    assert grad_norms == pytest.approx(one.grad_norms, rel=FP32_RTOL)


def test_fsdp_with_bf16_parameters_trains_as_one_process_reducing_once_per_step(two_ranks, one_process):
    losses, grad_norms, world_size, config, _, collectives = two_ranks["results"]["fsdp"]
    assert world_size == 2 and config["parallelism"]["data_parallel"] == "fsdp"
    assert config["training"]["param_dtype"] == "bf16" and config["te"]["gradient_accumulation_fusion"] is False
    _assert_close(one_process.losses, losses, "fsdp")
    _assert_close(one_process.grad_norms, grad_norms, "fsdp gradient norm")
    # FSDP2 gathers each block twice per micro-batch (forward, backward) and the root once, in BF16 (its
    # mixed-precision policy), and reduce-scatters each group's gradients once per step, after the last micro-batch.
    groups = load_model_config("tiny").n_layers + 1
    assert collectives["counts"]["all_gather"] == MICRO_BATCHES * (2 * (groups - 1) + 1)
    assert collectives["counts"]["reduce_scatter"] == groups
    assert collectives["all_gather_dtypes"] == ["c10::BFloat16"]


def test_tensor_parallel_with_fsdp_on_a_2d_mesh_trains_as_one_process(two_ranks):
    losses, grad_norms, world_size, config, _, _ = two_ranks["results"]["tp_fsdp"]
    assert world_size == 2 and config["parallelism"]["tensor_parallel"] == 2
    assert config["training"]["param_dtype"] == "bf16"  # FSDP2's mixed precision over the data-parallel dimension
    one = train(from_overrides({**RUN, **{k: v for k, v in TWO_D.items() if not k.startswith("parallelism.")}}))
    assert one.losses[-1] < one.losses[0]
    assert losses == pytest.approx(one.losses, rel=TWO_D_RTOL)
    assert grad_norms == pytest.approx(one.grad_norms, rel=10 * TWO_D_RTOL)


def test_ddp_checkpoint_saved_on_two_ranks_resumes_on_two_ranks_bit_identically(two_ranks, one_process):
    """The FP32 masters, their AdamW moments (replicated: DCP writes them once) and each rank's data position and RNG
    come back, so the resumed steps are the uninterrupted run's, exactly."""
    saving, resumed = two_ranks["results"]["ddp_saving"], two_ranks["results"]["ddp_resumed"]
    assert saving[3]["training"]["param_dtype"] == "bf16" and saving[2] == 2
    assert saving[0] == two_ranks["results"]["ddp"][0]  # saving changes nothing the steps compute
    # Profiled steps that save: DCP's planning gathers objects (all_gather's list form, counted apart, no bytes).
    assert saving[5]["counts"]["all_gather_list"] > 0 and "all_gather" not in saving[5]["bytes"]
    assert resumed[4] == 2 and resumed[0] == saving[0][2:]  # exact equality


@pytest.mark.parametrize("saved, resumed", [("ddp_saving", "fsdp_resumed_from_ddp"),
                                             ("fsdp_saving", "ddp_resumed_from_fsdp")])
def test_a_checkpoint_resumes_under_the_other_data_parallel_wrapper(two_ranks, saved, resumed):
    """The data-parallel wrapper is not a run setting: DCP reshards the FP32 masters and their moments between
    DDP's replicas and FSDP2's shards, so the resumed steps are the saving run's up to the wrappers' rounding (the
    2-rank tolerance: FSDP2 reduce-scatters in another order and casts its BF16 copies from shards)."""
    saving, resuming = two_ranks["results"][saved], two_ranks["results"][resumed]
    assert saving[3]["parallelism"]["data_parallel"] != resuming[3]["parallelism"]["data_parallel"]
    assert resuming[4] == 2 and len(resuming[0]) == RUN["training.steps"] - 2
    for step, (a, b) in enumerate(zip(saving[0][2:], resuming[0]), start=2):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{resumed} step {step}: saved run {a:.6f}, resumed {b:.6f}"


def test_levers_that_refused_more_than_one_process_now_refuse_only_what_a_cpu_lacks(two_ranks):
    for lever, (_, reason) in LEVER_REFUSALS.items():
        said = two_ranks["refused"][lever]
        assert reason in said, (lever, said)
        assert "one process" not in said and "ranks" not in said, (lever, said)


def test_old_flag_spellings_reach_the_renamed_field():
    assert job_from_flags(["--fsdp-one-rank", "--data-parallel", "ddp"]).parallelism.data_parallel_one_rank


def test_fsdp_keeping_gathered_parameters_trains_as_resharding_does():
    """--no-parallelism.fsdp-reshard-after-forward gathers once per step instead of twice per micro-batch: the same
    BF16 copies of the same shards, so the same losses (FSDP2 over one rank, 4 micro-batches per step)."""
    one_rank = {**RUN, "parallelism.data_parallel_one_rank": True, "training.steps": 2}
    resharded = train(from_overrides(one_rank))
    gathered = train(from_overrides({**one_rank, "parallelism.fsdp_reshard_after_forward": False}))
    assert gathered.losses == resharded.losses and gathered.grad_norms == resharded.grad_norms


@pytest.mark.parametrize("reduce_each", [False, True])
def test_fsdp_reducing_each_micro_batch_holds_no_unsharded_gradient_between_them(reduce_each):
    """--parallelism.fsdp-reduce-each-micro-batch: after a micro-batch but the last, the gradients are already in the
    sharded FP32 gradients and no unsharded FP32 gradient (4 bytes per parameter of the whole model) waits for the
    next; without it they wait unsharded (FSDP2 over one rank)."""
    from fp8stack.train.loop import session

    one_rank = {**RUN, "parallelism.data_parallel_one_rank": True, "training.steps": 2,
                "parallelism.fsdp_reduce_each_micro_batch": reduce_each}
    with session(from_overrides(one_rank)) as run:
        tokens, targets = (t.chunk(run.micro_batches)[0] for t in run.data.batch(0))
        with run.no_sync(), run.autocast():
            run.loss_fn(tokens, targets).backward()
        params = [p for module in run.model.modules() if isinstance(module, FSDPModule)
                  for p in module._get_fsdp_state()._fsdp_param_group.fsdp_params]
        waiting = [p for p in params if p.unsharded_accumulated_grad is not None]
        reduced = [p for p in params if p.sharded_param.grad is not None]
        assert (len(waiting), len(reduced)) == ((0, len(params)) if reduce_each else (len(params), 0))


def test_fsdp_reducing_each_micro_batch_trains_as_reducing_once_per_step():
    """The same FP32 sums of the same BF16 micro-batch gradients, so the same losses (FSDP2 over one rank)."""
    one_rank = {**RUN, "parallelism.data_parallel_one_rank": True, "training.steps": 2}
    each = train(from_overrides({**one_rank, "parallelism.fsdp_reduce_each_micro_batch": True}))
    assert each.losses == train(from_overrides(one_rank)).losses
