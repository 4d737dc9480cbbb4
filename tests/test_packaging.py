"""The built wheel: fp8stack.patches and the model configs inside the package, no top-level `patches`, core
dependencies without the extras; installed into a fresh venv that sees only the core dependencies, it plans, runs
the torchao path and names the extra to install for what is missing. The editable install of the test venv provides
fp8stack.patches and no `patches` either."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from email.message import Message
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

import fp8stack

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "fp8stack", "patches", "configs")
"""What the wheel is built from (copied, so that the build leaves nothing in the checkout)."""
EXTRAS = {"te", "gpu", "megatron", "deepgemm", "tb", "plot", "test", "all"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, cwd=source)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = dist.glob("fp8stack-*.whl")
    return built


def wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return HeaderParser().parsestr(archive.read(name).decode())


def core_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply without any extra."""
    requirements = [Requirement(r) for r in wheel_metadata(wheel).get_all("Requires-Dist")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({**default_environment(), "extra": ""})]


def test_the_wheel_installs_patches_and_configs_inside_the_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {n.split("/")[0] for n in names} == {"fp8stack", f"fp8stack-{fp8stack.__version__}.dist-info"}
    packaged = {str(Path(n).parent) for n in names if n.endswith("/__init__.py")}
    in_repo = {str(p.parent.relative_to(REPO)) for p in (REPO / "fp8stack").rglob("__init__.py")}
    assert packaged == in_repo | {"fp8stack/patches"}
    for folder in ("patches", "configs/models", "configs/recipes"):
        for path in (REPO / folder).glob("*.py" if folder == "patches" else "*.yaml"):
            assert f"fp8stack/{path.relative_to(REPO)}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_wheel_declares_core_dependencies_and_extras(wheel):
    info = wheel_metadata(wheel)
    assert info["Version"] == fp8stack.__version__
    assert set(info.get_all("Provides-Extra")) == EXTRAS
    core = {r.name: str(r.specifier) for r in core_requirements(wheel)}
    assert core == {"torch": ">=2.11", "torchao": ">=0.18", "pyyaml": ">=6", "rich": ">=13", "packaging": ">=23"}


def distributions_needed(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions `requirements` need, their own requirements (with the extras asked for) included."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(r, frozenset({""})) for r in requirements]
    while pending:
        requirement, extras_of_requirer = pending.pop()
        if requirement.marker and not any(requirement.marker.evaluate({**default_environment(), "extra": e})
                                          for e in extras_of_requirer):
            continue
        dist = metadata.distribution(requirement.name)
        extras = frozenset({"", *requirement.extras})
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        found[key] = dist
        pending += [(Requirement(r), extras) for r in dist.requires or ()]
    return list(found.values())


def top_level_paths(dist: metadata.Distribution) -> set[Path]:
    """The distribution's top-level modules, packages and .dist-info folder in its site-packages."""
    paths = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            paths.add(Path(dist.locate_file(first)))
    return paths


@pytest.fixture(scope="module")
def core_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed and, through a .pth file, only the core dependencies of this venv:
    a folder of links to their top-level modules, so nothing is downloaded."""
    root = tmp_path_factory.mktemp("core-venv")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    links = root / "core-dependencies"
    links.mkdir()
    for dist in distributions_needed(core_requirements(wheel)):
        for path in top_level_paths(dist):
            if not (links / path.name).exists():
                (links / path.name).symlink_to(path)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "core-dependencies.pth").write_text(f"{links}\n")
    return root / "venv"


def run_in(venv_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    """argv in the venv, from a folder outside the checkout and without PYTHONPATH: only what it installed counts."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, capture_output=True, text=True, cwd=venv_dir.parent, env=env, timeout=300)


CORE_SCRIPT = textwrap.dedent("""
    import importlib.util, json
    import torch
    import fp8stack
    import fp8stack.cli, fp8stack.train.loop  # the tools import without the extras
    from fp8stack.backends.te import TEBackend
    from fp8stack.models import Llama, load_model_config
    from fp8stack.patches import apply_all
    from fp8stack.config import from_overrides
    from fp8stack.train.model import model_config
    from fp8stack.train.preflight import preflight

    logged = from_overrides({"logging.dir": "logs"})

    plan = fp8stack.make_plan(fp8stack.load_description("llama-1b-like"), fp8stack.PolicyConfig(recipe="tensorwise"))
    tiny = fp8stack.make_plan(fp8stack.load_description("tiny"),
                              fp8stack.PolicyConfig(recipe="tensorwise", small_gemm_filter="off"))
    model = fp8stack.assemble(Llama(load_model_config("tiny")), tiny)
    with torch.backends.mkldnn.flags(enabled=False):  # torch's FP8 emulation on a CPU, as the trainer runs it
        model(torch.randint(0, 256, (2, 64)))[0].float().sum().backward()
    failures = {"te": TEBackend().available()[1]}
    for name, attempt in (("megatron", lambda: __import__("fp8stack.megatron")),
                          ("model_impl megatron", lambda: from_overrides({"model.impl": "megatron"})),
                          ("tensorboard", lambda: preflight(logged, model_config(logged)))):
        try:
            attempt()
        except Exception as err:
            failures[name] = f"{type(err).__name__}: {err}"
    print(json.dumps({
        "fp8stack": fp8stack.__file__,
        "fp8_decisions": sum(d.recipe == "tensorwise" for d in plan.decisions),
        "converted": sorted({type(m).__name__ for m in model.modules()} & {"Float8Linear"}),
        "patches": apply_all(),
        "top_level_patches": importlib.util.find_spec("patches") is not None,
        "megatron_core": importlib.util.find_spec("megatron") is not None,
        "failures": failures,
    }))
""")


def test_the_wheel_plans_and_runs_torchao_with_core_dependencies_only(core_venv):
    done = run_in(core_venv, str(core_venv / "bin" / "python"), "-c", CORE_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["fp8stack"].startswith(str(core_venv))
    assert report["fp8_decisions"] > 0 and report["converted"] == ["Float8Linear"]
    assert set(report["patches"].values()) == {"skipped: megatron-core is not installed",
                                               "skipped: transformer-engine is not installed"}
    assert not report["top_level_patches"] and not report["megatron_core"]
    failures = report["failures"]
    assert "pip install 'fp8stack[te]'" in failures["te"]
    for name, error, extra in (("megatron", "ModuleNotFoundError", "megatron"),
                               ("model_impl megatron", "ConfigError", "megatron"),
                               ("tensorboard", "ConfigError", "tb")):
        assert failures[name].startswith(error) and f"pip install 'fp8stack[{extra}]'" in failures[name]


def test_the_installed_commands_print_the_version(core_venv):
    version = run_in(core_venv, str(core_venv / "bin" / "python"), "-c",
                     "from importlib.metadata import version; print(version('fp8stack'))").stdout.strip()
    assert version == fp8stack.__version__
    for argv in ([str(core_venv / "bin" / "fp8stack"), "--version"],
                 [str(core_venv / "bin" / "python"), "-m", "fp8stack.train", "--version"]):
        done = run_in(core_venv, *argv)
        assert (done.returncode, done.stdout) == (0, f"fp8stack {version}\n"), done.stderr[-2000:]


def test_the_editable_install_has_no_top_level_patches(tmp_path):
    script = "import importlib.util, fp8stack.patches as p; print(p.__file__, importlib.util.find_spec('patches'))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert done.stdout.split() == [str(REPO / "patches" / "__init__.py"), "None"]
