"""Processes of one host sharing one change stream (``SHARED_STREAM``) on one contended key.

Counter agents (``tests.reliability.agents``) each increment a counter file under the lock,
round after round: one leads the relay (it opens the one stream), the others follow it over
the local socket. The relay only carries wake-ups, so exclusion and tokens must hold as they
do with a stream per process, also when the leading process is killed while the others
wait. Each agent reports its sections as (entered, left, token, role) on CLOCK_BOOTTIME,
which all processes of the machine share: a holder enters after its predecessor left, and
with a greater token, or exclusion broke.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_mongolock import LockManager, clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Agent, Record, Spawn
from tests.waiting import in_line

pytestmark = pytest.mark.timeout(180)

KEY = "counter"
ROUNDS = 300
FOLLOWERS = 4
# Acquire attempts per section, at most, over a process's sections: a waiter woken by its
# stream makes about one (it joins the line, and is handed the lock or woken when it nears
# the front); one on its back-off, sections some milliseconds apart, makes several.
ATTEMPTS_PER_SECTION = 1.5
# The share, at least, of the sections a process entered as a follower that a release
# handed it and its leader told it of.
TOLD_SHARE = 0.5
# The leading holder's lease in the fault test: a survivor takes the lock when it ends.
LEASE = 2.0


@pytest.fixture
def config(lone: MongoReplicaSet, tmp_path: Path) -> dict[str, Any]:
    """Counter agents with a shared stream, on a database (so a relay) of the test's own."""
    (tmp_path / "counter").write_text("0 0")
    return {
        "url": lone.url,
        "database": f"shared_{uuid.uuid4().hex[:12]}",
        "sst": 5.0,
        "key": KEY,
        "rounds": ROUNDS,
        "directory": str(tmp_path),
        "acquire_timeout": 120,
        "shared_stream": True,
    }


@pytest.fixture
def looking(config: dict[str, Any]) -> Iterator[LockManager]:
    """The test's own manager on the agents' collection, to see the key's line."""
    manager = LockManager(config["url"], database=config["database"])
    yield manager
    manager.close()


def followers(spawn: Spawn, config: dict[str, Any], count: int) -> list[Agent]:
    """``count`` counter agents that follow the relay a process leads already."""
    agents = [spawn("counter", config, name=f"follower-{i}") for i in range(count)]
    for agent in agents:
        assert agent.event("ready", 60)["role"] == "follower", agent.stderr()
    return agents


def results_of(agents: list[Agent]) -> list[dict[str, Any]]:
    """The agents' reports, once all are done (none leaves the relay before), and their
    exit codes."""
    results = [agent.event("done", timeout=120) for agent in agents]
    for agent in agents:
        assert agent.finish() == 0, agent.stderr()
    return results


def sections_in_order(results: list[dict[str, Any]], directory: Path) -> list[list[Any]]:
    """Every section of every agent by entry time, checked for overlaps, tokens that do not
    grow, and lost increments."""
    for result in results:
        assert result["sections"] == ROUNDS
        assert (result["overlaps"], result["regressions"]) == (0, 0), result
    sections = sorted(section for result in results for section in result["log"])
    for before, after in itertools.pairwise(sections):
        assert before[1] < after[0], f"overlapping holders: {before} and {after}"
        assert before[2] < after[2], f"the token did not grow: {before} then {after}"
    value, last_token = (int(part) for part in (directory / "counter").read_text().split())
    assert value == len(sections) == len(results) * ROUNDS
    assert last_token == sections[-1][2]
    return sections


def woken_through_the_relay(results: list[dict[str, Any]]) -> int:
    """Check that each agent's waiters slept until a wake-up came, and that most sections
    entered as a follower were handoffs its leader told it of; how many such sections."""
    following = 0
    for result in results:
        assert result["attempts"] <= ATTEMPTS_PER_SECTION * result["sections"], result["attempts"]
        told = set(result["handoffs_told"])
        tokens = [token for _, _, token, role in result["log"] if role == "follower"]
        relayed = sum(token in told for token in tokens)
        assert relayed >= TOLD_SHARE * len(tokens), f"{relayed} of {len(tokens)} told"
        following += len(tokens)
    return following


def test_processes_sharing_one_stream_exclude_each_other_and_are_woken_by_its_leader(
    config: dict[str, Any], spawn: Spawn, tmp_path: Path, record: Record
) -> None:
    """One leader and four followers, each 300 sections on one key: no overlap, no lost
    increment, tokens growing across all holders, and the waiters woken through the
    relay: the leader leads and the followers follow at every section (no stream of
    their own), and are handed the lock by the events their leader passes on."""
    leader = spawn("counter", config, name="leader")
    assert leader.event("ready", 60)["role"] == "leader", leader.stderr()
    agents = [leader, *followers(spawn, config, FOLLOWERS)]
    started = clock.now()
    for agent in agents:
        agent.write_line("go")
    results = results_of(agents)
    elapsed = clock.now() - started

    sections = sections_in_order(results, tmp_path)
    roles = [{section[3] for section in result["log"]} for result in results]
    assert roles == [{"leader"}] + [{"follower"}] * FOLLOWERS
    assert woken_through_the_relay(results) == FOLLOWERS * ROUNDS
    record(
        processes=len(agents),
        sections=len(sections),
        seconds=elapsed,
        attempts_per_section=sum(r["attempts"] for r in results) / len(sections),
        followers_handoffs_told=sum(len(r["handoffs_told"]) for r in results[1:]),
    )


def test_waiters_get_the_lock_in_order_after_the_leading_holder_is_killed(
    config: dict[str, Any],
    spawn: Spawn,
    looking: LockManager,
    tmp_path: Path,
    record: Record,
) -> None:
    """The process that leads the relay holds the key, three followers wait on it, and it
    is killed with SIGKILL. Its lease ends by itself: a survivor takes the lock then, with
    a greater token; one of them leads the relay from then on, and their sections go on
    without overlap, the followers' handed on through the new leader's stream."""
    leading = spawn("rpc", config, name="leader")
    leading.event("ready", 30)
    assert leading.call("stream")["role"] == "leader"
    taken = leading.call("acquire", name=KEY, key=KEY, ttl=LEASE)
    assert taken["ok"], taken
    agents = followers(spawn, config, FOLLOWERS - 1)
    for agent in agents:
        agent.write_line("go")
    in_line(looking, KEY, len(agents))

    leading.kill()
    killed = clock.now()
    results = results_of(agents)

    sections = sections_in_order(results, tmp_path)
    first = sections[0]
    assert first[2] > taken["token"]
    # The dead holder refreshed its lease at most a third of it before the kill.
    assert first[0] - killed <= LEASE + LEASE / 3 + SLACK
    roles = [{section[3] for section in result["log"]} for result in results]
    assert any("leader" in seen for seen in roles), roles
    assert woken_through_the_relay(results) > 0, roles
    record(
        taken_after_kill_seconds=first[0] - killed,
        roles_after_kill=[sorted(map(str, seen)) for seen in roles],
        attempts_per_section=sum(r["attempts"] for r in results) / len(sections),
    )
