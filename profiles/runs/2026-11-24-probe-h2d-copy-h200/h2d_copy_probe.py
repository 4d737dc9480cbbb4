"""Probe: does a host-to-device copy of a step's tokens block the host until the GPU has run what was queued before
it? Pageable against pinned memory, both with non_blocking=True, behind ~100 ms of queued GEMMs. Torch only.

Run from the project root on a GPU: python3 profiles/probes/h2d_copy_probe.py (evidence under profiles/probes/).
"""
import sys
import time

import torch

sys.path.insert(0, ".")
from fp8stack.bench.evidence import device_slug, markdown_table, write_evidence  # noqa: E402


def host_ms_of_copy(pinned: bool, queued: torch.Tensor) -> tuple[float, float]:
    """(ms the host spent in the copy call, ms of GPU work queued ahead of it) for one [16, 4097] int64 batch."""
    tokens = torch.randint(0, 256, (16, 4097))
    tokens = tokens.pin_memory() if pinned else tokens
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        queued @ queued
    end.record()
    began = time.perf_counter()
    tokens.to("cuda", non_blocking=True)
    host_ms = (time.perf_counter() - began) * 1000
    torch.cuda.synchronize()
    return host_ms, start.elapsed_time(end)


def main():
    queued = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    host_ms_of_copy(True, queued)
    results = {name: [host_ms_of_copy(pinned, queued) for _ in range(5)]
               for name, pinned in (("pageable", False), ("pinned", True))}
    rows = [[name, ", ".join(f"{h:.2f}" for h, _ in runs), ", ".join(f"{q:.1f}" for _, q in runs)]
            for name, runs in results.items()]
    markdown = markdown_table(["host memory", "host ms in .to(cuda, non_blocking=True)", "GPU ms queued before it"],
                              rows)
    write_evidence(f"h2d-copy-probe-{device_slug()}", {"runs": results}, markdown, "profiles/probes")
    print(markdown)


if __name__ == "__main__":
    main()
