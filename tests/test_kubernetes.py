"""The Kubernetes manifests: core kinds validate strictly, CRDs carry what their operators need,
and the Jobs fail fast on exits 2 and 3 while giving SIGTERM time to checkpoint."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
from test_deploy import (
    BIN,
    CRD_KINDS,
    K8S_DIR,
    K8S_OLDEST,
    K8S_VERSION,
    METRICS_PORT,
    k8s_docs,
    of_kind,
    pod_templates,
    run,
)

from zerotuner.errors import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ENVIRONMENT, EXIT_PEER_LOST


@pytest.mark.parametrize("version", [K8S_OLDEST, K8S_VERSION])
def test_core_kinds_validate_strictly(version: str) -> None:
    files = sorted(K8S_DIR.glob("*.yaml"))
    result = run(BIN / "kubernetes-validate", "--strict", "-k", version, *files)
    assert result.returncode == 0, result.stdout + result.stderr
    core = [(p, d) for p, d in k8s_docs() if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    assert {d["kind"] for _, d in core} >= {"Job", "Service", "PersistentVolumeClaim"}
    for path, doc in core:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in (
            result.stdout + result.stderr
        ), f"{path.name}: {doc['kind']} was not validated"


def test_strict_validation_rejects_a_misspelt_field() -> None:
    job = of_kind("Job")[0]
    broken = json.loads(json.dumps(job))
    broken["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_crd_pod_templates_validate_as_core_pod_templates() -> None:
    """CRD schemas are not available offline, but their pod templates are core PodTemplateSpecs."""
    for index, template in enumerate(pod_templates()):
        wrapper = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"t{index}"},
            "template": template,
        }
        kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)


def test_pytorchjob_has_what_the_training_operator_needs() -> None:
    (job,) = of_kind("PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] >= 1
    for spec in replicas.values():
        # ExitCode: 1-127 permanent (our 2, 3 and 4), 128-255 retried (our 143 and 200).
        assert spec["restartPolicy"] == "ExitCode"
        assert 128 <= EXIT_PEER_LOST <= 255
        containers = spec["template"]["spec"]["containers"]
        assert containers[0]["name"] == "pytorch"  # the operator's default container name
        env = {e["name"] for e in containers[0].get("env", [])}
        # Rendezvous comes from the operator's PET_* variables, never hard-coded here.
        assert not env & {"ZT_NNODES", "ZT_NODE_RANK", "ZT_MASTER_ADDR", "ZT_MASTER_PORT"}


def test_podmonitor_scrapes_the_trainer_pods_metrics_port() -> None:
    (monitor,) = of_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for template in pod_templates():
        assert wanted.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == METRICS_PORT
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "zerotuner-metrics"]
    assert service["spec"]["selector"] == wanted


@pytest.mark.parametrize("job", of_kind("Job"), ids=lambda j: j["metadata"]["name"])
def test_jobs_fail_fast_on_exit_2_3_and_4_retry_200_and_checkpoint_on_sigterm(job: dict) -> None:
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert spec["backoffLimit"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    codes = fail["onExitCodes"]
    assert codes["operator"] == "In"
    assert set(codes["values"]) == {EXIT_CONFIG, EXIT_ENVIRONMENT, EXIT_DIVERGED}
    assert codes["containerName"] in {c["name"] for c in pod["containers"]}
    (ignore,) = [r for r in rules if r["action"] == "Ignore"]
    assert ignore["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    # a lost node (exit 200): retried, resuming from the last committed checkpoint
    (retry,) = [r for r in rules if r["action"] == "Count"]
    assert retry["onExitCodes"]["values"] == [EXIT_PEER_LOST]
    assert retry["onExitCodes"]["operator"] == "In"
    assert pod["terminationGracePeriodSeconds"] >= 300
    assert pod["enableServiceLinks"] is False  # a Service `zt` would inject ZT_SERVICE_HOST
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes[mounts["/output"]]
    assert "hostPath" in volumes[mounts["/offload"]]


def test_indexed_job_rendezvous_points_at_pod_zero_through_the_headless_service() -> None:
    (job,) = [j for j in of_kind("Job") if j["spec"].get("completionMode") == "Indexed"]
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    service_name = pod["subdomain"]
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == service_name]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # rendezvous precedes readiness
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert env["ZT_MASTER_ADDR"]["value"] == f"{name}-0.{service_name}"
    assert int(env["ZT_NNODES"]["value"]) == spec["completions"] == spec["parallelism"]
    rank = env["ZT_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
