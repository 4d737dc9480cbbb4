"""Probe: the compiled attention glue of llama-1b-like (wqkv output -> split -> RoPE on q, k -> cuDNN SDPA), forward
and backward, with RoPE written four ways. Which one lets Inductor write the glue at memory speed? Torch only.

Run from the project root on a GPU: python3 profiles/probes/rope_glue_probe.py (evidence under profiles/probes/).
"""
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
from fp8stack.bench.evidence import device_slug, markdown_table, write_evidence  # noqa: E402
from fp8stack.models.llama import rope_table  # noqa: E402

B, S, H, H_KV, D = 2, 4096, 32, 8, 128


def rope_complex(x, rope):
    """The model's RoPE before this probe: a complex product (Inductor falls back to eager kernels)."""
    rotations = torch.complex(rope[..., 0], rope[..., 1])
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotations[:, None, :]).flatten(-2).type_as(x)


def rope_pairs(x, rope):
    """Real arithmetic on (even, odd) pairs, stacked back (the model's apply_rope at this probe)."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


def rope_swap(x, rope):
    """x * cos + swap_pairs(x) * (-sin, sin): elementwise over x's own layout, the pair partner by a flip."""
    cos = rope[..., 0].repeat_interleave(2, dim=-1)[:, None]
    sin = (rope[..., 1, None] * torch.tensor([-1.0, 1.0], device=rope.device)).flatten(-2)[:, None]
    xf = x.float()
    return (xf * cos + xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).type_as(x)


def glue(rope_fn, contiguous_heads, joint=False, separate=False):
    rope_fn = torch.compiler.disable(torch.compile(rope_fn)) if separate else rope_fn

    def forward(qkv, rope):
        if joint:  # q and k rotated as one tensor of H + H_KV heads, then split
            qk, v = qkv.split([(H + H_KV) * D, H_KV * D], dim=-1)
            q, k = rope_fn(qk.view(B, S, H + H_KV, D), rope).split([H, H_KV], dim=2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k, v = qkv.split([H * D, H_KV * D, H_KV * D], dim=-1)
            q = rope_fn(q.view(B, S, H, D), rope).transpose(1, 2)
            k = rope_fn(k.view(B, S, H_KV, D), rope).transpose(1, 2)
        v = v.view(B, S, H_KV, D).transpose(1, 2)
        if contiguous_heads:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, S, -1)
    return forward


VARIANTS = {"complex": (rope_complex, False), "pairs": (rope_pairs, False), "swap": (rope_swap, False),
            "pairs, BHSD copies": (rope_pairs, True), "swap, BHSD copies": (rope_swap, True),
            "pairs, q and k as one tensor": (rope_pairs, False, True),
            "pairs, RoPE compiled apart": (rope_pairs, False, False, True)}


def measure(name, rope, qkv, grad):
    fn = torch.compile(glue(*VARIANTS[name]))
    step = lambda: torch.autograd.backward(fn(qkv, rope), grad)  # noqa: E731
    for _ in range(5):
        step()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels[event.key] = event.device_time_total / 5 / 1000
    attention = sum(ms for k, ms in kernels.items() if "sdpa" in k or "cudnn" in k)
    return {"median_ms": statistics.median(times), "attention_kernels_ms": attention,
            "other_kernels_ms": sum(kernels.values()) - attention,
            "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def main():
    torch.manual_seed(0)
    rope = rope_table(D, S, 500000.0, device="cuda")
    qkv = torch.randn(B, S, (H + 2 * H_KV) * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    leaf = qkv.detach()[..., :H * D].clone().requires_grad_()
    q, seen = leaf.view(B, S, H, D).transpose(1, 2), []
    q.register_hook(lambda g: seen.append(list(g.stride())))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, q[:, :H_KV], q[:, :H_KV], is_causal=True, enable_gqa=True).sum().backward()
    grad_strides = {"q": list(q.stride()), "dq": seen[0]}
    x = qkv.detach()[..., :H * D].view(B, S, H, D)
    reference = rope_complex(x.float(), rope)
    agree = {n: (VARIANTS[n][0](x.float(), rope) - reference).abs().max().item() for n in ("pairs", "swap")}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        results = {name: measure(name, rope, qkv, grad) for name in VARIANTS}
    rows = [[name, f"{r['median_ms']:.3f}", f"{r['attention_kernels_ms']:.3f}", f"{r['other_kernels_ms']:.3f}",
             "; ".join(f"{k[:60]} {ms:.3f}" for k, ms in list(r["kernels_ms"].items())[:6])]
            for name, r in results.items()]
    markdown = ("Compiled attention glue of one llama-1b-like layer and micro-batch (B=2, S=4096, 32/8 heads of 128), "
                "forward + backward, cuDNN SDPA. Largest FP32 difference from the complex RoPE: "
                + ", ".join(f"{n} {v:.2e}" for n, v in agree.items()) + ".\n\n"
                + markdown_table(["RoPE", "fwd+bwd ms (median of 30)", "attention kernels ms", "other kernels ms",
                                  "largest kernels (ms per call)"], rows))
    markdown += f"\nStrides of a BSHD-laid-out q passed as [B, H, S, D] and of its gradient from cuDNN: {grad_strides}\n"
    payload = {"grad_strides": grad_strides, "shape": {"B": B, "S": S, "H": H, "H_KV": H_KV, "D": D}, "max_abs_diff_vs_complex": agree,
               "results": results}
    write_evidence(f"rope-glue-probe-{device_slug()}", payload, markdown, "profiles/probes")
    print(markdown)


if __name__ == "__main__":
    main()
