"""Two real Celery workers for the whole module, on the test replica set."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from tests.celery.harness import Jobs, Worker, client_app, workers


@pytest.fixture(scope="module")
def jobs(mongolock_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """The module's databases (locks, broker, results), dropped afterwards."""
    tmp: Path = tmp_path_factory.mktemp("celery")
    # A short lease: "retry" counts down the holder's remaining lease.
    jobs = Jobs(mongolock_url, f"mongolock_jobs_{uuid.uuid4().hex[:12]}", tmp, ttl=3.0)
    yield jobs
    jobs.drop()


@pytest.fixture(scope="module")
def two_workers(jobs: Jobs) -> Iterator[list[Worker]]:
    """Two prefork workers (concurrency 4 each) consuming the same queue."""
    with workers(jobs, "alpha", "beta") as started:
        yield started


@pytest.fixture(scope="module")
def app(jobs: Jobs) -> Iterator[Celery]:
    with client_app(jobs) as app:
        yield app
