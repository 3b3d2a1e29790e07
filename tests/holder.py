"""A lock holder run as a separate process: ``python -m tests.holder URL DB KEY TTL MODE``.

Prints ``held <token>`` once it holds the lock, then, by MODE: ``sleep`` (wait to be
killed), ``exit`` (leave normally without releasing: interpreter exit releases it), or
``exit-many``: hold besides the shared leases of ``KEY-shared-0`` to ``-199`` and 20
permits of the semaphore ``KEY-sem`` (limit 50), leave the same way, and print, last,
``exit-writes`` and the releases sent to the lock collection once ``main`` returned (as
JSON: each command's name; a refresh the process's refresher sends meanwhile is not
one).
"""

from __future__ import annotations

import atexit
import json
import sys
import time

import bson
from pymongo import monitoring

from django_mongolock import LockManager

SHARED = 200
PERMITS = 20
WRITES = {"update", "findAndModify", "delete", "insert"}


class _Writes(monitoring.CommandListener):
    """The releases sent to the lock collection once ``leaving`` is set: the writes
    that free a lease (and record when, in ``released_at``)."""

    def __init__(self) -> None:
        self.leaving = False
        self.sent: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        if not (self.leaving and name in WRITES and event.command.get(name) == "locks"):
            return
        if b"released_at" in bson.encode(event.command):
            self.sent.append(name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def main(url: str, database: str, key: str, ttl: str, mode: str) -> None:
    writes = _Writes()
    if mode == "exit-many":
        monitoring.register(writes)
        # Registered before the manager's own exit hook, so it runs after it.
        atexit.register(lambda: print("exit-writes", json.dumps(writes.sent), flush=True))
    manager = LockManager(url, database=database)
    lock = manager.acquire(key, ttl=float(ttl), blocking=False)
    _keep.append(lock)
    if mode == "exit-many":
        semaphore = manager.semaphore(f"{key}-sem", limit=50)
        _keep.extend(
            manager.acquire(f"{key}-shared-{n}", shared=True, ttl=float(ttl), blocking=False)
            for n in range(SHARED)
        )
        _keep.extend(semaphore.acquire(blocking=False, ttl=float(ttl)) for _ in range(PERMITS))
    print(f"held {lock.token}", flush=True)
    if mode == "sleep":
        time.sleep(600)
    # modes "exit" and "exit-many": return with the locks held, the handles referenced.
    sys.stdout.flush()
    writes.leaving = True


_keep: list[object] = []

if __name__ == "__main__":
    main(*sys.argv[1:6])
