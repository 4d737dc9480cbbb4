"""A user's own torchtitan-layout model (examples/own_model) through the public API on TransformerEngine: the traced
fusions against the unfused model, weights copied bit-exactly, the user's state-dict keys, the master weights with
the user's own optimizer and loop, resume, and TE loaded before torch's cuDNN. Run with `pytest -m gpu`."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8stack
from fp8stack.backends.fused import FoldedNorm, ProjectionSlice
from fp8stack.plan import PolicyConfig, make_plan

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed", "tensorwise"])

from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "own_model"))
from model import SIZES, Transformer  # noqa: E402

FUSED_REL_ERR = 0.05
"""A fused norm casts its FP32 result to FP8 directly where the unfused one rounds to BF16 first, and LayerNormMLP
computes SwiGLU in FP32: a few FP8 values one step apart, ~1% on the logits; a wrong order of q/k/v rows or of
gate/up would be O(1)."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def user_model(dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(SIZES["tiny"])
    model.init_weights()
    return model.to(dtype)


def assembled(model: Transformer, recipe: str, fuse: bool, **options) -> torch.nn.Module:
    policy = PolicyConfig(recipe, backend="te", small_gemm_filter="off", fuse_norm=fuse, fuse_mlp=fuse)
    return fp8stack.assemble(model, make_plan(model, policy, seq_len=128), **options)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fused_modules_hold_the_users_weights_and_compute_what_unfused_ones_do(recipe):
    base = user_model(torch.bfloat16)
    fused = assembled(copy.deepcopy(base), recipe, fuse=True)
    unfused = assembled(copy.deepcopy(base), recipe, fuse=False)
    for name, block in fused.layers.items():
        original = base.layers[name]
        attention, mlp = block.attention, block.feed_forward
        assert isinstance(block.attention_norm, FoldedNorm) and isinstance(block.ffn_norm, FoldedNorm)
        assert all(isinstance(getattr(attention, n), ProjectionSlice) for n in ("wq", "wk", "wv"))
        qkv = attention.wq.fused
        assert type(qkv).__name__ == "TELayerNormLinear" and type(mlp).__name__ == "TELayerNormMLP"
        assert torch.equal(qkv.weight, torch.cat([original.attention.wq.weight, original.attention.wk.weight,
                                                  original.attention.wv.weight]))
        assert torch.equal(qkv.layer_norm_weight, original.attention_norm.weight)
        assert torch.equal(mlp.fc1_weight, torch.cat([original.feed_forward.w1.weight, original.feed_forward.w3.weight]))
        assert torch.equal(mlp.fc2_weight, original.feed_forward.w2.weight)
        assert torch.equal(mlp.layer_norm_weight, original.ffn_norm.weight)
    assert type(fused.output).__name__ == "TELayerNormLinear" and fused.output.autocast_recipe is None
    tokens = torch.randint(0, 256, (4, 129), device="cuda")
    for _ in range(2):  # delayed scaling's first pass runs with scale 1: compare the second
        for model in (fused, unfused):
            model.zero_grad(set_to_none=True)
        losses = [F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
                  for m in (fused, unfused)]
        for loss in losses:
            loss.backward()
    logits = [m(tokens[:, :-1]) for m in (fused, unfused)]
    assert rel_err(*logits) < FUSED_REL_ERR
    fc1_grad = fused.layers["0"].feed_forward.fc1_weight.grad
    gate_up_grad = torch.cat([unfused.layers["0"].feed_forward.w1.weight.grad,
                              unfused.layers["0"].feed_forward.w3.weight.grad])
    assert rel_err(fc1_grad, gate_up_grad) < 2 * FUSED_REL_ERR


