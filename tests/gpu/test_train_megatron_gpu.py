"""The trainer's Megatron path on one GPU with TransformerEngine: megatron's TE linears cast their weights
to FP8 once per step and reuse the copy until told that a new step began (`set_is_first_microbatch`), so
the trainer must tell them after every optimizer step, or every later step runs the step-0 weights.
Run with `pytest -m gpu tests/gpu/test_train_megatron_gpu.py`."""

import pytest
import torch

from fp8stack.megatron.precision import te_usable

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False", allow_module_level=True)
if not te_usable():
    pytest.skip("needs TransformerEngine importable with CUDA (pip install 'fp8stack[gpu]')", allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402

from fp8stack.train import megatron_model  # noqa: E402
from fp8stack.train.loop import TrainConfig, _Distributed, train  # noqa: E402


@pytest.fixture(autouse=True)
def no_megatron_state_left_by_other_modules():
    """The trainer sets up megatron's parallel state itself; other GPU test modules leave theirs behind."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def megatron_tensorwise(**kw) -> TrainConfig:
    return TrainConfig(model="tiny", model_impl="megatron", recipe="tensorwise", backend="te", device="cuda",
                       eval_batches=0, progress=False, **kw)


def test_each_optimizer_step_marks_a_new_step_for_the_fp8_weight_cache():
    cfg = megatron_tensorwise(steps=1)
    with _Distributed(cfg) as env, megatron_model.build(cfg, env) as built:
        fp8_linears = [m for m in built.model.decoder.modules()
                       if isinstance(m, (te.Linear, te.LayerNormLinear)) and hasattr(m, "is_first_microbatch")]
        assert fp8_linears, "the plan puts the tiny model's layers in FP8: TE linears expected"
        tokens = torch.randint(0, 256, (2, built.seq_len), device=env.device)
        built.loss(tokens, tokens.roll(-1, 1)).backward()
        assert not any(m.is_first_microbatch for m in fp8_linears), "after a forward TE reuses its FP8 weights"
        built.after_optimizer_step()
        assert all(m.is_first_microbatch for m in fp8_linears), "the next step must cast the updated weights"


def test_megatron_fp8_training_learns():
    result = train(megatron_tensorwise(steps=30, lr=1e-3, warmup=3))
    head, tail = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert all(x == x for x in result.losses) and tail < 0.8 * head, result.losses
