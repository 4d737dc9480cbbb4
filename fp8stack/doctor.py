"""`fp8stack doctor`: what this machine runs. The GPUs and their arch, the CUDA driver and runtime, the versions of the
libraries fp8stack uses, which recipes and backends run here, and for each that does not, why and the command that
installs what is missing.

Missing optional pieces are not errors: the exit code is 1 only when fp8stack itself cannot work (Python, torch or
torchao missing, broken or older than fp8stack's lower bounds), else 0. `--format json` prints Report.as_dict():
fp8stack, gpus, cuda, packages, backends, recipes, problems and works, each documented on its dataclass.

Nothing here imports torch or an optional library at import time: each is probed inside a function, TransformerEngine
first (it must load its cuDNN before torch loads its own), so that doctor reports a broken stack instead of failing.
"""

import argparse
import contextlib
import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from fp8stack import __version__
from fp8stack.plan import PlanError, PolicyConfig
from fp8stack.plan.recipes import BACKEND_LABELS, RECIPES, Recipe, expert_paths

OK, NOT_INSTALLED, TOO_OLD, UNUSABLE, NOT_CHECKED = "ok", "not installed", "too old", "unusable", "not checked"
"""A package's status in the report."""
CPU_NOTE = "on CPU: torch's emulated FP8 GEMMs, for tests and demos (no speed-up)"
"""How an FP8 recipe runs without a GPU, where its backend allows it."""


@dataclass(frozen=True)
class PackageSpec:
    """A library doctor reports on, and how to get it."""

    name: str
    """Import name."""
    distributions: tuple[str, ...]
    """Distribution names its version may be installed under, tried in order."""
    used_for: str
    """What fp8stack needs it for."""
    required: bool = False
    """fp8stack cannot work without it (a core dependency in pyproject.toml)."""
    extra: str = ""
    """The fp8stack extra that installs it ('' for a core dependency or one pip cannot install)."""
    install: str = ""
    """The install command when no extra installs it."""
    min_python: tuple[int, int] | None = None
    """The oldest Python it installs on, when newer than fp8stack's own."""
    backend: str = ""
    """The fp8stack backend it implements, if any."""
    probe: Callable[[], str] | None = None
    """'' when it is usable here, else why in one line with the fix; None: importing it is the check."""


def _te_problem() -> str:
    """TransformerEngine is usable when fp8stack's TE backend can load it (a cuDNN load-order failure included)."""
    from fp8stack.backends.te import TEBackend

    return TEBackend().available()[1]


def _deepgemm_problem() -> str:
    """DeepGEMM is usable when fp8stack's adapter finds the functions it calls."""
    from fp8stack.backends import deepgemm

    return deepgemm.load()[1]


PACKAGES = (
    PackageSpec("torch", ("torch",), "everything", required=True),
    # Probed right after torch: TE must load before anything loads torch's cuDNN.
    PackageSpec("transformer_engine", ("transformer_engine", "transformer-engine"),
                "TransformerEngine modules: the te backend", extra="te", backend="te", probe=_te_problem),
    PackageSpec("torchao", ("torchao",), "Float8Linear: the torchao backend", required=True, backend="torchao"),
    PackageSpec("megatron.core", ("megatron-core",), "fp8stack.megatron, --model-impl megatron, the Megatron benches",
                extra="megatron", min_python=(3, 12)),
    PackageSpec("deep_gemm", ("deepinfer-gemm", "deep_gemm", "deep-gemm"),
                "DeepGEMM kernels for blockwise experts and --blockwise-gemms deepgemm (else torch's scaled GEMMs)",
                install="launch/build_deepgemm.sh (in the fp8stack repository; needs nvcc 12.9+ and GCC 13+)",
                probe=_deepgemm_problem),
    PackageSpec("tensorboard", ("tensorboard",), "--tensorboard-dir", extra="tb"),
    PackageSpec("matplotlib", ("matplotlib",), "the A/B's figure", extra="plot"),
)
"""The libraries doctor reports on, in probe order."""


