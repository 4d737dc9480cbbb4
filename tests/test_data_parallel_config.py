"""parallelism.data_parallel (fsdp | ddp) in the configuration and in what a run resolves: which levers each wrapper
takes, which it refuses (one line naming the fix, exit code 2, before anything is built), and what auto chooses."""

import pytest

from fp8stack.config import ConfigError, from_overrides
from fp8stack.train.command import job_from_flags
from fp8stack.train.command import main as train_main
from fp8stack.train.resolve import data_parallel_wrapped, resolve, wgrad_fusion

CPU_BF16 = {"model.name": "tiny", "training.device": "cpu", "training.dtype": "bf16"}
"""Resolvable on this machine, with the BF16 activations BF16 parameters need."""


def test_data_parallel_fields_and_their_flags():
    job = job_from_flags([])
    assert (job.parallelism.data_parallel, job.parallelism.data_parallel_one_rank) == ("fsdp", False)
    for flags in (["--parallelism.data-parallel", "ddp"], ["--data-parallel", "ddp"]):
        assert job_from_flags(flags).parallelism.data_parallel == "ddp"
    for alias in ("--parallelism.data-parallel-one-rank", "--data-parallel-one-rank", "--parallelism.fsdp-one-rank",
                  "--fsdp-one-rank"):
        assert job_from_flags([alias]).parallelism.data_parallel_one_rank is True
        assert job_from_flags([alias.replace("--", "--no-", 1)]).parallelism.data_parallel_one_rank is False
    with pytest.raises(ConfigError, match="unknown parallelism.data_parallel 'zero': use fsdp, ddp"):
        from_overrides({"parallelism.data_parallel": "zero"})


LEVERS = {"training.param_dtype": "bf16"}, {"training.param_dtype": "fp8"}, {"te.gradient_accumulation_fusion": True}


@pytest.mark.parametrize("lever", LEVERS, ids=lambda lever: "=".join(map(str, *lever.items())))
@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("one_rank", [False, True])
def test_ddp_takes_every_single_process_lever_at_any_world_size(lever, world_size, one_rank):
    job = from_overrides({**CPU_BF16, **lever, "parallelism.data_parallel": "ddp",
                          "parallelism.data_parallel_one_rank": one_rank})
    resolved = resolve(job, None if job.model.factory else _tiny(), world_size)
    assert resolved.parallelism.data_parallel == "ddp"


@pytest.mark.parametrize("param_dtype", ["bf16", "fp8"])
def test_fsdp_takes_bf16_and_fp8_parameters(param_dtype):
    """bf16: FSDP2's mixed precision (its sharded FP32 parameters are the masters); fp8: TE's FP8 weights with
    sharded masters of them."""
    job = from_overrides({**CPU_BF16, "training.param_dtype": param_dtype, "parallelism.data_parallel_one_rank": True})
    assert resolve(job, _tiny(), 2).training.param_dtype == param_dtype


def test_fused_wgrad_under_fsdp_is_refused_naming_te_and_the_fix():
    fix = "TE writes weight gradients into main_grad outside autograd, and FSDP2 reduce-scatters autograd's " \
          "gradients; .*add --no-parallelism.fsdp-reshard-after-forward, or pass --parallelism.data-parallel ddp"
    with pytest.raises(ConfigError, match=fix):  # one rank, wrapped: known from the configuration alone
        from_overrides({"te.gradient_accumulation_fusion": True, "parallelism.data_parallel_one_rank": True})
    from_overrides({"te.gradient_accumulation_fusion": True, "parallelism.data_parallel_one_rank": True,
                    "parallelism.fsdp_reshard_after_forward": False})  # gathered weights kept: FSDP2 reduces them
    fused = from_overrides({**CPU_BF16, "te.gradient_accumulation_fusion": True})
    assert resolve(fused, _tiny(), 1).te.gradient_accumulation_fusion is True  # one process: nothing wraps it
    with pytest.raises(ConfigError, match=fix):  # two processes: FSDP2 wraps the model
        resolve(fused, _tiny(), 2)


