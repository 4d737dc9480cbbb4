"""Evidence files: every GPU claim is written by the code that measured it, with where and how.

write_evidence() puts a JSON file (payload + environment + date + exact command + git commit and whether
the tree was dirty) and a Markdown file (a header naming the same, then the caller's table) in the run's own folder,
profiles/runs/<date>-<stem>/ (run_folder), beside the figure a tool draws there, and a copy of the
folder under $OUT/runs/ when $OUT is set (the folder a lent GPU machine sends back, so the copy drops
into profiles/ as it is). Each file is written whole (a temporary file renamed into place) and an
existing one is replaced only when the caller says so: a tool claims its files before measuring
(claim_evidence, refused without --force) and then rewrites them as often as it likes. A run measured
again later gets a new folder; profiles/archive/ keeps the runs a later one superseded, and
`python -m fp8stack.bench.results` writes profiles/INDEX.md and profiles/RESULTS.md from the folders.

The JSON is indented as json.dumps(indent=2) writes it, except that a list of scalars takes one line, and so does
each record of a list of flat records (evidence_json): a 2000-step loss curve is one line, not 2000, and a step's
routing statistics one line, not one per layer and statistic. A figure is a PNG with a palette (palette_png), a
third of the bytes of matplotlib's own: the working tree a lent GPU machine receives is capped at 64 MiB, and the
evidence is most of it.
`python -m fp8stack.evidence --compact PATH...` rewrites files written before in these layouts, their content
unchanged (a figure's colours aside, each drawn from a palette of PNG_COLORS).

A library module above train (it checks folders as the trainer does): the tools (ab, profile, bench) write
through it, nothing below them imports it.
"""

import argparse
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from fp8stack.config import ConfigError
from fp8stack.train.preflight import check_output_dir

PACKAGES = {
    "transformer_engine": ("transformer-engine", "transformer-engine-torch"),
    "torchao": ("torchao",),
    "megatron_core": ("megatron-core",),
    "deep_gemm": ("deep-gemm", "deepinfer-gemm", "sgl-deep-gemm"),  # launch/build_deepgemm.sh: deepinfer-gemm
    "triton": ("triton",),
}
"""Reported name -> installed distribution names tried in order (read from metadata: importing TE
without CUDA fails, and metadata is what pip installed)."""


def _installed(distributions: tuple[str, ...]) -> str | None:
    for dist in distributions:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """Device, compute capability and the versions of the FP8 stack (None when not installed)."""
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: _installed(dists) for name, dists in PACKAGES.items()},
    }


def device_slug(device: str | None = None) -> str:
    """A short file-name tag for the device: 'NVIDIA H100 80GB HBM3' -> 'h100', no GPU -> 'cpu'."""
    name = (device if device is not None else environment()["device"]).removeprefix("NVIDIA ")
    model = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name)
    return (model.group(1) if model else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown").lower()


def command_line() -> str:
    """How this process was started, as a shell line: `python -m pkg.mod args` when run with -m,
    prefixed with PYTHONPATH when set (the GPU machines load the FP8 stack from it)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        argv = [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    else:
        argv = [sys.executable, *sys.argv]
    path = os.environ.get("PYTHONPATH")
    return (f"PYTHONPATH={shlex.quote(path)} " if path else "") + shlex.join(argv)


def provenance() -> dict:
    """When, how and on what code this process measured: the UTC date, the exact command line, the git commit and
    whether the tree had uncommitted changes."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
            "commit": commit(), "dirty": dirty()}


REPOSITORY = Path(__file__).resolve().parents[1]
"""The checkout this module runs from (where git is asked for the commit)."""


