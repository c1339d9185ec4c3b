"""Applying a fault on one machine (run by that machine's agent, on the controller's command).

Each kind does the real thing where this host allows it: signals, the cgroup freezer and CPU quota,
`ip link`, `tc tbf`, nftables on the machines' bridge. GPU faults act on the simulated GPU (state
file + the kernel-log line a driver would print) where no GPU exists. Kinds that cannot work here
raise ChaosUnavailable with the reason.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from stalwart.chaos import catalogue
from stalwart.chaos.net import ChaosUnavailable
from stalwart.devices.netns import Machine
from stalwart.devices.simgpu import SimGpu
from stalwart.protocol import WorkerChaos

# Worker-side kinds: forwarded to the worker SDK over the local socket.
SDK_KINDS = {"nan", "user-error", "stage-hang"}


class MachineChaos:
    def __init__(self, machine_id: str, workdir: str, simgpu_path: str, gpus: int,
                 kmsg_path: str, disk_override_path: str, network: dict | None,
                 workers, send_to_worker: Callable[[int, WorkerChaos], None]):
        self.machine_id = machine_id
        self.workdir = workdir
        self.simgpu_path = simgpu_path
        self.gpus = gpus
        self.kmsg_path = kmsg_path
        self.disk_override_path = disk_override_path
        self.network = network          # {"self": machine dict, "machines": {id: machine dict}} or None
        self.workers = workers
        self.send_to_worker = send_to_worker
        self._cgroup = None

    # -- helpers -----------------------------------------------------------------------------
    def _target(self, cmd: dict):
        rank = cmd.get("rank")
        live = [w for w in self.workers.workers if w.proc.poll() is None]
        w = next((w for w in live if w.rank == rank), None) if rank is not None else (live[0] if live else None)
        if w is None:
            raise RuntimeError(f"no live worker for rank {rank} on {self.machine_id}")
        return w

    def _device(self, cmd: dict) -> int:
        if cmd.get("device") is not None:
            return int(cmd["device"])
        if cmd.get("rank") is not None:
            w = self._target(cmd)
            return w.local_rank
        return 0

    def _kmsg(self, line: str) -> None:
        with open(self.kmsg_path, "a") as f:
            f.write(line + "\n")

    def _machine(self, machine_id: str | None = None):
        if not self.network:
            raise ChaosUnavailable(f"needs machines with their own network: {catalogue.ISOLATE_HINT}; "
                                   f"this machine shares the host's network")
        d = self.network["self"] if machine_id is None else self.network["machines"].get(machine_id)
        if d is None:
            raise ChaosUnavailable(f"machine {machine_id} has no network of its own")
        return Machine(**d)

    def _cg(self):
        from stalwart.chaos.cgroup import CgroupChaos
        if self._cgroup is None:
            self._cgroup = CgroupChaos(f"stalwart-{os.getpid()}-{self.machine_id}")
            ok, why = self._cgroup.available()
            if not ok:
                self._cgroup = None
                raise ChaosUnavailable(why)
        return self._cgroup

    def cleanup(self) -> None:
        """Undo what must not outlive the machine's workers (cgroups)."""
        if self._cgroup is not None:
            self._cgroup.destroy()
            self._cgroup = None

    # -- the catalogue ---------------------------------------------------------------------------
    def apply(self, cmd: dict) -> float:
        """Apply `cmd["kind"]`; returns the time the fault took effect."""
        fn = HANDLERS.get(cmd["kind"])
        if fn is None:
            raise ChaosUnavailable(f"chaos kind {cmd['kind']!r} is not known to this agent")
        return fn(self, cmd) or time.time()

    def do_crash(self, cmd):
        os.kill(self._target(cmd).proc.pid, signal.SIGKILL)

    def do_sigstop(self, cmd):
        os.kill(self._target(cmd).proc.pid, signal.SIGSTOP)

    def do_freeze(self, cmd):
        self._cg().freeze(self.workers.all_pids())

    def do_cpu_throttle(self, cmd):
        self._cg().throttle_cpu(self.workers.all_pids(), fraction=float(cmd.get("fraction", 0.1)))

    def do_gpu_xid(self, cmd):
        code, dev = int(cmd.get("code", 79)), self._device(cmd)
        SimGpu(self.simgpu_path, self.gpus).add_xid(dev, code)
        self._kmsg(f"NVRM: Xid (PCI:0000:{0x18 + dev:02x}:00): {code}, pid={os.getpid()}, "
                   f"name=python, GPU has fallen off the bus." if code == 79 else
                   f"NVRM: Xid (PCI:0000:{0x18 + dev:02x}:00): {code}, pid={os.getpid()}, name=python")

    def do_gpu_lost(self, cmd):
        SimGpu(self.simgpu_path, self.gpus).set(self._device(cmd), present=False)

    def do_ecc(self, cmd):
        dev = self._device(cmd)
        SimGpu(self.simgpu_path, self.gpus).set(dev, ecc_dbe=1, retired_pages_pending=True)

    def do_gpu_hot(self, cmd):
        dev = self._device(cmd)
        SimGpu(self.simgpu_path, self.gpus).set(dev, temperature=int(cmd.get("temp", 96)),
                                                throttle=["hw_thermal_slowdown"], clock_sm=600)

    def do_sdc(self, cmd):
        devices = [self._device(cmd)] if cmd.get("rank") is not None else range(self.gpus)
        for dev in devices:
            SimGpu(self.simgpu_path, self.gpus).set(dev, sdc=True)

    def do_nic_down(self, cmd):
        from stalwart.chaos import net
        net.nic_down(self._machine())

    def do_nic_flap(self, cmd):
        from stalwart.chaos import net
        m = self._machine()
        threading.Thread(target=net.nic_flap, args=(m, int(cmd.get("times", 2)),
                                                     float(cmd.get("down_s", 0.5))), daemon=True).start()

    def do_link_slow(self, cmd):
        from stalwart.chaos import net
        net.link_slow(self._machine(), rate=str(cmd.get("rate", "1mbit")))

    def do_partition(self, cmd):
        from stalwart.chaos import net
        peer = cmd.get("peer")
        if peer is None:
            raise ChaosUnavailable("partition needs peer=M (the machine to cut this one off from)")
        net.partition(self._machine(), self._machine(f"m{peer}" if str(peer).isdigit() else str(peer)))

    def do_disk_full(self, cmd):
        tmp = self.disk_override_path + ".tmp"
        with open(tmp, "w") as f:
            f.write("0")
        os.replace(tmp, self.disk_override_path)

    def do_nan(self, cmd):
        self._to_sdk(cmd)

    def do_user_error(self, cmd):
        self._to_sdk(cmd)

    def do_stage_hang(self, cmd):
        self._to_sdk(cmd)

    def _to_sdk(self, cmd):
        ranks = [cmd["rank"]] if cmd.get("rank") is not None else \
            [w.rank for w in self.workers.workers if w.rank is not None]
        params = {k: v for k, v in cmd.items() if k not in ("type", "kind", "rank", "step", "from_step")}
        msg = WorkerChaos(kind=cmd["kind"], rank=cmd.get("rank"), from_step=int(cmd.get("from_step", 0)),
                          params=params)
        for r in ranks:
            self.send_to_worker(r, msg)


