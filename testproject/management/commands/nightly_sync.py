"""``manage.py nightly_sync``: a job that must stop the moment its lock is lost.

``@locked(..., on_lost="exit")``: if the lock is lost while the work runs (its lease
ran out in a network partition, an operator force-released it), the command is
interrupted at once, prints who lost which lock, and exits with status 76, so that a
cron job never runs on beside its successor.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_mongolock import current_lock, locked


@locked("nightly-sync", on_lost="exit")
class Command(BaseCommand):
    help = (
        "Run the demo sync under the lock 'nightly-sync'. Exits 75 when another run holds "
        "the lock, 76 when the lock is lost while the sync runs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--seconds", type=float, default=5.0, help="how long the work takes (default: 5)"
        )

    def handle(self, *args: Any, seconds: float, verbosity: int, **options: Any) -> None:
        lock = current_lock()
        assert lock is not None  # @locked holds it while handle() runs
        if verbosity >= 1:
            self.stdout.write(
                f"nightly-sync: holding lock {lock.key!r}, fencing token {lock.token}"
            )
            self.stdout.flush()
        time.sleep(seconds)  # the work: interrupted if the lock is lost meanwhile
        if verbosity >= 1:
            self.stdout.write(self.style.SUCCESS(f"nightly-sync: done (token {lock.token})"))
