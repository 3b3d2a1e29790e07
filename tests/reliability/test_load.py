"""Many processes on one lock: no lost increment, no overlapping critical section."""

from __future__ import annotations

from pathlib import Path

from django_mongolock import clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import Record, Spawn

PROCESSES = 8
ROUNDS = 1000


def test_eight_processes_a_thousand_sections_each_lose_no_increment_and_never_overlap(
    lone: MongoReplicaSet, spawn: Spawn, tmp_path: Path, record: Record
) -> None:
    """Each section reads a counter file, writes it back plus one, and holds an O_EXCL marker.

    On a single-node replica set: the exclusion under test does not depend on replication
    (the failover test covers that), and a single node keeps the run within minutes.
    """
    (tmp_path / "counter").write_text("0 0")
    config = {
        "url": lone.url,
        "database": "load",
        "sst": 5.0,
        "key": "counter",
        "rounds": ROUNDS,
        "directory": str(tmp_path),
        "acquire_timeout": 300,
    }
    agents = [spawn("counter", config, name=f"counter-{i}") for i in range(PROCESSES)]
    for agent in agents:
        agent.event("ready", 60)
    started = clock.now()
    for agent in agents:
        agent.write_line("go")
    results = [agent.event("done", timeout=900) for agent in agents]
    elapsed = clock.now() - started
    for agent in agents:
        assert agent.finish() == 0, agent.stderr()

    value, last_token = (int(part) for part in (tmp_path / "counter").read_text().split())
    assert [result["sections"] for result in results] == [ROUNDS] * PROCESSES
    assert sum(result["overlaps"] for result in results) == 0
    assert sum(result["regressions"] for result in results) == 0
    assert value == PROCESSES * ROUNDS
    assert last_token > 0
    record(
        processes=PROCESSES,
        sections=PROCESSES * ROUNDS,
        seconds=elapsed,
        sections_per_second=PROCESSES * ROUNDS / elapsed,
    )
