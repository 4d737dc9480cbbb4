"""The plain-torch Llama and grouped-experts MoE on CPU: shapes, gradients, GQA, routing, init."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8stack.models import load_model_config
from fp8stack.models import Attention, GroupedExperts, Llama, LlamaConfig, MoE, MoEConfig
from fp8stack.models.llama import apply_rope, rope_table
from fp8stack.models.moe import permute

TINY_MOE = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=64)


def reference_experts(experts: GroupedExperts, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One SwiGLU per expert over its row group, in a Python loop."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        gate, up = (x_sorted[start:end] @ experts.w13[e].T).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ experts.w2[e].T)
        start = end
    return torch.cat(out)


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = moe.router(flat)
    out = torch.zeros_like(flat)
    w13, w2 = moe.experts.w13, moe.experts.w2
    for t in range(flat.shape[0]):
        for weight, e in zip(weights[t], chosen[t].tolist()):
            gate, up = (flat[t] @ w13[e].T).chunk(2)
            out[t] += weight * ((F.silu(gate) * up) @ w2[e].T)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view(x.shape)


class IdentityExperts(GroupedExperts):
    """Returns its input: the MoE then returns each token times the sum of its routing weights."""

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return x_sorted


@pytest.mark.parametrize("config", [load_model_config("tiny"), load_model_config("tiny-moe")], ids=["dense", "moe"])
def test_forward_backward(config):
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, config.vocab_size)
    loss = model.loss(logits[:, :-1], tokens[:, 1:])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # Near log(vocab) at init: the output init keeps logits small.
    assert abs(loss.item() - torch.log(torch.tensor(config.vocab_size)).item()) < 1.0
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_bf16_model_runs_and_autocast_reaches_grouped_mm():
    tokens = torch.randint(0, 256, (1, 16))
    model = Llama(load_model_config("tiny-moe"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens).dtype == torch.bfloat16
    model = model.to(torch.bfloat16)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    model.loss(logits, tokens).backward()


def test_causal():
    model = Llama(load_model_config("tiny"))
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_gqa_matches_repeated_kv_heads():
    config = load_model_config("tiny")
    attention = Attention(config)
    nn.init.normal_(attention.wqkv.weight, std=0.05)
    nn.init.normal_(attention.wo.weight, std=0.05)
    x = torch.randn(2, 12, config.dim)
    rope = rope_table(config.head_dim, 12, config.rope_theta)

    hd, groups = config.head_dim, config.n_heads // config.n_kv_heads
    q, k, v = attention.wqkv(x).split([config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd], -1)
    q = apply_rope(q.view(2, 12, -1, hd), rope).transpose(1, 2)
    k = apply_rope(k.view(2, 12, -1, hd), rope).transpose(1, 2).repeat_interleave(groups, dim=1)
    v = v.view(2, 12, -1, hd).transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    expected = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 12, -1))
    torch.testing.assert_close(attention(x, rope), expected, rtol=1e-4, atol=1e-5)


def test_rope_keeps_norms_and_position_zero():
    x = torch.randn(1, 5, 2, 16)
    rotated = apply_rope(x, rope_table(16, 5, 10000.0))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_rope_is_the_complex_rotation_by_position_times_frequency(traced):
    """Eager RoPE is a complex product; traced by torch.compile, real arithmetic: both rotate by the same angles."""
    x = torch.randn(2, 7, 3, 16)
    freqs = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    rotations = torch.polar(torch.ones(7, 8), torch.outer(torch.arange(7).float(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotations[:, None]).flatten(-2)
    rope = torch.compile(apply_rope, backend="eager", fullgraph=True) if traced else apply_rope
    torch.testing.assert_close(rope(x, rope_table(16, 7, 10000.0)), expected)
    assert rope(x.bfloat16(), rope_table(16, 7, 10000.0)).dtype == torch.bfloat16


@pytest.mark.parametrize("autocast", [True, False])
def test_residual_stream_runs_in_the_activation_dtype(autocast):
    """Under BF16 autocast every block gets (and returns) BF16, as the plan's embedding and norm rows say; the FP32
    table's lookup is cast once. Without autocast (FP32 activations) nothing is cast."""
    model = Llama(load_model_config("tiny"))
    seen = []
    for layer in model.layers:
        layer.register_forward_hook(lambda _, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(torch.randint(0, 256, (1, 16)))
    dtype = torch.bfloat16 if autocast else torch.float32
    assert seen == [(dtype, dtype)] * len(model.layers)


def test_init_is_seeded_and_leaves_global_rng_alone():
    config = load_model_config("tiny")
    torch.manual_seed(1)
    a = Llama(config)
    torch.manual_seed(2)
    b = Llama(config)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    b.init_weights(seed=1)
    assert torch.rand(1) == expected_draw
    assert not torch.equal(a.output.weight, b.output.weight)


def test_meta_build_then_init_matches_cpu_build():
    config = load_model_config("tiny-moe")
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    reference = Llama(config)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kwargs, message", [
    ({"n_heads": 6}, "divisible by n_heads"),
    ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"moe": TINY_MOE, "first_moe_layer": 4}, "first_moe_layer"),
])
def test_config_validation(kwargs, message):
    base = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=64, vocab_size=32, seq_len=16)
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**base, **kwargs})


