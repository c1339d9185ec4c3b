"""What runs in each agent pod.

- The `agent` container: reads the node's topology labels from the Kubernetes API (the pod's
  service account may get nodes), then becomes the machine's agent (`stalwart agent … --label
  switch=… --label kubernetes.node=…`), its token from $STALWART_TOKEN (a Secret).
- The `training` container (`follow-logs`, the pod's default container): prints the training
  output of one rank as it is written, so `kubectl logs POD` and the cluster's log collectors see
  it: rank `--rank` (0 by default) when this pod holds it, else the pod's first rank; the newest
  run's, starting again at each new run.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from stalwart.agent import keeper
from stalwart.backends.kubernetes import _default_client, node_labels

log = logging.getLogger("stalwart.kubernetes")


def agent_argv(a: argparse.Namespace, labels: dict[str, str], env: dict[str, str]) -> list[str]:
    argv = [sys.executable, "-m", "stalwart.cli", "agent", "--controller", a.controller, "--machine-id", a.machine_id,
            "--workdir", os.path.join(a.workdir, a.machine_id), "--gpus-per-machine", str(a.gpus_per_machine),
            "--heartbeat", str(a.heartbeat), "--address", env.get("POD_IP") or "127.0.0.1"]
    for k, v in sorted(labels.items()):
        argv += ["--label", f"{k}={v}"]
    return argv


_LOG_NAME = re.compile(r"run(\d+)_rank(\d+)\.(out|err)$")


@dataclass
class LogFollower:
    """Follows the worker output files of one agent's log directory (`run<N>_rank<R>.out/.err`)."""
    directory: str
    rank: int = 0
    current: tuple[int, int] | None = None           # (run, rank) being followed
    offsets: dict[str, int] = field(default_factory=dict)

    def pick(self) -> tuple[int, int] | None:
        """The newest run's file of `rank`, else of that run's lowest rank."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return None
        found = sorted({(int(m.group(1)), int(m.group(2))) for m in map(_LOG_NAME.match, names) if m})
        if not found:
            return None
        run = found[-1][0]
        ranks = [r for n, r in found if n == run]
        return (run, self.rank if self.rank in ranks else ranks[0])

    def poll(self) -> list[tuple[str, bytes]]:
        """What was written since the last poll: (`out` or `err`, bytes), a header at a switch."""
        chunks: list[tuple[str, bytes]] = []
        now = self.pick()
        if now is not None and now != self.current:
            self.current, self.offsets = now, {}
            chunks.append(("out", f"== stalwart: run {now[0]}, rank {now[1]} ==\n".encode()))
        if self.current is None:
            return chunks
        for stream in ("out", "err"):
            path = os.path.join(self.directory, f"run{self.current[0]}_rank{self.current[1]}.{stream}")
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(stream, 0))
                    data = f.read()
            except OSError:
                continue
            if data:
                self.offsets[stream] = self.offsets.get(stream, 0) + len(data)
                chunks.append((stream, data))
        return chunks


def follow_logs(argv: list[str], out: BinaryIO | None = None, err: BinaryIO | None = None,
                polls: int | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.backends.k8s_agent follow-logs")
    ap.add_argument("--logs", required=True, help="the agent's worker log directory")
    ap.add_argument("--rank", type=int, default=0, help="whose output (default 0; else the pod's first rank)")
    ap.add_argument("--interval", type=float, default=0.5)
    a = ap.parse_args(argv)
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    follower = LogFollower(a.logs, a.rank)
    n = 0
    while polls is None or n < polls:
        for stream, data in follower.poll():
            dest = out if stream == "out" else err
            dest.write(data)
            dest.flush()
        n += 1
        if polls is None or n < polls:
            time.sleep(a.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["follow-logs"]:
        return follow_logs(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m stalwart.backends.k8s_agent")
    ap.add_argument("--machine-id", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--gpus-per-machine", type=int, default=1)
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
    return keeper.keep(args)        # a dead agent is started again: its workers are adopted, not lost


if __name__ == "__main__":
    sys.exit(main())
