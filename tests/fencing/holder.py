"""A holder that writes a fenced resource, run as a process: ``python -m tests.fencing.holder``.

Its one argument is a JSON config: ``url``, ``database``, ``key``, ``ttl``, ``name`` and
``backend``: ``"sql"`` (with ``alias`` and ``db``, a Django DATABASES entry) or ``"mongo"``
(with ``collection``). It acquires the key, writes ``first`` to the resource, prints
``{"held": token}``; then, for each line ``write BODY`` read from stdin, writes BODY under
that same token and prints ``{"ok": true, "rows": n}`` or ``{"error": name, "fence": f}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def _sql_writer(config: dict[str, Any]) -> Callable[[Any, str], int]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.db import connections

    from django_mongolock.fencing import fenced_update
    from tests.fencingapp.models import Report

    alias = config["alias"]
    connections.settings[alias] = connections.configure_settings(
        {
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            alias: config["db"],
        }
    )[alias]

    def write(lock: Any, body: str) -> int:
        return fenced_update(
            Report.objects.using(alias).filter(name=config["name"]), lock, body=body
        )

    return write


def _mongo_writer(config: dict[str, Any]) -> Callable[[Any, str], int]:
    from pymongo import MongoClient
    from pymongo.errors import AutoReconnect
    from pymongo.write_concern import WriteConcern

    from django_mongolock.fencing import fenced_update_one

    client: MongoClient[dict[str, Any]] = MongoClient(config["url"], serverSelectionTimeoutMS=30000)
    collection = client[config["database"]].get_collection(
        config["collection"], write_concern=WriteConcern("majority")
    )

    def write(lock: Any, body: str) -> int:
        # A holder woken from a long pause may first reach a server that is no longer
        # primary (its view of the set is stale): it sends the write again, as an
        # application would. The write is guarded by the fence, so sending it twice is safe.
        deadline = time.monotonic() + 60
        while True:
            try:
                result = fenced_update_one(
                    collection, {"_id": config["name"]}, {"$set": {"body": body}}, lock, upsert=True
                )
            except AutoReconnect:  # NotPrimaryError included
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
            return result.modified_count + (result.upserted_id is not None)

    return write


def main(config: dict[str, Any]) -> int:
    from django_mongolock import LockManager, StaleTokenError

    write = _sql_writer(config) if config["backend"] == "sql" else _mongo_writer(config)
    manager = LockManager(config["url"], database=config["database"])
    lock = manager.acquire(config["key"], ttl=float(config["ttl"]), blocking=False)
    write(lock, config["first"])
    print(json.dumps({"held": lock.token}), flush=True)
    for line in sys.stdin:
        command, _, body = line.rstrip("\n").partition(" ")
        if command != "write":
            break
        try:
            rows = write(lock, body)
        except StaleTokenError as exc:
            print(json.dumps({"error": type(exc).__name__, "fence": exc.fence}), flush=True)
        else:
            print(json.dumps({"ok": True, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
