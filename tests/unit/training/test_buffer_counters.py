"""What `build_buffer` counts: actions left out (`skipped`) vs. kept with recomputed log-probs (`recomputed`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from marft_lg.training.buffer import build_buffer
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset


def _dataset(logprobs: list) -> TrajectoryDataset:
    """One episode; action i has 3 completion tokens and the given completion_logprobs."""
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    ep = {"episode_id": "e", "scenario_id": None, "start_time": t0, "end_time": t0, "n_actions": len(logprobs),
          "agents": ["a"], "status": "ok", "outcome": None, "feedback": {}, "metadata": {}}
    acts = [{"episode_id": "e", "order": i, "step": i, "agent": "a", "span_id": f"s{i}",
             "messages": [{"role": "user", "content": "q"}], "completion": "x y z", "prompt_token_ids": [1, 2],
             "completion_token_ids": [3, 4, 5], "completion_logprobs": lp, "depends_on": [], "tool_calls": [],
             "tool_errors": 0, "input_tokens": 2, "output_tokens": 3, "latency_s": 0.1, "model": "m",
             "adapter_version": "v1"} for i, lp in enumerate(logprobs)]
    return TrajectoryDataset(pd.DataFrame([ep], columns=list(EPISODE_COLUMNS)),
                             pd.DataFrame(acts, columns=list(ACTION_COLUMNS)))


GOOD, SHORT = [-0.1, -0.2, -0.3], [-0.1]


def _build(logprobs, mode):
    ds = _dataset(logprobs)
    return build_buffer(ds, {"e": np.ones(len(logprobs))}, tokenizer=None, max_context=100, behaviour_logprobs=mode)


def test_auto_recomputes_and_counts_why_without_calling_it_skipped():
    buf = _build([GOOD, SHORT, None], "auto")
    assert len(buf.records) == 3  # nothing was left out
    assert dict(buf.skipped) == {}
    assert dict(buf.recomputed) == {"logprob_length_mismatch": 1, "missing": 1}
    assert buf.n_recomputed == 2 and [r.recomputed for r in buf.records] == [False, True, True]


def test_trace_mode_skips_them_and_recompute_mode_recomputes_all():
    buf = _build([GOOD, SHORT, None], "trace")
    assert len(buf.records) == 1
    assert dict(buf.skipped) == {"logprob_length_mismatch": 1, "no_logprobs": 1} and dict(buf.recomputed) == {}
    buf = _build([GOOD, SHORT, None], "recompute")
    assert len(buf.records) == 3 and dict(buf.recomputed) == {"config": 3} and dict(buf.skipped) == {}
