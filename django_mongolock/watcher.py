"""Wakes local waiters when their key is freed, through one change stream.

A key becomes free when its document is deleted (release, force release, the TTL
monitor), or when a release frees it but keeps it for the waiters in line. The watcher
thread tails those events on the lock collection and sets the wake-up events of that
key's waiters only; they re-check by trying to acquire. While the stream is healthy
waiters need not poll; when change streams are unavailable or the stream breaks,
waiters try again at once, then fall back to their jittered back-off, and the watcher
resumes the stream (from its resume token when it can). A release that handed the key
to a waiter in line (``queries.release``) names it in the event: that waiter takes the
lock from the event, without a request of its own. Such an event reaches only the
process of that waiter and of the next one in line (``queries.wakeups``), so the cost of
a handoff does not grow with the number of processes waiting for the key. The thread
starts with the first waiter and ends after a minute without any.

With a relay (``SHARED_STREAM``, see ``relay``) one process per host and user opens the
stream and leads; the others follow it over a local socket instead of opening their
own, and fall back to one of their own when no leader answers.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal

import pymongo
from pymongo.errors import OperationFailure, PyMongoError

from django_mongolock import clock, mongo, queries, relay
from django_mongolock.exceptions import MongoLockError
from django_mongolock.store import LockStore
from django_mongolock.waiters import Handoff, Waiters

__all__ = ["Watcher", "handoff_of"]

logger = logging.getLogger("django_mongolock.watcher")

# How long the server holds an empty getMore: bounds how fast the thread notices stop.
MAX_AWAIT = 0.5
# The same for a relay's leader, which takes followers in between two: one stream per
# host, so a shorter wait costs the server little, and a joining follower waits less.
LEAD_AWAIT = 0.1
# The thread ends after this long with nobody waiting; the next waiter starts it again.
IDLE_EXIT = 60.0
# A process that found a relay's name held but nobody answering streams on its own, and
# tries to lead or follow again this often.
RELAY_RETRY = 10.0
# How long a leader's check of the relay secret may take (``_secret_changed``).
SECRET_CHECK_TIMEOUT = 0.5
# How often, and how far apart, a process tries to lead or follow before streaming alone.
JOIN_TRIES = 3
JOIN_PAUSE = 0.05


def handoff_of(change: Mapping[str, Any]) -> Handoff | None:
    """The handoff a release event reports, if the release made a waiter the holder.

    Such a release changes ``owner`` (an id unique per acquisition), ``token`` (it
    grows) and ``acquired_at``; an update event without all three is only a wake-up. A
    ``replace`` event (the server logged the release as a whole document) carries the
    document itself: a handoff when it has an owner acquired in the release itself.
    """
    if change.get("operationType") == "replace":
        doc = change.get("fullDocument") or {}
        released_at, acquired_at = doc.get("released_at"), doc.get("acquired_at")
        if not isinstance(released_at, datetime) or not isinstance(acquired_at, datetime):
            return None
        if released_at < acquired_at:
            return None  # an acquisition logged whole, not a release
        fields: Mapping[str, Any] = doc
    else:
        fields = (change.get("updateDescription") or {}).get("updatedFields") or {}
    owner, token, acquired_at = fields.get("owner"), fields.get("token"), fields.get("acquired_at")
    if not isinstance(owner, str) or not owner or not isinstance(token, int):
        return None
    if not isinstance(acquired_at, datetime):
        return None
    expires_at = fields.get("expires_at")
    return Handoff(
        owner,
        token,
        acquired_at,
        expires_at if isinstance(expires_at, datetime) else None,
        _released_by(fields),
    )


def _released_by(fields: Mapping[str, Any]) -> str:
    """The owner a release put in front of ``ended``: the server reports the list whole
    or by its changed positions (every owner id is new, so position 0 always changes)."""
    ended = fields.get("ended")
    first = ended[0] if isinstance(ended, list) and ended else fields.get("ended.0")
    return first if isinstance(first, str) else ""


class _Progress:
    """What a watcher thread carries from one stream to the next."""

    __slots__ = ("failures", "idle_since", "resume_token")

    def __init__(self) -> None:
        self.resume_token: Any = None
        self.failures = 0
        self.idle_since = clock.now()


class Watcher:
    """One change stream on one lock collection, shared by all waiting threads of a process
    (or, with a relay, by all processes of a user on a host)."""

    def __init__(
        self,
        store_of: Callable[[], LockStore],
        waiters: Waiters,
        prefix_of: Callable[[], str | None] = lambda: None,
        relay_of: Callable[[], relay.Place | None] = lambda: None,
    ) -> None:
        self._store_of = store_of
        self.waiters = waiters
        # What this process's holder ids start with: only handoffs to them are streamed,
        # until a waiter with another kind of id comes (``ensure_running``).
        self._prefix_of = prefix_of
        self._relay_of = relay_of
        self._unfiltered = False
        # The relay's name is another user's, or cannot be bound: never lead or follow.
        self._alone = False
        # What went wrong last with the relay, logged once until it changes.
        self._trouble = ""
        self._reopen = threading.Event()
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy_since: float | None = None
        self.events = 0
        self.opened = 0
        # "leader", "follower" or "own" while the thread runs (None: not running).
        self.role: str | None = None
        self.leader: relay.Leader | None = None

    @property
    def healthy(self) -> bool:
        """True while events reach this process (its stream, or its leader's, is open):
        a delete after ``healthy_since`` will be seen."""
        return self._healthy_since is not None

    def healthy_since(self) -> float | None:
        """Monotonic time from which every delete event is delivered (None: not healthy)."""
        return self._healthy_since

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ensure_running(self, owner: str = "") -> None:
        """Start the thread if it is not running (cheap when it is).

        ``owner`` is the holder id of the waiter that needs the stream: one that does
        not start with this process's prefix (a manager whose ``new_owner()`` makes ids
        of its own) would never hear of a handoff to it, so the stream lets every
        handoff through from then on (and this process leaves any relay).
        """
        if owner and not self._unfiltered:
            prefix = self._prefix_of()
            if prefix is not None and not owner.startswith(prefix):
                self._unfiltered = True
                self._reopen.set()
                logger.info("waiter %r has a holder id of its own: streaming every handoff", owner)
        if self.running or self.pid != os.getpid():
            return
        with self._mutex:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mongolock-watcher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _relay_place(self) -> relay.Place | None:
        if self._unfiltered or self._alone or not relay.supported():
            return None
        return self._relay_of()

    def _relay_secret(self) -> bytes | None:
        """The relay secret (``relay_secret``), which leaders and followers prove they
        know, as the database holds it now (None: it cannot be read)."""
        try:
            return self._store_of().relay_secret()
        except (PyMongoError, MongoLockError) as exc:
            self._troubled("secret", f"no secret to lead or follow with: {exc}")
            return None

    def _troubled(self, kind: str, trouble: str = "") -> None:
        """Log what keeps this process off the relay when that ``kind`` of trouble first
        comes, not on each retry (every ``RELAY_RETRY`` seconds); ``""``: none now."""
        if kind and kind != self._trouble:
            logger.warning("relay: %s: this process streams on its own for now", trouble)
        elif not kind and self._trouble:
            logger.info("relay: this process leads or follows again")
        self._trouble = kind

    def _join(self, where: relay.Place, secret: bytes) -> relay.Follower | None:
        """Follow the leader at ``where`` (None: it did not answer, did not prove it knows
        the secret, or is another user's)."""
        prefix = self._prefix_of() or where.prefix
        try:
            # The store's codec: relayed events decode as its own stream's would.
            codec = self._store_of().collection.codec_options
            return relay.Follower.join(where, prefix, codec, secret)
        except relay.Foreign as exc:
            self._alone = True
            logger.warning("%s: this process streams on its own", exc)
        except relay.Unproven as exc:
            self._troubled("unproven", str(exc))
        except relay.Skewed as exc:
            self._troubled("clock", str(exc))
        except (PyMongoError, MongoLockError) as exc:
            logger.debug("relay: no client to follow with: %s", exc)
        return None

    def _run(self) -> None:
        progress = _Progress()
        leader: relay.Leader | None = None
        follower: relay.Follower | None = None
        try:
            while not self._stop.is_set():
                where = self._relay_place()
                if leader is not None and (where is None or leader.closed):
                    # This process now streams every handoff (no more relay), or the
                    # secret changed (it leads again, with the new one, if it can).
                    leader.close()
                    leader = None
                if leader is None and follower is None and where is not None:
                    # A leader that just died may hold its name a moment longer than
                    # its connections: a few quick tries before streaming alone.
                    secret = self._relay_secret()
                    for _ in range(JOIN_TRIES if secret is not None else 0):
                        joined = self._lead_or_follow(where, secret)
                        if isinstance(joined, relay.Leader):
                            leader = joined
                        else:
                            follower = joined
                        if joined is not None or self._relay_place() is None:
                            break
                        if self._stop.wait(JOIN_PAUSE):
                            return
                if follower is not None:
                    joined, follower = follower, None
                    if not self._follow(progress, joined):
                        return
                    continue
                outcome = self._stream(progress, where, leader)
                if outcome is False:
                    return
                if isinstance(outcome, relay.Leader):
                    leader = outcome  # its stream opens from where this one stopped
                else:
                    follower = outcome
        finally:
            if leader is not None:
                leader.close()  # the followers lead or follow anew
            if follower is not None:
                follower.close()
            with self._mutex:
                self._healthy_since = None
                self.role = None
                self.leader = None
            self.waiters.notify_all()

    def _secret_changed(self, leader: relay.Leader) -> bool:
        """Whether the secret ``leader`` proves itself with is no longer the database's
        (its document was deleted): then it stops leading, and leads again, or follows,
        with the new one. An unreadable secret changes nothing."""
        try:
            # No heartbeat goes out meanwhile: bounded, right after the beats then due.
            with pymongo.timeout(SECRET_CHECK_TIMEOUT):
                secret = self._store_of().relay_secret()
        except (PyMongoError, MongoLockError):
            return False
        if secret == leader.secret:
            return False
        logger.warning("relay: the relay secret changed: leading or following anew with it")
        leader.close()
        return True

    def _lead_or_follow(
        self, where: relay.Place, secret: bytes | None = None
    ) -> relay.Leader | relay.Follower | None:
        """Lead the relay at ``where`` if nobody holds its name, else follow its leader
        (None: nobody answered, or this process must stream alone).

        Either way with the secret the database holds now (``secret``: read for this
        round of tries), read first (one read by ``_id``): not one read before its
        document was deleted and made anew, and not while holding the name, where
        followers would wait for an answer meanwhile.
        """
        if secret is None:
            secret = self._relay_secret()
        if secret is None:
            return None
        try:
            listener = relay.bind(where)
        except OSError as exc:
            logger.warning("relay: cannot bind its socket, this process streams alone: %s", exc)
            return None
        joined = (
            relay.Leader(listener, where, secret)
            if listener is not None
            else self._join(where, secret)
        )
        if joined is not None:
            self._troubled("")
        return joined

    def _follow(self, progress: _Progress, follower: relay.Follower) -> bool:
        """Read the leader's events until it is lost (True) or nobody has waited for a
        while (False: the thread ends).

        The leader's events reach this process from when it took it in (a stream of this
        process's that it takes over from stopped a little before: ``_stream`` told its
        waiters to look again, as when any stream breaks).
        """
        self.role = "follower"
        if follower.healthy:
            self._healthy_since = clock.now()
        # A stream this process leads later starts afresh, not from where its own stream
        # stopped before it followed: its followers need nothing from before.
        progress.resume_token = None
        try:
            while not self._stop.is_set() and not self._unfiltered:
                for message in follower.read(MAX_AWAIT):
                    if message.get("t") == "h":
                        if not message.get("ok"):
                            if self._healthy_since is not None:
                                self._healthy_since = None
                                self.waiters.notify_all()
                        elif self._healthy_since is None:
                            self._healthy_since = clock.now()
                    elif message.get("t") == "e":
                        change = message.get("c")
                        if not isinstance(change, dict) or "documentKey" not in change:
                            raise relay.RelayLost(f"not an event: {message!r:.200}")
                        self._deliver(change, None)
                if len(self.waiters):
                    progress.idle_since = clock.now()
                elif clock.now() - progress.idle_since > IDLE_EXIT:
                    return False
        except relay.RelayLost as exc:
            logger.info("relay lost (%s): leading or following anew", exc)
        finally:
            follower.close()
            self._healthy_since = None
            self.waiters.notify_all()
        return True

    def _deliver(self, change: Mapping[str, Any], prefix: str | None) -> None:
        """Wake the waiters ``change`` concerns (with ``prefix``: if it concerns this
        process: a leader's stream carries the whole host's handoffs)."""
        self.events += 1
        if prefix is not None and not queries.reaches(change, prefix):
            return
        if self.waiters.notify(change["documentKey"]["_id"], handoff_of(change)):
            # Let the woken waiter take the interpreter lock now, before this thread
            # goes on to ask for the next event.
            time.sleep(0)

    def _stream(
        self, progress: _Progress, where: relay.Place | None, leader: relay.Leader | None
    ) -> relay.Follower | relay.Leader | Literal[False] | None:
        """Open a stream and read it until it fails or must reopen (None), a relay takes
        over (this process follows it, or leads it: a Follower or a Leader), or nobody
        has waited for a while (False).

        ``leader``: this process leads the relay at ``where`` and passes the events on;
        it keeps leading through a failed stream (its followers hear so, and wait).
        Without one, ``where`` is a relay whose name was held but nobody answered: this
        process tries to lead or follow it again every ``RELAY_RETRY`` seconds.
        """
        # Set when the stream is closed only to be opened again from where it stopped
        # (with another filter, or to lead): waiters miss nothing.
        reopened = widened = False
        handover: relay.Follower | relay.Leader | None = None
        retry_at = clock.now() + RELAY_RETRY
        own = self._prefix_of()
        self.role = "own" if leader is None else "leader"
        self.leader = leader
        try:
            store = self._store_of()
            self._reopen.clear()
            if leader is not None and self._unfiltered:
                return None  # a waiter with ids of its own came: no more relay
            if leader is not None and where is not None:
                pipeline = queries.wakeups(where.prefix)
            else:
                pipeline = queries.wakeups(None if self._unfiltered else own)
            with store.collection.watch(
                pipeline,
                max_await_time_ms=round((MAX_AWAIT if leader is None else LEAD_AWAIT) * 1000),
                resume_after=progress.resume_token,
            ) as stream:
                if self._healthy_since is None:
                    self._healthy_since = clock.now()
                if leader is not None:
                    leader.health(True)
                self.opened += 1
                if progress.failures:
                    logger.info("change stream resumed; waiters are woken by releases again")
                progress.failures = 0
                while not self._stop.is_set() and stream.alive:
                    if self._reopen.is_set() and progress.resume_token is not None:
                        # Every handoff from now on; one the old filter kept out since
                        # the waiter's last attempt is lost: its waiters look again.
                        reopened = widened = True
                        break
                    if leader is not None:
                        leader.admit()
                        leader.flush()
                        leader.beat()
                        if clock.now() >= retry_at:
                            retry_at = clock.now() + RELAY_RETRY
                            # No heartbeat meanwhile, so the beats due by its end go
                            # right after it (not all of them at once before it: they
                            # keep their phases, see ``relay.Leader.beat``).
                            if self._secret_changed(leader):
                                return None
                            leader.beat()
                    elif where is not None and clock.now() >= retry_at:
                        retry_at = clock.now() + RELAY_RETRY
                        where = self._relay_place()
                        handover = None if where is None else self._lead_or_follow(where)
                        if isinstance(handover, relay.Follower) and not handover.healthy:
                            handover.close()
                            handover = None
                        if isinstance(handover, relay.Leader):
                            # It leads, from where its own stream stopped: nothing lost.
                            reopened = True
                            break
                        if handover is not None:
                            break  # it follows (``_follow`` says what that costs)
                    change = stream.try_next()
                    progress.resume_token = stream.resume_token
                    if change is not None:
                        if leader is not None:
                            leader.pass_on(change)
                        self._deliver(change, own if leader is not None else None)
                        continue
                    if len(self.waiters) or (leader is not None and len(leader)):
                        progress.idle_since = clock.now()
                    elif clock.now() - progress.idle_since > IDLE_EXIT:
                        return False
        except (PyMongoError, MongoLockError) as exc:
            if isinstance(exc, OperationFailure) and exc.code in mongo.HISTORY_LOST:
                progress.resume_token = None  # the resume point is gone: start afresh
            progress.failures += 1
            if progress.failures == 1:
                logger.warning("change stream unavailable, waiters poll instead: %s", exc)
        except Exception:
            progress.failures += 1
            logger.exception("change stream failed")
        finally:
            if widened:
                self._healthy_since = None  # the next stream counts from its opening
                self.waiters.notify_all()
            if not reopened:
                self._healthy_since = None
                # Waiters sleeping on the stream must switch to their back-off now, and
                # so must the followers'.
                self.waiters.notify_all()
                if leader is not None:
                    leader.health(False)
        if handover is not None or reopened or self._stop.is_set():
            return handover
        pause = min(30.0, 0.5 * 2 ** min(progress.failures, 6)) * random.uniform(0.5, 1.0)
        end = clock.now() + pause
        # A leader keeps its followers through the pause: they hear it is alive.
        while (left := end - clock.now()) > 0 and not self._stop.wait(min(left, MAX_AWAIT)):
            if leader is not None:
                leader.admit()
                leader.flush()
                leader.beat()
        return None
