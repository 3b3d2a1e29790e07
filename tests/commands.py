"""A command recorder, and a manager whose clients report to one: every command sent,
as the server received it.

Attached to a client through ``event_listeners``; the driver's command monitoring calls
it from whichever thread sent the command, so it keeps its list under a mutex.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from pymongo import monitoring

from django_mongolock import LockManager


@dataclass(frozen=True, slots=True)
class Sent:
    """One command as sent: its name, its database and its body."""

    name: str
    database: str
    command: dict[str, Any]

    @property
    def collection(self) -> str | None:
        value = self.command.get(self.name)
        return value if isinstance(value, str) else None


class Recorder(monitoring.CommandListener):
    """Every command the clients it listens to sent (sync and async alike)."""

    def __init__(self) -> None:
        self._sent: list[Sent] = []
        self._mutex = threading.Lock()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        sent = Sent(event.command_name, event.database_name, dict(event.command))
        with self._mutex:
            self._sent.append(sent)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    @property
    def sent(self) -> list[Sent]:
        with self._mutex:
            return list(self._sent)

    def clear(self) -> None:
        with self._mutex:
            self._sent.clear()

    def on(self, database: str, collection: str) -> list[Sent]:
        """The commands on one collection, in the order sent."""
        return [s for s in self.sent if s.database == database and s.collection == collection]

    def named(self, name: str) -> list[dict[str, Any]]:
        """The bodies of the commands of one name, in the order sent."""
        return [s.command for s in self.sent if s.name == name]


class RecordedManager(LockManager):
    """A LockManager whose clients report every command to ``recorder``."""

    recorder: Recorder

    def _client_options(self) -> dict[str, Any]:
        return {**super()._client_options(), "event_listeners": [self.recorder]}
