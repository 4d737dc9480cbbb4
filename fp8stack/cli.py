"""The fp8stack command line. `fp8stack plan` prints which backend and recipe every GEMM gets, and why.

Every mistake in the input ends the same way: exit code 2 and one stderr line
'fp8stack: error: <problem and fix>'. Only a bug in fp8stack itself shows a traceback.
"""

import argparse
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from fp8stack import __version__
from fp8stack.ab import add_ab_parser
from fp8stack.doctor import add_doctor_parser
from fp8stack.plan import PlanError, PolicyConfig, load_description, load_recipe_file, make_plan, parse_arch
from fp8stack.plan.policy import SMALL_GEMM_CHOICES
from fp8stack.plan.recipe_file import SETTINGS
from fp8stack.plan.recipes import BACKEND_PREFERENCES, BF16, BLOCKWISE_EXPERT_BACKENDS, FP8_FORMATS, RECIPES
from fp8stack.plan.render import RENDERERS, render_table
from fp8stack.profile import add_profile_parser

PROG = "fp8stack"
USAGE_ERROR = 2
"""Exit code for bad input (argparse's convention)."""
MIN_TABLE_WIDTH = 100
"""Below this the table's columns get too narrow to read; a narrower terminal wraps lines instead."""
DEFAULT_ARCH = "sm90"
"""Target when no GPU is visible: Hopper, the first GPU with the FP8 recipes the plan uses most."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line, like every other fp8stack error."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{PROG}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)

    plan = commands.add_parser(
        "plan", help="print the precision plan of a model under an FP8 recipe",
        description="Print the precision plan: backend, recipe and reason for every component. "
                    "Settings come from the flags, then the --recipe-file, then the policy defaults.")
    plan.add_argument("--model", default="tiny",
                      help="model description: a YAML path or a name in configs/models (default: tiny)")
    # Settings default to None so that a flag the user did not give leaves the recipe file's value.
    plan.add_argument("--fp8-recipe", dest="recipe", choices=(BF16, *RECIPES),
                      help="FP8 recipe; may be omitted when the recipe file sets `recipe`")
    plan.add_argument("--fp8-format", choices=FP8_FORMATS,
                      help="e4m3, or hybrid: E4M3 forward, E5M2 gradients (default: the recipe's library default: "
                           "hybrid for delayed/tensorwise, e4m3 for rowwise/blockwise/mxfp8)")
    plan.add_argument("--backend", choices=BACKEND_PREFERENCES,
                      help="backend for dense linears; auto takes the recipe's first (default: auto)")
    plan.add_argument("--first-last-layers-bf16", action=argparse.BooleanOptionalAction, default=None,
                      help="keep the first and last layers in BF16 (Megatron's flag)")
    plan.add_argument("--num-layers-at-start-in-bf16", type=int, metavar="N",
                      help="layers kept BF16 at the start with --first-last-layers-bf16 (default: 1)")
    plan.add_argument("--num-layers-at-end-in-bf16", type=int, metavar="N",
                      help="layers kept BF16 at the end with --first-last-layers-bf16 (default: 1)")
    plan.add_argument("--arch", help=f"target GPU, e.g. sm90 or sm100 (default: the local GPU, else {DEFAULT_ARCH})")
    plan.add_argument("--small-gemm-filter", choices=SMALL_GEMM_CHOICES,
                      help="which torchao size thresholds keep small GEMMs in BF16 (default: auto, the recipe's own)")
    plan.add_argument("--blockwise-experts", choices=BLOCKWISE_EXPERT_BACKENDS,
                      help="blockwise expert GEMMs on fp8stack's grouped kernels (DeepGEMM, else torch scaled_mm per "
                           "expert) or TE GroupedLinear (default: grouped_fp8)")
    plan.add_argument("--head-on-te", action=argparse.BooleanOptionalAction, default=None,
                      help="run the output head (BF16) as a TE module beside the TE linears, for fused weight-gradient "
                           "accumulation (default: wherever the dense linears run on TE)")
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
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help printed, or a usage error already reported in one line
        return done.code if isinstance(done.code, int) else 0
    try:
        return args.run(args)
    except PlanError as err:
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USAGE_ERROR


def run_plan(args: argparse.Namespace) -> int:
    """`fp8stack plan`: print the plan of --model under the merged settings in --format."""
    model = load_description(args.model)
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
    flags = {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}
    merged = {**settings, **flags}
    if "recipe" not in merged:
        raise PlanError(f"no FP8 recipe given: pass --fp8-recipe ({', '.join([BF16, *RECIPES])}) "
                        "or set `recipe:` in the --recipe-file")
    counts = [f"--{name.replace('_', '-')}" for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
              if name in flags]
    if counts and not merged.get("first_last_layers_bf16"):
        verb = "applies" if len(counts) == 1 else "apply"
        raise PlanError(f"{' and '.join(counts)} only {verb} with --first-last-layers-bf16: add that flag")
    arch = parse_arch(args.arch if args.arch is not None else local_arch())
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
