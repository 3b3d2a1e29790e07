"""``make demo`` end to end: a living dashboard, then Ctrl+C stops every process it started.

The demo runs as a terminal would run it: in a session of its own, interrupted by SIGINT to
its process group. It starts its own ``mongod`` (on a free port, data in a temp dir), so
the test also proves that this server is stopped again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from django_mongolock import LockManager
from django_mongolock.info import LockInfo
from testproject.demo_workers import (
    CRASH_KEY,
    ELECTION_KEY,
    HANDOFF_KEYS,
    SEMAPHORE_KEY,
    STUCK_KEY,
    AdminClient,
)
from tests.utils import ROOT

STARTED_WITHIN = 120.0
"""Seconds for MongoDB, the migrations and the workers: generous, the machine may be busy."""
LIVING_WITHIN = 60.0
STOPPED_WITHIN = 45.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Output:
    """Everything the demo (and every child sharing its stdout) writes, read as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.stream = process.stdout
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    @property
    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                match = re.search(pattern, "".join(self.lines))
                if match:
                    return match
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    raise AssertionError(f"no {pattern!r} in the demo's output:\n{self.text}")
                self.changed.wait(min(left, 1.0))


def processes() -> Iterator[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every process, from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        if fields[0] != b"Z":
            yield int(entry.name), int(fields[1]), command


def descendants(root: int) -> dict[int, str]:
    children: dict[int, list[tuple[int, str]]] = {}
    for pid, parent, command in processes():
        children.setdefault(parent, []).append((pid, command))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, command in children.get(todo.pop(), []):
            found[pid] = command
            todo.append(pid)
    return found


def mentioning(*marks: str) -> dict[int, str]:
    """Live processes whose command line names one of ``marks`` (this demo's port, data)."""
    return {pid: cmd for pid, _, cmd in processes() if any(mark in cmd for mark in marks)}


def living(locks: list[LockInfo]) -> set[str]:
    """What the dashboard shows at one moment, among what a newcomer should see."""
    by_key = {info.key: info for info in locks}
    seen = set()
    if any(info.live and info.owner for info in locks):
        seen.add("live")
    if any(info.live and info.waiting for key in HANDOFF_KEYS if (info := by_key.get(key))):
        seen.add("waiting")
    if (info := by_key.get(CRASH_KEY)) and not info.live:
        seen.add("expired")
    if (info := by_key.get(SEMAPHORE_KEY)) and info.live_holders:
        seen.add("semaphore holder")
    if (info := by_key.get(ELECTION_KEY)) and info.live and info.kind == "election":
        seen.add("leader")
    return seen


LIVING = {"live", "waiting", "expired", "semaphore holder", "leader"}


def wait_until_living(url: str, database: str, wanted: set[str] = LIVING) -> set[str]:
    """Poll the lock collection until one look at it shows all of ``wanted``."""
    best: set[str] = set()
    with LockManager(url, database=database, refresh=False) as manager:
        deadline = time.monotonic() + LIVING_WITHIN
        while time.monotonic() < deadline:
            seen = living(manager.list("all", limit=None))
            if wanted <= seen:
                return seen
            best = max(best, seen, key=len)
            time.sleep(0.5)
    raise AssertionError(f"within {LIVING_WITHIN:g}s the dashboard showed at most {best}")


ON_THE_LIST = ('mongolock-state-expired">expired', "(leader)", "(semaphore ", "handoff-")
"""An expired lock, the leader, the semaphore, a lock handed over: what the list page shows."""


def page_shows(admin: AdminClient, path: str, *texts: str) -> set[str]:
    """The ``texts`` found on one load of the page, waiting (bounded) for one with them all."""
    deadline = time.monotonic() + LIVING_WITHIN
    while True:
        page = admin.get(path)
        found = {text for text in texts if text in page}
        if found == set(texts) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@dataclass
class Demo:
    process: subprocess.Popen[str]
    output: Output
    port: int
    marks: tuple[str, ...]
    """What the command lines of this demo's processes, and no others, contain."""

    def left(self) -> dict[int, str]:
        return mentioning(*self.marks)

    def stop(self, signum: int) -> int:
        """Signal the demo's process group, as a terminal does; its exit code."""
        os.killpg(self.process.pid, signum)
        code = self.process.wait(STOPPED_WITHIN)
        self.output.thread.join(10.0)  # the end of the output: no child holds the pipe any more
        assert not self.output.thread.is_alive()
        return code


@contextlib.contextmanager
def running_demo(tmp_path: Path, **env: str) -> Iterator[Demo]:
    """``scripts/demo.py`` on a free port, its SQLite and MongoDB data in ``tmp_path``."""
    port = free_port()
    dbpath = tmp_path / "mongodb"
    environ = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    environ.pop("MONGOLOCK_URL", None)
    environ.pop("MONGOLOCK_DATABASE", None)
    environ.update(env, PYTHONUNBUFFERED="1")
    command = [sys.executable, "scripts/demo.py", "--port", str(port)]
    command += ["--dbpath", str(dbpath), "--mongo-port", "0"]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    marks = (f"127.0.0.1:{port}", str(dbpath), *env.values())
    demo = Demo(process, Output(process), port, marks)
    try:
        yield demo
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in demo.left():  # never leave strays behind, even when the test failed
            os.kill(pid, signal.SIGKILL)
        demo.output.thread.join(10.0)
        demo.output.stream.close()
        print(demo.output.text)  # shown when the test fails


def test_a_living_dashboard_until_ctrl_c_stops_everything(tmp_path: Path) -> None:
    with running_demo(tmp_path) as demo:
        output = demo.output
        url = output.wait_for(r"==> MONGOLOCK_URL=(mongodb://\S+)", STARTED_WITHIN)[1]
        output.wait_for(r"Quit the server with", STARTED_WITHIN)

        assert wait_until_living(url, "mongolock_demo") == LIVING
        # The list page says the same to a logged-in admin.
        admin = AdminClient(f"http://127.0.0.1:{demo.port}/admin/", "admin", "admin")
        admin.login()
        assert page_shows(admin, "django_mongolock/lock/", *ON_THE_LIST) == set(ON_THE_LIST)
        # The operator force-releases the stuck import in the admin; its holder learns of it.
        output.wait_for(rf"{re.escape(STUCK_KEY)}: importer-\d \(pid \d+\) lost its lock", 60.0)
        assert STUCK_KEY in admin.get("")  # the force release, in the admin's recent actions

        started = descendants(demo.process.pid)
        assert sum("/mongod " in command for command in started.values()) == 1, started
        assert sum("testproject.demo_workers" in command for command in started.values()) >= 9
        assert any("runserver" in command for command in started.values())

        assert demo.stop(signal.SIGINT) == 0  # what Ctrl+C in a terminal does
        assert "Traceback" not in output.text
        assert "==> stopping MongoDB" in output.text
        assert output.text.rstrip().endswith("==> demo stopped")
        left = demo.left()
        left.update({pid: cmd for pid, _, cmd in processes() if started.get(pid) == cmd})
        assert left == {}
        host, port = re.findall(r"mongodb://([\d.]+):(\d+)", url)[0]
        with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port))):
            pass


def test_sigterm_with_mongolock_url_gives_back_the_locks_and_leaves_the_server(
    tmp_path: Path, mongolock_url: str, mongolock_database: str
) -> None:
    env = {"MONGOLOCK_URL": mongolock_url, "MONGOLOCK_DATABASE": mongolock_database}
    with running_demo(tmp_path, **env) as demo:
        demo.output.wait_for(r"Quit the server with", STARTED_WITHIN)
        with LockManager(mongolock_url, database=mongolock_database, refresh=False) as manager:
            assert {"live", "semaphore holder"} <= wait_until_living(
                mongolock_url, mongolock_database, {"live", "semaphore holder"}
            )
            assert demo.stop(signal.SIGTERM) == 0
            assert "Traceback" not in demo.output.text
            assert "==> stopping MongoDB" not in demo.output.text
            assert demo.left() == {}
            # The workers gave their locks back (the killed holder's lapses by itself); the
            # server given by the URL still serves.
            live = [info.key for info in manager.list("live", limit=None)]
            assert [key for key in live if key != CRASH_KEY] == []
