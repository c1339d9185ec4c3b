"""The controller's store: every job (and its live state), run, machine, incident, event and
checkpoint, through SQLAlchemy.

SQLite by default (a file in the state dir), PostgreSQL in production: one SQLAlchemy URL. The
store is the only state that survives a controller restart, and `stalwart report` reads it directly.
A job core's decision is written in one transaction (`commit`): its events, incident and run rows,
machine roles and the job's saved state together.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterable

import sqlalchemy as sa

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


class StoreSchemaError(RuntimeError):
    """The database was made by another version of stalwart."""


class Store:
    """Thread-safe access to the controller's tables."""

    def __init__(self, url: str):
        self.url = url
        kw: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kw["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = sa.create_engine(url, **kw)
        if url.startswith("sqlite"):
            @sa.event.listens_for(self.engine, "connect")
            def _pragma(dbapi_conn, _rec):  # WAL: readers (stalwart report) never block the controller
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()
        self._check_schema()
        META.create_all(self.engine)
        with self.engine.begin() as c:
            if c.execute(sa.select(meta.c.value).where(meta.c.key == "schema")).first() is None:
                c.execute(meta.insert().values(key="schema", value=SCHEMA))
        self._lock = threading.RLock()

    def _check_schema(self) -> None:
        names = set(sa.inspect(self.engine).get_table_names())
        if "jobs" not in names:
            return
        found = None
        if "meta" in names:
            with self.engine.connect() as c:
                row = c.execute(sa.select(meta.c.value).where(meta.c.key == "schema")).first()
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
        with self._lock, self.engine.begin() as c:
            res = c.execute(table.insert().values(**_enc(values)))
            return res.inserted_primary_key[0] if res.inserted_primary_key else 0

    def _update(self, table: sa.Table, where, **values) -> None:
        with self._lock, self.engine.begin() as c:
            c.execute(table.update().where(where).values(**_enc(values)))

    def _select(self, query) -> list[dict]:
        with self.engine.connect() as c:
            return [_row(r) for r in c.execute(query)]

    # -- one decision of a job core, in one transaction ------------------------------------------
    def commit(self, job_id: int, ops: list[tuple[str, dict[str, Any]]], state: bytes | None) -> None:
        """Apply a job's store operations and save its state, all or nothing. Operations:
        event, incident_open, incident_update, run_create, run_update, version, checkpoint,
        machine, job (see the executor)."""
        with self._lock, self.engine.begin() as c:
            for kind, v in ops:
                self._op(c, job_id, kind, dict(v))
            if state is not None:
                c.execute(_DEL_STATE, {"jid": job_id})
                c.execute(_INS_STATE, {"job_id": job_id, "state": state, "saved_at": time.time()})

    def _op(self, c, job_id: int, kind: str, v: dict[str, Any]) -> None:
        if kind == "event":
            c.execute(_INS_EVENT, {"job_id": job_id, "t": v["t"], "kind": v["kind"], "data": json.dumps(v["data"])})
        elif kind == "incident_open":
            c.execute(incidents.insert().values(job_id=job_id, **_enc(dict(v, suspects=[], evicted=[], data={}))))
        elif kind == "incident_update":
            ident = v.pop("id")
            c.execute(incidents.update().where((incidents.c.job_id == job_id) & (incidents.c.id == ident))
                      .values(**_enc(v)))
        elif kind == "run_create":
            c.execute(runs.insert().values(job_id=job_id, **_enc(v)))
        elif kind == "run_update":
            seq = v.pop("seq")
            c.execute(runs.update().where((runs.c.job_id == job_id) & (runs.c.seq == seq)).values(**_enc(v)))
        elif kind == "version":
            table = META.tables["code_versions"]
            ident = v.pop("id")
            c.execute(table.update().where(table.c.id == ident).values(**v))
        elif kind == "checkpoint":
            c.execute(_DEL_CKPT, {"jid": job_id, "s": v["step"], "r": v["rank"], "tier": v["tier"]})
            c.execute(_INS_CKPT, dict(v, job_id=job_id))
        elif kind == "machine":
            ident = v.pop("id")
            if c.execute(sa.select(machines.c.id).where(machines.c.id == ident)).first():
                c.execute(machines.update().where(machines.c.id == ident).values(**_enc(v)))
            else:
                c.execute(machines.insert().values(id=ident, **_enc(v)))
        elif kind == "job":
            c.execute(jobs.update().where(jobs.c.id == job_id).values(**_enc(v)))
        else:
            raise ValueError(f"unknown store operation {kind!r}")

    # -- jobs ----------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict, now: float, submitted: bool = False) -> int:
        """A new job's row; with `submitted`, its `job_submitted` event in the same transaction (a
        report can be built from the moment the job's id is known)."""
        with self._lock, self.engine.begin() as c:
            res = c.execute(jobs.insert().values(**_enc(dict(name=name, spec=spec, state="pending",
                                                                created_at=now))))
            key = res.inserted_primary_key
            assert key is not None
            job_id = int(key[0])
            if submitted:
                self._op(c, job_id, "event", {"kind": "job_submitted", "data": {"spec": spec}, "t": now})
        return job_id

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
        with self.engine.connect() as c:
            row = c.execute(sa.select(job_state.c.state).where(job_state.c.job_id == job_id)).first()
            return bytes(row[0]) if row else None

    # -- the controller's own record -------------------------------------------------------------
    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self.engine.begin() as c:
            c.execute(meta.delete().where(meta.c.key == key))
            c.execute(meta.insert().values(key=key, value=value))

    def get_meta(self, key: str) -> str | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(meta.c.value).where(meta.c.key == key)).first()
            return row[0] if row else None

    # -- runs ------------------------------------------------------------------------------------
    def runs(self, job_id: int) -> list[dict]:
        return self._select(sa.select(runs).where(runs.c.job_id == job_id).order_by(runs.c.seq))

    # -- machines --------------------------------------------------------------------------------
    def upsert_machine(self, machine_id: str, **values) -> None:
        with self._lock, self.engine.begin() as c:
            if "state" not in values and not c.execute(
                    sa.select(machines.c.id).where(machines.c.id == machine_id)).first():
                values["state"] = "provisioning"
            self._op(c, 0, "machine", dict(values, id=machine_id))

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
        with self.engine.connect() as c:
            return [r[0] for r in c.execute(sa.select(events.c.id).where(
                events.c.job_id == job_id, events.c.id > after_id).order_by(events.c.id))]

    def events(self, job_id: int, kinds: Iterable[str] | None = None) -> list[dict]:
        q = sa.select(events).where(events.c.job_id == job_id)
        if kinds is not None:
            q = q.where(events.c.kind.in_(list(kinds)))
        return self._select(q.order_by(events.c.t, events.c.id))

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoints(self, job_id: int) -> list[dict]:
        return self._select(sa.select(checkpoints).where(checkpoints.c.job_id == job_id)
                            .order_by(checkpoints.c.step, checkpoints.c.rank))