@dataclass
class Package:
    """One library (or Python itself) as found here."""

    name: str
    """Import name ('python' for the interpreter)."""
    version: str | None
    """Installed version (its distribution's); None when not installed or installed without metadata."""
    status: str
    """ok, not installed, too old, unusable (installed, but it fails to import or cannot run here: `problem` says
    why), or not checked (torch, which it needs, is unusable)."""
    required: bool
    """fp8stack cannot work without it."""
    used_for: str
    """What fp8stack needs it for."""
    problem: str = ""
    """Why it is not ok, in one line ('' when ok)."""
    install: str = ""
    """The command that installs or upgrades it ('' when ok, or when the problem line names the fix)."""


@dataclass
class Gpu:
    """One CUDA device."""

    index: int
    """CUDA device index."""
    name: str
    """Device name."""
    arch: str
    """Compute capability as smXY."""
    memory_gib: float
    """Total device memory, GiB."""


@dataclass
class Cuda:
    """The CUDA stack."""

    available: bool
    """torch sees a CUDA GPU."""
    runtime: str | None
    """The CUDA runtime torch was built with (torch.version.cuda); None: a CPU-only torch."""
    driver: str | None
    """The NVIDIA driver release; None: no driver found."""
    driver_cuda: str | None
    """The newest CUDA version the driver supports; None: no driver found."""
    cudnn: str | None
    """The cuDNN version torch loads; None without a GPU."""
    problem: str = ""
    """Why no CUDA GPU is usable, and what to do ('' when one is)."""


@dataclass
class BackendRun:
    """Whether one fp8stack backend runs here."""

    name: str
    """The plan's backend name."""
    label: str
    """What it is."""
    recipes: list[str]
    """Recipes it runs dense linears for."""
    expert_recipes: list[str]
    """Recipes whose MoE expert GEMMs it runs."""
    runs: bool
    """It can run here."""
    reason: str = ""
    """Why it cannot ('' when it can)."""
    install: str = ""
    """The command that installs what it lacks ('' when nothing to install helps)."""


@dataclass
class RecipeRun:
    """Whether one recipe runs here on one of its dense backends."""

    recipe: str
    """Recipe name."""
    backend: str
    """Backend running its dense linears."""
    min_arch: str
    """The oldest GPU arch the plan allows it on."""
    runs: bool
    """It can run here."""
    reason: str = ""
    """Why it cannot, or how it runs without a GPU ('' on a GPU that runs it)."""
    install: str = ""
    """The command that installs what it lacks ('' when nothing to install helps)."""


@dataclass
class Report:
    """Everything `fp8stack doctor` found."""

    fp8stack: str
    """fp8stack's version."""
    gpus: list[Gpu]
    """CUDA devices torch sees (empty on a CPU machine)."""
    cuda: Cuda
    """The CUDA driver and runtime."""
    packages: list[Package]
    """Python, then the libraries of PACKAGES."""
    backends: list[BackendRun]
    """Every fp8stack backend (empty when fp8stack cannot work here)."""
    recipes: list[RecipeRun]
    """Every FP8 recipe on each of its dense backends (empty when fp8stack cannot work here)."""
    problems: list[str] = field(default_factory=list)
    """What stops fp8stack itself from working here; empty: it works (exit 0)."""

    def as_dict(self) -> dict:
        """The report with `works`: whether fp8stack works here."""
        return {**asdict(self), "works": not self.problems}


