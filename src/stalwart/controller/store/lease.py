"""Which controller acts: a lease row with a fencing number, in the store the controllers share.

Several `stalwart controller --lease` processes on one database (PostgreSQL; SQLite on one host
works too): one holds the lease and acts, the others wait as standbys. Two rows: the lease (the
holder's name and a fencing number, raised by one at every takeover) and its beat (a counter the
holder raises every `BEAT_S`, apart so that a beat never waits for the holder's other writes). A
standby takes the lease once it has watched the counter stand still for `TAKEOVER_S` of its own
monotonic clock (no two hosts' clocks are compared; a standby that cannot read the rows starts
watching again), by a compare-and-set on the fence and the counter it saw, so two standbys never
both win.

Every write transaction of the holder first reads the lease row FOR SHARE and goes on only while
the fence is its own (`check`, hooked into `Store.write`); a takeover's update of that row waits
for such transactions in flight. A controller that lost its lease (it was paused, partitioned, or
its beats could not reach the database) fails that check on its first write, before anything it
decided is committed or sent: `on_lost` is called, which in the service logs why and exits with
`EXIT_LEASE_LOST`. Its beat finds the same within a beat, even when nothing else writes.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import sqlalchemy as sa

from stalwart.controller.store.db import META, LeaseLost, Store, StoreUnavailable

log = logging.getLogger("stalwart.controller")
BEAT_S = 0.5
TAKEOVER_S = 4.0        # a standby takes over after the counter stood still this long
EXIT_LEASE_LOST = 75    # `stalwart controller` exits with this code when another took its lease
NAME = "controller"          # the lease's row: holder, fence (locked by every fenced write)
BEAT = "controller-beat"     # the beat's row: its counter moves without waiting for those writes

lease = sa.Table(
    "lease", META,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("beat", sa.BigInteger, nullable=False),
    sa.Column("url", sa.Text),                 # where the holder serves its API
)


class _Moved(Exception):
    """The lease changed between the look and the takeover."""


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    def __init__(self, store: Store, holder: str | None = None, url: str | None = None,
                 on_lost: Callable[[str], None] | None = None, beat_s: float = BEAT_S,
                 takeover_s: float = TAKEOVER_S, clock: Callable[[], float] = time.monotonic):
        self.store, self.url = store, url
        self.holder = holder or default_holder()
        self.on_lost = on_lost or (lambda why: None)
        self.beat_s, self.takeover_s, self.clock = beat_s, takeover_s, clock
        self.fence: int | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        lease.create(store.engine, checkfirst=True)

    # -- taking it ----------------------------------------------------------------------------------
    def row(self) -> dict | None:
        """The lease (holder, fence, url) with the beat counter of its beat row."""
        with self.store.bounded(max(self.beat_s, 1.0)):
            rows = self.store.read(lambda c: {r.name: dict(r._mapping) for r in c.execute(
                sa.select(lease).where(lease.c.name.in_([NAME, BEAT])))})
        if NAME not in rows:
            return None
        return dict(rows[NAME], beat=rows.get(BEAT, {}).get("beat", 0))

    def try_acquire(self, seen: dict[str, Any]) -> bool:
        """One look at the row; True when this controller now holds the lease. `seen` carries
        what the previous looks saw ({"key": (fence, beat), "since": monotonic})."""
        try:
            r = self.row()
        except StoreUnavailable:
            seen.clear()            # what cannot be watched does not count as standing still
            return False
        if r is None:
            try:
                with self.store.bounded(max(self.beat_s, 1.0)):
                    self.store.write(lambda c: c.execute(lease.insert(), [
                        dict(name=NAME, holder=self.holder, fence=1, beat=0, url=self.url),
                        dict(name=BEAT, holder=self.holder, fence=1, beat=0, url=None)]))
            except (sa.exc.IntegrityError, StoreUnavailable):
                return False
            self.fence = 1
            return True
        key, now = (r["fence"], r["beat"]), self.clock()
        if seen.get("key") != key:
            seen.update(key=key, since=now, holder=r["holder"])
            return False
        if now - seen["since"] < self.takeover_s:
            return False

        def take(c) -> int:
            # the lease row first: its row lock waits for the old holder's fenced writes in flight
            n = c.execute(lease.update().where((lease.c.name == NAME) & (lease.c.fence == key[0]))
                          .values(holder=self.holder, fence=key[0] + 1, url=self.url)).rowcount
            if n == 1:
                n = c.execute(lease.update().where((lease.c.name == BEAT) & (lease.c.beat == key[1]))
                              .values(holder=self.holder, fence=key[0] + 1, beat=0)).rowcount
            if n != 1:
                raise _Moved()      # (rolls the transaction back: someone else moved first)
            return n
        try:
            with self.store.bounded(max(self.beat_s, 1.0)):
                won = self.store.write(take) == 1
        except _Moved:
            won = False
        except StoreUnavailable:
            seen.clear()
            return False
        if won:
            self.fence = key[0] + 1
            log.warning("took the lease from %s (silent for %.1fs); fence %d", r["holder"], now - seen["since"],
                        self.fence)
        seen.clear()
        return won

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait until this controller holds the lease (False: `stop` was set first)."""
        seen: dict[str, Any] = {}
        said = False
        while not (stop and stop.is_set()):
            if self.try_acquire(seen):
                return True
            if not said and seen.get("holder"):
                log.info("standby: %s holds the lease; waiting for it to go silent", seen["holder"])
                said = True
            time.sleep(self.beat_s / 2)
        return False

    # -- holding it ---------------------------------------------------------------------------------
    def check(self, c: sa.Connection) -> None:
        """In a write transaction: go on only while the fence is this controller's. The row is
        read FOR SHARE (PostgreSQL; SQLite has one writer at a time anyway): a takeover waits
        for this transaction, so nothing of the old holder commits after it."""
        fence = c.execute(sa.select(lease.c.fence).where(lease.c.name == NAME)
                          .with_for_update(read=True)).scalar()
        if fence != self.fence:
            self._lose(f"another controller holds the lease now (this one had fence {self.fence})")

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._stop.set()
            self.on_lost(why)
        raise LeaseLost(why)

    def keep(self) -> threading.Thread:
        """Fence every write of the store from now on, and beat in a thread of its own."""
        self.store.fence = self.check

        def beat() -> None:
            self.store.patient()
            while not self._stop.wait(self.beat_s):
                n = self.store.write(lambda c: c.execute(
                    lease.update().where((lease.c.name == BEAT) & (lease.c.fence == self.fence))
                    .values(beat=lease.c.beat + 1)).rowcount, fenced=False)
                if n != 1:
                    try:
                        self._lose(f"another controller holds the lease now (this one had fence {self.fence})")
                    except LeaseLost:
                        return
        t = threading.Thread(target=beat, name="lease-beat", daemon=True)
        t.start()
        return t

    def release(self) -> None:
        """Stop beating (a clean stop: a standby takes over after TAKEOVER_S)."""
        self._stop.set()
