"""Settings of the django.tasks worker processes (``db_worker``) and their driver.

The suite's settings, with django-tasks-db's ``DatabaseBackend`` as the default task
backend; its SQL database (``TASKS_DATABASE``, a JSON ``DATABASES`` entry) and MongoDB
(``MONGOLOCK_URL``, ``MONGOLOCK_DATABASE``) come from the environment the test sets.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db", "tests.taskapp"]
DATABASES = {"default": json.loads(os.environ["TASKS_DATABASE"])}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
MONGOLOCK = {
    "URL": os.environ["MONGOLOCK_URL"],
    "DATABASE": os.environ["MONGOLOCK_DATABASE"],
    "TTL": 10.0,
}

# A worker's stacks on SIGUSR1, in its log: what a task that does not end is doing.
faulthandler.register(signal.SIGUSR1, all_threads=True)

# The task states and the decorator's choices, with times and pids, in the workers' logs.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(name)s %(message)s"}},
    "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_mongolock": {"handlers": ["err"], "level": "DEBUG"},
        "django.tasks": {"handlers": ["err"], "level": "DEBUG"},
    },
}