# kind -> its handler, one for each kind of the catalogue but `machine-down`, which the agent
# carries out itself (it ends the agent: agent/armed.py). tests/unit/test_chaos_catalogue.py checks
# the two agree, and that the docs' table and some test cover every kind.
AGENT_KINDS = frozenset({"machine-down"})
HANDLERS: dict[str, Callable[[MachineChaos, dict], float | None]] = {
    "crash": MachineChaos.do_crash,
    "sigstop": MachineChaos.do_sigstop,
    "freeze": MachineChaos.do_freeze,
    "cpu-throttle": MachineChaos.do_cpu_throttle,
    "gpu-xid": MachineChaos.do_gpu_xid,
    "gpu-lost": MachineChaos.do_gpu_lost,
    "ecc": MachineChaos.do_ecc,
    "gpu-hot": MachineChaos.do_gpu_hot,
    "sdc": MachineChaos.do_sdc,
    "nic-down": MachineChaos.do_nic_down,
    "nic-flap": MachineChaos.do_nic_flap,
    "link-slow": MachineChaos.do_link_slow,
    "partition": MachineChaos.do_partition,
    "disk-full": MachineChaos.do_disk_full,
    "nan": MachineChaos.do_nan,
    "user-error": MachineChaos.do_user_error,
    "stage-hang": MachineChaos.do_stage_hang,
}
