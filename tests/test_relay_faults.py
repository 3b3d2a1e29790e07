"""The shared change stream (``relay``) under faults: a leader killed or stopped, a name
held by another user, a stranger turned away, a follower too slow, a fork.

Leaders and impostors run in processes of their own (``tests.relay_agent``); every wait
is bounded. Each fault test ends by checking that a waiter is still woken by a release
through the stream its process has then (not by polling: it makes next to no attempts
while it waits), long before the holder's lease would have ended. The last two tests
check that a follower joins a leader at any moment, and that a process that fell back
leads once the name is free again.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import bson
import pytest

from django_mongolock import LockManager, relay
from django_mongolock import watcher as watching
from django_mongolock.owners import host_prefix
from tests.relay_peers import drained, hello, join
from tests.utils import ROOT, reap
from tests.waiting import LEASE, Wait, lead_and_follow, streaming_as, until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not relay.supported(), reason="the relay needs Linux's abstract sockets"),
]

# Another user: the impostors and strangers run as ``nobody``.
NOBODY = 65534


class Agent:
    """A ``tests.relay_agent`` process, its stdout read line by line."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.relay_agent", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout as out:
            for line in out:
                self._lines.put(line.strip())

    def line(self, timeout: float = 60.0) -> str:
        """Its next line of output (bounded)."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"agent {self.args[0]} said nothing in {timeout:g} s "
                f"(exit code {self.process.poll()})"
            ) from None

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(30)
        self._reader.join(30)


@pytest.fixture(autouse=True)
def _quick_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watcher that could not follow tries again after 2 s rather than 10 (the tests
    would wait out the retry when a join fails: see ``test_a_follower_joins_...``)."""
    monkeypatch.setattr(watching, "RELAY_RETRY", 2.0)


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start agents; every one is killed (and continued first, if stopped) at the end."""
    started: list[Agent] = []

    def start(*args: str) -> Agent:
        agent = Agent(*args)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.end()


@pytest.fixture
def led_by_agent(
    agents: Callable[..., Agent],
    shared: Callable[[], LockManager],
    manager: LockManager,
    mongolock_url: str,
) -> tuple[Agent, LockManager]:
    """An agent process that leads, and a manager here that follows it."""
    leading = agents("lead", mongolock_url, manager.database)
    assert leading.line() == "role leader"
    following = shared()
    following.watcher.ensure_running()
    until(streaming_as(following.watcher, "follower"), 30, "following the agent")
    return leading, following


def _where(manager: LockManager) -> relay.Place:
    """The relay of ``manager``'s collection, as its watcher finds it (this user's)."""
    assert manager.url is not None
    return relay.place(manager.url, manager.database, manager.collection, host_prefix(None))


def test_a_follower_takes_over_when_its_leader_is_killed(
    led_by_agent: tuple[Agent, LockManager], manager: LockManager
) -> None:
    leading, following = led_by_agent
    opened = following.watcher.opened

    leading.signal(signal.SIGKILL)
    leading.process.wait(30)
    # The leader's end of the connection closed with it: no silence to wait out. The
    # follower leads: at once if the dead leader's name was gone by the time it tried to
    # take it, else (the kernel may close the connection before the listener) after a
    # stream of its own until its next try (``watcher.RELAY_RETRY``).
    until(
        streaming_as(following.watcher, "leader"),
        2 * watching.RELAY_RETRY + 10,
        "leading after the leader was killed",
    )
    role = following.watcher.role
    assert following.watcher.opened in (opened + 1, opened + 2)
    assert following.watcher.leader is not None
    Wait(manager, following, "after-kill").woken_by_release(role or "")


def test_a_follower_streams_on_its_own_when_its_leader_is_stopped(
    led_by_agent: tuple[Agent, LockManager], manager: LockManager
) -> None:
    leading, following = led_by_agent
    opened = following.watcher.opened
    # A waiter that sleeps on the leader's stream when it stops.
    wait = Wait(manager, following, "across-the-stop")

    leading.signal(signal.SIGSTOP)
    try:
        took = until(
            streaming_as(following.watcher, "own"), relay.SILENCE + 20, "falling back to its own"
        )
        # Not at once: nothing told it the leader was gone but its silence, and its
        # attempt to follow again waited for an answer in vain.
        assert took > relay.HELLO_TIMEOUT
        # It could not lead (the stopped leader holds the name), nor follow (the leader
        # does not answer): a stream of its own, and it may join a relay again later.
        assert following.watcher.opened == opened + 1
        assert following.watcher.leader is None
        assert following.watcher._alone is False
        wait.woken_by_release("own")
    finally:
        leading.signal(signal.SIGCONT)
        leading.signal(signal.SIGKILL)


def test_a_name_held_by_another_user_is_never_joined(
    agents: Callable[..., Agent], shared: Callable[[], LockManager], manager: LockManager
) -> None:
    assert os.geteuid() == 0, "a process of another user needs root to start"
    # An impostor of another uid binds the name this user's relay would have, and
    # answers like a leader: a follower that trusted it would never be woken.
    where = _where(manager)
    impostor = agents(
        "listen", str(NOBODY), where.address.hex(), bson.encode({"t": "h", "ok": True}).hex()
    )
    assert impostor.line() == f"listening {NOBODY}"
    alone = shared()
    alone.watcher.ensure_running()
    until(streaming_as(alone.watcher, "own"), 30, "a stream of its own")
    assert alone.watcher._alone is True
    assert alone.watcher.leader is None
    assert alone.watcher.opened == 1
    # It connected (and found the uid), and left without a word: no hello, no prefix.
    assert impostor.line(30) == "closed 0"
    Wait(manager, alone, "foreign").woken_by_release("own")


def test_a_leader_turns_away_a_process_of_another_user(
    agents: Callable[..., Agent], shared: Callable[[], LockManager], manager: LockManager
) -> None:
    assert os.geteuid() == 0, "a process of another user needs root to start"
    leading = shared()
    leading.watcher.ensure_running()
    until(streaming_as(leading.watcher, "leader"), 30, "leading")
    leader = leading.watcher.leader
    assert leader is not None
    where = _where(leading)

    nonce = os.urandom(relay.NONCE_BYTES)
    stranger = agents("connect", str(NOBODY), where.address.hex(), hello(nonce).hex())
    # Closed without an answer (a reset: its hello was never read).
    assert stranger.line(30) in ("eof", "reset")
    assert len(leader) == 0

    # A process of this user that knows the relay secret is answered and counted.
    same, _ = join(where.address, manager.store.relay_secret())
    with same:
        until(lambda: len(leader) == 1, 10, "the follower counted")
    Wait(manager, leading, "stranger").woken_by_release("leader")


def test_a_follower_that_does_not_read_is_dropped_and_the_others_go_on(
    shared: Callable[[], LockManager], manager: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backlog of 16 KiB past the socket's buffer rather than 4 MiB: the same drop,
    # after a few hundred events rather than many thousands.
    monkeypatch.setattr(relay, "BACKLOG", 16 << 10)
    leading, following = lead_and_follow(shared)
    leader = leading.watcher.leader
    assert leader is not None

    # Only the real follower is left (a join that failed is dropped at the next beat).
    until(lambda: len(leader) == 1, 10, "one follower")
    dropped, opened = leader.dropped, following.watcher.opened
    slow, _ = join(_where(leading).address, manager.store.relay_secret())
    with slow:
        until(lambda: len(leader) == 2, 10, "the slow follower admitted")
        # Releases, each a delete event for every follower, in batches small enough for
        # the real follower's buffer: it keeps up, while the one that never reads fills up.
        batch, sent = 25, 0
        deadline = time.monotonic() + 40
        while leader.dropped == dropped:
            assert time.monotonic() < deadline, f"not dropped after {sent} events"
            for n in range(batch):
                lock = manager.acquire(f"churn-{n}", ttl=LEASE)
                assert lock.release()
            sent += batch

            def caught_up(count: int = sent) -> bool:
                return following.watcher.events >= count

            until(caught_up, 20, "the follower keeping up")
        assert leader.dropped == dropped + 1
        assert len(leader) == 1
        # The one dropped was the slow one: its connection ends after what it was sent.
        assert drained(slow, 10) > 0
    # The real follower kept its place all along: no fallback, every event.
    assert following.watcher.role == "follower"
    assert following.watcher.opened == opened
    assert following.watcher.events == sent
    assert len(leader) == 1
    Wait(manager, following, "after-drop").woken_by_release("follower")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_closes_its_copies_of_the_relay_sockets(
    shared: Callable[[], LockManager], manager: LockManager
) -> None:
    leading, following = lead_and_follow(shared)
    leader = leading.watcher.leader
    assert leader is not None
    # The listener, the leader's end of the follower's connection, and the follower's.
    inherited = {s.fileno(): os.fstat(s.fileno()).st_ino for s in relay._open if s.fileno() >= 0}
    assert len(inherited) >= 3

    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then live on until the parent is done
        code = 9
        try:
            os.close(report_r)
            os.close(go_w)
            open_objects = [s for s in list(relay._open) if s.fileno() >= 0]
            open_fds = []
            for fd, inode in inherited.items():
                try:
                    if os.fstat(fd).st_ino == inode:
                        open_fds.append(fd)
                except OSError:
                    pass
            code = 0 if not open_objects and not open_fds else 1
            os.write(report_w, bytes([code]))
            os.read(go_r, 1)  # until the parent writes or closes
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(go_r)
    try:
        ready, _, _ = select.select([report_r], [], [], 30)
        assert ready, "the child did not report"
        assert os.read(report_r, 1) == b"\0", "the child kept relay sockets open"
        # While the child lives: the leader still admits a new follower ...
        joining = shared()
        joining.watcher.ensure_running()
        until(streaming_as(joining.watcher, "follower"), 30, "a new follower")
        until(lambda: len(leader) == 2, 10, "two followers")
        # ... and once it stops leading, the name is free for another to lead: the child
        # holds no copy of the listener.
        leading.close()
        until(
            lambda: (
                {following.watcher.role, joining.watcher.role} == {"leader", "follower"}
                and following.watcher.healthy
                and joining.watcher.healthy
            ),
            30,
            "a follower leading, the other following it",
        )
    finally:
        os.close(go_w)
        os.close(report_r)
        code = reap(pid, 30.0)
    assert code == 0
    follower = following if following.watcher.role == "follower" else joining
    Wait(manager, follower, "after-fork").woken_by_release("follower")


# -- joining at any moment, and leading again once the name is free -------------------------

JOINS = 14


def test_a_follower_joins_a_healthy_leader_at_any_moment(
    agents: Callable[..., Agent],
    manager: LockManager,
    mongolock_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    leading = agents("lead", mongolock_url, manager.database)
    assert leading.line() == "role leader"
    where = _where(manager)
    codec = manager.store.collection.codec_options
    secret = manager.store.relay_secret()
    caplog.set_level(logging.DEBUG, logger="django_mongolock.relay")
    failed = 0
    # Joins spread over three heartbeats of the leader: some come when a beat is due.
    for _ in range(JOINS):
        joined = relay.Follower.join(where, "x:", codec, secret)
        if joined is None:
            failed += 1
        else:
            assert joined.healthy
            joined.close()
        time.sleep(0.1)
    reasons = {r.getMessage() for r in caplog.records if "could not follow" in r.getMessage()}
    assert failed == 0, f"{failed} of {JOINS} joins of an idle, healthy leader failed: {reasons}"


def test_a_follower_that_fell_back_leads_once_the_stopped_leader_is_gone(
    led_by_agent: tuple[Agent, LockManager], manager: LockManager
) -> None:
    leading, following = led_by_agent
    leading.signal(signal.SIGSTOP)
    until(streaming_as(following.watcher, "own"), relay.SILENCE + 20, "falling back to its own")
    leading.signal(signal.SIGKILL)
    leading.process.wait(30)
    # The name is free now: "tries to lead or follow again" (``watcher.RELAY_RETRY``).
    until(
        streaming_as(following.watcher, "leader"),
        2 * watching.RELAY_RETRY + 5,
        "leading once the name was free",
    )
