"""Argument checks that run before any I/O, so bad input changes nothing on the server."""

from __future__ import annotations

import math
from numbers import Real

__all__ = [
    "AUDIT_TEXT_MAX",
    "MAX_KEY_BYTES",
    "MAX_TTL",
    "check_callback",
    "validate_audit_text",
    "validate_flag",
    "validate_keep",
    "validate_key",
    "validate_limit",
    "validate_name",
    "validate_owner",
    "validate_page",
    "validate_reentrant",
    "validate_retention",
    "validate_timeout",
    "validate_token",
    "validate_ttl",
]

MAX_KEY_BYTES = 1024
# Ten years: leases are renewed by the refresher, so anything longer is a mistake, and the
# server's date arithmetic must not overflow.
MAX_TTL = 10 * 365 * 24 * 3600.0
MIN_TTL = 0.001  # expiry has millisecond resolution on the server
# Longest ``by`` or ``reason`` an audit record keeps.
AUDIT_TEXT_MAX = 1000


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


def validate_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is True or False (1, 0 and None are refused: a typo)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def validate_keep(refresh: object, default: bool) -> bool:
    """Whether the refresher keeps a new lease alive (None: ``default``, the manager's)."""
    keep = default if refresh is None else refresh
    if type(keep) is not bool:
        raise TypeError(f"refresh must be True, False or None, not {refresh!r}")
    return keep


def validate_limit(limit: object, *, shared: bool) -> int | None:
    """Return the holder limit of a shared lock: None, or an int >= 1 with ``shared``."""
    if limit is None:
        return None
    if type(limit) is not int:
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if not shared:
        raise ValueError("limit applies to shared locks: pass shared=True")
    return limit


def validate_reentrant(reentrant: object, *, shared: bool) -> bool:
    """Return ``reentrant``: True or False, and never with a shared lock."""
    if type(reentrant) is not bool:
        raise TypeError(f"reentrant must be True or False, not {reentrant!r}")
    if reentrant and shared:
        raise ValueError("reentrant=True is for exclusive locks; shared locks are not reentrant")
    return reentrant


def check_callback(name: str, value: object) -> None:
    """Refuse a callback that cannot be called, before any I/O: it would fail much later,
    in another thread, where nobody sees the mistake.
    """
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, not {value!r:.80}")


def validate_retention(value: object, *, name: str = "retention") -> int:
    """Return a retention: a whole number of seconds >= 0 (an int, not a float or bool)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a whole number of seconds >= 0, got {value!r}")
    return value


def validate_owner(owner: object) -> str | None:
    """Return the holder name that starts owner ids: None, or a non-empty str without NUL."""
    if owner is not None and (not isinstance(owner, str) or not owner or "\x00" in owner):
        raise ValueError(f"owner must be a non-empty str without NUL, got {owner!r}")
    return owner


def validate_name(name: str, value: object) -> str:
    """Return ``value`` if it can name a MongoDB database or collection."""
    if not isinstance(value, str) or not value or any(c in value for c in '/\\. "$\x00'):
        raise ValueError(f"{name} must be a valid MongoDB name, got {value!r}")
    return value


def validate_audit_text(name: str, value: object, *, allow_empty: bool) -> str:
    """``value`` checked for an audit record: a str, not too long, without NUL."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if (not value and not allow_empty) or len(value) > AUDIT_TEXT_MAX or "\x00" in value:
        raise ValueError(
            f"{name} must be {'' if allow_empty else 'a non-empty '}text of at most "
            f"{AUDIT_TEXT_MAX} characters without NUL, got {value[:80]!r}"
        )
    return value


def validate_page(limit: object, offset: object) -> None:
    """Check one page of a listing: ``limit`` a whole number >= 0 or None, ``offset`` >= 0."""
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be a whole number >= 0 or None, got {limit!r}")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"offset must be a whole number >= 0, got {offset!r}")
