"""The demo's background workers: real processes that take, hand over, lose and abandon locks.

``make demo`` starts one process per worker (``python -m testproject.demo_workers ROLE ...``)
so that the admin dashboard shows a living system: keys handed over with waiters in line, a
semaphore partly full, an election whose leader changes, a holder killed so that its lock
expires, and a stuck job whose lock an operator force-releases in the admin, so that the job
finds its lock lost. Every worker uses the public API only, stops on SIGTERM or SIGINT (or
when the demo that started it is gone), and gives back what it holds before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import http.cookiejar
import os
import random
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from html.parser import HTMLParser
from types import FrameType
from typing import Any

from django_mongolock import Election, LockManager, MongoLockError

STOP = threading.Event()
"""Set on SIGTERM/SIGINT or when the demo is gone: every loop ends and gives back its locks."""

CAMPAIGN_SETTLES = 1.0
"""Seconds a stopped candidate keeps its manager open for a campaign still under way."""

# What each worker does, with the keys the dashboard shows.
HANDOFF_KEYS = ("orders/sync", "invoices/daily")
SEMAPHORE_KEY, SEMAPHORE_LIMIT = "exports", 4
ELECTION_KEY = "scheduler"
CRASH_KEY = "cleanup/nightly"
STUCK_KEY = "imports/customers"


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def pause(low: float, high: float) -> bool:
    """Sleep a random while; True when the worker should stop."""
    return STOP.wait(random.uniform(low, high))


def _stop(signum: int, frame: FrameType | None) -> None:
    STOP.set()


def _watch_parent(parent: int) -> None:
    """Stop when the demo that started this worker is gone (it was killed, say)."""
    while not STOP.wait(1.0):
        if os.getppid() != parent:
            STOP.set()


async def take_turns(
    manager: LockManager,
    key: str,
    hold: tuple[float, float],
    rest: tuple[float, float],
    **acquire: Any,
) -> None:
    """Wait in line for ``key``, hold it a while (the work), let go, rest, queue again.

    It waits without a timeout, woken by the release; stopping cancels the wait, and a
    cancelled wait takes nothing.
    """
    while True:
        try:
            async with manager.alock(key, ttl=30, **acquire):
                await asyncio.sleep(random.uniform(*hold))  # the work, fenced by its token
        except MongoLockError as exc:
            say(f"{key}: {exc}; retrying")
        await asyncio.sleep(random.uniform(*rest))


def run_until_stopped(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run the coroutines until STOP is set; then cancel them, which gives their locks back."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, STOP.set)
        tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
        await asyncio.to_thread(STOP.wait)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# -- the roles -----------------------------------------------------------------------------------


def handoff(manager: LockManager, args: argparse.Namespace) -> None:
    """Hand each key over to the next worker in line every 6 to 10 s."""
    run_until_stopped(*(take_turns(manager, key, (6.0, 10.0), (0.5, 1.5)) for key in HANDOFF_KEYS))


def semaphore(manager: LockManager, args: argparse.Namespace) -> None:
    """Three exporters share a semaphore of four slots: it is never full, rarely empty."""
    run_until_stopped(
        *(
            take_turns(
                manager, SEMAPHORE_KEY, (6.0, 12.0), (0.5, 2.0), shared=True, limit=SEMAPHORE_LIMIT
            )
            for _ in range(3)
        )
    )


def candidate(manager: LockManager, args: argparse.Namespace) -> None:
    """Campaign for leadership; step down after a term of 20 to 35 s, rest, campaign again."""
    name = manager.owner

    def elected(election: Election) -> None:
        say(f"{ELECTION_KEY}: {name} (pid {os.getpid()}) is the leader, token {election.token}")

    while not STOP.is_set():
        election = manager.elect(ELECTION_KEY, ttl=20, on_elected=elected)
        term_ends: float | None = None
        while not STOP.wait(0.5):
            if not election.is_leader:
                term_ends = None
            elif term_ends is None:
                term_ends = time.monotonic() + random.uniform(20.0, 35.0)
            elif time.monotonic() >= term_ends:
                say(f"{ELECTION_KEY}: {name} steps down")
                break
        election.stop()
        pause(4.0, 6.0)  # lets another candidate win the next term
    # stop() does not wait for a campaign already under way on the refresher's thread; one
    # that wins after stop() gives the lock back at once, which needs the manager still open.
    time.sleep(CAMPAIGN_SETTLES)


def crash(manager: LockManager, args: argparse.Namespace) -> None:
    """Take a lock, then die by SIGKILL: the lock is never released and expires."""
    try:
        lock = manager.acquire(CRASH_KEY, ttl=5, timeout=10)
    except MongoLockError as exc:  # LockNotAcquired included
        say(f"{CRASH_KEY}: {exc}")
        return
    say(
        f"{CRASH_KEY}: pid {os.getpid()} took the lock (token {lock.token}) and is killed "
        "(SIGKILL) mid-job; its lock expires within 5 s and is kept, as expired, until "
        "the TTL index purges it"
    )
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def importer(manager: LockManager, args: argparse.Namespace) -> None:
    """A job that hangs while holding its lock, until an operator force-releases it."""
    run_until_stopped(hang(manager))


async def hang(manager: LockManager) -> None:
    """Hold the stuck import's lock for up to 90 s, or until it is lost; then queue again."""
    name = manager.owner
    while True:
        try:
            async with manager.alock(STUCK_KEY, ttl=30) as lock:
                # Hung: it neither finishes nor lets go; its lease is refreshed meanwhile.
                for _ in range(180):
                    if lock.lost.is_set():
                        say(
                            f"{STUCK_KEY}: {name} (pid {os.getpid()}) lost its lock, token "
                            f"{lock.token}: it stops; a write fenced with that token would be "
                            "refused"
                        )
                        break
                    await asyncio.sleep(0.5)
        except MongoLockError as exc:
            say(f"{STUCK_KEY}: {exc}; retrying")
        await asyncio.sleep(random.uniform(3.0, 5.0))


