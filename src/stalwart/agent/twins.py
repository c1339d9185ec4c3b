"""Backups without a transfer: a peer's shard held as a reference to an identical local one.

Data-parallel replicas hold the same model and optimizer state after every step, so their
shards of a step are byte-identical (ByteRobust deduplicates model states within the DP group,
ByteCheckpoint style). With the usual placement a rank's backup lands on a machine that runs
one of its DP replicas, whose own slot already holds those very bytes. The pusher therefore
first *offers* the shard's header; the holder looks for a local own shard of the same step with
the same checksum and size (its *twin*) and, when there is one, keeps only the offered header
and where the bytes are: no send, no receive, no copy, no checksum pass, every step.

Such a backup is *virtual*: it lives exactly as long as the twin's slot holds that step, which
is as long as the twin's own copy of it does (a slot is reused `slots` steps later). Anything
that reads the backup tier (the inventory a machine reports when its workers stop, a peer's
fetch or listing, a durable copy) first *materializes* the virtual backups: each is copied from
its twin's slot into an ordinary backup file and checked against the offered checksum; one
whose slot moved on is dropped. A failure stops the workers before the inventory is taken, so
the twins' slots are still then: the newest steps' backups are there, as ordinary shards.

Nothing is assumed about the job: identity is decided by the checksums (which cover the data
and the pickled rest of the state), and each copy is checked again when it is made. The local
rank that matched last is remembered per offered rank; when it has not yet committed the
offered step (replicas finish a step within milliseconds of each other), the offer waits for it
a short while rather than falling back to the network at once.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time

from stalwart.agent.backups import BackupReceiver
from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard

TWIN_WAIT_S = 0.5       # how long an offer waits for its twin to commit the offered step
# A rank whose state differs from its replicas' (per-rank data-loader state, say) never matches:
# after this many offers that found the step here with other bytes, this many are answered
# "send" without looking (then it looks again: a new run may have other neighbours)
MISSES, SKIP = 8, 64
_SLOT_DATA = re.compile(r"^rank(\d{5})\.slot(\d{1,3})\.data$")
log = logging.getLogger("stalwart.agent")


class LocalTwins:
    """Finds, among this machine's own shards, one identical to an offered peer's shard."""

    def __init__(self, shm_dir: str, receiver: BackupReceiver, wait_s: float = TWIN_WAIT_S):
        self.shm_dir = shm_dir
        self.receiver = receiver
        self.wait_s = wait_s
        self._cv = threading.Condition()
        self._gen = 0                              # bumped by every local commit
        self._twin: dict[int, int] = {}            # offered rank -> local rank that matched last
        self._misses: dict[int, int] = {}          # offered rank -> offers in a row without one
        self._skip: dict[int, int] = {}            # offered rank -> offers left to answer unseen
        self._told: set[int] = set()
        self._local: frozenset[int] = frozenset()  # the ranks this machine's run has (`expect`)
        # (rank, step) -> (offered header bytes, its fields, the twin's header path)
        self._virtual: dict[tuple[int, int], tuple[bytes, dict, str]] = {}
        self._materializing = threading.Lock()
        self._slot_paths: dict[int, list[str]] = {}  # local rank -> its slots' header paths

    def offer(self, raw: bytes, fields: dict) -> bool:
        """Hold the offered shard as a virtual backup if a local twin has its bytes."""
        twin = self.find(fields)
        if twin is None:
            return False
        rank, step = fields["rank"], fields["step"]
        with self._cv:
            self._virtual[(rank, step)] = (raw, fields, twin)
            mine = sorted(s for r, s in self._virtual if r == rank)
            for old in mine[:-self.receiver.keep]:
                del self._virtual[(rank, old)]
        return True

    def virtual(self) -> list[tuple[int, int]]:
        """The (rank, step) of the backups held as references, not yet materialized."""
        with self._cv:
            return sorted(self._virtual)

    def materialize(self) -> int:
        """Copy every virtual backup from its twin's slot into an ordinary backup file (checked);
        those whose slot moved on are dropped. Returns how many were made."""
        made = 0
        with self._materializing:
            with self._cv:
                todo, self._virtual = self._virtual, {}
            for (rank, step), (raw, fields, twin) in sorted(todo.items()):
                try:
                    if "meta" not in fields:             # (an offer's fields leave it out)
                        fields = memckpt.header_fields(raw)
                except CorruptShard:
                    continue
                if self.receiver.fill(raw, fields, twin) is not None:
                    made += 1
        return made

    def changed(self) -> None:
        """A local worker committed a shard (the agent's announcement path calls this)."""
        with self._cv:
            self._gen += 1
            self._cv.notify_all()

    def expect(self, ranks) -> None:
        """The ranks this machine runs now: without a known twin, an offer counts as a miss only
        once each of them has reached its step (a replica that has not committed it yet is no
        miss)."""
        with self._cv:
            self._local = frozenset(int(r) for r in ranks)
            self._slot_paths.clear()                 # (a new run may have other slots)

    def twin_of(self, rank: int) -> int | None:
        with self._cv:
            return self._twin.get(rank)

    def find(self, fields: dict) -> str | None:
        """The header path of a local own shard holding the same bytes as the offered one
        (`memckpt.header_fields` of its header), or None."""
        rank, step = fields["rank"], fields["step"]
        with self._cv:
            twin = self._twin.get(rank)
            if twin is None and self._skip.get(rank, 0) > 0:
                self._skip[rank] -= 1
                return None
        deadline = time.monotonic() + (self.wait_s if twin is not None else 0.0)
        while True:
            with self._cv:
                gen = self._gen
            path, local, newest = self._look(fields, twin)
            if path is not None:
                with self._cv:
                    known = self._twin.get(rank)
                    self._twin[rank] = local
                    self._misses.pop(rank, None)
                if known != local:
                    log.info("backups of rank %s are filled from local rank %s's identical shards "
                             "(a data-parallel replica): no transfer", rank, local)
                return path
            left = deadline - time.monotonic()
            if twin is None or newest >= step or left <= 0:
                if newest >= step:               # the step is here, with other bytes
                    self._missed(rank)
                return None
            with self._cv:
                self._cv.wait_for(lambda: self._gen != gen, left)

    def _missed(self, rank: int) -> None:
        with self._cv:
            self._twin.pop(rank, None)
            n = self._misses[rank] = self._misses.get(rank, 0) + 1
            if n < MISSES:
                return
            self._misses[rank], self._skip[rank] = 0, SKIP
            first = rank not in self._told
            self._told.add(rank)
        if first:
            log.info("backups of rank %s are sent in full: no shard here holds the same bytes (its "
                     "state differs from its data-parallel replicas')", rank)

    def _look(self, fields: dict, twin: int | None) -> tuple[str | None, int, int]:
        """(path, its rank, newest) of a local shard matching `fields`; newest: the step every
        local rank looked at (the twin alone, if known) has reached, -1 without any."""
        if twin is not None:
            found = self._look_slots(fields, twin)
            if found is not None:
                return found
        reached: dict[int, int] = {}
        for r, s, path in memckpt.list_shards(self.shm_dir, twin):
            reached[r] = max(reached.get(r, -1), s)
            if s != fields["step"]:
                continue
            mine = _header_at(path)
            if mine is not None and _same_bytes(mine, fields):
                self._remember_slots(r)
                return path, r, s
        if twin is None:
            with self._cv:
                for r in self._local:
                    reached.setdefault(r, -1)
        return None, -1, min(reached.values(), default=-1)

    def _remember_slots(self, rank: int) -> list[str]:
        """Keep (and return) the header paths of `rank`'s slots, in slot order (its data files
        stay while its headers come and go): a known twin's offers read those alone, no listing."""
        slots = []
        for name in os.listdir(self.shm_dir):
            m = _SLOT_DATA.match(name)
            if m and int(m.group(1)) == rank:
                slots.append((int(m.group(2)), os.path.join(self.shm_dir, name[:-len(".data")] + ".hdr")))
        paths = [path for _, path in sorted(slots)]
        with self._cv:
            self._slot_paths[rank] = paths
        return paths

    def _look_slots(self, fields: dict, twin: int) -> tuple[str | None, int, int] | None:
        """`_look` for a known twin through its remembered slots (the step's own slot first, as
        `MemCheckpointer` places it; listed again when the step is in none of them: a slot used
        for the first time); None when none holds a shard."""
        with self._cv:
            paths = self._slot_paths.get(twin)
        step, newest = fields["step"], -1
        for again in (False, True):
            if again or not paths:
                known, paths = paths, self._remember_slots(twin)
                if again and paths == known:
                    break
            first = step % len(paths) if paths else 0
            for path in paths[first:] + paths[:first]:
                mine = _header_at(path)
                if mine is None or mine["rank"] != twin:
                    continue
                if mine["step"] == step and _same_bytes(mine, fields):
                    return path, twin, step
                newest = max(newest, mine["step"])
            if newest >= step:
                break
        return None if newest < 0 else (None, twin, newest)


def _header_at(path: str) -> dict | None:
    """The fields of the shard header at `path` without its metadata; None when there is none."""
    raw = memckpt.read_header_bytes(path)
    try:
        return memckpt.header_fields(raw, meta=False) if raw is not None else None
    except CorruptShard:
        return None


def _same_bytes(mine: dict, fields: dict) -> bool:
    """Do two shards' header fields say they hold the same bytes?"""
    return all(mine[k] == fields[k] for k in ("nbytes", "hash", "checksum"))
