"""What runs in each agent pod: reads the node's topology labels from the Kubernetes API (the pod's
service account may get nodes), then becomes the machine's agent (`stalwart agent … --label
switch=… --label kubernetes.node=…`), its token from $STALWART_TOKEN (a Secret)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from stalwart.backends.kubernetes import _default_client, node_labels

log = logging.getLogger("stalwart.kubernetes")


def agent_argv(a: argparse.Namespace, labels: dict[str, str], env: dict[str, str]) -> list[str]:
    argv = [sys.executable, "-m", "stalwart.cli", "agent", "--controller", a.controller, "--machine-id", a.machine_id,
            "--workdir", os.path.join(a.workdir, a.machine_id), "--gpus", str(a.gpus),
            "--heartbeat", str(a.heartbeat), "--address", env.get("POD_IP") or "127.0.0.1"]
    for k, v in sorted(labels.items()):
        argv += ["--label", f"{k}={v}"]
    return argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.backends.k8s_agent")
    ap.add_argument("--machine-id", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--workdir", default="/var/lib/stalwart-agent")
    ap.add_argument("--switch-label", default="stalwart.io/switch")
    ap.add_argument("--pod-label", default="stalwart.io/pod")
    ap.add_argument("--zone-label", default="topology.kubernetes.io/zone")
    a = ap.parse_args(argv)
    node = os.environ.get("NODE_NAME", "")
    labels: dict[str, str] = {}
    if node:
        from kubernetes import client
        try:
            labels = node_labels(client.CoreV1Api(_default_client()), node, a.switch_label, a.pod_label,
                                 a.zone_label)
        except Exception as e:       # the agent runs without topology labels rather than not at all
            print(f"warning: cannot read node {node}'s labels: {e}", file=sys.stderr)
            labels = {"kubernetes.node": node}
    args = agent_argv(a, labels, dict(os.environ))
    sys.stdout.flush()
    os.execv(args[0], args)
    return 0     # not reached


if __name__ == "__main__":
    sys.exit(main())
