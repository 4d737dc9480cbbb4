"""Every command's options, generated from the configuration tree: `--section.field value` for each field of each
section, with the field's docstring and default as its help, the flags users know from Megatron, torchao and
earlier fp8stack releases as aliases, and `--config FILE|PRESET` (TOML or JSON) read first.

A value given on the command line overrides the file's, which overrides the dataclass default. Underscores and
hyphens are the same in a flag's name (`--training.micro_batch` = `--training.micro-batch`).
"""

import argparse
import ast
import inspect
import json
import sys
import textwrap
import tomllib
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from fp8stack.config.job import (ACTIVATION_DTYPES, DATA_PARALLEL, DATA_SOURCES, DEVICES, MODEL_IMPLS, OPTIMIZER_MOMENTS,
                                 ConfigError, JobConfig)
from fp8stack.plan import PlanError, PolicyConfig, load_recipe_file
from fp8stack.plan.description import CONFIGS_DIR
from fp8stack.plan.expert_speeds import GROUPED_KERNELS
from fp8stack.plan.policy import SMALL_GEMM_CHOICES, Override
from fp8stack.plan.recipes import (BACKEND_PREFERENCES, BF16, BLOCKWISE_GEMMS, EXPERT_BACKENDS, EXPERT_QUANTIZERS,
                                   FP8_FORMATS, PARAM_DTYPES, RECIPES, WGRAD_FLATTENS, parse_arch, recipe_name)

CHOICES: dict[str, tuple[str, ...]] = {
    "model.impl": MODEL_IMPLS,
    "precision.recipe": (BF16, *RECIPES),
    "precision.fp8_format": FP8_FORMATS,
    "precision.backend": BACKEND_PREFERENCES,
    "precision.small_gemm_filter": SMALL_GEMM_CHOICES,
    "precision.expert_backend": ("auto", *EXPERT_BACKENDS),
    "precision.grouped_kernels": GROUPED_KERNELS,
    "te.blockwise_gemms": BLOCKWISE_GEMMS,
    "grouped_fp8.quantizer": EXPERT_QUANTIZERS,
    "grouped_fp8.wgrad_flatten": WGRAD_FLATTENS,
    "training.device": DEVICES,
    "training.dtype": ACTIVATION_DTYPES,
    "training.param_dtype": PARAM_DTYPES,
    "optimizer.moments": OPTIMIZER_MOMENTS,
    "parallelism.data_parallel": DATA_PARALLEL,
    "data.source": DATA_SOURCES,
}
"""Field -> the values its flag accepts (shown in --help); other names the field's validate() refuses."""

ALIASES: dict[str, tuple[str, ...]] = {
    "model.name": ("--model",),
    "model.impl": ("--model-impl",),
    "model.factory": ("--model-factory",),
    "model.fused_projections": ("--fused-projections",),
    "precision.recipe": ("--fp8-recipe", "--recipe"),
    "precision.fp8_format": ("--fp8-format",),
    "precision.backend": ("--backend",),
    "precision.first_last_layers_bf16": ("--first-last-layers-bf16",),
    "precision.num_layers_at_start_in_bf16": ("--num-layers-at-start-in-bf16",),
    "precision.num_layers_at_end_in_bf16": ("--num-layers-at-end-in-bf16",),
    "precision.small_gemm_filter": ("--small-gemm-filter",),
    "precision.expert_backend": ("--expert-backend",),
    "precision.head_on_te": ("--head-on-te",),
    "precision.fuse_norm": ("--fuse-norm",),
    "precision.fuse_mlp": ("--fuse-mlp",),
    "precision.arch": ("--arch",),
    "precision.fp8_attention": ("--fp8-dot-product-attention",),
    "te.delayed_margin": ("--fp8-margin",),
    "te.gradient_accumulation_fusion": ("--gradient-accumulation-fusion",),
    "te.blockwise_gemms": ("--blockwise-gemms",),
    "torchao.fsdp_float8_all_gather": ("--fsdp-float8-all-gather",),
    "torchao.precompute_fp8_scales": ("--precompute-fp8-scales",),
    "training.steps": ("--train-iters", "--steps"),
    "training.micro_batch": ("--micro-batch-size", "--micro-batch"),
    "training.global_batch": ("--global-batch-size",),
    "training.seq_len": ("--seq-length", "--seq-len"),
    "training.seed": ("--seed",),
    "training.device": ("--device",),
    "training.dtype": ("--dtype",),
    "training.param_dtype": ("--param-dtype",),
    "training.compile": ("--compile",),
    "training.sdpa_backend": ("--sdpa-backend",),
    "training.eval_batches": ("--eval-iters",),
    "optimizer.lr": ("--lr",),
    "optimizer.min_lr": ("--min-lr",),
    "optimizer.warmup": ("--lr-warmup-iters",),
    "optimizer.weight_decay": ("--weight-decay",),
    "optimizer.grad_clip": ("--clip-grad",),
    "optimizer.distributed": ("--use-distributed-optimizer",),
    "parallelism.tensor_parallel": ("--tensor-model-parallel-size",),
    "parallelism.expert_parallel": ("--expert-model-parallel-size",),
    "parallelism.data_parallel": ("--data-parallel",),
    "parallelism.data_parallel_one_rank": ("--data-parallel-one-rank", "--parallelism.fsdp-one-rank",
                                           "--fsdp-one-rank"),
    "activation_checkpoint.layers": ("--recompute-layers",),
    "activation_checkpoint.compress": ("--compress-activations",),
    "data.source": ("--data-source",),
    "data.max_bytes": ("--max-data-bytes",),
    "data.factory": ("--data",),
    "checkpoint.dir": ("--save",),
    "checkpoint.interval": ("--save-interval",),
    "checkpoint.resume": ("--load",),
    "checkpoint.trust": ("--trust-checkpoint",),
    "checkpoint.resume_despite_changes": ("--resume-despite-changes",),
    "logging.dir": ("--tensorboard-dir",),
    "logging.interval": ("--log-interval",),
    "logging.progress": ("--progress",),
    "logging.fp8_stats_interval": ("--fp8-stats-interval",),
    "logging.profile_collectives": ("--profile-collectives",),
}
"""Field -> the short flags it also answers to: Megatron's names where Megatron has the option, torchao's
and fp8stack's earlier ones elsewhere. A command's own sections may add theirs (add_section_arguments)."""

