"""The trainer on a CPU: stdlib-text data, LR schedule, short runs in bf16 and FP8, bit-identical resume."""

import math

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fp8stack.assembly import assemble, assembly_state
from fp8stack.backends import Backend
from fp8stack.models import Llama
from fp8stack.plan import Component, Decision, Plan, PlanError, PlanWarning
from fp8stack.plan.recipes import BF16
from fp8stack.precision import MasterWeights
from fp8stack.train import checkpoint
from fp8stack.train.dcp_json import WeightsOnlyLoadPlanner
from fp8stack.train.command import job_from_flags
from fp8stack.train.command import main as train_main
from fp8stack.train.data import SPLITS, TextData, load_split, source_files, source_roots, split_of, stdlib_root
from fp8stack.config import ConfigError, JobConfig, from_overrides
from fp8stack.train.loop import cpu_fp8_gemms, lr_at, resolve_job, session, train
from host_syncs import HostSyncs

SMALL_DATA = 1 << 20
"""1 MiB of stdlib source: plenty for a few short steps, quick to read."""
FAST = {"training.micro_batch": 2, "training.seq_len": 64, "training.eval_batches": 1, "data.max_bytes": SMALL_DATA, "logging.progress": False}
"""Settings that keep a tiny-model run to a fraction of a second per step on 2 cores."""


def test_batches_depend_only_on_seed_split_rank_and_index():
    a = TextData(64, 3, seed=7, max_bytes=SMALL_DATA)
    b = TextData(64, 3, seed=7, max_bytes=SMALL_DATA)
    first = [next(a) for _ in range(3)]
    assert all(torch.equal(x, y) for pair in zip(first, [next(b) for _ in range(3)]) for x, y in zip(*pair))
    assert torch.equal(a.batch(1)[0], first[1][0])  # random access = sequential order: resume needs only position
    tokens, targets = first[0]
    assert tokens.shape == targets.shape == (3, 64) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next bytes
    assert int(tokens.max()) < 256
    other_seed = TextData(64, 3, seed=8, max_bytes=SMALL_DATA).batch(0)[0]
    other_rank = TextData(64, 3, seed=7, rank=1, ranks=2, max_bytes=SMALL_DATA).batch(0)[0]
    assert not torch.equal(other_seed, first[0][0]) and not torch.equal(other_rank, first[0][0])


def test_ranks_slice_the_batches_of_one_process_with_their_micro_batches_together():
    """2 ranks x micro-batch 3 see exactly the global batch of 1 rank x 6: the 1-GPU reference is sound."""
    whole = TextData(64, 6, seed=7, max_bytes=SMALL_DATA).batch(4)[0]
    halves = [TextData(64, 3, seed=7, rank=r, ranks=2, max_bytes=SMALL_DATA).batch(4)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole) and not torch.equal(halves[0], halves[1])
    with pytest.raises(ValueError, match="rank 2 is not one of the 2"):
        TextData(64, 3, seed=7, rank=2, ranks=2, max_bytes=SMALL_DATA)


def test_split_is_by_file_and_stable(tmp_path):
    files = {f"pkg/mod{i}.py": f"# module {i}\nx = {i}\n".encode() for i in range(40)}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("not stdlib\n")
    assert "site-packages" not in {p.parts[-2] for p in source_files(tmp_path)}
    texts = {split: bytes(load_split(split, roots=[tmp_path]).tolist()) for split in SPLITS}
    for name, text in files.items():
        home = split_of(name)
        assert split_of(name) == home and text in texts[home]
        assert text not in texts[next(s for s in SPLITS if s != home)]
    assert 0 < sum(split_of(name) == "validation" for name in files) < len(files)


def test_real_stdlib_has_both_splits():
    assert source_files(stdlib_root())
    assert load_split("train", SMALL_DATA).numel() > load_split("validation", SMALL_DATA).numel() > 0


