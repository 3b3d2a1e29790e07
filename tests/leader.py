"""A campaigning process: ``python -m tests.leader URL DB KEY TTL``.

Prints ``leader <token>`` once elected, then waits to be killed.
"""

from __future__ import annotations

import sys
import threading

from django_mongolock import Election, LockManager


def main(url: str, database: str, key: str, ttl: str) -> None:
    manager = LockManager(url, database=database)
    elected = threading.Event()

    def on_elected(election: Election) -> None:
        print(f"leader {election.token}", flush=True)
        elected.set()

    manager.elect(key, ttl=float(ttl), on_elected=on_elected)
    elected.wait(60)
    threading.Event().wait(600)


if __name__ == "__main__":
    main(*sys.argv[1:5])
