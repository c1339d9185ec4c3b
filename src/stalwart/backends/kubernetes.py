"""Kubernetes: one agent pod per node (the job's workers run inside it), driven by the official
`kubernetes` Python client (`pip install stalwart[k8s]`).

- The pods are `stalwart-<tag>-m<i>`, one per node (pod anti-affinity), on the host's network and
  PID namespace (NIC probes, py-spy on the workers, the node's /dev/kmsg), holding the node's GPUs.
  `k8s_manifests.py` renders the first N + S + P of them with the controller; this backend makes
  the refills from the same template (`agent_pod`).
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

from stalwart.backends.base import Backend, BackendState

log = logging.getLogger("stalwart.kubernetes")
EVICTED_LABEL = "stalwart.io/evicted"
REASON_ANNOTATION = "stalwart.io/evicted-reason"
CLUSTER_LABEL = "stalwart.io/cluster"
MACHINE_LABEL = "stalwart.io/machine"
TOKEN_KEY = "token"


@dataclass
class K8sConfig:
    """The cluster's settings: the `kubernetes:` section of a job YAML (`stalwart k8s manifests`)
    and the controller's backend config (JSON, mounted from a ConfigMap)."""
    tag: str = "job"                     # names the pods: stalwart-<tag>-m<i>
    namespace: str = "stalwart"
    image: str = "stalwart:0.1.0"        # an image with stalwart and the training code
    gpus: int = 1                        # per node (the job's gpus_per_machine)
    gpu_resource: str = "nvidia.com/gpu"  # "" on CPU nodes
    state_dir: str = "/var/lib/stalwart"
    heartbeat_s: float = 1.0
    host_network: bool = True            # the NIC probe and gloo/NCCL see the node's interfaces
    node_selector: dict[str, str] = field(default_factory=dict)
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
        return cfg

    @property
    def controller_url(self) -> str:
        return f"http://{self.controller_service}.{self.namespace}.svc:{self.port}"

    @property
    def token_secret(self) -> str:
        return f"stalwart-{self.tag}-token"

    def pod_name(self, machine: str) -> str:
        return f"stalwart-{self.tag}-{machine}"


SECRET_KEY = "secret"            # the controller's secret, beside the operator's token in the Secret


def agent_pod(cfg: K8sConfig, machine: str, join_token: str | None = None) -> dict[str, Any]:
    """The agent pod of one machine (a manifest, and what a refill creates). Its credential: a
    one-time join token made for this machine (`stalwart.identity`; the controller's refills make
    one from the controller's secret), never the operator's token, which the user's training
    code would inherit."""
    labels = {"app.kubernetes.io/name": "stalwart-agent", CLUSTER_LABEL: cfg.tag, MACHINE_LABEL: machine}
    resources: dict[str, Any] = {"limits": {cfg.gpu_resource: str(cfg.gpus)}} if cfg.gpu_resource else {}
    if join_token is None:
        from stalwart import auth, identity
        join_token = identity.join_token(auth.read_token_file(cfg.secret_file).encode(), machine)
    env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "STALWART_JOIN_TOKEN", "value": join_token}]
    env += [{"name": k, "value": v} for k, v in sorted(cfg.env.items())]
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
            "name": "agent",
            "image": cfg.image,
            "command": ["python", "-m", "stalwart.backends.k8s_agent"],
            "args": ["--machine-id", machine, "--controller", cfg.controller_url, "--gpus", str(cfg.gpus),
                     "--heartbeat", str(cfg.heartbeat_s), "--switch-label", cfg.switch_label,
                     "--pod-label", cfg.pod_label, "--zone-label", cfg.zone_label],
            "env": env,
            "resources": resources,
            "securityContext": {"capabilities": {"add": ["SYS_PTRACE", "SYSLOG", "NET_ADMIN"]}},
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                             {"name": "work", "mountPath": "/var/lib/stalwart-agent"},
                             {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}],
        }],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}},       # in-memory checkpoints
                    {"name": "work", "emptyDir": {}},
                    {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}}],
    }
    if cfg.node_selector:
        spec["nodeSelector"] = dict(cfg.node_selector)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": cfg.pod_name(machine), "namespace": cfg.namespace, "labels": labels},
            "spec": spec}


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
