"""integrations/kubernetes/rayjob.yaml: the KubeRay RayJob, its job ConfigMap and the shared volume parse and agree
with each other, with cronjob.yaml / the Dockerfile, with the CLI and with marft_lg's own loaders."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from marft_lg._config import YamlDoc
from marft_lg.distributed.config import RayConfig
from marft_lg.jobs.config import RetrainJob

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "integrations" / "kubernetes"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _load(name: str) -> dict[tuple[str, str], dict]:
    out = {}
    for doc in yaml.safe_load_all((K8S / name).read_text()):
        for key in ("apiVersion", "kind", "metadata"):
            assert key in doc, f"a manifest object in {name} lacks {key}"
        assert DNS_SUBDOMAIN.match(doc["metadata"]["name"])
        out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    return _load("rayjob.yaml")


def _one(docs, kind: str) -> dict:
    [doc] = [d for (k, _), d in docs.items() if k == kind]
    return doc


@pytest.fixture(scope="module")
def rayjob(docs) -> dict:
    return _one(docs, "RayJob")


def _pods(rayjob: dict) -> dict[str, dict]:
    """Pod spec of each group: 'head' and each worker group's name."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster["workerGroupSpecs"]:
        pods[group["groupName"]] = group["template"]["spec"]
    return pods


