"""`fp8stack ab --fastest-bf16` on a GPU: both BF16 configurations run (plain, and on TE modules), the faster is
the reference the FP8 arm is judged against. Run with `pytest -m gpu tests/gpu/test_ab_gpu.py`."""

import json

import pytest

from fp8stack.ab import main
from fp8stack.ab.verdicts import BF16_ON_TE_ARM
from fp8stack.backends.te import TEBackend

pytestmark = pytest.mark.gpu


def test_fastest_bf16_judges_the_fp8_arm_against_the_faster_bf16_configuration(requires_cuda, tmp_path, monkeypatch):
    te_runs, why = TEBackend().available(["delayed"])
    if not te_runs:
        pytest.skip(why)
    monkeypatch.delenv("OUT", raising=False)  # the plot goes to tmp_path only, not to a device call's $OUT
    code = main(["--model", "tiny", "--recipes", "delayed", "--backend", "te", "--fastest-bf16", "--no-repeat-baseline",
                 "--steps", "8", "--micro-batch", "2", "--seq-len", "128", "--device", "cuda",
                 "--out-dir", str(tmp_path)])
    assert code == 0
    record = json.loads(next(tmp_path.rglob("ab-tiny-*.json")).read_text())
    plain, on_te, delayed = record["arms"]
    assert [(a["recipe"], a["backend"]) for a in record["arms"][:2]] == [("bf16", "bf16"), (BF16_ON_TE_ARM, "te")]
    assert plain["step_ms"] and on_te["step_ms"], "both BF16 configurations ran"
    reference, other = (plain, on_te) if plain["step_ms"] <= on_te["step_ms"] else (on_te, plain)
    assert (reference["verdict"], other["verdict"]) == ("baseline", "alternative")
    assert delayed["rel_loss_gap"] == pytest.approx(delayed["final_loss"] / reference["final_loss"] - 1)
    judged_against = (f"than {reference['label']} beyond the noise: ", f"within the noise of {reference['label']}: ")
    assert any(phrase in delayed["reason"] for phrase in judged_against), delayed["reason"]
