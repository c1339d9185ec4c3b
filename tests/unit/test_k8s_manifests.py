"""`stalwart k8s manifests`: every rendered object validates against the Kubernetes 1.37 OpenAPI
schemas (strict: no unknown fields) shipped by the pinned `kubernetes-validate`, and holds what the
backend relies on (RBAC to cordon and label nodes, one agent pod per node with host PID/network
and the node's GPUs, the workers in the agent's pod) and what the operator shaped: the pod
template (tolerations, volumes, requests, ...) in every agent pod, the durable checkpoint volume,
requests on every container, a disruption budget, the code from the image, the same token at every
render, no Namespace."""
from __future__ import annotations

import json
import re

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
  checkpoint: {claim: llm-checkpoints}
  pod_template:
    metadata:
      labels: {team: llm}
    spec:
      tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
      priorityClassName: training-high
      imagePullSecrets: [{name: registry-creds}]
      securityContext: {fsGroup: 1000}
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions: [{key: example.com/pool, operator: In, values: [h100]}]
      volumes:
      - name: dataset
        persistentVolumeClaim: {claimName: llm-data, readOnly: true}
      containers:
      - name: agent
        resources:
          requests: {cpu: "96", memory: 1500Gi}
          limits: {vpc.amazonaws.com/efa: "32"}
        volumeMounts: [{name: dataset, mountPath: /data, readOnly: true}]
        env: [{name: NCCL_DEBUG, value: WARN}]
"""


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(JOB)
    return str(p)


def objects(job, **kw):
    spec, cfg = load_job(job)
    return render(spec, cfg, "t0ken", **kw)


def test_every_object_validates_against_the_kubernetes_schemas(job):
    objs = objects(job, spare=1)
    for obj in objs:
        kv.validate(obj, K8S_VERSION, strict=True)      # raises ValidationError with the path
    kinds = [o["kind"] for o in objs]
    assert kinds.count("Pod") == 4 + 1 + 1             # active + standby + spare
    for kind in ("Secret", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ConfigMap",
                 "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget", "Job"):
        assert kind in kinds, kind
    # the namespace is the operator's: `kubectl delete -f` of the bundle must not take it away
    assert "Namespace" not in kinds
    assert all(o["metadata"].get("namespace") == "training" for o in objs if not o["kind"].startswith("Cluster"))


def pod_specs(objs):
    for o in objs:
        if o["kind"] == "Pod":
            yield o["metadata"]["name"], o["spec"]
        elif o["kind"] in ("Deployment", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def test_every_container_requests_resources_and_a_budget_guards_the_agents(job):
    objs = objects(job)
    for name, spec in pod_specs(objs):
        for c in spec["containers"]:
            req = c.get("resources", {}).get("requests", {})
            assert req.get("cpu") and req.get("memory"), (name, c["name"])       # none is BestEffort
    pdb = next(o for o in objs if o["kind"] == "PodDisruptionBudget")
    # a drain may take an agent only while a standby can replace it (4 active of 5 pods)
    assert pdb["spec"]["minAvailable"] == 4
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "stalwart-agent",
                                                     "stalwart.io/cluster": "llm7"}


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
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
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
    # the code is the image's (kubernetes.code_dir), not the directory the renderer ran in
    assert job_spec["code_dir"] == "/app"


def test_code_dir_is_a_path_in_the_image(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(JOB.replace("steps: 1000\n", "steps: 1000\ncode_dir: /opt/llm\n"))
    spec, _ = load_job(str(p))
    assert spec["code_dir"] == "/opt/llm"
    p.write_text(JOB.replace("steps: 1000\n", "steps: 1000\ncode_dir: src\n"))
    with pytest.raises(ValueError, match="must be an absolute path in the image"):
        load_job(str(p))


def agent_container(pod):
    return next(c for c in pod["spec"]["containers"] if c["name"] == "agent")


def carries_the_operators_shape(pod):
    """What the job's pod template and checkpoint settings put in an agent pod."""
    spec = pod["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["priorityClassName"] == "training-high" and spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert spec["securityContext"] == {"fsGroup": 1000} and pod["metadata"]["labels"]["team"] == "llm"
    # the operator's node affinity beside stalwart's one-agent-per-node anti-affinity
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "llm-checkpoints"}
    assert vols["dataset"]["persistentVolumeClaim"]["claimName"] == "llm-data" and "shm" in vols
    agent = agent_container(pod)
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["checkpoints"] == "/var/lib/stalwart-checkpoints" and mounts["dataset"] == "/data"
    assert agent["resources"]["requests"] == {"cpu": "96", "memory": "1500Gi"}
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in agent["env"]
    assert any(e["name"] == "STALWART_JOIN_TOKEN" for e in agent["env"])  # stalwart's own env stays
    assert not any(e["name"] == "STALWART_TOKEN" for e in agent["env"])  # never the operator's token
    assert agent["command"] == ["python", "-m", "stalwart.backends.k8s_agent"]


