"""``on_lost="exit"``: stop a call whose lock is lost while it runs.

The main thread is interrupted (as by Ctrl+C) the moment the loss is known; a management
command then exits with ``LOST_EXIT_CODE``, a plain function raises LockLost.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast

from django_mongolock.context import holding
from django_mongolock.decorating.held import release
from django_mongolock.decorating.kinds import Kind
from django_mongolock.exceptions import LockLost, MongoLockError
from django_mongolock.exitcodes import LOST_EXIT_CODE
from django_mongolock.lock import Lock
from django_mongolock.terminal import printable

if TYPE_CHECKING:
    from django.core.management.base import BaseCommand

__all__ = ["run_stopping"]

# The signal that interrupts the main thread: SIGINT, whose default handler Python always
# installs, so that a loss wakes the main thread from a sleep or a blocking read as Ctrl+C
# does. While the call runs, a handler of this module takes it, and passes on the others.
_INTERRUPT: Final = signal.SIGINT
# How long leaving the call waits for an interrupt already sent to arrive (it is
# delivered within microseconds): it must be taken here, not by the restored handler.
_IN_FLIGHT: Final = 1.0


class _Interrupted(BaseException):
    """Raised in the main thread when the call's lock is lost: not an Exception, so that
    the usual ``except Exception`` in the work does not swallow it. Carries the watch
    that raised it, so that a nested call passes on an interrupt meant for an outer one."""

    def __init__(self, stop: _StopOnLoss) -> None:
        super().__init__(stop.lock.key)
        self.stop = stop


class _StopOnLoss:
    """Interrupt the main thread when ``lock`` is lost while the call runs.

    The lock's loss hook (the deadline watch, the refresher) sends the main thread the
    interrupt the moment ``lost`` is set; this module's signal handler turns it into
    ``_Interrupted``. Outside the main thread (or when the loss is found by the call
    itself, as a failed ``refresh()``), nothing is interrupted: the loss is reported
    when the call returns.
    """

    def __init__(self, lock: Lock) -> None:
        self.lock = lock
        self.lost = False
        self.closing = False
        self._mutex = threading.Lock()
        self._active = False
        self._sent = False
        self._delivered = False
        self._main = threading.current_thread() is threading.main_thread()
        self._previous: Any = None

    def start(self) -> None:
        if self._main:
            self._previous = signal.getsignal(_INTERRUPT)
            signal.signal(_INTERRUPT, self._handle)
        self._active = True
        if not self.lock.add_loss_hook(self._on_loss):
            self.lost = True  # lost between the acquire and here

    def _on_loss(self) -> None:
        """The loss hook: runs in the thread that found the loss; must not block."""
        with self._mutex:
            if not self._active:
                return
            self.lost = True
            if not self._main or threading.current_thread() is threading.main_thread():
                return
            self._sent = True
            main = threading.main_thread().ident
            if main is not None and hasattr(signal, "pthread_kill"):
                signal.pthread_kill(main, _INTERRUPT)
            else:  # pragma: no cover - platforms without pthread_kill
                import _thread

                _thread.interrupt_main(_INTERRUPT)

    def _handle(self, signum: int, frame: Any) -> Any:
        if self._sent and not self._delivered:
            self._delivered = True
            if not self.closing:
                raise _Interrupted(self)
            return None
        previous = self._previous
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        raise KeyboardInterrupt

    def close(self) -> None:
        """Stop watching and put the previous handler back; never raises ``_Interrupted``."""
        self.closing = True
        with self._mutex:
            self._active = False
        self.lock.remove_loss_hook(self._on_loss)
        if not self._main:
            return
        ends = time.monotonic() + _IN_FLIGHT
        while self._sent and not self._delivered and time.monotonic() < ends:
            time.sleep(0.001)
        signal.signal(_INTERRUPT, self._previous)


def run_stopping(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lock: Lock,
    caller: str,
    kind: Kind,
    subject: Any,
) -> Any:
    """Run ``target`` holding ``lock``; stop it if the lock is lost (``on_lost="exit"``)."""
    stop = _StopOnLoss(lock)
    result: Any = None
    raised: LockLost | None = None
    try:
        try:
            with holding(lock):
                try:
                    stop.start()
                    if not stop.lost:  # a loss before the watch began: the work never starts
                        lock.check()  # and a lease that lapsed unnoticed (no I/O)
                        result = target(*args, **kwargs)
                finally:
                    stop.closing = True
        except _Interrupted as interrupt:
            if interrupt.stop is not stop:
                raise  # an outer call's lock was lost: it is that call's to stop
        except LockLost as error:
            if (error.key, error.token) != (lock.key, lock.token):
                raise
            raised = error  # the call found out itself: a failed refresh() or check()
        finally:
            stop.close()
    finally:
        if stop.lost or raised is not None:
            # Expected to be gone; released all the same in case the lease only lapsed here.
            with contextlib.suppress(MongoLockError):
                lock.release()
        else:
            release(lock, caller)
    if not stop.lost and raised is None:
        return result
    lost = raised or _loss_of(lock)
    if kind != "command":
        raise lost
    command = cast("BaseCommand", subject)
    name = type(command).__module__.rpartition(".")[2]
    from django.core.management.base import CommandError

    raise CommandError(
        f"{name}: stopped; lost the lock {lock.key!r} (owner {printable(lock.owner)}, "
        f"fencing token {lock.token}): {lost.reason}. Exit status {LOST_EXIT_CODE} means the "
        "lock was lost while the command ran: another run may hold it now.",
        returncode=LOST_EXIT_CODE,
    ) from lost


def _loss_of(lock: Lock) -> LockLost:
    try:
        lock.check()
    except LockLost as lost:
        return lost
    return LockLost(lock.key, lock.owner, lock.token, "it was lost")
