"""The agent's checkpoint manager: every-step shards in shared memory, backups on a peer, a durable tier.

Workers write their own round-robin slot shards into the machine's shm dir (worker/memckpt.py).
This manager, off the training processes:
- notices each new complete own shard, reports it, and streams it to this machine's backup peer
  (a machine that shares none of the rank's parallel groups; chosen by the controller from
  `topology`) — newest step wins, at the pace `pacing` decides from the push's measured cost
  (every step unless pushes would take more than a budget of a step's time); the newest step
  not pushed goes when the workers stop;
- persists every K-th step to the durable tier (a local dir or any fsspec URL), asynchronously;
- serves and stores peers' backups (PeerServer);
- at restore, materializes the shard each rank must start from, trying the tiers the controller
  named in order (own memory, a backup peer's memory, durable), verifying checksums and the MAC
  under the job's key, so a corrupt, missing or forged copy falls back to the next tier (the
  `restore_source` report names why) and never to a silent wrong state.

The job's checkpoint key comes with each `start` (`CkptPlan.key`): the peer server and client
authenticate every connection with it (`peerauth`), and the workers' commit threads MAC their
shards with it, reading it from a 0600 file in this machine's private memory directory
(`memckpt.key_path`; never their environment). Until a job's key arrives the server holds a
random one: it serves nobody (an agent that restarted takes the key its memory directory
holds). It listens on the machine's address, not on every interface.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import threading
import time
from typing import Callable

import msgspec

from stalwart import protocol as p
from stalwart.agent import pacing
from stalwart.agent.paths import secure_dir
from stalwart.agent.peerxfer import PeerClient, PeerServer
from stalwart.agent.shards import ShardStore
from stalwart.worker import memckpt
from stalwart.errors import StalwartError

SCAN_EVERY_S = 1.0      # the fallback scan of the shared memory (announcements do the rest)
FLUSH_WAIT_S = 1.0      # how long a stop waits for its deferred backups to reach the peer
# A rank's memory copies (own, a peer's backup) are reported to the controller at most this often
# (the agent's default; 0 reports every one). The controller plans a restore from what each
# stopped machine lists in its `stopped` report; these reports keep its view fresh between
# failures (status, and a machine that never says it stopped), a second old at most. Every step
# reported was two thirds of the events a training job sent, and of the controller's work on them.
ANNOUNCE_EVERY_S = 1.0
log = logging.getLogger("stalwart.agent")


class RestoreFailed(StalwartError, RuntimeError):
    """No tier holds a valid copy of a rank's shard for the requested step."""