def operator(args: argparse.Namespace) -> None:
    """An operator who, now and then, force-releases the stuck import in the admin."""
    admin = AdminClient(args.admin, "admin", "admin")
    quoted = STUCK_KEY.replace("/", "_2F")  # the admin's quote() of the key
    if STOP.wait(args.first):
        return
    while not STOP.is_set():
        try:
            admin.login()
            fields = admin.form(f"django_mongolock/lock/{quoted}/release/")
            if "token" in fields:
                # The importer's process is alive (it sends heartbeats): confirm anyway.
                fields["confirm_alive"] = f"{fields['token']}:{STUCK_KEY}"
                fields["reason"] = "the import hangs"
                admin.post(f"django_mongolock/lock/{quoted}/release/", fields)
                say(
                    f"{STUCK_KEY}: the operator force-released it in the admin (token "
                    f"{fields['token']}); the next importer in line takes it"
                )
        except (OSError, ValueError) as exc:  # the server is not up yet, or going down
            if not STOP.is_set():
                say(f"operator: {exc}")
        STOP.wait(args.every)


# -- a logged-in admin session, for the operator and the demo's test ------------------------------


class _Form(HTMLParser):
    """The named inputs of the page's ``method="post"`` forms."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}
        self._in_post = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "form":
            self._in_post = (values.get("method") or "").lower() == "post"
        elif tag == "input" and self._in_post and values.get("name"):
            self.fields[values["name"] or ""] = values.get("value") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._in_post = False


class AdminClient:
    """A browser-like session of the Django admin: cookies, CSRF, login."""

    def __init__(self, base: str, username: str, password: str, timeout: float = 10.0) -> None:
        self.base = base.rstrip("/") + "/"
        self.username = username
        self.password = password
        self.timeout = timeout
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=self.timeout) as response:
            text: str = response.read().decode()
            return text

    def form(self, path: str) -> dict[str, str]:
        parser = _Form()
        parser.feed(self.get(path))
        return parser.fields

    def post(self, path: str, fields: dict[str, str]) -> str:
        body = urllib.parse.urlencode(fields).encode()
        request = urllib.request.Request(
            self.base + path, data=body, headers={"Referer": self.base + path}
        )
        with self.opener.open(request, timeout=self.timeout) as response:
            text: str = response.read().decode()
            return text

    def login(self) -> None:
        """Log in unless the session still is; ValueError when refused."""
        fields = self.form("login/?next=/admin/")
        if "username" not in fields:
            return  # already logged in: the login page redirected to the index
        fields.update(username=self.username, password=self.password)
        page = self.post("login/?next=/admin/", fields)
        if 'id="login-form"' in page:
            raise ValueError(f"the admin refused the login of {self.username!r}")


# -- the command line ----------------------------------------------------------------------------

ROLES: dict[str, Callable[[LockManager, argparse.Namespace], None]] = {
    "handoff": handoff,
    "semaphore": semaphore,
    "candidate": candidate,
    "crash": crash,
    "importer": importer,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testproject.demo_workers")
    parser.add_argument("role", choices=[*ROLES, "operator"])
    parser.add_argument("--name", required=True, help="owner prefix shown in the admin")
    parser.add_argument("--url", help="the MongoDB URL (default: $MONGOLOCK_URL)")
    parser.add_argument("--database", default="mongolock_demo")
    parser.add_argument("--admin", default="http://127.0.0.1:8000/admin/", help="operator")
    parser.add_argument("--first", type=float, default=8.0, help="operator: first release")
    parser.add_argument("--every", type=float, default=20.0, help="operator: then every")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the demo asks a stuck worker
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.role == "operator":
        operator(args)
        return 0
    url = args.url or os.environ.get("MONGOLOCK_URL")
    if not url:
        parser.error("--url or $MONGOLOCK_URL is required")
    with LockManager(url, database=args.database, owner=args.name) as manager:
        ROLES[args.role](manager, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