def _workers(rayjob: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def _job_yaml(docs, rayjob) -> tuple[str, str]:
    """(the job file path the entrypoint names, its text from the ConfigMap mounted there)."""
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    job_path = Path(argv[argv.index("--job") + 1])
    pod = _pods(rayjob)["head"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cm_name = volumes[mounts[str(job_path.parent)]]["configMap"]["name"]
    return str(job_path), docs[("ConfigMap", cm_name)]["data"][job_path.name]


def _cpus(value) -> float:
    s = str(value)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def test_rayjob_kind_and_lifecycle(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0
    assert len(rayjob["metadata"]["name"]) <= 47  # KubeRay suffixes the cluster and pod names


def test_entrypoint_runs_marft_lg_retrain_on_the_mounted_job_file(docs, rayjob):
    from typer.main import get_command

    from marft_lg.cli import app

    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:3] == ["marft-lg", "retrain", "--job"]
    retrain = get_command(app).commands["retrain"]
    known = {o for p in retrain.params for o in p.opts}
    assert {a for a in argv[2:] if a.startswith("-")} <= known, "the entrypoint uses a flag retrain does not have"
    job_path, text = _job_yaml(docs, rayjob)  # the entrypoint's path is where the job ConfigMap is mounted
    assert job_path.startswith("/") and yaml.safe_load(text)


def test_head_container_has_image_ports_and_mounts(rayjob):
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # KubeRay: map[string]string
    assert head["rayStartParams"].get("include-dashboard", "true") != "false"  # K8sJobMode submits via the dashboard
    container = head["template"]["spec"]["containers"][0]
    assert container["image"] and DNS_LABEL.match(container["name"])
    assert {p["containerPort"] for p in container["ports"]} >= {6379, 8265}
    assert {m["name"] for m in container["volumeMounts"]} >= {"job", "data"}


def test_worker_groups_rollout_workers_and_a_gpu_learner(rayjob):
    workers = _workers(rayjob)
    assert set(workers) >= {"rollout-workers", "learner"}
    for name, group in workers.items():
        assert group["groupName"] == name and DNS_LABEL.match(name)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    rollout = workers["rollout-workers"]
    assert rollout["replicas"] == 2
    [c] = rollout["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # CPU only
    learner = workers["learner"]
    assert learner["replicas"] == 1
    [c] = learner["template"]["spec"]["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    # the driver asks for a GPU, so it lands on the learner pod (the only group with one)
    assert rayjob["spec"].get("entrypointNumGpus", 0) <= int(c["resources"]["limits"]["nvidia.com/gpu"])


def test_every_pod_uses_the_dockerfile_image_and_user():
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    user = next(line.split()[1] for line in text.splitlines() if line.startswith("USER"))
    cron = _load("cronjob.yaml")
    [cron_job] = [d for (k, _), d in cron.items() if k == "CronJob"]
    image = cron_job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
    for name, pod in _pods(_one(_load("rayjob.yaml"), "RayJob")).items():
        assert {c["image"] for c in pod["containers"]} == {image}, name
        assert pod["securityContext"]["runAsUser"] == int(user), name


def test_every_volume_mount_names_a_volume_of_its_pod(docs, rayjob):
    for name, pod in _pods(rayjob).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}: volumeMount {m['name']} has no volume"
                assert m["mountPath"].startswith("/")
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] != "marft-retrain-config":  # that one the user creates
                assert ("ConfigMap", v["configMap"]["name"]) in docs, f"{name}: ConfigMap {v['configMap']['name']}"


def test_the_shared_volume_is_one_readwritemany_claim_at_one_path_in_every_pod(docs, rayjob):
    pvc = _one(docs, "PersistentVolumeClaim")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    cron_pvc = _one(_load("cronjob.yaml"), "PersistentVolumeClaim")
    assert pvc == cron_pvc  # the same claim as the nightly CronJob's: applying both files changes nothing
    paths = set()
    for name, pod in _pods(rayjob).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        claims = {n: v["persistentVolumeClaim"]["claimName"] for n, v in volumes.items() if "persistentVolumeClaim" in v}
        assert set(claims.values()) == {pvc["metadata"]["name"]}, name
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
        assert len(mounts) == 1 and not mounts[0].get("readOnly"), name
        paths.add(mounts[0]["mountPath"])
    assert len(paths) == 1, f"the registry volume is mounted at different paths: {paths}"


def test_the_job_file_has_a_ray_section_that_joins_the_cluster(docs, rayjob):
    _, text = _job_yaml(docs, rayjob)
    data = yaml.safe_load(text)
    assert data["ray"]["address"] == "auto"
    ray = RayConfig.from_doc(YamlDoc.of(data["ray"], "job.yaml"))
    assert ray is not None and ray.address == "auto" and ray.worker.num_gpus == 0
    # the rollout-workers pods have room for every rollout worker the job asks for
    group = _workers(rayjob)["rollout-workers"]
    [c] = group["template"]["spec"]["containers"]
    pod_cpus = float(group["rayStartParams"].get("num-cpus", _cpus(c["resources"]["limits"]["cpu"])))
    assert group["replicas"] * (pod_cpus // ray.worker.num_cpus) >= ray.rollout_workers


def test_the_job_file_keeps_its_state_on_the_shared_volume_and_its_configs_mounted(docs, rayjob):
    """Every path the run reads or writes is on a volume every pod mounts (the driver may land on any of them)."""
    _, text = _job_yaml(docs, rayjob)
    job = RetrainJob.from_dict(yaml.safe_load(text))
    assert job.app and job.online_iterations > 0  # the rollout workers only run on-policy episodes
    for name, pod in _pods(rayjob).items():
        mounts = pod["containers"][0]["volumeMounts"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        [data_mount] = [m["mountPath"] for m in mounts if "persistentVolumeClaim" in volumes[m["name"]]]
        for path in (job.output_dir, job.store_path, job.lock_path, job.registry, *job.traces):
            assert Path(path).is_relative_to(data_mount), f"{name}: {path} is not on the shared volume"
        for path in (job.reward, job.trainer, job.gate, job.scenarios):
            assert any(Path(path).is_relative_to(m["mountPath"]) for m in mounts), f"{name}: {path} is not mounted"


def test_the_job_file_loads_with_marft_lgs_own_loader_ray_section_included(docs, rayjob, tmp_path):
    _, text = _job_yaml(docs, rayjob)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    job = RetrainJob.from_yaml(path)  # unknown keys, wrong types and bad values would raise ConfigError
    assert isinstance(job.ray, RayConfig) and job.ray.address == "auto"
    written = yaml.safe_load(text)["ray"]
    loaded = job.ray.to_dict()
    assert {k: loaded[k] for k in written if k != "worker"} == {k: v for k, v in written.items() if k != "worker"}
    assert {k: loaded["worker"][k] for k in written.get("worker", {})} == written.get("worker", {})
