"""`stalwart k8s manifests`: every rendered object validates against the Kubernetes 1.37 OpenAPI
schemas (strict: no unknown fields) shipped by the pinned `kubernetes-validate`, and holds what the
backend relies on (RBAC to cordon and label nodes, one agent pod per node with host PID/network
and the node's GPUs, the workers in the agent's pod)."""
from __future__ import annotations

import json

import pytest
import yaml

from stalwart.backends.k8s_manifests import load_job, render
from stalwart.cli import main

kv = pytest.importorskip("kubernetes_validate")
K8S_VERSION = "1.37.0"

JOB = """
name: llm
machines: 4
gpus_per_machine: 8
tp: 8
pp: 2
dp: 2
steps: 1000
standby: 1
command: [python, train.py]
kubernetes:
  image: registry.example.com/llm:1.0
  namespace: training
  tag: llm7
  node_selector: {node.kubernetes.io/instance-type: p5.48xlarge}
  switch_label: network.example.com/leaf
"""


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(JOB)
    return str(p)


def objects(job, **kw):
    spec, cfg = load_job(job)
    return render(spec, cfg, **kw)


def test_every_object_validates_against_the_kubernetes_schemas(job):
    objs = objects(job, spare=1)
    for obj in objs:
        kv.validate(obj, K8S_VERSION, strict=True)      # raises ValidationError with the path
    kinds = [o["kind"] for o in objs]
    assert kinds.count("Pod") == 4 + 1 + 1             # active + standby + spare
    for kind in ("Namespace", "Secret", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ConfigMap",
                 "PersistentVolumeClaim", "Deployment", "Service", "Job"):
        assert kind in kinds, kind


def test_a_broken_object_is_refused_by_the_schemas(job):
    pod = next(o for o in objects(job) if o["kind"] == "Pod")
    pod["spec"]["hostPID"] = "yes"
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, K8S_VERSION, strict=True)
    pod["spec"]["hostPID"] = True
    pod["spec"]["containers"][0]["gpus"] = 8             # not a field: strict schemas say so
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, K8S_VERSION, strict=True)


def test_what_the_backend_relies_on(job):
    objs = {(o["kind"], o["metadata"]["name"]): o for o in objects(job)}
    node_rules = objs[("ClusterRole", "stalwart-llm7-controller")]["rules"]
    assert {"patch", "get"} <= set(node_rules[0]["verbs"]) and node_rules[0]["resources"] == ["nodes"]
    pod_rules = objs[("Role", "stalwart-llm7-controller")]["rules"][0]
    assert {"create", "delete"} <= set(pod_rules["verbs"])
    pod = objs[("Pod", "stalwart-llm7-m4")]                    # the standby
    spec = pod["spec"]
    assert spec["hostPID"] and spec["hostNetwork"] and spec["restartPolicy"] == "Never"
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    args = spec["containers"][0]["args"]
    assert args[args.index("--machine-id") + 1] == "m4"
    assert args[args.index("--switch-label") + 1] == "network.example.com/leaf"
    dep = objs[("Deployment", "stalwart-controller")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    backend = json.loads(objs[("ConfigMap", "stalwart-llm7")]["data"]["backend.json"])
    assert backend["kind"] == "kubernetes" and backend["machines"] == 5      # refills start at m5
    job_spec = yaml.safe_load(objs[("ConfigMap", "stalwart-llm7")]["data"]["job.yaml"])
    assert job_spec["machines"] == 4 and "kubernetes" not in job_spec


def test_postgres_instead_of_a_volume(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(JOB.replace("  tag: llm7\n", "  tag: llm7\n  database_secret: llm-db\n"))
    objs = objects(str(p))
    dep = next(o for o in objs if o["kind"] == "Deployment")
    kv.validate(dep, K8S_VERSION, strict=True)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--db") + 1] == "$(DB_URL)"
    assert {"name": "DB_URL", "valueFrom": {"secretKeyRef": {"name": "llm-db", "key": "url"}}} in c["env"]


def test_cli_writes_them_and_refuses_bad_input_in_one_line(job, tmp_path, capsys):
    out = tmp_path / "k8s.yaml"
    assert main(["k8s", "manifests", "--job", job, "-o", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert len(docs) == len(objects(job)) and oct(out.stat().st_mode & 0o777) == "0o600"
    capsys.readouterr()
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB.replace("  tag: llm7\n", "  tag: llm7\n  imagee: x\n"))
    assert main(["k8s", "manifests", "--job", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: kubernetes: unknown key(s) imagee") and "\n" not in err
    assert main(["k8s", "manifests", "--job", str(tmp_path / "none.yaml")]) == 2
