"""`fp8stack doctor` on a GPU: it names the GPU and its arch, the CUDA stack and TransformerEngine's version, and
reports the recipes this GPU runs as runnable. Run with `pytest -m gpu tests/gpu/test_doctor_gpu.py`."""

import importlib.metadata
import json

import pytest
import torch
from gpu_skips import require_te

require_te(["delayed", "tensorwise", "blockwise"])  # skips without CUDA, or on a GPU where TE cannot run these

from fp8stack.cli import main  # noqa: E402
from fp8stack.plan import RECIPES, parse_arch  # noqa: E402

pytestmark = pytest.mark.gpu


def _report(capsys) -> dict:
    assert main(["doctor", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_names_the_gpu_its_arch_and_the_cuda_stack(capsys):
    report = _report(capsys)
    assert report["works"] is True
    major, minor = torch.cuda.get_device_capability(0)
    first = report["gpus"][0]
    assert (first["name"], first["arch"]) == (torch.cuda.get_device_name(0), f"sm{major}{minor}")
    assert parse_arch(first["arch"]) >= 90
    assert len(report["gpus"]) == torch.cuda.device_count()
    cuda = report["cuda"]
    assert cuda["available"] is True and cuda["problem"] == ""
    assert cuda["runtime"] == torch.version.cuda
    # torch checks the cuDNN it loads against its build once: where another (TE's) loaded first, doctor reports the
    # mismatch that check raised, and later reads return the loaded version
    assert cuda["cudnn"] == str(torch.backends.cudnn.version()) or cuda["cudnn"].startswith(
        "unusable: cuDNN version incompatibility")
    assert cuda["driver"] and cuda["driver_cuda"], "the NVIDIA driver's release and CUDA version"


def test_doctor_lists_te_and_reports_delayed_tensorwise_blockwise_runnable(capsys):
    report = _report(capsys)
    te = next(p for p in report["packages"] if p["name"] == "transformer_engine")
    assert (te["status"], te["version"]) == ("ok", importlib.metadata.version("transformer_engine"))
    runs = {(r["recipe"], r["backend"]): r for r in report["recipes"]}
    for pair in (("delayed", "te"), ("tensorwise", "te"), ("tensorwise", "torchao"), ("blockwise", "te")):
        assert runs[pair]["runs"] is True and runs[pair]["reason"] == "", pair
    arch = torch.cuda.get_device_capability(0)
    mxfp8 = runs[("mxfp8", "te")]
    if arch[0] * 10 + arch[1] < RECIPES["mxfp8"].min_arch:
        assert mxfp8["runs"] is False and f"needs sm{RECIPES['mxfp8'].min_arch}+" in mxfp8["reason"]
    backends = {b["name"]: b["runs"] for b in report["backends"]}
    assert backends["te"] and backends["torchao"] and backends["bf16"]


def test_doctor_table_names_the_gpu(capsys):
    assert main(["doctor", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    gpu_section = out.split("## Packages")[0]
    major, minor = torch.cuda.get_device_capability(0)
    assert f"| 0 | {torch.cuda.get_device_name(0)} | sm{major}{minor} |" in gpu_section
    assert "no CUDA GPU" not in gpu_section
