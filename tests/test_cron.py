"""Cron bursts: the same management command started on 8 "hosts" at the same instant.

Eight real processes are started together (each sleeps until one shared instant, then
execs ``python -m django <command>``, as cron on eight synchronised hosts would); the
first to take the lock runs, and it holds its run open until the seven others have
exited, so "exactly once" does not depend on how long a run takes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from django_mongolock import BUSY_EXIT_CODE
from tests.utils import ROOT, finished

HOSTS = 8
# Sleep until the shared instant, note the time it woke, then become the command (no new
# process: the same pid).
LAUNCH = (
    "import os, sys, time; time.sleep(max(0.0, float(sys.argv[1]) - time.time())); "
    "f = open(os.environ['CRON_STARTS'], 'a'); f.write(f'{time.time()!r}\\n'); f.close(); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
# The burst's processes all start within this (cron on eight hosts with synchronised clocks;
# here, the wake-ups of eight sleeping launchers, generous for a loaded machine).
SPREAD = 1.5


@pytest.fixture
def runs(mongolock_url: str, mongolock_database: str) -> Iterator[Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url)
    yield client[mongolock_database]["runs"]
    client.close()


def burst(command: str, url: str, database: str, starts: Path) -> list[subprocess.Popen[str]]:
    env = {
        "CRON_STARTS": str(starts),
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.cron_settings",
        "MONGOLOCK_URL": url,
        "MONGOLOCK_DATABASE": database,
    }
    at = time.time() + 3.0  # every launcher is asleep by then, even on a busy machine
    argv = [sys.executable, "-c", LAUNCH, repr(at), "-m", "django", command, "--no-color"]
    return [
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(HOSTS)
    ]


def run_burst(
    command: str, url: str, database: str, runs: Any, starts: Path
) -> tuple[dict[str, Any], tuple[int, str, str], list[tuple[int, str, str]]]:
    """Start the burst, let the run end once the others are done; (run, holder, others)."""
    runs.insert_one({"_id": "hold"})
    processes = burst(command, url, database, starts)
    try:
        ends = time.monotonic() + 90
        while sum(process.poll() is not None for process in processes) < HOSTS - 1:
            assert time.monotonic() < ends, "the busy processes did not exit"
            time.sleep(0.05)
        started = list(runs.find({"job": command}))
        assert len(started) == 1, started  # exactly one ran, and it is still running
        run = started[0]
        running = [process for process in processes if process.poll() is None]
        assert [process.pid for process in running] == [run["pid"]]
        runs.delete_one({"_id": "hold"})
        results = {process.pid: finished(process)[1:] for process in processes}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    codes = {process.pid: process.returncode for process in processes}
    holder = (codes[run["pid"]], *results[run["pid"]])
    others = [(codes[pid], *results[pid]) for pid in codes if pid != run["pid"]]
    assert runs.count_documents({"job": command}) == 1  # and nobody ran after it
    woke = [float(line) for line in starts.read_text().split()]
    assert len(woke) == HOSTS
    assert max(woke) - min(woke) <= SPREAD, f"the burst spread over {max(woke) - min(woke):.3f}s"
    return run, holder, others


def test_a_burst_runs_once_and_the_others_exit_75_in_one_line(
    mongolock_url: str, mongolock_database: str, runs: Any, tmp_path: Path
) -> None:
    run, holder, others = run_burst(
        "cron_report", mongolock_url, mongolock_database, runs, tmp_path / "starts"
    )
    assert holder == (0, "", "")
    assert len(others) == HOSTS - 1
    owner = re.compile(rf"[^\s:]+:{run['pid']}:[0-9a-f]+")
    for code, out, err in others:
        assert (code, out) == (BUSY_EXIT_CODE, "")
        assert err.count("\n") == 1, err
        assert err.startswith("CommandError: cron_report: not run; lock 'cron-report' is held by ")
        assert owner.search(err), err
        assert err.endswith(f"Exit status {BUSY_EXIT_CODE} means busy: try again later.\n")


def test_a_burst_with_skip_runs_once_and_the_others_exit_0_in_one_line(
    mongolock_url: str, mongolock_database: str, runs: Any, tmp_path: Path
) -> None:
    run, holder, others = run_burst(
        "cron_report_skip", mongolock_url, mongolock_database, runs, tmp_path / "starts"
    )
    assert holder == (0, "", "")
    owner = re.compile(rf"[^\s:]+:{run['pid']}:[0-9a-f]+")
    for code, out, err in others:
        assert (code, err) == (0, "")
        assert out.count("\n") == 1, out
        assert out.startswith("cron_report_skip: skipped; lock 'cron-report' is held by ")
        assert owner.search(out), out
