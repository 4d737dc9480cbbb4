"""--model-factory and --data: loading the user's functions, and checking the model and batches they return."""

from pathlib import Path

import pytest
import torch
from torch import nn

import fp8stack
from fp8stack.train.user_code import (DATA_FLAG, MODEL_FACTORY_FLAG, FactoryBatches, UserCodeError, build_model,
                                      check_batch, check_model, load_factory, vocab_size_of)

FACTORIES = Path(__file__).resolve().parents[1] / "examples" / "own_model" / "factories.py"
CPU = torch.device("cpu")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module `user_factories` in a folder on the path."""
    (tmp_path / "user_factories.py").write_text(
        "import torch\n"
        "WIDTH = 3\n"
        "def model():\n    return torch.nn.Linear(WIDTH, WIDTH)\n"
        "def needs_missing():\n    pass\n")
    (tmp_path / "broken_factories.py").write_text("import a_module_nobody_has\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("spec, message", [
    ("examples.own_model.factories", "'examples.own_model.factories' is not module:function: write e.g. "
                                     "--model-factory my_package.factories:model or path/to/file.py:function"),
    ("user_factories:", "is not module:function"),
    (":model", "is not module:function"),
    ("no_such_package.factories:model", "no module named 'no_such_package.factories' from "),
    ("user_factories:modle", "user_factories has no 'modle' (it defines model, needs_missing): name a function it "
                             "defines"),
    ("user_factories:WIDTH", "WIDTH (an int) is not callable: name the function that returns the model"),
    ("missing/factories.py:model", "no Python file missing/factories.py: give an existing path/to/file.py:function"),
])
def test_bad_factory_spec_is_one_line_naming_the_flag_and_the_fix(user_module, spec, message):
    with pytest.raises(UserCodeError) as err:
        load_factory(spec, MODEL_FACTORY_FLAG)
    assert str(err.value).startswith(MODEL_FACTORY_FLAG)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_module_that_fails_importing_something_else_shows_its_own_error(user_module):
    with pytest.raises(ModuleNotFoundError, match="a_module_nobody_has"):
        load_factory("broken_factories:model", DATA_FLAG)


def test_factories_load_from_a_module_and_from_a_file(user_module):
    assert isinstance(load_factory("user_factories:model", MODEL_FACTORY_FLAG)(), nn.Linear)
    model, data = (load_factory(f"{FACTORIES}:{name}", flag) for name, flag in (("model", MODEL_FACTORY_FLAG),
                                                                               ("data", DATA_FLAG)))
    assert model.__module__ == data.__module__  # one file, imported once


def test_example_model_factory_builds_the_same_model_from_the_same_seed():
    factory = load_factory(f"{FACTORIES}:model", MODEL_FACTORY_FLAG)
    state = torch.random.get_rng_state()
    first, again, other = (build_model(factory, seed=seed, device=CPU) for seed in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's RNG is left alone
    weights = [dict(m.state_dict()) for m in (first, again, other)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["layers.0.attention.wq.weight"], weights[2]["layers.0.attention.wq.weight"])
    assert vocab_size_of(first, torch.zeros(2, 16, dtype=torch.long)) == 256
    # What the trainer does next with it: a plan of the user's module.
    plan = fp8stack.make_plan(first, fp8stack.PolicyConfig("tensorwise", small_gemm_filter="off"), seq_len=256)
    assert "layers.3.feed_forward.w2" in {d.fqn for d in plan.decisions if d.recipe == "tensorwise"}


class _Logits(nn.Module):
    """Returns whatever `out(tokens)` gives, with one parameter to train."""

    def __init__(self, out):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.out = out

    def forward(self, tokens):
        return self.out(tokens)


@pytest.mark.parametrize("model, message", [
    (_Logits(lambda t: (t,)), "the model's forward returned a tuple: return the logits tensor"),
    (_Logits(lambda t: torch.zeros(*t.shape)), "returned torch.float32 (1, 16) for token ids (1, 16): return "
                                               "floating-point logits [batch, seq, vocab] (1, 16, V)"),
    (_Logits(lambda t: t[..., None].expand(-1, -1, 8)), "returned torch.int64 (1, 16, 8)"),
])
def test_model_whose_forward_returns_no_logits_is_refused(model, message):
    with pytest.raises(UserCodeError) as err:
        vocab_size_of(model, torch.zeros(2, 16, dtype=torch.long))
    assert str(err.value).startswith(MODEL_FACTORY_FLAG) and message in str(err.value)


@pytest.mark.parametrize("returned, message", [
    ({"model": None}, "returned a dict, not a torch.nn.Module: return the model"),
    (nn.ReLU(), "returned a ReLU with no parameters to train"),
    (nn.Linear(2, 2).to(torch.bfloat16), "returned weight as bfloat16: return FP32 parameters"),
])
def test_model_factory_returning_no_fp32_module_is_refused(returned, message):
    with pytest.raises(UserCodeError) as err:
        build_model(lambda: returned, seed=0, device=CPU)
    assert str(err.value).startswith(MODEL_FACTORY_FLAG) and message in str(err.value)
    assert check_model(nn.Linear(2, 2)) is not None


def _batches(split="train", seed=0, rank=0, ranks=1, batch_size=4, seq_len=32):
    return FactoryBatches(load_factory(f"{FACTORIES}:data", DATA_FLAG), split=split, seq_len=seq_len,
                          batch_size=batch_size, seed=seed, rank=rank, ranks=ranks, vocab_size=256)


def test_example_data_is_the_same_in_every_arm_and_differs_by_index_split_and_seed():
    arm_a, arm_b = _batches(), _batches()
    first = next(arm_a)
    assert arm_a.position == 1
    tokens, targets = first
    assert tokens.dtype == torch.int64 and tokens.shape == (4, 32) and torch.equal(tokens[:, 1:], targets[:, :-1])
    assert all(torch.equal(a, b) for a, b in zip(first, arm_b.batch(0)))
    assert not torch.equal(arm_a.batch(1)[0], first[0])
    assert not torch.equal(_batches(split="validation").batch(0)[0], first[0])
    assert not torch.equal(_batches(seed=1).batch(0)[0], first[0])
    two_ranks = [_batches(rank=r, ranks=2, batch_size=2).batch(0)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(two_ranks), _batches(batch_size=4).batch(0)[0])  # the ranks' slices of one batch
    assert not torch.equal(*two_ranks)


GOOD = torch.zeros(2, 8, dtype=torch.long)


@pytest.mark.parametrize("batch, message", [
    (GOOD, "batch(3) returned a Tensor: return (tokens, targets), two tensors"),
    ((GOOD, GOOD, GOOD), "batch(3) returned a tuple: return (tokens, targets)"),
    ((GOOD.int(), GOOD), "batch(3)'s tokens are int32: return int64 token ids (.long())"),
    ((GOOD, GOOD[:, :4]), "batch(3)'s targets have shape (2, 4): return [batch_size, seq_len] = (2, 8)"),
    ((GOOD.to("meta"), GOOD), "batch(3)'s tokens are on meta: return CPU tensors"),
    ((GOOD, GOOD + 256), "batch(3)'s targets hold ids from 256 to 256: return ids in [0, 256)"),
    ((GOOD - 1, GOOD), "batch(3)'s tokens hold ids from -1 to -1: return ids in [0, 256)"),
])
def test_bad_batch_is_refused_naming_the_fix(batch, message):
    with pytest.raises(UserCodeError) as err:
        check_batch(batch, batch_size=2, seq_len=8, vocab_size=256, index=3)
    assert str(err.value).startswith(DATA_FLAG) and message in str(err.value) and "\n" not in str(err.value)


def test_data_factory_returning_no_function_is_refused():
    with pytest.raises(UserCodeError, match="--data returned a list: return the batch function"):
        FactoryBatches(lambda **sizes: [GOOD, GOOD], split="train", seq_len=8, batch_size=2, seed=0)


def test_factory_batches_check_every_batch():
    batches = FactoryBatches(lambda **sizes: lambda index: (GOOD, GOOD + index), split="train", seq_len=8,
                             batch_size=2, seed=0, vocab_size=2)
    assert torch.equal(next(batches)[1], GOOD)
    next(batches)
    with pytest.raises(UserCodeError, match=r"batch\(2\)'s targets hold ids from 2 to 2"):
        next(batches)
