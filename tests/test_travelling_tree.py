"""The working tree a GPU call carries: every tracked file beside one staging part (scripts/stage-gpu.sh) must stay
under the device's limit, or the next session cannot stage its stack. The evidence grows the tree every session."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20
"""The device's cap on what one call carries: the working tree and the carried part (/work/.library/device)."""
MARGIN = 2**20
"""Room for the part's receive.sh and checksum and for untracked files a call carries (a devrun/ folder)."""


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    paths = (ROOT / name.decode() for name in names if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def part_bytes() -> int:
    """The size stage-gpu.sh cuts the TransformerEngine wheel into (`split -b NNm`)."""
    found = re.search(r"split -b (\d+)m ", (ROOT / "scripts" / "stage-gpu.sh").read_text())
    assert found, "scripts/stage-gpu.sh no longer cuts its parts with `split -b NNm`"
    return int(found.group(1)) * 2**20


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout: no tracked tree to measure")
def test_the_tracked_tree_leaves_room_for_a_staging_part_in_one_call():
    tree, part = tracked_bytes(), part_bytes()
    assert tree + part + MARGIN <= CALL_LIMIT, (
        f"the tracked tree is {tree / 2**20:.1f} MiB: beside a {part // 2**20} MiB staging part it no longer fits one "
        f"GPU call ({CALL_LIMIT // 2**20} MiB): cut smaller parts in scripts/stage-gpu.sh, or shrink profiles/ "
        "(python -m fp8stack.evidence --compact profiles)")
