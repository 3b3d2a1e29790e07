"""Settings of the cron processes: the test suite's, the cron commands, MongoDB from the env."""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.cronapp"]
MONGOLOCK = {
    "URL": os.environ["MONGOLOCK_URL"],
    "DATABASE": os.environ["MONGOLOCK_DATABASE"],
    "TTL": 10.0,
}
