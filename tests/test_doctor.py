"""`fp8stack doctor` on a CPU machine: exit 0 with a clear report, what is missing and the command that installs it;
exit 1 only when fp8stack itself cannot work (torch missing or too old)."""

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from rich.console import Console

from fp8stack import doctor
from fp8stack.cli import main
from fp8stack.plan.recipes import RECIPES

REPO = Path(__file__).resolve().parents[1]
REPORTED = ("python", *(spec.name for spec in doctor.PACKAGES))
"""Every package row doctor prints."""
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a CUDA GPU")


def _doctor(capsys, *words: str) -> tuple[int, str]:
    code = main(["doctor", *words])
    return code, capsys.readouterr().out


def _doctor_json(capsys) -> tuple[int, dict]:
    code, out = _doctor(capsys, "--format", "json")
    return code, json.loads(out)


def _row(markdown: str, first_cell: str) -> str:
    """The Markdown table row whose first cell is `first_cell`."""
    return next(line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |"))


def _pretend_missing(monkeypatch, name: str) -> None:
    """Make the package imported as `name` look uninstalled: no import spec, no distribution metadata."""
    spec = next(s for s in doctor.PACKAGES if s.name == name)
    find_spec, version = importlib.util.find_spec, importlib.metadata.version

    def no_spec(module, *args, **kwargs):
        return None if module == name else find_spec(module, *args, **kwargs)

    def no_version(distribution):
        if distribution in spec.distributions:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return version(distribution)

    monkeypatch.setattr(importlib.util, "find_spec", no_spec)
    monkeypatch.setattr(importlib.metadata, "version", no_version)


def _pretend_version(monkeypatch, distribution: str, fake: str) -> None:
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake if name == distribution else version(name))


@on_cpu
def test_cpu_machine_exits_0_names_the_missing_gpu_and_every_package(capsys):
    code, out = _doctor(capsys)
    assert code == 0
    assert "no CUDA GPU" in out.split("## Packages")[0]
    for name in REPORTED:
        assert _row(out, name)
    assert _row(out, "torch").split(" | ")[1] == importlib.metadata.version("torch")
    assert "fp8stack works here" in out


@on_cpu
def test_recipe_table_says_why_blockwise_cannot_run_on_a_cpu(capsys):
    _, out = _doctor(capsys)
    row = _row(out, "blockwise")
    assert "| te | sm90+ | no |" in row
    assert "no CUDA GPU: blockwise needs an sm90+ GPU" in row
    assert "| tensorwise | torchao | sm89+ | yes |" in out  # torchao's CPU GEMMs run the CPU demo


def test_json_has_the_documented_keys(capsys):
    code, report = _doctor_json(capsys)
    assert code == 0 and report["works"] is True and report["problems"] == []
    assert set(report) == {f.name for f in dataclasses.fields(doctor.Report)} | {"works"}
    assert set(report["cuda"]) == {f.name for f in dataclasses.fields(doctor.Cuda)}
    assert [p["name"] for p in report["packages"]] == list(REPORTED)
    for kind, cls in (("packages", doctor.Package), ("backends", doctor.BackendRun), ("recipes", doctor.RecipeRun),
                      ("gpus", doctor.Gpu)):
        for entry in report[kind]:
            assert set(entry) == {f.name for f in dataclasses.fields(cls)}, kind
    assert [(r["recipe"], r["backend"]) for r in report["recipes"]] == [
        (r.name, b) for r in RECIPES.values() for b in r.dense_backends]
    assert {b["name"] for b in report["backends"]} == {"te", "torchao", "grouped_fp8", "bf16"}
    assert report["fp8stack"] == importlib.metadata.version("fp8stack")


@on_cpu
def test_json_on_a_cpu_machine(capsys):
    _, report = _doctor_json(capsys)
    assert report["gpus"] == [] and report["cuda"]["available"] is False
    assert report["cuda"]["problem"].startswith("no CUDA GPU")
    blockwise = next(r for r in report["recipes"] if r["recipe"] == "blockwise")
    assert blockwise["runs"] is False and "no CUDA GPU" in blockwise["reason"]
    assert next(b for b in report["backends"] if b["name"] == "bf16")["runs"] is True


INSTALLS = {
    "transformer_engine": "pip install 'fp8stack[te]'",
    "megatron.core": "pip install 'fp8stack[megatron]'",
    "deep_gemm": "launch/build_deepgemm.sh",
    "tensorboard": "pip install 'fp8stack[tb]'",
    "matplotlib": "pip install 'fp8stack[plot]'",
}
"""Optional package -> the command pyproject.toml's extras (or the build script) install it with."""


@pytest.mark.parametrize("name", INSTALLS)
def test_missing_optional_package_shows_not_installed_and_its_install_command(capsys, monkeypatch, name):
    _pretend_missing(monkeypatch, name)
    code, out = _doctor(capsys, "--format", "markdown")
    assert code == 0, "a missing optional package is not an error"
    row = _row(out, name)
    assert f"| {name} | - | not installed |" in row
    assert INSTALLS[name] in row.split(" | ")[-1]


def test_missing_te_names_its_install_in_the_te_backend_and_recipe_rows(capsys, monkeypatch):
    _pretend_missing(monkeypatch, "transformer_engine")
    _, out = _doctor(capsys, "--format", "markdown")
    for row in (_row(out, "te"), _row(out, "delayed")):
        assert "| no |" in row and "TransformerEngine is not installed" in row
        assert row.endswith("| pip install 'fp8stack[te]' |")


