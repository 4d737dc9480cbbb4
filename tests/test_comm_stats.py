"""fp8stack.train.comm_stats on a one-rank gloo group: the profiler's record of each collective counted once per
step, all-to-alls (an MoE dispatch's) with the bytes each rank sends, by element type."""

import torch
import torch.distributed as dist

from fp8stack.train.comm_stats import CollectiveCounter

PROFILED = 2
"""Steps counted after the first."""


def test_all_to_alls_are_counted_with_the_bytes_sent_by_dtype(mesh):
    tokens, weights = torch.ones(6, 4, dtype=torch.bfloat16), torch.ones(6)
    with CollectiveCounter(PROFILED) as counter:
        for _ in range(1 + PROFILED):
            for sent in (tokens, weights, tokens):  # dispatch the tokens and their routing weights, return the tokens
                dist.all_to_all_single(torch.empty_like(sent), sent, [sent.shape[0]], [sent.shape[0]])
            dist.all_to_all([torch.empty(3)], [torch.ones(3)])
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))
            counter.step_done()
    found = counter.result
    assert found.steps == PROFILED
    assert found.counts == {"all_gather": 1, "all_to_all": 3, "all_to_all_list": 1}
    assert found.all_to_all_bytes_by_dtype == {"c10::BFloat16": 2 * 6 * 4 * 2, "float": 6 * 4}
    assert found.bytes == {"all_gather": 4 * 4, "all_to_all": 2 * 6 * 4 * 2 + 6 * 4}
