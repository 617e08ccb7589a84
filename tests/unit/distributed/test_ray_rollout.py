"""Rollout workers on a real local Ray cluster (started here on 127.0.0.1, stopped at the end): the same seeds give
the same episodes as one process; a worker killed mid-iteration is replaced and the iteration holds every episode
exactly once; versions the learner publishes reach the workers, by registry path or as files; `marft-lg train` with
a `ray:` section runs its online phase on the workers."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from marft_lg.distributed.config import RayConfig  # noqa: E402
from marft_lg.distributed.rollout import WORKER_KEY, RayCollector  # noqa: E402
from marft_lg.distributed.worker import RolloutWorker, WorkerSpec, version_files  # noqa: E402
from marft_lg.graph.collect import GraphCollector, plan_episodes  # noqa: E402
from marft_lg.trajectories.scenarios import Scenario  # noqa: E402

APPS = Path(__file__).with_name("ray_apps.py")
AGENTS = ["planner", "writer"]
SCENARIOS = [Scenario(f"s{i}", {"msgs": [f"question {i}"]}) for i in range(4)]


@pytest.fixture(scope="module")
def cluster():
    from marft_lg.distributed.config import _loopback_only

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    with _loopback_only():  # as `address: local` starts one: nothing listens beyond 127.0.0.1
        ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp,
                 configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _fixed_spec(**over) -> WorkerSpec:
    return WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, engine=f"{APPS}:FixedLatencyEngine",
                      **{"engine_options": {"latency_s": 0.01}, **over})


def test_the_same_seeds_give_the_same_episodes_as_one_process(cluster, tiny_model_dir):
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.loading import load_object
    from marft_lg.serving.team import Team

    team = Team(tiny_model_dir, AGENTS, seed=0)
    app = wrap(load_object(f"{APPS}:two_agents")(TeamChatModel(team=team, max_tokens=6, temperature=1.0)), team=team,
               trace_dir=tempfile.mkdtemp())
    local = GraphCollector(app, run_id="r").collect(SCENARIOS, 2, 0, seed=7)
    team.close()
    spec = WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, model=tiny_model_dir, max_tokens=6, temperature=1.0)
    with RayCollector(RayConfig(address="auto", rollout_workers=2), spec, run_id="r") as collector:
        remote = collector.collect(SCENARIOS, 2, 0, seed=7)
    assert sorted(remote.episode_ids) == sorted(local.episode_ids) and len(local.episodes) == 8

    def tokens(ds):
        acts = ds.actions.sort_values(["episode_id", "order"])
        return [(e, a, list(t)) for e, a, t in zip(acts["episode_id"], acts["agent"], acts["completion_token_ids"],
                                                   strict=True)]

    assert tokens(remote) == tokens(local)
    workers = {m[WORKER_KEY] for m in remote.episodes["metadata"]}
    assert workers == {0, 1}  # both workers ran episodes


def test_a_worker_killed_mid_iteration_is_replaced_and_no_episode_is_lost_or_doubled(cluster, tmp_path):
    # the first worker to answer its 3rd call dies there (mid-episode, mid-iteration: 6 episodes of 2 calls each)
    spec = _fixed_spec(engine_options={"latency_s": 0.01, "die_once": str(tmp_path / "died"), "die_after": 3},
                       concurrency=1)
    with RayCollector(RayConfig(address="auto", rollout_workers=2), spec, run_id="k") as collector:
        dataset = collector.collect(SCENARIOS, 3, 0, seed=1)
        assert (tmp_path / "died").exists() and collector.replaced == 1
        ids = dataset.episode_ids
        assert len(ids) == len(set(ids)) == 12
        assert sorted(ids) == sorted(f"k-it0-s{i}-{j}" for i in range(4) for j in range(3))
        assert (dataset.actions.groupby("episode_id").size() == 2).all()  # whole episodes, no half-run leftovers
        assert sum(collector.last_stats["episodes_per_worker"].values()) == 12
        assert len(collector.workers) == 2 and sorted(collector.workers) != [0, 1]  # one index replaced (2)
        again = collector.collect(SCENARIOS[:1], 2, 1, seed=1)  # the pool keeps working after the replacement
        assert len(again.episodes) == 2


def test_a_worker_killed_mid_episode_leaves_only_whole_episodes_in_the_trace_folder(cluster, tmp_path, caplog):
    from marft_lg.trajectories.mining import mine

    # each worker answers 12 calls in iteration 0 (6 episodes of 2 calls, one at a time); the first to answer its
    # 16th call (iteration 1, the writer of its 2nd episode) dies there, once its 15 chat spans are on disk: its
    # folder holds iteration 0's whole episodes, one whole and one half episode of iteration 1
    traces = tmp_path / "traces"
    spec = _fixed_spec(engine_options={"latency_s": 0.0, "die_once": str(tmp_path / "died"), "die_after": 16,
                                       "die_traced": str(traces)}, concurrency=1, trace_dir=str(traces))
    with RayCollector(RayConfig(address="auto", rollout_workers=2), spec, run_id="m") as collector:
        for iteration in range(2):
            collector.collect(SCENARIOS, 3, iteration, seed=1)
        assert (tmp_path / "died").exists() and collector.replaced == 1
    mined = mine([str(traces)])
    planned = [f"m-it{it}-s{i}-{j}" for it in range(2) for i in range(4) for j in range(3)]
    assert sorted(mined.episode_ids) == sorted(planned)  # each episode exactly once
    sizes = mined.actions.groupby("episode_id").size()
    assert (sizes == 2).all(), sizes[sizes != 2]  # whole episodes: no half-run leftover joined to its re-run
    assert re.search(r"dropped [1-9]\d* spans of its unfinished episodes", caplog.text), caplog.text


def test_a_local_cluster_listens_on_loopback_only():
    import subprocess
    import sys

    script = """