@pytest.mark.parametrize(("settings", "world_size", "message"), [
    ({"parallelism.tensor_parallel": 2, "parallelism.data_parallel": "ddp"}, None,
     "ddp replicates the whole model, and tensor parallelism shards it .*use --parallelism.data-parallel fsdp or "
     "--tensor-model-parallel-size 1"),
    ({"parallelism.tensor_parallel": 2, "te.gradient_accumulation_fusion": True}, None,
     "tensor parallelism's sharded gradients do not include: drop --gradient-accumulation-fusion"),
    ({"parallelism.tensor_parallel": 2, "training.param_dtype": "fp8"}, None,
     "param_dtype fp8 keeps FP32 masters of whole parameters, which tensor parallelism shards.*--training.param-dtype "
     "fp32"),
    ({"parallelism.tensor_parallel": 2, "training.param_dtype": "bf16"}, 2,  # TP alone: no FSDP2 to keep them
     "param_dtype bf16 keeps FP32 masters of whole parameters.*or add data-parallel ranks"),
    ({"parallelism.data_parallel": "ddp", "torchao.fsdp_float8_all_gather": True,
      "precision.recipe": "tensorwise"}, None,
     "all-gathers FSDP2's sharded weights, and DDP shards none: use --parallelism.data-parallel fsdp"),
    ({"te.local_amax": True, "training.param_dtype": "fp8"}, 2,
     "te.local_amax keeps each rank's delayed-scaling scales its own, and FSDP2 all-gathers each FP8 weight's shards "
     "under one scale: drop --te.local-amax or --param-dtype fp8"),
    ({"training.param_dtype": "fp32", "precision.recipe": "delayed", "precision.backend": "te",
      "precision.head_on_te": True}, 2,
     "precision.head_on_te puts the output head on a TE module without FP8, and FSDP2 here all-gathers FP32 weights "
     r"\(training.param_dtype fp32\) for BF16 activations: .* Use --param-dtype bf16 \(FSDP2 then gathers BF16\) or "
     "drop --head-on-te"),
    ({"training.param_dtype": "fp32", "precision.recipe": "bf16", "precision.backend": "te"}, 2,
     "precision.recipe bf16 with backend te puts every linear on a TE module without FP8.* or use --backend auto"),
])
def test_what_no_wrapper_serves_is_refused_naming_the_fix(settings, world_size, message):
    with pytest.raises(ConfigError, match=message):
        resolve(from_overrides({**CPU_BF16, **settings}), _tiny(), world_size or 4)


@pytest.mark.parametrize(("settings", "world_size", "head_on_te"), [
    ({}, 2, False),  # FSDP2 gathers FP32 weights for BF16 activations
    ({"parallelism.data_parallel_one_rank": True}, 1, False),
    ({"training.param_dtype": "bf16"}, 2, None),  # FSDP2 gathers BF16: TE keeps the head's weight as gathered
    ({"training.dtype": "fp32"}, 2, None),  # FP32 activations: TE casts nothing
    ({"parallelism.data_parallel": "ddp"}, 2, None),
    ({}, 1, None),  # one process, nothing wraps it
])
def test_the_head_leaves_te_where_fsdp2_gathers_fp32_weights_for_bf16_activations(settings, world_size, head_on_te):
    """TE under fully_shard saves no copy of a weight for the backward and rebuilds it with the module's FP8
    quantizer, which the head on TE (a module without FP8) lacks: auto puts the head off TE there (resolve.head_on_te),
    and the plan then keeps it a BF16 linear."""
    from fp8stack.plan import load_description, make_plan

    delayed_on_te = {**CPU_BF16, "training.param_dtype": "fp32", "precision.recipe": "delayed",
                     "precision.backend": "te"}
    resolved = resolve(from_overrides({**delayed_on_te, **settings}), _tiny(), world_size)
    assert resolved.precision.head_on_te is head_on_te
    head = make_plan(load_description("tiny"), resolved.precision).decision("output")
    assert head.backend == ("bf16" if head_on_te is False else "te") and head.recipe == "bf16"
    assert resolve(resolved, _tiny(), world_size) == resolved


def test_bf16_parameters_under_tensor_and_fsdp_parallelism_are_fsdp_mixed_precision():
    job = from_overrides({**CPU_BF16, "parallelism.tensor_parallel": 2, "training.param_dtype": "bf16",
                          "model.fused_projections": False})
    assert resolve(job, _tiny(), 4).training.param_dtype == "bf16"  # 2 FSDP2 ranks x 2 TP


