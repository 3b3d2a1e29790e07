"""A holder of long leases that locks keep being handed to, over a slow link.

A release hands the head waiter a short first lease (``HANDOFF_LEASE_MS``), so the
waiter's refresher ticks early for it; an early tick extends only the leases that could
not wait for the regular tick. This is where that rule meets a real network: a process
reaches the single-node set through a :class:`TcpProxy` that delays every chunk by a
different amount now and then, holds leases of three lengths, and waits for keys that the
test's own (direct) manager holds and then releases, one after another, keeping each lock
it is handed. No lease of that process may end: none is told lost, each is still its own
on the server at the end, with the token it got, and each handed key's token is greater
than the one before it.
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from typing import Any

import pytest

from django_mongolock import LockManager
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, NetAgent, NetSpawn, Record
from tests.reliability.proxy import TcpProxy
from tests.waiting import in_line

pytestmark = pytest.mark.timeout(240)

LEASES = {"long-6": 6.0, "long-20": 20.0, "long-60": 60.0}
"""The leases the far process holds throughout: the shortest sets its lane's pace (2 s)."""
HANDED_TTL = 20.0
HANDOFFS = 16
DELAYS = (0.02, 0.1)
"""Each chunk through the proxy is this late, both ways, drawn again for each handoff: a
round trip of up to 0.2 s and more. A handed lease, learnt of from the change stream, has
about 1.5 s of its 2 s first lease left when ``acquire`` returns, and its first refresh is
sent two thirds of a second later. A link much slower than this one can end a handed
lease before that refresh is answered (the holder is told, before anyone else can take
the key): see docs/locks.md."""
SST = 8.0


def test_leases_of_a_holder_that_keeps_being_handed_locks_over_a_slow_link_are_kept(
    lone: MongoReplicaSet, proxy: TcpProxy, net_spawn: NetSpawn, record: Record
) -> None:
    seed = int(time.time())
    rng = random.Random(seed)
    database = f"busy_{uuid.uuid4().hex[:8]}"
    far = net_spawn(
        "rpc",
        {"url": proxy.direct_url, "database": database, "sst": SST, "ttl": HANDED_TTL},
        name="far",
    )
    assert far.call("stream", wait=60)["ok"]  # every handoff comes by its event
    tokens: dict[str, int] = {}
    for name, ttl in LEASES.items():
        got = far.call("acquire", name=name, key=name, ttl=ttl, wait=60)
        assert got["ok"], got
        tokens[name] = got["token"]
    woken: list[float] = []  # release -> the far acquire's return, seconds
    try:
        with LockManager(lone.url, database=database, ttl=HANDED_TTL) as near:
            for number in range(HANDOFFS):
                proxy.set_mode("delay", rng.uniform(*DELAYS))
                key = f"handed-{number}"
                mine = near.acquire(key, blocking=False)
                seq = far.send("acquire", name=key, key=key, ttl=HANDED_TTL, timeout=SST)
                in_line(near, key, 1, SST + SLACK, functools.partial(_answered, far, seq))
                time.sleep(rng.uniform(0.0, 0.5))  # and the far lanes' ticks fall anywhere
                released = time.monotonic()
                assert mine.release()
                got = far.reply(seq, SST + 10)
                assert got["ok"], got
                assert got["token"] > mine.token, (key, got, mine.token)
                tokens[key] = got["token"]
                woken.append(got["done"] - released)
            # The handed leases past their first lease, and three regular ticks (2 s apart).
            time.sleep(LEASES["long-6"] + 0.5)
            proxy.set_mode("pass")
            for name, token in tokens.items():
                state = far.call("state", name=name)
                assert (state["valid"], state["token"]) == (True, token), (name, state)
                status = near.status(name)
                assert status is not None, name
                assert (status.live, status.token) == (True, token), (name, status)
            notices = far.events("notice")
            assert not notices, f"the far process was told of losses: {notices}"
            for name in tokens:
                assert far.call("release", name=name)["held"], name
    finally:
        proxy.set_mode("pass")
    assert far.finish() == 0, far.stderr()
    record(
        seed=seed,
        handoffs=len(woken),
        worst_wake_after_release_seconds=max(woken),
    )


def _answered(agent: NetAgent, seq: int) -> dict[str, Any] | None:
    """The agent's answer to request ``seq`` if it came (an acquire answered before the
    release it waits for has failed)."""
    return next((m for m in list(agent.messages) if m.get("reply") == seq), None)
