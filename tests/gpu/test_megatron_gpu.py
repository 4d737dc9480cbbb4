"""fp8stack.megatron on a GPU with TransformerEngine: factory-spec GPTModels (dense, MoE) run forward and
backward with exactly the plan's layers and GEMMs in FP8; apply_plan_to_megatron on a built model; the
Megatron bench's training step re-quantizing updated weights; and each patch in patches/ shown with and
without. Run with `pytest -m gpu tests/gpu/test_megatron_gpu.py`."""

import pytest
import torch

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te()

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as te_recipes  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.bench import megatron as bench  # noqa: E402
from fp8stack.megatron import apply_plan_to_megatron, block_spec, plan_from_megatron_args  # noqa: E402
from fp8stack.patches import fp8_wgrad_ignored, recompute_fp8_context  # noqa: E402

VOCAB, SEQ = bench.VOCAB, 256
DENSE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=True,
           moe_layer_freq=[0, 1, 1, 1], moe_token_dispatcher_type="alltoall")


@pytest.fixture(scope="module", autouse=True)
def megatron():
    bench.init_megatron()


def fp8_seen(model) -> dict[str, bool]:
    """fqn -> whether FP8 was on when each TE GEMM module of the decoder last ran forward."""
    # Read inside TE's forward (prepare_forward), not in a forward pre-hook: a pre-hook runs before a
    # plan-precision module enters its own autocast and would report the enclosing layer's state.
    seen = {}
    for fqn, module in model.decoder.named_modules():
        if isinstance(module, (te.Linear, te.LayerNormLinear, te.GroupedLinear)):
            def recording(*args, fqn=fqn, prepare=module.prepare_forward, **kwargs):
                seen[fqn] = FP8GlobalStateManager.is_fp8_enabled()
                return prepare(*args, **kwargs)
            module.prepare_forward = recording
    return seen


def step(model):
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ), device="cuda")
    position_ids = torch.arange(SEQ, device="cuda").expand(2, SEQ)
    loss = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return loss


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_dense_factory_spec_runs_the_plans_layers_in_fp8(recipe):
    config = bench.make_config(DENSE, "hybrid", recipe)
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, first_last_layers_bf16=True)
    model = bench.build_gpt(config, block_spec(config, plan))
    tag = recipe.capitalize()
    assert [type(layer).__name__ for layer in model.decoder.layers] == [
        "BF16TransformerLayer", f"FP8{tag}TransformerLayer", f"FP8{tag}TransformerLayer", "BF16TransformerLayer"]
    seen = fp8_seen(model)
    step(model)
    assert seen and all(on == (fqn.split(".")[1] in ("1", "2")) for fqn, on in seen.items()), seen


def test_moe_only_plan_keeps_attention_bf16_and_experts_fp8():
    config = bench.make_config(MOE, "hybrid", "tensorwise")
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, moe_only=True)
    model = bench.build_gpt(config, block_spec(config, plan))
    assert type(model.decoder.layers[1].mlp.experts).__name__ == "TEGroupedMLP"
    seen = fp8_seen(model)
    step(model)
    for fqn, on in seen.items():
        assert on == (fqn.split(".")[1] != "0" and ".mlp." in fqn), (fqn, on)


def test_moe_grouped_experts_train_in_fp8():
    config = bench.make_config(MOE, "hybrid", "blockwise")
    model = bench.build_gpt(config, block_spec(config, plan_from_megatron_args(config, vocab_size=VOCAB,
                                                                               seq_len=SEQ)))
    seen = fp8_seen(model)
    step(model)
    assert all(seen.values()) and any("experts.linear_fc1" in fqn for fqn in seen)


def test_apply_plan_to_a_megatron_te_model_gives_the_factory_classes():
    config = bench.make_config(DENSE, "hybrid", "tensorwise")
    plan = plan_from_megatron_args(config, vocab_size=VOCAB, seq_len=SEQ, first_last_layers_bf16=True)
    model = apply_plan_to_megatron(bench.build_gpt(config, bench.megatron_spec(config)), plan)
    factory = bench.build_gpt(config, block_spec(config, plan))
    assert [type(m).__name__ for m in model.decoder.modules()] == [type(m).__name__ for m in factory.decoder.modules()]
    step(model)


def test_bench_step_trains_the_weights_the_fp8_gemms_read():
    # Megatron's TE linears quantize their weights on the first forward after set_is_first_microbatch() and
    # reuse that FP8 copy until the next call; a bench step that skipped the call would update BF16 weights
    # that no FP8 GEMM reads (the bench's FP8 arms once trained that way).
    config = bench.make_config(DENSE, "hybrid", "tensorwise")
    model = bench.build_gpt(config, bench.fp8stack_spec(config))
    trainer = bench.Trainer(model, lr=1e-3, warmup_steps=0)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ), device="cuda")
    labels, position_ids = torch.roll(tokens, -1, 1), torch.arange(SEQ, device="cuda").expand(2, SEQ)
    trainer.step(tokens, labels)  # quantizes the initial weights, then updates them
    with torch.no_grad():
        stale = model(tokens, position_ids, None, labels=labels).float().mean().item()  # the cached FP8 copy
        model.set_is_first_microbatch()
        fresh = model(tokens, position_ids, None, labels=labels).float().mean().item()
    assert stale != pytest.approx(fresh, rel=1e-4), "TE no longer reuses cached FP8 weights: revisit Trainer.step"
    assert abs(trainer.step(tokens, labels) - fresh) < 0.1 * abs(stale - fresh)


def test_recompute_patch_restores_the_forwards_fp8_autocast():
    from megatron.core import tensor_parallel

    linear = te.Linear(256, 256, params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = te_recipes.Float8CurrentScaling()

    def run(patched: bool) -> list[bool]:
        states = []

        def function(inp):
            states.append(FP8GlobalStateManager.is_fp8_enabled())
            return linear(inp)

        (recompute_fp8_context.apply() if patched else recompute_fp8_context.revert())
        try:
            with te.autocast(enabled=True, recipe=recipe):
                out = tensor_parallel.checkpoint(function, False, x)
            out.float().sum().backward()
        finally:
            recompute_fp8_context.revert()
        return states

    assert run(patched=False) == [True, False]  # the bug: recompute in BF16 after an FP8 forward
    assert run(patched=True) == [True, True]


def test_fp8_wgrad_false_is_silently_ignored_without_the_patch():
    from megatron.core import fp8_utils

    config = bench.make_config(DENSE, "hybrid", "delayed")
    config.fp8_wgrad = False
    fp8_wgrad_ignored.revert()
    recipe = fp8_utils.get_fp8_recipe(config)  # the bug: builds, and nothing keeps wgrad in BF16
    assert not hasattr(recipe, "override_linear_precision")
    try:
        assert fp8_wgrad_ignored.apply().startswith("applied")
        with pytest.raises(ValueError, match="--no-fp8-wgrad"):
            fp8_utils.get_fp8_recipe(config)
    finally:
        fp8_wgrad_ignored.revert()
