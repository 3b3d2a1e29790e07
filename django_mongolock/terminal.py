"""Display helpers for text output: the CLI, ``@locked``'s messages and the admin share them.

Keys and owners are chosen by whoever takes a lock. Printed raw, a newline in a key would
forge a row of ``mongolock list``, an ESC sequence could clear the screen or retitle the
window, and a bidi override (U+202E) would show the rest of the line reversed: everything
taken from a lock document goes through ``printable``. Times are the server's, in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal, TypeAlias

from django_mongolock.info import LockInfo

__all__ = ["Liveness", "age", "liveness", "printable", "relative", "role", "timestamp", "who"]

Liveness: TypeAlias = Literal["alive", "silent", "unknown"]


def printable(text: str) -> str:
    """``text`` with each character that is not printable escaped as ``repr`` escapes it.

    That is every control character (C0, DEL, C1: ``\\n``, ``\\r``, ``\\x1b``, ``\\x9b``),
    every format character (bidi controls U+202A-U+202E and U+2066-U+2069, zero-width
    characters), line and paragraph separators, and spaces other than U+0020. Everything
    else, backslashes included, is kept as it is, so plain keys read unchanged.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def relative(seconds: float) -> str:
    """``in 12s`` ahead, ``3m ago`` behind: the largest whole unit, as people read a clock."""
    size = abs(seconds)
    if size < 1:
        return "now"
    unit, length = next(
        (unit, length)
        for unit, length in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
        if size >= length
    )
    text = f"{int(size // length)}{unit}"
    return f"in {text}" if seconds > 0 else f"{text} ago"


def timestamp(moment: datetime) -> str:
    """A server time to the second, in UTC: ``2026-01-31 12:00:00 UTC``."""
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def age(info: LockInfo) -> float:
    """Seconds since the lock was acquired, by the server's clock."""
    return (info.now - info.acquired_at).total_seconds()


def liveness(info: LockInfo) -> tuple[Liveness, float]:
    """Whether the holder's process sends heartbeats, and for how long it has been silent
    (seconds since its last heartbeat; 0 when unknown)."""
    silent = info.holder_silent_for
    if info.holder_alive is None or silent is None:
        return "unknown", 0.0
    return ("alive" if info.holder_alive else "silent"), silent


def role(info: LockInfo) -> Literal["leader", "group", ""]:
    """What the holder is besides a holder: an elected leader, a group member, or nothing."""
    if info.kind == "election":
        return "leader"
    return "group" if info.group else ""


def who(info: LockInfo) -> str:
    """The holder for people: the owner, or the shared holders; with the lock's role.

    Escaped for the terminal, as keys are (see ``printable``).
    """
    label = info.owner or info.holder_label
    kind = role(info)
    shown = "leader" if kind == "leader" else f"group {info.group}" if kind == "group" else ""
    return printable(f"{label} ({shown})" if shown else label)
