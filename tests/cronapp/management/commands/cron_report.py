"""A nightly report that cron starts on every host: busy exits 75."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_mongolock import locked
from tests.cronapp.jobs import run_job


@locked("cron-report", ttl=10)
class Command(BaseCommand):
    help = "Build the report; one run per burst, whichever host starts first."

    def handle(self, *args: Any, **options: Any) -> None:
        run_job("cron_report")
