"""The wait plan of one acquisition, without I/O: what to ask for, when to ask again, when to stop.

Every time is given by the caller (``clock.now()``'s scale), so the plan can be
followed step by step without a server or a clock.

The sync and the async acquire loops (``acquiring.py``) differ only in how they send an
attempt and how they sleep; every decision between two attempts is made here, once:
how long to sleep (a release wakes the waiter, or the holder's lease ends, or a
back-off), how many releases to sleep through when others are ahead in line, and when
the caller's timeout has passed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from django_mongolock import clock
from django_mongolock.exceptions import LockNotAcquired
from django_mongolock.info import LockInfo
from django_mongolock.queries import HANDOFF_LEASE_MS, LINE_CHECK_MS, PLACE_GRACE_MS
from django_mongolock.waiters import Handoff

__all__ = [
    "Request",
    "WaitPlan",
    "busy",
    "first_lease",
    "handed_over",
    "late",
    "must_extend",
    "next_delay",
]

# Back-off of a blocked acquirer: doubling from 10 ms up to 500 ms, each sleep drawn from
# [half, full] of that, and never past the holder's lease end or the caller's timeout.
BACKOFF_BASE = 0.01
BACKOFF_CAP = 0.5
# How long a waiter behind others in line sleeps on the stream between attempts while
# the key is free, or after a release that was not its turn: well within the grace
# period that keeps its place.
BEHIND_IN_LINE = 0.75 * PLACE_GRACE_MS / 1000
# How often an exclusive waiter with others ahead looks again while the key is held: its
# place lasts this plus the grace period, and a handoff it does not hear of cuts it to no
# less.
LINE_CHECK = LINE_CHECK_MS / 1000


@dataclass(frozen=True, slots=True)
class Request:
    """One acquisition: the key, this attempt's owner id, and what kind of lease."""

    key: str
    owner: str
    ttl: float
    shared: bool = False
    limit: int | None = None
    tags: Mapping[str, str] | None = None

    def arguments(self, *, queue: bool) -> dict[str, Any]:
        """The store's ``acquire`` arguments (the sync and the async store take the same)."""
        return {
            "key": self.key,
            "owner": self.owner,
            "ttl": self.ttl,
            "queue": queue,
            "shared": self.shared,
            "limit": self.limit,
            "tags": self.tags,
        }

    def taken(self, info: LockInfo) -> LockInfo | None:
        """This request's lease, if the attempt that returned ``info`` got one."""
        if self.shared:
            return info.as_holder(self.owner)
        # A lease a release handed over may have lapsed before the waiter took it.
        return info if info.owner == self.owner and info.live else None