def test_roots_are_read_in_order_up_to_max_bytes(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for root, text in ((first, b"a" * 100), (second, b"b" * 100)):
        for i in range(20):
            (root / f"m{i}.py").parent.mkdir(exist_ok=True)
            (root / f"m{i}.py").write_bytes(text)
    both = sum(bytes(load_split(split, roots=[first, second]).tolist()).count(b"b" * 100) for split in SPLITS)
    only_first = sum(bytes(load_split(split, 2000, roots=[first, second]).tolist()).count(b"b" * 100)
                     for split in SPLITS)
    assert (both, only_first) == (20, 0)


def test_python_source_adds_site_packages_after_the_stdlib():
    roots = source_roots("python")
    assert roots[0] == stdlib_root() == source_roots("stdlib")[0] and len(roots) > 1
    assert any(root.name == "site-packages" for root in roots[1:])
    stdlib_bytes = sum(p.stat().st_size for p in source_files(stdlib_root()))
    more = stdlib_bytes + SMALL_DATA  # the whole stdlib, then a MiB of site-packages for the python source
    assert load_split("train", more, source="python").numel() > load_split("train", more).numel()
    with pytest.raises(ConfigError, match="unknown data.source 'pypi': use stdlib, python"):
        from_overrides({"data.source": "pypi"})


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_cpu_fp8_gemms_take_torchs_emulation_with_onednns_results(rowwise):
    """A CPU run's FP8 GEMMs leave oneDNN (its FP8 matmul is a reference loop on CPUs without AMX-FP8) for torch's
    emulation, which gives the same bits."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(96, 128, generator=generator).to(torch.float8_e4m3fn).t()
    scales = (torch.rand(64, 1, generator=generator), torch.rand(1, 96, generator=generator)) if rowwise else (
        torch.tensor(0.5), torch.tensor(2.0))
    gemm = lambda: torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)  # noqa: E731
    with torch.backends.mkldnn.flags(enabled=True):
        by_onednn = gemm()
        with cpu_fp8_gemms(torch.device("cpu")):
            assert not torch.backends.mkldnn.enabled
            assert torch.equal(gemm(), by_onednn)
        with cpu_fp8_gemms(torch.device("cuda")):
            assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize(("recipe", "onednn"), [("bf16", True), ("tensorwise", False)])
def test_a_cpu_run_keeps_onednn_off_only_where_its_plan_has_fp8_gemms(recipe, onednn):
    """A plan without FP8 GEMMs runs its BF16 GEMMs on oneDNN (torch's fallback without it is dozens of times
    slower); an FP8 plan's GEMMs take torch's FP8 emulation (cpu_fp8_gemms). The run leaves the setting as it was."""
    before = torch.backends.mkldnn.enabled
    with session(from_overrides({**FAST, "precision.recipe": recipe, "training.dtype": "bf16", "training.steps": 1})):
        assert torch.backends.mkldnn.enabled is onednn
    assert torch.backends.mkldnn.enabled is before


def test_lr_warms_up_then_decays_to_min_lr():
    cfg = from_overrides({"training.steps": 20, "optimizer.warmup": 4, "optimizer.lr": 1e-3, "optimizer.min_lr": 1e-4})
    lrs = [lr_at(step, cfg) for step in range(cfg.training.steps + 1)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[4] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(later <= earlier for earlier, later in zip(lrs[4:], lrs[5:]))
    assert lrs[12] == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way through the cosine


def test_min_lr_defaults_to_a_tenth_of_the_peak():
    cfg = resolve_job(from_overrides({"training.steps": 40, "optimizer.warmup": 4, "optimizer.lr": 3e-4}))
    assert cfg.optimizer.min_lr == pytest.approx(3e-5)
    assert lr_at(39, cfg) < 4e-5


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_short_run_trains(recipe, tmp_path):
    result = train(from_overrides({"precision.recipe": recipe, "training.steps": 5, "optimizer.warmup": 1, "logging.dir": str(tmp_path), **FAST}))
    assert len(result.losses) == len(result.step_ms) == 5
    assert all(math.isfinite(loss) for loss in result.losses) and math.isfinite(result.val_loss)
    assert result.losses[-1] < result.losses[0]
    assert result.tokens_per_s > 0 and result.max_rss_gib > 0 and result.peak_mem_gib is None
    assert (result.plan_summary["fp8_gemms"] > 0) == (recipe != "bf16")
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 5
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(5))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(result.losses, rel=1e-6)


def test_compile_compiles_the_loss_and_trains_as_eager():
    """--compile compiles the blocks and the loss (torchtitan's practice: a fused cross-entropy without FP32 copies
    of the logits); on a CPU in FP32 the compiled run takes the eager run's steps to rounding."""
    settings = {**FAST, "precision.recipe": "bf16", "training.steps": 3, "optimizer.warmup": 1, "training.eval_batches": 0}
    with session(from_overrides({**settings, "training.compile": True})) as run:
        _, loss = run.loss_fn.args
        assert loss is not Llama.loss and loss.__wrapped__ is Llama.loss, "the loss is torch.compile'd"
    compiled, eager = train(from_overrides({**settings, "training.compile": True})), train(from_overrides({**settings}))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    assert compiled.grad_norms == pytest.approx(eager.grad_norms, rel=1e-3)


@pytest.mark.parametrize("recipe, rel", [("bf16", 1e-5), ("tensorwise", 2e-3)])
def test_gradient_accumulation_trains_on_the_whole_batch(recipe, rel):
    """Two micro-batches of 2 per step take the steps one micro-batch of 4 takes (same windows, mean loss).
    FP32 on a CPU agrees to rounding; tensorwise FP8 to its rounding, as each micro-batch has its own
    activation scales."""
    settings = {**FAST, "precision.recipe": recipe, "training.steps": 4, "optimizer.warmup": 1, "training.eval_batches": 0}
    whole = train(from_overrides({**{**settings, "training.micro_batch": 4}}))
    accumulated = train(from_overrides({**{**settings, "training.micro_batch": 2}, "training.global_batch": 4}))
    halves = train(from_overrides({**{**settings, "training.micro_batch": 2}}))
    assert accumulated.tokens_per_step == whole.tokens_per_step == 2 * halves.tokens_per_step
    assert accumulated.losses == pytest.approx(whole.losses, rel=rel)
    assert accumulated.grad_norms == pytest.approx(whole.grad_norms, rel=10 * rel)
    assert halves.losses != pytest.approx(whole.losses, rel=10 * rel)  # other batches: the check can fail
    with pytest.raises(ConfigError, match="must be a multiple of training.micro_batch=2"):
        from_overrides({"training.micro_batch": 2, "training.global_batch": 3})


def test_data_parallel_one_rank_shards_a_single_process_over_a_one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    settings = {"precision.recipe": "tensorwise", "precision.backend": "torchao", "training.steps": 3, "optimizer.warmup": 1, "training.dtype": "bf16", **FAST}
    found = dist.is_initialized()  # a session fixture may have made a one-rank group already
    with session(from_overrides({**settings, "parallelism.data_parallel_one_rank": True})) as run:
        assert isinstance(run.model, FSDPModule) and run.model.layers[0].attention.wqkv.weight.dtype == torch.float32
        assert dist.get_world_size() == 1
    assert dist.is_initialized() == found  # a group made for the run is gone with it
    plain, sharded = (train(from_overrides({**settings, "parallelism.data_parallel_one_rank": one}))
                      for one in (False, True))
    # BF16 all-gathers of FSDP2's FP32 shards where one process copies BF16 parameters from its masters: close.
    assert sharded.losses != plain.losses and sharded.losses == pytest.approx(plain.losses, rel=1e-2)
    # the first steps' FP8 gradient check ran, on plain and on sharded (DTensor) gradients, and found none zero
    assert plain.zero_fp8_weight_grads == sharded.zero_fp8_weight_grads == [[], [], []]


def test_priming_passes_leave_weights_optimizer_and_data_as_they_were():
    """prime_fp8_scales (run before step 1 under TE delayed scaling, a GPU test checks what it is for) keeps
    only FP8 scaling state: the run that follows is the run without it, loss for loss."""
    settings = {"precision.recipe": "tensorwise", "precision.backend": "torchao", "training.steps": 3, "optimizer.warmup": 1, **FAST}
    with session(from_overrides({**settings})) as run:
        before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
        run.prime_fp8_scales(2)
        assert run.data.position == 0 and not run.optimizer.state
        assert all(p.grad is None and torch.equal(p, before[name]) for name, p in run.model.named_parameters())
        primed = [float(run.step(1.0)[0]) for _ in range(3)]
    assert primed == train(from_overrides({**settings})).losses  # exact: priming changed nothing a torchao run keeps
    with pytest.raises(ConfigError, match="te.priming_passes must be at least 0"):
        from_overrides({"te.priming_passes": -1})


@pytest.mark.parametrize("recipe, params", [("bf16", {}), ("tensorwise", {}),
                                            ("tensorwise", {"training.dtype": "bf16", "training.param_dtype": "bf16"})],
                         ids=["bf16", "tensorwise", "tensorwise-bf16-params"])
def test_resume_continues_bit_identically(recipe, params, tmp_path):
    """With BF16 parameters too: the checkpoint holds the FP32 masters, which BF16 copies could not restore."""
    settings = {"precision.recipe": recipe, "training.steps": 4, "optimizer.warmup": 1, **FAST, **params}
    uninterrupted = train(from_overrides({**settings}))
    train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": 2}))
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-00000002", "step-00000004"]
    resumed = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.resume": str(tmp_path / "step-00000002")}))
    assert resumed.first_step == 2
    assert resumed.losses == uninterrupted.losses[2:]  # exact equality, not approx


class _ScalingState(nn.Module):
    """A module keeping state in get_extra_state, as TE modules keep their FP8 amax history and scales
    (a pickled byte tensor whose size changes once FP8 has run)."""

    def __init__(self):
        super().__init__()
        self.history = [0.0]

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.history, dtype=torch.float64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.history = state.tolist()


def test_checkpoint_keeps_module_extra_state(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), _ScalingState())
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model[1].history = [3.0, 1.5, 2.0]  # longer than a fresh module's: DCP could not load it in place
    path = checkpoint.save(tmp_path, 3, model, optimizer, scheduler, data_position=5)
    fresh = nn.Sequential(nn.Linear(4, 4), _ScalingState())
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    resumed = checkpoint.load(path, fresh, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(fresh_optimizer,
                                                                                            lambda step: 1.0))
    assert (resumed.step, resumed.data_position) == (3, 5)
    assert fresh[1].history == [3.0, 1.5, 2.0]
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert checkpoint.latest(tmp_path) == path


