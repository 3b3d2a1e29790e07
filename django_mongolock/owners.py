"""Who holds and who operates: holder ids unique per acquisition, and the operator's name."""

from __future__ import annotations

import getpass
import itertools
import os
import secrets
import socket

__all__ = ["host_prefix", "new_owner", "operator", "owner_prefix"]


class _OwnerIds:
    """This process's source of holder ids: its host, its pid and a counter from a random start.

    A counter rather than fresh randomness per acquisition: unique all the same within
    the process, and no system call on the hot path.
    """

    __slots__ = ("host", "pid", "serial")

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.serial = itertools.count(secrets.randbits(48))


_ids: _OwnerIds | None = None


def _owner_ids() -> _OwnerIds:
    """The ids of this process (a forked child starts its own)."""
    global _ids
    ids = _ids
    if ids is None or ids.pid != os.getpid():
        ids = _ids = _OwnerIds()
    return ids


def new_owner(name: str | None) -> str:
    """A holder id unique per acquisition: ``host:pid:random`` (or ``name:pid:random``)."""
    ids = _owner_ids()
    return f"{name or ids.host}:{ids.pid}:{next(ids.serial) % 2**48:012x}"


def owner_prefix(name: str | None) -> str:
    """What every holder id this process makes with ``name`` starts with: ``host:pid:``.

    The change stream of a process lets through only the handoffs to its own waiters
    by this prefix (``queries.wakeups``).
    """
    ids = _owner_ids()
    return f"{name or ids.host}:{ids.pid}:"


def host_prefix(name: str | None) -> str:
    """What the holder ids of every process on this host start with, given ``name``:
    ``host:``. One relay's stream carries the handoffs to all of them (``relay``)."""
    return f"{name or _owner_ids().host}:"


def operator() -> str:
    """Who runs this process, for the audit trail: ``user@host`` (``(sudo from U)``).

    The name comes from the effective uid, not from LOGNAME or USER, which anyone can
    set; a sudo run also names the user who ran sudo.
    """
    who = f"{_user_name()}@{socket.gethostname()}"
    sudo = os.environ.get("SUDO_USER")
    return f"{who} (sudo from {sudo})" if sudo else who


def _user_name() -> str:
    """The effective user's name from the password database; the uid if it has none."""
    try:
        import pwd
    except ImportError:  # pragma: no cover - no pwd (Windows)
        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return "unknown"
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # no name for this uid (a bare container)
        return str(os.geteuid())
