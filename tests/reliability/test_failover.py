"""Failover under load: the primary of a three-node set steps down, is killed, is frozen.

Five worker processes contend for three keys and write through a fenced resource while the
test replaces the primary six times. Every worker reports every operation with its start
and end on CLOCK_MONOTONIC (shared by the processes of one machine); the checks below read
those reports, the resource's log of accepted writes, and locks the test itself holds.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager, LockNotAcquired, clock
from django_mongolock.testing import MongoNode, MongoReplicaSet
from tests.reliability.conftest import (
    REPORT,
    SLACK,
    Agent,
    Record,
    Spawn,
    agent_config,
    members_healthy,
)
from tests.reliability.fenced import FencedResource

KEYS = ["alpha", "beta", "gamma"]
WORKERS = 5
FAULTS = ["step_down", "kill", "freeze", "step_down", "kill", "freeze"]
TTL = 4.0
"""Lease of the workers' locks: shorter than some elections, so some leases end meanwhile."""
SST = 5.0
"""The workers' server selection timeout: every lock operation ends within it."""
ACQUIRE_TIMEOUT = 8.0
STEADY = 2.0
"""Seconds of undisturbed work between two faults."""
TIMELINE = REPORT.parent / "failover-timeline.jsonl"


@dataclass
class Acquisition:
    """One lock a worker took, and the latest moments at which it still held it for sure."""

    worker: int
    key: str
    token: int
    sent: float
    done: float
    held_until: float = 0.0
    writes: list[dict[str, Any]] = field(default_factory=list)


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = clock.now() + timeout
    while not (result := condition()):
        assert clock.now() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(0.05)
    return result