class _CountedScalingState(_ScalingState):
    """A _ScalingState counting the extra states loaded into it."""

    def __init__(self):
        super().__init__()
        self.loads = 0

    def set_extra_state(self, state: torch.Tensor) -> None:
        super().set_extra_state(state)
        self.loads += 1


class _RestoringBackend(Backend):
    """A backend whose modules keep state outside the model, as TE keeps its amax registry: records, each time
    after_checkpoint_load runs, the model it got and what the model's _CountedScalingState held then."""

    name = "restoring"

    def __init__(self):
        self.calls = []

    def after_checkpoint_load(self, model: nn.Module) -> None:
        self.calls.append((model, model[1].loads, model[1].history))


def _assembled_with(*backends: Backend) -> nn.Sequential:
    """A linear and a _CountedScalingState, assembled by a plan keeping the linear in BF16, `backends` among the
    backends of its assembly."""
    decision = Decision(Component("0", "linear", 4, 4), BF16, BF16, "test")
    model = assemble(nn.Sequential(nn.Linear(4, 4), _CountedScalingState()),
                     Plan(model="test", recipe=BF16, fp8_format="hybrid", arch=90, decisions=(decision,)))
    assembly_state(model).backends.extend(backends)
    return model


@pytest.mark.parametrize("with_masters", [False, True], ids=["parameters", "masters"])
def test_load_calls_each_backends_hook_once_after_the_extra_states_are_in_place(with_masters, tmp_path):
    """Without masters the extra states load twice (before the tensors, and again in set_state_dict): each backend's
    after_checkpoint_load runs once, after the last, with the model (the masters hold no extra state)."""
    model = _assembled_with()
    masters = MasterWeights(model) if with_masters else None
    optimizer = torch.optim.AdamW((masters or model).parameters())
    model[0](torch.ones(2, 4, dtype=model[0].weight.dtype)).float().sum().backward()
    optimizer.step()  # the moments a checkpoint holds
    model[1].history = [3.0, 1.5]
    path = checkpoint.save(tmp_path, 1, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                           data_position=0, masters=masters.module if masters else None)
    restoring = [_RestoringBackend(), _RestoringBackend()]
    fresh = _assembled_with(*restoring)
    fresh_masters = MasterWeights(fresh) if with_masters else None
    fresh_optimizer = torch.optim.AdamW((fresh_masters or fresh).parameters())
    checkpoint.load(path, fresh, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda _: 1.0),
                    masters=fresh_masters.module if fresh_masters else None)
    assert fresh[1].loads == (1 if with_masters else 2)
    for backend in restoring:
        assert backend.calls == [(fresh, fresh[1].loads, [3.0, 1.5])]


