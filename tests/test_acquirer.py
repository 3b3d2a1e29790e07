"""The wait plan of a blocked acquirer, step by step: no server, no clock, no sleeping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django_mongolock.acquirer import (
    BEHIND_IN_LINE,
    LINE_CHECK,
    Request,
    WaitPlan,
    first_lease,
    handed_over,
    late,
    must_extend,
)
from django_mongolock.info import LockInfo
from django_mongolock.waiters import Handoff


def _info(
    *,
    remaining: float,
    position: int = 0,
    owner: str = "holder",
    ttl: float = 30.0,
    age: float = 1.0,
) -> LockInfo:
    """A lock as an answer shows it: taken ``age`` seconds ago, ``remaining`` left."""
    now = datetime.now(UTC)
    return LockInfo(
        key="k",
        owner=owner,
        token=7,
        acquired_at=now - timedelta(seconds=age),
        refreshed_at=now - timedelta(seconds=age),
        expires_at=now + timedelta(seconds=remaining),
        ttl=ttl,
        now=now,
        position=position,
    )


OWNER = "me:1:000000000001"


def _request(*, shared: bool = False, ttl: float = 30.0) -> Request:
    return Request("k", OWNER, ttl, shared=shared)


def test_a_streamed_waiter_sleeps_until_the_lease_ends_but_never_past_its_timeout() -> None:
    plan = WaitPlan(_request(), 2.0, 100.0, _info(remaining=20.0))
    # The stream was healthy before the attempt: a release wakes the waiter, so the timer
    # is the holder's lease end, cut to the caller's timeout.
    assert plan.wake_at(stream_since=99.0, now=100.5) == 102.0
    # The wait counts from the acquire's first request, not the one that joined the line.
    later = WaitPlan(_request(), 2.0, 100.5, _info(remaining=20.0), started=100.0)
    assert later.wake_at(stream_since=99.0, now=100.5) == 102.0
    assert later.wake_at(stream_since=99.0, now=102.0) is None
    unlimited = WaitPlan(_request(), None, 100.0, _info(remaining=20.0))
    wake_at = unlimited.wake_at(stream_since=99.0, now=100.5)
    assert wake_at is not None
    assert 119.0 <= wake_at <= 120.6


def test_a_waiter_behind_the_head_looks_again_by_the_line_check() -> None:
    """A handoff to a waiter further ahead wakes nobody behind it, whose places last
    ``LINE_CHECK`` beyond the grace period: they look again by then, whatever the lease
    (a line that turns over within it renews no place). The head sleeps until the lease
    end: the handoff wakes it."""
    for remaining in (20.0, 1.0):
        behind = WaitPlan(_request(), None, 100.0, _info(remaining=remaining, position=1))
        wake_at = behind.wake_at(stream_since=99.0, now=100.0)
        assert wake_at is not None
        assert abs(wake_at - (100.0 + LINE_CHECK)) < 1e-9
    # The head, and a shared waiter anywhere in line (readers behind a lease that runs
    # out enter together), look again at the lease end when it comes first.
    for request, position in ((_request(), 0), (_request(shared=True), 3)):
        soon = WaitPlan(request, None, 100.0, _info(remaining=1.0, position=position))
        wake_at = soon.wake_at(stream_since=99.0, now=100.0)
        assert wake_at is not None
        assert 100.9 <= wake_at <= 101.1
    # A shared waiter behind others, behind a long lease: by the line check.
    later = WaitPlan(_request(shared=True), None, 100.0, _info(remaining=20.0, position=3))
    wake_at = later.wake_at(stream_since=99.0, now=100.0)
    assert wake_at is not None
    assert abs(wake_at - (100.0 + LINE_CHECK)) < 1e-9
    head = WaitPlan(_request(), None, 100.0, _info(remaining=20.0, position=0))
    wake_at = head.wake_at(stream_since=99.0, now=100.0)
    assert wake_at is not None
    assert wake_at > 100.0 + LINE_CHECK


def test_the_plan_gives_up_once_the_timeout_has_passed_naming_the_holder() -> None:
    plan = WaitPlan(_request(), 2.0, 100.0, _info(remaining=20.0))
    assert plan.wake_at(stream_since=None, now=102.0) is None
    error = plan.busy(now=102.5)
    assert error.holder == "holder"
    assert error.waited == 2.5


def test_a_waiter_behind_others_sleeps_through_the_releases_that_are_theirs() -> None:
    # Two waiters ahead and a live holder: the third release is this waiter's turn.
    plan = WaitPlan(_request(), None, 100.0, _info(remaining=20.0, position=2))
    assert not plan.woken(1)
    assert not plan.woken(2)
    assert plan.woken(3)
    # Shared waiters may get in together: each release is worth a try.
    shared = WaitPlan(_request(shared=True), None, 100.0, _info(remaining=20.0, position=2))
    assert shared.woken(1)
    # A release that is not ours keeps our place alive: look again within the grace period.
    assert WaitPlan.behind(500.0, now=100.0) == 100.0 + BEHIND_IN_LINE
    assert WaitPlan.behind(100.1, now=100.0) == 100.1


def test_an_answer_that_is_ours_ends_the_wait_and_counts_from_its_sending() -> None:
    request = _request()
    plan = WaitPlan(request, None, 100.0, _info(remaining=20.0, position=1))
    assert plan.answered(105.0, _info(remaining=20.0, position=1), seen=2) is None
    assert (plan.sent_at, plan.seen) == (105.0, 2)
    assert not plan.woken(2)  # releases are counted from the last attempt on
    mine = _info(remaining=30.0, owner=request.owner)
    assert plan.answered(106.0, mine, seen=3) is mine


def test_a_lease_answered_late_is_bounded_again() -> None:
    mine = _info(remaining=30.0)
    assert not late(100.0, mine.remaining, mine.ttl, now=100.5)
    assert late(100.0, mine.remaining, mine.ttl, now=120.0)
    # A lease of moments answered after a held-up request is bounded again too.
    moment = _info(remaining=0.5, ttl=0.5)
    assert late(100.0, moment.remaining, moment.ttl, now=100.3)


def test_a_short_lease_answered_at_once_is_not_refreshed() -> None:
    """A round trip of a few milliseconds uses up most of a lease of a few milliseconds:
    a refresh would take as long, and an uncontended acquire is one round trip."""
    tiny, short = _info(remaining=0.004, ttl=0.004), _info(remaining=0.1, ttl=0.1)
    assert not late(100.0, tiny.remaining, tiny.ttl, now=100.003)
    assert not late(100.0, short.remaining, short.ttl, now=100.06)


def test_a_lease_got_with_too_little_left_is_extended_before_it_is_returned() -> None:
    """Learnt late, or handed over with less than half its first lease left by the time
    an attempt of the waiter's own found it, or handed over with no refresher to come."""
    request = _request()

    def extend(lease: LockInfo, now: float = 100.01, keep: bool = True) -> bool:
        return must_extend(100.0, first_lease(lease, request), request, now, keep=keep)

    # Handed 0.5 s ago with a 2 s first lease, answered at once: the refresher extends it.
    fresh = _info(remaining=1.5, owner=OWNER, age=0.5)
    assert not extend(fresh)
    assert extend(fresh, keep=False)  # no refresher will
    # Handed 1.6 s ago: 0.4 s of it left, the refresher might tick too late.
    assert extend(_info(remaining=0.4, owner=OWNER, age=1.6))
    # Taken by the attempt itself: kept as it is, unless answered late.
    taken = _info(remaining=29.0, owner=OWNER)
    assert not extend(taken)
    assert not extend(taken, keep=False)
    assert extend(taken, now=120.0)
    # A ttl no longer than the first lease is the lease asked for, handed over or not.
    short = _request(ttl=2.0)
    lease = _info(remaining=1.5, owner=OWNER, ttl=2.0, age=0.5)
    assert not must_extend(100.0, first_lease(lease, short), short, 100.01, keep=False)
    # ... but found with less than half of it left, it is extended all the same.
    nearly = _info(remaining=0.4, owner=OWNER, ttl=2.0, age=1.6)
    assert must_extend(100.0, first_lease(nearly, short), short, 100.01)