RETIRED: dict[str, str] = {
    "--warmup": "LR warm-up is --optimizer.warmup (--lr-warmup-iters); a profile's unprofiled steps are "
                "--profile.warmup-steps",
    "--fp8-recompute": "recompute is --activation-checkpoint.layers all --activation-checkpoint.modules MODULE...; it "
                       "now applies to every arm of an A/B, the BF16 ones included",
}
"""Flags that no longer exist -> where their meaning went (a use of them is refused with this pointer)."""

USAGE_ERROR = 2
"""Exit code for bad input (argparse's convention)."""

MEGATRON_SELECTIVE_DEFAULT = ("core_attn",)
"""What Megatron recomputes under --recompute-granularity selective without --recompute-modules."""
PRESETS = CONFIGS_DIR / "presets"
"""Where the named configurations `--config NAME` loads live (configs/presets/NAME.toml)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line, 'fp8stack: error: <problem and fix>', like every other
    fp8stack error."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"fp8stack: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def run_command(prog: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None) -> int:
    """One subcommand on its own (`python -m fp8stack.ab ...`): its parser, then run(args); the exit code."""
    parser = OneLineParser(prog=prog, usage="%(prog)s [options]")
    add_arguments(parser)
    try:
        args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    except SystemExit as done:  # --help printed, or a usage error already reported in one line
        return done.code if isinstance(done.code, int) else 0
    return run(args)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def sections(root: type = JobConfig) -> dict[str, type]:
    """Section name -> its dataclass, in the tree's order."""
    return {f.name: _section_class(f) for f in fields(root)}


DERIVED_FIELDS = ("precision.arch", "precision.overrides")
"""Fields a run sets itself (the GPU's arch) or takes from elsewhere (--recipe-file), not flags of train/ab/profile."""


def add_config_arguments(parser: argparse.ArgumentParser, only: Sequence[str] | None = None,
                         skip: Sequence[str] = DERIVED_FIELDS) -> None:
    """`--config` and every field of JobConfig's sections (those in `only`, if given) as `--section.field` with its
    aliases; the values land in the namespace under their dotted names (read them with job_from_args)."""
    parser.add_argument("--config", metavar="FILE|PRESET",
                        help="a TOML or JSON file of these sections, or a preset name in configs/presets "
                             f"({', '.join(preset_names())}); the flags given override it")
    parser.add_argument("--recipe-file", metavar="PATH_OR_NAME",
                        help="a recipe file: YAML of precision settings and per-block / per-fqn overrides (a path, "
                             "or a name in configs/recipes, as fp8stack plan takes it); over --config, under the "
                             "flags given")
    defaults = JobConfig()
    for name, cls in sections().items():
        if only is None or name in only:
            add_section_arguments(parser, name, getattr(defaults, name), skip=skip)
    for flag, where in RETIRED.items():
        parser.add_argument(flag, nargs="?", action=_Retired, help=argparse.SUPPRESS, pointer=where)


