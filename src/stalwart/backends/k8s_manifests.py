"""`stalwart k8s manifests --config job.yaml`: the Kubernetes objects that run a job.

The job YAML is a `stalwart run --config` spec plus a `kubernetes:` mapping (`K8sConfig`: image,
the code's directory in it, GPUs resource, requests, the operator's pod template, the durable
checkpoint volume, labels to read topology from, storage or a PostgreSQL Secret). Rendered, in
apply order, all in the job's namespace, which the operator creates (it is not part of the bundle,
so `kubectl delete -f` leaves it and whatever else lives there):

- the API token (a Secret whose value is kept in a local file, so every render gives the same one);
  service accounts for the controller and agents;
- RBAC: the controller may get/list/patch nodes (cordon, label) and create/delete pods in its
  namespace; agents may get nodes (their topology labels);
- a ConfigMap with the job spec and the controller's backend config (the pod template included:
  the controller builds replacement pods from it);
- the durable checkpoint PVC when `checkpoint.size` asks for one (ReadWriteMany: every agent
  mounts it);
- the controller: a PVC for its state (SQLite, the backend's name counter) or a PostgreSQL URL from a
  Secret, a one-replica Deployment (Recreate: never two controllers on one store), a Service;
- one agent pod per machine (N active + S standby + P spare; `kubernetes.agent_pod`) and a
  PodDisruptionBudget that lets a node drain take an agent only while more than N agents run (a
  standby can take over);
- a Job that submits the training job to the controller once it answers.

Every container has resource requests (none is BestEffort).

The command itself (its arguments, a user's mistakes, what it prints) is in `cli/k8s.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
from typing import Any

import yaml

from stalwart.backends import k8s_template
from stalwart.backends.kubernetes import CHECKPOINT_MOUNT, CLUSTER_LABEL, SECRET_KEY, TOKEN_KEY, K8sConfig, agent_pod
from stalwart.backends.statedir import DB_NAME
from stalwart.controller.cluster.standby import standby_count
from stalwart.security import identity
from stalwart.spec import JobSpec

CONTROLLER_LABELS = {"app.kubernetes.io/name": "stalwart-controller"}
CONTROLLER_REQUESTS = {"cpu": "1", "memory": "2Gi"}
SUBMIT_REQUESTS = {"cpu": "100m", "memory": "256Mi"}


def load_job(path: str) -> tuple[dict[str, Any], K8sConfig]:
    """The job spec (validated) and its `kubernetes:` settings from a job YAML."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read job {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"job {path} is not valid YAML: {getattr(e, 'problem', None) or type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"job {path} must be a mapping")
    k8s = data.pop("kubernetes", None)
    if k8s is not None and not isinstance(k8s, dict):
        raise ValueError(f"job {path}: kubernetes must be a mapping")
    cfg = K8sConfig.from_dict(k8s)
    # the code is the image's, not this machine's working directory
    code_dir = data.setdefault("code_dir", cfg.code_dir)
    if not isinstance(code_dir, str) or not code_dir.startswith("/"):
        raise ValueError(f"job {path}: code_dir {code_dir!r} must be an absolute path in the image "
                         f"(default: kubernetes.code_dir, {cfg.code_dir})")
    spec = JobSpec.from_dict(data)
    cfg.gpus = spec.gpus_per_machine
    cfg.heartbeat_s = spec.policy.heartbeat_s
    return spec.to_dict(), cfg


def _meta(cfg: K8sConfig, name: str, labels: dict[str, str] | None = None, namespaced: bool = True) -> dict:
    m: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "stalwart",
                                                  "stalwart.io/cluster": cfg.tag, **(labels or {})}}
    if namespaced:
        m["namespace"] = cfg.namespace
    return m


def _rbac(cfg: K8sConfig) -> list[dict]:
    out: list[dict] = []
    for who, node_verbs, pod_verbs in (("controller", ["get", "list", "watch", "patch"],
                                        ["get", "list", "watch", "create", "delete", "deletecollection"]),
                                       ("agent", ["get"], [])):
        name = f"stalwart-{cfg.tag}-{who}"
        subject = [{"kind": "ServiceAccount", "name": name, "namespace": cfg.namespace}]
        out += [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, name)},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                 "metadata": _meta(cfg, name, namespaced=False),
                 "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": node_verbs}]},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": _meta(cfg, name, namespaced=False), "subjects": subject,
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}}]
        if pod_verbs:
            out += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(cfg, name),
                     "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": pod_verbs}]},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                     "metadata": _meta(cfg, name), "subjects": subject,
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}]
    return out


