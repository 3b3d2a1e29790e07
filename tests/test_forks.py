"""The process id every fork check reads (``forks.pid``) follows each fork, before the
fork hooks that read it run."""

from __future__ import annotations

import os
from collections.abc import Callable

from django_mongolock import forks
from django_mongolock.deadlines import get_deadlines
from django_mongolock.refresher import get_refresher


def _in_child(check: Callable[[], bool]) -> int:
    """Run ``check`` in a forked child; its exit code: 0 if it held, 1 if not, 2 if it
    raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_the_id_is_this_process_s_and_a_child_s_own() -> None:
    parent = os.getpid()
    assert forks.pid() == parent
    assert _in_child(lambda: forks.pid() == os.getpid() != parent) == 0
    assert forks.pid() == parent


def test_a_grandchild_reads_its_own_id() -> None:
    parent = os.getpid()
    grandchild = lambda: forks.pid() == os.getpid() != parent  # noqa: E731
    assert _in_child(lambda: _in_child(grandchild) == 0 and forks.pid() == os.getpid()) == 0


def test_the_hooks_registered_after_it_see_the_child_s_id() -> None:
    seen: list[int] = []
    os.register_at_fork(after_in_child=lambda: seen.append(forks.pid()))
    assert _in_child(lambda: seen[-1] == os.getpid()) == 0


def test_a_child_gets_services_of_its_own() -> None:
    refresher, deadlines = get_refresher(), get_deadlines()
    assert _in_child(lambda: get_refresher() is not refresher) == 0
    assert _in_child(lambda: get_deadlines() is not deadlines) == 0
    assert get_refresher() is refresher
    assert get_deadlines() is deadlines
