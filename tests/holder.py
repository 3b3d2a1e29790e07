"""A lock holder run as a separate process: ``python -m tests.holder URL DB KEY TTL MODE``.

Prints ``held <token>`` once it holds the lock, then, by MODE: ``sleep`` (wait to be
killed), ``exit`` (leave normally without releasing: interpreter exit releases it).
"""

from __future__ import annotations

import sys
import time

from django_mongolock import LockManager


def main(url: str, database: str, key: str, ttl: str, mode: str) -> None:
    manager = LockManager(url, database=database)
    lock = manager.acquire(key, ttl=float(ttl), blocking=False)
    print(f"held {lock.token}", flush=True)
    if mode == "sleep":
        time.sleep(600)
    # mode "exit": return with the lock held; keep the handle referenced until then.
    sys.stdout.flush()
    _keep.append(lock)


_keep: list[object] = []

if __name__ == "__main__":
    main(*sys.argv[1:6])