class WaitPlan:
    """The schedule of one blocked acquirer between its attempts.

    The loop asks ``wake_at()`` when to try again (None: the timeout has passed, raise
    ``busy()``), sleeps on its wake event until then, asks ``woken()`` whether the
    releases it saw are enough to try, and reports each attempt to ``answered()``.
    """

    __slots__ = (
        "_at_once",
        "_attempt",
        "_deadline",
        "_started",
        "handoff",
        "info",
        "request",
        "seen",
        "sent_at",
    )

    def __init__(
        self,
        request: Request,
        limit: float | None,
        sent_at: float,
        info: LockInfo,
        started: float | None = None,
    ) -> None:
        """``sent_at``: when the attempt that answered ``info`` was sent; ``started``:
        when the acquire's first request was (the wait counts from it), if earlier."""
        self.request = request
        self.sent_at = sent_at
        self.info = info
        self.seen = 0  # releases counted before the last attempt
        self._started = sent_at if started is None else started
        self._deadline = None if limit is None else self._started + limit
        self._attempt = 0
        self._at_once = False  # renamed after its last answer: no place in line to keep
        # The releasing holder's owner id once a release handed this request its lease
        # ("" when nobody said whose); None while the lease was not handed over.
        self.handoff: str | None = None

    def wake_at(self, stream_since: float | None, now: float) -> float | None:
        """When to try again, given since when the change stream has been healthy."""
        if self._at_once:
            wanted = 0.0
        else:
            wanted, self._attempt = next_delay(
                self.info, stream_since, self.sent_at, self._attempt, shared=self.request.shared
            )
        if self._deadline is None:
            return now + wanted
        left = self._deadline - now
        return None if left <= 0 else now + min(wanted, left)

    def woken(self, count: int) -> bool:
        """Whether ``count`` releases seen so far are enough to try: one per waiter ahead,
        plus the holder's (shared waiters may get in together: they try after each one).

        Counting may err (a release seen twice, a place ahead that lapsed): then the
        waiter tries once too early, or sleeps until its timer, never past it.
        """
        info = self.info
        if self.request.shared or info.position <= 0:
            needed = 1
        else:
            needed = info.position + (1 if info.held else 0)
        return count - self.seen >= needed

    @staticmethod
    def behind(wake_at: float, now: float) -> float:
        """A release a waiter ahead takes; if that waiter is gone, its place lapses within
        the grace period: look again by then."""
        return min(wake_at, now + BEHIND_IN_LINE)

    def answered(
        self, sent_at: float, info: LockInfo, seen: int, told: Handoff | None = None
    ) -> LockInfo | None:
        """Take the answer to an attempt sent at ``sent_at``: the lease, if it is ours.

        The attempt may find the key already its own, handed over by a release that
        no wake-up told of in time (a waiter in the releasing process is woken by the
        release itself, which does not know whom the server handed the key to):
        that is a handoff too. ``told`` is a wake-up's handoff that came meanwhile,
        naming the releasing holder (and telling a handed lease the attempt could not:
        one of a ttl no longer than the first lease).
        """
        self.sent_at, self.info, self.seen = sent_at, info, seen
        self._at_once = False
        mine = self.request.taken(info)
        if mine is not None:
            if told is not None and told.token == mine.token:
                self.handoff = told.previous
            elif handed_over(mine, self.request):
                self.handoff = ""
        return mine

    def rename(self, owner: str) -> None:
        """Wait on as a new acquisition: the lease this one got (handed over by a
        release, or taken by an attempt whose answer came too late) ended before it
        could count on it, which ends that acquisition for good (a late duplicate of its
        attempts must change nothing), but not the caller's wait. The new one has no
        place in line yet: it tries at once, and joins the line at its end."""
        old, self.request = self.request.owner, replace(self.request, owner=owner)
        self.handoff = None
        self._at_once = True
        # The last answer named the old owner id as a holder: not somebody to blame.
        info = self.info
        self.info = replace(
            info,
            owner="" if info.owner == old else info.owner,
            holders=tuple(holder for holder in info.holders if holder.owner != old),
        )

    def handed(self, handoff: Handoff | None) -> LockInfo | None:
        """The lease a release handed to this request, if ``handoff`` is one for it that
        came after the last attempt (noted in ``self.handoff`` for observers).

        The token tells the order without clocks: a handoff applied before the last
        attempt was seen by it (tokens only grow), so a greater token is a newer lease.
        The lease is bounded from that attempt, which renewed the place the release took
        (``sent_at`` locally, ``info.now`` on the server, both before the release): the
        server time from there to the handoff is counted, less 1 % for a slow local
        clock, plus the lease the release gave. Its ``ttl`` is that first lease (at most
        ``HANDOFF_LEASE_MS``), for the refresher to extend soon.
        """
        request, info = self.request, self.info
        if handoff is None or request.shared or handoff.owner != request.owner:
            return None
        if handoff.token <= info.token or handoff.acquired_at < info.now:
            return None
        first = min(round(request.ttl * 1000), HANDOFF_LEASE_MS) / 1000
        expires_at = handoff.expires_at or handoff.acquired_at + timedelta(seconds=first)
        waited = handoff.acquired_at - info.now
        self.handoff = handoff.previous
        return replace(
            info,
            owner=request.owner,
            token=handoff.token,
            acquired_at=handoff.acquired_at,
            refreshed_at=handoff.acquired_at,
            expires_at=expires_at,
            ttl=first,
            now=info.now + waited / 100,
            position=-1,
            mode="exclusive",
            limit=None,
            group=None,
            kind=None,
            holders=(),
        )

    def busy(self, now: float) -> LockNotAcquired:
        """The error of a wait that timed out: who holds the key, how long it waited."""
        return busy(self.info, waited=now - self._started)


