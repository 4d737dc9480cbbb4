"""`fp8stack train` (also `python -m fp8stack.train`; launch/train.sh wraps it in torchrun).

Options are the configuration tree's (fp8stack.config): `--config FILE|PRESET` first, then `--section.field` flags
and their Megatron-style aliases. Mistakes in the input end with exit code 2 and one line
'fp8stack train: error: <problem and fix>', before any model is built; a NaN or infinite loss or gradient norm with
exit code 1 and one line naming the first non-finite layer and the file pinning the step; SIGTERM or SIGINT with a
final checkpoint, the --result-json of the steps taken (TrainResult.stopped_after), one line and exit code 128 + the
signal's number.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from fp8stack import __version__
from fp8stack.config import ConfigError, JobConfig, add_config_arguments, job_from_args, parse_args
from fp8stack.config.flags import USAGE_ERROR, add_megatron_recompute_arguments, run_command
from fp8stack.plan import PlanError



def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every configuration option, Megatron's recompute flags, --result-json and --version."""
    parser.add_argument("--version", action="version", version=f"fp8stack {__version__}")
    add_config_arguments(parser)
    add_megatron_recompute_arguments(parser)
    parser.add_argument("--result-json", metavar="PATH", help="write the TrainResult here (rank 0)")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """The `train` subcommand; it runs run_train(args)."""
    parser = subparsers.add_parser("train", help="train a model under a precision plan",
                                   description=__doc__.split("\n\n")[0], usage="%(prog)s [options]")
    add_train_arguments(parser)
    parser.set_defaults(run=run_train)
    return parser


def run_train(args: argparse.Namespace, prog: str = "fp8stack train") -> int:
    """Train; the exit code (see the module docstring)."""
    from fp8stack.assembly import OrderingError
    from fp8stack.backends import BackendUnavailable
    from fp8stack.runtime.numerics import NonFiniteLossError
    from fp8stack.train.checkpoint import CheckpointError
    from fp8stack.train.loop import train
    from fp8stack.train.preflight import check_output_file
    from fp8stack.train.stop import TrainingStopped

    try:
        job = job_from_args(args)
        if args.result_json:
            check_output_file(args.result_json, "--result-json")
        result = train(job)
    except (PlanError, ConfigError, CheckpointError, BackendUnavailable, OrderingError, NotImplementedError) as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USAGE_ERROR
    except NonFiniteLossError as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except TrainingStopped as err:
        _write_result(args.result_json, err.result)  # the steps taken, with stopped_after: `ab` resumes from them
        print(f"{prog}: {err}", file=sys.stderr)
        return 128 + err.signal_number
    _write_result(args.result_json, result)
    return 0


def _write_result(path: str | None, result) -> None:
    """Write the TrainResult to --result-json's path, if given (rank 0)."""
    if path and os.environ.get("RANK", "0") == "0":
        Path(path).write_text(json.dumps(asdict(result)) + "\n")


def job_from_flags(argv: list[str]) -> JobConfig:
    """The JobConfig `fp8stack train` builds from these flags (not resolved: fields left None stay None)."""
    parser = argparse.ArgumentParser(prog="fp8stack train")
    add_train_arguments(parser)
    return job_from_args(parse_args(parser, argv))


def main(argv: list[str] | None = None) -> int:
    """`fp8stack train` with these arguments; the exit code."""
    return run_command("fp8stack train", add_train_arguments, run_train, argv)
