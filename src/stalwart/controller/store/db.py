"""The controller's store: every job (and its live state), run, machine, incident, event and
checkpoint, through SQLAlchemy.

SQLite by default (a file in the state dir), PostgreSQL in production: one SQLAlchemy URL. The
store is the only state that survives a controller restart, and `stalwart report` reads it directly.
A job core's decision is written in one transaction (`commit`): its events, incident and run rows,
machine roles and the job's saved state together. The operations are typed values (`ops.py`, the
job core's store actions themselves), each with its writer here (`_write`, one `match` over them).

The database is a dependency that fails (a file locked by another process, a PostgreSQL restart or
failover). Every call goes through one path (`_call`): a transaction that fails on a connection or
a lock is rolled back and run again after a backoff (0.05 s doubling to 2 s), on a new connection
where the old one died (`pool_pre_ping` checks a pooled one before use). The controller's own
threads (a job's decisions, the heartbeat monitor) wait as long as the outage lasts (`patient`);
any other caller (an API request) waits at most `BOUNDED_WAIT_S` and gets `StoreUnavailable`
(HTTP 503). `unavailable()` says whether writes fail or hang now: `/api/health` answers 503 from it
(a read that succeeds says nothing about writes, so it never clears it).

With a lease (`controller/store/lease.py`), every write transaction first checks the fence: a controller
whose lease another one took gets `LeaseLost` from its first write, before anything it decided
reaches an agent.

SQLite runs with `synchronous=FULL`: a decision is on disk before its commands leave (the
executor's write-ahead contract; NORMAL may lose the last transactions at a power loss while their
commands are already out). Its cost, measured with `bench/store_outage.py --commit-cost` (one job
decision with a 20 KB state, WAL mode, a virtio disk shared by nine busy sessions, 2026-11-27):
1.3-5.2 ms per commit with NORMAL, 13.8-19.6 ms with FULL. A job commits about once a second
(state saves, transitions; steps' records ride along), so FULL costs it 1-2% of its thread.
The database file and its WAL are made 0600 (they hold job environments).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Never, NoReturn, Sequence, TypeVar

import sqlalchemy as sa

from stalwart.controller.cluster.roles import Role
from stalwart.controller.store import ops
from stalwart.controller.store.ops import StoreOp
from stalwart.errors import StalwartError

log = logging.getLogger("stalwart.store")
T = TypeVar("T")
BOUNDED_WAIT_S = 10.0      # an API request waits this long for the store, then answers 503
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0
STALL_S = 3.0              # a write pending this long counts as an outage (health answers 503)
SQLITE_BUSY_S = 1.0        # SQLite's own wait on a lock before an attempt fails (then: backoff)
PG_IDLE_TX_MS = 5000       # PostgreSQL ends a session idle this long inside a transaction
PG_LOCK_MS = 5000          # ... and fails a statement waiting this long for a lock

META = sa.MetaData()

jobs = sa.Table(
    "jobs", META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
)
runs = sa.Table(
    "runs", META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("start_step", sa.Integer, nullable=False),
    sa.Column("end_step", sa.Integer),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("stopped_at", sa.Float),
    sa.Column("machines", sa.Text, nullable=False),
    sa.Column("restore", sa.Text),
    sa.Column("reason", sa.Text),
    sa.UniqueConstraint("job_id", "seq"),
)
machines = sa.Table(
    "machines", META,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("job_id", sa.Integer),
    sa.Column("address", sa.String(200)),
    sa.Column("info", sa.Text),
    sa.Column("registered_at", sa.Float),
    sa.Column("last_beat", sa.Float),
    sa.Column("reason", sa.Text),
)
incidents = sa.Table(
    "incidents", META,
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), primary_key=True),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),     # per job: 1, 2, 3 ...
    sa.Column("run_seq", sa.Integer),
    sa.Column("symptom", sa.String(64), nullable=False),
    sa.Column("category", sa.String(32), nullable=False),
    sa.Column("cause", sa.Text),
    sa.Column("suspects", sa.Text, nullable=False, default="[]"),
    sa.Column("evicted", sa.Text, nullable=False, default="[]"),
    sa.Column("mechanism", sa.String(32)),
    sa.Column("injected_at", sa.Float),
    sa.Column("detected_at", sa.Float, nullable=False),
    sa.Column("localized_at", sa.Float),
    sa.Column("resumed_at", sa.Float),
    sa.Column("data", sa.Text, nullable=False, default="{}"),
)
events = sa.Table(
    "events", META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, nullable=False, index=True),
    sa.Column("t", sa.Float, nullable=False),
    sa.Column("kind", sa.String(64), nullable=False),
    sa.Column("data", sa.Text, nullable=False),
)
checkpoints = sa.Table(
    "checkpoints", META,
    sa.Column("job_id", sa.Integer, primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("rank", sa.Integer, primary_key=True),
    sa.Column("tier", sa.String(16), primary_key=True),
    sa.Column("location", sa.Text, nullable=False),
    sa.Column("checksum", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

job_state = sa.Table(
    "job_state", META,
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), primary_key=True),
    sa.Column("state", sa.LargeBinary, nullable=False),     # controller.job.state.dumps
    sa.Column("saved_at", sa.Float, nullable=False),
)
meta = sa.Table(
    "meta", META,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)
SCHEMA = "2"

# The statements a job's every decision runs, built once: a statement built per call with its
# values in it has its cache key generated on each execution (half the job thread's time)
_INS_EVENT = events.insert()
_DEL_STATE = job_state.delete().where(job_state.c.job_id == sa.bindparam("jid"))
_INS_STATE = job_state.insert()
_DEL_CKPT = checkpoints.delete().where(
    (checkpoints.c.job_id == sa.bindparam("jid")) & (checkpoints.c.step == sa.bindparam("s"))
    & (checkpoints.c.rank == sa.bindparam("r")) & (checkpoints.c.tier == sa.bindparam("tier")))
_INS_CKPT = checkpoints.insert()

JSON_FIELDS = {"spec", "machines", "restore", "info", "suspects", "evicted", "data"}


def _row(r) -> dict:
    d = dict(r._mapping)
    for k in JSON_FIELDS & d.keys():
        if isinstance(d[k], str):
            d[k] = json.loads(d[k])
    return d


def _enc(values: dict) -> dict:
    return {k: (json.dumps(v) if k in JSON_FIELDS and not isinstance(v, str) else v)
            for k, v in values.items()}


def _upsert_machine(c, ident: str, values: dict[str, Any]) -> None:
    if c.execute(sa.select(machines.c.id).where(machines.c.id == ident)).first():
        c.execute(machines.update().where(machines.c.id == ident).values(**_enc(values)))
    else:
        c.execute(machines.insert().values(id=ident, **_enc(values)))


def _write(c, job_id: int, op: StoreOp) -> None:
    """The rows of one operation of job `job_id`. A `match` over the `StoreOp` union: mypy finds
    an operation without a writer (`assert_never`), and so does a unit test over the union."""
    match op:
        case ops.Record():
            c.execute(_INS_EVENT, {"job_id": job_id, "t": op.t, "kind": op.kind, "data": json.dumps(op.data)})
        case ops.OpenIncident():
            c.execute(incidents.insert().values(job_id=job_id, **_enc(dict(
                id=op.seq, run_seq=op.run, symptom=op.symptom, category=op.category,
                detected_at=op.detected_at, suspects=[], evicted=[], data={}))))
        case ops.UpdateIncident():
            c.execute(incidents.update().where((incidents.c.job_id == job_id) & (incidents.c.id == op.seq))
                      .values(**_enc(op.fields)))
        case ops.CreateRun():
            c.execute(runs.insert().values(job_id=job_id, **_enc(dict(
                seq=op.seq, start_step=op.start_step, started_at=op.started_at,
                machines={str(i): m for i, m in enumerate(op.machines)},
                restore={"step": op.restore_step} if op.restore_step >= 0 else None))))
        case ops.UpdateRun():
            c.execute(runs.update().where((runs.c.job_id == job_id) & (runs.c.seq == op.seq))
                      .values(**_enc(op.fields)))
        case ops.SaveVersion():
            table = META.tables["code_versions"]
            v = dict(op.row)
            ident = v.pop("id")
            c.execute(table.update().where(table.c.id == ident).values(**v))
        case ops.AddCheckpoint():
            c.execute(_DEL_CKPT, {"jid": job_id, "s": op.step, "r": op.rank, "tier": op.tier})
            c.execute(_INS_CKPT, {"job_id": job_id, "step": op.step, "rank": op.rank, "tier": op.tier,
                                  "location": op.location, "checksum": op.checksum, "created_at": op.t})
        case ops.AssignMachine():
            role = Role(op.state)
            _upsert_machine(c, op.machine, {"state": role.value, "reason": op.reason,
                                            "job_id": None if role is Role.IDLE else job_id})
        case ops.FinishJob():
            c.execute(jobs.update().where(jobs.c.id == job_id)
                      .values(state=op.state, reason=op.reason, finished_at=op.t))
        case ops.StartJob():
            c.execute(jobs.update().where(jobs.c.id == job_id).values(state="running"))
        case _:
            _not_an_op(op)


def _not_an_op(op: Never) -> NoReturn:
    """Reached by no `StoreOp` (mypy checks it, like `typing.assert_never`), only by a value of
    another type that a caller slipped past the type checker."""
    raise TypeError(f"not a store operation: {op!r}")


class StoreSchemaError(StalwartError, RuntimeError):
    """The database was made by another version of stalwart."""


class StoreUnavailable(StalwartError):
    """The store did not answer within the caller's bound (a lock, a database restart)."""

    status = 503


