"""Lock clients for the network fault tests (``-m tests.reliability.netagent``).

``rpc`` holds locks, semaphore slots and elections on one ``LockManager`` (reached
directly or through a :mod:`tests.reliability.proxy`) and reports, as ``notice`` events,
every way it learns of a loss, each when it happens: the ``lost`` event, the
``lock_lost`` signal, ``on_lost`` and an election's ``on_demoted``. ``worker`` takes one
key again and again and reports how long it saw each lock valid. Times are
``time.monotonic()`` (CLOCK_MONOTONIC, shared by the processes of one machine), so the test
can put the reports of several processes on one timeline.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from django_mongolock import Election, Lock, LockLost, LockManager, LockNotAcquired, MongoLockError
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired, lock_lost
from tests.reliability.agents import Output, _error, answer, serve
from tests.waiting import stream_open

__all__ = ["main"]


def now() -> float:
    return time.monotonic()


def _manager(config: dict[str, Any]) -> LockManager:
    return LockManager(
        config["url"],
        database=config["database"],
        ttl=config.get("ttl", 30.0),
        server_selection_timeout=config["sst"],
    )


def _view(lock: Lock) -> dict[str, Any]:
    return {"valid": lock.valid, "token": lock.token, "deadline": lock.deadline}


class Notices:
    """Reports each loss notice of the watched keys as it happens, with its time."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.names: dict[str, str] = {}  # key -> name
        self.watchers: list[threading.Thread] = []
        lock_lost.connect(self._signal, weak=False)
        lock_acquired.connect(self._acquired, weak=False)

    def watch(self, key: str, name: str) -> None:
        self.names[key] = name

    def emit(self, what: str, lock: Lock | None, name: str, **extra: Any) -> None:
        at = now()
        view = {} if lock is None else {"token": lock.token, "deadline": lock.deadline}
        self.out.emit({"event": "notice", "what": what, "name": name, "at": at, **view, **extra})

    def _signal(self, sender: object, lock: Lock, reason: str = "", **kwargs: Any) -> None:
        name = self.names.get(lock.key)
        if name is not None:
            self.emit("signal", lock, name, reason=reason)

    def _acquired(self, sender: object, lock: Lock, **kwargs: Any) -> None:
        """Every lock of a watched key gets a thread that reports when ``lost`` is set."""
        name = self.names.get(lock.key)
        if name is None:
            return
        event = lock.lost  # built here, before any loss

        def wait() -> None:
            # A release that finds the lease gone sets the event after ``released``.
            while not event.wait(0.5):
                if lock.released and not event.wait(2.0):
                    return
            self.emit("event", lock, name)

        watcher = threading.Thread(target=wait, name=f"lost-{name}", daemon=True)
        self.watchers.append(watcher)
        watcher.start()

    def settle(self, timeout: float = 3.0) -> None:
        """Let the ``lost`` watchers report before the process ends."""
        deadline = now() + timeout
        for watcher in self.watchers:
            watcher.join(max(0.0, deadline - now()))

    def on_lost(self, name: str) -> Callable[[Lock], None]:
        return lambda lock: self.emit("on_lost", lock, name)


