"""TE's FP8 dot-product attention on a GPU (the plan's fp8_attention, --fp8-dot-product-attention): the attention
modules' SDPA calls run in TE's fused FP8 attention kernel (TE's own backend selection says so, and the FP8 attention
modules count their calls), within FP8 rounding of BF16 SDPA; a Llama with head dim 128 (what TE's fused FP8 attention
trains on sm90) trains with it close to the same Llama with BF16 attention, eager and with its blocks compiled; SDPA
calls TE's kernel cannot take are refused; the trainer's plain path and its Megatron path train with it.
Run with `pytest -m gpu tests/gpu/test_fp8_attention_gpu.py`."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8stack import assemble, describe_module
from fp8stack.assembly import assembly_state
from fp8stack.config import from_overrides
from fp8stack.models import Llama, LlamaConfig
from fp8stack.plan import PlanError, PolicyConfig, make_plan

from gpu_skips import require_te

pytestmark = pytest.mark.gpu

require_te(["delayed"])
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("TE's fused FP8 attention needs sm90+", allow_module_level=True)

from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends  # noqa: E402
from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

from fp8stack.backends.te_attention import TEScaledDotProductAttention  # noqa: E402
from fp8stack.train.loop import train  # noqa: E402

MAJOR, MINOR = torch.cuda.get_device_capability()
ARCH = 10 * MAJOR + MINOR
CONFIG = LlamaConfig(dim=512, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=1536, vocab_size=512, seq_len=256)
"""Head dim 128 (512 / 4) with grouped-query attention (2 key/value heads), a sequence of two 128-token tiles."""
STEPS = 10
FP8_ATTENTION_REL_ERR = 0.10
"""Upper bound on ||FP8 attention - BF16 SDPA|| / ||BF16 SDPA|| on the same Q, K, V: TE rounds Q, K, V and the
probabilities to E4M3 (3 mantissa bits, ~2.5% rms each) and accumulates in FP32, so the output lands near 3-5%; twice
that bounds it."""
MIN_FP8_REL_ERR = 0.005
"""BF16 SDPA against itself differs by nothing; an error under this means no FP8 rounding happened."""
LOSS_GAP = 0.15
"""Largest per-step gap between the training losses (~6.2 at the start: ln 512) of one Llama with delayed FP8 linears
and FP8 attention and the same Llama with BF16 attention, from one seed, over STEPS steps on one batch: tighter than
the 0.2 test_te_backend.test_tiny_llama_trains allows FP8 against BF16 linears, as only the attention differs."""


@pytest.fixture(autouse=True)
def fresh_fp8_state():
    """TE keeps every delayed-scaling module's amax buffers in process-global state: drop them between tests."""
    yield
    FP8GlobalStateManager.reset()


def policy(fp8_attention: bool) -> PolicyConfig:
    return PolicyConfig(recipe="delayed", arch=ARCH, small_gemm_filter="off", fp8_attention=fp8_attention)


def build(fp8_attention: bool, compile: bool = False) -> nn.Module:
    """The BF16 Llama of CONFIG from seed 0, assembled under a delayed plan with or without FP8 attention."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(CONFIG).to(torch.bfloat16)
    return assemble(model, make_plan(model, policy(fp8_attention), seq_len=CONFIG.seq_len), compile=compile)


def tokens() -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), device="cuda", generator=generator)


def train_steps(model: nn.Module, batch: torch.Tensor, steps: int = STEPS) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = Llama.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def counted_calls(model: nn.Module) -> list[int]:
    """[calls so far] of the model's FP8 attention modules, all together (a forward hook on each)."""
    calls = [0]
    for module in model.modules():
        if isinstance(module, TEScaledDotProductAttention):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def assert_ran_tes_fused_fp8_attention() -> None:
    """TE's latest backend selection for DotProductAttention was its fused attention in FP8 (not flash, not unfused,
    not the BF16 fused kernel): TE selects it only with fp8_dpa under an FP8 autocast."""
    assert _attention_backends["use_fused_attention"], _attention_backends
    assert int(_attention_backends["fused_attention_backend"]) == int(FusedAttnBackend["FP8"]), _attention_backends