def _git(*args: str) -> str | None:
    """git's output in REPOSITORY, None outside a checkout (a tree copied without .git, git not installed)."""
    try:
        return subprocess.run(["git", *args], cwd=REPOSITORY, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def commit() -> str | None:
    """The git commit measured: $FP8STACK_COMMIT (set where the tree travels without .git, as to a GPU machine), else
    the checkout's HEAD; None outside a checkout."""
    if os.environ.get("FP8STACK_COMMIT"):
        return os.environ["FP8STACK_COMMIT"]
    head = _git("rev-parse", "HEAD")
    return head.strip() if head else None


DIRTY_VALUES = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
"""What $FP8STACK_DIRTY may say (case-insensitive)."""


def dirty() -> bool | None:
    """The measured tree had changes not in its commit: $FP8STACK_DIRTY (1/0, set beside $FP8STACK_COMMIT where the tree
    travels without .git), else whether `git status --porcelain` lists anything; None when neither can tell."""
    flag = os.environ.get("FP8STACK_DIRTY")
    if flag:
        if flag.strip().lower() not in DIRTY_VALUES:
            raise EvidenceError(f"FP8STACK_DIRTY={flag!r}: set it to 1 (uncommitted changes) or 0 (a clean tree)")
        return DIRTY_VALUES[flag.strip().lower()]
    if os.environ.get("FP8STACK_COMMIT"):
        return None  # the commit was named from outside: this tree's git status says nothing about it
    status = _git("status", "--porcelain")
    return None if status is None else bool(status.strip())


def describe_commit(record: dict) -> str:
    """The commit of an evidence record and whether its tree was dirty, as one line (records older than the dirty
    field say it inside the commit, or not at all)."""
    if not record.get("commit"):
        return "not recorded"
    if "dirty" not in record:
        return record["commit"]
    state = {True: "dirty", False: "clean", None: "dirty: not recorded"}[record["dirty"]]
    return f"{record['commit']} ({state})"


EVIDENCE_SUFFIXES = (".json", ".md")
"""The files write_evidence writes per stem."""

RUNS = "runs"
"""The folder, under an evidence folder (profiles/), of the current runs: one <date>-<slug>/ folder per run."""

ARCHIVE = "archive"
"""The folder, beside RUNS, of the runs a later run of the same kind, model, device and arms superseded."""

_run_folders: dict[tuple[Path, str], Path] = {}
"""(evidence folder, stem) -> the run folder this process chose: fixed at the first call."""


def run_folder(stem: str, out_dir: str | Path = "profiles") -> Path:
    """The folder this process's evidence named `stem` goes in: <out_dir>/runs/<UTC date>-<stem>/, the date taken at
    the first call, so that a run which passes midnight keeps one folder for its JSON, Markdown and figure."""
    key = (Path(out_dir).resolve(), stem)
    if key not in _run_folders:
        _run_folders[key] = Path(out_dir) / RUNS / f"{datetime.now(timezone.utc).date().isoformat()}-{stem}"
    return _run_folders[key]


def latest_evidence(stem: str, out_dir: str | Path = "profiles") -> Path:
    """The newest current run's <stem>.json under <out_dir>/runs/ (run folders sort by their date), else the path this
    process would write it to (which does not exist)."""
    found = sorted((Path(out_dir) / RUNS).glob(f"*/{stem}.json"))
    return found[-1] if found else run_folder(stem, out_dir) / f"{stem}.json"


def device_copy(path: str | Path) -> Path | None:
    """Where the copy of the evidence file `path` goes under $OUT: $OUT/runs/<its run folder>/<its name>, the layout
    of profiles/; None when $OUT is not set."""
    path = Path(path)
    return Path(os.environ["OUT"]) / RUNS / path.parent.name / path.name if os.environ.get("OUT") else None


class EvidenceError(ValueError):
    """Evidence that cannot be written where asked (a file it would replace, a folder it cannot write in)."""


def add_force_option(parser: argparse.ArgumentParser) -> None:
    """The --force flag of a tool writing evidence."""
    parser.add_argument("--force", action="store_true", help="replace evidence files of the same name")


def claim_evidence(stem: str, out_dir: str | Path = "profiles", force: bool = False,
                   suffixes: tuple[str, ...] = EVIDENCE_SUFFIXES) -> None:
    """Before measuring: refuse (EvidenceError) when out_dir cannot be written in, or when this run's folder
    (run_folder) holds <stem> with one of `suffixes` and not `force`; afterwards the tool writes with
    write_evidence(..., replace=True)."""
    try:
        check_output_dir(out_dir, "the evidence folder")
    except ConfigError as err:
        raise EvidenceError(str(err)) from None
    folder = run_folder(stem, out_dir)
    existing = [str(path) for path in (folder / f"{stem}{suffix}" for suffix in suffixes) if path.exists()]
    if existing and not force:
        raise EvidenceError(f"{', '.join(existing)} exist{'s' if len(existing) == 1 else ''}: pass --force to replace "
                            "that evidence, or write elsewhere (--out-dir, --label)")


def claim_or_exit(prog: str, stem: str, out_dir: str | Path, force: bool) -> None:
    """claim_evidence for a tool's main: a refusal ends the process with one line and exit code 2."""
    try:
        claim_evidence(stem, out_dir, force)
    except EvidenceError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def write_evidence(stem: str, payload: dict, markdown: str, out_dir: str | Path = "profiles",
                   replace: bool = False) -> tuple[Path, Path]:
    """Write <stem>.json and .md in this run's folder under out_dir (run_folder; copies under $OUT, replaced there);
    returns the two paths.
    replace: replace existing files (claimed with claim_evidence); without it an existing file is an EvidenceError,
    raised before anything is written."""
    if not replace:
        claim_evidence(stem, out_dir)
    meta = {**provenance(), "environment": environment()}
    clash = set(meta) & set(payload)
    if clash:
        raise ValueError(f"payload keys {sorted(clash)} are reserved for the evidence header: rename them")
    record = {**meta, **payload}
    text_json = evidence_json(record)
    text_md = _header(stem, record) + markdown.rstrip() + "\n"
    json_path, md_path = run_folder(stem, out_dir) / f"{stem}.json", run_folder(stem, out_dir) / f"{stem}.md"
    for path, text in ((json_path, text_json), (md_path, text_md)):
        for target in filter(None, (path, device_copy(path))):
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_whole(target, text)
    return json_path, md_path


def evidence_json(record) -> str:
    """The text of an evidence JSON file holding `record`: dicts, and lists holding a dict or a list, indented two
    spaces a level as json.dumps(indent=2) writes them, a list of scalars (numbers, strings, booleans, null) on one
    line, and in a list of flat records (non-empty dicts of scalars) each record on a line of its own. A value json
    cannot encode is written as its str() (json's default=str); json.loads of the text equals
    json.loads(json.dumps(record, indent=2, default=str)), floats in json's own repr, NaN and infinities included."""
    return _layout(json.loads(json.dumps(record, default=str)), "") + "\n"


def _layout(value, indent: str) -> str:
    """A value as json.loads returns it, as evidence_json lays it out, its lines after the first starting `indent`."""
    inner = indent + "  "
    if isinstance(value, list) and value and all(_flat_record(item) for item in value):
        return "[\n" + ",\n".join(inner + json.dumps(item) for item in value) + f"\n{indent}]"
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(key)}: {_layout(item, inner)}" for key, item in value.items()]
    elif isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        items = [inner + _layout(item, inner) for item in value]
    else:  # a scalar, an empty dict or list, or a list of scalars: one line
        return json.dumps(value)
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return f"{opening}\n" + ",\n".join(items) + f"\n{indent}{closing}"