def test_a_renamed_wait_tries_again_at_once_but_never_past_its_timeout() -> None:
    plan = WaitPlan(_request(), 5.0, 100.0, _info(remaining=20.0))
    assert plan.wake_at(stream_since=99.0, now=100.5) == 105.0  # the holder's lease, cut
    # The last answer said the key was this acquisition's (a lease it could not keep).
    plan.answered(100.6, _info(remaining=0.1, owner=OWNER), seen=0)
    plan.rename("me:1:000000000002")
    assert plan.wake_at(stream_since=99.0, now=100.5) == 100.5  # no place in line to keep
    assert plan.wake_at(stream_since=99.0, now=105.0) is None
    # Giving up then names no holder: the old owner id was the waiter's own.
    assert plan.busy(now=105.0).holder is None
    # Once that attempt is answered, the schedule is the usual one again.
    assert plan.answered(101.0, _info(remaining=20.0, position=0), seen=0) is None
    assert plan.wake_at(stream_since=99.0, now=101.5) == 105.0


def test_an_attempt_tells_a_handed_lease_by_its_short_first_lease() -> None:
    """A release writes a first lease shorter than the ttl asked for; an attempt that
    takes the key (or the same attempt sent again) writes the whole ttl."""
    # Taken a second ago with a lease of two seconds, of the 30 asked for: handed over.
    assert handed_over(_info(remaining=1.0, owner=OWNER), _request())
    # Taken a second ago with the whole 30 seconds: taken by the attempt itself.
    assert not handed_over(_info(remaining=29.0, owner=OWNER), _request())
    # Refreshed since (a lease longer than the ttl from its acquisition): not told.
    assert not handed_over(_info(remaining=30.0, owner=OWNER), _request())
    # A ttl no longer than the first lease: an attempt cannot tell, and does not say.
    assert not handed_over(_info(remaining=1.0, owner=OWNER, ttl=2.0), _request(ttl=2.0))
    # Shared leases are never handed over.
    assert not handed_over(_info(remaining=1.0, owner=OWNER), _request(shared=True))


