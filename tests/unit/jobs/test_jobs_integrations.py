"""integrations/: the Kubernetes CronJob, its container recipe and the collector config parse and agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.scheduler import cron_trigger

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "integrations" / "kubernetes"
OTEL = REPO / "integrations" / "otel-collector"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    out = {}
    for doc in yaml.safe_load_all((K8S / "cronjob.yaml").read_text()):
        for key in ("apiVersion", "kind", "metadata"):
            assert key in doc, f"a manifest object lacks {key}"
        assert DNS_SUBDOMAIN.match(doc["metadata"]["name"])
        out[doc["kind"]] = doc
    return out


def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_cronjob_has_the_fields_kubernetes_requires(docs):
    cron = docs["CronJob"]
    assert cron["apiVersion"] == "batch/v1"
    assert len(cron["metadata"]["name"]) <= 52  # CronJob names leave room for the Job suffix
    spec = cron["spec"]
    cron_trigger(spec["schedule"], "UTC")  # a valid 5-field cron expression
    assert len(spec["schedule"].split()) == 5
    assert spec["concurrencyPolicy"] in ("Allow", "Forbid", "Replace") and spec["concurrencyPolicy"] == "Forbid"
    job_spec = spec["jobTemplate"]["spec"]
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] in ("OnFailure", "Never")
    if "podFailurePolicy" in job_spec:
        assert pod["restartPolicy"] == "Never"  # required by Kubernetes for podFailurePolicy
    containers = pod["containers"]
    assert containers and all(DNS_LABEL.match(c["name"]) and c["image"] for c in containers)
    names = {c["name"] for c in containers}
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        assert rule["action"] in ("FailJob", "Ignore", "Count", "FailIndex")
        assert rule["onExitCodes"]["containerName"] in names
        assert rule["onExitCodes"]["operator"] in ("In", "NotIn")
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in containers:
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"volumeMount {m['name']} has no volume"
            assert m["mountPath"].startswith("/")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v]
    assert claims == [docs["PersistentVolumeClaim"]["metadata"]["name"]]


def test_the_pod_runs_marft_lg_retrain_on_the_mounted_job_file(docs):
    pod = docs["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    instructions = dockerfile()
    entrypoint = json.loads(next(v for k, v in instructions if k == "ENTRYPOINT"))
    cmd = json.loads(next(v for k, v in instructions if k == "CMD"))
    argv = entrypoint + container.get("args", cmd)
    assert argv[:3] == ["marft-lg", "retrain", "--job"]
    assert cmd == container["args"]  # the image's default is the same run
    job_path = Path(argv[3])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    source = volumes[mounts[str(job_path.parent)]]["configMap"]["name"]
    assert docs["ConfigMap"]["metadata"]["name"] == source and job_path.name in docs["ConfigMap"]["data"]


def test_the_job_in_the_configmap_is_valid_and_keeps_its_state_on_the_shared_volume(docs):
    job = RetrainJob.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"]))
    cron = docs["CronJob"]
    assert job.schedule == cron["spec"]["schedule"]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    data = next(m for m in mounts.values()
                if "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] == m["name"]))
    assert not data.get("readOnly")
    for path in (job.output_dir, job.store_path, job.lock_path, job.registry, *job.traces):
        assert Path(path).is_relative_to(data["mountPath"]), f"{path} is not on the shared volume"
    config_mounts = [m["mountPath"] for m in mounts.values()]
    for path in (job.reward, job.trainer, job.gate, job.scenarios):
        assert any(Path(path).is_relative_to(mp) for mp in config_mounts), f"{path} is not mounted"
    # the pod's grace period is long enough for the run to record 'interrupted' and release its lock
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert pod["securityContext"]["runAsUser"] == int(next(v for k, v in dockerfile() if k == "USER"))


def test_dockerfile_builds_from_repository_files():
    instructions = dockerfile()
    assert instructions[0][0] == "FROM" and instructions[0][1].startswith("python:3.11")
    for key, value in instructions:
        if key == "COPY":
            *sources, _ = value.split()
            for src in sources:
                assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    run = " ".join(v for k, v in instructions if k == "RUN")
    args = dict(v.split("=", 1) for k, v in instructions if k == "ARG" and "=" in v)
    assert args.get("TORCH_INDEX", "").endswith("download.pytorch.org/whl/cpu")  # CPU torch unless built otherwise
    assert "--index-url ${TORCH_INDEX}" in run
    assert 'pip install ".[ray,otlp]"' in run and "ray[default]" in run  # a RayJob submits through the dashboard


def test_collector_writes_otlp_json_lines_where_the_job_mines(docs):
    cfg = yaml.safe_load((OTEL / "collector.yaml").read_text())
    pipelines = cfg["service"]["pipelines"]
    for name, pipe in pipelines.items():
        for section in ("receivers", "processors", "exporters"):
            for comp in pipe.get(section, []):
                assert comp in cfg[section], f"pipeline {name} uses undefined {section[:-1]} {comp}"
    files = [e for e in pipelines["traces"]["exporters"] if e.split("/")[0] == "file"]
    assert len(files) == 1
    exporter = cfg["exporters"][files[0]]
    assert exporter.get("format", "json") == "json" and "compression" not in exporter
    assert "rotation" in exporter and "append" not in exporter  # the exporter rejects rotation + append
    path = Path(exporter["path"])
    assert path.suffix == ".jsonl"
    job = RetrainJob.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"]))
    assert str(path.parent) in job.traces


def test_collector_output_shape_is_read_by_the_trace_reader():
    from marft_lg.tracing.reader import read_spans

    [span] = read_spans([OTEL / "example-spans.jsonl"])
    assert len(span["trace_id"]) == 32 and len(span["span_id"]) == 16
    assert span["attributes"]["marft.episode.id"] == "ep-1"
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 12
    assert span["end_ns"] - span["start_ns"] == 1_500_000_000
