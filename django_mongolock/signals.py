"""Signals sent by the lock manager: ``sender`` is the LockManager, ``lock`` the Lock.

They are plain ``django.dispatch`` signals, which need no configured settings, so a
LockManager used outside Django sends them too (to no receivers).
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from django.dispatch import Signal

__all__ = ["lock_acquired", "lock_lost", "lock_released", "send_safely"]

logger = logging.getLogger("django_mongolock.signals")

lock_acquired = Signal()
"""Sent after a lock was acquired."""

lock_released = Signal()
"""Sent after its holder released a lock (``held`` says whether its lease was still running)."""

lock_lost = Signal()
"""Sent once when a holder learns it lost its lock (lease ended or force-released)."""


def send_safely(signal: Signal, sender: object, **named: Any) -> None:
    """Call every receiver of ``signal``; one that fails or calls ``sys.exit()`` skips none.

    ``Signal.send_robust`` catches ``Exception`` only: a receiver raising ``SystemExit``
    would skip the receivers after it. Each receiver is called on its own here, and its
    failure logged. (Falls back to ``send_robust`` should Django's receiver lookup change.)
    """
    try:
        sync_receivers, async_receivers = signal._live_receivers(sender)
    except Exception:  # pragma: no cover - a Django without the lookup used here
        try:
            signal.send_robust(sender, **named)
        except (Exception, SystemExit):
            logger.exception("a signal receiver failed")
        return
    for receiver in sync_receivers:
        try:
            receiver(signal=signal, sender=sender, **named)
        except (Exception, SystemExit):
            logger.exception("signal receiver %r failed", receiver)
    for receiver in async_receivers:
        try:
            async_to_sync(receiver)(signal=signal, sender=sender, **named)
        except (Exception, SystemExit):
            logger.exception("signal receiver %r failed", receiver)
