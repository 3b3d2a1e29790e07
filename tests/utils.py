"""Helpers for tests: management commands run as a shell would, managers whose clients
carry a name of their own, replica sets stopped for good, who holds a re-entrant lock,
forked children reaped within a bound, a child's error output without the warnings of
a slow server."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from io import StringIO
from pathlib import Path
from typing import Any

from django.core.management import CommandError, call_command

from django_mongolock import LockManager
from django_mongolock.testing import MongoReplicaSet

# The project's root: the working directory of the test's child processes.
ROOT = Path(__file__).resolve().parent.parent

# Warnings a process logs when a background write (its heartbeat, its lock statistics)
# times out on a loaded machine: it goes on, and tries again at the next one.
_SLOW_SERVER_WARNINGS = (
    "cannot record this process's heartbeat: ",
    "could not record lock statistics: ",
)


def without_slow_server_warnings(err: str) -> str:
    """A child process's error output without the warnings of a background write that
    timed out, which say nothing about what a test of its output checks."""
    lines = err.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith(_SLOW_SERVER_WARNINGS))


def finished(process: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    """A child process's exit code, output and error output (without the warnings of a
    slow server), once it has ended; within ``timeout`` seconds."""
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, without_slow_server_warnings(err)


def run_command(*args: str, **options: Any) -> tuple[str, str, int]:
    """Run a management command; return (stdout, stderr, exit code) like a shell would."""
    out, err = StringIO(), StringIO()
    try:
        call_command(*args, stdout=out, stderr=err, no_color=True, **options)
    except CommandError as exc:
        err.write(str(exc))
        return out.getvalue(), err.getvalue(), exc.returncode
    return out.getvalue(), err.getvalue(), 0


class NamedManager(LockManager):
    """A manager whose clients, sync and async, carry the app name ``app``: what a
    server fail point can be limited to, so that other clients never meet it."""

    def __init__(self, *args: Any, app: str, **kwargs: Any) -> None:
        self.app = app
        super().__init__(*args, **kwargs)

    def _client_options(self) -> dict[str, Any]:
        return {**super()._client_options(), "appname": self.app}


def stop_and_check(replica_set: MongoReplicaSet) -> None:
    """Stop the set and fail if any of its mongod processes is still alive."""
    replica_set.stop()
    alive = [
        node.address
        for node in replica_set.nodes
        if node.process is not None and node.process.poll() is None
    ]
    assert not alive, f"mongod left running: {alive}"


def held_here(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock`` (another thread's hold is not this one's): a
    condition on it may notify only in the thread that holds it."""
    try:
        threading.Condition(lock).notify()
    except RuntimeError:
        return False
    return True


def answer_of(read: int, pid: int, within: float = 30.0) -> tuple[str | None, int]:
    """A forked child's answer on the pipe ``read`` (None if it wrote nothing within
    ``within`` seconds) and its exit code (``reap``); the pipe is closed after."""
    try:
        ready, _, _ = select.select([read], [], [], within)
        answer = os.read(read, 4096).decode() if ready else None
    finally:
        os.close(read)
        code = reap(pid, 10.0)
    return answer, code


def reap(pid: int, grace: float) -> int:
    """A forked child's exit code. A child that has answered may not have reached its
    ``os._exit`` yet, so it gets ``grace`` seconds to end; one still running after
    that is killed."""
    deadline = time.monotonic() + grace
    done, status = os.waitpid(pid, os.WNOHANG)
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