def test_moe_config_validation():
    with pytest.raises(ValueError, match="score_func"):
        MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=8, score_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, expert_ffn_dim=8)


@pytest.mark.parametrize("alignment", [1, 8, 128])
def test_permutation_round_trip_with_identity_experts(alignment):
    moe = MoE(32, TINY_MOE)
    moe.experts = IdentityExperts(32, 64, 8)
    moe.experts.group_alignment = alignment
    moe.init_weights(0.02)
    x = torch.randn(3, 10, 32)
    weights, _ = moe.router(x.reshape(-1, 32))
    expected = x * weights.sum(-1).view(3, 10, 1)
    torch.testing.assert_close(moe(x), expected)


@pytest.mark.parametrize("alignment", [1, 8, 16])
def test_permute_groups_rows_by_expert(alignment):
    experts = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])
    perm = permute(experts, num_experts=5, alignment=alignment)
    offsets = perm.offsets.tolist()
    assert perm.offsets.dtype == torch.int32 and all(o % alignment == 0 for o in offsets)
    starts = [0, *offsets[:-1]]
    for slot, row in enumerate(perm.slot_row.tolist()):
        token, expert = divmod(slot, 2)
        assert perm.row_token[row] == token
        assert starts[experts[token, expert]] <= row < offsets[experts[token, expert]]
    counts = [e - s for s, e in zip(starts, offsets)]
    assert counts[1] == counts[4] == 0  # experts 1 and 4 get no tokens
    real_rows = set(perm.slot_row.tolist())
    assert all(perm.row_token[r] == 4 for r in range(len(perm.row_token)) if r not in real_rows)
    # Whole alignment tiles: a quantizer that cannot pad the buffer (TE's) reads it as it is.
    assert perm.row_token.numel() == -(-(8 + 5 * (alignment - 1)) // alignment) * alignment


class TokenPermutingExperts(GroupedExperts):
    """Experts that gather the expert-sorted rows from the tokens themselves, in BF16 as MoE does."""

    permutes_tokens = True

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
        self.received = (tuple(tokens.shape), tuple(row_token.shape))
        padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
        return super().forward(padded[row_token], offsets)


def test_experts_that_permute_the_tokens_take_them_from_the_moe():
    """permutes_tokens (grouped_fp8's FP8 dispatch) moves the permutation into the experts: they get the tokens and
    each row's token, and the layer computes what it computes with the rows permuted by the MoE, gradients too."""
    moe = MoE(32, TINY_MOE)
    moe.init_weights(0.02)
    x = torch.randn(2, 9, 32, requires_grad=True)
    grad = torch.randn_like(x)
    params = [x, moe.router.gate.weight, moe.experts.w13, moe.experts.w2]
    expected = moe(x)
    expected_grads = torch.autograd.grad(expected, params, grad)
    permuting = TokenPermutingExperts(32, 64, 8)
    permuting.w13, permuting.w2 = moe.experts.w13, moe.experts.w2
    moe.experts = permuting
    out = moe(x)
    alignment = permuting.group_alignment
    rows = -(-(18 * TINY_MOE.top_k + TINY_MOE.num_experts * (alignment - 1)) // alignment) * alignment
    assert permuting.received == ((18, 32), (rows,))
    assert torch.equal(out, expected)
    for got, want in zip(torch.autograd.grad(out, params, grad), expected_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_per_expert_loop(dtype):
    experts = GroupedExperts(32, 48, 4)
    experts.init_weights(0.02)
    experts = experts.to(dtype)
    x = torch.randn(20, 32, dtype=dtype)
    offsets = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 is empty
    tol = {"rtol": 2e-2, "atol": 1e-3} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(experts(x, offsets), reference_experts(experts, x, offsets), **tol)


@pytest.mark.parametrize("config", [TINY_MOE, MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=32, shared_ffn_dim=16,
                                                        score_func="sigmoid", route_norm=True)],
                         ids=["softmax-top2", "sigmoid-top1-shared"])
def test_moe_matches_per_token_reference(config):
    moe = MoE(32, config)
    moe.init_weights(0.02)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = moe(x)
    expected = reference_moe(moe, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, moe.experts.w13, moe.experts.w2], grad)
    want = torch.autograd.grad(expected, [x, moe.experts.w13, moe.experts.w2], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_experts_without_tokens():
    moe = MoE(32, TINY_MOE)
    moe.init_weights(0.02)
    with torch.no_grad():  # route every token to experts 0 and 1
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = moe.router.gate.weight[1, 0] = 1.0
    x = torch.randn(1, 6, 32)
    x[..., 0] = 5.0
    out = moe(x)
    torch.testing.assert_close(out, reference_moe(moe, x), rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    assert moe.experts.w13.grad[:2].abs().sum() > 0
    assert moe.experts.w13.grad[2:].abs().sum() == 0 and moe.experts.w2.grad[2:].abs().sum() == 0
    assert moe(x[:, :0]).shape == (1, 0, 32)


def _bf16_experts_and_rows() -> tuple[GroupedExperts, torch.Tensor, torch.Tensor]:
    """BF16 experts (as master weights leave them), 36 rows: groups of 8, 0, 16, 8, then 4 rows past the last."""
    torch.manual_seed(0)
    experts = GroupedExperts(32, 48, 4)
    experts.init_weights(0.02)
    return experts.bfloat16(), torch.randn(36, 32, dtype=torch.bfloat16), torch.tensor([8, 8, 24, 32]).int()


def _accumulate_into_main_grads(experts, forward, x, offsets, grads) -> list[torch.Tensor]:
    """Zeroed FP32 main_grads, wgrad_into_main_grad on, one backward of forward (experts, or experts compiled) per
    gradient in `grads`; the input gradients."""
    for weight in (experts.w13, experts.w2):
        weight.main_grad = torch.zeros(weight.shape)
    experts.wgrad_into_main_grad = True
    input_grads = []
    for grad in grads:
        leaf = x.clone().requires_grad_(True)
        forward(leaf, offsets).backward(grad)
        input_grads.append(leaf.grad)
    return input_grads


def test_grouped_experts_add_their_weight_gradients_into_main_grad():
    """With wgrad_into_main_grad (set by the bf16 backend under master weights) two micro-batches' weight gradients
    land in the FP32 main_grads: the FP32 sum of autograd's BF16 gradients bit for bit, an empty expert's zero; the
    weights get no .grad (nothing for a hook to add) and the input gradients are autograd's."""
    experts, x, offsets = _bf16_experts_and_rows()
    grads = [torch.randn(36, 32, dtype=torch.bfloat16) for _ in range(2)]
    weight_grads, input_grads = [], []
    for grad in grads:
        leaf = x.clone().requires_grad_(True)
        experts(leaf, offsets).backward(grad)
        weight_grads.append([experts.w13.grad.float(), experts.w2.grad.float()])
        input_grads.append(leaf.grad)
        experts.zero_grad(set_to_none=True)
    fused_input_grads = _accumulate_into_main_grads(experts, experts, x, offsets, grads)
    assert experts.w13.grad is None and experts.w2.grad is None
    for index, weight in enumerate((experts.w13, experts.w2)):
        assert torch.equal(weight.main_grad, weight_grads[0][index] + weight_grads[1][index])
        assert (weight.main_grad[1] == 0).all() and weight.main_grad.abs().sum() > 0
    for fused, autograd in zip(fused_input_grads, input_grads):
        assert torch.equal(fused[:32], autograd[:32])  # rows past the last group are unspecified


def test_main_grad_accumulation_survives_torch_compile():
    """The trainer compiles each block on CUDA: traced whole (fullgraph), the backward's in-place add into the main_grad
    still lands, as in eager."""
    experts, x, offsets = _bf16_experts_and_rows()
    grads = [torch.randn(36, 32, dtype=torch.bfloat16) for _ in range(2)]
    _accumulate_into_main_grads(experts, experts, x, offsets, grads)
    eager = [experts.w13.main_grad.clone(), experts.w2.main_grad.clone()]
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    _accumulate_into_main_grads(experts, compiled, x, offsets, grads)
    assert torch.equal(experts.w13.main_grad, eager[0]) and torch.equal(experts.w2.main_grad, eager[1])
