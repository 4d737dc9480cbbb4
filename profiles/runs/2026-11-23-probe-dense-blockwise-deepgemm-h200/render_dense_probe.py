"""Renders dense-blockwise-deepgemm-probe-h200.json (written by dense_blockwise_deepgemm_probe.py) as Markdown:
`python profiles/probes/render_dense_probe.py > profiles/probes/dense-blockwise-deepgemm-probe-h200.md`."""
import json
from pathlib import Path

rows = json.loads((Path(__file__).parent / "dense-blockwise-deepgemm-probe-h200.json").read_text())["rows"]
print("| linear | GEMM | TE cuBLAS ms | DeepGEMM ms | TE TF/s | DeepGEMM TF/s | DeepGEMM speedup | TE vs DeepGEMM rel. diff |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['shape']} {r['N']}x{r['K']} | {r['gemm']} | {r['te_ms']:.4f} | {r['dg_ms']:.4f} | {r['te_tflops']:.0f} "
          f"| {r['dg_tflops']:.0f} | {r['speedup']:.3f} | {r['te_vs_dg_rel']} |")
layers = [r for r in rows if r["shape"] != "head"]
te, dg = sum(r["te_ms"] for r in layers), sum(r["dg_ms"] for r in layers)
print(f"\nOne block's twelve GEMMs (head excluded): TE {te:.3f} ms, DeepGEMM {dg:.3f} ms; x 32 (4 layers x 8 "
      f"micro-batches) {te * 32:.1f} vs {dg * 32:.1f} ms per step.")
