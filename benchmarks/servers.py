"""The servers the suite measures against: one MongoDB replica set and, when installed, Redis.

MongoDB is a single-node replica set started for the run (``MongoReplicaSet``), unless
``MONGOLOCK_URL`` names one. Redis is a ``redis-server`` on a free loopback port, without
persistence, stopped with the suite.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pymongo import MongoClient
from pymongo.errors import PyMongoError

from django_mongolock.testing import LOOPBACK, MongoReplicaSet, free_port

__all__ = ["MongoServer", "RedisServer", "mongo_server", "redis_server", "size"]

URL_ENV = "MONGOLOCK_URL"


@dataclass(frozen=True, slots=True)
class MongoServer:
    url: str
    version: str
    topology: str
    started_here: bool
    storage: str = "?"
    """The primary's WiredTiger cache and oplog sizes, as the report gives them."""


@dataclass(frozen=True, slots=True)
class RedisServer:
    url: str
    version: str


@contextlib.contextmanager
def mongo_server() -> Iterator[MongoServer]:
    """``MONGOLOCK_URL`` when set, otherwise a single-node replica set for this run."""
    url = os.environ.get(URL_ENV)
    if url:
        yield _describe(url, started_here=False)
        return
    # Sized by mongod for the machine, as a production server is, not the test suite's
    # small cache and oplog: over 10,000 locks a tick's write and the raw one each dirty
    # megabytes of documents and oplog, and in a 0.25 GB cache a third of them waited for
    # eviction, hitting either side at random (docs/performance.md).
    with MongoReplicaSet(
        1, name="mongolockbench", cache_size_gb=None, oplog_size_mb=None
    ) as replica_set:
        yield _describe(replica_set.url, started_here=True)


def _describe(url: str, *, started_here: bool) -> MongoServer:
    client: MongoClient[dict[str, Any]] = MongoClient(url, serverSelectionTimeoutMS=10000)
    try:
        info = client.server_info()
        hello = client.admin.command("hello")
        storage = _storage(client) if "setName" in hello else "?"
    finally:
        client.close()
    if "setName" in hello:
        members = len(hello.get("hosts", [])) or 1
        topology = f"replica set {hello['setName']!r}, {members} node(s)"
    else:
        topology = "standalone (django-mongolock refuses it)"
    return MongoServer(url, str(info.get("version", "?")), topology, started_here, storage)


def _storage(client: MongoClient[dict[str, Any]]) -> str:
    """The primary's WiredTiger cache and oplog sizes ("?" for what it does not say)."""
    try:
        cache = client.admin.command("serverStatus")["wiredTiger"]["cache"]
        (oplog,) = client.local["oplog.rs"].aggregate([{"$collStats": {"storageStats": {}}}])
        sizes = cache["maximum bytes configured"], oplog["storageStats"]["maxSize"]
    except (PyMongoError, KeyError, ValueError):
        return "?"
    return f"WiredTiger cache {size(sizes[0])}, oplog {size(sizes[1])}"


def size(nbytes: float) -> str:
    """``nbytes`` in MiB below a GiB, in GiB from there."""
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer | None]:
    """A throwaway ``redis-server`` on loopback, or None (with the reason printed) without one."""
    binary = shutil.which("redis-server")
    if binary is None:
        print("notice: no redis-server on PATH: python-redis-lock is skipped")
        yield None
        return
    try:
        importlib.import_module("redis")
        importlib.import_module("redis_lock")
    except ImportError:
        print(
            "notice: python-redis-lock or redis is not installed (pip install -e '.[bench]'): "
            "python-redis-lock is skipped"
        )
        yield None
        return
    workdir = tempfile.mkdtemp(prefix="mongolock-bench-redis-")
    port = free_port()
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--logfile",
        os.path.join(workdir, "redis.log"),
    ]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        version = _wait_redis(port, process)
        yield RedisServer(f"redis://{LOOPBACK}:{port}/0", version)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_redis(port: int, process: subprocess.Popen[bytes]) -> str:
    redis = importlib.import_module("redis")
    client = redis.Redis(host=LOOPBACK, port=port, socket_timeout=1.0)
    deadline = time.monotonic() + 10
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {process.returncode}")
            try:
                return str(client.info("server")["redis_version"])
            except redis.exceptions.ConnectionError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"redis-server did not answer on port {port}") from None
                time.sleep(0.05)
    finally:
        client.close()