def _controller(cfg: K8sConfig, spec: dict[str, Any]) -> list[dict]:
    name = cfg.controller_service
    policy = spec.get("policy") or {}
    # workers reach the run's rendezvous store (a port per run) at the pod's own address
    env: list[dict] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                       {"name": "STALWART_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": cfg.token_secret, "key": TOKEN_KEY}}}]
    if cfg.database_secret:
        env.append({"name": "DB_URL", "valueFrom": {"secretKeyRef": {"name": cfg.database_secret, "key": "url"}}})
        db = "$(DB_URL)"
    else:
        db = f"sqlite:///{cfg.state_dir}/{DB_NAME}"     # (the pod's path, not this machine's)
    host = f"{name}.{cfg.namespace}.svc"
    container: dict[str, Any] = {
        "name": "controller", "image": cfg.image,
        "command": ["stalwart", "controller"],
        "args": ["--db", db, "--listen", f"0.0.0.0:{cfg.port}", "--state-dir", cfg.state_dir,
                 "--token-file", "/etc/stalwart-token/token", "--secret-file", "/etc/stalwart-token/secret",
                 "--backend", "/etc/stalwart/backend.json",
                 "--advertise", host, "--store-host", "$(POD_IP)",
                 "--heartbeat", str(policy.get("heartbeat_s", cfg.heartbeat_s)),
                 "--missed-beats", str(policy.get("missed_beats", 3)), "--log-level", "INFO"]
                + (["--checkpoint-dir", cfg.checkpoint_dir] if cfg.checkpoint_dir else []),
        "env": env,
        "resources": {"requests": dict(CONTROLLER_REQUESTS)},
        "ports": [{"name": "api", "containerPort": cfg.port}],
        "readinessProbe": {"httpGet": {"path": "/api/health", "port": cfg.port}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/api/health", "port": cfg.port}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "state", "mountPath": cfg.state_dir},
                         {"name": "config", "mountPath": "/etc/stalwart", "readOnly": True},
                         {"name": "token", "mountPath": "/etc/stalwart-token", "readOnly": True}],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"stalwart-{cfg.tag}"}},
        {"name": "token", "secret": {"secretName": cfg.token_secret}}]
    if cfg.checkpoint_claim:        # (the controller lists and prunes what the agents wrote)
        container["volumeMounts"].append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": cfg.checkpoint_claim}})
    objs: list[dict] = []
    if cfg.database_secret:
        volumes.append({"name": "state", "emptyDir": {}})      # the store is PostgreSQL's
    else:
        pvc = f"stalwart-{cfg.tag}-state"
        objs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(cfg, pvc),
                     "spec": _claim(["ReadWriteOnce"], cfg.storage, cfg.storage_class)})
        volumes.append({"name": "state", "persistentVolumeClaim": {"claimName": pvc}})
    template = {"metadata": {"labels": {**CONTROLLER_LABELS, CLUSTER_LABEL: cfg.tag}},
                "spec": {"serviceAccountName": f"stalwart-{cfg.tag}-controller", "containers": [container],
                         "volumes": volumes}}
    template = k8s_template.apply(template, cfg.controller_pod_template)
    return objs + [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, name, CONTROLLER_LABELS),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": {**CONTROLLER_LABELS, CLUSTER_LABEL: cfg.tag}},
                  "template": template}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name),
         "spec": {"selector": {**CONTROLLER_LABELS, "stalwart.io/cluster": cfg.tag},
                  "ports": [{"name": "api", "port": cfg.port, "targetPort": cfg.port}]}},
    ]


def _claim(modes: list[str], size: str, storage_class: str | None) -> dict[str, Any]:
    claim: dict[str, Any] = {"accessModes": modes, "resources": {"requests": {"storage": size}}}
    if storage_class:
        claim["storageClassName"] = storage_class
    return claim


