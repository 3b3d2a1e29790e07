"""Lock clients in processes of their own for the fault tests (``-m tests.reliability.agents``).

Each agent is a real process with its own pymongo client, refresher and watcher, so a test
can kill it (SIGKILL), freeze it (SIGSTOP) or run it under libfaketime. Agents talk JSON
lines: ``rpc`` answers one command per stdin line (and reports lost locks as they happen,
and, once it campaigns, the locks it releases); ``leave`` ends it without closing its
manager, so that the interpreter's exit hook does what is left;
``contender`` and ``counter`` run a workload until told to stop, reporting every operation.
With ``shared_stream`` in its config, an agent's manager shares one change stream with the
other agents of the host (``SHARED_STREAM``). Times are ``clock.now()`` (CLOCK_BOOTTIME, the
clock of lock deadlines), comparable between the processes of one machine.
"""

from __future__ import annotations

import os
import select
import time


def _relative_sleep(seconds: float) -> None:
    """``time.sleep`` without ``clock_nanosleep(TIMER_ABSTIME)``.

    Under libfaketime 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (the only setting in
    which a threaded Python program does not hang), Python 3.11's ``time.sleep`` fails with
    EINVAL: libfaketime shifts the absolute monotonic deadline by the fake offset
    (libfaketime issue #426). ``select`` sleeps for a relative time, which is unaffected.
    """
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)


if "faketime" in os.environ.get("LD_PRELOAD", ""):  # before pymongo can call time.sleep
    time.sleep = _relative_sleep  # type: ignore[assignment]

import asyncio  # noqa: E402
import atexit  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TextIO  # noqa: E402

from pymongo import MongoClient, monitoring  # noqa: E402
from pymongo.errors import PyMongoError  # noqa: E402

from django_mongolock import (  # noqa: E402
    Election,
    Lock,
    LockManager,
    LockNotAcquired,
    MongoLockError,
    clock,
    events,
    refresher,
)
from django_mongolock.refresher import get_refresher  # noqa: E402
from django_mongolock.signals import lock_released  # noqa: E402
from tests.reliability.fenced import FencedResource  # noqa: E402
from tests.utils import NamedManager  # noqa: E402
from tests.waiting import count_attempts, stream_open  # noqa: E402

__all__ = ["RESOURCE", "main"]

RESOURCE = "resource"
"""The collection of the fenced resource, next to the lock collection."""


def now() -> float:
    return clock.now()


