"""What this process knows of one held lease, without I/O: its deadline, and its loss.

A ``Lock`` is a ``LeaseState`` plus the writes that refresh and release it. The state is
shared by the holder's thread, the refresher and the deadline watch: each change is
made under the lease's own mutex, and a loss is announced once, whoever finds it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django_mongolock import clock, events
from django_mongolock.deadlines import get_deadlines
from django_mongolock.exceptions import LockLost
from django_mongolock.info import LockInfo
from django_mongolock.notices import get_notices
from django_mongolock.reasons import LAPSED
from django_mongolock.signals import calls, lock_lost, send_safely

__all__ = ["LAPSED", "LeaseState"]

logger = logging.getLogger("django_mongolock.lock")


class LeaseState:
    """A held lease as this process sees it: who holds what, until when, and whether lost.

    ``sender`` sends the lease's ``lock_lost`` signal (the manager that gave it out).
    ``key``, ``owner``, ``token``, ``shared`` and ``refreshable`` never change once set
    here: the refresher lists them once and sends that list while its leases stay the same.
    """

    __slots__ = (
        "__weakref__",
        "_deadline",
        "_expiry",
        "_expiry_deadline",
        "_holds",
        "_hooks",
        "_loss",
        "_lost",
        "_lost_event",
        "_mutex",
        "_pid",
        "_released",
        "_sender",
        "acquired_at",
        "contended",
        "key",
        "on_lost",
        "owner",
        "refreshable",
        "shared",
        "token",
        "ttl",
    )

    def __init__(
        self,
        sender: object,
        info: LockInfo,
        sent_at: float,
        *,
        on_lost: Callable[[Any], object] | None = None,
        refresh: bool = False,
    ) -> None:
        self._sender = sender
        self.shared: bool = info.shared
        self.key: str = info.key
        self.owner: str = info.owner
        self.token: int = info.token
        self.acquired_at: datetime = info.acquired_at
        # Others were in line when it was taken: they likely still are at its release,
        # which then goes straight to the write that hands the lock on.
        self.contended: bool = info.waiting > 0
        self.ttl: float = info.ttl
        # The event costs a kilobyte: it is built only when somebody asks for ``lost``.
        self._lost = False
        self._lost_event: threading.Event | None = None
        self.on_lost = on_lost
        self.refreshable = refresh
        self._deadline = sent_at + info.remaining - clock.margin(info.ttl)
        # The server's lease end as last reported, and the local deadline it matched:
        # a refresher tick moves only the deadline, and expires_at follows it.
        self._expiry = info.expires_at
        self._expiry_deadline = self._deadline
        self._released = False
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        # Why it was lost (for check()), the hooks to call the moment it is, and how many
        # reentrant acquisitions hold it (see LockManager.acquire(reentrant=True)).
        self._loss: str | None = None
        self._hooks: list[Callable[[], object]] | None = None
        self._holds = 1
        get_deadlines().watch(self)

    @property
    def valid(self) -> bool:
        """Held: not released, not lost, and the lease has not run out.

        Always False in a process forked from the holder: the lock is its parent's.
        """
        if self._released or self._lost or self._pid != os.getpid():
            return False
        now = clock.now()
        if now >= self._deadline:
            if self.lapse(now):
                self.announce_lapse()
            return False
        return True

    def check(self) -> None:
        """Raise LockLost (with the reason) unless the lock is still valid; None otherwise.

        One local check, no I/O: cheap enough to call between any two steps of the work.
        """
        if self._pid != os.getpid():
            reason = f"it belongs to process {self._pid}, not to this forked child"
        elif self._lost:
            reason = self._loss or "it was lost"
        elif self._released:
            reason = "it was released"
        else:
            now = clock.now()
            if now < self._deadline:
                return
            if self.lapse(now):
                self.announce_lapse()
            reason = self._loss or LAPSED
        raise LockLost(self.key, self.owner, self.token, reason)

    @property
    def holds(self) -> int:
        """Acquisitions holding this handle: above 1 only for a re-entered reentrant lock."""
        return 0 if self._released else self._holds

    def add_loss_hook(self, hook: Callable[[], object]) -> bool:
        """Call ``hook()`` the moment the lock is lost, in the thread that finds out.

        For the engine's own reactions (cancelling a task, interrupting a command): the
        hook runs right after ``lost`` is set, before the notices, on the deadline watch,
        the refresher or the holder's thread, so it must be quick and must not block.
        Returns False, and keeps nothing, when the lock is already lost or released.
        """
        if self._pid != os.getpid():
            return False
        with self._mutex:
            if self._lost or self._released:
                return False
            if self._hooks is None:
                self._hooks = []
            self._hooks.append(hook)
        return True

    def remove_loss_hook(self, hook: Callable[[], object]) -> None:
        """Forget a hook given to ``add_loss_hook`` (nothing if it is not there)."""
        if self._pid != os.getpid():
            return
        with self._mutex:
            if self._hooks is not None and hook in self._hooks:
                self._hooks.remove(hook)

    @property
    def lost(self) -> threading.Event:
        """Set once the lock is lost: check it (``is_set()``) or wait on it (``wait(t)``)."""
        event = self._lost_event
        if event is None:
            if self._pid != os.getpid():
                # A forked child: the parent's lock was never this process's. No mutex here,
                # it may have been held by a thread of the parent at the fork.
                event = threading.Event()
                event.set()
                return event
            with self._mutex:
                if self._lost_event is None:
                    self._lost_event = threading.Event()
                    if self._lost:
                        self._lost_event.set()
                event = self._lost_event
        return event

    @property
    def expires_at(self) -> datetime:
        """The lease end in server time (as of the last refresh)."""
        moved = self._deadline - self._expiry_deadline
        return self._expiry + timedelta(seconds=moved) if moved else self._expiry

    @property
    def released(self) -> bool:
        return self._released

    @property
    def remaining(self) -> float:
        """Seconds left of the lease by this process's clock (0 once it has ended)."""
        return max(0.0, self._deadline - clock.now())

    @property
    def deadline(self) -> float:
        """The lease end on ``clock.now()``'s scale, margin included (before the server's)."""
        return self._deadline

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the holder's: the lock is its parent's, and
        nothing done with it here reaches the server."""
        return self._pid != os.getpid()

    @property
    def over(self) -> bool:
        """Released or lost: the deadline watch and the refresher can forget it."""
        return self._released or self._lost

    def lapse(self, now: float) -> bool:
        """Mark the lock lost if ``now`` is past its deadline: the flag, the event and the
        loss hooks, never user code. True when this call marked it; its notices then go
        out through ``announce_lapse()``, which the deadline watch calls once it has
        marked every lease due at that moment, so that the last of ten thousand is not
        marked late behind the others' notices."""
        with self._mutex:
            if self._lost or self._released or now < self._deadline:
                return False
            self._lost = True
            self._loss = LAPSED
            event = self._lost_event
            hooks, self._hooks = self._hooks, None
        if event is not None:
            event.set()
        self._run_hooks(hooks)
        return True

    def announce_lapse(self) -> None:
        """The notices of a lapse that ``lapse()`` marked (on workers, never here)."""
        self._post_notices(LAPSED)

    def _run_hooks(self, hooks: list[Callable[[], object]] | None) -> None:
        for hook in hooks or ():
            try:
                hook()
            except Exception:
                logger.exception("a loss hook of lock %r failed", self.key)

    def add_hold(self) -> bool:
        """One more reentrant acquisition of this handle; False if it is no longer valid."""
        with self._mutex:
            if self._lost or self._released or self._pid != os.getpid():
                return False
            self._holds += 1
            return True

    def _drop_hold(self) -> bool:
        """Count down an inner release of a re-entered lock; False for the outermost one."""
        if self._holds == 1 or self._pid != os.getpid():
            return False
        with self._mutex:
            if self._holds == 1 or self._released:
                return False
            self._holds -= 1
            return True

    def lengthen(self, ttl: float) -> None:
        """Count with ``ttl`` from the next refresh on: the lease stored for this lock is
        that long, while its first lease (handed over by a release) was shorter.

        The deadline stays where the first lease put it; the refresher, which was
        given the lock with its first lease, ticks within a third of it and extends it
        by the stored ttl.
        """
        with self._mutex:
            self.ttl = max(self.ttl, ttl)

    def renewed(self, sent_at: float, ends: dict[float, float] | None = None) -> bool:
        """Extend by the lease after a bulk refresh sent at ``sent_at``; False if lost meanwhile.

        The lease is read here, not when the refresh was sent: a ``refresh(ttl=shorter)``
        that reached the server first has already shortened it (``_shorten``). ``ends``,
        shared by the leases of one refresh, keeps each lease length's new deadline.
        """
        with self._mutex:
            if self._lost:
                return False
            ttl = self.ttl
            deadline = None if ends is None else ends.get(ttl)
            if deadline is None:
                deadline = sent_at + ttl - clock.margin(ttl)
                if ends is not None:
                    ends[ttl] = deadline
            earlier = deadline < self._deadline
            self._deadline = deadline
        if earlier:
            get_deadlines().watch(self)
        return True

    def _check_refreshable(self) -> None:
        if self._released:
            raise LockLost(self.key, self.owner, self.token, "it was released")
        if self._lost:
            raise LockLost(self.key, self.owner, self.token, "it was lost before")
        if self._pid != os.getpid():
            raise LockLost(self.key, self.owner, self.token, f"it belongs to process {self._pid}")

    def take_release(self) -> bool:
        """Mark released once, in the holder's process only; False if that was done already."""
        if self._pid != os.getpid():
            return False  # before the mutex: a fork may have copied it locked
        with self._mutex:
            if self._released:
                return False
            self._released = True
        get_deadlines().ended()
        return True

    def _extend(self, info: LockInfo, sent_at: float) -> bool:
        """Take the lease a refresh reported; False if the lock was lost meanwhile."""
        deadline = sent_at + info.remaining - clock.margin(info.ttl)
        with self._mutex:
            if self._lost:
                return False
            earlier = deadline < self._deadline
            self.ttl = info.ttl
            self._deadline = self._expiry_deadline = deadline
            self._expiry = info.expires_at
        if earlier:
            get_deadlines().watch(self)  # its entry sits at the later deadline
        return True

    def _shorten(self, ttl: float, sent_at: float) -> None:
        """Before a refresh to a shorter ``ttl`` is sent: count with the shorter lease now.

        The server may apply the request and its answer never arrive (a timeout, a lost
        reply, a cancelled ``arefresh``): the lease it keeps is then the shorter one, and
        so must be the deadline. A longer lease counts only once the server confirmed it.
        """
        deadline = sent_at + ttl - clock.margin(ttl)
        with self._mutex:
            if ttl >= self.ttl and deadline >= self._deadline:
                return
            self.ttl = min(self.ttl, ttl)
            if deadline >= self._deadline:
                return
            self._deadline = deadline
        get_deadlines().watch(self)

    def mark_lost(self, reason: str, *, inline: bool = True) -> bool:
        """Set ``lost``, then tell everybody (signal, ``on_lost``) once; False if lost before.

        The event comes first so that protected code waiting on it learns at once, not
        after the receivers have run. ``inline`` runs the notices in the caller's thread
        (the holder's own ``refresh()`` or ``release()``); the engine's threads post them.
        """
        if self._pid != os.getpid():
            return False
        with self._mutex:
            if self._lost:
                return False
            self._lost = True
            self._loss = reason
            event = self._lost_event
            hooks, self._hooks = self._hooks, None
        if event is not None:
            event.set()
        self._run_hooks(hooks)
        if inline:
            self._notify(reason)
        else:
            self._post_notices(reason)
        return True

    def _post_notices(self, reason: str) -> None:
        """Post the notices, each apart: ``on_lost`` first (it demotes an election), then
        one per ``lock_lost`` receiver, so that none waits behind another that blocks."""
        events.lost(self._sender, self, reason, self._deadline)
        receivers = calls(lock_lost, self._sender, lock=self, reason=reason)
        get_notices().post_all(receivers, urgent=[self._call_on_lost])
        get_deadlines().kick()

    def _notify(self, reason: str) -> None:
        """Log, call ``on_lost`` and send ``lock_lost`` here: a failing one stops none."""
        events.lost(self._sender, self, reason, self._deadline)
        self._call_on_lost()
        send_safely(lock_lost, self._sender, lock=self, reason=reason)

    def _call_on_lost(self) -> None:
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except (Exception, SystemExit):
                logger.exception("on_lost callback of lock %r failed", self.key)
