"""Worker processes and what they run: the lock loops of the timed workloads.

Workers are spawned once (``spawn``: each builds its own clients, none inherited) and
reused for every round and contender, so that a round measures locking rather than
process start-up. Contended jobs start together on a barrier. A job marked ``fresh`` (and
any whose contender installs observers, which are process-wide) builds its contender for
itself and closes it after.

Safety is counted while measuring: every critical section marks its key as occupied in
shared memory (an overlap is a second holder seen there) and does a read-modify-write of
a shared counter without any other protection (a lost update is an acquisition whose
increment is missing at the end of the round).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from multiprocessing.synchronize import Lock as ProcessLock
from typing import Any, Final

from benchmarks.contenders import Contender, Spec, build, quiet_peers

__all__ = ["HANDOFF_KEY", "Job", "Pool", "Round", "Shared"]

HANDOFF_KEY: Final = "handoff"
BARRIER_TIMEOUT: Final = 120.0
# How long a worker keeps trying its first, unmeasured, lock before its round fails.
CONNECT_WITHIN: Final = 120.0


class Shared:
    """Occupancy and counters per key slot, in shared memory, for the safety counts."""

    def __init__(self, ctx: SpawnContext, slots: int) -> None:
        self.slots = slots
        self.occupancy = ctx.RawArray(ctypes.c_int32, slots)
        self.counters = ctx.RawArray(ctypes.c_int64, slots)
        self.overlaps = ctx.RawValue(ctypes.c_int64, 0)
        self.guard: ProcessLock = ctx.Lock()

    def reset(self) -> None:
        ctypes.memset(self.occupancy, 0, ctypes.sizeof(self.occupancy))
        ctypes.memset(self.counters, 0, ctypes.sizeof(self.counters))
        self.overlaps.value = 0

    def total(self) -> int:
        return sum(self.counters)

    def critical(self, slot: int, hold: float) -> None:
        """The protected section: mark the key held, read-modify-write its counter, unmark."""
        with self.guard:
            self.occupancy[slot] += 1
            if self.occupancy[slot] > 1:
                self.overlaps.value += 1
        value = self.counters[slot]
        if hold:
            time.sleep(hold)
        self.counters[slot] = value + 1
        with self.guard:
            self.occupancy[slot] -= 1


@dataclass(frozen=True, slots=True)
class Job:
    """One worker's part of one round."""

    workload: str
    spec: Spec
    parties: int = 1
    duration: float = 0.0
    cycles: int = 0
    keys: int = 1
    hold: float = 0.0
    seed: int = 0
    fresh: bool = False
    """Build the contender for this job alone and close it after (always so when its spec
    installs instrumentation: process-wide observers must not outlive their job)."""


@dataclass(frozen=True, slots=True)
class Round:
    """What the workers of one round sent back, and the shared counters after it."""

    workers: list[dict[str, Any]]
    counted: int
    """Increments of the shared counters seen at the end: the acquisitions minus lost updates."""
    overlaps: int
    """Critical sections entered while another holder of the same key was inside."""