def next_delay(
    info: LockInfo,
    stream_since: float | None,
    sent_at: float,
    attempt: int,
    *,
    shared: bool,
) -> tuple[float, int]:
    """How long to sleep before the next attempt, and the next back-off step (for a
    ``shared`` request, readers behind a lease that runs out enter together)."""
    lease_end = max(info.next_free_in, 0.0) + 0.001
    streamed = stream_since is not None and stream_since <= sent_at
    # A lease that has ended (its holder crashed) ends no later: no release will come,
    # and trying again at once only spins while a waiter ahead keeps its place.
    running = info.held and info.next_free_in > 0
    if running and streamed:
        # The stream was open before the last attempt: a release that frees the key, or
        # hands it to us or to the waiter just ahead, wakes us. A handoff to a waiter
        # further ahead does not: an exclusive waiter looks again by the line check,
        # which its place lasts past by the grace period whatever the lease (see
        # ``queries.acquire``); a shared one at the lease end too, whose end wakes nobody.
        if info.position > 0:
            return (min(lease_end, LINE_CHECK) if shared else LINE_CHECK), attempt
        return lease_end, attempt
    if streamed and info.position > 0:
        # Free, with others ahead in line: their releases wake us; the timer only keeps
        # our place in line (it lapses PLACE_GRACE after our last attempt).
        return BEHIND_IN_LINE, attempt
    # No stream to wake us, or the lock is free with others ahead in line.
    delay = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt) * random.uniform(0.5, 1.0)
    if running:
        delay = min(delay, lease_end)
    return delay, min(attempt + 1, 16)


def first_lease(mine: LockInfo, request: Request) -> LockInfo:
    """``mine``, with the lease it was given as its ttl when that is shorter than asked.

    A release hands a waiter a first lease of at most ``HANDOFF_LEASE_MS`` (the document
    keeps the ttl asked for, which the refresher then extends it by). The waiter may
    learn of it from the change stream, or from an attempt of its own that finds the
    lock already its own: either way, its handle counts with the short lease until the
    first refresh, so that the refresher ticks in time.
    """
    if request.shared:
        return mine
    span = (mine.expires_at - mine.acquired_at).total_seconds()
    return replace(mine, ttl=span) if 0 < span < mine.ttl - 0.002 else mine


def handed_over(mine: LockInfo, request: Request) -> bool:
    """Whether a release handed ``mine`` to this request before its attempt found it.

    A release writes the waiter's first lease shorter than the ttl it asked for (at
    most ``HANDOFF_LEASE_MS``); an attempt that takes the key itself writes the whole
    ttl, and so does the same attempt sent again after a lost reply. A lease asked for
    no longer than that first lease does not tell.
    """
    return first_lease(mine, request).ttl < mine.ttl


def must_extend(
    sent_at: float, first: LockInfo, request: Request, now: float, *, keep: bool = True
) -> bool:
    """Whether a lease just got must be extended to the ttl asked for before it is
    returned; ``first`` is its ``first_lease``.

    An answer learnt late (see ``late``); a lease with less than half of it left (a
    first lease a release handed over, found by an attempt some time after): the
    refresher's first tick, within a third of that lease, might come after its end; or
    a first lease shorter than asked for when no refresher will extend it (``keep``
    False). A lease just taken has all of it left: no extra round trip. While waiting,
    a lease that turns out over by then does not end the wait (``WaitPlan.rename``).
    """
    if not keep and first.ttl < request.ttl:
        return True
    remaining = first.remaining  # one subtraction of datetimes, read once
    return remaining < first.ttl / 2 or late(sent_at, remaining, first.ttl, now)


def late(sent_at: float, remaining: float, ttl: float, now: float) -> bool:
    """Whether the answer was held up so long that less than half the lease is left by the
    holder's bound (sent + lease - margin).

    The answer came so late (server selection during an outage) that the lease, bounded
    from when the request was sent, has nearly ended by the holder's clock: the loops
    then bound it again from a refresh sent on the connection now ready. A round trip
    within the minimum margin is a normal answer, even for a lease of milliseconds that
    it mostly uses up: a refresh would take as long, and an uncontended acquire is one
    round trip. ``remaining`` and ``ttl`` are the lease's, as answered.
    """
    if now - sent_at <= clock.MIN_MARGIN:
        return False  # a normal round trip
    return sent_at + remaining - clock.margin(ttl) - now < ttl / 2


def busy(info: LockInfo, waited: float | None = None) -> LockNotAcquired:
    """The error for a key that is not ours: naming its holder (or the line) when known."""
    if info.owner:
        return LockNotAcquired(info.key, info.owner, info.expires_at, waited=waited)
    if info.held:
        first_end = min(holder.expires_at for holder in info.live_holders)
        return LockNotAcquired(info.key, info.holder_label, first_end, waited=waited)
    return LockNotAcquired(info.key, None, None, waited=waited, waiting=info.waiting)
