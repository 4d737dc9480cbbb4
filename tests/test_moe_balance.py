"""Auxiliary-loss-free load balancing of the plain MoE (a routing bias moved once per optimizer step by the step's
expert loads) and the router statistics the trainer and `fp8stack ab` report."""

import json
import math

import pytest
import torch

from fp8stack.models import Llama, load_model_config
from fp8stack.models.moe import (MoE, MoEConfig, Router, RouterLoad, clear_expert_load, moe_layers,
                                 register_expert_bias_update, router_statistics, update_expert_bias)
from fp8stack.config import from_overrides
from fp8stack.train.command import main as train_main
from fp8stack.train.loop import train
from host_syncs import HostSyncs

DIM, EXPERTS, TOP_K = 16, 4, 2
SIGMOID = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_ffn_dim=8, score_func="sigmoid", route_norm=True,
                    bias_update_rate=0.02)
FAST = {"model.name": "tiny-moe", "training.micro_batch": 2, "training.seq_len": 32, "training.eval_batches": 0,
        "data.max_bytes": 1 << 20, "logging.progress": False, "optimizer.warmup": 1}


def skewed_moe(config: MoEConfig = SIGMOID) -> MoE:
    """An MoE whose router sends every token to expert 0 and mostly expert 1: their gate rows read a constant
    feature, the other rows only noise."""
    torch.manual_seed(0)
    moe = MoE(DIM, config)
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.gate.weight.normal_(std=0.1)
        moe.router.gate.weight[0, 0] = 3.0
        moe.router.gate.weight[1, 0] = 1.0
    return moe


def tokens(count: int = 64) -> torch.Tensor:
    x = torch.randn(count, DIM)
    x[:, 0] = 1.0
    return x


def test_the_bias_chooses_the_experts_and_the_unbiased_scores_weigh_them():
    router = Router(DIM, SIGMOID)
    x = torch.randn(8, DIM)
    scores = router.gate(x).sigmoid()
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    plain_weights, plain_experts = router(x)
    weights, experts = router(x, bias)
    assert (experts == 3).any(dim=-1).all() and not (plain_experts == 3).any(dim=-1).all()
    chosen = scores.gather(-1, experts)
    assert torch.equal(weights, chosen / chosen.sum(dim=-1, keepdim=True))  # no trace of the bias
    assert torch.equal(router(x, torch.zeros(EXPERTS))[1], plain_experts)


def test_the_bias_update_evens_out_a_skewed_router():
    moe, x = skewed_moe(), tokens()
    imbalances = []
    for _ in range(40):
        moe(x)
        imbalances.append(router_statistics(update_expert_bias(moe))["imbalance"])
    assert imbalances[0] == pytest.approx(2.0)  # expert 0 takes every token: 64 of 128 slots, mean 32
    assert imbalances[-1] < 1.3 < imbalances[0]
    bias = moe.expert_bias
    assert bias[0] == bias.min() < 0 < bias[2:].min()  # the busiest expert pushed down, the idle ones up
    off = skewed_moe(MoEConfig(**{**SIGMOID.__dict__, "bias_update_rate": 0.0}))
    off(x)
    update_expert_bias(off)
    assert torch.equal(off.expert_bias, torch.zeros(EXPERTS))  # rate 0: balancing off


def test_counts_add_up_over_micro_batches_and_clear_at_the_update():
    moe = skewed_moe()
    batches = [tokens(10), tokens(6)]
    expected = sum(torch.bincount(moe.router(x)[1].flatten(), minlength=EXPERTS).float() for x in batches)
    for x in batches:
        moe(x)
    assert torch.equal(moe.tokens_per_expert, expected) and moe.routed_slots == 16 * TOP_K
    with torch.no_grad():
        moe(tokens(5))  # not training: not counted
    load = update_expert_bias(moe)[""]
    assert torch.equal(load.tokens_per_expert, expected) and load.routed_slots == 16 * TOP_K
    assert not moe.tokens_per_expert.any() and moe.routed_slots == 0
    assert torch.equal(load.bias, SIGMOID.bias_update_rate * torch.sign(expected.mean() - expected))
    moe(tokens(3))
    clear_expert_load(moe)
    assert not moe.tokens_per_expert.any() and moe.routed_slots == 0


def test_a_recomputed_forward_is_counted_once():
    moe, x = skewed_moe(), tokens(12).requires_grad_()
    torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.routed_slots == 12 * TOP_K and moe.tokens_per_expert.sum() == 12 * TOP_K


def test_an_optimizer_hook_updates_the_bias_after_each_step():
    moe = skewed_moe()
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    register_expert_bias_update(optimizer, moe)
    moe(tokens()).sum().backward()
    optimizer.step()
    assert moe.expert_bias[0] == -SIGMOID.bias_update_rate and moe.routed_slots == 0