import json, psutil
from marft_lg.distributed.config import RayConfig, connect
ray = connect(RayConfig(address="local", rollout_workers=1))
ray.get(ray.remote(lambda: 1).remote())  # a worker process too
info = ray._private.worker.global_worker.node.address_info
listening = []
for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
    try:
        listening += [[p.name(), c.laddr.ip] for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        pass
print(json.dumps({"node": info["node_ip_address"], "gcs": info["gcs_address"], "listening": listening}))
ray.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["node"] == "127.0.0.1" and seen["gcs"].startswith("127.0.0.1:"), seen
    names = {name for name, _ in seen["listening"]}
    assert {"gcs_server", "raylet"} <= names, seen
    outside = [(n, ip) for n, ip in seen["listening"] if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not outside, outside


def test_workers_serve_the_versions_the_learner_serves(cluster):
    serving = {"planner": "v3", "writer": "init"}
    with RayCollector(RayConfig(address="auto", rollout_workers=2), _fixed_spec(), versions=lambda: dict(serving),
                      run_id="v") as collector:
        first = collector.collect(SCENARIOS, 1, 0, seed=0)
        serving["planner"], serving["writer"] = "v4", "v1"  # the learner published new versions
        second = collector.collect(SCENARIOS, 1, 1, seed=0)
    by_agent = lambda ds: dict(zip(ds.actions["agent"], ds.actions["adapter_version"], strict=True))  # noqa: E731
    assert by_agent(first) == {"planner": "v3", "writer": "init"}
    assert by_agent(second) == {"planner": "v4", "writer": "v1"}


def test_a_worker_without_the_registry_loads_a_version_sent_as_files(tmp_path, tiny_model_dir):
    from marft_lg.serving.team import Team

    registry = tmp_path / "registry"
    learner = Team(tiny_model_dir, AGENTS, registry=registry, versions=None, seed=0)
    version = learner.save_version("planner")
    learner.close()
    files = version_files(registry, "planner", version)
    assert any(name.endswith(".safetensors") for name in files)
    worker = RolloutWorker(WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, model=tiny_model_dir,
                                      registry=str(registry), shared_registry=False), 0)
    try:
        assert worker.versions()["planner"] == "init"
        assert worker.load({"planner": version}, {"planner": {version: files}})["planner"] == version
        _, dataset, failed = worker.run(plan_episodes("f", SCENARIOS[:1], 1, 0, 0))
        assert not failed and set(dataset.actions["adapter_version"]) == {version, "init"}
    finally:
        worker.close()


def _train_yaml(tmp_path: Path, model: str, *, iterations: int, asynchronous: bool) -> Path:
    (tmp_path / "scenarios.jsonl").write_text("\n".join(json.dumps(
        {"scenario_id": s.scenario_id, "inputs": s.inputs, "split": "train"}) for s in SCENARIOS) + "\n")
    path = tmp_path / "train.yaml"
    path.write_text(f"""
model: {model}
agents: [planner, writer]
registry: registry
versions: null
run_dir: run
reward: {{weights: {{step_count: -0.05}}}}
scenarios: scenarios.jsonl
phases: [online]
online: {{app: "{APPS}:two_agents", iterations: {iterations}, max_tokens: 6}}
marft: {{group_size: 2, ppo_epochs: 1, max_new_tokens: 6}}
ray: {{address: auto, rollout_workers: 2, worker: {{num_cpus: 1, num_gpus: 0}}, async: {str(asynchronous).lower()}}}
""")
    return path


def _train(path: Path) -> list[dict]:
    from typer.testing import CliRunner

    from marft_lg.cli import app as cli

    result = CliRunner().invoke(cli, ["train", "--config", str(path)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (path.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "online"]


def test_train_with_a_ray_section_runs_the_online_phase_on_the_workers(cluster, tmp_path, tiny_model_dir):
    online = _train(_train_yaml(tmp_path, tiny_model_dir, iterations=2, asynchronous=False))
    assert len(online) == 2
    for row in online:
        assert row["rollout_workers"] == 2 and sum(row["episodes_per_worker"].values()) == 8
        assert row["staleness_mean"] == 0.0 and row["trained_agents"]
    from marft_lg.serving.registry.store import AdapterRegistry

    registry = AdapterRegistry(tmp_path / "registry")
    for role in AGENTS:  # one version per update of the role (the end of the run saves no copy of the last one)
        updates = sum(role in r["trained_agents"] for r in online)
        assert len(registry.versions(role)) == max(updates, 1), (role, registry.versions(role))
    candidate = registry.alias("candidate")
    assert all(candidate[role] == registry.versions(role)[-1] for role in AGENTS)


def test_async_rollouts_overlap_the_update_and_record_their_staleness(cluster, tmp_path, tiny_model_dir):
    online = _train(_train_yaml(tmp_path, tiny_model_dir, iterations=3, asynchronous=True))
    assert [r["staleness_mean"] for r in online] == [0.0, 1.0, 1.0]  # after the first, one step off-policy
    assert all(r["trained_agents"] for r in online) and all(sum(r["episodes_per_worker"].values()) == 8 for r in online)


def test_prefetched_episodes_carry_their_staleness(cluster):
    with RayCollector(RayConfig(address="auto", rollout_workers=2, async_=True), _fixed_spec(), run_id="a") as c:
        first = c.collect(SCENARIOS, 1, 0, seed=0)
        c.prefetch(SCENARIOS, 1, 1, seed=0)
        second = c.collect(SCENARIOS, 1, 1, seed=0)
        c.prefetch(SCENARIOS, 1, 2, seed=0)
        third = c.collect(SCENARIOS[:2], 1, 2, seed=0)  # not what was prefetched: run now, nothing stale
    staleness = lambda ds: {m["marft.staleness"] for m in ds.episodes["metadata"]}  # noqa: E731
    assert (staleness(first), staleness(second), staleness(third)) == ({0}, {1}, {0})
    assert len(third.episodes) == 2


def test_the_ray_section_is_checked_with_file_and_line(tmp_path):
    from marft_lg._config import ConfigError, load_yaml

    path = tmp_path / "t.yaml"
    path.write_text("ray:\n  address: somewhere\n  rollout_workers: 2\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2.*local, auto or ray://"):
        RayConfig.from_doc(load_yaml(path).at("ray"))
    path.write_text("ray:\n  rollout_workers: 0\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2.*>= 1"):
        RayConfig.from_doc(load_yaml(path).at("ray"))
    path.write_text("ray:\n  worker: {num_gpu: 1}\n")
    with pytest.raises(ConfigError, match="num_gpus"):
        RayConfig.from_doc(load_yaml(path).at("ray"))
    path.write_text("ray:\n  worker: {engine: sglang}\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2.*hf or vllm"):
        RayConfig.from_doc(load_yaml(path).at("ray"))
    path.write_text("ray: {worker: {num_gpus: 1, engine: vllm}}\n")
    cfg = RayConfig.from_doc(load_yaml(path).at("ray"))
    spec = RayCollector(cfg, WorkerSpec(app="a.py:f", agents=AGENTS)).spec
    assert (cfg.worker.engine, spec.serving) == ("vllm", "vllm")  # the workers start a vLLM server each
    path.write_text("ray: {address: 'ray://head:10001', rollout_workers: 3, async: true}\n")
    cfg = RayConfig.from_doc(load_yaml(path).at("ray"))
    assert (cfg.address, cfg.rollout_workers, cfg.async_) == ("ray://head:10001", 3, True)
    assert RayConfig.from_doc(load_yaml(path).at("missing")) is None


def test_compare_over_ray_equals_the_in_process_compare(cluster):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.loading import load_object
    from marft_lg.rewards.composite import CompositeReward

    spec = _fixed_spec()
    engine = load_object(spec.engine)(spec)
    app = wrap(load_object(spec.app)(TeamChatModel(team=engine)), team=engine, trace_dir=tempfile.mkdtemp())
    reward = CompositeReward.from_yaml({"weights": {"task_completion": 1.0},
                                        "components": {"task_completion": {"match": "contains"}}})
    scenarios = [Scenario(f"s{i}", {"msgs": [f"question {i}"]}, reference=c) for i, c in enumerate("abcdef")]
    kwargs = dict(baseline={"planner": "v1", "writer": "v1"}, candidate={"planner": "v2"}, scenarios=scenarios,
                  reward=reward, samples_per_scenario=2, seed=3, drift=False, progress=False, run_id="cmp")
    local = shadow_compare(app, **kwargs)
    with RayCollector(RayConfig(address="auto", rollout_workers=2), spec, run_id="unused") as runner:
        remote = shadow_compare(app, runner=runner, **kwargs)
    assert remote.n_pairs == local.n_pairs == 6  # a unit per scenario (its samples averaged)
    assert (remote.team.mean, remote.team.low, remote.team.high) == (local.team.mean, local.team.low, local.team.high)
    for side in ("baseline", "candidate"):
        a = getattr(local, side).episodes.sort_values("episode_id").reset_index(drop=True)
        b = getattr(remote, side).episodes.sort_values("episode_id").reset_index(drop=True)
        assert a["episode_id"].tolist() == b["episode_id"].tolist()
        assert a["reward"].tolist() == b["reward"].tolist()
    versions = set(remote.candidate.episodes["episode_id"])
    assert versions and remote.meta["candidate"] == {"planner": "v2", "writer": "v1"}


def test_compare_cli_replays_on_ray_workers(cluster, tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from marft_lg.cli import app as cli

    (tmp_path / "scenarios.jsonl").write_text("\n".join(json.dumps(
        {"scenario_id": s.scenario_id, "inputs": s.inputs, "reference": "a"}) for s in SCENARIOS) + "\n")
    (tmp_path / "reward.yaml").write_text("weights: {task_completion: 1.0}\ncomponents: {task_completion: {match: contains}}\n")
    (tmp_path / "ray.yaml").write_text("ray: {address: auto, rollout_workers: 2}\n")
    result = CliRunner().invoke(cli, [
        "compare", "--scenarios", str(tmp_path / "scenarios.jsonl"), "--app", f"{APPS}:two_agents",
        "--reward", str(tmp_path / "reward.yaml"), "--model", tiny_model_dir, "--agents", "planner,writer",
        "--baseline", "planner=init,writer=init", "--candidate", "planner=init", "--max-tokens", "4", "--no-drift",
        "--ray", str(tmp_path / "ray.yaml"), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    units = json.loads((tmp_path / "cmp" / "decision.json").read_text())
    assert units  # the gate decided on the replays the workers ran
    assert (tmp_path / "cmp" / "report.md").exists()
    ran = re.search(r"replayed on Ray rollout workers: (.*)", result.output)
    assert ran, result.output  # not printed when --ray is ignored and the replays run in this process
    per_worker = dict(item.split(": ") for item in ran.group(1).split(", "))
    assert len(per_worker) == 2 and sum(map(int, per_worker.values())) == 2 * len(SCENARIOS)  # both workers ran


def test_a_job_yaml_takes_the_same_ray_section(tmp_path):
    from marft_lg._config import ConfigError
    from marft_lg.jobs.config import RetrainJob

    job = tmp_path / "job.yaml"
    job.write_text("app: app.py:build\nray: {address: auto, rollout_workers: 3, async: true}\n")
    cfg = RetrainJob.from_yaml(job).ray
    assert isinstance(cfg, RayConfig) and (cfg.rollout_workers, cfg.async_) == (3, True)
    job.write_text("app: app.py:build\nray:\n  rollout_workers: -1\n")
    with pytest.raises(ConfigError, match=r"job.yaml:3"):
        RetrainJob.from_yaml(job)
    job.write_text("app: app.py:build\n")
    assert RetrainJob.from_yaml(job).ray is None


def test_versions_travel_as_files_when_the_workers_share_no_registry(cluster, tmp_path, tiny_model_dir):
    from marft_lg.serving.team import Team

    registry = tmp_path / "registry"
    learner = Team(tiny_model_dir, AGENTS, registry=registry, versions=None, seed=0)
    learner.load_version("planner", learner.save_version("planner"))
    cfg = RayConfig(address="auto", rollout_workers=2, shared_registry=False)
    spec = WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, model=tiny_model_dir, registry=str(registry),
                      max_tokens=4)
    try:
        with RayCollector(cfg, spec, versions=learner.versions, run_id="f") as collector:
            assert collector.spec.shared_registry is False
            dataset = collector.collect(SCENARIOS, 1, 0, seed=0)
    finally:
        learner.close()
    served = dict(zip(dataset.actions["agent"], dataset.actions["adapter_version"], strict=True))
    assert served == {"planner": "v1", "writer": "init"}


def test_replays_that_fail_on_a_runner_count_against_their_own_side():
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.graph.collect import EpisodeFailure
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.trajectories.dataset import TrajectoryDataset

    class FailingRunner:  # every baseline replay raises, as a worker reports it
        failures: list[EpisodeFailure] = []

        def run(self, jobs):
            self.failures = [EpisodeFailure(j.episode_id, j.scenario.scenario_id, "RuntimeError: boom")
                             for j in jobs if "-baseline-" in j.episode_id]
            return TrajectoryDataset()

    reward = CompositeReward.from_yaml({"weights": {"step_count": -0.05}})
    scenarios = [Scenario("a:1", {"msgs": ["x"]}), Scenario("b:2", {"msgs": ["y"]})]  # ids holding a colon
    result = shadow_compare(object(), {"planner": "v1"}, {"planner": "v2"}, scenarios, reward, drift=False,
                            progress=False, runner=FailingRunner(), run_id="c")
    assert result.meta["invoke_failures"] == {"baseline": 2, "candidate": 0}


def test_counterfactual_replays_run_on_the_rollout_workers(cluster, tiny_model_dir):
    from marft_lg.graph.replays import ReplayBudget, plan_replays, sibling_returns, step_order

    spec = WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, model=tiny_model_dir, max_tokens=6, temperature=1.0)
    with RayCollector(RayConfig(address="auto", rollout_workers=2), spec, run_id="cf") as collector:
        ds = collector.collect(SCENARIOS[:2], 2, 0, seed=7)
        batch = plan_replays(ds, {s.scenario_id: s for s in SCENARIOS}, ReplayBudget(per_action=1), seed=3)
        replayed = collector.run(batch.jobs)
    assert len(batch.jobs) == len(ds.actions) == 8
    meta = dict(zip(replayed.episodes["episode_id"], replayed.episodes["metadata"], strict=True))
    assert {m[WORKER_KEY] for m in meta.values()} == {0, 1}  # both workers replayed
    assert all(m["replay_diverged"] is None for m in meta.values())  # a worker holds the learner's record exactly
    for job in batch.jobs:
        rows = replayed.actions[replayed.actions["episode_id"] == job.episode_id].sort_values("order")
        step = step_order(rows, job.replay)
        assert step == job.replay.step
        for k in range(step):
            assert tuple(rows.iloc[k]["completion_token_ids"]) == job.replay.held[k].completion_ids
    usable, lost = sibling_returns(replayed, {e: 0.0 for e in replayed.episode_ids},
                                   {j.episode_id: j.replay for j in batch.jobs})
    assert sum(len(v) for v in usable.values()) == 8 and not lost
