"""The test project's settings with a short lease, so that a lost lock is noticed within
a second: for ``manage.py nightly_sync --settings tests.nightly_settings``."""

from __future__ import annotations

from testproject.settings import *  # noqa: F403
from testproject.settings import MONGOLOCK

MONGOLOCK = {**MONGOLOCK, "TTL": 1.5}
