"""A real Slurm 22.05 cluster on this host for tests: a private munged, slurmctld and one
`slurmd -N nodeN` per node, all in a temp dir with their own ports.

As root each node's slurmd runs in its own network namespace (`devices.netns`), so whatever Slurm
starts on the node (the agent, its workers) lives in that node's network, as on a real host: the
node's address is its namespace's, its /etc/hosts maps this host's name to it (gloo binds there),
and slurmctld listens on the bridge's gateway. Without root every node is 127.0.0.1. Every node has
one GPU GRES (backed by /dev/null: the workers' GPUs are simulated), so jobs ask for GPUs as on a
GPU cluster.

Everything is stopped even when a start fails half-way (`stop` is idempotent); `skip_reason()`
says why Slurm cannot run here (binaries missing), for a skip with the reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")


def skip_reason() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: Debian packages slurm-wlm and munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _environ(p) -> dict[str, str]:
    import psutil
    try:
        return p.environ()
    except psutil.Error:
        return {}


class SlurmTestCluster:
    """`nodes` nodes named n1..nN, on switches of `per_switch` nodes (topology/tree), in two
    partitions over the same nodes: `batch` (the default) and `urgent`, whose jobs preempt
    batch's (PreemptMode=CANCEL)."""

    def __init__(self, nodes: int = 4, per_switch: int = 3, netns: bool | None = None):
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.per_switch = per_switch
        self.dir = Path(tempfile.mkdtemp(prefix="swslurm"))     # short: it holds a unix socket
        if netns is None:
            from stalwart.devices import netns as ns
            netns = ns.available()[0]
        self.use_netns = netns
        self.net = None
        self.cgroup_mount: Path | None = None
        self.node_ns: dict[str, str] = {}        # node -> namespace
        self.node_addr: dict[str, str] = {n: "127.0.0.1" for n in self.nodes}
        self.ctl_addr = "127.0.0.1"
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"))

    # -- start ------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "SlurmTestCluster":
        try:
            self._network()
            self._munge()
            self._config()
            self.slurmctld = self._popen([_bin("slurmctld"), "-D", "-i"], "slurmctld.out")
            for n in self.nodes:
                self.start_node(n)
            self.wait_idle(self.nodes, timeout)
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def _network(self) -> None:
        if not self.use_netns:
            return
        from stalwart.devices import netns
        self.net = netns.Network("sl" + os.urandom(3).hex(), state_dir=self.dir / "netns")
        self.net.create()
        self.ctl_addr = self.net.gateway
        # `ip netns exec` mounts a fresh /sys without the host's cgroups, which slurmd 22.05
        # initializes even with proctrack/pgid: show them to it at a path of the mount tree the
        # namespace copies (cgroup.conf's CgroupMountpoint)
        mnt = self.dir / "cgroup"
        mnt.mkdir()
        subprocess.run(["mount", "--rbind", "/sys/fs/cgroup", str(mnt)], check=True, capture_output=True)
        self.cgroup_mount = mnt
        host = socket.gethostname()
        for i, n in enumerate(self.nodes):
            m = self.net.add_machine(i)
            self.node_ns[n], self.node_addr[n] = m.ns, m.address
            # `ip netns exec` binds /etc/netns/<ns>/hosts over /etc/hosts: the host's name is the node's
            (netns.ETC_NETNS / m.ns / "hosts").write_text(f"127.0.0.1 localhost\n{m.address} {host}\n")

    def _munge(self) -> None:
        d = self.dir / "munge"
        d.mkdir()
        d.chmod(0o755)          # munged wants the socket's directory searchable by all
        (d / "key").mkdir(mode=0o700)
        key = d / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (d, d / "key", key):
            shutil.chown(path, "munge", "munge")
        self.dir.chmod(0o755)
        self.munge_socket = d / "munge.sock"
        subprocess.run(["runuser", "-u", "munge", "--", _bin("munged"), "--socket", str(self.munge_socket),
                        "--key-file", str(key), "--pid-file", str(d / "munged.pid"),
                        "--log-file", str(d / "munged.log"), "--seed-file", str(d / "munged.seed")],
                       check=True, capture_output=True, timeout=30)
        self._wait(lambda: self.munge_socket.exists(), 10, "munged did not start")

    def _config(self) -> None:
        d = self.dir
        for sub in ["state", "log"] + [f"spool/{n}" for n in self.nodes]:
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.ctl_port = _free_port()
        lines = [
            "ClusterName=swtest", f"SlurmctldHost=localhost({self.ctl_addr})", f"SlurmctldPort={self.ctl_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n", f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid", f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log", "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
            "SlurmdTimeout=10", "MpiDefault=none", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "PreemptType=preempt/partition_prio", "PreemptMode=CANCEL", "KillWait=5",
            "TopologyPlugin=topology/tree", "SchedulerParameters=defer_batch=0", "GresTypes=gpu",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname=localhost NodeAddr={self.node_addr[n]} "
                         f"Port={_free_port()} CPUs=1 RealMemory=100 Gres=gpu:1 Feature=rack{self._switch(n)}")
        lines.append("PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1")
        lines.append("PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2")
        (d / "slurm.conf").write_text("\n".join(lines) + "\n")
        switches = sorted({self._switch(n) for n in self.nodes})
        topo = [f"SwitchName=leaf{s} Nodes={','.join(n for n in self.nodes if self._switch(n) == s)}"
                for s in switches]
        topo.append(f"SwitchName=spine Switches={','.join(f'leaf{s}' for s in switches)}")
        (d / "topology.conf").write_text("\n".join(topo) + "\n")
        # one "GPU" per node, so jobs can ask for GPUs as on a GPU cluster (--gpus-per-node, --gres);
        # the workers use simulated GPUs
        (d / "gres.conf").write_text(f"NodeName={','.join(self.nodes)} Name=gpu File=/dev/null\n")
        if self.cgroup_mount is not None:
            (d / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={self.cgroup_mount}\n")

    def _switch(self, node: str) -> int:
        return (self.nodes.index(node)) // self.per_switch + 1

    def switch_of(self, node: str) -> str:
        return f"leaf{self._switch(node)}"

    def _popen(self, argv: list[str], log: str, ns: str | None = None) -> subprocess.Popen:
        prefix = ["ip", "netns", "exec", ns] if ns else []
        with open(self.dir / "log" / log, "ab") as out:
            return subprocess.Popen(prefix + argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)

    def start_node(self, node: str) -> None:
        self.slurmd[node] = self._popen([_bin("slurmd"), "-D", "-N", node], f"slurmd-{node}.out",
                                        self.node_ns.get(node))

    def kill_node(self, node: str) -> None:
        """The node dies as a lost host does: its slurmd and everything it runs (SIGKILL)."""
        import psutil
        p = self.slurmd.pop(node)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        doomed = [q for q in self.processes() if _environ(q).get("SLURMD_NODENAME") == node]
        if node in self.node_ns:
            pids = subprocess.run(["ip", "netns", "pids", self.node_ns[node]], capture_output=True, text=True).stdout
            doomed += [psutil.Process(int(x)) for x in pids.split() if psutil.pid_exists(int(x))]
        for q in doomed:
            try:
                q.kill()
            except psutil.Error:
                pass

    # -- queries ----------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        p = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or p.returncode}")
        return p.stdout

    def node(self, name: str) -> dict[str, str]:
        """`scontrol show node NAME` as a dict (State, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "node", name)
        fields: dict[str, str] = {}
        key = None
        for tok in out.strip().split(" "):
            if "=" in tok and not (key == "Reason" and not tok.split("=", 1)[0].isalpha()):
                k, v = tok.split("=", 1)
                if k[:1].isupper() and k.replace("_", "").isalnum():
                    fields[k] = v
                    key = k
                    continue
            if key:
                fields[key] += " " + tok
        return fields

    def wait_idle(self, nodes: list[str], timeout: float) -> None:
        def idle() -> bool:
            try:
                out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            except subprocess.TimeoutExpired:
                return False
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(n, "").startswith("idle") for n in nodes)
        self._wait(idle, timeout, f"nodes {nodes} did not become idle; see {self.dir}/log")

    def wait_idle_count(self, count: int, timeout: float) -> None:
        """Wait until at least `count` nodes are idle (an earlier test's allocations are let go)."""
        def enough() -> bool:
            out = self.run("sinfo", "-h", "-N", "-p", "batch", "-o", "%N %t", check=False)
            return sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"]) >= count
        self._wait(enough, timeout, f"fewer than {count} idle nodes")

    @staticmethod
    def _wait(cond, timeout: float, msg: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(msg)
            time.sleep(0.1)

    # -- stop -------------------------------------------------------------------------------
    def stop(self, keep_logs: bool = False) -> None:
        """Cancel every job, stop the daemons, munged, the namespaces; remove the temp dir (its
        logs go to $STALWART_ARTIFACTS/slurm-logs first when `keep_logs`)."""
        if self.slurmctld is not None and self.slurmctld.poll() is None:
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
            try:        # let Slurm end its steps (agents, workers) before the daemons go
                self._wait(lambda: not self.run("squeue", "-h", check=False).strip(), 20, "")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        for p in list(self.slurmd.values()) + ([self.slurmctld] if self.slurmctld else []):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in list(self.slurmd.values()) + ([self.slurmctld] if self.slurmctld else []):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self.slurmd.clear()
        self.slurmctld = None
        self._kill_leftover_steps()
        pid_file = self.dir / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        if self.net is not None:
            self.net.destroy()
            self.net = None
        if self.cgroup_mount is not None:
            subprocess.run(["umount", "-R", str(self.cgroup_mount)], capture_output=True)
            self.cgroup_mount = None
        if keep_logs and (self.dir / "log").is_dir():
            dest = Path(os.environ.get("STALWART_ARTIFACTS", "/tmp/stalwart-artifacts")) / "slurm-logs"
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(self.dir / "log", dest)
        shutil.rmtree(self.dir, ignore_errors=True)

    def processes(self) -> list:
        """Processes started through this cluster (slurmstepd, agents, workers: their environment
        names its config), not this one."""
        import psutil
        conf = str(self.dir / "slurm.conf")
        out = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == conf:
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def _kill_leftover_steps(self) -> None:
        """What Slurm started outlives a killed slurmd (slurmstepd, the agents under it): end it."""
        import psutil
        for p in self.processes():
            try:
                p.kill()
            except psutil.Error:
                pass

    def __enter__(self) -> "SlurmTestCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
