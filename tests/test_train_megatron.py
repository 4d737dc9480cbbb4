"""The trainer's Megatron path on a CPU: flags -> JobConfig -> megatron TransformerConfig, the options it
refuses (and the CPU itself: the trainer needs CUDA for megatron), the GPTModel it builds (the plain
Llama's weights in megatron's layouts, computing the plain Llama's function, the same weights at TP=2 as at
TP=1), its gradient finishing over two gloo ranks, and its checkpoints in megatron's sharded layout with the
trainer's AdamW (at TP=1, and at TP=2 over two gloo ranks). Training it, megatron's DDP and distributed optimizer
run on GPUs (tests/gpu/test_train_megatron_gpu.py, fp8stack.bench.multigpu_tp)."""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from fp8stack.megatron import layer_precisions
from fp8stack.megatron.block_spec import check_config
from fp8stack.plan import PlanError
from fp8stack.models import Llama
from fp8stack.train.command import job_from_flags
from fp8stack.train.command import main as train_main
from fp8stack.config import ConfigError, JobConfig, from_overrides
from fp8stack.train.checkpoint import CheckpointMismatchError, Resumed
from fp8stack.train.loop import _adamw, train
from fp8stack.train.megatron_checkpoint import MegatronTensors
from fp8stack.train.model import build_model, model_config
from fp8stack.train import checkpoint, megatron_model

from gloo_ranks import spawn
from megatron_cpu import drawn_gpt

pytestmark = pytest.mark.filterwarnings("ignore:GPTModel IS DEPRECATED", "ignore:.*tp_group is None",
                                        "ignore:Apex is not installed")


def megatron_cfg(*flags: str) -> JobConfig:
    return job_from_flags(["--model-impl", "megatron", *flags])


def build(cfg: JobConfig, seed: int = 0):
    """The GPTModel megatron_model.build makes, from the plain Llama the trainer draws on the CPU for `seed`."""
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, megatron_model.fp8_format(cfg))
    # megatron's local (torch) norms refuse sequence parallelism without Apex; the weight layout is the same.
    config.sequence_parallel = False
    plan = megatron_model.build_plan(config, cfg, shape, arch=90)
    llama = build_model(from_overrides({"training.seed": seed}, cfg), torch.device("cpu"))
    return megatron_model.gpt_model(config, plan, llama, use_te=False)  # TE needs CUDA: megatron's local modules


def test_flags_map_onto_megatrons_transformer_config():
    cfg = megatron_cfg("--model", "llama-1b-like", "--fp8-recipe", "tensorwise", "--tensor-model-parallel-size", "2",
                       "--seq-length", "1024", "--first-last-layers-bf16")
    assert cfg.model.impl == "megatron" and cfg.parallelism.tensor_parallel == 2
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, megatron_model.fp8_format(cfg))
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 4096, 14336)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (32, 8, 128)
    assert config.gated_linear_unit and config.normalization == "RMSNorm" and not config.add_bias_linear
    assert (config.fp8, str(config.fp8_recipe)) == ("hybrid", "tensorwise")  # tensorwise's default format
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel
    assert config.params_dtype == torch.float32 and not config.bf16 and config.use_cpu_initialization
    assert config.first_last_layers_bf16
    plan = megatron_model.build_plan(config, cfg, shape, arch=90)
    assert [p.recipe for p in layer_precisions(config, plan)] == [None, "tensorwise", "tensorwise", None]

    one = megatron_model.transformer_config(megatron_cfg(), model_config(megatron_cfg()), "hybrid")
    assert one.fp8 is None and not one.sequence_parallel  # bf16, TP=1: megatron forbids SP without TP
    delayed = megatron_cfg("--fp8-recipe", "delayed", "--fp8-margin", "1")
    assert megatron_model.transformer_config(delayed, model_config(delayed), "hybrid").fp8_margin == 1


def test_fp8_dot_product_attention_reaches_megatrons_config_and_the_plan():
    cfg = megatron_cfg("--model", "llama-1b-like", "--fp8-recipe", "delayed", "--fp8-dot-product-attention",
                       "--seq-length", "1024")
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, megatron_model.fp8_format(cfg))
    assert config.fp8_dot_product_attention and not config.fp8_multi_head_attention
    plan = megatron_model.build_plan(config, cfg, shape, arch=90)
    cores = [d for d in plan.decisions if d.component.kind == "attn_core"]
    assert len(cores) == 4 and {(d.backend, d.recipe) for d in cores} == {("te", "delayed")}
    assert "TE's FP8 dot-product attention" in cores[0].reason
    check_config(config, plan, layer_precisions(config, plan), True, "")  # they agree
    without = megatron_cfg("--model", "llama-1b-like", "--fp8-recipe", "delayed", "--seq-length", "1024")
    plain = megatron_model.transformer_config(without, shape, "hybrid")
    assert not plain.fp8_dot_product_attention
    with pytest.raises(PlanError, match="the plan runs attention in FP8 \\(delayed\\) but "
                                        "config.fp8_dot_product_attention is False: make them agree"):
        check_config(plain, plan, layer_precisions(plain, plan), True, "")


