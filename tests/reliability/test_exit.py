"""A process that ends normally while its election campaigns: the key is not left held."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import LockManager
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import Spawn, agent_config
from tests.waiting import until

KEY = "exit-elected"
APP = "exit-campaigner"
# The agent's exit budget, and how long the server holds its campaign: past half of it
# (the lanes' wait) and within all of it (the final join) for an exit that begins
# anywhere within 1.5 s of the hold, when the test asks for it at once. The election's
# ttl, 12 s, makes a campaign answered after 3.5 s no late answer (that would take
# more than half the ttl less its margin, 5.75 s), which an extra write would extend.
EXIT_TIMEOUT = 4.0
HOLD_MS = 3500


@pytest.fixture
def admin(fail_points: MongoReplicaSet) -> Iterator[MongoClient[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(fail_points.nodes[0].direct_url)
    yield client
    client.drop_database("exitcampaign")
    client.close()


def _idle(admin: MongoClient[dict[str, Any]], app: str) -> Callable[[], bool]:
    """Whether the server runs no command of clients named ``app``: a command it held for
    a process that has ended since still writes when the hold is over."""
    stages: list[dict[str, Any]] = [
        {"$currentOp": {"allUsers": True}},
        {"$match": {"appName": app}},
    ]
    return lambda: not list(admin.admin.aggregate(stages))


def test_a_campaign_held_at_exit_leaves_the_key_free_once_the_process_ended(
    fail_points: MongoReplicaSet,
    admin: MongoClient[dict[str, Any]],
    hang: Any,
    spawn: Spawn,
) -> None:
    """A real process campaigns for a key another holds. The server holds its next
    campaign 3.5 s: past the exit's wait for the refresher's lane (half of its budget,
    4 s here, 2 s by default) and the releases after it, within the whole budget. The
    key is freed meanwhile, so that campaign wins, and the process leaves normally (the
    interpreter's exit hook, not a close). Before the process ends, the lease it won is
    given back: once it has ended and the server runs none of its commands, the key is
    free, not held for the election's ttl by a process that no longer exists."""
    observer = LockManager(fail_points.url, database="exitcampaign")
    try:
        blocker = observer.acquire(KEY, ttl=30)
        config = agent_config(fail_points, "exitcampaign", app=APP)
        agent = spawn("rpc", config, name="campaigner")
        agent.event("ready", 30)
        assert agent.call("elect", name="lead", key=KEY, ttl=12.0)["leader"] is False
        # The first findAndModify of the agent's from now on: a campaign (its heartbeats
        # and refreshes are updates), which the key's release below lets win.
        held = hang(APP, ms=HOLD_MS, times=1, commands=("findAndModify",))
        assert blocker.release()
        admin.admin.command(
            "waitForFailPoint", "failCommand", timesEntered=held + 1, maxTimeMS=20_000
        )
        leave = json.dumps({"op": "leave", "seq": 0, "exit_timeout": EXIT_TIMEOUT})
        assert agent.finish(command=leave) == 0
        until(_idle(admin, APP), 10, f"{APP}'s commands ended")
        status = observer.status(KEY)
        assert status is None or not status.live, status
        # The held campaign did win, and the exit gave back a lease of its own.
        given_back = [e["token"] for e in agent.events("released") if e["key"] == KEY]
        assert given_back, agent.messages
        assert all(token > blocker.token for token in given_back), given_back
        # The held campaign was answered after the exit's wait for the lanes, within its
        # budget: what the final join is for (else this would test another path).
        (exiting,) = [e["at"] for e in agent.events("exiting")]
        answered = [e["at"] for e in agent.events("answered") if e["command"] == "findAndModify"]
        assert answered, agent.messages
        assert exiting + EXIT_TIMEOUT / 2 < answered[-1] < exiting + EXIT_TIMEOUT
    finally:
        observer.close()
