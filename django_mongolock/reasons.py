"""Why a lease that ended was not extended: what the refresher lanes tell.

A loss at the holder's deadline is "expired" when nobody refreshed the lease in time (a
lock taken with ``refresh=False``, a stalled process); "server-unreachable" when the
refresher tried: its manager's last refresh could not reach the server, or a refresh of
that very lease, sent before its end, still waits for an answer (the deadline watch fires
before the write's own timeout is reported); and "refresh-failed" when the server answered
the manager's last refresh with an error (a permission revoked), or refused that lease's
own write while the others went through (a validator that rejects its document). Kept
weakly per manager (and per lease), so that a closed manager's state cannot pass to a new
one, and forgotten in a forked child, whose parent's lanes do not run there.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CLOSED",
    "LAPSED",
    "accepted",
    "answered",
    "lease_refused",
    "refused",
    "refused_leases",
    "sent",
    "unanswered",
]

# The ``LockLost`` sentences the engine gives two losses; ``events`` sorts losses by them.
LAPSED = "its lease ended before it could be refreshed"
"""The holder's own deadline passed before a refresh extended the lease."""
CLOSED = "its LockManager was closed"
"""The manager that kept the lease alive was closed while the lock was held."""


class _Sent:
    """A refresh write waiting for its answer: when it was sent, and its leases (their ids
    made into a set on the first loss that asks, so that ten thousand losses at once cost
    one lookup each; the list keeps the leases, and so their ids, alive)."""

    __slots__ = ("_ids", "leases", "sent_at")

    def __init__(self, sent_at: float, leases: Sequence[object]) -> None:
        self.sent_at = sent_at
        self.leases = leases
        self._ids: frozenset[int] | None = None

    def holds(self, lease: object) -> bool:
        if self._ids is None:
            self._ids = frozenset(map(id, self.leases))
        return id(lease) in self._ids


# Managers whose last refresh could not reach the server, those whose last refresh the
# server refused, and each one's refresh write that waits for its answer (one lane per
# manager: one write at a time).
_failing: weakref.WeakSet[Any] = weakref.WeakSet()
_refused: weakref.WeakSet[Any] = weakref.WeakSet()
_refreshing: weakref.WeakKeyDictionary[Any, _Sent] = weakref.WeakKeyDictionary()
# Leases whose own refresh write the server refused while the manager's others went
# through: marked on the lease, since the manager's next ticks succeed.
_refused_leases: weakref.WeakSet[Any] = weakref.WeakSet()


def sent(source: object, sent_at: float, leases: Sequence[object]) -> None:
    """A lane sent its refresh write for ``leases`` at ``sent_at`` (until ``answered``)."""
    _refreshing[source] = _Sent(sent_at, leases)


def answered(source: object, ok: bool, *, refused: bool = False) -> None:
    """The lane's refresh write returned (``ok``), the server refused it (``refused``), or
    it could not reach the server (neither)."""
    if ok or refused:
        _failing.discard(source)
    else:
        _failing.add(source)
    if refused and not ok:
        _refused.add(source)
    else:
        _refused.discard(source)
    _refreshing.pop(source, None)


def refused_leases(leases: Sequence[object]) -> None:
    """The server refused these leases' refresh writes (and not their manager's others)."""
    _refused_leases.update(leases)


def accepted(leases: Sequence[object], refused: Sequence[object] = ()) -> None:
    """The server took these leases' refresh writes, but for ``refused``: a lease refused
    once and extended since loses that mark (free while no lease is marked)."""
    if not _refused_leases:
        return
    still = set(map(id, refused))
    for lease in leases:
        if id(lease) not in still:
            _refused_leases.discard(lease)


def lease_refused(lease: object) -> bool:
    """Whether the server refused a refresh write of ``lease`` itself."""
    try:
        return lease in _refused_leases
    except TypeError:  # not weakly referenceable: never refreshed by a lane
        return False


def refused(source: object) -> bool:
    """Whether the server answered ``source``'s last refresh write with an error."""
    try:
        return source in _refused
    except TypeError:  # not weakly referenceable: no refresher lane sends for it
        return False


def unanswered(source: object, lease: object, deadline: float) -> bool:
    """Whether ``lease``, ending at ``deadline``, ended for want of a server's answer."""
    try:
        if source in _failing:
            return True
        pending = _refreshing.get(source)
    except TypeError:  # not weakly referenceable: no refresher lane sends for it
        return False
    return pending is not None and pending.sent_at < deadline and pending.holds(lease)


def _forget_in_child() -> None:
    _failing.clear()
    _refused.clear()
    _refreshing.clear()
    _refused_leases.clear()


os.register_at_fork(after_in_child=_forget_in_child)
