"""Kubernetes: one agent pod per node (the job's workers run inside it), driven by the official
`kubernetes` Python client (`pip install stalwart[k8s]`).

- The pods are `stalwart-<tag>-m<i>`, one per node (pod anti-affinity), on the host's network and
  PID namespace (NIC probes, py-spy on the workers, the node's /dev/kmsg), holding the node's GPUs,
  with resource requests, the durable checkpoint volume (a PVC every agent mounts at the same
  path) and a `training` container that shows a rank's output in `kubectl logs`. The operator's
  pod template (`k8s_template.py`: tolerations, volumes, resources, nodeSelector, affinity, ...) is
  merged into each. `k8s_manifests.py` renders the first N + S + P of them with the controller;
  this backend builds the refills the same way (`agent_pod`, from the same config).
- Eviction cordons the node (`spec.unschedulable`), labels it `stalwart.io/evicted=incident-<n>`
  with the reason as an annotation (what `kubectl get nodes -l stalwart.io/evicted` lists), and
  deletes the machine's pod.
- A refill creates the next pod; the scheduler places it on a node that is neither cordoned nor
  already holding an agent.
- `release` deletes every agent pod of the cluster (label `stalwart.io/cluster=<tag>`).

Not run against a live cluster (none can run where stalwart is developed): the requests are tested
against recorded API exchanges and the manifests against the Kubernetes OpenAPI schemas.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from stalwart.backends import k8s_template
from stalwart.backends.base import Backend, BackendState
from stalwart.security import auth, identity

log = logging.getLogger("stalwart.kubernetes")
EVICTED_LABEL = "stalwart.io/evicted"
REASON_ANNOTATION = "stalwart.io/evicted-reason"
CLUSTER_LABEL = "stalwart.io/cluster"
MACHINE_LABEL = "stalwart.io/machine"
TOKEN_KEY = "token"
AGENT_WORKDIR = "/var/lib/stalwart-agent"
CHECKPOINT_MOUNT = "/var/lib/stalwart-checkpoints"
LOG_CONTAINER = "training"
AGENT_REQUESTS = {"cpu": "2", "memory": "8Gi"}     # an agent and its workers: raise it for real jobs


@dataclass
class K8sConfig:
    """The cluster's settings: the `kubernetes:` section of a job YAML (`stalwart k8s manifests`)
    and the controller's backend config (JSON, mounted from a ConfigMap), so the pods the
    controller makes after an eviction are built as the rendered ones were."""
    tag: str = "job"                     # names the pods: stalwart-<tag>-m<i>
    namespace: str = "stalwart"          # created by the operator (not part of the bundle)
    image: str = "stalwart:0.1.0"        # an image with stalwart and the training code
    code_dir: str = "/app"               # the training code in the image (the job's code_dir)
    gpus: int = 1                        # per node (the job's gpus_per_machine)
    gpu_resource: str = "nvidia.com/gpu"  # "" on CPU nodes
    state_dir: str = "/var/lib/stalwart"
    heartbeat_s: float = 1.0
    host_network: bool = True            # the NIC probe and gloo/NCCL see the node's interfaces
    node_selector: dict[str, str] = field(default_factory=dict)
    pod_template: dict[str, Any] = field(default_factory=dict)             # merged into every agent pod
    controller_pod_template: dict[str, Any] = field(default_factory=dict)  # ... into the controller's
    requests: dict[str, str] = field(default_factory=lambda: dict(AGENT_REQUESTS))  # the agent container's
    checkpoint: dict[str, Any] = field(default_factory=dict)   # the durable tier: claim | size | url
    log_rank: int = 0                    # whose output `kubectl logs` shows (the pod holding it)
    switch_label: str = "stalwart.io/switch"     # node labels copied to the agents' topology labels
    pod_label: str = "stalwart.io/pod"
    zone_label: str = "topology.kubernetes.io/zone"
    controller_service: str = "stalwart-controller"
    port: int = 7420
    storage: str = "10Gi"                # the controller's PVC (SQLite); unused with a database URL
    storage_class: str | None = None
    database_secret: str | None = None   # a Secret whose key `url` holds a PostgreSQL URL
    env: dict[str, str] = field(default_factory=dict)
    machines: int = 0                    # pods m0.. the manifests made; the controller's refills follow
    secret_file: str = "/etc/stalwart-token/secret"   # the controller's secret (its pod mounts it)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "K8sConfig":
        d = dict(d or {})
        d.pop("kind", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"kubernetes: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        cfg = cls(**d)
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?", cfg.tag):
            raise ValueError(f"kubernetes.tag {cfg.tag!r} must be a short DNS label (a-z, 0-9, -)")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", cfg.namespace):
            raise ValueError(f"kubernetes.namespace {cfg.namespace!r} is not a valid namespace name")
        if not isinstance(cfg.code_dir, str) or not cfg.code_dir.startswith("/"):
            raise ValueError(f"kubernetes.code_dir {cfg.code_dir!r} must be an absolute path in the image")
        k8s_template.check(cfg.pod_template, "kubernetes.pod_template")
        k8s_template.check(cfg.controller_pod_template, "kubernetes.controller_pod_template", "controller")
        if not isinstance(cfg.requests, dict) or not all(isinstance(v, str) for v in cfg.requests.values()):
            raise ValueError("kubernetes.requests must map resources to quantities, e.g. {cpu: \"8\", memory: 64Gi}")
        _check_checkpoint(cfg.checkpoint)
        return cfg

    @property
    def controller_url(self) -> str:
        return f"http://{self.controller_service}.{self.namespace}.svc:{self.port}"

    @property
    def token_secret(self) -> str:
        return f"stalwart-{self.tag}-token"

    @property
    def checkpoint_claim(self) -> str | None:
        """The PVC of the durable tier (made by the operator, or rendered from `size`)."""
        if self.checkpoint.get("claim"):
            return str(self.checkpoint["claim"])
        if self.checkpoint.get("size"):
            return f"stalwart-{self.tag}-checkpoints"
        return None

    @property
    def checkpoint_dir(self) -> str | None:
        """Where durable checkpoints go, the same path or URL for the controller and every agent."""
        if self.checkpoint.get("url"):
            return str(self.checkpoint["url"])
        return CHECKPOINT_MOUNT if self.checkpoint_claim else None

    def pod_name(self, machine: str) -> str:
        return f"stalwart-{self.tag}-{machine}"


SECRET_KEY = "secret"            # the controller's secret, beside the operator's token in the Secret


def _check_checkpoint(ck: Any) -> None:
    if not isinstance(ck, dict):
        raise ValueError("kubernetes.checkpoint must be a mapping: {claim: PVC} or {size: 1Ti} or {url: s3://...}")
    unknown = sorted(set(ck) - {"claim", "size", "storage_class", "url"})
    if unknown:
        raise ValueError(f"kubernetes.checkpoint: unknown key(s) {', '.join(unknown)} "
                         "(known: claim, size, storage_class, url)")
    if sum(bool(ck.get(k)) for k in ("claim", "size", "url")) > 1:
        raise ValueError("kubernetes.checkpoint: one of claim (an existing PVC), size (a new one) or url")


def agent_pod(cfg: K8sConfig, machine: str, join_token: str | None = None) -> dict[str, Any]:
    """The agent pod of one machine (a manifest, and what a refill creates), the operator's
    `pod_template` merged in. Its credential: a one-time join token made for this machine
    (`stalwart.security.identity`; the controller's refills make one from the controller's secret), never
    the operator's token, which the user's training code would inherit."""
    labels = {"app.kubernetes.io/name": "stalwart-agent", CLUSTER_LABEL: cfg.tag, MACHINE_LABEL: machine}
    resources: dict[str, Any] = {"requests": dict(cfg.requests)}
    if cfg.gpu_resource:
        resources["limits"] = {cfg.gpu_resource: str(cfg.gpus)}
    if join_token is None:
        join_token = identity.join_token(auth.read_token_file(cfg.secret_file).encode(), machine)
    env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "STALWART_JOIN_TOKEN", "value": join_token}]
    env += [{"name": k, "value": v} for k, v in sorted(cfg.env.items())]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"},
              {"name": "work", "mountPath": AGENT_WORKDIR},
              {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory"}},       # in-memory checkpoints
        {"name": "work", "emptyDir": {}},
        {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}}]
    if cfg.checkpoint_claim:
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": cfg.checkpoint_claim}})
    spec: dict[str, Any] = {
        "serviceAccountName": f"stalwart-{cfg.tag}-agent",
        "restartPolicy": "Never",           # a lost machine is replaced by the controller, not restarted here
        "hostNetwork": cfg.host_network,
        "hostPID": True,                    # py-spy reads the workers' stacks; the host probe sees the node
        "dnsPolicy": "ClusterFirstWithHostNet" if cfg.host_network else "ClusterFirst",
        "terminationGracePeriodSeconds": 30,
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "stalwart-agent", CLUSTER_LABEL: cfg.tag}},
            "topologyKey": "kubernetes.io/hostname"}]}},
        "containers": [{
            "name": k8s_template.AGENT_CONTAINER,
            "image": cfg.image,
            "command": ["python", "-m", "stalwart.backends.k8s_agent"],
            "args": ["--machine-id", machine, "--controller", cfg.controller_url, "--gpus-per-machine", str(cfg.gpus),
                     "--heartbeat", str(cfg.heartbeat_s), "--switch-label", cfg.switch_label,
                     "--pod-label", cfg.pod_label, "--zone-label", cfg.zone_label, "--workdir", AGENT_WORKDIR],
            "env": env,
            "resources": resources,
            "securityContext": {"capabilities": {"add": ["SYS_PTRACE", "SYSLOG", "NET_ADMIN"]}},
            "volumeMounts": mounts,
        }, {
            # `kubectl logs POD` shows this one: the training output of rank `log_rank` (the pod
            # holding it), else of the pod's first rank; the agent's own log is `-c agent`
            "name": LOG_CONTAINER,
            "image": cfg.image,
            "command": ["python", "-m", "stalwart.backends.k8s_agent", "follow-logs"],
            "args": ["--logs", f"{AGENT_WORKDIR}/{machine}/logs", "--rank", str(cfg.log_rank)],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
            "volumeMounts": [{"name": "work", "mountPath": AGENT_WORKDIR, "readOnly": True}],
        }],
        "volumes": volumes,
    }
    if cfg.node_selector:
        spec["nodeSelector"] = dict(cfg.node_selector)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": cfg.pod_name(machine), "namespace": cfg.namespace, "labels": labels,
                        "annotations": {"kubectl.kubernetes.io/default-container": LOG_CONTAINER}},
           "spec": spec}
    return k8s_template.apply(pod, cfg.pod_template)


class KubernetesBackend(Backend):
    kind = "kubernetes"

    def __init__(self, cfg: K8sConfig, api_client: Any = None):
        from kubernetes import client
        self.cfg = cfg
        if api_client is None:
            api_client = _default_client()
        self.core = client.CoreV1Api(api_client)
        self.state = BackendState(os.path.join(cfg.state_dir, "kubernetes"), {"next": cfg.machines})

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> "KubernetesBackend":
        return cls(K8sConfig.from_dict(d))

    def start_agents(self, controller_url: str, count: int) -> list[str]:
        names = self.state.take_names(count)
        for m in names:
            self.core.create_namespaced_pod(self.cfg.namespace, agent_pod(self.cfg, m))
        return names

    def labels(self, node: str) -> dict[str, str]:
        c = self.cfg
        return node_labels(self.core, node, c.switch_label, c.pod_label, c.zone_label)

    def evict(self, machine: str, reason: str, labels: dict[str, str]) -> None:
        node = labels.get("kubernetes.node") or self._node_of(machine)
        if node:
            incident = re.search(r"incident (\d+)", reason)
            self.core.patch_node(node, {
                "spec": {"unschedulable": True},
                "metadata": {"labels": {EVICTED_LABEL: f"incident-{incident.group(1)}" if incident else "true"},
                             "annotations": {REASON_ANNOTATION: reason}}},
                # a dict body is a merge patch (the client's default for a patch is a JSON Patch list)
                _content_type="application/strategic-merge-patch+json")
            log.info("cordoned node %s (%s): %s", node, machine, reason)
        else:
            log.warning("cannot cordon the node of %s: neither its agent nor its pod says which", machine)
        self._delete_pod(machine)

    def _node_of(self, machine: str) -> str | None:
        from kubernetes.client.exceptions import ApiException
        try:
            pod = self.core.read_namespaced_pod(self.cfg.pod_name(machine), self.cfg.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return pod.spec.node_name

    def _delete_pod(self, machine: str) -> None:
        from kubernetes.client.exceptions import ApiException
        try:
            self.core.delete_namespaced_pod(self.cfg.pod_name(machine), self.cfg.namespace, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                raise

    def request(self, count: int) -> list[str]:
        names = self.state.take_names(count)
        for m in names:
            self.core.create_namespaced_pod(self.cfg.namespace, agent_pod(self.cfg, m))
            log.info("created agent pod %s", self.cfg.pod_name(m))
        return names

    def release(self) -> None:
        self.core.delete_collection_namespaced_pod(self.cfg.namespace, label_selector=f"{CLUSTER_LABEL}={self.cfg.tag}")


def node_labels(core: Any, node: str, switch_label: str, pod_label: str, zone_label: str) -> dict[str, str]:
    """A node's topology labels as stalwart's agent takes them: `switch`, `pod`, `zone` from the
    node's labels where it has them; always `kubernetes.node`."""
    meta = core.read_node(node).metadata
    have = dict(meta.labels or {})
    out = {"kubernetes.node": node}
    for ours, theirs in (("switch", switch_label), ("pod", pod_label), ("zone", zone_label)):
        if theirs and have.get(theirs):
            out[ours] = have[theirs]
    return out


def _default_client() -> Any:
    """In a pod: its service account; elsewhere: the kubeconfig."""
    from kubernetes import client, config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