def test_the_moe_forward_and_backward_never_wait_for_the_device(monkeypatch):
    moe, x = skewed_moe(), tokens(24).requires_grad_()
    with HostSyncs(monkeypatch) as syncs:
        moe(x).sum().backward()
        update_expert_bias(moe)
    assert syncs.seen == []
    with HostSyncs(monkeypatch) as syncs:  # the check sees syncs: router_statistics reads its numbers by .tolist()
        router_statistics(update_expert_bias(moe))
    assert syncs.seen == ["tolist"]


def test_router_statistics_of_a_hand_built_routing():
    loads = {"layers.1.moe": RouterLoad(tokens_per_expert=torch.tensor([4.0, 2.0, 2.0, 0.0]),
                                        routed_slots=torch.tensor(10.0), bias=torch.tensor([-0.1, 0.0, 0.0, 0.3])),
             "layers.2.moe": RouterLoad(tokens_per_expert=torch.tensor([2.0, 2.0, 2.0, 2.0]),
                                        routed_slots=torch.tensor(8.0), bias=torch.tensor([0.0, 0.2, 0.0, 0.0]))}
    stats = router_statistics(loads)
    assert stats["layers.1.moe/imbalance"] == pytest.approx(2.0)  # max 4 over mean 2
    assert stats["layers.1.moe/cv"] == pytest.approx(math.sqrt(2) / 2)  # population std sqrt(2) over mean 2
    assert stats["layers.1.moe/dropped"] == pytest.approx(0.2)  # 2 of 10 slots in no group
    assert (stats["layers.1.moe/bias_min"], stats["layers.1.moe/bias_max"]) == pytest.approx((-0.1, 0.3))
    assert stats["layers.2.moe/imbalance"] == 1.0 and stats["layers.2.moe/cv"] == 0.0
    assert stats["imbalance"] == pytest.approx(1.5) and stats["imbalance_max"] == pytest.approx(2.0)
    assert stats["dropped"] == pytest.approx(2 / 18)
    assert (stats["bias_min"], stats["bias_max"]) == pytest.approx((-0.1, 0.3))
    assert router_statistics({}) == {}


def test_the_dropless_moe_drops_nothing_as_its_permutation_counts():
    moe = skewed_moe()
    moe(tokens(9))
    stats = router_statistics(update_expert_bias(moe))
    assert stats["dropped"] == 0.0 and stats["imbalance"] == pytest.approx(2.0)


def test_training_tiny_moe_logs_router_statistics(tmp_path):
    result_json = tmp_path / "result.json"
    assert train_main([
        "--model", "tiny-moe", "--train-iters", "3", "--micro-batch-size", "2", "--seq-length", "32",
        "--eval-iters", "0", "--max-data-bytes", str(1 << 20), "--no-progress", "--lr-warmup-iters", "1",
        "--tensorboard-dir", str(tmp_path), "--result-json", str(result_json)]) == 0
    result = json.loads(result_json.read_text())
    layers = [f"layers.{i}.moe" for i in (1, 2, 3)]
    assert len(result["router"]) == 3
    for step in result["router"]:
        assert step["dropped"] == 0.0 and step["imbalance"] >= 1.0 and step["cv"] >= 0.0
        assert step["imbalance"] == pytest.approx(sum(step[f"{name}/imbalance"] for name in layers) / 3)
    first = result["router"][0]
    rate = load_model_config("tiny-moe").moe.expert_bias_rate
    assert rate == pytest.approx(4e-3 / 8)  # softmax router: 4e-3 / experts
    assert first["bias_max"] == pytest.approx(rate) and first["bias_min"] == pytest.approx(-rate)
    logged = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [entry["router/imbalance"] for entry in logged] == [step["imbalance"] for step in result["router"]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("train/router/layers.2.moe/cv")] == [0, 1, 2]


def test_dense_models_log_no_router_statistics():
    assert train(from_overrides({**FAST, "model.name": "tiny", "training.steps": 1})).router == []


@pytest.mark.parametrize("params", [{}, {"training.dtype": "bf16", "training.param_dtype": "bf16"}],
                         ids=["fp32-params", "bf16-params"])
def test_resume_restores_the_routing_bias_bit_identically(params, tmp_path):
    """A fast rate, so that the bias decides routes within 4 steps; with BF16 parameters the checkpoint's tensors
    are the FP32 masters, which hold no buffers: the bias is saved beside them."""
    settings = {**FAST, "training.steps": 4, "model.expert_bias_rate": 0.05, **params}
    uninterrupted = train(from_overrides(settings))
    train(from_overrides({**settings, "checkpoint.dir": str(tmp_path), "checkpoint.interval": 2}))
    resumed = train(from_overrides({**settings, "checkpoint.dir": str(tmp_path),
                                    "checkpoint.resume": str(tmp_path / "step-00000002")}))
    assert resumed.losses == uninterrupted.losses[2:]
    assert resumed.router == uninterrupted.router[2:]  # the bias range included: exact
    assert uninterrupted.router[1]["bias_max"] > 0.05  # the bias moved twice before the checkpoint