class Output:
    """JSON lines on stdout, one writer at a time (the refresher thread reports too)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._mutex = threading.Lock()

    def emit(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=str)
        with self._mutex:
            self._stream.write(line + "\n")
            self._stream.flush()


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


def _client(config: dict[str, Any]) -> MongoClient[dict[str, Any]]:
    """The fenced resource's own client, bounded like the lock manager's."""
    timeout_ms = round(config["sst"] * 1000)
    return MongoClient(
        config["url"],
        serverSelectionTimeoutMS=timeout_ms,
        connectTimeoutMS=timeout_ms,
        timeoutMS=timeout_ms,
        w="majority",
        tz_aware=True,
    )


def _manager(config: dict[str, Any]) -> LockManager:
    options: dict[str, Any] = {
        "database": config["database"],
        "ttl": config.get("ttl", 30.0),
        "server_selection_timeout": config["sst"],
        "shared_stream": config.get("shared_stream", False),
    }
    if "app" in config:  # clients named so, whose commands a fail point can pick out
        return NamedManager(config["url"], app=config["app"], **options)
    return LockManager(config["url"], **options)


def _role(manager: LockManager) -> str | None:
    """How wake-ups reach ``manager``'s waiters now: "leader", "follower" (of a relay) or
    "own" stream; None while none reaches them."""
    watcher = manager.watcher
    return watcher.role if watcher.healthy else None


# -- rpc: one command per line ----------------------------------------------------------------


class _Answers(monitoring.CommandListener):
    """Reports when each command to ``collection`` was answered (``answered`` events):
    a test that holds a command on the server learns when the hold ended."""

    def __init__(self, out: Output, collection: str) -> None:
        self.out = out
        self.collection = collection
        self._sent: dict[int, str] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command.get(event.command_name) == self.collection:
            self._sent[event.request_id] = event.command_name

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        command = self._sent.pop(event.request_id, None)
        if command is not None:
            self.out.emit({"event": "answered", "command": command, "at": now()})

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._sent.pop(event.request_id, None)


class Rpc:
    """Holds named locks and runs the commands the test sends, one at a time."""

    def __init__(self, config: dict[str, Any], out: Output) -> None:
        self.config = config
        self.out = out
        self.manager = _manager(config)
        if "app" in config:  # a named manager, whose commands a test holds on the server
            # For the clients made from here on: the manager makes its own when first used.
            monitoring.register(_Answers(out, self.manager.collection))
        self.client = _client(config)
        self.resource = FencedResource(self.client[config["database"]][RESOURCE])
        self.locks: dict[str, Lock] = {}
        self.lost_at: dict[str, float] = {}
        self.elections: dict[str, Election] = {}

    def close(self) -> None:
        self.manager.close()
        self.client.close()

    def _on_lost(self, name: str) -> Callable[[Lock], None]:
        def report(lock: Lock) -> None:
            at = now()
            self.lost_at[name] = at
            self.out.emit(
                {"event": "lost", "name": name, "at": at, "wall": time.time(), **_view(lock)}
            )

        return report

    def acquire(
        self,
        name: str,
        key: str,
        ttl: float | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        refresh: bool | None = None,
    ) -> dict[str, Any]:
        sent = now()
        try:
            lock = self.manager.acquire(
                key,
                ttl=ttl,
                blocking=blocking,
                timeout=timeout,
                refresh=refresh,
                on_lost=self._on_lost(name),
            )
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return self._taken(name, lock, sent)

    def _taken(self, name: str, lock: Lock, sent: float) -> dict[str, Any]:
        done = now()
        self.locks[name] = lock
        return {
            "ok": True,
            "sent": sent,
            "done": done,
            "token": lock.token,
            "owner": lock.owner,
            "acquired_at": lock.acquired_at.timestamp(),
            "expires_at": lock.expires_at.timestamp(),
            "wall": time.time(),
            **_view(lock),
        }

    def aacquire(self, name: str, key: str, timeout: float | None = None) -> dict[str, Any]:
        """``acquire`` through ``aacquire``, in an event loop of its own (``asyncio.run``,
        as a script's is: Ctrl-C cancels its task)."""
        sent = now()
        try:
            lock = asyncio.run(self.manager.aacquire(key, timeout=timeout))
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return self._taken(name, lock, sent)

    def persist(
        self, name: str, key: str, ttl: float, timeout: float, give_up_after: float
    ) -> dict[str, Any]:
        """Acquire with ``timeout``, again and again, for at most ``give_up_after`` seconds.

        What an application does about a MongoDB outage: try again later. Every attempt
        is reported, so that the test can check that each one ended within its bounds.
        """
        attempts: list[dict[str, Any]] = []
        until = now() + give_up_after
        while now() < until:
            result = self.acquire(name, key, ttl=ttl, timeout=timeout)
            attempts.append({field: result.get(field) for field in ("ok", "error", "sent", "done")})
            if result["ok"]:
                return {**result, "attempts": attempts}
            threading.Event().wait(0.1)
        return {"ok": False, "attempts": attempts}

    def write(self, name: str, write_id: str) -> dict[str, Any]:
        """A fenced write with the lock's token, whether or not the lock is still held."""
        lock = self.locks[name]
        sent = now()
        try:
            verdict = self.resource.write(lock.key, lock.token, write_id)
        except PyMongoError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return {
            "ok": True,
            "sent": sent,
            "done": now(),
            "accepted": verdict.accepted,
            "fence": verdict.fence,
        }

    def state(self, name: str) -> dict[str, Any]:
        return {"now": now(), **_view(self.locks[name])}

    def refresh(self, name: str) -> dict[str, Any]:
        sent = now()
        try:
            self.locks[name].refresh()
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return {"ok": True, "sent": sent, "done": now(), **_view(self.locks[name])}

    def release(self, name: str) -> dict[str, Any]:
        sent = now()
        try:
            held = self.locks[name].release()
        except MongoLockError as exc:
            return {"ok": False, "sent": sent, "done": now(), **_error(exc)}
        return {"ok": True, "held": held, "sent": sent, "done": now()}

    def wait_lost(self, name: str, timeout: float) -> dict[str, Any]:
        lock = self.locks[name]
        deadline = now() + timeout
        lost = lock.lost.wait(timeout)
        # The flag comes first; on_lost, which notes the time, runs just after on a notice
        # worker: wait for it too, within the same bound.
        while lost and name not in self.lost_at and now() < deadline:
            time.sleep(0.005)
        return {"lost": lost, "at": self.lost_at.get(name), "now": now(), **_view(lock)}

    def hold(self, name: str, seconds: float, every: float = 0.05) -> dict[str, Any]:
        """Look at ``valid`` every ``every`` seconds for ``seconds``; report the first False."""
        lock = self.locks[name]
        started = now()
        checks = 0
        while (at := now()) < started + seconds:
            checks += 1
            if not lock.valid:
                return {"always_valid": False, "first_invalid": at, "checks": checks}
            lock.lost.wait(every)
        return {"always_valid": lock.valid, "first_invalid": None, "checks": checks}

    def clock(self) -> dict[str, Any]:
        """This process's wall clock next to the server's (``hello.localTime``)."""
        before = time.time()
        hello = self.manager.client.admin.command("hello")
        after = time.time()
        server: datetime = hello["localTime"].replace(tzinfo=UTC)  # naive UTC from command()
        return {
            "local": (before + after) / 2,
            "local_iso": datetime.now(UTC).isoformat(),
            "server": server.timestamp(),
            "monotonic": now(),
        }

    def stream(self, timeout: float = 30.0) -> dict[str, Any]:
        """Open the change stream now, as a first waiter would (bounded): its role."""
        stream_open(self.manager, timeout)
        return {"role": _role(self.manager)}

    def elect(self, name: str, key: str, ttl: float) -> dict[str, Any]:
        """Campaign for ``key`` in the background; from now on every lock this process
        releases is reported (``released``), those given back at exit among them."""
        if not self.elections:
            lock_released.connect(self._released, weak=False)
        election = self.manager.elect(key, ttl=ttl)
        self.elections[name] = election
        return {"leader": election.is_leader}

    def _released(self, sender: Any, lock: Lock, **kwargs: Any) -> None:
        self.out.emit({"event": "released", "key": lock.key, "token": lock.token, "at": now()})

    def refresher(self) -> dict[str, Any]:
        refresher = get_refresher()
        return {"running": refresher.running, "ticks": refresher.ticks, "held": len(refresher)}


def _view(lock: Lock) -> dict[str, Any]:
    return {
        "valid": lock.valid,
        "lost": lock.lost.is_set(),
        "remaining": lock.remaining,
        "deadline": lock.deadline,
        "token": lock.token,
    }


def run_rpc(config: dict[str, Any], out: Output) -> int:
    return answer(Rpc(config, out), out)


def answer(rpc: Any, out: Output, *, report_errors: bool = False) -> int:
    """Run the test's commands on ``rpc``, one JSON line each on stdin, until ``exit`` (or
    ``leave``, which does not close ``rpc``: the interpreter's exit hook does, within
    the request's ``exit_timeout`` if it gives one).

    A command's error ends the agent (the test sees it crash), or with ``report_errors`` is
    sent back as the reply, for tests that expect some commands to fail.
    """
    out.emit({"event": "ready", "pid": os.getpid()})
    close = True
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op = request.pop("op")
            seq = request.pop("seq")
            if op in ("exit", "leave"):
                close = op == "exit"
                if not close:
                    # Runs first at exit (hooks run last in, first out), just before the
                    # refresher's: when the exit began.
                    atexit.register(lambda: out.emit({"event": "exiting", "at": now()}))
                if "exit_timeout" in request:  # the exit hook's budget (``leave``)
                    refresher.EXIT_TIMEOUT = float(request["exit_timeout"])
                out.emit({"reply": seq})
                break
            try:
                reply = getattr(rpc, op)(**request)
            except Exception as exc:
                if not report_errors:
                    raise
                reply = {"ok": False, **_error(exc), "traceback": traceback.format_exc()}
            out.emit({"reply": seq, **reply})
    finally:
        if close:
            rpc.close()
    return 0


# -- contender: the failover workload ---------------------------------------------------------


def _stop_on_stdin() -> threading.Event:
    """Set when the test writes ``stop`` (or closes stdin)."""
    stop = threading.Event()

    def watch() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch, name="stdin", daemon=True).start()
    return stop