def test_megatron_on_a_python_it_does_not_install_on(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "PACKAGES", tuple(
        dataclasses.replace(s, min_python=(99, 0)) if s.name == "megatron.core" else s for s in doctor.PACKAGES))
    _pretend_missing(monkeypatch, "megatron.core")
    _, out = _doctor(capsys, "--format", "markdown")
    assert _row(out, "megatron.core").endswith(
        f"| pip install 'fp8stack[megatron]' under Python >= 99.0 (this is {platform.python_version()}) |")


def test_a_package_that_fails_to_import_shows_the_error_in_one_line(capsys, monkeypatch):
    import_module = importlib.import_module

    def broken(name, *args):
        if name == "matplotlib":
            raise ImportError("libfreetype.so.6: cannot open shared object file:\n  No such file or directory")
        return import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", broken)
    code, report = _doctor_json(capsys)
    assert code == 0
    matplotlib = next(p for p in report["packages"] if p["name"] == "matplotlib")
    assert matplotlib["status"] == "unusable"
    assert matplotlib["problem"] == (
        "matplotlib is installed but fails to import (ImportError: libfreetype.so.6: cannot open shared object file: "
        "No such file or directory): reinstall it with pip install 'fp8stack[plot]'")


def test_torch_older_than_the_lower_bound_exits_1(capsys, monkeypatch):
    bound = _bound("torch")
    _pretend_version(monkeypatch, "torch", "2.0.0")
    code, out = _doctor(capsys, "--format", "markdown")
    assert code == 1
    assert f"torch 2.0.0 is older than fp8stack needs ({bound})" in _row(out, "torch")
    assert f"fp8stack cannot work here: torch: torch 2.0.0 is older than fp8stack needs ({bound}) " \
           f"(pip install -U '{bound}')" in out


def test_missing_torch_exits_1_and_still_reports(capsys, monkeypatch):
    _pretend_missing(monkeypatch, "torch")
    code, report = _doctor_json(capsys)
    assert code == 1 and report["works"] is False
    assert report["problems"] == [f"torch: torch is not installed (pip install '{_bound('torch')}')"]
    assert report["backends"] == [] and report["recipes"] == []
    assert {p["status"] for p in report["packages"][2:] if p["version"]} == {"not checked"}


def test_missing_torchao_exits_1_it_is_a_core_dependency(capsys, monkeypatch):
    _pretend_missing(monkeypatch, "torchao")
    code, report = _doctor_json(capsys)
    assert code == 1
    assert report["problems"] == [f"torchao: torchao is not installed (pip install '{_bound('torchao')}')"]
    assert report["backends"] == [] and report["recipes"] == []


def _bound(distribution: str) -> Requirement:
    """fp8stack's installed requirement on `distribution`."""
    return next(r for r in map(Requirement, importlib.metadata.requires("fp8stack")) if r.name == distribution)


def test_rich_table_prints_install_commands_verbatim(monkeypatch):
    _pretend_missing(monkeypatch, "tensorboard")
    out = io.StringIO()
    doctor.render_rich(doctor.diagnose(), Console(file=out, force_terminal=True, width=250, no_color=True))
    text = out.getvalue()
    for title in ("Packages", "Backends", "Recipes"):
        assert title in text
    assert "pip install 'fp8stack[tb]'" in text  # '[tb]' is text, not rich markup


def test_bad_format_exits_2_with_one_line(capsys):
    assert main(["doctor", "--format", "html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --format: invalid choice: 'html'" in err


def test_package_table_matches_pyproject():
    """Each package's extra installs it, and exactly the core dependencies are marked required."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}
    for spec in doctor.PACKAGES:
        names = {canonicalize_name(d) for d in spec.distributions}
        assert spec.required == bool(names & core), spec.name
        if spec.extra:
            extra = {canonicalize_name(Requirement(line).name)
                     for line in project["optional-dependencies"][spec.extra]}
            assert names & extra, f"fp8stack[{spec.extra}] does not install {spec.name}"


def test_importing_doctor_loads_neither_torch_nor_te():
    done = subprocess.run([sys.executable, "-c", "import sys, fp8stack.doctor; "
                           "print(sorted({'torch', 'transformer_engine'} & set(sys.modules)))"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@on_cpu
def test_installed_te_without_cuda_says_it_needs_a_gpu(tmp_path):
    """A TransformerEngine that is installed but cannot run here: TE's own diagnosis, its version from metadata."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    info = tmp_path / "transformer_engine-2.20.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.20.0\n")
    done = subprocess.run([sys.executable, "-m", "fp8stack", "doctor", "--format", "json"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    te = next(p for p in report["packages"] if p["name"] == "transformer_engine")
    assert (te["version"], te["status"], te["install"]) == ("2.20.0", "unusable", "")
    assert te["problem"].startswith("TransformerEngine needs CUDA")
    blockwise = next(r for r in report["recipes"] if r["recipe"] == "blockwise")
    assert blockwise["reason"].startswith("no CUDA GPU: blockwise needs an sm90+ GPU; TransformerEngine needs CUDA")


def test_installed_console_script(tmp_path):
    script = Path(sys.executable).with_name("fp8stack")
    if not script.exists():
        pytest.skip(f"no fp8stack console script beside {sys.executable}: install fp8stack (make venv)")
    done = subprocess.run([str(script), "doctor"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"# fp8stack {importlib.metadata.version('fp8stack')} doctor")
    for name in REPORTED:
        assert _row(done.stdout, name)
    assert "## Recipes" in done.stdout