def test_the_fused_model_loads_and_writes_the_users_state_dict_keys():
    base = user_model(torch.bfloat16)
    user = {k: v.clone() for k, v in base.state_dict().items()}
    fused = assembled(copy.deepcopy(base), "delayed", fuse=True)
    back = fp8stack.unfused_state_dict(fused)
    extra = {k for k in back if k.endswith("._extra_state")}
    assert set(back) - extra == set(user)
    assert all(torch.equal(back[k], user[k]) for k in user), "written back bit-exactly"
    with torch.no_grad():
        for p in fused.parameters():
            p.zero_()
    missing, unexpected = fused.load_state_dict(user, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing)
    assert all(torch.equal(fp8stack.unfused_state_dict(fused)[k], user[k]) for k in user)


def train_steps(model, optimizer, batches) -> list[float]:
    """The user's loop: two micro-batches per step under BF16 autocast, clipping the optimizer's parameters."""
    losses = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for step_batches in batches:
        total = 0.0
        for tokens in step_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / len(step_batches)).backward()
            total += loss.item() / len(step_batches)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def user_run(recipe: str):
    model = assembled(user_model(), recipe, fuse=True)
    masters = fp8stack.MasterWeights(model)
    optimizer = masters.track(torch.optim.AdamW(masters.parameters(), lr=1e-3, fused=True))
    return model, masters, optimizer


def batches(steps: int) -> list:
    """Micro-batches of counting sequences from random starts: each next token is learnable (random tokens are not:
    their loss cannot fall below log 256)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    starts = torch.randint(0, 256, (steps, 2, 2, 1), device="cuda", generator=generator)
    return list((starts + torch.arange(129, device="cuda")) % 256)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_master_weights_with_the_users_optimizer_train_as_fp32_parameters(recipe):
    """BF16 parameters with FP32 masters and main_grads (TE's fused wgrad GEMMs into them, a hook elsewhere) train
    as FP32 parameters under autocast do, to the rounding of the BF16 copies."""
    model, masters, optimizer = user_run(recipe)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert any(getattr(p, "main_grad", None) is not None for p in model.parameters())
    data = batches(4)
    losses = train_steps(model, optimizer, data)
    for param, master in zip(masters.params, masters.masters, strict=True):
        assert torch.equal(param, master.to(torch.bfloat16))
    reference = assembled(user_model(), recipe, fuse=True)
    fp32_losses = train_steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True), data)
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(fp32_losses, rel=2e-2), (losses, fp32_losses)


def test_a_user_run_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path, monkeypatch):
    """The masters, the optimizer's moments and TE's delayed-scaling state (the modules' extra state) are what a
    resume needs; the BF16 parameters are copied from the loaded masters."""
    data = batches(4)
    model, masters, optimizer = user_run("delayed")
    full = train_steps(model, optimizer, data)

    model, masters, optimizer = user_run("delayed")
    first = train_steps(model, optimizer, data[:2])
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("._extra_state")}
    torch.save({"masters": masters.module.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra},
               tmp_path / "checkpoint.pt")
    del model, masters, optimizer
    FP8GlobalStateManager.reset()

    model, masters, optimizer = user_run("delayed")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)  # the test's own file
    masters.module.load_state_dict(saved["masters"])
    optimizer.load_state_dict(saved["optimizer"])
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")  # TE unpickles its own scaling state
    model.load_state_dict(saved["extra"], strict=False)
    masters.after_step()
    assert first + train_steps(model, optimizer, data[2:]) == full


def test_fp8stack_imported_after_torch_loads_te_before_torchs_cudnn():
    """A process that imports fp8stack before running any model gets TE loaded first, so a cuDNN attention run
    before TE's first use does not break TE's own cuDNN."""
    code = ("import torch, fp8stack\n"
            "q = torch.randn(1, 2, 128, 64, device='cuda', dtype=torch.bfloat16)\n"
            "with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):\n"
            "    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
            "from fp8stack.backends import get_backend\n"
            "print(get_backend('te').available(['delayed']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])})
    assert run.returncode == 0 and "(True, '')" in run.stdout, run.stderr[-2000:]
