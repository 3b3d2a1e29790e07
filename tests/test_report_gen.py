"""The demo command ``report_gen`` (``@locked("report-gen")``): one run at a time, anywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from pytest_django.fixtures import Settings

from django_mongolock import BUSY_EXIT_CODE, LockManager, locks
from tests.utils import ROOT, finished, run_command

pytestmark = pytest.mark.usefixtures("mongolock_settings")


def test_runs_under_the_lock_and_prints_its_token(lock_events: list[tuple[str, Any]]) -> None:
    out, err, code = run_command("report_gen", "--seconds", "0.1")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    lock = lock_events[0][1]
    assert lines[0] == (
        f"report-gen: holding lock 'report-gen' as {lock.owner}, fencing token {lock.token}"
    )
    assert lines[1] == "  [##..................] step 1/10"
    assert lines[10] == "  [####################] step 10/10"
    assert lines[11] == f"report-gen: done (token {lock.token})"
    assert [name for name, _ in lock_events] == ["acquired", "released"]
    assert locks.status("report-gen") is None


def test_busy_exits_75_naming_the_holder(other: LockManager) -> None:
    with other.lock("report-gen", ttl=30) as holder:
        out, err, code = run_command("report_gen", "--seconds", "0")
        assert code == BUSY_EXIT_CODE
        assert out == ""
        assert err.startswith(f"report_gen: not run; lock 'report-gen' is held by {holder.owner}")
        # Errors are shown whatever the verbosity.
        assert run_command("report_gen", "-v", "0")[1:] == (err, BUSY_EXIT_CODE)


def test_stops_when_the_lock_is_lost(
    mongolock_settings: dict[str, Any], settings: Settings, other: LockManager
) -> None:
    # A short lease, so that the background refresher notices the loss within a second.
    settings.MONGOLOCK = {**mongolock_settings, "TTL": 0.9}
    result: list[tuple[str, str, int]] = []
    worker = threading.Thread(
        target=lambda: result.append(run_command("report_gen", "--seconds", "20"))
    )
    worker.start()
    deadline = time.monotonic() + 10
    while other.status("report-gen") is None:
        assert time.monotonic() < deadline, "report_gen did not take its lock"
        time.sleep(0.02)
    assert other.force_release("report-gen") is not None
    worker.join(10)
    assert not worker.is_alive()
    out, err, code = result[0]
    assert code == 1
    assert "report-gen: lost the lock 'report-gen' at step" in err
    assert "done" not in out


def test_two_processes_at_once_one_runs_the_other_exits_75(
    mongolock_url: str, mongolock_database: str
) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "MONGOLOCK_URL": mongolock_url,
        "MONGOLOCK_DATABASE": mongolock_database,
    }
    command = [sys.executable, "manage.py", "report_gen", "--seconds", "3", "--no-color"]
    processes = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(process, *finished(process)[1:]) for process in processes]
    codes = sorted(process.returncode for process, _, _ in results)
    assert codes == [0, BUSY_EXIT_CODE], results
    (winner, out, err), (_, busy_out, busy_err) = sorted(results, key=lambda r: r[0].returncode)

    assert err == ""
    assert out.count(" step ") == 10
    match = re.match(r"report-gen: holding lock 'report-gen' as (\S+), fencing token (\d+)", out)
    assert match is not None, out
    owner, token = match.groups()
    assert f":{winner.pid}:" in owner
    assert out.rstrip().endswith(f"report-gen: done (token {token})")

    assert busy_out == ""
    assert busy_err.startswith(
        f"CommandError: report_gen: not run; lock 'report-gen' is held by {owner} until "
    )
    assert f"Exit status {BUSY_EXIT_CODE} means busy" in busy_err
    assert locks.status("report-gen") is None
