"""The Celery app of the test workers: ``celery -A tests.celery.app worker``.

Broker and result backend are MongoDB databases of the test's replica set, given in
``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND``. With ``MONGOLOCK_PARENT_KEY`` set, the
worker's main process takes that lock before it forks its pool: the children must not
inherit its client or refresher, nor release it. ``CELERY_WORKER_LOST_WAIT`` sets Celery's
``worker_lost_wait`` (10 s by default).
"""

from __future__ import annotations

import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery.settings")
django.setup()

from celery import Celery  # noqa: E402
from celery.signals import worker_init  # noqa: E402

from django_mongolock import Lock  # noqa: E402

TRANSPORT_OPTIONS = {"polling_interval": 0.05}

app = Celery(
    "mongolock_tests",
    broker=os.environ["CELERY_BROKER_URL"],
    backend=os.environ["CELERY_RESULT_BACKEND"],
    include=["tests.celery.tasks"],
)
app.conf.update(
    broker_transport_options=TRANSPORT_OPTIONS,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_track_started=True,
    task_serializer="json",
    result_serializer="json",
    # How long the worker waits for the result of a pool process that died before it
    # declares the task lost (and, for reject_on_worker_lost, hands it back to the broker).
    worker_lost_wait=float(os.environ.get("CELERY_WORKER_LOST_WAIT", "10")),
)

_held: list[Lock] = []


def hold_in_parent(**kwargs: Any) -> None:
    """Take ``MONGOLOCK_PARENT_KEY`` in the main process, before the pool forks."""
    key = os.environ.get("MONGOLOCK_PARENT_KEY")
    if not key:
        return
    from django_mongolock import locks

    lock = locks.acquire(key)
    _held.append(lock)
    print(f"parent {os.getpid()} holds {key} with token {lock.token}", flush=True)


worker_init.connect(hold_in_parent, weak=False)
