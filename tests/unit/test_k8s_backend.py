"""The Kubernetes backend against recorded API exchanges (`k8sreplay.py`): the official client, over
real HTTP, must make exactly the recorded requests (method, path, query, content type, body) for
an eviction (cordon + label + annotate the node, delete the pod), a refill (create the next pod),
the release (delete the cluster's pods) and the agent's topology labels (read its node)."""
from __future__ import annotations

import pytest

from k8sreplay import ReplayServer, load

pytest.importorskip("kubernetes")

from stalwart.backends.kubernetes import K8sConfig, KubernetesBackend, node_labels  # noqa: E402


def backend(srv: ReplayServer, tmp_path) -> KubernetesBackend:
    (tmp_path / "secret").write_text("controller-secret\n")      # (the controller pod mounts it)
    cfg = K8sConfig(tag="llm7", namespace="training", image="registry.example.com/llm:1.0", gpus=8,
                    state_dir=str(tmp_path), machines=5, secret_file=str(tmp_path / "secret"))
    return KubernetesBackend(cfg, api_client=srv.api_client())


def test_evict_refill_release(tmp_path):
    with ReplayServer(load("evict_refill_release.json")) as srv:
        b = backend(srv, tmp_path)
        # the agent said which node it runs on
        b.evict("m1", "stalwart: incident 3: gpu_xid on m1: source=nvml, device=4, xid=79",
                {"kubernetes.node": "gpu-node-2", "switch": "leaf-07"})
        # it did not (an agent from before its labels): the pod says; the pod is gone already
        b.evict("m2", "stalwart: incident 4: machine_lost: m2 missed 3 heartbeats", {})
        assert b.request(1) == ["m5"]          # the manifests made m0..m4
        b.release()
        srv.check()
    # a restarted controller's backend goes on from the saved counter
    with ReplayServer([]) as srv:
        assert backend(srv, tmp_path).state.take_names(1) == ["m6"]


def test_a_refused_patch_is_an_api_error_the_controller_logs(tmp_path):
    from kubernetes.client.exceptions import ApiException
    with ReplayServer(load("forbidden.json")) as srv:
        with pytest.raises(ApiException) as e:
            backend(srv, tmp_path).evict("m1", "stalwart: incident 3: gpu_xid on m1: source=nvml, device=4, xid=79",
                                         {"kubernetes.node": "gpu-node-2"})
        assert e.value.status == 403
        srv.check()


def test_node_topology_labels_for_the_agent(tmp_path):
    from kubernetes import client
    with ReplayServer(load("node_labels.json")) as srv:
        labels = node_labels(client.CoreV1Api(srv.api_client()), "gpu-node-2", "network.example.com/leaf",
                             "stalwart.io/pod", "topology.kubernetes.io/zone")
        srv.check()
    assert labels == {"kubernetes.node": "gpu-node-2", "switch": "leaf-07", "pod": "pod-2", "zone": "us-east-1a"}


def test_the_replay_catches_a_wrong_request(tmp_path):
    """The harness itself: a request that differs from the recording fails the check."""
    ex = load("forbidden.json")
    ex[0]["request"]["content_type"] = "application/merge-patch+json"
    with ReplayServer(ex) as srv:
        with pytest.raises(Exception):
            backend(srv, tmp_path).evict("m1", "stalwart: incident 3: gpu_xid on m1: source=nvml, device=4, xid=79",
                                         {"kubernetes.node": "gpu-node-2"})
        with pytest.raises(AssertionError, match="content_type"):
            srv.check()
