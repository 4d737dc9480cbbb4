"""The Megatron bench on CPU: its verdicts and noise on synthetic numbers, and its trainer, interleaved group
runner and report on two tiny real megatron GPTModels (megatron's local spec against fp8stack's factory
spec, BF16). The TE arms run on a GPU: python -m fp8stack.bench.megatron."""

import argparse
import math

import pytest
import torch

from fp8stack.bench import megatron as bench
from fp8stack.bench.megatron_verdicts import (LOSS_TOLERANCE, against, judge_pair, loss_verdict, throughput_verdict,
                                              trains, window_order, window_summary)
from fp8stack.megatron import block_spec, plan_from_megatron_args

pytestmark = pytest.mark.filterwarnings("ignore:.*tp_group is None", "ignore:Apex is not installed",
                                        "ignore:full scope is deprecated", "ignore:MLP requires ffn_hidden_size")

VOCAB, SEQ = 128, 32


def test_throughput_verdict_allows_the_measured_noise_and_no_more():
    assert throughput_verdict(101.0, 100.0, noise=0.0)[0]
    passed, reason = throughput_verdict(99.5, 100.0, noise=0.01)
    assert passed and reason == "factory >= megatron within noise (-0.50%, noise 1.00%)"
    passed, reason = throughput_verdict(98.0, 100.0, noise=0.01)
    assert not passed and reason == "factory slower than megatron beyond the noise (-2.00%, noise 1.00%)"
    assert not throughput_verdict(99.99, 100.0, noise=0.0)[0]


def test_loss_verdict_uses_the_mean_of_the_last_tenth_both_ways():
    megatron = [10.0] * 45 + [2.0] * 5
    assert loss_verdict([10.0] * 45 + [2.0, 2.0, 2.0, 2.0, 2.04], megatron) == (
        True, "same loss within tolerance (+0.400%, tolerance 0.50%)", pytest.approx(0.004))
    assert not loss_verdict([10.0] * 45 + [2.0] * 4 + [2.06], megatron)[0]  # +0.6%
    assert not loss_verdict([10.0] * 45 + [1.98] * 5, megatron)[0]  # -1%: lower is a difference too
    assert loss_verdict([99.0] * 45 + [2.0] * 5, megatron)[0]  # only the last 10% count
    assert LOSS_TOLERANCE == 0.005


def test_window_order_alternates_so_drift_favours_no_arm():
    assert window_order(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1), (3, 1), (3, 0)]
    assert [a for _, a in window_order(3, 2)] == [0, 1, 2, 2, 1, 0]


def test_window_summary_drops_warm_up_and_measures_the_spread():
    summary = window_summary([5.0, 2.0, 1.0, 1.0, 1.0, 1.0], tokens_per_step=1000)
    assert summary == {"median_step_s": 1.0, "tokens_per_s": 1000.0, "noise": 0.0, "windows_used": 4}
    summary = window_summary([9.0, 9.0, 0.8, 0.9, 1.0, 1.1, 1.2], tokens_per_step=1000)
    assert summary["tokens_per_s"] == pytest.approx(1000.0) and summary["noise"] == pytest.approx(0.3)


def _arm(name, tokens_per_s, noise, losses, status="ok"):
    return {"arm": name, "status": status, "tokens_per_s": tokens_per_s, "noise": noise, "losses": losses}


def test_judge_pair_takes_the_larger_noise_and_fails_unfinished_arms():
    losses = [3.0] * 10
    verdict = judge_pair("tensorwise", _arm("m", 100.0, 0.002, losses), _arm("f", 99.0, 0.015, losses))
    assert verdict["noise"] == 0.015 and verdict["throughput_passed"] and verdict["loss_passed"] and verdict["passed"]
    verdict = judge_pair("tensorwise", _arm("m", 100.0, 0.015, losses), _arm("f", 98.0, 0.002, losses))
    assert not verdict["throughput_passed"] and verdict["loss_passed"] and not verdict["passed"]
    verdict = judge_pair("delayed", _arm("m", 100.0, 0.01, losses), _arm("f", None, None, [], "error"))
    assert not verdict["passed"] and verdict["throughput"] == "not judged, f: error"


def test_trains_and_against_bf16():
    assert trains([10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]) == (True, "finite, decreasing (10.000 -> 1.000)")
    assert trains([3.0] * 10)[1] == "loss not decreasing (3.000 -> 3.000)"
    assert trains([3.0, math.nan, 1.0]) == (False, "non-finite loss")
    base, arm = _arm("b", 100.0, 0.0, [4.0] * 10), _arm("a", 125.0, 0.0, [4.2] * 10)
    assert against(base, arm) == {"vs_bf16_speedup": 1.25, "vs_bf16_loss_gap": pytest.approx(0.05)}
    assert against(None, arm) == {"vs_bf16_speedup": None, "vs_bf16_loss_gap": None}