def test_llama3_8b_16_layers_maps_onto_megatrons_config_and_plan():
    cfg = megatron_cfg("--model", "llama3-8b-16-layers", "--fp8-recipe", "delayed")
    shape = model_config(cfg)
    config = megatron_model.transformer_config(cfg, shape, megatron_model.fp8_format(cfg))
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (16, 4096, 14336)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (32, 8, 128)
    assert (shape.seq_len, shape.vocab_size, shape.rope_theta) == (8192, 128256, 500000)
    plan = megatron_model.build_plan(config, cfg, shape, arch=90)
    assert [p.recipe for p in layer_precisions(config, plan)] == ["delayed"] * 16
    head = plan.decision("output_layer")
    assert (head.backend, head.recipe) == ("bf16", "bf16")  # plan rule 1: the head stays out of FP8


@pytest.mark.parametrize("flags, names", [
    (["--compile"], "does not take training.compile (torch.compile of the blocks)"),
    (["--recompute-granularity", "full"], "does not take activation_checkpoint.layers (fp8stack's recompute)"),
    (["--param-dtype", "fp8"], "does not take training.param_dtype fp8 (TE weights held in FP8"),
    (["--sdpa-backend", "flash"], "does not take training.sdpa_backend"),
    (["--no-te.cache-fp8-weights"], "does not take te.cache_fp8_weights false"),
    (["--te.local-amax"], "does not take te.local_amax (the plain path's TE scaling state"),
    (["--fsdp-one-rank"], "does not take parallelism.data_parallel_one_rank (fp8stack's data-parallel wrappers)"),
    (["--parallelism.fsdp-reduce-each-micro-batch"], "does not take parallelism.fsdp_reduce_each_micro_batch (FSDP2)"),
    (["--model", "llama3-8b"], "builds tiny, llama-1b-like, llama-70b-layers, llama3-8b-16-layers, tiny-moe, "
                               "deepseek-moe-small, deepseek-moe-medium, not 'llama3-8b'"),
    (["--fp8-recipe", "rowwise"], "torchao recipe"),
    (["--backend", "torchao"], "--backend te"),
    (["--small-gemm-filter", "rowwise"], "precision.small_gemm_filter='rowwise'"),
    (["--no-fused-projections"], "model.fused_projections false shapes the plain Llama"),
    (["--recipe-file", "moe-only-fp8"], "does not take --recipe-file's overrides (per-block / per-fqn overrides"),
])
def test_options_the_megatron_path_cannot_honour_are_refused(flags, names, capsys):
    assert train_main(["--model-impl", "megatron", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fp8stack train: error: ") and names in error, error
    assert len(error.splitlines()) == 1 and "needs CUDA" not in error


def test_megatrons_data_parallel_flags_and_checkpoints_are_accepted():
    """--use-distributed-optimizer is optimizer.distributed; checkpoints go with every parallel layout, DDP and the
    distributed optimizer (megatron's sharded state dicts)."""
    cfg = megatron_cfg("--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--save", "ckpt",
                       "--gradient-accumulation-fusion")
    assert cfg.optimizer.distributed and cfg.checkpoint.dir == "ckpt" and cfg.te.gradient_accumulation_fusion
    assert not megatron_cfg().optimizer.distributed


def test_bf16_parameters_are_megatrons_own_mixed_precision():
    """--param-dtype bf16 on the Megatron path: megatron builds BF16 parameters (Float16Module, FP32 masters in its
    optimizer: megatron_model.build), where the default keeps the FP32 ones the trainer's AdamW steps."""
    cfg = megatron_cfg("--param-dtype", "bf16", "--tensor-model-parallel-size", "2")
    config = megatron_model.transformer_config(cfg, model_config(cfg), megatron_model.fp8_format(cfg))
    assert config.params_dtype == torch.bfloat16 and config.bf16
    assert megatron_cfg().training.param_dtype is None  # resolves to fp32 on the Megatron path


def test_a_process_count_the_tp_size_does_not_divide_is_refused_before_compute(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train_main(["--model-impl", "megatron", "--tensor-model-parallel-size", "2"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fp8stack train: error: parallelism.tensor_parallel=2 must divide the 3 processes"), error
    assert "launch a multiple of 2 processes" in error and len(error.splitlines()) == 1


def test_the_plans_fusion_flags_are_accepted_on_the_megatron_path():
    for flags in ([], ["--fuse-norm", "--fuse-mlp"], ["--no-fuse-norm", "--no-fuse-mlp"]):
        cfg = megatron_cfg(*flags)
        fused = "--no-fuse-norm" not in flags
        assert (cfg.model.impl, cfg.precision.fuse_norm, cfg.precision.fuse_mlp) == ("megatron", fused, fused)


def test_the_trainer_refuses_megatron_on_a_cpu():
    with pytest.raises(ConfigError, match="the Megatron model needs CUDA.*--model-impl torch"):
        train(from_overrides({"model.impl": "megatron", "training.device": "cpu", "logging.progress": False}))


def test_gpt_model_starts_from_the_plain_llamas_weights(model_parallel):
    cfg = megatron_cfg()
    model, other = build(cfg), build(cfg, seed=1)
    plain = build_model(from_overrides({}), torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # FP32 master weights
    assert not torch.equal(model.output_layer.weight, other.output_layer.weight)
    weights = dict(model.named_parameters())
    same = {"embedding.word_embeddings.weight": plain.tok_embeddings.weight,
            "decoder.final_layernorm.weight": plain.norm.weight, "output_layer.weight": plain.output.weight}
    for i, block in enumerate(plain.layers):
        layer = f"decoder.layers.{i}"
        same |= {f"{layer}.input_layernorm.weight": block.attention_norm.weight,
                 f"{layer}.self_attention.linear_proj.weight": block.attention.wo.weight,
                 f"{layer}.pre_mlp_layernorm.weight": block.ffn_norm.weight,
                 f"{layer}.mlp.linear_fc1.weight": block.feed_forward.w13.weight,  # [gate; up], megatron's GLU order
                 f"{layer}.mlp.linear_fc2.weight": block.feed_forward.w2.weight}
        # q/k/v rows regrouped for megatron (and q/k reordered for its RoPE): the same rows, in another order.
        qkv, wqkv = weights[f"{layer}.self_attention.linear_qkv.weight"], block.attention.wqkv.weight
        assert torch.equal(qkv.sum(1).sort().values, wqkv.sum(1).sort().values) and not torch.equal(qkv, wqkv)
    for name, weight in same.items():
        assert torch.equal(weights[name], weight), name


@pytest.fixture
def megatron_rope_on_cpu(monkeypatch, cpu_megatron):
    """megatron's RotaryEmbedding.get_emb moves its frequencies to torch.cuda.current_device(): let that be
    the CPU (a third shim, on torch; megatron's own code runs unchanged)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


def test_gpt_model_computes_the_plain_llamas_function(megatron_rope_on_cpu):
    """FP32 on the CPU: the same logits, and after one step of the trainer's AdamW on each, the same loss.
    Measured: logits agree within 1e-6 (max |logit| ~4); a wrong RoPE pairing moves them by ~1e-2 at this
    init (q.k is small), GLU order by ~5e-2, the plain [Q; K; V] order instead of megatron's groups by ~0.4."""
    cfg = from_overrides({"optimizer.lr": 1e-3}, megatron_cfg())
    megatron, plain = build(cfg), build_model(cfg, torch.device("cpu"))
    tokens = torch.randint(0, plain.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, 1)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.ones(tokens.shape[1], tokens.shape[1]).triu(1).bool()[None, None]  # megatron's default is on CUDA

    expected = plain(tokens)
    torch.testing.assert_close(megatron(tokens, positions, causal), expected, rtol=1e-5, atol=1e-5)

    losses = []
    for loss_of, model in ((lambda: Llama.loss(plain(tokens), targets), plain),
                           (lambda: megatron(tokens, positions, causal, labels=targets).mean(), megatron)):
        optimizer = _adamw(model, cfg)
        first = loss_of()
        first.backward()
        optimizer.step()
        with torch.no_grad():
            losses.append((first.item(), loss_of().item()))
    (plain_first, plain_next), (megatron_first, megatron_next) = losses
    assert megatron_first == pytest.approx(plain_first, rel=1e-5)
    assert plain_next < plain_first - 0.01  # the step moved the loss, so its agreement means something
    assert megatron_next == pytest.approx(plain_next, rel=1e-5)


def test_llama3_8b_16_layers_gpt_model_computes_the_plain_llamas_function_at_llama3s_rope_base(megatron_rope_on_cpu):
    """Its 128256-token vocabulary, untied head and RoPE base 500000 at a CPU width: 2 layers of 256 (two heads of
    Llama 3's 128, one KV group). FP32 on the CPU, the same logits as the plain Llama of that shape. Measured: within
    2e-6 (max |logit| ~5.5), where megatron's RoPE at base 10000 moves them by ~8e-3."""
    cfg = megatron_cfg("--model", "llama3-8b-16-layers")
    shape = replace(model_config(cfg), dim=256, n_heads=2, n_kv_heads=1, ffn_dim=896, n_layers=2)
    megatron, plain = drawn_gpt(cfg, shape, seed=0), Llama(shape)
    plain.init_weights(seed=0)
    assert megatron.output_layer.weight.shape == megatron.embedding.word_embeddings.weight.shape == (128256, 256)
    assert not megatron.share_embeddings_and_output_weights and megatron.max_sequence_length == 8192
    frequencies = 1 / 500000 ** (torch.arange(0, 128, 2).float() / 128)
    torch.testing.assert_close(megatron.rotary_pos_emb.inv_freq.float(), frequencies)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.ones(tokens.shape[1], tokens.shape[1]).triu(1).bool()[None, None]  # megatron's default is on CUDA
    with torch.no_grad():
        torch.testing.assert_close(megatron(tokens, positions, causal), plain(tokens), rtol=1e-5, atol=1e-5)


def _two_ranks(rank: int, init_file: str, out: str) -> None:
    """Rank `rank` of 2 on gloo under megatron's TP=2: its GPTModel shards, and finish_grads' results."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build(megatron_cfg("--tensor-model-parallel-size", "2"))
    shards = {name: (p.detach().clone(), getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
              for name, p in model.named_parameters()}
    # Gradients as TP leaves them: a sharded weight's are this rank's own, a replicated weight's are equal
    # on both ranks, a sequence-parallel norm weight's are this rank's part of the sum over the sequence.
    sharded = torch.nn.Parameter(torch.zeros(2))
    sharded.tensor_model_parallel, sharded.grad = True, torch.tensor([3.0, 4.0]) * (rank + 1)
    replicated = torch.nn.Parameter(torch.zeros(1))
    replicated.grad = torch.tensor([12.0])
    norm_weight = torch.nn.Parameter(torch.zeros(1))
    norm_weight.sequence_parallel, norm_weight.grad = True, torch.tensor([1.0 + rank])
    total = megatron_model.finish_grads([sharded, replicated, norm_weight], 0.0,
                                        parallel_state.get_tensor_model_parallel_group())
    torch.save({"shards": shards, "norm": float(total), "norm_weight_grad": float(norm_weight.grad)}, f"{out}{rank}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_start_from_the_tp1_weights_and_finish_gradients_like_megatron(tmp_path, model_parallel):
    spawn(_two_ranks, (str(tmp_path / "init"), str(tmp_path / "rank")), 2)
    ranks = [torch.load(tmp_path / f"rank{rank}", weights_only=False) for rank in (0, 1)]
    for found in ranks:  # sharded grads count from both ranks, the replicated one once; norm weights sum 1 + 2
        assert found["norm_weight_grad"] == 3.0
        assert found["norm"] == pytest.approx((25 + 100 + 144 + 9) ** 0.5)
    whole = dict(build(megatron_cfg()).named_parameters())
    for name, (shard0, dim, stride) in ranks[0]["shards"].items():
        shard1 = ranks[1]["shards"][name][0]
        if dim is None:  # replicated: both ranks hold the whole weight
            assert torch.equal(shard0, whole[name]) and torch.equal(shard1, whole[name]), name
            continue
        # megatron's layout: the full weight split into 2 * stride pieces, rank r holding pieces r, r + 2, ...
        pieces0, pieces1 = shard0.chunk(stride, dim), shard1.chunk(stride, dim)
        joined = torch.cat([piece for pair in zip(pieces0, pieces1) for piece in pair], dim)
        assert torch.equal(joined, whole[name].detach()), name


def stepped_adamw(model: torch.nn.Module, cfg: JobConfig) -> torch.optim.AdamW:
    """The trainer's AdamW over `model` after one step on gradients drawn from a fixed seed (the same on every rank,
    so TP-replicated weights stay equal, as training keeps them)."""
    optimizer = _adamw(model, cfg)
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    return optimizer


def constant_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def same_training_state(model, optimizer, other, other_optimizer) -> bool:
    """Equal parameters, and equal AdamW moments and steps."""
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)):
        return False
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    return saved.keys() == loaded.keys() and all(
        saved[i].keys() == loaded[i].keys() and all(torch.equal(saved[i][k], loaded[i][k]) for k in saved[i])
        for i in saved)


def test_megatron_checkpoints_hold_whole_tensors_and_resume_the_model_and_adamw(tmp_path, model_parallel):
    """The Megatron path's layout: megatron's sharded state dicts through fp8stack's checkpoint writer (JSON
    metadata, a rank file with the common part), each weight whole under its global key (the layers stacked),
    AdamW's moments as tensors of the same sharding; a resume restores both exactly."""
    cfg = from_overrides({"optimizer.lr": 1e-3}, megatron_cfg())
    model = build(cfg)
    optimizer = stepped_adamw(model, cfg)
    path = checkpoint.save(tmp_path / "ckpt", 1, model, optimizer, constant_lr(optimizer), 5,
                           layout=MegatronTensors(model, optimizer))
    shape = model_config(cfg)
    tensors = json.loads((path / "metadata.json").read_text())["tensors"]
    assert tensors["decoder.layers.mlp.linear_fc1.weight"]["size"] == [shape.n_layers, 2 * shape.ffn_dim, shape.dim]
    assert tensors["optimizer.state.exp_avg.embedding.word_embeddings.weight"]["size"] == [shape.vocab_size, shape.dim]
    assert "layout" in torch.load(path / "rank0.pt", weights_only=True)

    other = build(cfg, seed=1)
    fresh = _adamw(other, cfg)
    assert not same_training_state(model, optimizer, other, fresh)
    resumed = checkpoint.load(path, other, fresh, constant_lr(fresh), layout=MegatronTensors(other, fresh))
    assert resumed == Resumed(step=1, data_position=5)
    assert same_training_state(model, optimizer, other, fresh)

    plain = checkpoint.save(tmp_path / "plain", 1, model, optimizer, constant_lr(optimizer), 5)
    with pytest.raises(CheckpointMismatchError, match="was not saved in this model's layout"):
        checkpoint.load(plain, other, fresh, constant_lr(fresh), layout=MegatronTensors(other, fresh))


def _two_rank_checkpoint(rank: int, init_file: str, folder: str, out: str) -> None:
    """Rank `rank` of 2 under megatron's TP=2: save a checkpoint of its stepped model and AdamW, resume it into a
    model drawn from another seed, and record whether all came back, with its post-step shards."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = from_overrides({"optimizer.lr": 1e-3}, megatron_cfg("--tensor-model-parallel-size", "2"))
    model = build(cfg)
    optimizer = stepped_adamw(model, cfg)
    path = checkpoint.save(folder, 1, model, optimizer, constant_lr(optimizer), 0,
                           layout=MegatronTensors(model, optimizer))
    other = build(cfg, seed=1)
    fresh = _adamw(other, cfg)
    checkpoint.load(path, other, fresh, constant_lr(fresh), layout=MegatronTensors(other, fresh))
    shards = {name: (p.detach().clone(), getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
              for name, p in model.named_parameters()}
    torch.save({"resumed": same_training_state(model, optimizer, other, fresh), "shards": shards}, f"{out}{rank}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_on_each_rank_and_holds_the_whole_weights(tmp_path, model_parallel):
    """Each TP rank resumes its shards exactly; read by one TP=1 process, the checkpoint gives the whole weights
    (the two ranks' shards joined in megatron's layout): each shard sits at its global offset."""
    folder = tmp_path / "ckpt"
    spawn(_two_rank_checkpoint, (str(tmp_path / "init"), str(folder), str(tmp_path / "rank")), 2)
    ranks = [torch.load(tmp_path / f"rank{rank}", weights_only=False) for rank in (0, 1)]
    assert all(found["resumed"] for found in ranks)

    cfg = from_overrides({"optimizer.lr": 1e-3}, megatron_cfg())
    whole = build(cfg, seed=1)
    fresh = _adamw(whole, cfg)
    checkpoint.load(folder / "step-00000001", whole, fresh, constant_lr(fresh), layout=MegatronTensors(whole, fresh))
    weights = dict(whole.named_parameters())
    for name, (shard0, dim, stride) in ranks[0]["shards"].items():
        if dim is None:
            assert torch.equal(weights[name], shard0), name
            continue
        pieces0, pieces1 = shard0.chunk(stride, dim), ranks[1]["shards"][name][0].chunk(stride, dim)
        joined = torch.cat([piece for pair in zip(pieces0, pieces1) for piece in pair], dim)
        assert torch.equal(weights[name], joined), name