def add_section_arguments(parser: argparse.ArgumentParser, section: str, defaults,
                          aliases: Mapping[str, tuple[str, ...]] | None = None,
                          skip: Sequence[str] = ()) -> None:
    """One argument group titled by the section, one flag per field of `defaults` (a dataclass instance, whose
    values the help shows as the defaults)."""
    cls = type(defaults)
    group = parser.add_argument_group(f"{section}: {_first_sentence(cls.__doc__ or '')}")
    docs = field_docs(cls)
    aliases = {**ALIASES, **(aliases or {})}
    for f in fields(cls):
        dotted = f"{section}.{f.name}"
        if dotted in skip:
            continue
        default = getattr(defaults, f.name)
        options = {"dest": dotted, "default": argparse.SUPPRESS,
                   "help": f"{docs.get(f.name, '')} (default: {_shown(default)})".replace("%", "%%")}
        kind = _base_type(f.type)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            options.update(nargs="+", metavar="NAME")
        else:
            options["type"] = _PARSERS.get(dotted, kind)
            if dotted in CHOICES and dotted not in _PARSERS:
                options["choices"] = CHOICES[dotted]
            options["metavar"] = "{" + ",".join(CHOICES[dotted]) + "}" if dotted in CHOICES else _METAVARS[kind]
        # a command's own section registered first keeps an alias both claim (ab's --blockwise-gemms)
        free = [alias for alias in aliases.get(dotted, ()) if alias not in parser._option_string_actions]
        group.add_argument(f"--{section}.{f.name}".replace("_", "-"), *free, **options)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parser.parse_args with `--section.field_name` spelled either way."""
    return parser.parse_args(None if argv is None else [_hyphenated(arg) for arg in argv])


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of --config (if any), then --recipe-file's precision settings and overrides, with the flags
    given on top; Megatron's recompute flags translated."""
    given = {k: v for k, v in vars(args).items() if "." in k and not k.startswith(("ab.", "profile."))}
    base = load_config(args.config) if getattr(args, "config", None) else JobConfig()
    if getattr(args, "recipe_file", None):
        given = {**_recipe_file_options(args.recipe_file), **given}
    _megatron_recompute(args, given)
    job = from_overrides(given, base)
    counts = [ALIASES[name][0] for name in ("precision.num_layers_at_start_in_bf16",
                                            "precision.num_layers_at_end_in_bf16") if name in given]
    if counts and not job.precision.first_last_layers_bf16:
        verb = "applies" if len(counts) == 1 else "apply"
        raise ConfigError(f"{' and '.join(counts)} only {verb} with --first-last-layers-bf16: add that flag")
    return job


def _recipe_file_options(name_or_path: str) -> dict[str, Any]:
    """A recipe file's settings and overrides as precision options."""
    try:
        settings, overrides = load_recipe_file(name_or_path)
    except PlanError as err:
        raise ConfigError(f"--recipe-file: {err}") from None
    return {**{f"precision.{key}": value for key, value in settings.items()}, "precision.overrides": overrides}


def from_overrides(dotted: Mapping[str, Any], base: JobConfig | None = None) -> JobConfig:
    """`base` (default JobConfig()) with {'section.field': value} applied, validated."""
    nested = to_dict(base or JobConfig())
    for key, value in dotted.items():
        section, _, name = key.partition(".")
        if section not in nested or name not in nested[section]:
            raise ConfigError(f"unknown option {key!r}: sections are {', '.join(nested)}; `fp8stack train --help` "
                              "lists every field")
        nested[section][name] = list(value) if isinstance(value, tuple) else value
    return from_dict(nested)


def load_config(path_or_preset: str) -> JobConfig:
    """A JobConfig from a TOML or JSON file of sections, or from configs/presets/<name>.toml."""
    path = Path(path_or_preset)
    if not path.is_file() and path_or_preset in preset_names():
        path = PRESETS / f"{path_or_preset}.toml"
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"--config {path_or_preset}: no such file and no such preset (presets: "
                          f"{', '.join(preset_names())})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"cannot read --config {path_or_preset}: {' '.join(str(err).split())}; pass a TOML (or "
                          "JSON) file of sections") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path_or_preset} holds a {type(data).__name__}: pass a table of sections")
    return from_dict(data, where=f"--config {path_or_preset}")


def preset_names() -> list[str]:
    """The presets in configs/presets, by name."""
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def to_dict(job: JobConfig) -> dict[str, dict[str, Any]]:
    """The tree as plain data (what the evidence and checkpoints record; from_dict reads it back)."""
    return json.loads(json.dumps(asdict(job)))