class _StateDictLayout:
    """A checkpoint.TensorLayout laying out the module's tensors as its state_dict names them (no optimizer)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def _tensors(self) -> dict:
        return {k: v for k, v in self.module.state_dict().items() if not k.endswith(checkpoint.EXTRA_STATE_SUFFIX)}

    def save_items(self):
        return {"model": self._tensors()}, {}, None

    def load_items(self):
        items = {"model": self._tensors()}
        return items, WeightsOnlyLoadPlanner(), lambda _plain: self.module.load_state_dict(items["model"], strict=False)


def test_a_laid_out_load_calls_the_backends_hook_once_after_the_extra_states_are_in_place(tmp_path):
    model = _assembled_with()
    model[1].history = [2.0, 0.5]
    optimizer = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(tmp_path, 1, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                           data_position=0, layout=_StateDictLayout(model))
    restoring = _RestoringBackend()
    fresh = _assembled_with(restoring)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(path, fresh, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda _: 1.0),
                    layout=_StateDictLayout(fresh))
    assert restoring.calls == [(fresh, 1, [2.0, 0.5])]
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_load_asks_no_backend_of_a_model_fp8stack_did_not_assemble(monkeypatch, tmp_path):
    """A plain model keeps nothing outside itself that a backend would rebuild: loading it asks no backend."""
    asked = []
    monkeypatch.setattr(Backend, "after_checkpoint_load", lambda backend, model: asked.append(backend.name))
    for step, model in enumerate((nn.Sequential(nn.Linear(4, 4), _CountedScalingState()), _assembled_with())):
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        path = checkpoint.save(tmp_path, step, model, optimizer, scheduler, data_position=0)
        checkpoint.load(path, model, optimizer, scheduler)
    assert asked == [BF16]  # the assembled model's one backend, the plain model's none


@pytest.mark.parametrize("flags, recompute, modules", [
    ([], None, ("block",)),
    (["--recompute-granularity", "full"], "all", ("block",)),
    (["--recompute-granularity", "selective"], "all", ("core_attn",)),  # Megatron's default
    (["--recompute-modules", "mlp", "layernorm"], "all", ("mlp", "layernorm")),
    (["--recompute-modules", "mlp", "--recompute-layers", "0,2"], "0,2", ("mlp",)),
])
def test_megatron_recompute_flags(flags, recompute, modules):
    cfg = job_from_flags(flags)
    assert (cfg.activation_checkpoint.layers, cfg.activation_checkpoint.modules) == (recompute, modules)


def test_selective_recompute_trains():
    result = train(from_overrides({"precision.recipe": "tensorwise", "training.steps": 2, "activation_checkpoint.layers": "all", "activation_checkpoint.modules": ("mlp", "core_attn"), **FAST}))
    assert all(math.isfinite(loss) for loss in result.losses)


def test_compressed_activations_train_like_uncompressed_and_save_bytes():
    settings = {"precision.recipe": "tensorwise", "training.steps": 6, "optimizer.warmup": 1, **{**FAST, "training.dtype": "bf16"}}
    plain = train(from_overrides({**settings}))
    compressed = train(from_overrides({**settings, "activation_checkpoint.compress": True}))
    assert plain.activation_bytes_saved_per_step is None
    assert compressed.activation_bytes_saved_per_step > 0  # BF16 activations: 1 byte per element of 2
    assert compressed.losses[0] == plain.losses[0]  # the forward is untouched, only what backward reads
    gaps = [abs(c - p) / p for c, p in zip(compressed.losses, plain.losses)]
    assert 0 < max(gaps) < 0.02, gaps  # E4M3-rounded activations in backward: close, not identical


def test_compression_refuses_an_fp32_run_where_it_would_compress_nothing():
    with pytest.raises(ConfigError, match="pass --dtype bf16"):
        train(from_overrides({"activation_checkpoint.compress": True, **{**FAST, "training.dtype": "fp32"}}))


def test_config_errors_name_the_fix(capsys):
    with pytest.raises(PlanError, match="'gpt5' not found: give a YAML path or one of deepseek"):
        resolve_job(from_overrides({"model.name": "gpt5"}))
    with pytest.raises(ConfigError, match="needs checkpoint.dir"):
        from_overrides({"checkpoint.resume": "latest"})
    with pytest.raises(ConfigError, match="FSDP2 reduce-scatters autograd's gradients; .*or pass "
                       "--parallelism.data-parallel ddp"):
        from_overrides({"te.gradient_accumulation_fusion": True, "parallelism.data_parallel_one_rank": True})
    assert train_main(["--recompute-granularity", "full", "--recompute-modules", "mlp"]) == 2
    assert "drop one of them" in capsys.readouterr().err
    assert train_main(["--fp8-recipe", "rowwise_gw_hp", "--dtype", "bf16", "--device", "cpu", "--train-iters", "1",
                       "--no-progress"]) == 2
    assert "use --dtype fp32 on a CPU" in capsys.readouterr().err
    assert train_main(["--fp8-recipe", "tensorwise", "--fp8-margin", "1"]) == 2
    assert "drop --fp8-margin or use --fp8-recipe delayed" in capsys.readouterr().err


def test_fp8_margin_reaches_the_te_backend_of_a_delayed_plan():
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    cfg = resolve_job(job_from_flags(["--model", "tiny", "--fp8-recipe", "delayed", "--fp8-margin", "2",
                                      "--small-gemm-filter", "off", "--device", "cpu"]))
    plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
    assert _backend_options(cfg, plan, micro_batches=1)["te"]["delayed_margin"] == 2


def test_fp8_weight_cache_follows_micro_batches_and_the_configuration():
    """Cached only where a step has more micro-batches to reuse the cast, and off when the configuration says so
    (the FSDP2 bound arm of fp8stack.bench.data_parallel)."""
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    def cached(micro_batches: int, *flags: str) -> bool:
        cfg = resolve_job(job_from_flags(["--model", "tiny", "--fp8-recipe", "delayed", "--small-gemm-filter", "off",
                                          "--device", "cpu", *flags]))
        plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
        return _backend_options(cfg, plan, micro_batches)["te"]["cache_fp8_weights"]

    assert cached(2) and not cached(1)
    assert not cached(2, "--no-te.cache-fp8-weights")


def test_te_local_amax_reaches_the_te_backend_as_asked_and_is_left_to_assemble_when_unset():
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    def local(*flags: str) -> bool | None:
        cfg = resolve_job(job_from_flags(["--model", "tiny", "--fp8-recipe", "delayed", "--small-gemm-filter", "off",
                                          "--device", "cpu", *flags]))
        plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
        return _backend_options(cfg, plan, 1)["te"]["local_amax"]

    assert local() is None and local("--te.local-amax") is True and local("--no-te.local-amax") is False


def test_te_one_autocast_per_forward_reaches_the_te_backend_only_when_asked_and_refuses_recompute():
    from fp8stack.backends.te import TEBackend
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    def te_options(*flags: str) -> dict:
        cfg = resolve_job(job_from_flags(["--model", "tiny", "--fp8-recipe", "delayed", "--small-gemm-filter", "off",
                                          "--device", "cpu", *flags]))
        return _backend_options(cfg, build_plan(cfg, build_model(cfg, torch.device("cpu"))), 1)["te"]

    assert "one_autocast_per_forward" not in te_options()
    options = te_options("--te.one-autocast-per-forward")
    assert options["one_autocast_per_forward"] is True
    assert "drop activation recompute" in TEBackend(**options).refuse_recompute()
    assert TEBackend().refuse_recompute() is None


def test_gradient_accumulation_fusion_reaches_the_te_backend_and_needs_te_layers():
    from fp8stack.train.loop import _backend_options, build_plan
    from fp8stack.train.model import build_model

    def plan(recipe: str, backend: str = "te", fusion: bool = True) -> tuple[JobConfig, Plan]:
        cfg = resolve_job(from_overrides({"model.name": "tiny", "precision.recipe": recipe, "precision.backend": backend,
                                          "precision.small_gemm_filter": "off", "training.device": "cpu",
                                          "te.gradient_accumulation_fusion": fusion}))
        return cfg, build_plan(cfg, build_model(cfg, torch.device("cpu")))

    def options(recipe: str, backend: str = "te") -> dict | None:
        return _backend_options(*plan(recipe, backend), 1)

    assert options("delayed")["te"]["fuse_wgrad_accumulation"] is True
    assert options("bf16")["te"]["fuse_wgrad_accumulation"] is True  # a bf16 plan on te: TE modules without FP8
    with pytest.raises(ConfigError, match="plan for recipe 'bf16' has no TE layers.*drop --gradient-accum"):
        options("bf16", backend="auto")
    # The output head joins the TE linears (without FP8) so that its wgrad GEMM accumulates in FP32 too: by default
    # wherever the linears run on TE (head_on_te auto), the wgrad fusion on or not.
    for recipe in ("delayed", "bf16"):
        head = plan(recipe)[1].decision("output")
        assert (head.backend, head.recipe) == ("te", "bf16")
    assert plan("delayed", fusion=False)[1].decision("output").backend == "te"
    assert plan("tensorwise", backend="torchao")[1].decision("output").backend == "bf16"


def test_expert_backend_reaches_the_plan():
    from fp8stack.train.loop import build_plan
    from fp8stack.train.model import build_model

    def expert(**options):
        cfg = resolve_job(from_overrides({"model.name": "tiny-moe", "precision.recipe": "blockwise",
                                          "training.device": "cpu", **options}))
        plan = build_plan(cfg, build_model(cfg, torch.device("cpu")))
        return next(d for d in plan.decisions if d.component.kind == "expert")

    auto = expert()  # the plan's measured table for the target arch (sm90 on a CPU): TE's GroupedLinear is fastest
    assert (auto.backend, auto.recipe) == ("te", "blockwise")
    assert "expert_backend=auto: the fastest blockwise expert path on sm90, measured " in auto.reason
    asked = expert(**{"precision.expert_backend": "grouped_fp8"})
    assert (asked.backend, asked.recipe) == ("grouped_fp8", "blockwise")
    assert "expert_backend=grouped_fp8, as asked: measured " in asked.reason
    with pytest.raises(ConfigError, match="expert_backend='x': use auto, grouped_fp8 or te"):
        from_overrides({"precision.expert_backend": "x"})


def test_checkpoint_of_another_model_is_refused(tmp_path):
    def parts(model):
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    model, optimizer, scheduler = parts(nn.Linear(4, 4))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    path = checkpoint.save(tmp_path, 1, model, optimizer, scheduler, data_position=1)
    with pytest.raises(checkpoint.CheckpointError, match="Missing key in checkpoint state_dict: model.0.weight"):
        checkpoint.load(path, *parts(nn.Sequential(nn.Linear(4, 4))))
    with pytest.raises(checkpoint.CheckpointError, match="not a complete fp8stack checkpoint"):
        checkpoint.load(tmp_path, *parts(nn.Linear(4, 4)))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_a_training_step_reads_the_device_once_before_its_optimizer_step_and_never_after(model, monkeypatch):
    """train() reads each step's loss, gradient norm and routing statistics in one copy before the optimizer step: a
    read after it, until the next step's, would wait for the optimizer and leave the GPU idle while the host logs and
    prepares the next step. (On a CPU nothing waits: the recorder sees the reads a GPU would wait on. Left out: torch's
    AdamW reading its step counts and the data's sampling, both CPU tensors on a GPU too.)"""
    syncs = HostSyncs(monkeypatch)

    def leave_out(function):
        def unrecorded(*args, **kwargs):
            kept = len(syncs.seen)
            result = function(*args, **kwargs)
            del syncs.seen[kept:]
            return result
        return unrecorded

    def optimizer_step(optimizer, args, kwargs):
        syncs.seen.append("optimizer step")
        syncs.optimizer_reads_from = len(syncs.seen)

    def optimizer_stepped(optimizer, args, kwargs):
        del syncs.seen[syncs.optimizer_reads_from:]

    monkeypatch.setattr(TextData, "batch", leave_out(TextData.batch))
    hooks = [register_optimizer_step_pre_hook(optimizer_step),
             register_optimizer_step_post_hook(optimizer_stepped)]
    try:
        with syncs:
            train(from_overrides({"model.name": model, "precision.recipe": "tensorwise", "precision.backend": "torchao",
                                  "training.steps": 3, "optimizer.warmup": 1, "training.fp8_grad_check_steps": 0,
                                  **FAST}))
    finally:
        for hook in hooks:
            hook.remove()
    steps = [index for index, seen in enumerate(syncs.seen) if seen == "optimizer step"]
    assert len(steps) == 3
    assert [syncs.seen[start + 1:end] for start, end in zip(steps, steps[1:])] == [["tolist"], ["tolist"]]


LITTLE_FP8 = """description: one FP8 linear of sixteen
recipe: tensorwise
small_gemm_filter: "off"
overrides:
  - {block: "*", backend: bf16, reason: "kept BF16"}
  - {fqn: "layers.0.feed_forward.w2", backend: auto, reason: "the one FP8 linear"}
"""


def test_a_plan_with_little_fp8_is_refused_by_the_cli_option_that_accepts_it(tmp_path, capsys):
    """A recipe file that leaves one linear of sixteen in FP8: the trainer refuses it in one line naming its own
    option (not assemble's argument), exit 2; with --training.allow-little-fp8 it trains, warning what runs."""
    recipe = tmp_path / "little.yaml"
    recipe.write_text(LITTLE_FP8)
    flags = ["--model", "tiny", "--recipe-file", str(recipe), "--device", "cpu", "--train-iters", "1",
             "--seq-length", "32", "--max-data-bytes", str(1 << 20), "--eval-iters", "0", "--no-progress"]
    assert train_main(flags) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "runs 6% of its GEMM FLOPs in FP8 (under 25%)" in error, error
    assert "little.yaml: kept BF16: pass --training.allow-little-fp8 if that is intended" in error
    with pytest.warns(PlanWarning, match=r"\(accepted by --training.allow-little-fp8\)"):
        assert train_main([*flags, "--training.allow-little-fp8"]) == 0