def test_the_plans_attention_cores_run_in_tes_fused_fp8_kernel():
    model = build(fp8_attention=True)
    (te_record,) = [r for r in assembly_state(model).conversions if r.backend == "te"]
    cores = [f"layers.{i}.attention.core" for i in range(CONFIG.n_layers)]
    assert {te_record.converted[core] for core in cores} == {"TEScaledDotProductAttention"}
    assert any(note.startswith("fp8_attention: 2 attention module(s)") for note in te_record.notes), te_record.notes
    attentions = [m for m in model.modules() if isinstance(m, TEScaledDotProductAttention)]
    assert len(attentions) == CONFIG.n_layers
    calls = counted_calls(model)
    batch = tokens()
    Llama.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
    assert calls == [CONFIG.n_layers]
    assert_ran_tes_fused_fp8_attention()
    assert all(a.fp8 and a.fp8_meta["recipe"].fp8_dpa for a in attentions)
    for layer in model.layers:  # gradients came back through TE's FP8 attention backward
        grad = layer.attention.wqkv.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_fp8_attention_is_within_fp8_rounding_of_bf16_sdpa():
    """One FP8 attention module of the assembled Llama against torch's SDPA in BF16 on the same Q, K, V (grouped
    query: 4 query heads, 2 key/value heads), causal."""
    model = build(fp8_attention=True)
    attention = model.layers[0].attention.te_fp8_attention
    generator = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, heads, CONFIG.seq_len, CONFIG.head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for heads in (CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.n_kv_heads))
    call = {"query": q, "key": k, "value": v, "is_causal": True, "enable_gqa": True}
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float()
        for _ in range(2):  # delayed scaling: the scales come from the previous calls' amaxes
            attention.sdpa(call)
        fp8 = attention.sdpa(call)
    assert fp8.shape == reference.shape and fp8.dtype == torch.bfloat16
    assert_ran_tes_fused_fp8_attention()
    rel = ((fp8.float() - reference).norm() / reference.norm()).item()
    assert MIN_FP8_REL_ERR < rel < FP8_ATTENTION_REL_ERR, rel


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_llama_trains_with_fp8_attention_close_to_bf16_attention(compiled):
    batch = tokens()
    fp8_attention = build(fp8_attention=True, compile=compiled)
    calls = counted_calls(fp8_attention)
    fp8_losses = train_steps(fp8_attention, batch)
    assert calls == [STEPS * CONFIG.n_layers], "every attention call of every step went to TE's FP8 attention"
    assert_ran_tes_fused_fp8_attention()
    bf16_losses = train_steps(build(fp8_attention=False, compile=compiled), batch)
    assert all(math.isfinite(loss) for loss in fp8_losses), fp8_losses
    assert fp8_losses[-1] < fp8_losses[0], f"FP8 attention did not learn: {fp8_losses}"
    gaps = [abs(f - b) for f, b in zip(fp8_losses, bf16_losses)]
    assert max(gaps) < LOSS_GAP, f"FP8 attention {fp8_losses} strays from BF16 attention {bf16_losses}"


class Net(nn.Module):
    """A user's model: one block whose attention module computes its core as `how` says."""

    def __init__(self, how: str):
        super().__init__()
        self.layers = nn.ModuleList([UserAttention(how)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class UserAttention(nn.Module):
    def __init__(self, how: str, heads: int = 2, head_dim: int = 128):
        super().__init__()
        self.how, self.n_heads, self.head_dim = how, heads, head_dim
        self.wqkv = nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, heads * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wqkv(x).view(batch, seq, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.how == "mask":
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.how == "dropout":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        elif self.how == "scale":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
        else:  # by hand, no SDPA call
            out = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


@pytest.mark.parametrize("how, message", [
    ("mask", "layers.0 calls F.scaled_dot_product_attention with an attn_mask tensor, and TE's FP8 attention takes "
             "causal or no mask only: pass is_causal=True"),
    ("dropout", "with dropout_p=0.1, and TE's fused FP8 attention has no dropout"),
    ("scale", "with scale=0.5, and its FP8 attention scales by 1/sqrt(head_dim)"),
    ("by hand", "layers.0's forward made no F.scaled_dot_product_attention call, so the plan's FP8 attention did not "
                "run"),
])
def test_attention_te_cannot_compute_in_fp8_is_refused_not_run_in_bf16(how, message):
    with torch.device("cuda"):
        net = Net(how).to(torch.bfloat16)
    description = describe_module(net, seq_len=256, name="net", trace=False)
    plan = make_plan(description, policy(True))
    assert plan.decision("layers.0.core").recipe == "delayed"
    net = assemble(net, plan)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        net(torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16))


def test_the_trainer_runs_fp8_attention_as_an_ab_arm_does():
    """The plain path as `fp8stack ab --attention bf16,fp8` runs its arm: llama-1b-like, blocks compiled (the default
    on CUDA), BF16 parameters with FP32 masters, delayed scaling primed before the first step."""
    result = train(from_overrides({
        "model.name": "llama-1b-like", "precision.recipe": "delayed", "precision.fp8_attention": True,
        "training.device": "cuda", "training.seq_len": 512, "training.micro_batch": 1, "training.global_batch": 1,
        "training.steps": 4, "training.eval_batches": 0, "logging.progress": False}))
    assert result.config["precision"]["fp8_attention"] is True
    assert all(math.isfinite(loss) for loss in result.losses), result.losses
    assert_ran_tes_fused_fp8_attention()


def test_megatron_trains_with_fp8_dot_product_attention():
    """--model-impl megatron: megatron's TE DotProductAttention runs under each layer's recipe with fp8_dpa
    (TransformerConfig.fp8_dot_product_attention)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # the trainer sets megatron's parallel state up itself
    result = train(from_overrides({
        "model.name": "llama-1b-like", "model.impl": "megatron", "precision.recipe": "delayed",
        "precision.backend": "te", "precision.fp8_attention": True, "training.device": "cuda",
        "training.seq_len": 512, "training.micro_batch": 1, "training.global_batch": 1, "training.steps": 4,
        "training.eval_batches": 0, "te.gradient_accumulation_fusion": False, "logging.progress": False}))
    assert all(math.isfinite(loss) for loss in result.losses), result.losses
    assert_ran_tes_fused_fp8_attention()