def from_dict(data: Mapping[str, Any], where: str = "the configuration") -> JobConfig:
    """A validated JobConfig from {section: {field: value}}; unknown sections or fields, and values of the wrong
    type, are refused naming them."""
    classes = sections()
    unknown = set(data) - set(classes)
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}: use {', '.join(classes)}")
    built = {}
    for name, values in data.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: section {name} must be a table of fields, got {values!r}")
        built[name] = _section(name, classes[name], values, where)
    try:
        return JobConfig(**built)
    except PlanError as err:
        raise ConfigError(str(err)) from None


def _section(name: str, cls: type, values: Mapping[str, Any], where: str):
    known = {f.name: f for f in fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(f'{name}.{k}' for k in sorted(unknown))}; section "
                          f"{name} has {', '.join(known)}")
    kwargs = {}
    for key, value in values.items():
        if key == "overrides" and cls is PolicyConfig:
            value = tuple(Override(**rule) if isinstance(rule, Mapping) else rule for rule in value)
        elif isinstance(value, (list, tuple)):
            value = _split_items(value) if all(isinstance(item, str) for item in value) else tuple(value)
        _check_type(f"{name}.{key}", value, known[key].type)
        kwargs[key] = recipe_name(value) if (name, key) == ("precision", "recipe") else value
    try:
        return cls(**kwargs)
    except PlanError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_type(dotted: str, value, annotation) -> None:
    kinds = annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)
    if not any(_is_a(value, kind) for kind in kinds):
        names = " or ".join(_KIND_NAMES.get(kind, getattr(kind, "__name__", str(kind))) for kind in kinds)
        raise ConfigError(f"{dotted} must be {names}, got {value!r}")


_METAVARS = {int: "N", float: "X", str: "TEXT"}
_KIND_NAMES = {type(None): "unset (omit it)", bool: "true or false", int: "an integer", float: "a number",
               str: "a string", tuple[str, ...]: "a list of names"}


def _is_a(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if getattr(kind, "__origin__", None) is tuple:
        return isinstance(value, tuple)
    return isinstance(value, kind)


def _section_class(f) -> type:
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    return type(default) if is_dataclass(default) else f.type


def _shown(default) -> str:
    if default is None:
        return "chosen per run, see above"
    if isinstance(default, tuple):
        return " ".join(map(str, default))
    return str(default).lower() if isinstance(default, bool) else str(default) or "none"


def _base_type(annotation):
    kinds = [k for k in (annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,))
             if k is not type(None)]
    kind = kinds[0]
    return tuple if getattr(kind, "__origin__", None) is tuple else kind


def _recipe(text: str) -> str:
    try:
        return recipe_name(text)
    except PlanError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _arch(text: str) -> int:
    try:
        return parse_arch(text)
    except PlanError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_PARSERS = {"precision.recipe": _recipe, "precision.arch": _arch}
"""Fields whose flag reads its text its own way (a recipe's other names, 'sm90')."""


def _first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".")


def _hyphenated(arg: str) -> str:
    if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _megatron_recompute(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """--recompute-granularity full|selective and --recompute-modules (Megatron's) -> activation_checkpoint."""
    granularity = getattr(args, "recompute_granularity", None)
    modules = getattr(args, "recompute_modules", None)
    if granularity == "full" and modules:
        raise ConfigError("--recompute-modules applies to --recompute-granularity selective, not full: drop one of "
                          "them")
    if granularity is None and modules:
        granularity = "selective"
    if granularity is not None:
        given.setdefault("activation_checkpoint.layers", "all")
        given["activation_checkpoint.modules"] = (("block",) if granularity == "full"
                                                  else _split_items(modules or MEGATRON_SELECTIVE_DEFAULT))


def add_megatron_recompute_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's spelling of activation checkpointing."""
    parser.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                        help="Megatron's: full recomputes whole blocks; selective the --recompute-modules regions "
                             f"(default {' '.join(MEGATRON_SELECTIVE_DEFAULT)}), in every block unless "
                             "--recompute-layers names some")
    parser.add_argument("--recompute-modules", nargs="+", metavar="MODULE", default=None,
                        help="Megatron's: core_attn attn mlp moe moe_act shared_experts layernorm (implies selective)")


def _split_items(items: Sequence[str]) -> tuple[str, ...]:
    """A space list whose items may be comma lists ('mlp,attn' as earlier releases took it) -> one tuple."""
    return tuple(part.strip() for item in items for part in item.split(",") if part.strip())


class _Retired(argparse.Action):
    """A flag that no longer exists: refused naming where its meaning went."""

    def __init__(self, *args, pointer: str, **kwargs):
        self.pointer = pointer
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} no longer exists: {self.pointer}")
