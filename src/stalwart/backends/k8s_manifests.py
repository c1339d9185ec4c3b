"""`stalwart k8s manifests --job job.yaml`: the Kubernetes objects that run a job.

The job YAML is a `stalwart run --config` spec plus a `kubernetes:` mapping (`K8sConfig`: image,
namespace, GPUs resource, node selector, labels to read topology from, storage or a PostgreSQL
Secret). Rendered, in apply order:

- Namespace; the API token (a Secret, made here); service accounts for the controller and agents;
- RBAC: the controller may get/list/patch nodes (cordon, label) and create/delete pods in its
  namespace; agents may get nodes (their topology labels);
- a ConfigMap with the job spec and the controller's backend config;
- the controller: a PVC for its state (SQLite, the backend's name counter) or a PostgreSQL URL from a
  Secret, a one-replica Deployment (Recreate: never two controllers on one store), a Service;
- one agent pod per machine (N active + S standby + P spare; `kubernetes.agent_pod`);
- a Job that submits the training job to the controller once it answers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from typing import Any

import yaml

from stalwart.backends.statedir import DB_NAME
from stalwart import identity
from stalwart.backends.kubernetes import SECRET_KEY, TOKEN_KEY, K8sConfig, agent_pod

CONTROLLER_LABELS = {"app.kubernetes.io/name": "stalwart-controller"}


def load_job(path: str) -> tuple[dict[str, Any], K8sConfig]:
    """The job spec (validated) and its `kubernetes:` settings from a job YAML."""
    from stalwart.spec import JobSpec
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
    spec = JobSpec.from_dict(data)
    cfg = K8sConfig.from_dict(k8s)
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
    container = {
        "name": "controller", "image": cfg.image,
        "command": ["stalwart", "controller"],
        "args": ["--db", db, "--listen", f"0.0.0.0:{cfg.port}", "--state-dir", cfg.state_dir,
                 "--token-file", "/etc/stalwart-token/token", "--secret-file", "/etc/stalwart-token/secret",
                 "--backend", "/etc/stalwart/backend.json",
                 "--advertise", host, "--store-host", "$(POD_IP)",
                 "--heartbeat", str(policy.get("heartbeat_s", cfg.heartbeat_s)),
                 "--missed-beats", str(policy.get("missed_beats", 3)), "--log-level", "INFO"],
        "env": env,
        "ports": [{"name": "api", "containerPort": cfg.port}],
        "readinessProbe": {"httpGet": {"path": "/api/health", "port": cfg.port}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/api/health", "port": cfg.port}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "state", "mountPath": cfg.state_dir},
                         {"name": "config", "mountPath": "/etc/stalwart", "readOnly": True},
                         {"name": "token", "mountPath": "/etc/stalwart-token", "readOnly": True}],
    }
    pvc = f"stalwart-{cfg.tag}-state"
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": cfg.storage}}}
    if cfg.storage_class:
        claim["storageClassName"] = cfg.storage_class
    return [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(cfg, pvc), "spec": claim},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, name, CONTROLLER_LABELS),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": {**CONTROLLER_LABELS, "stalwart.io/cluster": cfg.tag}},
                  "template": {"metadata": {"labels": {**CONTROLLER_LABELS, "stalwart.io/cluster": cfg.tag}},
                               "spec": {"serviceAccountName": f"stalwart-{cfg.tag}-controller",
                                        "containers": [container],
                                        "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": pvc}},
                                                    {"name": "config", "configMap": {"name": f"stalwart-{cfg.tag}"}},
                                                    {"name": "token", "secret": {"secretName": cfg.token_secret}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name),
         "spec": {"selector": {**CONTROLLER_LABELS, "stalwart.io/cluster": cfg.tag},
                  "ports": [{"name": "api", "port": cfg.port, "targetPort": cfg.port}]}},
    ]


def _submit_job(cfg: K8sConfig) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(cfg, f"stalwart-{cfg.tag}-submit"),
            "spec": {"backoffLimit": 20, "template": {"spec": {
                "restartPolicy": "OnFailure",
                "containers": [{"name": "submit", "image": cfg.image, "command": ["stalwart", "submit"],
                                "args": ["--controller", cfg.controller_url, "--config", "/etc/stalwart/job.yaml"],
                                "env": [{"name": "STALWART_TOKEN", "valueFrom": {"secretKeyRef": {
                                    "name": cfg.token_secret, "key": TOKEN_KEY}}}],
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/stalwart",
                                                  "readOnly": True}]}],
                "volumes": [{"name": "config", "configMap": {"name": f"stalwart-{cfg.tag}"}}]}}}}


def render(spec: dict[str, Any], cfg: K8sConfig, spare: int = 0, token: str | None = None) -> list[dict]:
    """Every object of the job, in apply order."""
    from stalwart.controller.pool import standby_count
    from stalwart.spec import JobSpec
    js = JobSpec.from_dict(spec)
    cfg = dataclasses.replace(cfg, machines=js.machines + standby_count(js) + spare)
    backend = {"kind": "kubernetes", **dataclasses.asdict(cfg)}
    secret = secrets.token_urlsafe(32)        # the controller's (--secret-file): agents' join tokens derive from it
    objs: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(cfg, cfg.namespace, namespaced=False)},
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(cfg, cfg.token_secret), "type": "Opaque",
         "stringData": {TOKEN_KEY: token or secrets.token_urlsafe(32), SECRET_KEY: secret}},
    ]
    objs += _rbac(cfg)
    objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(cfg, f"stalwart-{cfg.tag}"),
                 "data": {"job.yaml": yaml.safe_dump(spec, sort_keys=False),
                          "backend.json": json.dumps(backend, indent=1)}})
    objs += _controller(cfg, spec)
    objs += [agent_pod(cfg, f"m{i}", identity.join_token(secret.encode(), f"m{i}", ttl_s=7 * 86400))
             for i in range(cfg.machines)]
    objs.append(_submit_job(cfg))
    return objs


def cmd_k8s_manifests(a) -> int:
    from stalwart.errors import UserError
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    spec, cfg = load_job(a.job)
    text = yaml.safe_dump_all(render(spec, cfg, a.spare), sort_keys=False)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
        os.chmod(a.output, 0o600)            # it holds the API token
        print(f"wrote {a.output}: kubectl apply -f {a.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("k8s", help="run jobs on Kubernetes").add_subparsers(dest="k8s_cmd", required=True)
    p = s.add_parser("manifests", help="the Kubernetes objects of a job (controller, RBAC, agent pods)")
    p.add_argument("--job", required=True, help="job YAML: a job spec plus a kubernetes: mapping")
    p.add_argument("--spare", type=int, default=0, help="more agent pods beyond the active and standby ones")
    p.add_argument("-o", "--output", help="write here (mode 0600: it holds the API token) instead of stdout")
    p.set_defaults(fn=cmd_k8s_manifests)