def run_contender(config: dict[str, Any], out: Output) -> int:
    """Take random keys, write through the fenced resource under each, release; report all.

    Holders do not look at ``valid`` before writing, like code that does not know it lost
    its lock. A few acquisitions ("laggards") take a short lease without refreshing and
    overstay it, so that their late writes meet a newer holder's token at the resource.
    """
    worker = config["worker"]
    rng = random.Random(config["seed"])
    stop = _stop_on_stdin()
    manager = _manager(config)
    client = _client(config)
    resource = FencedResource(client[config["database"]][RESOURCE])
    out.emit({"event": "ready", "pid": os.getpid(), "worker": worker})
    seq = 0
    try:
        while not stop.is_set():
            key = rng.choice(config["keys"])
            laggard = rng.random() < config["lag_probability"]
            sent = now()
            try:
                lock = manager.acquire(
                    key,
                    ttl=config["lag_ttl"] if laggard else None,
                    timeout=config["acquire_timeout"],
                    refresh=not laggard,
                )
            except MongoLockError as exc:
                busy = isinstance(exc, LockNotAcquired)
                event = "busy" if busy else "acquire_error"
                out.emit({"event": event, "key": key, "sent": sent, "done": now(), **_error(exc)})
                continue
            except Exception as exc:  # not one of the package's errors: the test judges it
                trace = traceback.format_exc()
                failed = {"event": "api_error", "key": key, "sent": sent, "done": now()}
                out.emit({**failed, **_error(exc), "traceback": trace})
                continue
            out.emit(
                {
                    "event": "acquired",
                    "key": key,
                    "token": lock.token,
                    "sent": sent,
                    "done": now(),
                    "laggard": laggard,
                }
            )
            stop.wait(config["lag"] if laggard else rng.uniform(0.005, 0.03))
            seq += 1
            write_id = f"{worker}-{seq}"
            write: dict[str, Any] = {"event": "write", "key": key, "token": lock.token}
            write.update(id=write_id, sent=now())
            try:
                verdict = resource.write(key, lock.token, write_id)
                write.update(outcome="accepted" if verdict.accepted else "rejected")
                write.update(fence=verdict.fence)
            except PyMongoError as exc:
                write.update(outcome="unknown", **_error(exc))
            write["done"] = now()
            write["valid_at"] = now()
            write["valid"] = lock.valid
            out.emit(write)
            sent = now()
            try:
                held = lock.release()
            except MongoLockError as exc:
                failed = {"event": "release_error", "key": key, "token": lock.token}
                out.emit({**failed, "sent": sent, "done": now(), **_error(exc)})
                continue
            except Exception as exc:  # not one of the package's errors: the test judges it
                failed = {"event": "api_error", "key": key, "token": lock.token, "sent": sent}
                trace = traceback.format_exc()
                out.emit({**failed, "done": now(), **_error(exc), "traceback": trace})
                continue
            out.emit(
                {
                    "event": "release",
                    "key": key,
                    "token": lock.token,
                    "held": held,
                    "sent": sent,
                    "done": now(),
                }
            )
    finally:
        manager.close()
        client.close()
    out.emit({"event": "done", "worker": worker})
    return 0