def test_the_pod_template_and_checkpoint_volume_reach_every_agent_pod_and_the_controller(job):
    objs = objects(job, spare=1)
    pods = [o for o in objs if o["kind"] == "Pod"]
    for pod in pods:
        carries_the_operators_shape(pod)
        kv.validate(pod, K8S_VERSION, strict=True)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    # the controller writes durable checkpoints' paths the agents can open: the same mount
    assert c["args"][c["args"].index("--checkpoint-dir") + 1] == "/var/lib/stalwart-checkpoints"
    assert {"name": "checkpoints", "mountPath": "/var/lib/stalwart-checkpoints"} in c["volumeMounts"]


def test_the_replacement_pod_after_an_eviction_carries_them_too(job, tmp_path):
    """The controller's backend, built from the rendered ConfigMap as in the controller's pod,
    creates the refill's pod through the API (a recorded exchange): the operator's shape is in it."""
    pytest.importorskip("kubernetes")
    from k8sreplay import ReplayServer

    from stalwart.backends.kubernetes import KubernetesBackend
    objs = objects(job)
    backend_json = json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["backend.json"])
    backend_json["state_dir"] = str(tmp_path)
    secret = next(o for o in objs if o["kind"] == "Secret")["stringData"]["secret"]
    (tmp_path / "secret").write_text(secret + "\n")           # as mounted in the controller's pod
    backend_json["secret_file"] = str(tmp_path / "secret")
    created = {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "stalwart-llm7-m5", "namespace": "training"}}
    with ReplayServer([{"request": {"method": "POST", "path": "/api/v1/namespaces/training/pods",
                                    "body": {"metadata": {"name": "stalwart-llm7-m5"}}},
                        "response": {"status": 201, "body": created}}]) as srv:
        from stalwart.backends.kubernetes import K8sConfig
        b = KubernetesBackend(K8sConfig.from_dict(backend_json), api_client=srv.api_client())
        assert b.request(1) == ["m5"]
        srv.check()
    pod = srv.seen[0]["body"]
    carries_the_operators_shape(pod)
    kv.validate(pod, K8S_VERSION, strict=True)


def test_two_renders_give_the_same_token_secret(job, tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert main(["k8s", "manifests", "--config", job, "-o", str(a)]) == 0
    assert main(["k8s", "manifests", "--config", job, "-o", str(b)]) == 0

    def secret(path):
        return next(o for o in yaml.safe_load_all(path.read_text()) if o["kind"] == "Secret")
    assert secret(a) == secret(b) and len(secret(a)["stringData"]["token"]) >= 32
    kept = tmp_path / "stalwart-llm7.token"          # next to the job YAML, made by the first render
    assert kept.read_text().strip() == secret(a)["stringData"]["token"] and oct(kept.stat().st_mode & 0o777) == "0o600"
    # the rest is the same too, but for each agent pod's one-time join token (it carries its expiry)
    join = re.compile(r"(name: STALWART_JOIN_TOKEN\n\s+value: )\S+")
    assert join.sub(r"\1X", a.read_text()) == join.sub(r"\1X", b.read_text())


def test_a_pod_template_that_is_no_pod_spec_is_refused_in_one_line(job, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    for wrong, msg in (("      priorityClassName: training-high\n", "priority_class_name"),
                       ("      - name: agent\n", "command")):
        fix = {"priorityClassName": "      priority_class_name: training-high\n",
               "- name: agent": "      - name: agent\n        command: [sh]\n"}
        new = fix["priorityClassName"] if "priority" in wrong else fix["- name: agent"]
        bad.write_text(JOB.replace(wrong, new))
        assert main(["k8s", "manifests", "--config", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: kubernetes.pod_template") and msg in err and "\n" not in err, err


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
    assert main(["k8s", "manifests", "--config", job, "-o", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert len(docs) == len(objects(job)) and oct(out.stat().st_mode & 0o777) == "0o600"
    capsys.readouterr()
    # --job, the old name of --config, still works and says so
    assert main(["k8s", "manifests", "--job", job, "-o", str(out)]) == 0
    assert "--job is deprecated" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB.replace("  tag: llm7\n", "  tag: llm7\n  imagee: x\n"))
    assert main(["k8s", "manifests", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: kubernetes: unknown key(s) imagee") and "\n" not in err
    assert main(["k8s", "manifests", "--config", str(tmp_path / "none.yaml")]) == 2


def test_the_controller_puts_durable_checkpoints_where_it_is_told(tmp_path):
    """The rendered controller's --checkpoint-dir (the agents' shared volume, or a URL); without
    it, <state-dir>/checkpoints."""
    from stalwart.controller.service import Controller
    ctl = Controller(f"sqlite:///{tmp_path}/s.db", str(tmp_path), checkpoint_dir="s3://bucket/llm/")
    try:
        assert ctl.ckpt_dir(3) == "s3://bucket/llm/job3"
    finally:
        ctl.close()
