"""A process that calls a function decorated ``@locked(..., on_busy="coalesce")``.

``python -m tests.coalesce_worker URL DATABASE``: each run of the function records
itself in the ``runs`` collection, then waits (at most 60 s) while a ``hold`` document
exists there, so that a test decides when a run ends, or kills it mid-run. Prints
``ran`` or ``requested`` (the call found the key busy and left a request).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime

from pymongo import MongoClient

from django_mongolock import LockManager, locked

KEY = "report-build"
TTL = 2.0


def main(url: str, database: str) -> int:
    manager = LockManager(url, database=database)
    client: MongoClient[dict[str, object]] = MongoClient(url)
    runs = client[database]["runs"]
    ran = []

    @locked(KEY, ttl=TTL, on_busy="coalesce", manager=manager)
    def build() -> str:
        runs.insert_one({"pid": os.getpid(), "at": datetime.now(UTC)})
        ran.append(True)
        ends = time.monotonic() + 60
        while runs.find_one({"_id": "hold"}) is not None and time.monotonic() < ends:
            time.sleep(0.02)
        return "ran"

    result = build()
    print(result or "requested", len(ran), flush=True)
    manager.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
