"""One definition of an episode's group (the episodes whose mean return is its baseline without a critic): its
scenario, or the episode alone where it ran none, however the table spells "none" (None, NaN, "")."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from marft_lg.training.batch import compute_advantages
from marft_lg.training.buffer import build_buffer
from marft_lg.training.config import MARFTConfig
from marft_lg.training.trainer import MARFTTrainer
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset

SIDS = ["a", None, float("nan"), "", "a", float("nan")]


def _dataset(sids: list, ids: list[str] | None = None) -> TrajectoryDataset:
    """One one-action episode per scenario id, started in list order (`ids`: their episode ids, e0, e1, ...)."""
    ids = ids or [f"e{i}" for i in range(len(sids))]
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    eps = [{"episode_id": ids[i], "scenario_id": sid, "start_time": t0 + pd.Timedelta(seconds=i), "end_time": t0,
            "n_actions": 1, "agents": ["a"], "status": "ok", "outcome": None, "feedback": {}, "metadata": {}}
           for i, sid in enumerate(sids)]
    acts = [{"episode_id": ids[i], "order": 0, "step": 0, "agent": "a", "span_id": f"s{i}",
             "messages": [{"role": "user", "content": "q"}], "completion": "x", "prompt_token_ids": [1, 2],
             "completion_token_ids": [3], "completion_logprobs": [-0.5], "depends_on": [], "tool_calls": [],
             "tool_errors": 0, "input_tokens": 2, "output_tokens": 1, "latency_s": 0.1, "model": "m",
             "adapter_version": "v1"} for i in range(len(sids))]
    return TrajectoryDataset(pd.DataFrame(eps, columns=list(EPISODE_COLUMNS)),
                             pd.DataFrame(acts, columns=list(ACTION_COLUMNS)))


def test_an_episode_without_a_scenario_is_a_group_of_its_own_however_it_is_spelled():
    assert _dataset(SIDS).scenario_groups() == {"a": ["e0", "e4"], "e1": ["e1"], "e2": ["e2"], "e3": ["e3"],
                                                "e5": ["e5"]}
    numbered = _dataset([7, 7, pd.NA, 8])  # a scenario file may number its scenarios
    assert numbered.scenario_groups() == {"7": ["e0", "e1"], "e2": ["e2"], "8": ["e3"]}


def test_the_group_baseline_never_pools_episodes_that_ran_no_scenario():
    """Scenario-less episodes (None, NaN, "", NaN) each have advantage 0: nothing to compare them with. The update
    once read NaN as the scenario "nan" and pooled the two NaN episodes (returns 0 and 1) into one group."""
    ds = _dataset(SIDS)
    returns = {"e0": 1.0, "e1": 1.0, "e2": 0.0, "e3": 1.0, "e4": 0.0, "e5": 1.0}
    buf = build_buffer(ds, {e: np.array([r]) for e, r in returns.items()}, tokenizer=None, max_context=100)
    assert [r.scenario_id for r in buf.records] == ["a", None, None, None, "a", None]
    cfg = MARFTConfig(use_critic=False)
    adv, _ = compute_advantages(buf.records, [torch.zeros(1) for _ in buf.records], cfg)
    by_episode = {r.episode_id: float(a[0]) for r, a in zip(buf.records, adv, strict=True)}
    assert by_episode["e1"] == by_episode["e2"] == by_episode["e3"] == by_episode["e5"] == 0.0
    assert by_episode["e0"] > 0 > by_episode["e4"]  # the scenario "a" pair, one solved and one not


def test_offline_chunks_keep_a_scenarios_episodes_together():
    """Traces arrive in completion order (every scenario's first episode, then every second one): a chunk that split
    a scenario would leave its episodes alone in their groups, and the group baseline would give no signal."""
    ds = _dataset(["a", "b", "c", None, "a", "b", float("nan")], ids=["a-0", "b-0", "c-0", "x", "a-1", "b-1", "y"])
    assert MARFTTrainer._offline_chunks(ds, 4) == [["a-0", "a-1", "b-0", "b-1"], ["c-0", "x", "y"]]
    assert MARFTTrainer._offline_chunks(ds, 1) == [["a-0", "a-1"], ["b-0", "b-1"], ["c-0"], ["x"], ["y"]]
