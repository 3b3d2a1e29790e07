"""Contention statistics: what this process's locks saw, counted per key and minute, and
added to ``<collection>.stats`` after each refresher tick (no thread of its own).

The recorder listens to the lock events (acquire attempts, releases, losses, handoffs)
and keeps plain counters in memory, at most ``MAX_BUFFERED`` keys between two flushes
(later keys are counted under the summed-up "other keys", and then minutes older than the
collection's retention are dropped, so a manager that never ticks stays small). Each
manager writes at most ``MAX_KEYS`` keys per minute, however often it flushes. After each
tick of a manager's refresher lane, the notice worker that tells observers of the tick adds
that manager's counts in one bulk write, bounded in time so that no later notice waits
long; a failed write drops those counts (they are statistics, not records) and is logged
once. The admin's contention view reads them back.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

import pymongo

from django_mongolock import events
from django_mongolock.exceptions import MongoLockError
from django_mongolock.queries import stats as queries
from django_mongolock.store import LockStore
from django_mongolock.store.stats import StatsStore

__all__ = [
    "MAX_BUFFERED",
    "Recorder",
    "flush_all",
    "get_recorder",
    "install",
    "installed",
    "stats_store",
    "uninstall",
]

logger = logging.getLogger("django_mongolock.stats")

# Keys counted in memory between two flushes; more are summed up under "other keys".
MAX_BUFFERED: Final = 1000
# The longest the flush at interpreter exit may take, per manager.
EXIT_FLUSH_TIMEOUT: Final = 0.5
# The longest a flush may take: the refresher's next write must not wait on it.
FLUSH_TIMEOUT: Final = 1.0

Outcome = Literal["acquired", "busy", "timeout", "error"]

_stores: weakref.WeakKeyDictionary[LockStore, StatsStore] = weakref.WeakKeyDictionary()
_stores_mutex = threading.Lock()


def stats_store(store: LockStore) -> StatsStore:
    """The statistics store next to ``store``'s collection (one per lock store)."""
    with _stores_mutex:
        found = _stores.get(store)
        if found is None:
            found = _stores[store] = StatsStore(store.collection)
        return found


@dataclass(slots=True)
class _Pending:
    buckets: dict[tuple[str, datetime], queries.Bucket]


# Past MAX_BUFFERED, counts older than this are dropped unwritten: the TTL index would
# purge them at once.
_KEPT: Final = timedelta(seconds=queries.STATS_RETENTION)


