"""scripts/gpu-lanes.sh, the device side of a GPU call, run here on the CPU with a command standing in for a bench."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SAVES_ON_SIGTERM = """
import pathlib, signal, sys, time
def save(*_):
    time.sleep(2)  # an A/B's arm finishing its step and writing its checkpoint and evidence
    pathlib.Path("profiles/runs/saved-on-sigterm").write_text("saved")
    sys.exit(3)
signal.signal(signal.SIGTERM, save)
time.sleep(60)
"""


def test_a_lane_stopped_at_its_deadline_keeps_the_call_until_its_command_has_saved(tmp_path):
    """At the deadline the lane's shell dies of the SIGTERM at once; the command handling it must still get GRACE
    seconds to save, and what it saves must come back in results.tgz."""
    tree, work, out = tmp_path / "tree", tmp_path / "work", tmp_path / "out"
    (tree / "profiles" / "runs").mkdir(parents=True)
    (tree / "saves.py").write_text(SAVES_ON_SIGTERM)
    out.mkdir()
    script = f"source {ROOT}/scripts/gpu-lanes.sh 2; lane_seq main '' '{sys.executable} saves.py' 'echo never'; finish"
    done = subprocess.run(["bash", "-c", script], cwd=tree, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(out), "LANES_WORK": str(work), "GRACE": "20"})
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "results.tgz") as archive:
        names = archive.getnames()
        assert "lane-main/profiles/runs/saved-on-sigterm" in names, names
        log = archive.extractfile("lanes-logs/main.log").read().decode()
    assert "== main rc=124" in log and "never" not in log.splitlines()[1:], log