class Rpc:
    """Runs the test's commands, one per stdin line, on one manager."""

    def __init__(self, config: dict[str, Any], out: Output) -> None:
        self.out = out
        self.manager = _manager(config)
        self.notices = Notices(out)
        self.locks: dict[str, Lock] = {}
        self.elections: dict[str, Election] = {}
        self.ballast: list[Lock] = []

    def close(self) -> None:
        for election in self.elections.values():
            election.on_demoted = None
            election.stop()
        self.manager.close()

    def acquire(
        self,
        name: str,
        key: str,
        kind: str = "plain",
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
    ) -> dict[str, Any]:
        """Take ``key`` as a plain lock, a shared lock or a slot of a semaphore of 1."""
        self.notices.watch(key, name)
        on_lost = self.notices.on_lost(name)
        sent = now()
        try:
            if kind == "semaphore":
                slot = self.manager.semaphore(key, 1, ttl=ttl)
                lock = slot.acquire(blocking=blocking, timeout=timeout, on_lost=on_lost)
            else:
                lock = self.manager.acquire(
                    key,
                    ttl=ttl,
                    blocking=blocking,
                    timeout=timeout,
                    shared=kind == "shared",
                    on_lost=on_lost,
                )
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        self.locks[name] = lock
        return {"ok": True, "sent": sent, "done": now(), "owner": lock.owner, **_view(lock)}

    def take_ballast(self, prefix: str, kind: str, count: int, ttl: float) -> dict[str, Any]:
        """Hold ``count`` more locks of ``kind`` ("plain" or "shared"), each watched under
        its key: enough of them make the refresher keep its write encoded and send it
        again as it is."""
        for number in range(count):
            key = f"{prefix}-{number}"
            self.notices.watch(key, key)
            lock = self.manager.acquire(key, ttl=ttl, blocking=False, shared=kind == "shared")
            self.ballast.append(lock)
        return {"ok": True, "tokens": {lock.key: lock.token for lock in self.ballast}}

    def kept(self) -> dict[str, Any]:
        """Whether the refresher's next write of each kind is the one it keeps encoded
        (the kept entry lists exactly the lane's leases of now)."""
        lane = get_refresher().lane_of(self.manager)
        batch = None if lane is None else lane.batch
        if lane is None or batch is None:
            return {"exclusive": False, "shared": False, "leases": 0, "current": False}
        listed = [entry[0] for entry in tuple(batch.kept.values())]
        return {
            "exclusive": any(held is batch.exclusive for held in listed),
            "shared": any(held is batch.shared for held in listed),
            "leases": batch.size,
            "current": lane.current and lane.batch is batch,
        }

    def drop_ballast(self) -> dict[str, Any]:
        """Release the ballast: for each lock, whether it had learnt of its loss, and
        whether the release still found it held."""
        dropped = [
            {"key": lock.key, "lost": lock.lost.is_set(), "released": lock.release()}
            for lock in self.ballast
        ]
        self.ballast.clear()
        return {"ok": True, "locks": dropped}

    def elect(self, name: str, key: str, ttl: float) -> dict[str, Any]:
        """Campaign for ``key``; ``elected`` and ``demoted`` are reported as they happen."""
        self.notices.watch(key, name)

        def elected(election: Election) -> None:
            at = now()
            self.out.emit({"event": "elected", "name": name, "at": at, "token": election.token})

        def demoted(election: Election) -> None:
            self.notices.emit("demoted", None, name)

        self.elections[name] = self.manager.elect(
            key, on_elected=elected, on_demoted=demoted, ttl=ttl
        )
        return {"ok": True, "started": now()}

    def resign(self, name: str) -> dict[str, Any]:
        """Stop campaigning; a leader releases (its ``on_demoted`` is not reported)."""
        election = self.elections.pop(name)
        was_leader = election.is_leader
        election.on_demoted = None
        election.stop()
        return {"ok": True, "was_leader": was_leader}

    def leading(self, name: str) -> dict[str, Any]:
        election = self.elections[name]
        return {"is_leader": election.is_leader, "token": election.token, "terms": election.terms}

    def after_heal(self, name: str) -> dict[str, Any]:
        """What the old holder's handle does once the network is back."""
        lock = self.locks[name]
        result: dict[str, Any] = {"valid": lock.valid, "lost": lock.lost.is_set()}
        try:
            lock.refresh()
            result["refresh"] = "refreshed"
        except LockLost:
            result["refresh"] = "LockLost"
        except MongoLockError as exc:
            result["refresh"] = type(exc).__name__
        try:
            result["release"] = lock.release()
        except MongoLockError as exc:
            result["release"] = type(exc).__name__
        result["valid_after"] = lock.valid
        return result

    def release(self, name: str) -> dict[str, Any]:
        sent = now()
        try:
            held = self.locks.pop(name).release()
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return {"ok": True, "held": held, "sent": sent, "done": now()}

    def state(self, name: str) -> dict[str, Any]:
        return {"now": now(), **_view(self.locks[name])}

    def stream(self, timeout: float = 30.0) -> dict[str, Any]:
        """Open the change stream now (bounded), so that the first handoff to a waiter of
        this process comes by its event, as the later ones do."""
        stream_open(self.manager, timeout)
        return {"ok": True}

    def ping(self) -> dict[str, Any]:
        """One bounded round trip through this process's own manager."""
        sent = now()
        try:
            self.manager.status("ping")
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return {"ok": True, "sent": sent, "done": now()}


def run_rpc(config: dict[str, Any], out: Output) -> int:
    return answer(Rpc(config, out), out, report_errors=True)


# -- worker: take one key again and again --------------------------------------------------------


def run_worker(config: dict[str, Any], out: Output) -> int:
    """Acquire, hold, release; report every step until told to stop.

    The worker holds each lock by waiting on its ``lost`` event, as code that relies on
    the notices does (it never looks at ``valid``, which would find a lapsed lease by
    itself). Every call reports when it was sent and when it returned, and every loss
    notice when it came (with the lock's token), so the test can check that no process
    believed it held the key once another had taken it, and that no call outlived its
    timeout.
    """
    rng = random.Random(config["seed"])
    stop = threading.Event()

    def watch() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch, name="stdin", daemon=True).start()
    manager = _manager(config)
    notices = Notices(out)
    key, ttl, worker = config["key"], config["ttl"], config["name"]
    notices.watch(key, worker)
    out.emit({"event": "ready", "pid": os.getpid()})
    try:
        while not stop.is_set():
            sent = now()
            try:
                lock = manager.acquire(
                    key,
                    ttl=ttl,
                    timeout=config["acquire_timeout"],
                    on_lost=notices.on_lost(worker),
                )
            except MongoLockError as exc:
                kind = "busy" if isinstance(exc, LockNotAcquired) else "error"
                failed = {"event": kind, "op": "acquire", "sent": sent, "done": now()}
                out.emit({**failed, **_error(exc)})
                stop.wait(0.05)
                continue
            acquired = {"event": "acquired", "token": lock.token, "sent": sent, "done": now()}
            out.emit({**acquired, "deadline": lock.deadline})
            lost = lock.lost.wait(rng.uniform(config.get("hold_min", 0.3), config["hold"]))
            sent = now()
            released: dict[str, Any] = {"event": "released", "token": lock.token, "lost": lost}
            try:
                released["held"] = lock.release()
            except MongoLockError as exc:
                released.update(held=None, **_error(exc))
            out.emit({**released, "sent": sent, "done": now()})
            stop.wait(rng.uniform(0.0, 0.2))
    finally:
        manager.close()
        notices.settle()
    out.emit({"event": "done"})
    return 0


ROLES: dict[str, Callable[[dict[str, Any], Output], int]] = {"rpc": run_rpc, "worker": run_worker}


def main(argv: list[str]) -> int:
    return serve(ROLES, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
