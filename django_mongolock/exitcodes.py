"""Exit statuses of the management commands and of ``@locked`` commands, in one place.

Cron wrappers and deploy pipelines branch on these numbers: they are part of the API.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUSY_EXIT_CODE",
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "EXIT_HOLDER_ALIVE",
    "EXIT_NO_LOCK",
    "EXIT_OK",
    "LOST_EXIT_CODE",
]

EXIT_OK: Final = 0
EXIT_NO_LOCK: Final = 1
"""``mongolock release`` and ``status``: no such lock."""
EXIT_CHECK_FAILED: Final = 1
"""``migrate_mongolock --check``: an index is missing or out of date, or the server is a
standalone mongod."""
EXIT_ERROR: Final = 2
"""MongoDB could not be reached or refused; invalid settings or arguments."""
EXIT_HOLDER_ALIVE: Final = 3
"""``mongolock release``: the lease is live and its holder is not known to be dead."""

BUSY_EXIT_CODE: Final = 75
"""Exit status of a ``@locked`` management command whose lock is busy (EX_TEMPFAIL)."""

LOST_EXIT_CODE: Final = 76
"""Exit status of a ``@locked(..., on_lost="exit")`` command whose lock was lost mid-run."""
