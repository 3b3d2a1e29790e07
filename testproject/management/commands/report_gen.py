"""``manage.py report_gen``: a slow job that must run on one machine at a time.

Run it twice at once (in two terminals, or on two machines sharing MongoDB): one
generates the report, the other exits at once with status 75 and names the holder.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_mongolock import current_lock, locked

STEPS = 10
BAR_WIDTH = 20


@locked("report-gen")
class Command(BaseCommand):
    help = (
        "Generate the demo report under the lock 'report-gen': one run at a time across all "
        "machines. Exits 75 when another run holds the lock."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--seconds",
            type=float,
            default=5.0,
            help="how long the work takes (default: 5)",
        )

    def handle(self, *args: Any, seconds: float, verbosity: int, **options: Any) -> None:
        if seconds < 0:
            raise CommandError(f"--seconds must be >= 0, got {seconds:g}")
        lock = current_lock()
        assert lock is not None  # @locked holds it while handle() runs
        if verbosity >= 1:
            self.stdout.write(
                f"report-gen: holding lock {lock.key!r} as {lock.owner}, fencing token {lock.token}"
            )
        for step in range(1, STEPS + 1):
            # Sleeping on the lost flag ends the work as soon as the lock is lost, instead of
            # writing a report that another run may be writing too.
            if lock.lost.wait(seconds / STEPS):
                raise CommandError(
                    f"report-gen: lost the lock {lock.key!r} at step {step}; stopped"
                )
            if verbosity >= 1:
                done = BAR_WIDTH * step // STEPS
                bar = "#" * done + "." * (BAR_WIDTH - done)
                self.stdout.write(f"  [{bar}] step {step}/{STEPS}")
        if verbosity >= 1:
            self.stdout.write(self.style.SUCCESS(f"report-gen: done (token {lock.token})"))
