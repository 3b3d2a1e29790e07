"""The same report with ``on_busy="skip"``: busy says so in one line and exits 0."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_mongolock import locked
from tests.cronapp.jobs import run_job


@locked("cron-report", ttl=10, on_busy="skip")
class Command(BaseCommand):
    help = "Build the report; one run per burst, the others skip quietly."

    def handle(self, *args: Any, **options: Any) -> None:
        run_job("cron_report_skip")
