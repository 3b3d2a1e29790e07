"""A holder whose child is forked without fork hooks: ``python -m tests.hookless_fork URL DB KEY``.

fork(2) called from libc with the GIL held runs none of Python's fork hooks in the child,
as in a uWSGI worker forked in uWSGI's default set-up. Nor does the interpreter make its
own state fit for a child: a thread of the parent that was waiting for the GIL at the fork
leaves the child a GIL it can never take back, and the child hangs at its next bytecodes.
So this holder forks as a single thread: it takes its lock, closes its manager, stops the
deadline watch, and forks once the driver's threads have ended (a bounded wait).

It prints one JSON line: its pid, the lock (owner, token), a holder id it made before the
fork, the threads it forked with, and the child's pid, exit code and answer.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

from django_mongolock import Lock, LockLost, LockManager
from django_mongolock.deadlines import get_deadlines
from tests.utils import answer_of


def fork_without_hooks() -> int:
    """fork(2) from libc with the GIL held; the child's pid (0 in the child)."""
    libc = ctypes.PyDLL(None, use_errno=True)
    pid = int(libc.fork())
    if pid < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return pid


def single_threaded(others: list[threading.Thread], timeout: float = 10.0) -> list[str]:
    """The names of this process's threads once ``others`` have ended and the system
    counts one thread left (or at ``timeout``). A thread is joined, not just gone from
    ``threading.enumerate()``, which it leaves before it lets go of the interpreter."""
    deadline = time.monotonic() + timeout
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    names = [thread.name for thread in threading.enumerate()]
    return names if len(os.listdir("/proc/self/task")) == 1 else [*names, "(a system thread)"]


def child(lock: Lock, manager: LockManager, write: int) -> None:  # pragma: no cover
    """Check, refresh and release the parent's lock; write what each said, and exit."""
    code = 0
    try:
        found = []
        for attempt in (lock.check, lock.refresh):
            try:
                attempt()
                found.append("held")
            except LockLost as lost:
                found.append(lost.reason)
        owner, released = manager.new_owner(), lock.release()
        answer = f"{owner}|{found[0]}|{found[1]}|{released}|{lock.valid}"
    except BaseException as exc:
        answer, code = repr(exc), 1
    finally:
        os.write(write, answer.encode()[:4000])
        os._exit(code)


def main(url: str, database: str, key: str) -> dict[str, object]:
    """Take ``key``, fork as one thread, and say what the child found."""
    manager = LockManager(url, database=database)
    lock = manager.acquire(key, ttl=60, refresh=False)
    parent_owner = manager.new_owner()
    others = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    manager.close()
    get_deadlines().stop()
    threads = single_threaded(others)
    found: dict[str, object] = {
        "pid": os.getpid(),
        "owner": lock.owner,
        "token": lock.token,
        "parent_owner": parent_owner,
        "threads": threads,
    }
    if len(threads) > 1:
        return found
    read, write = os.pipe()
    pid = fork_without_hooks()
    if pid == 0:  # pragma: no cover - the child
        child(lock, manager, write)
    os.close(write)
    answer, code = answer_of(read, pid)
    lock.check()  # still this process's
    return {**found, "child": pid, "code": code, "answer": answer}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])), flush=True)
