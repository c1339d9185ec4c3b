"""Enrollment: a machine trades a one-time join token for its credential (`stalwart.security.identity`).

What is kept (the store's meta table, shared by controllers on one database): which join tokens
were used, and which machine ids enrolled. A join token made for any machine enrolls a new id
only; one made for a machine id may enroll it again (its agent lost its work directory: the
operator named that machine).
"""
from __future__ import annotations

import logging
import threading
import time

from stalwart.security import identity
from stalwart.errors import Conflict, InvalidRequest

log = logging.getLogger("stalwart.controller")


class Enrollment:
    def __init__(self, store, secret: bytes):
        self.store, self.secret = store, secret
        self._lock = threading.Lock()

    def enroll(self, machine: str, ident: identity.Identity) -> dict:
        if ident.scope is not identity.Scope.JOIN or ident.nonce is None:
            raise InvalidRequest("enrolling takes a join token")
        with self._lock:
            if self.store.get_meta(f"join:{ident.nonce}") is not None:
                raise Conflict("this join token was used already (each enrolls one machine once)")
            if ident.machine is None and self.store.get_meta(f"enrolled:{machine}") is not None:
                raise Conflict(f"machine {machine} enrolled already: a join token made for it "
                               f"(stalwart join-token --machine {machine}) may enroll it again")
            now = repr(time.time())
            self.store.set_meta(f"join:{ident.nonce}", machine)
            self.store.set_meta(f"enrolled:{machine}", now)
        log.info("machine %s enrolled", machine)
        return {"ok": True, "machine": machine, "credential": identity.machine_credential(self.secret, machine)}
