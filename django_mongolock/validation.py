"""Argument checks that run before any I/O, so bad input changes nothing on the server."""

from __future__ import annotations

import math
from numbers import Real

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_TTL",
    "validate_key",
    "validate_timeout",
    "validate_token",
    "validate_ttl",
]

MAX_KEY_BYTES = 1024
# Ten years: leases are renewed by the refresher, so anything longer is a mistake, and the
# server's date arithmetic must not overflow.
MAX_TTL = 10 * 365 * 24 * 3600.0
MIN_TTL = 0.001  # expiry has millisecond resolution on the server


def validate_key(key: object) -> str:
    """Return ``key`` if it is a usable lock name; a key is always a plain string value."""
    if type(key) is not str:
        raise TypeError(f"lock key must be a str, not {type(key).__name__}: {key!r:.80}")
    if not key:
        raise ValueError("lock key must not be empty")
    if "\x00" in key:
        raise ValueError(f"lock key must not contain NUL characters: {key!r:.80}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"lock key is not valid UTF-8 (lone surrogate?): {key!r:.80}") from exc
    if size > MAX_KEY_BYTES:
        raise ValueError(f"lock key is {size} bytes of UTF-8; the limit is {MAX_KEY_BYTES}")
    return key


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"{name} must be a number of seconds, not {type(value).__name__}: {value!r:.80}"
        )
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got a number too large: {value!r:.80}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def validate_ttl(ttl: object, *, name: str = "ttl") -> float:
    """Return ``ttl`` in seconds: a finite number from 1 ms to ten years."""
    seconds = _number(name, ttl)
    if seconds <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {ttl!r}")
    if seconds < MIN_TTL:
        raise ValueError(f"{name} must be at least {MIN_TTL} seconds (1 ms), got {ttl!r}")
    if seconds > MAX_TTL:
        raise ValueError(f"{name} must be at most {MAX_TTL:.0f} seconds (ten years), got {ttl!r}")
    return seconds


def validate_timeout(timeout: object, *, blocking: object) -> float | None:
    """Return the wait limit in seconds (None: wait without end), following threading.Lock."""
    if type(blocking) is not bool:
        raise TypeError(f"blocking must be True or False, not {blocking!r:.80}")
    if timeout is None:
        return None if blocking else 0.0
    if not blocking:
        raise ValueError("a timeout cannot be given with blocking=False")
    seconds = _number("timeout", timeout)
    if seconds < 0:
        raise ValueError(
            f"timeout must be >= 0 seconds (or None to wait without end), got {timeout!r}"
        )
    return seconds


def validate_token(token: object) -> int:
    """Return ``token`` if it can be a fencing token: an int64 (as the server stores it)."""
    if type(token) is not int:
        raise TypeError(f"token must be an int, not {type(token).__name__}")
    if not -(2**63) <= token < 2**63:
        raise ValueError(f"token must fit in 64 bits, got {token}")
    return token