def test_the_plan_notes_a_handoff_however_the_waiter_learnt_of_it() -> None:
    request = _request()
    plan = WaitPlan(request, None, 100.0, _info(remaining=20.0, position=0))
    handed = _info(remaining=1.0, owner=OWNER)
    # Found by an attempt, with a wake-up for an older lease meanwhile: nobody named.
    older = Handoff(OWNER, handed.token - 1, handed.acquired_at, None, previous="them")
    assert plan.answered(101.0, handed, seen=1, told=older) is handed
    assert plan.handoff == ""
    # With the wake-up for this very lease: it names the releasing holder.
    plan = WaitPlan(request, None, 100.0, _info(remaining=20.0, position=0))
    told = Handoff(OWNER, handed.token, handed.acquired_at, None, previous="them")
    assert plan.answered(101.0, handed, seen=1, told=told) is handed
    assert plan.handoff == "them"
    # Taken by the attempt itself: no handoff.
    plan = WaitPlan(request, None, 100.0, _info(remaining=20.0, position=0))
    assert plan.answered(101.0, _info(remaining=29.0, owner=OWNER), seen=1, told=older)
    assert plan.handoff is None
    # A ttl no longer than the first lease: only the wake-up for this lease tells it.
    short = _request(ttl=2.0)
    lease = _info(remaining=1.0, owner=OWNER, ttl=2.0)
    plan = WaitPlan(short, None, 100.0, _info(remaining=20.0, position=0))
    assert plan.answered(101.0, lease, seen=1, told=older) is lease
    assert plan.handoff is None
    plan = WaitPlan(short, None, 100.0, _info(remaining=20.0, position=0))
    assert plan.answered(101.0, lease, seen=1, told=told) is lease
    assert plan.handoff == "them"
    # Told by the wake-up; a handed lease found over renames the request and forgets it.
    plan = WaitPlan(request, None, 100.0, _info(remaining=20.0, position=0))
    wake_up = Handoff(OWNER, 8, plan.info.now, None, previous="them")
    assert plan.handed(wake_up) is not None
    assert plan.handoff == "them"
    plan.rename("me:1:000000000002")
    assert plan.handoff is None
