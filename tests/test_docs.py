"""docs/reference/ is generated from the code (fp8stack.bench.docs) and committed current: the CLI from the real
parsers, the configuration from the dataclass docstrings, the errors from the exception classes' docstrings."""

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from fp8stack.bench.docs import HELP_FORMAT, REFERENCE, error_classes, pages
from fp8stack.config.flags import sections


def test_committed_reference_matches_the_code():
    written_by = re.search(rf"{HELP_FORMAT} (\d+\.\d+)\.", (REFERENCE / "cli.md").read_text()).group(1)
    if written_by != f"{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"docs/reference/cli.md was written by Python {written_by}'s argparse, whose help differs from "
                    f"this Python's: run the test under {written_by}")
    result = subprocess.run([sys.executable, "-m", "fp8stack.bench.docs", "--check"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_reference_names_every_command_field_and_error(tmp_path):
    generated = {path.name: text for path, text in pages(tmp_path).items()}
    for command in ("train", "plan", "ab", "profile", "doctor"):
        assert f"## fp8stack {command}\n" in generated["cli.md"]
    assert "--training.micro-batch" in generated["cli.md"]  # the generated flags, not a summary
    for section, cls in sections().items():
        assert f"## `{section}`" in generated["config.md"]
        for f in fields(cls):
            assert f"| `{f.name}` |" in generated["config.md"], f"{section}.{f.name}"
    for _, name, _, _ in error_classes():
        assert f"| `{name}` |" in generated["errors.md"]
    assert "| `ConfigError` | `fp8stack.config.job` | `ValueError` |" in generated["errors.md"]


def test_error_classes_are_found_through_their_bases_and_every_one_is_documented(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('class BaseProblem(RuntimeError):\n    """Base."""\n\n\n'
                                  'class Leaf(BaseProblem):\n    """A leaf."""\n\n\nclass NotAnError:\n    pass\n\n\n'
                                  'class _Private(ValueError):\n    pass\n')
    found = {name: (module, bases, doc) for module, name, bases, doc in error_classes(package)}
    assert found == {"BaseProblem": ("pkg.a", ("RuntimeError",), "Base."), "Leaf": ("pkg.a", ("BaseProblem",), "A leaf.")}
    assert all(doc for _, _, _, doc in error_classes()), "an fp8stack exception class without a docstring"


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    import fp8stack.bench.docs as docs

    monkeypatch.setattr(docs, "REFERENCE", tmp_path)
    monkeypatch.setattr(docs, "pages", lambda: pages(tmp_path))
    assert docs.main(["--check"]) == 1
    assert "differ from the code" in capsys.readouterr().err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0
    page = Path(tmp_path / "config.md")
    page.write_text(page.read_text().replace("| `steps` |", "| `stepz` |"))
    assert docs.main(["--check"]) == 1
