"""The controller's store: every job, run, machine, incident, event and checkpoint, through SQLAlchemy.

SQLite by default (a file in the state dir), PostgreSQL in production: one SQLAlchemy URL. The
store is the only state that survives a controller restart, and `stalwart report` reads it directly.
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
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False),
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
        META.create_all(self.engine)
        self._lock = threading.RLock()

    def close(self) -> None:
        self.engine.dispose()

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

    # -- jobs ----------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict, now: float) -> int:
        return self._insert(jobs, name=name, spec=spec, state="pending", created_at=now)

    def update_job(self, job_id: int, **values) -> None:
        self._update(jobs, jobs.c.id == job_id, **values)

    def job(self, job_id: int) -> dict | None:
        rows = self._select(sa.select(jobs).where(jobs.c.id == job_id))
        return rows[0] if rows else None

    def latest_job(self) -> dict | None:
        rows = self._select(sa.select(jobs).order_by(jobs.c.id.desc()).limit(1))
        return rows[0] if rows else None

    def jobs_in_state(self, states: Iterable[str]) -> list[dict]:
        return self._select(sa.select(jobs).where(jobs.c.state.in_(list(states))))

    # -- runs ------------------------------------------------------------------------------------
    def create_run(self, job_id: int, seq: int, start_step: int, started_at: float,
                   machine_map: dict, restore: dict | None) -> int:
        return self._insert(runs, job_id=job_id, seq=seq, start_step=start_step, started_at=started_at,
                            machines=machine_map, restore=restore)

    def update_run(self, run_id: int, **values) -> None:
        self._update(runs, runs.c.id == run_id, **values)

    def runs(self, job_id: int) -> list[dict]:
        return self._select(sa.select(runs).where(runs.c.job_id == job_id).order_by(runs.c.seq))

    # -- machines --------------------------------------------------------------------------------
    def upsert_machine(self, machine_id: str, **values) -> None:
        with self._lock, self.engine.begin() as c:
            exists = c.execute(sa.select(machines.c.id).where(machines.c.id == machine_id)).first()
            if exists:
                c.execute(machines.update().where(machines.c.id == machine_id).values(**_enc(values)))
            else:
                values.setdefault("state", "provisioning")
                c.execute(machines.insert().values(id=machine_id, **_enc(values)))

    def machines(self) -> list[dict]:
        return self._select(sa.select(machines).order_by(machines.c.id))

    # -- incidents -------------------------------------------------------------------------------
    def create_incident(self, job_id: int, **values) -> int:
        return self._insert(incidents, job_id=job_id, **values)

    def update_incident(self, incident_id: int, **values) -> None:
        self._update(incidents, incidents.c.id == incident_id, **values)

    def incidents(self, job_id: int) -> list[dict]:
        return self._select(sa.select(incidents).where(incidents.c.job_id == job_id)
                            .order_by(incidents.c.id))

    # -- events ----------------------------------------------------------------------------------
    def add_event(self, job_id: int, kind: str, data: dict, t: float | None = None) -> None:
        self._insert(events, job_id=job_id, t=time.time() if t is None else t, kind=kind,
                     data=json.dumps(data))

    def events(self, job_id: int, kinds: Iterable[str] | None = None) -> list[dict]:
        q = sa.select(events).where(events.c.job_id == job_id)
        if kinds is not None:
            q = q.where(events.c.kind.in_(list(kinds)))
        return self._select(q.order_by(events.c.t, events.c.id))

    # -- checkpoints -----------------------------------------------------------------------------
    def add_checkpoint(self, job_id: int, step: int, rank: int, tier: str, location: str,
                       checksum: str, now: float) -> None:
        with self._lock, self.engine.begin() as c:
            key = ((checkpoints.c.job_id == job_id) & (checkpoints.c.step == step)
                   & (checkpoints.c.rank == rank) & (checkpoints.c.tier == tier))
            c.execute(checkpoints.delete().where(key))
            c.execute(checkpoints.insert().values(job_id=job_id, step=step, rank=rank, tier=tier,
                                                  location=location, checksum=checksum,
                                                  created_at=now))

    def checkpoints(self, job_id: int) -> list[dict]:
        return self._select(sa.select(checkpoints).where(checkpoints.c.job_id == job_id)
                            .order_by(checkpoints.c.step, checkpoints.c.rank))