def add_doctor_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `doctor` subcommand to an argparse subparsers object; it runs run_doctor(args)."""
    parser = subparsers.add_parser(
        "doctor", help="what this machine runs: GPU, CUDA, library versions, recipes and backends, what to install",
        description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                        help="table: a rich table on a terminal, Markdown when piped; json: the report as a dict "
                             "(default: table)")
    parser.set_defaults(run=run_doctor)
    return parser


def run_doctor(args: argparse.Namespace) -> int:
    """`fp8stack doctor`: print the report; 1 when fp8stack itself cannot work here, else 0."""
    report = diagnose()
    if args.format == "json":
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print_report(report, markdown=args.format == "markdown")
    return 1 if report.problems else 0


def diagnose() -> Report:
    """Probe this machine. Libraries' prints go to stderr and their import warnings are muted, so that stdout holds
    the report alone."""
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bounds = _fp8stack_requirements()
        packages, torch_ok = [_python(bounds)], True
        for spec in PACKAGES:  # torch first: the others are checked only when it works
            packages.append(_package(spec, bounds, torch_ok))
            if spec.name == "torch":
                torch_ok = packages[-1].status == OK
        by_name = {p.name: p for p in packages}
        gpus, cuda = _cuda(torch_ok, by_name["torch"])
        # A required package not checked (torch is broken) is not a problem of its own.
        problems = [f"{p.name}: {p.problem}" + (f" ({p.install})" if p.install else "")
                    for p in packages if p.required and p.status not in (OK, NOT_CHECKED)]
        if problems:  # the backends cannot even load
            return Report(__version__, gpus, cuda, packages, [], [], problems)
        arch = _arch(gpus)
        backends = _backends(by_name)
        recipes = [_recipe_run(r, b, arch, by_name) for r in RECIPES.values() for b in r.dense_backends]
    return Report(__version__, gpus, cuda, packages, backends, recipes)


def _fp8stack_requirements() -> dict[str, Requirement | SpecifierSet]:
    """Canonical distribution name -> fp8stack's requirement on it (core and extras), 'python' -> Requires-Python;
    empty when fp8stack's metadata is missing (a source tree that was never installed)."""
    try:
        lines = importlib.metadata.requires("fp8stack") or []
        requires_python = importlib.metadata.metadata("fp8stack").get("Requires-Python")
    except importlib.metadata.PackageNotFoundError:
        return {}
    bounds: dict[str, Requirement | SpecifierSet] = {}
    for line in lines:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        bounds.setdefault(canonicalize_name(requirement.name), requirement)
    if requires_python:
        bounds["python"] = SpecifierSet(requires_python)
    return bounds


def _python(bounds: dict) -> Package:
    version = platform.python_version()
    wanted = bounds.get("python")
    if wanted is not None and not wanted.contains(version, prereleases=True):
        return Package("python", version, TOO_OLD, True, "everything", f"fp8stack needs Python {wanted}",
                       f"a Python {wanted}")
    return Package("python", version, OK, True, "everything")


def _package(spec: PackageSpec, bounds: dict, torch_ok: bool) -> Package:
    """Whether `spec` is installed, recent enough and usable here."""
    requirement = next((bounds[canonicalize_name(d)] for d in spec.distributions if canonicalize_name(d) in bounds),
                       None)
    if not _find_spec(spec.name):
        return Package(spec.name, None, NOT_INSTALLED, spec.required, spec.used_for, f"{spec.name} is not installed",
                       _install_command(spec, requirement))
    version = _installed_version(spec)
    package = Package(spec.name, version, OK, spec.required, spec.used_for)
    if requirement is not None and version is not None and not _satisfies(version, requirement):
        package.status, package.problem = TOO_OLD, f"{spec.name} {version} is older than fp8stack needs ({requirement})"
        package.install = _install_command(spec, requirement, upgrade=True)
        return package
    if not torch_ok and spec.name != "torch":
        package.status, package.problem = NOT_CHECKED, "needs torch, which is unusable here"
        return package
    problem = _one_line(spec.probe() if spec.probe else _import_problem(spec, requirement))
    if problem:
        package.status, package.problem = UNUSABLE, problem
    return package