def test_arguments_need_enough_windows_for_the_noise(capsys):
    args = bench.parse_args([])
    assert (args.steps, args.window, args.recipes) == (50, 5, ("bf16", "delayed", "tensorwise", "blockwise"))
    assert args.moe_recipes == ("bf16", "tensorwise", "blockwise")
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "20", "--window", "5"])
    assert "gives 4 timed windows per arm; the noise needs at least 6" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_main_without_cuda_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs a CUDA GPU with TransformerEngine"):
        bench.main([])


class CausalGPT(torch.nn.Module):
    """A CPU GPTModel given an explicit causal mask (megatron builds its default mask on CUDA)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        self.steps_begun = 0

    @property
    def decoder(self):
        return self.gpt.decoder

    def set_is_first_microbatch(self):  # what makes TE re-quantize updated weights (a no-op in BF16)
        self.steps_begun += 1
        self.gpt.set_is_first_microbatch()

    def forward(self, tokens, position_ids, attention_mask, labels):
        assert attention_mask is None  # the bench leaves the mask to megatron
        causal = torch.ones(tokens.shape[1], tokens.shape[1]).triu(1).bool()[None, None]
        return self.gpt(tokens, position_ids, causal, labels=labels)


def tiny_gpt(factory: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, gated_linear_unit=True, normalization="RMSNorm",
                               add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)
    spec = (block_spec(config, plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ), use_te=False)
            if factory else get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"))
    torch.manual_seed(0)
    return CausalGPT(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                              position_embedding_type="learned_absolute"))


def test_group_trains_both_specs_interleaved_and_reports_verdicts(cpu_megatron):
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(0, 16, (400,), generator=generator)  # a small alphabet: a loss that can fall
    data = []
    for _ in range(12):
        starts = torch.randint(0, 400 - SEQ - 1, (2,), generator=generator).tolist()
        windows = torch.stack([text[s: s + SEQ + 1] for s in starts])
        data.append((windows[:, :-1], windows[:, 1:]))
    models = []

    def build(factory: bool):
        models.append(tiny_gpt(factory))
        return models[-1]

    arms = [bench.Arm("bf16 megatron-spec", "bf16", lambda: build(factory=False)),
            bench.Arm("bf16 fp8stack-spec", "bf16", lambda: build(factory=True))]
    assert bench.run_group(arms, data, window=2) is None  # no CUDA peak on a CPU
    assert [m.steps_begun for m in models] == [12, 12]  # each step told megatron a new step begins
    megatron, factory = (arm.record for arm in arms)
    assert megatron["status"] == factory["status"] == "ok", (megatron.get("trace"), factory.get("trace"))
    assert megatron["layers"] == ["TransformerLayer"] * 2 and factory["layers"] == ["BF16TransformerLayer"] * 2
    assert len(megatron["losses"]) == 12 and len(megatron["window_step_s"]) == 6 and megatron["windows_used"] == 4
    assert megatron["losses"] == factory["losses"]  # same weights, same batches, same modules: same curve
    assert megatron["losses"][-1] < megatron["losses"][0]  # the trainer trains
    assert megatron["tokens_per_s"] > 0 and megatron["step_extra_gib"] is None

    moe = [bench.Arm("moe bf16 fp8stack-spec", "bf16", None, {"arm": "moe bf16 fp8stack-spec", "status": "ok",
                                                              "losses": [5.0, 4.0, 3.0], "tokens_per_s": 100.0}),
           bench.Arm("moe blockwise fp8stack-spec", "blockwise", None,
                     {"arm": "moe blockwise fp8stack-spec", "status": "error", "error": "ValueError: boom"})]
    args = argparse.Namespace(steps=12, window=2)
    payload, markdown, passed = bench.report({"bf16": arms}, moe, args, "test data", {}, {"bf16": None}, None)
    assert not passed  # the MoE arm that errored fails its check
    verdict = payload["verdicts"][0]
    assert verdict["loss_passed"] and verdict["rel_loss_gap"] == 0.0
    assert "| bf16 |" in markdown and "pass: same loss within tolerance (+0.000%, tolerance 0.50%)" in markdown
    assert "FAIL: error" in markdown and "ValueError: boom" in markdown
    assert payload["moe_arms"][0]["trains"] == "finite, decreasing (5.000 -> 3.000)"
    assert payload["arms"][1]["vs_bf16_speedup"] == pytest.approx(factory["tokens_per_s"] / megatron["tokens_per_s"])
