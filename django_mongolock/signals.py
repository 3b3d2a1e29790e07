"""Signals sent by the lock manager: ``sender`` is the LockManager, ``lock`` the Lock.

They are plain ``django.dispatch`` signals, which need no configured settings, so a
LockManager used outside Django sends them too (to no receivers).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync
from django.dispatch import Signal

__all__ = ["calls", "lock_acquired", "lock_lost", "lock_released", "send_safely"]

logger = logging.getLogger("django_mongolock.signals")

lock_acquired = Signal()
"""Sent after a lock was acquired."""

lock_released = Signal()
"""Sent after its holder released a lock (``held`` says whether its lease was still running)."""

lock_lost = Signal()
"""Sent once when a holder learns it lost its lock (lease ended or force-released)."""


def calls(signal: Signal, sender: object, **named: Any) -> list[Callable[[], None]]:
    """One call per receiver of ``signal``, each catching and logging its own failure.

    ``Signal.send_robust`` catches ``Exception`` only: a receiver raising ``SystemExit``
    would skip the receivers after it, and one that blocks holds back the rest. Run
    apart (``notices.py`` gives each its own turn), none can stop another. Falls back
    to one ``send_robust`` call should Django's receiver lookup change. A signal with
    no receiver at all, the usual case outside a project that connects one, costs no
    lookup (``Signal.send`` skips it alike).
    """
    try:
        if not signal.receivers:
            return []
        sync_receivers, async_receivers = signal._live_receivers(sender)
    except Exception:  # pragma: no cover - a Django without the lookup used here
        return [_guarded(lambda: signal.send_robust(sender, **named), signal)]
    found = [functools.partial(r, signal=signal, sender=sender, **named) for r in sync_receivers]
    found += [
        functools.partial(async_to_sync(r), signal=signal, sender=sender, **named)
        for r in async_receivers
    ]
    return [_guarded(call, call.func) for call in found]


def send_safely(signal: Signal, sender: object, **named: Any) -> None:
    """Call every receiver of ``signal`` in turn; one that fails or exits skips none."""
    for call in calls(signal, sender, **named):
        call()


def _guarded(call: Callable[[], object], receiver: object) -> Callable[[], None]:
    def guarded() -> None:
        try:
            call()
        except (Exception, SystemExit):
            logger.exception("signal receiver %r failed", receiver)

    return guarded