@pytest.mark.parametrize(("settings", "world_size", "param_dtype"), [
    ({}, 1, "bf16"),
    ({"parallelism.data_parallel": "ddp"}, 2, "bf16"),
    ({}, 2, "bf16"),  # FSDP2's mixed precision
    ({"parallelism.tensor_parallel": 2, "model.fused_projections": False}, 4, "bf16"),  # TP + FSDP2
    ({"parallelism.tensor_parallel": 2, "model.fused_projections": False}, 2, "fp32"),  # TP alone
    ({"training.dtype": "fp32"}, 2, "fp32"),
])
def test_param_dtype_defaults_to_bf16_wherever_activations_are_bf16_on_the_plain_path(settings, world_size,
                                                                                      param_dtype):
    assert resolve(from_overrides({**CPU_BF16, **settings}), _tiny(), world_size).training.param_dtype == param_dtype


@pytest.mark.parametrize(("settings", "world_size", "te_layers", "fused"), [
    ({}, 1, True, True),
    ({}, 1, False, False),
    ({"parallelism.data_parallel": "ddp"}, 2, True, True),
    ({"parallelism.data_parallel": "ddp", "parallelism.data_parallel_one_rank": True}, 1, True, True),
    ({}, 2, True, False),  # FSDP2: TE cannot
    ({"parallelism.data_parallel_one_rank": True}, 1, True, False),
    ({"parallelism.tensor_parallel": 2}, 2, True, False),
    ({"te.gradient_accumulation_fusion": False, "parallelism.data_parallel": "ddp"}, 2, True, False),
])
def test_wgrad_fusion_auto_is_on_for_te_layers_in_one_process_or_ddp(settings, world_size, te_layers, fused):
    assert wgrad_fusion(from_overrides({**CPU_BF16, **settings}), te_layers, world_size) is fused


def test_the_wrapper_applies_with_more_than_one_data_parallel_rank_or_when_asked():
    assert not data_parallel_wrapped(from_overrides({}), 1)
    assert data_parallel_wrapped(from_overrides({}), 2)
    assert not data_parallel_wrapped(from_overrides({"parallelism.tensor_parallel": 2}), 2)
    assert data_parallel_wrapped(from_overrides({"parallelism.data_parallel_one_rank": True}), 1)


def test_megatrons_model_runs_megatrons_ddp_not_the_plain_wrappers_and_fuses_wgrad_with_checkpoints():
    megatron = from_overrides({"model.impl": "megatron", "parallelism.tensor_parallel": 2,
                               "checkpoint.dir": "ckpt"})
    assert not data_parallel_wrapped(megatron, 4)
    assert wgrad_fusion(megatron, True, 4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--data-parallel", "ddp", "--tensor-model-parallel-size", "2"], "use --parallelism.data-parallel fsdp"),
    (["--gradient-accumulation-fusion", "--fsdp-one-rank"], "pass --parallelism.data-parallel ddp"),
    (["--data-parallel", "ddp", "--fsdp-float8-all-gather", "--fp8-recipe", "tensorwise"], "DDP shards none"),
    (["--te.local-amax", "--param-dtype", "fp8", "--fsdp-one-rank"], "drop --te.local-amax or --param-dtype fp8"),
    (["--head-on-te", "--fp8-recipe", "delayed", "--backend", "te", "--param-dtype", "fp32", "--dtype", "bf16",
      "--fsdp-one-rank"], "Use --param-dtype bf16 (FSDP2 then gathers BF16) or drop --head-on-te"),
])
def test_refusals_exit_2_in_one_line(flags, message, capsys):
    assert train_main([*flags, "--device", "cpu", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.splitlines()) == 1, error


def _tiny():
    from fp8stack.models import load_model_config

    return load_model_config("tiny")


@pytest.mark.parametrize("field, value", [("fsdp_reshard_after_forward", False),
                                          ("fsdp_reduce_each_micro_batch", True)])
def test_fsdp_options_are_refused_where_fsdp_does_not_run(field, value):
    with pytest.raises(ConfigError, match=f"{field} is FSDP2's, and data_parallel is ddp: drop it or use "):
        from_overrides({"parallelism.data_parallel": "ddp", f"parallelism.{field}": value})