class LeaseLost(StalwartError, RuntimeError):
    """Another controller holds the lease: this one must not write or act any more."""


def retryable(e: BaseException) -> bool:
    """A failure of the connection or a lock (try again), not of the statement (a bug, a conflict)."""
    if isinstance(e, sa.exc.DBAPIError) and e.connection_invalidated:
        return True
    return isinstance(e, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError))


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL (None: not SQLite, or in memory)."""
    if not url.startswith("sqlite"):
        return None
    path = sa.engine.make_url(url).database
    return path if path and path != ":memory:" else None


def private_file(path: str) -> None:
    """Make `path` (created empty where missing) and its WAL/SHM companions readable by their
    owner alone. An existing database is never opened here: closing any descriptor of a file
    drops every POSIX lock this process holds on it, SQLite's included (another connection would
    then think itself the last one and delete the WAL under this process's feet). A directory that
    does not exist is not made: the database's connection then fails and says so (a mistyped --db)."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return
    if not os.path.exists(path):
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    for p in (path, path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError, PermissionError):   # (a reader that is not its owner)
            os.chmod(p, 0o600)


class Store:
    """Thread-safe access to the controller's tables."""

    def __init__(self, url: str, wait_s: float | None = None):
        """`wait_s`: how long a call waits for the store before it fails (None: the first attempts
        at opening it fail at once; an unreachable database at start is the operator's to fix)."""
        self.url = url
        kw: dict[str, Any] = {"future": True, "pool_pre_ping": True}
        path = sqlite_path(url)
        if path is not None:
            private_file(path)
        if url.startswith("sqlite"):
            kw["connect_args"] = {"check_same_thread": False, "timeout": SQLITE_BUSY_S}
        elif url.startswith("postgresql"):
            # a controller paused or cut off inside a transaction must not hold its row locks (the
            # lease's) for good: the server ends such a session, and a wait for a lock fails (retried)
            kw["connect_args"] = {"options": f"-c idle_in_transaction_session_timeout={PG_IDLE_TX_MS} "
                                             f"-c lock_timeout={PG_LOCK_MS}"}
        self.engine = sa.create_engine(url, **kw)
        if url.startswith("sqlite"):
            @sa.event.listens_for(self.engine, "connect")
            def _pragma(dbapi_conn, _rec):  # WAL: readers (stalwart report) never block the controller
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=FULL")     # a decision survives a power loss
                cur.close()
        self._lock = threading.RLock()
        self._local = threading.local()          # .patient: this thread waits out any outage
        self._failing_since: float | None = None  # monotonic: a write failed and none succeeded since
        self._pending: dict[int, float] = {}     # thread id -> when its write began (monotonic)
        self.retries = 0                          # attempts that failed and were tried again
        self.fence: Callable[[Any], None] | None = None     # checks this controller's lease (lease.py)
        self._wait_s = 0.0 if wait_s is None else wait_s      # opening: an error is the operator's
        self._check_schema()
        META.create_all(self.engine)
        with self.engine.begin() as c:
            if c.execute(sa.select(meta.c.value).where(meta.c.key == "schema")).first() is None:
                c.execute(meta.insert().values(key="schema", value=SCHEMA))
        if path is not None:
            private_file(path)
        self._wait_s = BOUNDED_WAIT_S if wait_s is None else wait_s

    # -- the one path every call takes ----------------------------------------------------------
    def patient(self) -> None:
        """This thread (a job's, the heartbeat monitor's) waits as long as an outage lasts."""
        self._local.patient = True

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """Calls of this thread within the block wait at most `seconds` for the store."""
        old = getattr(self._local, "bound", None)
        self._local.bound = seconds
        try:
            yield
        finally:
            self._local.bound = old

    def unavailable(self) -> str | None:
        """Why writes fail now (None: the last write succeeded and none hangs past STALL_S)."""
        now = time.monotonic()
        if self._failing_since is not None:
            return f"the store has failed writes for {now - self._failing_since:.1f}s"
        oldest = min(self._pending.values(), default=now)
        if now - oldest > STALL_S:
            return f"a write to the store has waited {now - oldest:.1f}s"
        return None

    def read(self, fn: Callable[[sa.Connection], T]) -> T:
        """`fn(connection)` in a read transaction, retried through outages."""
        return self._call(fn, write=False)

    def write(self, fn: Callable[[sa.Connection], T], fenced: bool = True) -> T:
        """`fn(connection)` in one write transaction, all or nothing, retried through outages;
        `fenced`: checked against the lease first and serialized with this controller's other
        writes. The lease's beat is not (it checks the fence itself, and must never queue behind
        a slow decision: a late beat hands the lease away)."""
        return self._call(fn, write=True, fenced=fenced)

    def _call(self, fn: Callable[[sa.Connection], T], write: bool, fenced: bool = True) -> T:
        patient = getattr(self._local, "patient", False)
        bound = getattr(self._local, "bound", None)
        wait = None if patient and bound is None else (bound if bound is not None else self._wait_s)
        start = time.monotonic()
        delay, logged = BACKOFF_FIRST_S, 0.0
        me = threading.get_ident()
        if write:
            self._pending[me] = start
        try:
            while True:
                try:
                    if write:
                        with self._lock if fenced else contextlib.nullcontext(), self.engine.begin() as c:
                            if fenced and self.fence is not None:
                                self.fence(c)
                            out = fn(c)
                        self._failing_since = None
                    else:
                        with self.engine.connect() as c:
                            out = fn(c)
                    if logged:
                        log.warning("the store answers again after %.1fs", time.monotonic() - start)
                    return out
                except Exception as e:
                    if not retryable(e) or wait == 0:
                        raise
                    now = time.monotonic()
                    if write and self._failing_since is None:
                        self._failing_since = now
                    self.retries += 1
                    if now - logged >= 5.0:
                        log.warning("the store failed (%s); trying again", str(getattr(e, "orig", e)).strip()
                                    or type(e).__name__)
                        logged = now
                    if wait is not None and now + delay - start > wait:
                        raise StoreUnavailable(f"the store is unavailable ({str(getattr(e, 'orig', e)).strip()}); "
                                               f"waited {now - start:.1f}s") from None
                    time.sleep(delay)
                    delay = min(BACKOFF_MAX_S, delay * 2)
        finally:
            if write:
                self._pending.pop(me, None)

    def _check_schema(self) -> None:
        names = set(self.read(lambda c: sa.inspect(c).get_table_names()))
        if "jobs" not in names:
            return
        found = None
        if "meta" in names:
            row = self.read(lambda c: c.execute(sa.select(meta.c.value).where(meta.c.key == "schema")).first())
            found = row[0] if row else None
        if found != SCHEMA:
            self.engine.dispose()
            raise StoreSchemaError(f"the database {self.url} was made by another version of stalwart "
                                   f"(schema {found or 1}, this one needs {SCHEMA}); use a new state dir "
                                   f"(stalwart run --fresh) or a new database")

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        """One round trip to the database (raises what the driver raises when it is unreachable)."""
        with self.engine.connect() as c:
            c.execute(sa.text("SELECT 1"))

    # -- generic helpers ---------------------------------------------------------------------
    def _insert(self, table: sa.Table, **values) -> int:
        def go(c):
            res = c.execute(table.insert().values(**_enc(values)))
            return res.inserted_primary_key[0] if res.inserted_primary_key else 0
        return self.write(go)

    def _update(self, table: sa.Table, where, **values) -> None:
        self.write(lambda c: c.execute(table.update().where(where).values(**_enc(values))))

    def _select(self, query) -> list[dict]:
        return self.read(lambda c: [_row(r) for r in c.execute(query)])

    # -- one decision of a job core, in one transaction ------------------------------------------
    def commit(self, job_id: int, ops: Sequence[StoreOp], state: bytes | None) -> None:
        """Write a job's store operations (`ops.py`, in order) and save its state, all or nothing."""
        def go(c):
            for op in ops:
                _write(c, job_id, op)
            if state is not None:
                c.execute(_DEL_STATE, {"jid": job_id})
                c.execute(_INS_STATE, {"job_id": job_id, "state": state, "saved_at": time.time()})
        self.write(go)

    # -- jobs ----------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict, now: float, submitted: bool = False) -> int:
        """A new job's row; with `submitted`, its `job_submitted` event in the same transaction (a
        report can be built from the moment the job's id is known)."""
        def go(c) -> int:
            res = c.execute(jobs.insert().values(**_enc(dict(name=name, spec=spec, state="pending",
                                                                created_at=now))))
            key = res.inserted_primary_key
            assert key is not None
            job_id = int(key[0])
            if submitted:
                _write(c, job_id, ops.Record(kind="job_submitted", data={"spec": spec}, t=now))
            return job_id
        return self.write(go)

    def update_job(self, job_id: int, **values) -> None:
        self._update(jobs, jobs.c.id == job_id, **values)

    def job(self, job_id: int) -> dict | None:
        rows = self._select(sa.select(jobs).where(jobs.c.id == job_id))
        return rows[0] if rows else None

    def latest_job(self) -> dict | None:
        rows = self._select(sa.select(jobs).order_by(jobs.c.id.desc()).limit(1))
        return rows[0] if rows else None

    def jobs_in_state(self, states: Iterable[str]) -> list[dict]:
        return self._select(sa.select(jobs).where(jobs.c.state.in_(list(states))).order_by(jobs.c.id))

    def save_state(self, job_id: int, state: bytes) -> None:
        self.commit(job_id, [], state)

    def load_state(self, job_id: int) -> bytes | None:
        row = self.read(lambda c: c.execute(
            sa.select(job_state.c.state).where(job_state.c.job_id == job_id)).first())
        return bytes(row[0]) if row else None

    # -- the controller's own record -------------------------------------------------------------
    def set_meta(self, key: str, value: str) -> None:
        def go(c):
            c.execute(meta.delete().where(meta.c.key == key))
            c.execute(meta.insert().values(key=key, value=value))
        self.write(go)

    def get_meta(self, key: str) -> str | None:
        row = self.read(lambda c: c.execute(sa.select(meta.c.value).where(meta.c.key == key)).first())
        return row[0] if row else None

    # -- runs ------------------------------------------------------------------------------------
    def runs(self, job_id: int) -> list[dict]:
        return self._select(sa.select(runs).where(runs.c.job_id == job_id).order_by(runs.c.seq))

    # -- machines --------------------------------------------------------------------------------
    def upsert_machine(self, machine_id: str, **values) -> None:
        def go(c):
            v = dict(values)
            if "state" not in v and not c.execute(
                    sa.select(machines.c.id).where(machines.c.id == machine_id)).first():
                v["state"] = Role.PROVISIONING.value
            _upsert_machine(c, machine_id, v)
        self.write(go)

    def machines(self) -> list[dict]:
        return self._select(sa.select(machines).order_by(machines.c.id))

    # -- incidents -------------------------------------------------------------------------------
    def incidents(self, job_id: int) -> list[dict]:
        return self._select(sa.select(incidents).where(incidents.c.job_id == job_id)
                            .order_by(incidents.c.id))

    # -- events ----------------------------------------------------------------------------------
    def add_event(self, job_id: int, kind: str, data: dict, t: float | None = None) -> None:
        self._insert(events, job_id=job_id, t=time.time() if t is None else t, kind=kind,
                     data=json.dumps(data))

    def events_since(self, job_id: int, after_id: int) -> list[dict]:
        """The job's events with an id above `after_id`, in id order."""
        return self._select(sa.select(events).where(events.c.job_id == job_id, events.c.id > after_id)
                            .order_by(events.c.id))

    def event_ids_since(self, job_id: int, after_id: int) -> list[int]:
        """The ids of the job's events above `after_id`, in order (no payload read or decoded)."""
        return self.read(lambda c: [r[0] for r in c.execute(sa.select(events.c.id).where(
            events.c.job_id == job_id, events.c.id > after_id).order_by(events.c.id))])

    def events(self, job_id: int, kinds: Iterable[str] | None = None) -> list[dict]:
        q = sa.select(events).where(events.c.job_id == job_id)
        if kinds is not None:
            q = q.where(events.c.kind.in_(list(kinds)))
        return self._select(q.order_by(events.c.t, events.c.id))

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoints(self, job_id: int) -> list[dict]:
        return self._select(sa.select(checkpoints).where(checkpoints.c.job_id == job_id)
                            .order_by(checkpoints.c.step, checkpoints.c.rank))