def election_id(node: MongoNode, replica_set: MongoReplicaSet) -> Any:
    """The ``electionId`` the primary ``node`` reports."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(node.direct_url, serverSelectionTimeoutMS=10000) as client:
        return client.admin.command("hello")["electionId"]


def inject(kind: str, replica_set: MongoReplicaSet) -> MongoNode:
    """Take the primary away; returns it."""
    if kind == "step_down":
        return replica_set.step_down(10)
    primary = replica_set.primary()
    replica_set.kill(primary, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return primary


def repair(kind: str, node: MongoNode, replica_set: MongoReplicaSet) -> None:
    """Bring the old primary back as a secondary and wait until the set is whole."""
    if kind == "kill":
        replica_set.restart(node)
    elif kind == "freeze":
        replica_set.kill(node, signal.SIGCONT)
    wait_until(lambda: members_healthy(replica_set), 90, "the set did not heal")


def first_acquisition_after(workers: list[Agent], moment: float) -> dict[str, Any] | None:
    found = [
        event for agent in workers for event in agent.events("acquired") if event["sent"] >= moment
    ]
    return min(found, key=lambda event: event["done"]) if found else None


@pytest.mark.timeout(600)
def test_locks_and_tokens_survive_step_downs_kills_and_freezes_of_the_primary(
    replica_set: MongoReplicaSet,
    database: str,
    resource: FencedResource,
    spawn: Spawn,
    record: Record,
) -> None:
    resource.create(KEYS)
    config = agent_config(
        replica_set,
        database,
        sst=SST,
        ttl=TTL,
        keys=KEYS,
        acquire_timeout=ACQUIRE_TIMEOUT,
        lag_probability=0.05,
        lag_ttl=1.5,
        lag=2.0,
    )
    workers = [
        spawn("contender", {**config, "worker": n, "seed": n}, name=f"contender-{n}")
        for n in range(WORKERS)
    ]
    for agent in workers:
        agent.event("ready", 60)
    wait_until(
        lambda: all(len(agent.events("acquired")) >= 3 for agent in workers),
        60,
        "the workers did not get going",
    )

    faults: list[dict[str, Any]] = []
    try:
        with LockManager(replica_set.url, database=database, server_selection_timeout=30) as tester:
            sentinels = []
            for number, kind in enumerate(FAULTS):
                # A lock acknowledged just before the primary goes away.
                sentinel = tester.acquire(f"sentinel-{number}", ttl=120)
                sentinels.append(sentinel)
                before = replica_set.primary()
                old_election = election_id(before, replica_set)
                old = inject(kind, replica_set)
                injected = clock.now()
                assert old is before
                new = replica_set.primary(timeout=60)
                elected = clock.now()
                assert new is not old
                assert election_id(new, replica_set) != old_election
                resumed = wait_until(
                    lambda: first_acquisition_after(workers, injected),  # noqa: B023
                    60,
                    f"no lock was taken after the {kind} of the primary",
                )
                repair(kind, old, replica_set)
                status = tester.status(sentinel.key)
                assert status is not None, f"the sentinel lock vanished in the {kind}"
                assert (status.owner, status.token, status.live) == (
                    sentinel.owner,
                    sentinel.token,
                    True,
                )
                sentinel.refresh()
                with pytest.raises(LockNotAcquired):
                    tester.acquire(sentinel.key, blocking=False)
                faults.append(
                    {
                        "kind": kind,
                        "election": elected - injected,
                        "injected": injected,
                        "unavailable": resumed["done"] - injected,
                        "healed": clock.now(),
                    }
                )
                time.sleep(STEADY)
            last_fault_healed = faults[-1]["healed"]
            wait_until(
                lambda: all(
                    any(event["sent"] >= last_fault_healed for event in agent.events("acquired"))
                    for agent in workers
                ),
                60,
                "not every worker took a lock again after the last failover",
            )
            for agent in workers:
                agent.write_line("stop")
            for agent in workers:
                agent.event("done", ACQUIRE_TIMEOUT + 2 * SST + 30)
                assert agent.finish() == 0, agent.stderr()
            for sentinel in sentinels:
                assert sentinel.valid
                assert sentinel.release()
    finally:
        save_timeline(workers, faults)
    report = check_reports(workers, resource)
    record(
        elections=len(faults),
        faults=", ".join(f"{f['kind']} ({f['unavailable']:.1f}s)" for f in faults),
        max_election_seconds=max(fault["election"] for fault in faults),
        max_unavailable_seconds=max(fault["unavailable"] for fault in faults),
        **report,
    )


def save_timeline(workers: list[Agent], faults: list[dict[str, Any]]) -> None:
    """Keep every report of the run, for the record and for looking into a failure."""
    TIMELINE.parent.mkdir(parents=True, exist_ok=True)
    with TIMELINE.open("w") as timeline:
        for fault in faults:
            timeline.write(json.dumps({"event": "fault", **fault}) + "\n")
        for number, agent in enumerate(workers):
            for message in agent.messages:
                timeline.write(json.dumps({"worker": number, **message}) + "\n")


def check_reports(workers: list[Agent], resource: FencedResource) -> dict[str, Any]:
    """Check every guarantee against what the workers and the resource saw; return figures."""
    acquisitions: dict[tuple[str, int], Acquisition] = {}
    writes: list[dict[str, Any]] = []
    durations: dict[str, float] = defaultdict(float)
    errors: Counter[str] = Counter()
    busy = 0
    for number, agent in enumerate(workers):
        assert not agent.events("crash"), agent.events("crash")
        for event in agent.messages:
            kind = event.get("event")
            if kind in ("acquired", "busy", "acquire_error"):
                durations["acquire"] = max(durations["acquire"], event["done"] - event["sent"])
            if kind == "acquired":
                ident = (event["key"], event["token"])
                assert ident not in acquisitions, f"token {event['token']} handed out twice"
                acquisitions[ident] = Acquisition(
                    number, event["key"], event["token"], event["sent"], event["done"]
                )
            elif kind == "busy":
                busy += 1
            elif kind == "api_error":
                raise AssertionError(f"not a MongoLockError: {event['traceback']}")
            elif kind in ("acquire_error", "release_error"):
                errors[f"{kind.split('_')[0]}: {event['error']}"] += 1
                if kind == "release_error":  # a release that fails ends within its bound too
                    durations["release"] = max(durations["release"], event["done"] - event["sent"])
                assert event["message"], event
                if event["error"] == "ServerUnavailable":
                    assert "did not answer within 5s" in event["message"], event
            elif kind == "write":
                durations["write"] = max(durations["write"], event["done"] - event["sent"])
                writes.append(event)
                taken = acquisitions[event["key"], event["token"]]
                taken.writes.append(event)
                if event["valid"]:
                    taken.held_until = max(taken.held_until, event["valid_at"])
            elif kind == "release":
                durations["release"] = max(durations["release"], event["done"] - event["sent"])
                if event["held"]:
                    taken = acquisitions[event["key"], event["token"]]
                    taken.held_until = max(taken.held_until, event["sent"])

    # Every operation ended, one way or the other, within its bound.
    assert durations["acquire"] <= ACQUIRE_TIMEOUT + 2 * SST + SLACK, durations
    assert durations["write"] <= SST + SLACK, durations
    assert durations["release"] <= SST + SLACK, durations
    assert set(errors) <= {"acquire: ServerUnavailable", "release: ServerUnavailable"}, errors

    by_key: dict[str, list[Acquisition]] = defaultdict(list)
    for taken in acquisitions.values():
        by_key[taken.key].append(taken)
    for key, taken_list in by_key.items():
        # Tokens follow real time: a lock taken after another was handed out has a greater one.
        by_done = sorted(taken_list, key=lambda taken: taken.done)
        by_sent = sorted(taken_list, key=lambda taken: taken.sent)
        greatest, index = 0, 0
        for later in by_sent:
            while index < len(by_done) and by_done[index].done < later.sent:
                greatest = max(greatest, by_done[index].token)
                index += 1
            assert later.token > greatest, f"{key}: token {later.token} after {greatest}"
        # No lock was taken from a holder that still held it.
        by_token = sorted(taken_list, key=lambda taken: taken.token)
        earliest_later = float("inf")
        for taken in reversed(by_token):
            assert taken.held_until < earliest_later, (
                f"{key}: token {taken.token} still held at {taken.held_until:.3f}, but a "
                f"greater token was handed out at {earliest_later:.3f}"
            )
            earliest_later = min(earliest_later, taken.done)

    # The fenced resource: accepted writes are all there, in token order; stale ones refused.
    outcomes = Counter(write["outcome"] for write in writes)
    logged: dict[str, list[dict[str, Any]]] = {key: resource.log(key) for key in KEYS}
    for key, log in logged.items():
        tokens = [entry["token"] for entry in log]
        assert tokens == sorted(set(tokens)), f"{key}: accepted tokens not increasing"
    ids = {entry["id"] for log in logged.values() for entry in log}
    assert len(ids) == sum(len(log) for log in logged.values())
    stale = 0
    accepted_by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for write in writes:
        if write["outcome"] == "accepted":
            assert write["id"] in ids, f"an acknowledged write was lost: {write}"
            accepted_by_key[write["key"]].append(write)
        elif write["outcome"] == "rejected":
            assert write["id"] not in ids, write
            assert write["fence"] > write["token"], write
            assert not write["valid"], f"a holder that still held its lock was refused: {write}"
    for write in writes:
        newer = [
            other
            for other in accepted_by_key[write["key"]]
            if other["token"] > write["token"] and other["done"] < write["sent"]
        ]
        if newer:
            stale += 1
            assert write["id"] not in ids, f"a stale token was accepted: {write}, after {newer[0]}"
    assert outcomes["accepted"] > 0
    assert outcomes["rejected"] > 0, "no stale token reached the resource"
    return {
        "acquisitions": len(acquisitions),
        "busy": busy,
        "errors": dict(errors),
        "writes_accepted": outcomes["accepted"],
        "stale_tokens_rejected": outcomes["rejected"],
        "writes_unknown": outcomes["unknown"],
        "writes_stale_by_real_time": stale,
        "max_acquire_seconds": durations["acquire"],
        "max_write_seconds": durations["write"],
        "max_release_seconds": durations["release"],
    }
