"""Semaphores, lock groups and elections: now in ``recipes.py`` (this path keeps working)."""

from django_mongolock.recipes import Election, LockGroup, Semaphore, check_callback

__all__ = ["Election", "LockGroup", "Semaphore", "check_callback"]
