"""``manage.py migrate_mongolock``: create or update the lock collection's indexes."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_mongolock import conf
from django_mongolock.exceptions import MongoLockError
from django_mongolock.terminal import printable


class Command(BaseCommand):
    help = (
        "Create the unique index on the lock key and the TTL index that purges expired "
        "lock documents RETENTION seconds after they expire, and the indexes of the "
        "heartbeat (<collection>.processes, purged RETENTION seconds after a process "
        "stops) and audit (<collection>.audit, purged AUDIT_RETENTION seconds after a "
        "force release) collections. Idempotent; updates a TTL in place when its "
        "setting changed. With --check, changes nothing and exits 1 when something is "
        "missing or out of date (for deploy pipelines)."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--check",
            action="store_true",
            help="Only check; exit 1 if an index is missing, its TTL differs, or the "
            "server is not a replica set.",
        )

    def handle(self, *args: Any, check: bool, verbosity: int, **options: Any) -> None:
        try:
            manager = conf.get_manager()  # invalid settings: a message, not a traceback
            kind = manager.server_kind()
            plan = manager.check_indexes() if check else manager.ensure_indexes()
        except MongoLockError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        target = printable(f"{manager.database}.{manager.collection}")
        width = max(len(item.description) for item in plan)
        styles = {
            "created": self.style.SUCCESS,
            "updated": self.style.SUCCESS,
            "unchanged": self.style.NOTICE,
            "missing": self.style.ERROR,
            "differs": self.style.ERROR,
        }
        if verbosity >= 1:
            for item in plan:
                detail = f" ({item.detail})" if item.detail else ""
                status = styles[item.action](item.action)
                self.stdout.write(f"{target}: {item.description:<{width}}  {status}{detail}")
        problems = [
            f"{item.description} is " + ("missing" if item.action == "missing" else "out of date")
            for item in plan
            if item.action in {"missing", "differs"}
        ]
        if problems:
            problems[-1] += "; run 'python manage.py migrate_mongolock'"
        if kind == "standalone":
            problems.append("the server is a standalone mongod; locks need a replica set")
        if problems:
            raise CommandError("; ".join(problems) + ".", returncode=1)
