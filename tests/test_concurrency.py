"""Mutual exclusion between threads and between processes on the real server."""

from __future__ import annotations

import multiprocessing
import threading
import time

from pymongo import MongoClient

from django_mongolock import LockManager
from tests.workers import increment


def test_threads_lose_no_increment(manager: LockManager) -> None:
    counter = {"value": 0, "inside": 0, "overlaps": 0}
    rounds, threads = 25, 6

    def work() -> None:
        for _ in range(rounds):
            with manager.lock("threads", ttl=30, timeout=60):
                counter["inside"] += 1
                if counter["inside"] != 1:
                    counter["overlaps"] += 1
                value = counter["value"]
                time.sleep(0.001)
                counter["value"] = value + 1
                counter["inside"] -= 1

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers)
    assert counter["overlaps"] == 0
    assert counter["value"] == rounds * threads


def test_processes_lose_no_increment(mongolock_url: str, manager: LockManager) -> None:
    rounds, processes = 30, 4
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        results = [
            pool.apply_async(increment, (mongolock_url, manager.database, rounds))
            for _ in range(processes)
        ]
        overlaps = [result.get(timeout=240) for result in results]
    client: MongoClient[dict[str, object]] = MongoClient(mongolock_url)
    try:
        doc = client[manager.database]["counters"].find_one({"_id": "counter"})
    finally:
        client.close()
    assert overlaps == [0] * processes
    assert doc is not None
    assert doc["value"] == rounds * processes
    assert doc["inside"] == 0