def test_a_bias_rate_for_a_dense_model_or_below_zero_is_refused(capsys):
    assert train_main(["--model", "tiny", "--model.expert-bias-rate", "0.01"]) == 2
    assert "drop --model.expert-bias-rate or pick an MoE model" in capsys.readouterr().err
    assert train_main(["--model", "tiny-moe", "--model.expert-bias-rate", "-1"]) == 2
    assert "must be at least 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bias_update_rate=-0.1 must be at least 0"):
        MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, bias_update_rate=-0.1)


def test_deepseek_moe_small_fits_one_h200_with_fp32_masters_and_adam():
    """Resident training state per parameter with BF16 parameters and FP32 masters (training.param_dtype bf16):
    2 (BF16 parameter) + 4 (FP32 master) + 4 (FP32 main_grad) + 8 (AdamW's two FP32 moments) = 18 bytes; with FP32
    parameters 16. 2.46 B parameters hold 44 GB of the H200's 141 GB, leaving ~97 GB for activations and
    workspaces. Counted from the parameters, not measured."""
    config = load_model_config("deepseek-moe-small")
    assert config.moe.score_func == "sigmoid" and config.moe.expert_bias_rate == 1e-3
    with torch.device("meta"):
        model = Llama(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert 2.4e9 < parameters < 2.5e9
    assert 18 * parameters < 45e9 < 141e9 / 3
    assert len(moe_layers(model)) == 7


def test_deepseek_moe_medium_fits_one_h200_with_fp32_masters_and_adam():
    """Its header's arithmetic: 4.97 B parameters at 18 bytes each (as above) are 83.3 GiB resident; micro-batch 2
    in FP8 adds ~12 GiB of activations (~6 GiB a sequence) and ~9 GiB of FP8 weight copies, ~105 GiB of the H200's
    139 GiB. Counted from the parameters, not measured."""
    config = load_model_config("deepseek-moe-medium")
    assert config.moe.score_func == "sigmoid" and config.moe.expert_bias_rate == 1e-3
    with torch.device("meta"):
        model = Llama(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert 4.96e9 < parameters < 4.98e9
    resident_gib = 18 * parameters / 2**30
    assert resident_gib == pytest.approx(83.3, abs=0.05)
    assert resident_gib + 2 * 6 + 9 < 139 - 30
    assert len(moe_layers(model)) == 5


DEEPSEEK_MOES = ("deepseek-moe-small", "deepseek-moe-medium")
"""The DeepSeek-style MoE models sized for one H200."""


@pytest.mark.parametrize("model", DEEPSEEK_MOES)
@pytest.mark.parametrize("command", ["train", "ab", "profile"])
def test_the_deepseek_moes_are_refused_only_for_want_of_a_gpu(command, model, capsys):
    """Without CUDA every command says so in one line and nothing else: the model itself is accepted."""
    from fp8stack.cli import main as cli_main

    assert cli_main([command, "--model", model, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"fp8stack {command}: error: training.device cuda requested but torch sees no CUDA GPU: pass "
                       "--device cpu")


@pytest.mark.parametrize("model, width", zip(DEEPSEEK_MOES, (2048, 4096)))
def test_the_deepseek_moes_pass_preflight_and_get_their_width_s_schedule(model, width):
    from fp8stack.train.loop import resolve_job
    from fp8stack.train.model import model_shape
    from fp8stack.train.preflight import preflight

    cfg = resolve_job(from_overrides({"model.name": model, "training.device": "cpu", "training.steps": 2000}))
    assert preflight(cfg, model_shape(cfg)) is None
    assert cfg.optimizer.lr == pytest.approx(6e-4 * 768 / width) and cfg.optimizer.warmup == 200


def test_ab_flags_an_arm_whose_routing_leaves_the_bf16_runs_range():
    from fp8stack.ab.run import _table
    from fp8stack.ab.verdicts import Arm, router_check, router_window

    def run(imbalances):
        return {"router": [{"imbalance": value} for value in imbalances]}

    steady = run([3.0] * 90 + [1.10, 1.12] * 5)  # the final 10%: mean 1.11, standard error 0.0033
    assert router_window(steady) == pytest.approx((1.11, 0.01 / 3), rel=1e-6)
    assert router_window({"router": []}) is None and router_window({}) is None
    bf16 = [(1.10, 0.003), (1.14, 0.003)]  # run-to-run spread 0.04: the margin
    assert router_check((1.17, 0.003), bf16)[0] == "within"
    verdict, note = router_check((1.19, 0.003), bf16)
    assert verdict == "differs" and "outside the 2 bf16 runs' 1.100 to 1.140 +-0.040" in note
    assert router_check((1.12, 0.05), [(1.0, 0.05)])[0] == "within"  # one run: two standard errors, 0.141
    header, rows = _table([Arm(recipe="bf16", backend="bf16", router_imbalance=1.1234, label="bf16")])
    assert rows[0][header.index("experts max/mean")] == "1.123"
    assert "experts max/mean" not in _table([Arm(recipe="bf16", backend="bf16", label="bf16")])[0]