class CkptManager:
    def __init__(self, machine_id: str, root: str, emit: Callable[[p.Event], None], peer_host: str = "127.0.0.1",
                 announce_every_s: float = 0.0):
        self.machine_id = machine_id
        self.announce_every_s = announce_every_s
        self._announced: dict[tuple[int, str], float] = {}    # (rank, tier) -> when last reported
        self._held: dict[tuple[int, str], p.Ckpt] = {}          # (rank, tier) -> newest report not sent
        self._limiting = True                                 # a run trains (see workers_stopped)
        self.root = root
        self.shm_dir = os.path.join(root, "own")
        self.backup_dir = os.path.join(root, "backup")
        self.restore_dir = os.path.join(root, "restore")
        self.emit = emit
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        secure_dir(root)                        # (a rank's state: this user's alone)
        for d in (self.shm_dir, self.backup_dir, self.restore_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        # peers' backups: keep more than the controller counts on, so a report still in flight
        # never points at a pruned copy
        self.store = ShardStore(self.shm_dir, self.backup_dir, keep_backup=4)
        # the holder of a backup reports it (it may wait for company in the outbox: the copy dies
        # with this machine), not its pusher (whose report had to go at once, a request per rank
        # per step: the pusher may die right after the push, its backup living on here)
        # an agent that restarted finds its job's key where it left it (the memory outlives it)
        try:
            self.key = memckpt.read_key(memckpt.key_path(self.shm_dir))
        except ValueError:
            self.key = None
        self.server = PeerServer(peer_host, 0, self.store, on_stored=self._stored,
                                 key=self.key or secrets.token_bytes(memckpt.KEY_BYTES)).start()
        self.peer_addr = (peer_host, self.server.address[1])
        self.client = PeerClient(key=self.key)
        self._cfg_lock = threading.Lock()
        self._backup: dict | None = None        # {"machine": id, "addr": [host, port]}
        self._every = 10
        self._pace = pacing.AUTO                # backup pace: steps between pushes, AUTO measured
        self._pace_cap = 1                      # the slowest pace the own memory covers
        self._lanes: dict[int, pacing.Lane] = {}    # rank -> its backup pacing state
        self._newest: dict[int, str] = {}       # rank -> the path of its newest own shard
        self._seen: dict[int, int] = {}         # rank -> newest own step handled
        self._run: int | None = None            # the run whose copies are announced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ckpt-watch", daemon=True)
        self._thread.start()

    def configure(self, durable_dir: str | None, every: int, backup: dict | None,
                  key: bytes | None = None, backup_every: int = pacing.AUTO, mem_slots: int = 3) -> None:
        """Set up for a run: where durable copies go, how often, which peer holds backups, and
        the job's checkpoint key (None: a controller that gives none; connections and shards
        then go unauthenticated, the agent logs it); the backup pace (`pacing.AUTO`: measured)
        and the workers' shared-memory slots per rank, which bound it (see `pacing`)."""
        if key is not None and key != self.key:
            memckpt.write_key(memckpt.key_path(self.shm_dir), key)
            self.server.key = self.client.key = key
        elif key is None and self.key is not None:
            log.warning("the controller gave no checkpoint key: peer traffic is not authenticated")
        self.key = key
        with self._cfg_lock:
            if durable_dir and durable_dir != self.store.durable_dir:
                old = self.store
                self.store = ShardStore(self.shm_dir, self.backup_dir, durable_dir, keep_backup=4)
                self.server.store = self.store
                old.close()
            self._every = max(1, int(every))
            self._backup = backup
            self._pace = max(pacing.AUTO, int(backup_every))
            self._pace_cap = max(1, int(mem_slots) - 2)
            self._announced.clear()     # a run's first copies are reported at once
            self._held.clear()
            self._limiting = True

    def clear_own(self) -> None:
        """Forget this machine's own shards (a new job, or ranks handed to another machine)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        os.makedirs(self.shm_dir, exist_ok=True)
        self._seen.clear()
        self._lanes.clear()
        self._newest.clear()

    # -- the watcher ------------------------------------------------------------------------
    def _watch(self) -> None:
        # SDK workers announce each complete snapshot (`on_shard`); this slow scan only catches
        # what an announcement missed (a worker killed between its commit and its message)
        while not self._stop.wait(SCAN_EVERY_S):
            try:
                self._scan()
            except Exception as e:   # never let a bad shard stop the watcher
                log.warning("checkpoint watcher: %s", e)

    def on_shard(self, rank: int, step: int, path: str) -> None:
        """A worker committed `step` of `rank` to its slot at `path`."""
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.shm_dir):
            log.warning("rank %s announced a shard outside this machine's memory: %s", rank, path)
            return
        self.store.twins.changed()                  # (a peer's offer may wait for this shard)
        if memckpt.header_step_rank(path) != (step, rank):
            return                                  # (its slot was reused by a newer step already)
        self._handle(rank, [(step, path)])

    def _scan(self) -> None:
        self.store.twins.changed()
        shards: dict[int, list[tuple[int, str]]] = {}
        for rank, step, path in memckpt.list_shards(self.shm_dir):   # sorted by (rank, step)
            shards.setdefault(rank, []).append((step, path))
        for rank, held in shards.items():
            self._handle(rank, held)

    def _handle(self, rank: int, held: list[tuple[int, str]]) -> None:
        """The rank's complete shards in step order: announce, back up and persist the new ones."""
        with self._cfg_lock:
            backup, every, store = self._backup, self._every, self.store
            seen = self._seen.get(rank, -1)
            new = [(s, p) for s, p in held if s > seen]
            if not new:
                return
            step, path = new[-1]
            self._seen[rank] = step
            run = self._run
            lane = pacing.observe_step(self._lanes.get(rank, pacing.Lane()), step, time.monotonic())
            push = backup is not None and pacing.due(lane, step, pacing.interval(lane, self._pace, self._pace_cap))
            self._lanes[rank] = pacing.pushing(lane, step) if push else lane
            self._newest[rank] = path
        ev = p.Ckpt(run=run, rank=rank, step=step, tier="own", holder=self.machine_id)
        if self._due(ev):
            self.emit(ev)
        if push and backup is not None:       # only the newest step goes to the peer
            self._push(backup, rank, step, path, run)
        if not store.durable_dir:
            return
        # every K-th step is made durable, also one that arrived too late to be the newest: the
        # rank's slots still hold the last few steps
        for s, _ in new:
            if (s + 1) % every == 0:
                fut = store.persist(rank, s, or_newer=True)
                fut.add_done_callback(lambda f, r=rank, s=s: self._persisted(f, r, s))

    def _stored(self, hdr: dict, run: int | None) -> None:
        """A peer's shard is stored and verified here: this machine holds its backup."""
        ev = p.Ckpt(run=run, rank=hdr["rank"], step=hdr["step"], tier="backup", holder=self.machine_id)
        if self._due(ev):
            self.emit(ev)

    def _due(self, ev: p.Ckpt) -> bool:
        """Whether to send the report `ev` of a new copy now (see ANNOUNCE_EVERY_S); one held back
        waits, the newest of its rank and tier, for `workers_stopped`."""
        if self.announce_every_s <= 0:
            return True
        key, now = (ev.rank, ev.tier), time.monotonic()
        with self._cfg_lock:
            if self._limiting and now - self._announced.get(key, -math.inf) < self.announce_every_s:
                if ev.step >= self._held.get(key, ev).step:
                    self._held[key] = ev
                return False
            self._announced[key] = now
            self._held.pop(key, None)
            return True

    def workers_stopped(self) -> None:
        """The run's workers are gone: push each rank's newest step the pace deferred (what the
        own memory holds reaches the peer; waited for up to FLUSH_WAIT_S, so the peer's inventory
        has it), then send the reports held back, and every report at once until the next run
        (the controller plans the restore now: a backup still arriving from a peer, newer than
        this machine's inventory, must not wait a second)."""
        flushes = []
        with self._cfg_lock:
            self._limiting = False
            held, self._held = list(self._held.values()), {}
            backup, run = self._backup, self._run
            if backup is not None:
                for rank, lane in self._lanes.items():
                    step = pacing.flush(lane)
                    if step is not None and rank in self._newest:
                        self._lanes[rank] = pacing.pushing(lane, step)
                        flushes.append((rank, step, self._newest[rank]))
        for rank, step, path in flushes:
            self._push(backup, rank, step, path, run)          # type: ignore[arg-type]
        if flushes and not self.client.flush(FLUSH_WAIT_S):
            log.warning("the deferred backups of ranks %s were not stored within %.1fs of the stop",
                        sorted(r for r, _, _ in flushes), FLUSH_WAIT_S)
        for ev in held:
            self.emit(ev)

    def _push(self, backup: dict, rank: int, step: int, path: str, run: int | None) -> None:
        fut = self.client.push(tuple(backup["addr"]), rank, step, path, run=run)
        fut.add_done_callback(lambda f, r=rank, s=step, b=backup, n=run: self._pushed(f, r, s, b, n))

    def _pushed(self, fut, rank: int, step: int, backup: dict, run: int | None = None) -> None:
        try:
            fut.result()             # (the holder reports a stored backup: see _stored)
        except Exception as e:
            log.warning("backup of rank %s step %s to %s failed: %s", rank, step, backup["machine"], e)
            return
        cpu_s = getattr(fut, "cpu_s", 0.0)
        if cpu_s > 0:
            with self._cfg_lock:
                self._lanes[rank] = pacing.observe_push(self._lanes.get(rank, pacing.Lane()), cpu_s)

    def _persisted(self, fut, rank: int, step: int) -> None:
        try:
            url = fut.result()
        except Exception as e:
            log.warning("durable copy of rank %s step %s failed: %s", rank, step, e)
            return
        made = memckpt.parse_name(url.rsplit("/", 1)[-1])
        if made is not None and made[2] != step:
            log.info("rank %s step %s was overwritten before its durable copy; step %s made durable "
                     "instead", rank, step, made[2])
            step = made[2]
        self._report_durable(rank, step, url)

    def _report_durable(self, rank: int, step: int, url: str) -> None:
        raw = memckpt.read_header_bytes(url) if os.path.exists(url) else None
        try:        # (the checksum from where the header has it: a whole parse is tens of KB of JSON)
            checksum = f"{memckpt.header_fields(raw)['checksum']:08x}" if raw else ""
        except memckpt.CorruptShard:
            checksum = ""
        self.emit(p.Ckpt(rank=rank, step=step, tier="durable", location=url, checksum=checksum))

    def announce_durable(self, ranks: list[int]) -> None:
        """Report the newest durable copy of each of `ranks` (a predecessor's): the agent that made
        it may have died before its report left, and a restart that finds no copy in memory must
        not start the job over while one is in durable storage."""
        try:
            newest = self.store.newest_durable(ranks)
        except OSError as e:
            log.warning("cannot list the durable copies of ranks %s: %s", ranks, e)
            return
        for rank, (step, url) in sorted(newest.items()):
            log.info("rank %s: its newest durable copy is step %s (reported again)", rank, step)
            self._report_durable(rank, step, url)

    def inventory(self) -> dict[str, dict[int, list[int]]]:
        """The complete shards this machine holds in memory, by tier (checksums not re-read)."""
        return {tier: {r: sorted(v) for r, v in self.store.steps(tier, verify=False).items()}
                for tier in ("own", "backup")}

    # -- restore ----------------------------------------------------------------------------
    def materialize(self, rank: int, candidates: list[dict]) -> tuple[str, str, list[str]]:
        """(tier, local shard path, errors of the tiers tried before) for the first valid candidate."""
        errors: list[str] = []
        for c in candidates:
            tier, step = c["tier"], int(c["step"])
            try:
                if tier == "own":
                    path = self.store.fetch(rank, step, "own")
                elif tier == "backup" and c.get("holder") == self.machine_id:
                    path = self.store.fetch(rank, step, "backup")
                elif tier == "backup":
                    path = self.client.fetch(tuple(c["addr"]), rank, step, self.restore_dir)
                else:
                    path = self.store.fetch(rank, step, "durable")
                memckpt.verify_shard(path, self.key)
                return tier, path, errors
            except Exception as e:
                errors.append(f"{tier}{'@' + c['holder'] if c.get('holder') else ''}: {e}")
        raise RestoreFailed(f"rank {rank}: no valid copy of step {candidates[0]['step'] if candidates else '?'} "
                            f"({'; '.join(errors) or 'no candidates'})")

    def close(self) -> None:
        self._stop.set()
        self.client.close(timeout=5)
        self.server.stop()
        self.store.close()

    def prepare_run(self, cmd: p.Start, emit: Callable[[p.Event], None]) -> list[dict[str, str]] | None:
        """Checkpoint set-up and restore shards for a run: the extra env of each worker, or None
        (reported as `restore_failed`) when a rank has no valid copy anywhere. A replay's run
        (stop-time diagnostics: a throw-away copy of the job, of its own shape) neither reads nor
        touches the job's copies: the restart after it restores from them."""
        if cmd.spec.replay:
            return [p.rank_env(w) for w in cmd.workers]
        if cmd.ckpt is not None:
            backup = {"machine": cmd.ckpt.backup.machine, "addr": list(cmd.ckpt.backup.addr)} \
                if cmd.ckpt.backup is not None else None
            key = bytes.fromhex(cmd.ckpt.key) if cmd.ckpt.key else None
            self.configure(cmd.ckpt.durable_dir, cmd.ckpt.every, backup, key,
                           backup_every=cmd.ckpt.backup_every, mem_slots=cmd.spec.mem_slots)
        extra = []
        for w in cmd.workers:
            env = p.rank_env(w)
            if w.restore:
                candidates = [msgspec.to_builtins(c) for c in w.restore]
                try:
                    tier, path, errors = self.materialize(w.rank, candidates)
                except RestoreFailed as e:
                    emit(p.RestoreFailed(run=cmd.spec.run, rank=w.rank, step=w.restore[0].step, error=str(e)))
                    return None
                env.update({p.Env.RESTORE_PATH: path, p.Env.RESTORE_TIER: tier})
                emit(p.RestoreSourceUsed(run=cmd.spec.run, rank=w.rank, step=w.restore[0].step, tier=tier,
                                         skipped=errors))
            extra.append(env)
        for w in cmd.workers:
            self.start_from(w.rank, w.restore[0].step if w.restore else -1, cmd.spec.run)
        self.store.twins.expect(w.rank for w in cmd.workers)
        return extra

    def adopt_run(self, run: int) -> None:
        """A restarted agent adopted `run`'s workers: their copies in memory (the next scan
        announces them) and those to come are that run's."""
        with self._cfg_lock:
            self._run = run

    def start_from(self, rank: int, step: int, run: int | None = None) -> None:
        """A run starts `rank` after `step` (its restore is materialized by now): the rank's own
        slots holding later steps belong to the run that stopped and go (a scan would announce
        them, a stale copy, and take their step for the newest seen: the new run's copies of the
        same steps were then never announced, backed up or made durable, and every restore fell
        back to an old durable step); the next step announced is the first after `step`, and
        the copies announced from now on are `run`'s (the controller ignores a stopped run's)."""
        with self._cfg_lock:
            self._run = run
            for _, s, path in memckpt.list_shards(self.shm_dir, rank):
                if s > step:
                    try:
                        os.unlink(path)          # the header: the slot no longer looks complete
                    except FileNotFoundError:
                        pass
            self._seen[rank] = step
            # (the pace's measurements stay; the run's steps count from `step`)
            lane = self._lanes.get(rank, pacing.Lane())
            self._lanes[rank] = pacing.Lane(pushed=step, newest=step, step_s=lane.step_s, cost_s=lane.cost_s)
            self._newest.pop(rank, None)
