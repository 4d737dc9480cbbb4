"""Run the GPU test suite (`pytest -m gpu`) and write its outcome as evidence.

    python -m fp8stack.bench.gpu_tests [--label NAME] [--force] [pytest args]

Writes profiles/runs/<date>-gpu-tests[-NAME]-<device>/ (.json and .md: every test's outcome and duration, failure
tails) and exits with pytest's exit code. A label names a part of the suite, so that parts run side by side (one per
GPU, CUDA_VISIBLE_DEVICES) or one after another on a day keep their own evidence. SIGTERM (`timeout` running out
on a device call) stops pytest as Ctrl-C does, and the evidence still holds the tests that finished, marked
interrupted. -h/--help prints this and pytest's help, and writes nothing.
"""

import re
import signal
import sys
import time
from collections import Counter

import pytest

from fp8stack.evidence import claim_or_exit, device_slug, markdown_table, write_evidence

FAILURE_LINES = 15
"""Lines kept from the end of a failure's report: the assertion and the line that raised."""


class OutcomeCollector:
    """pytest plugin: one record per test; a failing setup or teardown shows as an error of that phase."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "", "duration_s": 0.0})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 4)
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            entry["failure"] = "\n".join(str(report.longrepr).splitlines()[-FAILURE_LINES:])
        elif report.when == "call" or report.skipped:
            entry["outcome"] = report.outcome
            if hasattr(report, "wasxfail"):
                entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            if report.skipped and isinstance(report.longrepr, tuple):
                entry["reason"] = report.longrepr[2]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module that fails to import, or skips itself whole (no CUDA), has no tests to report."""
        if report.failed:
            self.results[report.nodeid] = {"nodeid": report.nodeid, "outcome": "collection error", "duration_s": 0.0,
                                           "failure": "\n".join(str(report.longrepr).splitlines()[-FAILURE_LINES:])}
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.results[report.nodeid] = {"nodeid": report.nodeid, "outcome": "skipped", "duration_s": 0.0,
                                           "reason": reason}


def _note(result: dict) -> str:
    """A skip's reason or a failure's last line, for one table cell."""
    lines = (result.get("reason") or result.get("failure") or "").strip().splitlines()
    return (lines[-1] if lines else "").replace("|", "\\|")[:160]


def run(args: list[str], out_dir: str = "profiles", force: bool = False, label: str = "") -> int:
    """pytest -m gpu <args> in this process; write the evidence (replacing an earlier one only with `force`);
    return pytest's exit code. With -h or --help: the help of both, no tests and no evidence."""
    if "-h" in args or "--help" in args:
        print(__doc__)
        return int(pytest.main(["--help"]))
    stem = f"gpu-tests-{label + '-' if label else ''}{device_slug()}"
    claim_or_exit("fp8stack.bench.gpu_tests", stem, out_dir, force)
    collector = OutcomeCollector()
    pytest_args = ["-m", "gpu", *args]
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = int(pytest.main(list(pytest_args), plugins=[collector]))  # pytest.main edits the list it gets
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = list(collector.results.values())
    for result in results:  # set up, but stopped before its call reported
        result["outcome"] = result["outcome"] or "interrupted"
    counts = dict(Counter(r["outcome"] for r in results))
    payload = {"pytest_args": pytest_args, "exit_code": code, "wall_s": round(time.perf_counter() - start, 2),
               "counts": counts, "tests": results}
    json_path, _ = write_evidence(stem, payload, render(payload), out_dir, replace=True)
    print(f"evidence: {json_path} ({_summary(counts)})")
    return code


def _interrupt(signum, frame) -> None:
    """SIGTERM as Ctrl-C: pytest ends the session, reporting the tests that finished (exit code INTERRUPTED)."""
    raise KeyboardInterrupt(f"signal {signum}")


def render(record: dict) -> str:
    """The Markdown of a run's record: pytest's exit code and counts, then one row per test."""
    rows = [[f"`{r['nodeid']}`", r["outcome"], f"{r['duration_s']:.2f}", _note(r)] for r in record["tests"]]
    stopped = (" (interrupted: the tests below finished; the rest did not run)"
               if record["exit_code"] == pytest.ExitCode.INTERRUPTED else "")
    return (f"pytest exit code {record['exit_code']}{stopped}: {_summary(record['counts'])}\n\n"
            + markdown_table(["test", "outcome", "s", "note"], rows))


def _summary(counts: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests collected"


def split_arguments(argv: list[str]) -> tuple[list[str], bool, str]:
    """(pytest's arguments, --force, --label's value): --force and --label NAME are ours, the rest pytest's."""
    args, force, label = [], False, ""
    rest = iter(argv)
    for arg in rest:
        if arg == "--force":
            force = True
        elif arg == "--label":
            label = next(rest, "")
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", label):
                print(f"fp8stack.bench.gpu_tests: error: --label {label!r} is not a folder-name word: use lowercase "
                      "letters, digits and dashes, e.g. --label moe", file=sys.stderr)
                raise SystemExit(2)
        else:
            args.append(arg)
    return args, force, label


if __name__ == "__main__":
    pytest_args, force_replace, run_label = split_arguments(sys.argv[1:])
    sys.exit(run(pytest_args, force=force_replace, label=run_label))
