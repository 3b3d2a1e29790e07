"""The body of the cron commands: record the run, then hold while the test says so."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

from pymongo import MongoClient

from django_mongolock import current_lock


def run_job(name: str) -> None:
    """Record this run in ``runs`` (with its lock's token), then wait (at most 60 s)
    while a ``hold`` document is there, so that the test ends the run when it wants."""
    lock = current_lock()
    assert lock is not None
    client: MongoClient[dict[str, Any]] = MongoClient(os.environ["MONGOLOCK_URL"])
    try:
        runs = client[os.environ["MONGOLOCK_DATABASE"]]["runs"]
        runs.insert_one(
            {"job": name, "pid": os.getpid(), "token": lock.token, "at": datetime.now(UTC)}
        )
        ends = time.monotonic() + 60
        while runs.find_one({"_id": "hold"}) is not None and time.monotonic() < ends:
            time.sleep(0.02)
    finally:
        client.close()