# -- counter: the load workload ---------------------------------------------------------------


def run_counter(config: dict[str, Any], out: Output) -> int:
    """Increment a counter in a file ``rounds`` times, each time under the lock.

    The counter is read, then written back plus one, so two overlapping sections lose an
    increment; entering creates a marker file with O_EXCL, which fails if another section
    is inside. The file also keeps the last token, which each holder must exceed.

    Each section is reported as (entered, left, token, role): ``role`` says how wake-ups
    reached this process then (``_role``). With ``shared_stream`` the stream opens before
    ``ready``, which names the role the process took. The report also counts acquire
    attempts, and lists the tokens of the handoffs a wake-up told of (a release named this
    process's waiter the holder, and the event said so), not those an attempt found. The
    manager stays open after ``done`` until the input ends: a relay's leader that ended
    first would hand the relay to another process while the others still run.
    """
    directory = Path(config["directory"])
    counter = directory / "counter"
    marker = directory / "inside"
    manager = _manager(config)
    attempts = count_attempts(manager)
    told: list[int] = []
    events.subscribe(
        lambda e: told.append(e.token) if isinstance(e, events.Handoff) and e.from_owner else None
    )
    if manager.shared_stream:
        stream_open(manager, 60.0)
    overlaps = regressions = sections = 0
    log: list[tuple[float, float, int, str | None]] = []
    out.emit({"event": "ready", "pid": os.getpid(), "role": _role(manager)})
    sys.stdin.readline()  # all start together
    started = now()
    try:
        for _ in range(config["rounds"]):
            with manager.lock(config["key"], timeout=config["acquire_timeout"]) as lock:
                entered, role = now(), _role(manager)
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    alone = True
                except FileExistsError:
                    overlaps += 1
                    alone = False
                value, last_token = (int(part) for part in counter.read_text().split())
                if lock.token <= last_token:
                    regressions += 1
                counter.write_text(f"{value + 1} {lock.token}")
                sections += 1
                if alone:
                    marker.unlink()
                log.append((entered, now(), lock.token, role))
        out.emit(
            {
                "event": "done",
                "sections": sections,
                "overlaps": overlaps,
                "regressions": regressions,
                "seconds": now() - started,
                "attempts": len(attempts),
                "handoffs_told": told,
                "log": log,
            }
        )
        sys.stdin.readline()  # a relay's leader leads until the others are done too
    finally:
        manager.close()
    return 0


ROLES: dict[str, Callable[[dict[str, Any], Output], int]] = {
    "rpc": run_rpc,
    "contender": run_contender,
    "counter": run_counter,
}


def serve(roles: dict[str, Callable[[dict[str, Any], Output], int]], argv: list[str]) -> int:
    """Run the role named by ``argv[0]`` with the JSON config of ``argv[1]``; report a crash."""
    role, config = argv[0], json.loads(argv[1])
    out = Output(sys.stdout)
    try:
        return roles[role](config, out)
    except BaseException as exc:
        out.emit({"event": "crash", **_error(exc), "traceback": traceback.format_exc()})
        raise


def main(argv: list[str]) -> int:
    return serve(ROLES, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