@dataclass
class Pool:
    """``size`` spawned workers; ``run`` hands a job to the first ``parties`` of them."""

    size: int
    ctx: SpawnContext = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    slots: int = 1000

    def __post_init__(self) -> None:
        self.shared = Shared(self.ctx, self.slots)
        self.barriers = {n: self.ctx.Barrier(n) for n in range(2, self.size + 1)}
        self.results: Queue[tuple[int, str, Any]] = self.ctx.Queue()
        self.inboxes: list[Queue[Job | None]] = [self.ctx.Queue() for _ in range(self.size)]
        self.processes: list[SpawnProcess] = []
        for index in range(self.size):
            process = self.ctx.Process(
                target=_serve,
                args=(index, self.inboxes[index], self.results, self.barriers, self.shared),
                name=f"bench-worker-{index}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def run(self, job: Job, timeout: float = 300.0) -> Round:
        """Run ``job`` on ``job.parties`` workers at once, with the round's safety counts."""
        self.shared.reset()
        for index in range(job.parties):
            self.inboxes[index].put(job)
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < job.parties:
            index, status, payload = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"worker {index} failed in {job.workload}:\n{payload}")
            results[index] = payload
        return Round(
            [results[index] for index in sorted(results)],
            counted=self.shared.total(),
            overlaps=self.shared.overlaps.value,
        )

    def close(self) -> None:
        """Stop every worker. Results still on their way are read and dropped meanwhile:
        a worker exits only once what it put on the queue is in the pipe, and after a
        failed round nobody else reads it (a worker stopped while it writes would keep
        the queue's lock, and every other worker, forever)."""
        for inbox in self.inboxes:
            inbox.put(None)
        deadline = time.monotonic() + 60
        while any(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self.results.get(timeout=0.1)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
            process.join(5)


def _serve(
    index: int,
    inbox: Queue[Job | None],
    results: Queue[tuple[int, str, Any]],
    barriers: dict[int, Barrier],
    shared: Shared,
) -> None:
    quiet_peers()
    contenders: dict[Spec, Contender] = {}
    while (job := inbox.get()) is not None:
        try:
            run = _WORKLOADS[job.workload]
            barrier = barriers.get(job.parties)
            if job.fresh or job.spec.instrument:
                fresh = build(job.spec)
                try:
                    result = run(fresh, job, barrier, shared, index)
                finally:
                    fresh.close()
            else:
                contender = contenders.get(job.spec)
                if contender is None:
                    contender = contenders[job.spec] = build(job.spec)
                result = run(contender, job, barrier, shared, index)
            results.put((index, "ok", result))
        except BaseException:
            results.put((index, "error", traceback.format_exc()))
            barrier = barriers.get(job.parties)
            if barrier is not None:
                barrier.abort()
            return
    for contender in contenders.values():
        contender.close()


def _start(barrier: Barrier | None) -> float:
    if barrier is not None:
        barrier.wait(BARRIER_TIMEOUT)
    return time.monotonic()


def _uncontended(
    contender: Contender, job: Job, barrier: Barrier | None, shared: Shared, index: int
) -> dict[str, Any]:
    """Acquire and release over rotating keys, one process, nobody else in the way."""
    keys = [f"u-{slot}" for slot in range(job.keys)]
    for slot in range(min(20, job.cycles)):  # warm the connection pool and the threads
        contender.release(_must(contender.try_acquire(keys[slot % job.keys])))
    shared.reset()
    acquire: list[float] = []
    release: list[float] = []
    clock = time.perf_counter
    cpu_started = time.process_time()
    started = clock()
    for cycle in range(job.cycles):
        slot = cycle % job.keys
        t0 = clock()
        handle = _must(contender.try_acquire(keys[slot]))
        t1 = clock()
        shared.critical(slot, 0.0)
        t2 = clock()
        contender.release(handle)
        t3 = clock()
        acquire.append(t1 - t0)
        release.append(t3 - t2)
    elapsed = clock() - started
    return {
        "cycles": job.cycles,
        "elapsed": elapsed,
        "cpu": time.process_time() - cpu_started,
        "acquire": acquire,
        "release": release,
    }


def _handoff(
    contender: Contender, job: Job, barrier: Barrier | None, shared: Shared, index: int
) -> dict[str, Any]:
    """Block on one key, hold it ``job.hold``, release it, and again, until time is up.

    A call the server did not answer in time (hundreds of processes on a small machine)
    is counted in ``timeouts`` and the loop goes on: a turn whose release timed out is
    recorded all the same, an acquire that timed out has no turn. ``asked`` is when the
    first acquire was called, whether or not it returned.
    """
    records: list[tuple[float, float, float, float]] = []
    timeouts = 0
    clock = time.monotonic
    asked = _start(barrier)
    end = asked + job.duration
    while (t0 := clock()) < end:
        try:
            handle = contender.acquire(HANDOFF_KEY)
        except Exception as error:
            if not contender.timed_out(error):
                raise
            timeouts += 1
            continue
        t1 = clock()
        shared.critical(0, job.hold)
        t2 = clock()
        try:
            contender.release(handle)
        except Exception as error:
            if not contender.timed_out(error):
                raise
            timeouts += 1
        records.append((t0, t1, t2, clock()))
    return {
        "worker": index,
        "pid": os.getpid(),
        "asked": asked,
        "records": records,
        "timeouts": timeouts,
    }


def _connect(
    contender: Contender, job: Job, barrier: Barrier | None, shared: Shared, index: int
) -> dict[str, Any]:
    """Take and release a key of this worker's own, as soon as it is ready: no barrier.

    Workers come up one by one, so their connections open spread out in time, as a
    deployment's processes start, rather than all in one instant after a barrier. While
    hundreds of workers still start on a small machine, the server may not answer one in
    time: that try is not measured, so it is made again, for up to ``CONNECT_WITHIN``.
    """
    deadline = time.monotonic() + CONNECT_WITHIN
    while True:
        try:
            contender.release(_must(contender.try_acquire(f"connect-{index}")))
            return {"worker": index}
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _many_keys(
    contender: Contender, job: Job, barrier: Barrier | None, shared: Shared, index: int
) -> dict[str, Any]:
    """Non-blocking tries on random keys out of ``job.keys``; release at once when taken."""
    rng = random.Random(job.seed * 100 + index)
    names = [f"m-{slot}" for slot in range(job.keys)]
    tries = acquired = 0
    clock = time.monotonic
    end = _start(barrier) + job.duration
    started = clock()
    while clock() < end:
        slot = rng.randrange(job.keys)
        handle = contender.try_acquire(names[slot])
        tries += 1
        if handle is None:
            continue
        shared.critical(slot, job.hold)
        contender.release(handle)
        acquired += 1
    return {"tries": tries, "acquired": acquired, "elapsed": clock() - started}


def _must(handle: object | None) -> object:
    if handle is None:
        raise RuntimeError("an uncontended lock was busy: the workload's keys are not clean")
    return handle


_WORKLOADS: Final[
    dict[str, Callable[[Contender, Job, Barrier | None, Shared, int], dict[str, Any]]]
] = {
    "uncontended": _uncontended,
    "connect": _connect,
    "handoff": _handoff,
    "many_keys": _many_keys,
}
