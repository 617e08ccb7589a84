import pytest
from eval_factory import FormatAndAnswerReward, make_dataset

from marft_lg.evaluation.gate import PromotionGate
from marft_lg.evaluation.shadow import derive_seed, resolve_versions, shadow_compare, split_mirrored
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

SCENARIOS = ScenarioSet(Scenario(f"s{i}", {"question": f"q{i}"}, reference=str(i)) for i in range(8))


class RecordingApp:
    """Test double of a WrappedGraph: the writer answers in format only when it runs adapter v2,
    and the candidate crashes on the scenarios listed in `crash_on`."""

    def __init__(self, crash_on=()):
        self.calls, self.episodes, self.crash_on = [], [], set(crash_on)

    def invoke(self, inputs, *, episode_id, scenario_id, seed, versions, metadata):
        self.calls.append({"episode_id": episode_id, "scenario_id": scenario_id, "seed": seed,
                           "versions": versions, "side": metadata["marft.compare.side"]})
        if scenario_id in self.crash_on and versions.get("writer") == "v2":
            raise RuntimeError("tool exploded")
        ref = SCENARIOS.by_id()[scenario_id]["reference"]
        answer = f"ANSWER: {ref}" if versions.get("writer") == "v2" else f"it is {ref}"
        self.episodes.append({"episode_id": episode_id, "scenario_id": scenario_id, "actions": [
            {"agent": "planner", "completion": "plan", "adapter_version": versions.get("planner")},
            {"agent": "writer", "completion": answer, "adapter_version": versions.get("writer")}]})
        return {"answer": answer}

    def collect(self, ids):
        return make_dataset(self.episodes).select(ids)


def test_paired_runs_share_seeds_and_pin_versions():
    app = RecordingApp()
    res = shadow_compare(app, {"planner": "v1", "writer": "v1"}, {"writer": "v2"}, SCENARIOS,
                         FormatAndAnswerReward(), samples_per_scenario=2, seed=7, collect=app.collect, progress=False)
    assert len(app.calls) == 8 * 2 * 2
    by_side = {"baseline": [], "candidate": []}
    for c in app.calls:
        by_side[c["side"]].append(c)
    assert [c["seed"] for c in by_side["baseline"]] == [c["seed"] for c in by_side["candidate"]]
    assert len({c["seed"] for c in by_side["baseline"]}) == 16
    assert by_side["candidate"][0]["versions"] == {"planner": "v1", "writer": "v2"}
    assert by_side["baseline"][0]["versions"] == {"planner": "v1", "writer": "v1"}
    assert by_side["baseline"][0]["seed"] == derive_seed(7, "s0", 0)
    assert res.n_pairs == 8 and res.team.mean == pytest.approx(1.0)
    assert res.meta["candidate"] == {"planner": "v1", "writer": "v2"} and res.meta["samples_per_scenario"] == 2
    assert PromotionGate().evaluate(res).promote


def test_candidate_crashes_count_against_it():
    app = RecordingApp(crash_on={"s1", "s2"})
    res = shadow_compare(app, {"writer": "v1"}, {"writer": "v2"}, SCENARIOS, FormatAndAnswerReward(),
                         collect=app.collect, progress=False)
    assert res.meta["invoke_failures"] == {"baseline": 0, "candidate": 2}
    assert res.episode_metrics["error"].mean == pytest.approx(2 / 8)
    decision = PromotionGate().evaluate(res)
    assert not decision.promote
    assert [c.name for c in decision.checks if not c.passed] == ["error_rate"]


def test_version_specs_resolve_through_a_registry(tmp_path):
    class Registry:
        root = tmp_path

        def alias(self, name):
            return {"live": {"planner": "v1", "writer": "v3"}}.get(name, {})

        def aliases(self):
            return {"live": self.alias("live")}

        def resolve(self, role, ref):
            return {"latest": "v3"}.get(ref, ref)

    assert resolve_versions("live", Registry(), ["writer"]) == {"writer": "v3"}
    assert resolve_versions({"writer": "latest", "planner": "init"}, Registry()) == {"writer": "v3", "planner": "init"}
    with pytest.raises(ValueError, match="alias 'candidate' is not set.*known aliases: \\['live'\\]"):
        resolve_versions("candidate", Registry())
    with pytest.raises(ValueError, match="needs an adapter registry"):
        resolve_versions("live", None)


def test_nothing_to_compare_is_an_error():
    with pytest.raises(ValueError, match="no scenarios"):
        shadow_compare(RecordingApp(), {}, {}, [], FormatAndAnswerReward(), collect=lambda ids: TrajectoryDataset())


def test_split_mirrored_pairs_by_metadata_and_counts_lost_shadows():
    eps = []
    for i in range(4):
        for side in ("live", "shadow"):
            if side == "shadow" and i == 3:
                continue  # this shadow run hung before its first LLM call
            eps.append({"episode_id": f"{side}-{i}", "scenario_id": None,
                        "metadata": {"marft.mirror.pair_id": f"p{i}", "marft.mirror.side": side},
                        "actions": [{"agent": "writer", "completion": "ANSWER: 1"}]})
    eps.append({"episode_id": "unmirrored", "actions": [{"agent": "writer", "completion": "x"}]})
    ds = make_dataset(eps)
    live, shadow, lu, su = split_mirrored(ds, pairs={"shadow-3": ("p3", "shadow")})
    assert sorted(lu.values()) == ["p0", "p1", "p2", "p3"] and sorted(su.values()) == ["p0", "p1", "p2", "p3"]
    assert len(live) == 4 and len(shadow) == 4
    lost = shadow.episodes.set_index("episode_id").loc["shadow-3"]
    assert lost["status"] == "error" and lost["n_actions"] == 0
