"""The workers' rendezvous store, hosted by the controller (never on a training machine).

Every run gets a fresh torch TCPStore on its own port, and SDK workers add a per-run prefix on top,
so a restarted run can never read the addresses of an earlier one (pytorch#135712) and losing any
training machine never loses the store (pytorch#67616).

torch is imported on a thread of its own when the controller starts, not before it serves: a
restarted controller answers its agents at once (importing torch takes seconds on a busy host).
"""
from __future__ import annotations

import datetime
import importlib
import threading
from typing import Any


def _import_dist() -> Any:
    return importlib.import_module("torch.distributed")


class Rendezvous:
    def __init__(self, host: str = "0.0.0.0", keep_runs: int = 2):
        self.host = host
        self.keep_runs = keep_runs
        self._stores: dict[tuple[int, int], Any] = {}        # torch TCPStores
        self._scratch: dict[tuple[int, str], Any] = {}       # diagnostics, replays
        self._lock = threading.Lock()
        self.imported = threading.Event()       # torch is in (or failed to import)
        threading.Thread(target=self._import, name="import-torch", daemon=True).start()

    def _import(self) -> None:
        try:
            _import_dist()
        finally:
            self.imported.set()

    def _new_store(self) -> Any:
        dist = _import_dist()
        return dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=300))

    def open(self, job_id: int, run: int) -> int:
        """Start the store of (job, run); returns its port. Older runs of the job are closed."""
        store = self._new_store()
        with self._lock:
            self._stores[(job_id, run)] = store
            old = sorted(k for k in self._stores if k[0] == job_id)[:-self.keep_runs]
            for k in old:
                del self._stores[k]
        return store.port

    def open_scratch(self, job_id: int, name: str) -> int:
        """The store of stop-time diagnostics or a replay of the job named `name`, opened on first
        use (its users pick their own key prefixes); it never displaces the stores of the job's
        runs. Returns its port."""
        with self._lock:
            store = self._scratch.get((job_id, name))
            if store is None:
                store = self._new_store()
                self._scratch[(job_id, name)] = store
            return store.port

    def close_scratch(self, job_id: int, name: str) -> None:
        with self._lock:
            self._scratch.pop((job_id, name), None)

    def close_job(self, job_id: int) -> None:
        with self._lock:
            for run in [k for k in self._stores if k[0] == job_id]:
                del self._stores[run]
            for name in [k for k in self._scratch if k[0] == job_id]:
                del self._scratch[name]

    def close(self) -> None:
        with self._lock:
            self._stores.clear()
            self._scratch.clear()