def _installed_version(spec: PackageSpec) -> str | None:
    """The installed distribution's version (not the module's __version__: megatron.core's appends the commit of
    whatever git checkout holds the environment)."""
    for distribution in spec.distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _find_spec(name: str) -> bool:
    """Whether `name` can be found for import (a dotted name's parent is imported to look)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # the parent package is missing or broken
        return False


def _satisfies(version: str, requirement: Requirement) -> bool:
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:  # a build without a PEP 440 version: cannot judge, so do not complain
        return True


def _install_command(spec: PackageSpec, requirement: Requirement | None, upgrade: bool = False) -> str:
    """The command that installs (or upgrades) `spec` for fp8stack."""
    flag = "-U " if upgrade else ""
    if spec.extra:
        command = f"pip install {flag}'fp8stack[{spec.extra}]'"
    elif spec.install:
        command = spec.install
    else:
        command = f"pip install {flag}'{requirement.name}{requirement.specifier}'" if requirement \
            else f"pip install {flag}{spec.distributions[0]}"
    if spec.min_python and sys.version_info[:2] < spec.min_python:
        wanted = ".".join(map(str, spec.min_python))
        return f"{command} under Python >= {wanted} (this is {platform.python_version()})"
    return command


def _import_problem(spec: PackageSpec, requirement: Requirement | None) -> str:
    try:
        importlib.import_module(spec.name)
    except Exception as err:  # a missing native library surfaces as OSError, RuntimeError, ...
        return (f"{spec.name} is installed but fails to import ({type(err).__name__}: {err}): reinstall it with "
                f"{_install_command(spec, requirement)}")
    return ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cuda(torch_ok: bool, torch_package: Package) -> tuple[list[Gpu], Cuda]:
    """The GPUs torch sees and the CUDA stack."""
    driver, driver_cuda = _driver_release(), _driver_cuda_version()
    if not torch_ok:
        return [], Cuda(False, None, driver, driver_cuda, None, f"not checked: {torch_package.problem}")
    import torch

    runtime = torch.version.cuda
    if not torch.cuda.is_available():
        return [], Cuda(False, runtime, driver, driver_cuda, None, _no_gpu_problem(runtime, driver_cuda))
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(Gpu(index, props.name, f"sm{props.major}{props.minor}", round(props.total_memory / 2**30, 1)))
    # This loads torch's cuDNN, hence after TE's probe (TE must load its own first).
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError as err:  # a second cuDNN loaded first (TE's, or LD_LIBRARY_PATH's) that torch cannot use
        cudnn = f"unusable: {' '.join(str(err).split())}"
    return gpus, Cuda(True, runtime, driver, driver_cuda, None if cudnn is None else str(cudnn))


def _no_gpu_problem(runtime: str | None, driver_cuda: str | None) -> str:
    if runtime is None:
        return "no CUDA GPU: this torch is a CPU-only build; on a GPU machine install a CUDA build of torch"
    if driver_cuda is None:
        oldest = min(r.min_arch for r in RECIPES.values())
        return f"no CUDA GPU: no NVIDIA driver found (libcuda.so.1); FP8 recipes need an NVIDIA GPU (sm{oldest}+)"
    if Version(driver_cuda) < Version(runtime):
        return (f"no CUDA GPU usable: the driver supports CUDA {driver_cuda}, this torch needs CUDA {runtime}: "
                "update the NVIDIA driver or install a torch built for the driver's CUDA")
    return "no CUDA GPU: the driver sees none (check CUDA_VISIBLE_DEVICES and nvidia-smi)"


def _driver_release() -> str | None:
    """The NVIDIA driver release from NVML, without importing anything that needs CUDA."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        text = ctypes.create_string_buffer(96)
        return text.value.decode() if nvml.nvmlSystemGetDriverVersion(text, len(text)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def _driver_cuda_version() -> str | None:
    """The newest CUDA version the installed driver supports (cuDriverGetVersion), e.g. '12.8'."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _arch(gpus: list[Gpu]) -> int | None:
    """The current CUDA device's SM version, as the backends and the plan see it; None without a GPU."""
    if not gpus:
        return None
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _backends(packages: dict[str, Package]) -> list[BackendRun]:
    from fp8stack.backends import available_backends

    runs = []
    for backend in available_backends():
        name = backend.name
        ok, why = backend().available()
        runs.append(BackendRun(
            name, BACKEND_LABELS.get(name, "modules left as they are"),
            [r.name for r in RECIPES.values() if name in r.dense_backends],
            _expert_recipes(name),
            ok, _one_line(why), "" if ok else _missing_installs(name, packages)))
    return runs


def _expert_recipes(backend: str) -> list[str]:
    """Recipes whose MoE expert GEMMs the plan may give `backend`, over every dense backend."""
    return [r.name for r in RECIPES.values()
            if any(path[0] == backend for dense in r.dense_backends for path in expert_paths(r, dense))]


def _missing_installs(backend: str, packages: dict[str, Package]) -> str:
    """The install commands of the libraries `backend` needs that are missing or too old here."""
    needed = [packages[spec.name] for spec in PACKAGES if spec.backend == backend]
    return "; ".join(p.install for p in needed if p.status in (NOT_INSTALLED, TOO_OLD) and p.install)


def _recipe_run(recipe: Recipe, backend: str, arch: int | None, packages: dict[str, Package]) -> RecipeRun:
    """Whether `recipe` runs on `backend` here: the plan's arch rule for this GPU, then the backend's own check."""
    run = RecipeRun(recipe.name, backend, f"sm{recipe.min_arch}", runs=False)
    if arch is not None:
        try:
            PolicyConfig(recipe=recipe.name, backend=backend, arch=arch)
        except PlanError as err:
            run.reason = _one_line(str(err))
            return run
    from fp8stack.backends import backend_class

    ok, why = backend_class(backend)().available([recipe.name])
    if ok:
        run.runs, run.reason = True, "" if arch is not None else CPU_NOTE
        return run
    no_gpu = [] if arch is not None else [f"no CUDA GPU: {recipe.name} needs an sm{recipe.min_arch}+ GPU"]
    run.reason = "; ".join([*no_gpu, _one_line(why)])
    run.install = _missing_installs(backend, packages)
    return run


def print_report(report: Report, markdown: bool = False) -> None:
    """Rich tables on a terminal (unless `markdown`), Markdown elsewhere."""
    from rich.console import Console

    console = Console(highlight=False)
    if markdown or not console.is_terminal:
        print(render_markdown(report), end="")
        return
    render_rich(report, console)


def sections(report: Report) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """(title, header, rows, lines after the table) for each part of the report, shared by both renderings."""
    cuda = report.cuda
    stack = [f"CUDA runtime (torch): {cuda.runtime or 'none (CPU-only torch)'}; "
             f"driver: {cuda.driver or 'none'} (CUDA {cuda.driver_cuda or '-'}); cuDNN: {cuda.cudnn or '-'}"]
    gpu_lines = stack if cuda.available else [cuda.problem, *stack]
    gpus = [[str(g.index), g.name, g.arch, f"{g.memory_gib:g}"] for g in report.gpus]
    packages = [[p.name, p.version or "-", p.status, p.used_for, p.problem, p.install] for p in report.packages]
    backends = [[b.name, _yes_no(b.runs), ", ".join(b.recipes) or "-", ", ".join(b.expert_recipes) or "-",
                 b.reason, b.install] for b in report.backends]
    recipes = [[r.recipe, r.backend, f"{r.min_arch}+", _yes_no(r.runs), r.reason, r.install] for r in report.recipes]
    not_checked = ["not checked: fp8stack cannot work here (the last lines say why)"] if report.problems else []
    verdict = ([f"fp8stack cannot work here: {problem}" for problem in report.problems] or
               ["fp8stack works here; what is missing above is optional (its install command beside it)"])
    return [
        ("GPU", ["#", "GPU", "arch", "memory (GiB)"], gpus, gpu_lines),
        ("Packages", ["package", "version", "status", "used for", "problem", "install"], packages, []),
        ("Backends", ["backend", "runs here", "dense recipes", "expert recipes", "why not", "install"], backends,
         not_checked),
        ("Recipes", ["recipe", "backend", "needs", "runs here", "why not / how", "install"], recipes,
         [*not_checked, *verdict]),
    ]


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def render_markdown(report: Report) -> str:
    """The report as GitHub Markdown."""
    out = [f"# fp8stack {report.fp8stack} doctor"]
    for title, header, rows, lines in sections(report):
        out += ["", f"## {title}"]
        if rows:
            out += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        out += [""] * bool(lines) + lines
    return "\n".join(out) + "\n"


def render_rich(report: Report, console) -> None:
    """The report as rich tables on `console`."""
    from rich.table import Table
    from rich.text import Text

    console.print(f"fp8stack {report.fp8stack} doctor", style="bold")
    for title, header, rows, lines in sections(report):
        if rows:
            table = Table(*header, title=title, title_justify="left")
            for row in rows:  # Text, not markup: '[te]' in an install command is not a style
                table.add_row(*map(Text, row))
            console.print(table)
        else:
            console.print(title, style="bold")
        for line in lines:
            console.print(line, markup=False)
