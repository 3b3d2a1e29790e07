"""Tests of the test harness itself (django_mongolock.testing), against real mongod processes."""

from __future__ import annotations

import io
import os
import platform
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from pymongo import MongoClient, WriteConcern
from pymongo.read_concern import ReadConcern

from django_mongolock import testing
from django_mongolock.testing import (
    MongodNotFound,
    MongoNode,
    MongoReplicaSet,
    ReplicaSetError,
    find_mongod,
    free_port,
    mongolock_replica_set_url,
)

REPO = Path(__file__).resolve().parent.parent
MAJORITY = WriteConcern("majority", wtimeout=20000)


@pytest.fixture(scope="module")
def single() -> Iterator[MongoReplicaSet]:
    with MongoReplicaSet(name="harness") as replica_set:
        yield replica_set


def _client(url: str) -> MongoClient[dict[str, Any]]:
    return MongoClient(url, serverSelectionTimeoutMS=30000)


def _mongod_pids(dbpath: str) -> list[int]:
    """Processes whose command line names ``dbpath``: what a harness might have left behind."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if dbpath.encode() in argv and any(arg.endswith(b"mongod") for arg in argv[:1]):
            found.append(int(proc.name))
    return found


def _gone(node: MongoNode) -> bool:
    assert node.process is not None
    if node.process.returncode is None:
        return False
    try:
        os.kill(node.process.pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- find_mongod --------------------------------------------------------------------------------


def _fake_mongod(directory: Path) -> Path:
    binary = directory / "mongod"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    return binary


def test_find_mongod_prefers_the_environment_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_mongod(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MONGOLOCK_MONGOD", "/opt/mongodb/bin/mongod")
    assert find_mongod() == "/opt/mongodb/bin/mongod"


def test_find_mongod_then_looks_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = _fake_mongod(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("MONGOLOCK_MONGOD", raising=False)
    assert find_mongod() == str(binary)


def test_find_mongod_then_takes_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("MONGOLOCK_MONGOD", raising=False)
    found = find_mongod()
    if sys.platform == "linux" and platform.machine() == "x86_64":  # the [server] extra's wheel
        assert found is not None
        assert found.endswith(os.path.join("fiftyone", "db", "bin", "mongod"))
        assert os.access(found, os.X_OK)
    else:  # pragma: no cover
        assert found is None


def test_without_any_server_the_error_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("MONGOLOCK_MONGOD", raising=False)
    monkeypatch.delenv("MONGOLOCK_TEST_URL", raising=False)
    monkeypatch.setattr(testing.nodes, "_wheel_mongod", lambda: None)
    monkeypatch.setattr(testing.servers, "_docker_engine_answers", lambda: False)
    assert find_mongod() is None
    with pytest.raises(MongodNotFound) as caught, mongolock_replica_set_url():
        pass  # pragma: no cover
    assert "django-mongolock[server]" in str(caught.value)
    assert "MONGOLOCK_TEST_URL" in str(caught.value)
    with pytest.raises(MongodNotFound):
        MongoReplicaSet().start()


def test_the_test_url_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "mongodb://db.example:27017/?replicaSet=elsewhere"
    monkeypatch.setenv("MONGOLOCK_TEST_URL", url)
    monkeypatch.setattr(
        testing.servers, "find_mongod", lambda: pytest.fail("must not look for mongod")
    )
    with mongolock_replica_set_url() as given:
        assert given == url


def test_docker_probe_answers_a_bool() -> None:
    assert isinstance(testing.servers._docker_engine_answers(), bool)


def test_the_docker_fallback_has_the_sizes_of_a_local_set() -> None:
    """The container's mongod gets the cache and oplog a local test set starts with
    (``test_nodes_start_small_unless_told_otherwise`` checks those on a running set)."""
    args = testing.servers._docker_command("rs-test").split()
    assert args[:2] == ["--replSet", "rs-test"]
    assert args[args.index("--wiredTigerCacheSizeGB") + 1] == "0.25"
    assert args[args.index("--oplogSize") + 1] == "128"


# -- MongoReplicaSet, one node ------------------------------------------------------------------


def test_bad_arguments_are_refused_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        MongoReplicaSet(0)
    with pytest.raises(ValueError, match="ports must have 3 items"):
        MongoReplicaSet(3, ports=[27017])
    with pytest.raises(ValueError, match="priority above 0"):
        MongoReplicaSet(2, priorities=[0, 0])
    with pytest.raises(ReplicaSetError, match="not started"):
        _ = MongoReplicaSet().url
    # mongod's own bounds, which it would only enforce once started.
    for cache in (0.1, 0, -1, 10_001, 10**400, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"cache_size_gb must be between 0\.25 and 10,000"):
            MongoReplicaSet(cache_size_gb=cache)
    for wrong in (True, "1", [1]):
        with pytest.raises(TypeError, match="cache_size_gb must be an int or a float or None"):
            MongoReplicaSet(cache_size_gb=wrong)  # type: ignore[arg-type]
    for oplog in (0, -5, 2**31):
        with pytest.raises(ValueError, match="oplog_size_mb must be between 1 and 2,147,483,647"):
            MongoReplicaSet(oplog_size_mb=oplog)
    for not_int in (1.5, False, "128"):
        with pytest.raises(TypeError, match="oplog_size_mb must be an int or None"):
            MongoReplicaSet(oplog_size_mb=not_int)  # type: ignore[arg-type]


def _storage(url: str) -> tuple[dict[str, Any], int, int]:
    """The storage options mongod was started with, its cache's size and its oplog's."""
    with _client(url) as client:
        parsed = client.admin.command("getCmdLineOpts")["parsed"]
        cache = client.admin.command("serverStatus")["wiredTiger"]["cache"]
        (stats,) = client.local["oplog.rs"].aggregate([{"$collStats": {"storageStats": {}}}])
    return parsed, cache["maximum bytes configured"], stats["storageStats"]["maxSize"]


def test_nodes_start_small_unless_told_otherwise(single: MongoReplicaSet) -> None:
    parsed, cache, oplog = _storage(single.url)
    assert parsed["storage"]["wiredTiger"]["engineConfig"]["cacheSizeGB"] == 0.25
    assert parsed["replication"]["oplogSizeMB"] == 128
    assert (cache, oplog) == (256 * 2**20, 128 * 2**20)
    with MongoReplicaSet(name="sized", cache_size_gb=0.5, oplog_size_mb=300) as sized:
        parsed, cache, oplog = _storage(sized.url)
        assert parsed["storage"]["wiredTiger"]["engineConfig"]["cacheSizeGB"] == 0.5
        assert (cache, oplog) == (512 * 2**20, 300 * 2**20)
    # None: mongod sizes both for the machine, as a production server does.
    with MongoReplicaSet(name="machine", cache_size_gb=None, oplog_size_mb=None) as machine:
        parsed, cache, oplog = _storage(machine.url)
        assert "cacheSizeGB" not in parsed["storage"].get("wiredTiger", {}).get("engineConfig", {})
        assert "oplogSizeMB" not in parsed["replication"]
        # mongod's default oplog on Linux: 5 % of the free disk, at least 990 MB (its
        # cache, at least 256 MB, cannot be told from an explicit 0.25 GB by its size).
        assert oplog >= 990 * 2**20


def test_single_node_is_a_primary_that_accepts_majority_writes(single: MongoReplicaSet) -> None:
    assert single.primary() is single.nodes[0]
    assert single.url == f"mongodb://127.0.0.1:{single.nodes[0].port}/?replicaSet=harness"
    with _client(single.url) as client:
        hello = client.admin.command("hello")
        assert hello["setName"] == "harness"
        assert hello["isWritablePrimary"]
        collection = client.harness.get_collection("writes", write_concern=MAJORITY)
        assert collection.insert_one({"n": 1}).acknowledged
        majority = client.harness.get_collection("writes", read_concern=ReadConcern("majority"))
        assert majority.count_documents({"n": 1}) >= 1


def test_mongolock_url_is_a_replica_set(mongolock_url: str, mongolock_database: str) -> None:
    assert mongolock_database.startswith("mongolock_test_")
    with _client(mongolock_url) as client:
        assert client.admin.command("hello").get("setName")
        collection = client[mongolock_database].get_collection("probe", write_concern=MAJORITY)
        collection.insert_one({"ok": True})


def test_kill_and_restart_keep_majority_writes() -> None:
    with MongoReplicaSet(name="restart") as replica_set:
        node = replica_set.nodes[0]
        with _client(replica_set.url) as client:
            client.kept.get_collection("docs", write_concern=MAJORITY).insert_one({"_id": 1})
        replica_set.kill(node, signal.SIGSTOP)
        with pytest.raises(ReplicaSetError, match="no writable primary"):
            replica_set.primary(timeout=0.2)
        replica_set.kill(node, signal.SIGCONT)
        assert replica_set.primary() is node
        replica_set.kill(node, signal.SIGSTOP)
        replica_set.kill(node, signal.SIGTERM)  # resumed first, or it would never exit
        assert node.process is not None
        assert node.process.returncode == 0  # a clean shutdown
        replica_set.restart(node)
        replica_set.kill(node, signal.SIGKILL)
        assert not node.running
        with pytest.raises(ReplicaSetError, match="not running"):
            replica_set.kill(node)
        assert replica_set.restart(node) is node
        assert replica_set.primary() is node
        with _client(replica_set.url) as client:
            assert client.kept.docs.find_one({"_id": 1}) == {"_id": 1}


def test_stop_leaves_no_process_and_no_temp_dir() -> None:
    replica_set = MongoReplicaSet(name="stopping").start()
    node = replica_set.nodes[0]
    assert replica_set.start() is replica_set  # idempotent
    replica_set.kill(node, signal.SIGSTOP)  # even a frozen node is stopped
    assert node.paused
    with pytest.raises(ReplicaSetError, match="no writable primary"):
        replica_set.primary(timeout=0.2)
    replica_set.stop()
    assert _gone(node)
    assert not os.path.exists(node.dbpath)
    assert _mongod_pids(node.dbpath) == []
    replica_set.stop()  # idempotent


def test_kept_dbpath_is_reused_even_on_another_port(tmp_path: Path) -> None:
    dbpath = tmp_path / "data"
    with MongoReplicaSet(name="kept", dbpaths=[dbpath]) as replica_set:
        first_port = replica_set.nodes[0].port
        with _client(replica_set.url) as client:
            client.kept.get_collection("docs", write_concern=MAJORITY).insert_one({"_id": 1})
    assert (dbpath / "mongod.log").exists()  # a given dbpath is kept
    other_port = next(port for port in iter(free_port, None) if port != first_port)
    replica_set = MongoReplicaSet(name="kept", dbpaths=[dbpath], ports=[other_port])
    for _ in range(2):  # a stopped set starts again
        with replica_set, _client(replica_set.url) as client:
            assert client.kept.docs.find_one({"_id": 1}) == {"_id": 1}
    with pytest.raises(ReplicaSetError, match="holds replica set 'kept'"):
        MongoReplicaSet(name="renamed", dbpaths=[dbpath]).start()
    assert _mongod_pids(str(dbpath)) == []


def test_a_taken_port_fails_with_the_log_tail() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        replica_set = MongoReplicaSet(name="taken", ports=[port])
        with pytest.raises(ReplicaSetError, match="Address already in use"):
            replica_set.start()
    node = replica_set.nodes[0]
    assert _gone(node)
    assert not os.path.exists(node.dbpath)


# -- MongoReplicaSet, three nodes ---------------------------------------------------------------


def test_three_nodes_elect_a_new_primary_after_step_down_and_kill() -> None:
    with MongoReplicaSet(3, name="trio") as replica_set:
        first = replica_set.primary()
        assert first is replica_set.nodes[0]
        with _client(replica_set.url) as client:
            docs = client.trio.get_collection("docs", write_concern=MAJORITY)
            docs.insert_one({"_id": "before"})

            assert replica_set.step_down(60) is first
            second = replica_set.primary()
            assert second is not first
            docs.insert_one({"_id": "after step-down"})

            replica_set.kill(second, signal.SIGKILL)
            third = replica_set.primary()
            assert third not in (first, second)  # the first may not stand for 60 s
            docs.insert_one({"_id": "after kill"})

            replica_set.restart(second)
            majority = client.trio.get_collection("docs", read_concern=ReadConcern("majority"))
            assert {doc["_id"] for doc in majority.find()} == {
                "before",
                "after step-down",
                "after kill",
            }
        nodes = list(replica_set.nodes)
    assert all(_gone(node) for node in nodes)
    assert not any(os.path.exists(node.dbpath) for node in nodes)


# -- the pytest fixtures, seen from a pytest run of their own -----------------------------------


def test_fixtures_in_a_pytest_session(tmp_path: Path, mongolock_url: str) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "inner_settings.py").write_text(
        'SECRET_KEY = "inner"\nINSTALLED_APPS: list[str] = []\nMONGOLOCK = {"TTL": 7}\n'
    )
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import os
            from pathlib import Path

            from django.conf import settings
            from pymongo import MongoClient

            from django_mongolock import LockManager

            SEEN = Path(os.environ["SEEN_FILE"])


            def test_first(
                mongolock_url, mongolock_database, mongolock_manager, mongolock_settings
            ):
                assert settings.MONGOLOCK == {
                    "TTL": 7, "URL": mongolock_url, "DATABASE": mongolock_database
                }
                assert mongolock_settings == settings.MONGOLOCK
                assert isinstance(mongolock_manager, LockManager)
                with MongoClient(mongolock_url) as client:
                    client[mongolock_database].probe.insert_one({})
                SEEN.write_text(mongolock_database)


            def test_second(mongolock_url, mongolock_database):
                assert settings.MONGOLOCK == {"TTL": 7}
                first = SEEN.read_text()
                assert first != mongolock_database
                with MongoClient(mongolock_url) as client:
                    assert first not in client.list_database_names()
            """
        )
    )
    env = {
        **os.environ,
        "MONGOLOCK_TEST_URL": mongolock_url,
        "DJANGO_SETTINGS_MODULE": "inner_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "SEEN_FILE": str(tmp_path / "seen"),
    }
    plugins = ["no:mongolock", "django_mongolock.testing", "no:randomly", "no:cacheprovider"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *(f"-p{p}" for p in plugins), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


# -- python -m django_mongolock.testing serve ---------------------------------------------------


def _read_url(process: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if selector.select(timeout=0.5):
                line = process.stdout.readline()
                if line.startswith("MONGOLOCK_URL="):
                    return line.removeprefix("MONGOLOCK_URL=").strip()
                assert line, f"serve ended early: {process.communicate()}"
    raise AssertionError("serve printed no URL")


def _serve(*args: str) -> subprocess.Popen[str]:
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.Popen(
        [sys.executable, "-m", "django_mongolock.testing", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_serve_keeps_its_data_and_stops_on_sigint_and_sigterm(tmp_path: Path) -> None:
    dbpath = str(tmp_path / "db")
    for sig in (signal.SIGTERM, signal.SIGINT):
        port = free_port()
        process = _serve("--port", str(port), "--dbpath", dbpath, "--replset", "served")
        try:
            url = _read_url(process)
            assert url == f"mongodb://127.0.0.1:{port}/?replicaSet=served"
            with _client(url) as client:
                docs = client.served.get_collection("docs", write_concern=MAJORITY)
                docs.insert_one({"signal": int(sig)})
                assert docs.count_documents({}) == (1 if sig == signal.SIGTERM else 2)
            process.send_signal(sig)
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:  # pragma: no cover - only when the test fails
                process.kill()
            process.communicate()
        assert _mongod_pids(dbpath) == []


def test_serve_in_process_stops_on_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    """The same command, run here so that coverage sees it; a thread plays the operator,
    and stops it once it has printed its URL (it prints it when its server is ready)."""
    port = free_port()
    url = f"MONGOLOCK_URL=mongodb://127.0.0.1:{port}/?replicaSet=inproc\n"
    # capsys's stdout (pytest's CaptureIO, a TextIOWrapper over a BytesIO, not a StringIO)
    # keeps what serve prints until the test reads it: getvalue() reads without taking.
    printed = cast("io.StringIO", sys.stdout).getvalue
    ended = threading.Event()

    def operator() -> None:
        while not ended.wait(0.05):
            if url in printed():  # serve's handler is in place: it printed
                os.kill(os.getpid(), signal.SIGTERM)
                return

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    try:
        code = testing.main(["serve", "--port", str(port), "--replset", "inproc"])
    finally:
        ended.set()  # serve failed, or stopped: nothing more to stop
    thread.join(timeout=10)
    assert code == 0
    assert signal.getsignal(signal.SIGTERM) == before
    assert capsys.readouterr().out == url


def test_serve_reports_a_failed_start(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert testing.main(["serve", "--port", str(port)]) == 1
    assert "Address already in use" in capsys.readouterr().err
