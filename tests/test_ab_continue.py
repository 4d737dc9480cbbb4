"""fp8stack ab --continue-from across options added or changed since the partial evidence was written."""

import json

import pytest

from fp8stack.ab import AbConfig
from fp8stack.ab.run import _earlier_runs, to_plain
from fp8stack.config import JobConfig, to_dict


def _partial(tmp_path, train_config: dict) -> str:
    record = {"train_config": train_config, "recipes": ["bf16", "delayed"], "nproc": 1,
              "runs": {"bf16": {"losses": [1.0]}}, "continued_from": [], "date": "today", "command": "fp8stack ab"}
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(record))
    return path


def test_an_option_added_since_the_partial_run_continues_it_at_its_default_only(tmp_path):
    ours = {"job": to_dict(JobConfig()), "ab": to_plain(AbConfig())}
    written_before = json.loads(json.dumps(ours))
    del written_before["job"]["parallelism"]["fsdp_reduce_each_micro_batch"]
    path = _partial(tmp_path, written_before)
    runs, _ = _earlier_runs(path, ours, ["bf16", "delayed"], 1)
    assert list(runs) == ["bf16"]
    ours["job"]["parallelism"]["fsdp_reduce_each_micro_batch"] = True
    with pytest.raises(ValueError, match="train_config differs in job.parallelism.fsdp_reduce_each_micro_batch"):
        _earlier_runs(path, ours, ["bf16", "delayed"], 1)


def test_moe_only_options_do_not_part_the_a_b_of_a_dense_model(tmp_path):
    ours = {"job": to_dict(JobConfig()), "ab": to_plain(AbConfig())}
    written_before = json.loads(json.dumps(ours))
    written_before["job"]["grouped_fp8"]["quantizer"] = "inductor"  # the default when it was written
    path = _partial(tmp_path, written_before)
    assert list(_earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=True)[0]) == ["bf16"]
    with pytest.raises(ValueError, match="train_config differs in job.grouped_fp8.quantizer"):
        _earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=False)


def test_an_moe_a_b_written_before_the_grouped_fp8_weight_cache_continues_only_without_it(tmp_path):
    """grouped_fp8.cache_fp8_weights came after MoE A/Bs were written, and is on by default since: such a partial
    run (its runs uncached) continues with the cache off; at the default, the continuation names it."""
    ours = {"job": to_dict(JobConfig()), "ab": to_plain(AbConfig())}
    assert ours["job"]["grouped_fp8"]["cache_fp8_weights"] is True
    written_before = json.loads(json.dumps(ours))
    del written_before["job"]["grouped_fp8"]["cache_fp8_weights"]
    path = _partial(tmp_path, written_before)
    with pytest.raises(ValueError, match="train_config differs in job.grouped_fp8.cache_fp8_weights"):
        _earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=False)
    ours["job"]["grouped_fp8"]["cache_fp8_weights"] = False
    assert list(_earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=False)[0]) == ["bf16"]


def test_an_option_that_lays_out_the_same_bytes_does_not_part_the_a_b(tmp_path):
    """The compiled wgrad flattening writes the per-expert copies' bytes (GPU-tested): a loss A/B written with the
    copies continues with the gather; an option that changes the numbers still parts it."""
    ours = {"job": to_dict(JobConfig()), "ab": to_plain(AbConfig())}
    written_before = json.loads(json.dumps(ours))
    ours["job"]["grouped_fp8"]["wgrad_flatten"] = "compiled"
    path = _partial(tmp_path, written_before)
    assert list(_earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=False)[0]) == ["bf16"]
    ours["job"]["grouped_fp8"]["quantizer"] = "inductor"
    with pytest.raises(ValueError, match=r"train_config differs in job.grouped_fp8.quantizer\)"):
        _earlier_runs(path, ours, ["bf16", "delayed"], 1, dense=False)
