"""``manage.py migrate_mongolock``: create or update the lock collection's indexes."""

from __future__ import annotations

from typing import Any, Final

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_mongolock import conf
from django_mongolock.exceptions import MongoLockError
from django_mongolock.exitcodes import EXIT_CHECK_FAILED, EXIT_ERROR
from django_mongolock.queries import AUDIT_KEY_INDEX, AUDIT_TTL_INDEX, PROCESS_TTL_INDEX
from django_mongolock.queries.requests import REQUESTS_TTL_INDEX
from django_mongolock.terminal import printable

# The side collections' indexes, by name: the collection they belong to.
_SUFFIXES: Final = {
    PROCESS_TTL_INDEX: ".processes",
    AUDIT_TTL_INDEX: ".audit",
    AUDIT_KEY_INDEX: ".audit",
    REQUESTS_TTL_INDEX: ".requests",
}


def _plain(description: str) -> str:
    """An index's description without its side collection's label ("heartbeats: ", ...)."""
    label, sep, rest = description.partition(": ")
    return rest if sep and label in ("heartbeats", "audit trail", "run requests") else description


class Command(BaseCommand):
    help = (
        "Create the unique index on the lock key and the TTL index that purges expired "
        "lock documents RETENTION seconds after they expire, and the indexes of the "
        "heartbeat (<collection>.processes, purged RETENTION seconds after a process "
        "stops) and audit (<collection>.audit, purged AUDIT_RETENTION seconds after a "
        "force release) collections, and the TTL index of the run requests of "
        'on_busy="coalesce" (<collection>.requests). Idempotent; updates a TTL in place '
        "when its setting changed. With --check, changes nothing and exits 1 when something is "
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
            plan = manager.check_indexes(kind=kind) if check else manager.ensure_indexes(kind=kind)
        except MongoLockError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        base = f"{manager.database}.{manager.collection}"
        rows = [(printable(base + _SUFFIXES.get(item.name, "")), item) for item in plan]
        names = [(target, _plain(item.description)) for target, item in rows]
        width = max(len(target) + len(text) for target, text in names)
        styles = {
            "created": self.style.SUCCESS,
            "updated": self.style.SUCCESS,
            "unchanged": self.style.NOTICE,
            "missing": self.style.ERROR,
            "differs": self.style.ERROR,
        }
        if verbosity >= 1:
            for (target, text), (_, item) in zip(names, rows, strict=True):
                detail = f" ({item.detail})" if item.detail else ""
                status = styles[item.action](item.action)
                label = f"{target}: {text}"
                self.stdout.write(f"{label:<{width + 2}}  {status}{detail}")
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
            raise CommandError("; ".join(problems) + ".", returncode=EXIT_CHECK_FAILED)
