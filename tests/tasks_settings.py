"""Settings of the django.tasks worker processes (``db_worker``) and their driver.

The suite's settings, with django-tasks-db's ``DatabaseBackend`` as the default task
backend; its SQL database (``TASKS_DATABASE``, a JSON ``DATABASES`` entry) and MongoDB
(``MONGOLOCK_URL``, ``MONGOLOCK_DATABASE``) come from the environment the test sets.
"""

from __future__ import annotations

import json
import os

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
