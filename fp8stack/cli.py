"""The fp8stack command line: train, plan (which backend and recipe every GEMM gets, and why), ab, profile.

Every mistake in the input ends the same way: exit code 2 and one stderr line
'fp8stack: error: <problem and fix>'. Only a bug in fp8stack itself shows a traceback.
"""

import argparse
import shutil
import sys
from collections.abc import Sequence

from fp8stack import __version__
from fp8stack.ab import add_ab_parser
from fp8stack.config import ConfigError, ModelConfig, add_section_arguments, parse_args
from fp8stack.config.flags import USAGE_ERROR, OneLineParser
from fp8stack.doctor import add_doctor_parser
from fp8stack.plan import PlanError, PolicyConfig, load_description, load_recipe_file, make_plan, parse_arch
from fp8stack.plan.recipes import BF16, RECIPES
from fp8stack.plan.render import RENDERERS, render_table
from fp8stack.profile import add_profile_parser
from fp8stack.train.command import add_train_parser

PROG = "fp8stack"
MIN_TABLE_WIDTH = 100
"""Below this the table's columns get too narrow to read; a narrower terminal wraps lines instead."""
DEFAULT_ARCH = "sm90"
"""Target when no GPU is visible: Hopper, the first GPU with the FP8 recipes the plan uses most."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    add_train_parser(commands)
    plan = commands.add_parser(
        "plan", help="print the precision plan of a model under an FP8 recipe", usage="%(prog)s [options]",
        description="Print the precision plan: backend, recipe and reason for every component. "
                    "Settings come from the flags, then the --recipe-file, then the policy defaults.")
    add_section_arguments(plan, "model", ModelConfig(), skip=("model.impl", "model.factory",
                                                              "model.fused_projections"))
    # Every policy flag is optional: a flag the user did not give leaves the recipe file's value.
    add_section_arguments(plan, "precision", PolicyConfig(recipe=BF16),
                          skip=("precision.overrides",))
    plan.add_argument("--recipe-file", metavar="PATH_OR_NAME",
                      help="YAML with settings and per-block / per-fqn overrides (a path or a name in configs/recipes)")
    plan.add_argument("--format", choices=tuple(RENDERERS), default="table", help="output format (default: table)")
    plan.set_defaults(run=run_plan)
    add_ab_parser(commands)
    add_profile_parser(commands)
    add_doctor_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code."""
    try:
        args = parse_args(build_parser(), sys.argv[1:] if argv is None else argv)
    except SystemExit as done:  # --help printed, or a usage error already reported in one line
        return done.code if isinstance(done.code, int) else 0
    try:
        return args.run(args)
    except (PlanError, ConfigError) as err:
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USAGE_ERROR


def run_plan(args: argparse.Namespace) -> int:
    """`fp8stack plan`: print the plan of --model under the merged settings in --format."""
    model = load_description(getattr(args, "model.name", ModelConfig().name))
    plan = make_plan(model, policy_config(args))
    if args.format == "table":
        text = render_table(plan, width=max(MIN_TABLE_WIDTH, shutil.get_terminal_size().columns))
    else:
        text = RENDERERS[args.format](plan)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    """Flags given on the command line, over the recipe file's settings, over PolicyConfig's defaults."""
    settings, overrides = load_recipe_file(args.recipe_file) if args.recipe_file else ({}, ())
    flags = {key.removeprefix("precision."): value for key, value in vars(args).items()
             if key.startswith("precision.")}
    merged = {**settings, **flags}
    if "recipe" not in merged:
        raise PlanError(f"no FP8 recipe given: pass --fp8-recipe ({', '.join([BF16, *RECIPES])}) "
                        "or set `recipe:` in the --recipe-file")
    counts = [f"--{name.replace('_', '-')}" for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
              if name in flags]
    if counts and not merged.get("first_last_layers_bf16"):
        verb = "applies" if len(counts) == 1 else "apply"
        raise PlanError(f"{' and '.join(counts)} only {verb} with --first-last-layers-bf16: add that flag")
    arch = parse_arch(merged.pop("arch") if "arch" in merged else local_arch())  # pop(key, default) would import torch
    return PolicyConfig(**merged, arch=arch, overrides=overrides)


def local_arch() -> str:
    """The local GPU's compute capability as 'smXY', or DEFAULT_ARCH when there is no CUDA GPU."""
    import torch  # here, not at the top: the import takes seconds and only this default needs it

    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


if __name__ == "__main__":
    sys.exit(main())
