"""The local clock that bounds leases, and the margin kept for clock drift.

A holder bounds its lease from the moment its request was *sent*: the server started the
lease later than that, so the bound can only err early. Two things could still make it
late, and both are covered here:

- the machine sleeps (suspend, a paused VM): ``CLOCK_MONOTONIC`` stops while it sleeps,
  the server's clock does not. ``CLOCK_BOOTTIME`` keeps counting, so it is used where the
  platform has it (Linux); elsewhere ``time.monotonic()``.
- the local clock runs slower than the server's. A quartz clock is off by well under
  0.01 %, and NTP slews by at most 0.05 %; the margin is 1 % of the lease, at least
  250 ms (thread scheduling on a loaded machine, the time to set a flag and start the
  notices), at most a quarter of the lease.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

__all__ = ["DRIFT_RATE", "MIN_MARGIN", "margin", "now"]

DRIFT_RATE = 0.01
"""The share of a lease the holder gives up at its end, for clock drift."""

MIN_MARGIN = 0.25
"""The margin in seconds for short leases (scheduling delays of the notice itself)."""

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def _boottime() -> float:
    return time.clock_gettime(_BOOTTIME)  # type: ignore[arg-type]


now = _boottime if _BOOTTIME is not None else time.monotonic
"""Seconds on a clock that never goes back and keeps counting while the machine sleeps."""


@functools.lru_cache(maxsize=256)
def _margin(ttl: float) -> float:
    return min(ttl / 4, max(MIN_MARGIN, ttl * DRIFT_RATE))


# Cached: a refresher tick asks for every lease it extended, and a process uses few lease
# lengths. Typed as the function it is, which the cache's own type would not check.
margin: Callable[[float], float] = _margin
"""How long before the end of a ``ttl``-second lease the holder counts it as over."""
