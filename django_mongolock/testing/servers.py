"""The replica set the tests use: ``MONGOLOCK_TEST_URL`` as given, else a container when a
Docker engine answers, else a local ``mongod``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import warnings
from collections.abc import Iterator

import pymongo
from pymongo.errors import PyMongoError

from django_mongolock.testing.nodes import (
    _HOW_TO_GET_A_SERVER,
    TEST_URL_ENV,
    MongodNotFound,
    ReplicaSetError,
    direct_client,
    find_mongod,
)
from django_mongolock.testing.replica_set import _TEST_CACHE_GB, _TEST_OPLOG_MB, MongoReplicaSet

__all__ = ["DEFAULT_DOCKER_IMAGE", "DOCKER_IMAGE_ENV", "mongolock_replica_set_url"]

logger = logging.getLogger("django_mongolock.testing")

DOCKER_IMAGE_ENV = "MONGOLOCK_TEST_IMAGE"
DEFAULT_DOCKER_IMAGE = "mongo:6.0"


@contextlib.contextmanager
def mongolock_replica_set_url() -> Iterator[str]:
    """Yield the URL of a replica set for tests, starting one if need be and stopping it after.

    ``MONGOLOCK_TEST_URL`` is used as is; else a container when a Docker engine answers; else a
    local ``mongod``. Raises :class:`MongodNotFound` with instructions when none is available.
    """
    explicit = os.environ.get(TEST_URL_ENV)
    if explicit:
        yield explicit
        return
    with contextlib.ExitStack() as stack:
        url: str | None = None
        docker_problem = ""
        if _docker_engine_answers():  # pragma: no cover - no Docker engine where tests run
            try:
                url = stack.enter_context(_docker_replica_set())
            except Exception as exc:
                docker_problem = f" (A Docker engine answered but MongoDB did not start: {exc})"
                logger.warning("MongoDB in Docker failed, trying a local mongod: %s", exc)
        if url is None:
            binary = find_mongod()
            if binary is None:
                raise MongodNotFound(_HOW_TO_GET_A_SERVER + docker_problem)
            url = stack.enter_context(MongoReplicaSet(mongod=binary)).url
        yield url


def _docker_engine_answers(timeout: float = 3.0) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        from testcontainers.core.docker_client import DockerClient
    except ImportError:
        return False
    # The docker SDK leaves its socket to the garbage collector when no engine answers; collect
    # it here, quietly, rather than let a ResourceWarning fail whichever test runs next.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = DockerClient(timeout=timeout)
            try:  # pragma: no cover - no Docker engine where tests run
                return bool(client.client.ping())
            finally:  # pragma: no cover
                client.client.close()
        except Exception:  # the docker SDK raises errors of its own
            return False
        finally:
            gc.collect()


def _docker_command(name: str) -> str:
    """mongod's arguments in the container: the cache and oplog sizes of a local test
    set, so that a test runs on the same server whichever of the two it got."""
    return (
        f"--replSet {name} --bind_ip_all --port 27017"
        f" --wiredTigerCacheSizeGB {_TEST_CACHE_GB} --oplogSize {_TEST_OPLOG_MB}"
    )


@contextlib.contextmanager
def _docker_replica_set(name: str = "mongolock") -> Iterator[str]:  # pragma: no cover
    """A single-node replica set in a container; the URL connects to it directly.

    The member is known as ``localhost:27017`` inside the container, a name the host cannot
    use, hence ``directConnection=true`` rather than replica set discovery.
    """
    from testcontainers.core.container import DockerContainer

    image = os.environ.get(DOCKER_IMAGE_ENV, DEFAULT_DOCKER_IMAGE)
    container = DockerContainer(image).with_command(_docker_command(name)).with_exposed_ports(27017)
    with container:
        address = f"{container.get_container_host_ip()}:{container.get_exposed_port(27017)}"
        deadline = time.monotonic() + 60
        with direct_client(address) as client:
            while True:
                try:
                    with pymongo.timeout(5):
                        client.admin.command(
                            "replSetInitiate",
                            {"_id": name, "members": [{"_id": 0, "host": "localhost:27017"}]},
                        )
                    break
                except PyMongoError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
            while not client.admin.command("hello").get("isWritablePrimary"):
                if time.monotonic() >= deadline:
                    raise ReplicaSetError(f"MongoDB in {image} did not become primary")
                time.sleep(0.2)
        yield f"mongodb://{address}/?directConnection=true"