def _flat_record(value) -> bool:
    """A non-empty dict whose values are all scalars: a row of a table, or one step of a per-step series."""
    return isinstance(value, dict) and bool(value) and not any(isinstance(v, (dict, list)) for v in value.values())


PNG_COLORS = 256
"""Colours a figure's PNG keeps (palette_png): the benches' line and bar plots use a few colours and their
anti-aliased edges, which a palette of 256 keeps, at about a third of the bytes of matplotlib's RGBA file."""


def palette_png(data: bytes) -> bytes:
    """A PNG re-encoded with a palette of at most PNG_COLORS colours (median cut, no dithering), or `data` itself
    where it is a palette image already or Pillow (which matplotlib installs) is missing."""
    try:
        from PIL import Image
    except ImportError:
        return data
    image = Image.open(io.BytesIO(data))
    if image.mode == "P":
        return data
    out = io.BytesIO()
    image.convert("RGB").quantize(PNG_COLORS, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, "PNG", optimize=True)
    return out.getvalue()


def compact(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """Rewrite JSON files in evidence_json's layout and PNG figures with a palette (palette_png; a folder: every
    *.json and *.png under it), a JSON only when its parsed content stays the same, key order, number types and float
    values included, a PNG only when the palette makes it smaller; returns (the files rewritten, 'path: why' for each
    file left as it was: one that does not parse, or a JSON whose content would change)."""
    rewritten, untouched = [], []
    found = [file for path in map(Path, paths)
             for file in (sorted([*path.rglob("*.json"), *path.rglob("*.png")]) if path.is_dir() else [path])]
    for path in found:
        if path.suffix == ".png":
            if _compact_png(path, untouched):
                rewritten.append(path)
            continue
        try:
            text = path.read_text()
            record = json.loads(text)
        except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
            untouched.append(f"{path}: {err}")
            continue
        new = evidence_json(record)
        if json.dumps(json.loads(new)) != json.dumps(record):
            untouched.append(f"{path}: its content would change")
        elif new != text:
            _write_whole(path, new)
            rewritten.append(path)
    return rewritten, untouched


def _compact_png(path: Path, untouched: list[str]) -> bool:
    """Rewrite the PNG at `path` with a palette where that makes it smaller (True); a file Pillow cannot read goes
    to `untouched` with the reason."""
    try:
        data = path.read_bytes()
        smaller = palette_png(data)
    except (OSError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        untouched.append(f"{path}: {err}")
        return False
    if len(smaller) >= len(data):
        return False
    _write_whole(path, smaller)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8stack.evidence",
                                     description="Rewrite evidence files in the layouts write_evidence and the "
                                                 "figures write.")
    parser.add_argument("--compact", nargs="+", type=Path, required=True, metavar="PATH",
                        help="JSON and PNG files, or folders of them (every *.json and *.png under each), to rewrite: "
                             "a JSON in evidence_json's layout (lists of scalars and flat records on one line each), "
                             "only when its parsed content stays the same; a PNG with a palette of 256 colours, only "
                             "when that is smaller")
    args = parser.parse_args(argv)
    rewritten, untouched = compact(args.compact)
    print(f"rewrote {len(rewritten)} file(s)")
    for line in untouched:
        print(f"left as it was: {line}", file=sys.stderr)
    return 1 if untouched else 0


def _write_whole(path: Path, content: str | bytes) -> None:
    """`content` into `path` through a temporary file renamed over it: a reader never sees half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(content) if isinstance(content, bytes) else partial.write_text(content)
    os.replace(partial, path)


def _header(stem: str, record: dict) -> str:
    """The Markdown header naming the device, versions, date and command of an evidence record."""
    env = record["environment"]
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in env.items()
                         if k not in ("device", "compute_capability"))
    return (f"# {stem}\n\n"
            f"- device: {env['device']} (compute capability {env['compute_capability'] or '-'})\n"
            f"- versions: {versions}\n- date: {record['date']}\n- command: `{record['command']}`\n"
            f"- commit: {describe_commit(record)}\n\n")


def rerender(json_path: str | Path, render: Callable[[dict], str]) -> Path:
    """Rewrite the .md beside an evidence JSON from its record, its header unchanged (the measuring run's device,
    date and command): for a table added to a renderer after the GPU run that measured it, or a .md that did not
    come back from the device."""
    json_path = Path(json_path)
    record = json.loads(json_path.read_text())
    md_path = json_path.with_suffix(".md")
    _write_whole(md_path, _header(json_path.stem, record) + render(record).rstrip() + "\n")
    return md_path


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
