"""This process's id, read without a system call.

Handles, lanes, connections and the process-wide services each check that they run in
the process that made them: a forked child must not release, refresh or watch its
parent's locks. ``os.getpid()`` is a system call every time, and an uncontended acquire
and release made ten. The id is kept here instead and renewed in a forked child by a
fork hook; this module is imported before any module that registers a hook of its own,
and the child's hooks run in the order they were registered, so theirs see the new id.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

_pid = os.getpid()


def pid() -> int:
    """``os.getpid()``, as of the last fork."""
    return _pid


def _renew_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_renew_in_child)
