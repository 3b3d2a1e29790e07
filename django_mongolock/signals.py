"""Signals sent by the lock manager: ``sender`` is the LockManager, ``lock`` the Lock.

They are plain ``django.dispatch`` signals, which need no configured settings, so a
LockManager used outside Django sends them too (to no receivers).
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["lock_acquired", "lock_lost", "lock_released"]

lock_acquired = Signal()
"""Sent after a lock was acquired."""

lock_released = Signal()
"""Sent after its holder released a lock (``held`` says whether its lease was still running)."""

lock_lost = Signal()
"""Sent once when a holder learns it lost its lock (lease ended or force-released)."""