def _checkpoint_pvc(cfg: K8sConfig) -> list[dict]:
    ck = cfg.checkpoint
    if not ck.get("size"):
        return []
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": _meta(cfg, f"stalwart-{cfg.tag}-checkpoints"),
             "spec": _claim(["ReadWriteMany"], str(ck["size"]), ck.get("storage_class"))}]


def _disruption_budget(cfg: K8sConfig, active: int) -> dict:
    """Voluntary evictions (a node drain) may take an agent pod only while more than the job's
    active machines run: a standby takes the evicted one's place. (Agent pods are bare pods: a
    budget over them can only be an integer minAvailable.)"""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(cfg, f"stalwart-{cfg.tag}-agents"),
            "spec": {"minAvailable": active,
                     "selector": {"matchLabels": {"app.kubernetes.io/name": "stalwart-agent", CLUSTER_LABEL: cfg.tag}}}}


def _submit_job(cfg: K8sConfig) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(cfg, f"stalwart-{cfg.tag}-submit"),
            "spec": {"backoffLimit": 20, "template": {"spec": {
                "restartPolicy": "OnFailure",
                "containers": [{"name": "submit", "image": cfg.image, "command": ["stalwart", "submit"],
                                "args": ["--controller", cfg.controller_url, "--config", "/etc/stalwart/job.yaml"],
                                "resources": {"requests": dict(SUBMIT_REQUESTS)},
                                "env": [{"name": "STALWART_TOKEN", "valueFrom": {"secretKeyRef": {
                                    "name": cfg.token_secret, "key": TOKEN_KEY}}}],
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/stalwart",
                                                  "readOnly": True}]}],
                "volumes": [{"name": "config", "configMap": {"name": f"stalwart-{cfg.tag}"}}]}}}}


def render(spec: dict[str, Any], cfg: K8sConfig, token: str, spare: int = 0, secret: str | None = None) -> list[dict]:
    """Every object of the job, in apply order (`token`: the API's, and `secret`: the controller's,
    from which the agents' join tokens derive; both kept by the caller so that renders agree)."""
    js = JobSpec.from_dict(spec)
    cfg = dataclasses.replace(cfg, machines=js.machines + standby_count(js) + spare)
    backend = {"kind": "kubernetes", **dataclasses.asdict(cfg)}
    secret = secret or secrets.token_urlsafe(32)    # the controller's (--secret-file)
    objs: list[dict] = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(cfg, cfg.token_secret), "type": "Opaque",
         "stringData": {TOKEN_KEY: token, SECRET_KEY: secret}},
    ]
    objs += _rbac(cfg)
    objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(cfg, f"stalwart-{cfg.tag}"),
                 "data": {"job.yaml": yaml.safe_dump(spec, sort_keys=False),
                          "backend.json": json.dumps(backend, indent=1)}})
    objs += _checkpoint_pvc(cfg)
    objs += _controller(cfg, spec)
    objs += [agent_pod(cfg, f"m{i}", identity.join_token(secret.encode(), f"m{i}", ttl_s=7 * 86400))
             for i in range(cfg.machines)]
    objs.append(_disruption_budget(cfg, js.machines))
    objs.append(_submit_job(cfg))
    return objs


def token_from(path: str) -> str:
    """The API token kept in `path` (made there, mode 0600, by the first render)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


KUSTOMIZATION = """\
# A kustomize base of one stalwart job, written by `stalwart k8s manifests --kustomize`.
# Overlays may add labels, annotations or objects; shape the agent pods through the job's
# kubernetes.pod_template instead of patches: the controller builds replacement pods from it.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
"""


def write_kustomize(directory: str, objs: list[dict]) -> list[str]:
    """A kustomize base: one file per kind of object and the kustomization listing them."""
    os.makedirs(directory, exist_ok=True)
    groups: dict[str, list[dict]] = {}
    for o in objs:
        groups.setdefault(o["kind"].lower(), []).append(o)
    files = []
    for kind, items in groups.items():
        name = f"{kind}.yaml"
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)      # the Secret: the token
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump_all(items, sort_keys=False))
        os.chmod(path, 0o600)
        files.append(name)
    with open(os.path.join(directory, "kustomization.yaml"), "w") as f:
        f.write(KUSTOMIZATION + "".join(f"- {n}\n" for n in files))
    return files