class Recorder:
    """Counters per source (a manager), key and minute, until the source's next flush."""

    def __init__(self, max_buffered: int = MAX_BUFFERED) -> None:
        self.max_buffered = max_buffered
        self._mutex = threading.Lock()
        # Weak: the counts of a manager that is dropped before its next tick go with it.
        self._pending: weakref.WeakKeyDictionary[Hashable, _Pending] = weakref.WeakKeyDictionary()
        # The keys each source has written per minute: a minute's MAX_KEYS hold across flushes.
        self._written: weakref.WeakKeyDictionary[Hashable, dict[datetime, set[str]]] = (
            weakref.WeakKeyDictionary()
        )
        self._failing = False
        self.flushes = 0
        # The last minute seen, as a number and as its bucket's datetime: one conversion
        # a minute, not one per event.
        self._minute: tuple[int, datetime] = (-1, queries.bucket_of(0))

    def _bucket(self, source: Hashable, key: str, at: float) -> queries.Bucket:
        """The bucket of ``key`` at ``at`` (holding the mutex)."""
        pending = self._pending.get(source)
        if pending is None:
            pending = self._pending[source] = _Pending({})
        number = int(at // queries.BUCKET_SECONDS)
        if number == self._minute[0]:
            minute = self._minute[1]
        else:
            minute = queries.bucket_of(at)
            self._minute = (number, minute)
        bucket = pending.buckets.get((key, minute))
        if bucket is None:
            if len(pending.buckets) >= self.max_buffered:
                key = queries.OTHER_KEYS
                bucket = pending.buckets.get((key, minute))
                if bucket is None:  # a new minute past the cap: forget what is too old to keep
                    _drop_before(pending.buckets, minute - _KEPT)
            if bucket is None:
                bucket = pending.buckets[(key, minute)] = queries.Bucket()
        return bucket

    def acquire(
        self,
        source: Hashable,
        key: str,
        outcome: Outcome,
        *,
        wait: float = 0.0,
        owner: str = "",
        token: int | None = None,
        at: float | None = None,
    ) -> None:
        """One acquire attempt that ended: ``wait`` seconds spent waiting for the key (0 for
        one that found it free: however long its round trips took, it did not wait)."""
        at = time.time() if at is None else at
        wait_ms = max(0, round(wait * 1000))
        with self._mutex:
            bucket = self._bucket(source, key, at)
            counts = bucket.counts
            if outcome == "acquired":
                counts["acquired"] = counts.get("acquired", 0) + 1
                if wait > 0:
                    counts["waited"] = counts.get("waited", 0) + 1
                    counts["wait_ms"] = counts.get("wait_ms", 0) + wait_ms
            elif outcome == "busy":
                counts["busy"] = counts.get("busy", 0) + 1
            elif outcome == "timeout":
                counts["timeouts"] = counts.get("timeouts", 0) + 1
                counts["wait_ms"] = counts.get("wait_ms", 0) + wait_ms
            else:
                counts["errors"] = counts.get("errors", 0) + 1
            bucket.wait_max_ms = max(bucket.wait_max_ms, wait_ms)
            if outcome == "timeout":
                self._event(bucket, "timeout", at, owner=owner, token=token, wait_ms=wait_ms)

    def released(self, source: Hashable, key: str, *, hold: float, at: float | None = None) -> None:
        at = time.time() if at is None else at
        with self._mutex:
            counts = self._bucket(source, key, at).counts
            counts["released"] = counts.get("released", 0) + 1
            counts["hold_ms"] = counts.get("hold_ms", 0) + max(0, round(hold * 1000))

    def lost(
        self,
        source: Hashable,
        key: str,
        reason: str,
        *,
        owner: str = "",
        token: int | None = None,
        at: float | None = None,
    ) -> None:
        at = time.time() if at is None else at
        with self._mutex:
            bucket = self._bucket(source, key, at)
            bucket.counts["lost"] = bucket.counts.get("lost", 0) + 1
            bucket.lost_by[reason] = bucket.lost_by.get(reason, 0) + 1
            self._event(bucket, "lost", at, owner=owner, token=token, reason=reason)

    def handoff(
        self,
        source: Hashable,
        key: str,
        *,
        owner: str = "",
        token: int | None = None,
        at: float | None = None,
    ) -> None:
        at = time.time() if at is None else at
        with self._mutex:
            bucket = self._bucket(source, key, at)
            bucket.counts["handoffs"] = bucket.counts.get("handoffs", 0) + 1
            self._event(bucket, "handoff", at, owner=owner, token=token)

    @staticmethod
    def _event(
        bucket: queries.Bucket,
        kind: str,
        at: float,
        *,
        owner: str = "",
        token: int | None = None,
        reason: str = "",
        wait_ms: int | None = None,
    ) -> None:
        event: dict[str, object] = {
            "kind": kind,
            "at": datetime.fromtimestamp(at, UTC),
            "owner": owner,
        }
        if token is not None:
            event["token"] = token
        if reason:
            event["reason"] = reason
        if wait_ms is not None:
            event["wait_ms"] = wait_ms
        bucket.events = [*bucket.events, event][-queries.EVENTS_KEEP :]

    def take(self, source: Hashable) -> dict[tuple[str, datetime], queries.Bucket]:
        """The counts of ``source`` since its last flush, at most ``MAX_KEYS`` keys per
        minute (the others summed up under "other keys"); the buffer is emptied.

        A minute's keys count across flushes: the keys it already wrote stay, and new ones
        fill the room left, the busiest first, so that a manager that flushes six times a
        minute still writes at most ``MAX_KEYS`` keys' documents for it (and its "other
        keys" and total). A key counts once taken, even if that flush's write then fails.
        """
        with self._mutex:
            pending = self._pending.pop(source, None)
            if pending is None:
                return {}
            written = self._written.get(source)
            if written is None:
                written = self._written[source] = {}
            return _cut(pending.buckets, written)

    def sources(self) -> list[Hashable]:
        """The sources with counts waiting for a flush."""
        with self._mutex:
            return list(self._pending.keys())

    def forget(self) -> None:
        """Drop every count not flushed yet (a forked child starts with none)."""
        with self._mutex:
            self._pending.clear()
            self._written.clear()

    def pending(self, source: Hashable) -> int:
        """How many (key, minute) counters wait for ``source``'s next flush."""
        with self._mutex:
            found = self._pending.get(source)
            return 0 if found is None else len(found.buckets)

    def flush(self, source: Hashable, store: LockStore, timeout: float = FLUSH_TIMEOUT) -> int:
        """Add ``source``'s counts to ``store``'s statistics: one write, within ``timeout``.

        Returns how many (key, minute) documents were written; 0 when there was nothing,
        or when the write failed (logged once until one succeeds again).
        """
        buckets = self.take(source)
        if not buckets:
            return 0
        try:
            with pymongo.timeout(timeout):
                stats_store(store).add(buckets)
        except (MongoLockError, pymongo.errors.PyMongoError) as exc:
            if not self._failing:
                logger.warning("could not record lock statistics: %s", exc)
            self._failing = True
            return 0
        self._failing = False
        self.flushes += 1
        return len(buckets)


def _drop_before(buckets: dict[tuple[str, datetime], queries.Bucket], oldest: datetime) -> None:
    for found in [k for k in buckets if k[1] < oldest]:
        del buckets[found]


def _cut(
    buckets: dict[tuple[str, datetime], queries.Bucket], written: dict[datetime, set[str]]
) -> dict[tuple[str, datetime], queries.Bucket]:
    """``buckets`` with at most ``MAX_KEYS`` keys per minute, counting the keys ``written``
    before in that minute (updated here); the rest merged into the minute's other keys."""
    by_minute: dict[datetime, list[str]] = {}
    for key, minute in buckets:
        if key != queries.OTHER_KEYS:
            by_minute.setdefault(minute, []).append(key)
    out: dict[tuple[str, datetime], queries.Bucket] = {}
    for minute, keys in by_minute.items():
        before = written.setdefault(minute, set())
        fresh = sorted(
            (k for k in keys if k not in before),
            key=lambda k: (-buckets[(k, minute)].weight, k),
        )
        room = max(0, queries.MAX_KEYS - len(before))
        before.update(fresh[:room])
        for key in keys:
            bucket = buckets[(key, minute)]
            if key in before:
                out[(key, minute)] = bucket
                continue
            other = out.setdefault((queries.OTHER_KEYS, minute), queries.Bucket())
            bucket.events = []  # only the kept keys' events are worth their space
            other.merge(bucket)
    for (key, minute), bucket in buckets.items():
        if key == queries.OTHER_KEYS:
            bucket.events = []
            out.setdefault((key, minute), queries.Bucket()).merge(bucket)
    if written:
        newest = max(written)
        for minute in [m for m in written if m < newest - _KEPT]:
            del written[minute]
    return out


_recorder: Recorder | None = None
_recorder_mutex = threading.Lock()


def get_recorder() -> Recorder:
    """This process's recorder."""
    global _recorder
    with _recorder_mutex:
        if _recorder is None:
            _recorder = Recorder()
        return _recorder


def _store_of(source: object) -> LockStore | None:
    """The lock store of an event's source (a manager); None once it is closed."""
    try:
        store = getattr(source, "store", None)
    except MongoLockError:
        return None
    return store if isinstance(store, LockStore) else None


def observe(event: events.Event, recorder: Recorder | None = None) -> None:
    """Count one lock event; on a refresher tick, flush the ticking manager's counts."""
    recorder = recorder or _recorder or get_recorder()
    if isinstance(event, events.AcquireFinished):
        if event.outcome != "cancelled":
            recorder.acquire(
                event.source,
                event.key,
                event.outcome,
                wait=event.waited if event.contended else 0.0,
                owner=event.owner,
                token=event.token,
            )
    elif isinstance(event, events.Released):
        # A release that found the lease ended is the loss's, counted as such whichever
        # of the two the holder learnt first.
        if event.held and event.held_for is not None:
            recorder.released(event.source, event.lock.key, hold=event.held_for)
    elif isinstance(event, events.Lost):
        recorder.lost(
            event.source,
            event.lock.key,
            event.reason,
            owner=event.lock.owner,
            token=event.lock.token,
        )
    elif isinstance(event, events.Handoff):
        recorder.handoff(event.source, event.key, owner=event.to_owner, token=event.token)
    elif isinstance(event, events.RefresherTick):
        # The next refresh must not wait on statistics: nothing while the server is
        # unreachable or refuses writes (the refresh just failed), or slow (the tick
        # took, or started, more than half its interval late: the counts wait for a
        # quicker tick), and a quarter of the interval at most.
        if not event.ok or not recorder.pending(event.source):
            return
        every = event.interval
        if every > 0 and (event.duration > every / 2 or event.lag > every / 2):
            return
        store = _store_of(event.source)
        if store is not None:
            recorder.flush(event.source, store, min(FLUSH_TIMEOUT, every / 4) or FLUSH_TIMEOUT)


_unsubscribe: Callable[[], None] | None = None
_hooked = False


def flush_all(timeout: float = EXIT_FLUSH_TIMEOUT) -> int:
    """Flush every manager's counts now, each within ``timeout`` (run at interpreter exit,
    so that a short process, a cron command, leaves its counts behind)."""
    recorder = _recorder
    if recorder is None:
        return 0
    written = 0
    for source in recorder.sources():
        store = _store_of(source)
        if store is not None:
            written += recorder.flush(source, store, timeout)
    return written


def _forget_in_child() -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.forget()  # the parent flushes its own counts


def install() -> None:
    """Record this process's contention statistics from now on (idempotent; no thread,
    no I/O until a refresher tick, or the interpreter's exit, has counts to write)."""
    global _unsubscribe, _hooked
    with _recorder_mutex:
        if _unsubscribe is None:
            _unsubscribe = events.subscribe(observe)
        if not _hooked:
            _hooked = True
            atexit.register(flush_all)
            os.register_at_fork(after_in_child=_forget_in_child)


def uninstall() -> None:
    """Stop recording; counts not flushed yet are dropped."""
    global _unsubscribe, _recorder
    with _recorder_mutex:
        if _unsubscribe is not None:
            _unsubscribe()
            _unsubscribe = None
        _recorder = None


def installed() -> bool:
    return _unsubscribe is not None
