"""Settings of the worker processes (Celery and gunicorn): the demo project, shorter leases.

The tests pass ``MONGOLOCK_URL``, ``MONGOLOCK_DATABASE`` and ``MONGOLOCK_TTL`` in the
environment, so that every child process finds the test's replica set and database.
"""

from __future__ import annotations

import os

from testproject.settings import *  # noqa: F403
from testproject.settings import MONGOLOCK

MONGOLOCK = {**MONGOLOCK, "TTL": float(os.environ.get("MONGOLOCK_TTL", "30"))}
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEBUG = False
